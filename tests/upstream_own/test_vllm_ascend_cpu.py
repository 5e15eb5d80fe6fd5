"""The logic of tests/upstream_own/vllm_ascend_cpu.py without the engine venv: the pinned sdist, the plugin names,
collection errors read from real pytest junit XML, and the positive control's edit and verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_module

ascend_cpu = load_module(REPO / "tests" / "upstream_own" / "vllm_ascend_cpu.py", "upstream_own_vllm_ascend_cpu")

#: vLLM-Ascend 0.13.0's sdist's vllm_ascend.egg-info/entry_points.txt (its setup.py's entry_points)
ENTRY_POINTS = """[vllm.general_plugins]
ascend_kv_connector = vllm_ascend:register_connector
ascend_model_loader = vllm_ascend:register_model_loader
ascend_service_profiling = vllm_ascend:register_service_profiling

[vllm.platform_plugins]
ascend = vllm_ascend:register

[console_scripts]
other = x:y
"""


def test_cached_sdist_with_another_sha256_is_refused_and_deleted(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN3_RL_CACHE", str(tmp_path))
    cached = tmp_path / "sdists" / ascend_cpu.SDIST_URL.rsplit("/", 1)[1]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not the vLLM-Ascend 0.13.0 sdist")
    with pytest.raises(SystemExit, match=ascend_cpu.SDIST_SHA256):
        ascend_cpu.sdist()
    assert not cached.exists()


def test_plugins_are_the_egg_infos_vllm_entry_points_only(tmp_path: Path) -> None:
    (tmp_path / "entry_points.txt").write_text(ENTRY_POINTS)
    assert ascend_cpu.plugin_names(tmp_path) == ["ascend", "ascend_kv_connector", "ascend_model_loader",
                                                 "ascend_service_profiling"]
    (tmp_path / "entry_points.txt").write_text("[console_scripts]\nother = x:y\n")
    with pytest.raises(SystemExit, match="no vLLM plugin entry points"):
        ascend_cpu.plugin_names(tmp_path)


def _junit(tmp_path: Path, broken: bool) -> Path:
    tree = tmp_path / ("broken" if broken else "clean")
    (tree / "tests" / "ut").mkdir(parents=True)
    (tree / "tests" / "ut" / "test_ok.py").write_text("def test_ok():\n    pass\n")
    if broken:
        (tree / "tests" / "ut" / "test_broken.py").write_text("import not_a_module_anywhere\n")
    out = tree / "junit.xml"
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir",
                    str(tree), "--junitxml", str(out), "--continue-on-collection-errors", "tests/ut"], cwd=tree,
                   capture_output=True, check=False, timeout=120, env=env)
    return out


def test_a_file_failing_to_import_on_both_trees_fails_the_run_unless_listed(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    broken = ascend_cpu.outcomes(_junit(tmp_path, broken=True))
    clean = ascend_cpu.outcomes(_junit(tmp_path, broken=False))
    assert broken == {"tests/ut/test_ok.py::test_ok": "passed", "tests/ut/test_broken.py": "error"}
    assert ascend_cpu.unlisted_collection_errors(broken, dict(broken)) == ["tests/ut/test_broken.py"]
    # on one tree only: not this check's business, the comparison names it
    assert ascend_cpu.unlisted_collection_errors(broken, clean) == []
    assert ascend_cpu.compare(clean, broken) == ["  tests/ut/test_broken.py: pristine absent, patched error"]
    monkeypatch.setitem(ascend_cpu.CANNOT_RUN, "tests/ut/test_broken.py", "a reason")
    assert ascend_cpu.unlisted_collection_errors(broken, dict(broken)) == []


def test_every_left_out_file_has_a_reason() -> None:
    assert ascend_cpu.CANNOT_RUN
    for path, reason in ascend_cpu.CANNOT_RUN.items():
        assert path.startswith("tests/ut/") and path.endswith(".py") and len(reason) > 40, path


def test_the_controls_edit_target_is_a_line_the_seam_patch_adds(tmp_path: Path) -> None:
    """The control edits a line of the series (so it checks that the comparison sees our code), once; it stops
    when the line is gone."""
    old, new = ascend_cpu.CONTROL_EDIT
    added = [line[1:] for p in sorted((REPO / "patches" / "vllm_ascend").glob("*.patch"))
             for line in p.read_text().splitlines()
             if line.startswith("+") and not line.startswith("+++") and old in line]
    assert len(added) == 1, added
    f = tmp_path / ascend_cpu.CONTROL_PATH
    f.parent.mkdir(parents=True)
    f.write_text(f"before\n{added[0]}\nafter\n")
    ascend_cpu.control_edit(tmp_path)
    assert f.read_text() == f"before\n{added[0].replace(old, new)}\nafter\n"
    with pytest.raises(SystemExit, match="positive control"):
        ascend_cpu.control_edit(tmp_path)


def test_the_control_shows_only_when_its_test_flips_from_passed_to_failed() -> None:
    t, other = ascend_cpu.CONTROL_TEST, f"{ascend_cpu.CONTROL_FILE}::test_generate_policy[0-RandomLoadBalance]"
    pristine = {t: "passed", other: "passed", "tests/ut/test_x.py::test_y": "passed"}
    assert ascend_cpu.control_shows(pristine, {t: "failed", other: "passed"}) == [
        f"  {t}: pristine passed, control failed"]
    assert ascend_cpu.control_shows(pristine, {t: "passed", other: "passed"}) == []
    assert ascend_cpu.control_shows(pristine, {t: "error", other: "passed"}) == []
    assert ascend_cpu.control_shows(pristine, {other: "passed"}) == []


def test_run_env_loads_vllm_ascends_plugins_only_with_the_tree_first(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "vllm_ascend.egg-info").mkdir()
    (tmp_path / "vllm_ascend.egg-info" / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.setenv("VLLM_PLUGINS", "qwen3_rl")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    env = ascend_cpu.run_env(tmp_path, tmp_path / "out")
    assert env["VLLM_PLUGINS"] == "ascend,ascend_kv_connector,ascend_model_loader,ascend_service_profiling"
    assert "VLLM_LOGGING_LEVEL" not in env and env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), str(ascend_cpu.SITE), str(REPO)]


def test_every_process_of_a_run_starts_with_the_stand_in(tmp_path: Path) -> None:
    """The run's sitecustomize installs the torch_npu stand-in before any user code (a subprocess vLLM starts
    imports vLLM-Ascend, which imports torch_npu)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ascend_cpu.SITE), str(REPO)])}
    code = ("import sys; assert 'torch_npu' in sys.modules; import torch, torch_npu; "
            "print(torch.npu.is_available(), torch_npu.npu is torch.npu)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], proc.stdout + proc.stderr
