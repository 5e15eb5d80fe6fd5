"""verl's own CPU tests on the pristine and on the patched verl tree: their outcomes must be equal.

verl 0.6.1's PyPI wheel ships its ``tests/`` package beside ``verl/`` (byte-identical to the sdist's ``tests/``),
so the pristine workspace tree (``tests/conftest.py``'s ``pristine_workspace``: the pinned wheel's text sources,
cached under ``~/.cache/qwen3_rl/pristine-<pins hash>/verl``) already holds upstream's tests where they expect to
be. This script

1. clones that tree twice (``git clone --shared``) into a scratch directory;
2. applies the whole verl series, read from ``patches/verl/`` now (``apply_all_patches.sh --only verl``), to one;
3. runs every ``tests/**/*_on_cpu.py`` file (12 at v0.6.1; several start Ray) in both trees at the same time, in
   this interpreter's venv, each run with the tree as working directory and first on ``PYTHONPATH`` and its own
   Ray temp dir (so a Ray cluster of another process on the host is never joined);
4. compares the outcome of every test id (passed / failed / error / skipped) between the two trees.

It fails (exit 1) when the outcomes differ (the differing ids are printed with both outcomes), when a run collects
nothing or passes nothing, or when pytest stops with a usage/internal error. Usage:
``python tests/upstream_own/verl_cpu.py [--keep DIR] [--full] [--record]``.

Each tree's outcomes come from its record while the record's key (``recorded.py``) equals the present one, else
that tree runs: ``recorded/verl.json`` for the pristine tree (key: the tree, this script, the interpreter, the
installed packages) and ``recorded/verl-patched.json`` for the patched one (key: the patched tree, byte for byte,
and the same, plus this recipe's package when a patch names it). ``--full`` runs both trees whatever the records;
``--record`` runs both and writes both records when their outcomes are equal.

Deselected on both trees: the two ``test_legacy_config_on_cpu.py`` comparisons, which read
``tests/trainer/config/legacy_*.yaml``; the wheel and the sdist do not ship those files (only the git tag does), so
the tests fail on both trees with ``FileNotFoundError`` and prove nothing about the patches.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import recorded  # noqa: E402

from qwen3_rl.tools.pins import load_pins  # noqa: E402
from qwen3_rl.tools.upstream.download import fill_pristine  # noqa: E402

DESELECT = (
    "tests/trainer/config/test_legacy_config_on_cpu.py::TestConfigComparison::"
    "test_ppo_megatron_trainer_config_matches_legacy",
    "tests/trainer/config/test_legacy_config_on_cpu.py::TestConfigComparison::test_ppo_trainer_config_matches_legacy",
)
#: A hang guard per run (s): verl 0.9.1's patched run passed 1500 s under a 1-min load of 21 on 2 slow cores.
RUN_TIMEOUT_S = 3000
#: Files of this repository a run depends on (the ``repo`` part of its records' keys).
REPO_INPUTS = ("tests/upstream_own/verl_cpu.py", "tests/upstream_own/recorded.py")


def pristine_verl() -> Path:
    """The pristine verl tree of the pinned wheel (downloaded and unpacked once, in the suite's cache; the main
    run's ``pristine_workspace`` fixture fills the same cache at the same time)."""
    fw = load_pins(REPO / "pins.toml").frameworks["verl"]
    return fill_pristine(REPO / "pins.toml", [fw]) / fw.dir


def make_trees(scratch: Path) -> tuple[Path, Path]:
    """Clone the pristine tree to ``scratch/pristine/verl`` and ``scratch/patched/verl``; patch the latter."""
    src = pristine_verl()
    trees = []
    for name in ("pristine", "patched"):
        dst = scratch / name / "verl"
        subprocess.run(["git", "clone", "-q", "--shared", str(src), str(dst)], check=True)
        trees.append(dst)
    env = {k: v for k, v in os.environ.items() if k != "QWEN3_RL_WORKSPACE"}
    proc = subprocess.run(["bash", str(REPO / "apply_all_patches.sh"), "--only", "verl", "--workspace",
                           str(scratch / "patched")], text=True, capture_output=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"error: the verl series does not apply:\n{proc.stdout}{proc.stderr}")
    applied = subprocess.run(["git", "-C", str(trees[1]), "status", "--porcelain"], text=True,
                             capture_output=True, check=True).stdout.splitlines()
    if not applied:
        raise SystemExit("error: the patched tree equals the pristine one (no verl patch applied)")
    print(f"verl-own: {len(sorted((REPO / 'patches' / 'verl').glob('*.patch')))} verl patches applied, "
          f"{len(applied)} paths changed")
    return trees[0], trees[1]


def test_files(tree: Path) -> list[str]:
    """verl's CPU test files, relative to the tree (sorted)."""
    return sorted(str(p.relative_to(tree)) for p in (tree / "tests").rglob("*_on_cpu.py"))


def start_run(tree: Path, files: list[str], out: Path) -> subprocess.Popen[bytes]:
    """Start pytest on ``files`` inside ``tree``; junit XML to ``out/junit.xml``, log to ``out/pytest.log``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ray").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=str(tree), RAY_TMPDIR=str(out / "ray"), RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tree),
           "--junitxml", str(out / "junit.xml"), "--durations=5", *files]
    cmd += [f"--deselect={d}" for d in DESELECT]
    log = (out / "pytest.log").open("wb")
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)


def outcomes(junit: Path) -> dict[str, str]:
    """Test id (``file::Class::name``) -> passed / failed / error / skipped, from pytest's junit XML. A file that
    fails to import (``--continue-on-collection-errors``) is one ``error`` under its path, without ``::``."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if not classname:  # a collection error: name is the module's dotted path
            test_id = name.replace(".", "/") + ".py"
            result[test_id] = "error"
            continue
        parts = classname.split(".")
        # classname is the dotted module path plus classes; the file is the longest prefix that names a module
        mod_len = next((i for i in range(len(parts), 0, -1) if parts[i - 1].startswith("test_")), len(parts))
        test_id = "::".join(["/".join(parts[:mod_len]) + ".py", *parts[mod_len:], name])
        kinds = {child.tag for child in case}
        outcome = ("error" if "error" in kinds else "failed" if "failure" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        # a test that fails in its call and errors in teardown appears twice: keep the worse outcome
        if result.get(test_id) in (None, "passed"):
            result[test_id] = outcome
    return result


def compare(pristine: dict[str, str], patched: dict[str, str]) -> list[str]:
    """Lines describing every test id whose outcome differs (missing on one side counts); empty if equal."""
    diff = []
    for test_id in sorted(set(pristine) | set(patched)):
        a, b = pristine.get(test_id, "absent"), patched.get(test_id, "absent")
        if a != b:
            diff.append(f"  {test_id}: pristine {a}, patched {b}")
    return diff


def summary(result: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for outcome in result.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "nothing collected"


def judge(tag: str, upstream: str, procs: dict[str, subprocess.Popen], scratch: Path, t0: float,
          timeout_s: float = RUN_TIMEOUT_S, recorded_pristine: dict[str, str] | None = None,
          recorded_patched: dict[str, str] | None = None) -> bool:
    """Wait for the pristine and the patched run (``procs``: name -> pytest process writing
    ``scratch/<name>-run/{pytest.log,junit.xml}``), print each run's summary under ``tag`` and whether their
    outcomes are equal (``t0``: monotonic start, s; ``timeout_s``: per run); False if a run stopped, passed
    nothing, or the outcomes differ. With ``recorded_pristine`` / ``recorded_patched`` (test id -> outcome,
    ``recorded.lookup``) that tree's outcomes are those and ``procs`` does not hold its run."""
    results: dict[str, dict[str, str]] = {}
    for name, rec in (("pristine", recorded_pristine), ("patched", recorded_patched)):
        if rec is None:
            continue
        if name in procs:
            raise ValueError(f"a recorded {name} run and a live one")
        results[name] = rec
        print(f"{tag}: {name} (recorded): {summary(rec)}")
    ok = True
    for name, proc in procs.items():
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            print(f"error: the {name} run did not end within {timeout_s:.0f} s: stopped", file=sys.stderr)
        log = (scratch / f"{name}-run" / "pytest.log").read_text(errors="replace")
        junit = scratch / f"{name}-run" / "junit.xml"
        results[name] = outcomes(junit) if junit.exists() else {}
        print(f"{tag}: {name}: pytest exit {rc}; {summary(results[name])}")
        if rc not in (0, 1) or "passed" not in results[name].values():
            print(f"error: the {name} run stopped (exit {rc}) or passed nothing; its log:\n{log}", file=sys.stderr)
            ok = False
        elif rc == 1:
            failed = [t for t, o in results[name].items() if o != "passed"]
            print(f"{tag}: {name}: not passed: {' '.join(failed)}")
    diff = compare(results["pristine"], results["patched"])
    if diff:
        print(f"error: {upstream}'s own CPU tests differ between the pristine and the patched tree:\n" + "\n".join(diff),
              file=sys.stderr)
        for name in procs:
            print(f"--- {name} log\n" + (scratch / f"{name}-run" / "pytest.log").read_text(errors="replace"))
        ok = False
    print(f"{tag}: {'equal' if ok else 'NOT equal'} outcomes on both trees "
          f"({sum(o == 'passed' for o in results['patched'].values())} passed on the patched tree); "
          f"{time.monotonic() - t0:.0f} s")
    return ok


@contextlib.contextmanager
def scratch_from_argv(argv: list[str] | None, doc: str, prefix: str) -> Iterator[tuple[Path, argparse.Namespace]]:
    """The command line of an own-test script (``--keep DIR``, ``--full``, ``--record``; ``doc``'s first paragraph as
    its description): yields the scratch folder (``DIR`` or a temporary one removed afterwards) and the arguments."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--keep", type=Path, help="scratch directory to use and keep (default: a temporary one)")
    ap.add_argument("--full", action="store_true", help="run both trees, whatever their records say")
    ap.add_argument("--record", action="store_true",
                    help="run both trees and, when their outcomes are equal, write both trees' outcomes as records")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield args.keep or Path(tmp), args


#: The package a patched upstream tree may import (its seam patches call into it): when the patched tree names it,
#: the patched record's key covers its files too.
PACKAGE = "qwen3_rl"


def names_package(tree: Path, package: str = PACKAGE) -> bool:
    """True when a ``.py`` file under ``tree`` (``.git`` and ``__pycache__`` left out) contains ``package``'s name
    (a pristine upstream tree never does: only a patch can put it there)."""
    needle = package.encode()
    return any(needle in f.read_bytes() for f in tree.rglob("*.py")
               if f.is_file() and not recorded.SKIP_PARTS.intersection(f.relative_to(tree).parts))


@dataclass
class Sides:
    """The two trees of an own-test comparison: each tree's record key and its recorded outcomes (None: that tree
    runs now). The pristine key is the tree, the repo files of the run, the interpreter and the packages
    (``recorded.run_key``); the patched key is the same over the patched tree, and over :data:`PACKAGE`'s files too
    when the patched tree names it, so a record matches only a byte-equal patched tree run with the same code."""

    pristine_key: dict
    patched_key: dict
    pristine: dict[str, str] | None
    patched: dict[str, str] | None

    def trees(self, pristine_tree: Path, patched_tree: Path) -> list[tuple[str, Path]]:
        """(name, tree) of the trees that run now (those without a matching record), patched first."""
        return [(n, t) for n, t, rec in (("patched", patched_tree, self.patched),
                                         ("pristine", pristine_tree, self.pristine)) if rec is None]


def record_sides(tag: str, name: str, pristine_tree: Path, patched_tree: Path, repo_inputs: tuple[str, ...],
                 args: argparse.Namespace, repo: Path = REPO, records: Path = recorded.RECORDS) -> Sides:
    """Both trees' keys and recorded outcomes (records ``<name>.json`` and ``<name>-patched.json`` in ``records``;
    ``repo_inputs`` relative to ``repo``), printing under ``tag`` why each tree runs or not; no record is used with
    ``--full`` or ``--record`` (both trees run)."""
    pristine_key = recorded.run_key(pristine_tree, [""], repo, repo_inputs)
    extra = (PACKAGE,) if names_package(patched_tree) else ()
    patched_key = recorded.run_key(patched_tree, [""], repo, (*repo_inputs, *extra))
    found: dict[str, dict[str, str] | None] = {}
    for side, rec_name, key in (("pristine", name, pristine_key), ("patched", f"{name}-patched", patched_key)):
        if args.full or args.record:
            print(f"{tag}: {side} tree runs ({'--full' if args.full else '--record'})")
            found[side] = None
            continue
        found[side], why = recorded.lookup(rec_name, key, records)
        print(f"{tag}: {side} outcomes: {why}; {'not run again' if found[side] is not None else f'the {side} tree runs'}")
    if extra:
        print(f"{tag}: the patched tree names {PACKAGE}: its files are in the patched record's key")
    return Sides(pristine_key, patched_key, found["pristine"], found["patched"])


def record_if_asked(tag: str, name: str, sides: Sides, args: argparse.Namespace, ok: bool, scratch: Path,
                    records: Path = recorded.RECORDS) -> None:
    """With ``--record`` and equal outcomes of a run of both trees, write ``scratch/pristine-run``'s outcomes as
    ``name``'s record and ``scratch/patched-run``'s as ``name-patched``'s (in ``records``), each for its tree's key."""
    if args.record and ok:
        for side, rec_name, key in (("pristine", name, sides.pristine_key),
                                    ("patched", f"{name}-patched", sides.patched_key)):
            path = recorded.write(rec_name, key, outcomes(scratch / f"{side}-run" / "junit.xml"), records)
            print(f"{tag}: recorded the {side} outcomes in {path.name}")


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    with scratch_from_argv(argv, __doc__, "verl-own-") as (scratch, args):
        pristine_tree, patched_tree = make_trees(scratch)
        files = test_files(pristine_tree)
        if not files:
            print(f"error: no tests/**/*_on_cpu.py in {pristine_tree}", file=sys.stderr)
            return 1
        print(f"verl-own: {len(files)} files: {' '.join(files)}")
        sides = record_sides("verl-own", "verl", pristine_tree, patched_tree, REPO_INPUTS, args)
        procs = {name: start_run(tree, files, scratch / f"{name}-run")
                 for name, tree in sides.trees(pristine_tree, patched_tree)}
        ok = judge("verl-own", "verl", procs, scratch, t0, recorded_pristine=sides.pristine,
                   recorded_patched=sides.patched)
        record_if_asked("verl-own", "verl", sides, args, ok, scratch)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
