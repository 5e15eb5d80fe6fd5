"""Preflight, current pin set: MindSpeed's adaptor imports the way verl 0.9.1 imports it, or one ``[mindspeed]`` line
naming the missing module (verl itself swallows the ImportError and trains without MindSpeed,
``verl/workers/engine/mindspeed/transformer_impl.py:18-21``).

The check (``qwen3_rl.tools.launch.mindspeed_check``, run by :func:`preflight.check_mindspeed` in a fresh process)
runs here in the verl 0.9.1 venv with the pinned MindSpeed core_r0.16.0 tree (verified archive, current series
applied) and the NPU stand-ins of ``tests/helpers/verl091_mindspeed_driver.py`` (``check`` mode). Positive control:
with transformers' alias modules out of the way (as in the MindSpeed engine test) the adaptor imports, no finding.
Negative: as the venv is (no torchvision), one error line naming torchvision.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qwen3_rl.tools.launch import preflight

from conftest import REPO
from helpers.current_set import MINDSPEED, apply, series
from helpers.current_verl import PYTHON, pristine_verl
from helpers.mindspeed_tree import pinned_mindspeed_workspace

DRIVER = REPO / "tests" / "helpers" / "verl091_mindspeed_driver.py"
PATH = [REPO / "tests" / "helpers" / "grouped_gemm_cpu", REPO / "qwen3_rl" / "cpu_device", REPO]


@pytest.fixture(scope="module")
def venv_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of the check's process: the verl 0.9.1 tree, the pinned MindSpeed tree, the stand-ins."""
    ws = pinned_mindspeed_workspace(tmp_path_factory.mktemp("ms16"), MINDSPEED)
    tree = ws / MINDSPEED.dir
    apply(tree, series("mindspeed"))
    path = [pristine_verl(), tree, *PATH]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("RAY_")}
    return {**env, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}


def _check(env: dict[str, str], mode: str) -> list[preflight.Finding]:
    return preflight.check_mindspeed(env, cmd=[str(PYTHON), str(DRIVER), "check", mode], timeout_s=600)


def test_adaptor_importable_no_finding(venv_env: dict[str, str]) -> None:
    findings = _check(venv_env, "present")
    print(f"\nMindSpeed importable: {[f.line() for f in findings]}")
    assert findings == []


def test_torchvision_missing_one_line_naming_it(venv_env: dict[str, str]) -> None:
    findings = _check(venv_env, "as-is")
    lines = [f.line() for f in findings]
    print(f"\nwithout torchvision: {lines}")
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith(
        "error: [mindspeed] missing module 'torchvision': importing mindspeed.megatron_adaptor"
    )
    assert "transformer_impl.py:18-21" in lines[0], lines[0]


def test_finding_from_probe_results() -> None:
    """The probe's JSON -> finding: ok none; a failure without a module name still one line; a broken check one line."""
    assert preflight.mindspeed_finding({"ok": True, "error": None, "missing": None}) == []
    (f,) = preflight.mindspeed_finding({"ok": False, "error": "AssertionError: x", "missing": None})
    assert (
        f.line().startswith("error: [mindspeed] importing mindspeed.megatron_adaptor")
        and "AssertionError" in f.line()
    )
    (f,) = preflight.check_mindspeed(dict(os.environ), cmd=["false"], timeout_s=30)
    assert f.line().startswith("error: [mindspeed] the MindSpeed import check failed (exit 1)"), f.line()


def test_preflight_runs_it_on_the_current_set_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """run_preflight's node checks call it with PIN_SET=current, not with the seed set (positive control)."""
    calls: list[str] = []
    monkeypatch.setattr(preflight, "check_mindspeed", lambda env: calls.append(env.get("PIN_SET", "")) or [])
    for name in ("check_npus", "check_cann", "check_patches"):
        monkeypatch.setattr(preflight, name, lambda *a, **k: [])
    script = str(REPO / "internal" / "train_grpo_tiny_cpu.sh")
    for pin_set in ("seed", "current"):
        env = {**os.environ, "PIN_SET": pin_set, "MODEL_PATH": str(tmp_path)}
        preflight.run_preflight(script, env=env, npu_env=None)
    assert calls == ["current"], calls
