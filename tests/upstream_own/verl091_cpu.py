"""verl 0.9.1's own CPU tests (the current set) on the pristine and on the patched verl tree: outcomes must be equal.

verl 0.9.1's PyPI wheel ships its ``tests/`` beside ``verl/``, so the pristine tree (``tests/helpers/current_verl.py``:
the wheel's text files, cached) holds upstream's tests where they expect to be. Run with the verl 0.9.1 venv's Python
(``tests/setup_verl091_env.sh``): ``$QWEN3_RL_VERL091_VENV/bin/python tests/upstream_own/verl091_cpu.py [--keep DIR]
[--full] [--record]``. Like ``verl_cpu.py`` (whose run, judge and record code it uses) it

1. clones the pristine tree twice into a scratch directory and applies ``patches/current/verl/`` to one;
2. runs every ``tests/**/*_on_cpu.py`` file (30 at v0.9.1; several start Ray) in each tree whose record
   (``recorded/verl091.json``, ``recorded/verl091-patched.json``; ``recorded.py``) misses, both at the same time;
3. fails (exit 1) when the outcome of a test id differs, when a run collects or passes nothing, or when pytest stops
   with a usage/internal error.

Nothing is deselected (``verl_cpu.DESELECT`` names 0.6.1 ids that 0.9.1 does not have).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE), str(REPO / "tests")]

from verl_cpu import judge, record_if_asked, record_sides, scratch_from_argv, start_run, test_files  # noqa: E402

from helpers.current_verl import clone, patched_verl, pristine_verl, series  # noqa: E402

NAME = "verl091"
#: Files of this repository a run depends on (the ``repo`` part of its records' keys).
REPO_INPUTS = ("tests/upstream_own/verl091_cpu.py", "tests/upstream_own/verl_cpu.py", "tests/upstream_own/recorded.py",
               "tests/helpers/current_verl.py")


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    # a short prefix: Ray's socket paths under <scratch>/pristine-run/ray must stay within AF_UNIX's 107 bytes
    with scratch_from_argv(argv, __doc__, "v091-") as (scratch, args):
        pristine_tree = clone(pristine_verl(), scratch / "pristine" / "verl")
        patched_tree = patched_verl(scratch / "patched")
        print(f"{NAME}-own: {len(series())} patches of patches/current/verl applied")
        files = test_files(pristine_tree)
        if not files:
            print(f"error: no tests/**/*_on_cpu.py in {pristine_tree}", file=sys.stderr)
            return 1
        print(f"{NAME}-own: {len(files)} files: {' '.join(files)}")
        sides = record_sides(f"{NAME}-own", NAME, pristine_tree, patched_tree, REPO_INPUTS, args)
        procs = {name: start_run(tree, files, scratch / f"{name}-run")
                 for name, tree in sides.trees(pristine_tree, patched_tree)}
        ok = judge(f"{NAME}-own", "verl 0.9.1", procs, scratch, t0, recorded_pristine=sides.pristine,
                   recorded_patched=sides.patched)
        record_if_asked(f"{NAME}-own", NAME, sides, args, ok, scratch)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
