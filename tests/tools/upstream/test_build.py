"""build_project.sh: ordered steps, pypi-mode source links, NPU gate, idempotence, bad inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import run_script

REPO = Path(__file__).resolve().parents[3]


def _git_tree(path: Path) -> None:
    """A git-mode-looking tree (first commit is not a 'pristine' pypi commit)."""
    path.mkdir(parents=True)
    (path / "setup.py").write_text("from setuptools import setup\nsetup()\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run(["git", "-C", str(path), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(path), "commit", "-qm", "upstream release"], check=True,
                   env={**env, "PATH": "/usr/bin:/bin"})


def _build(*args: str, python: str = sys.executable):
    return run_script("build_project.sh", *args, env={"PYTHON": python, "ASCEND_TOOLKIT_HOME": ""})


def test_dry_run_orders_steps_and_runs_nothing(tmp_path):
    ws = tmp_path / "ws"
    for d in ("vllm", "vllm-ascend", "Megatron-LM", "MindSpeed", "verl"):
        _git_tree(ws / d)
    proc = _build("--dry-run", "--workspace", str(ws))
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    names = [ln.split("]")[1].split(":")[0].strip() for ln in lines]
    assert names == ["requirements", "vllm", "vllm_ascend", "megatron", "mindspeed", "verl", "qwen3_rl"]
    assert "VLLM_TARGET_DEVICE=empty" in lines[1] and f"-e {ws / 'vllm'}" in lines[1]
    assert "requirements.txt" in lines[0]
    assert all("--no-deps" in ln for ln in lines[1:])
    skip = _build("--dry-run", "--skip-npu", "--workspace", str(ws))
    assert "vllm_ascend:   # skipped (--skip-npu)" in skip.stdout


def test_npu_only_step_stops_with_a_clear_message(tmp_path):
    ws = tmp_path / "ws"
    _git_tree(ws / "vllm-ascend")
    proc = _build("--workspace", str(ws), "--only", "vllm_ascend", "--no-requirements", "--no-package")
    assert proc.returncode == 1
    assert "vllm_ascend needs an NPU build environment: CANN environment not sourced" in proc.stderr
    assert "--skip-npu" in proc.stderr


def test_pypi_trees_are_linked_and_rerun_is_a_noop(make_workspace, tmp_path):
    ws = make_workspace("verl", "megatron", "vllm_ascend")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    args = ("--workspace", str(ws), "--only", "verl,megatron", "--no-requirements", "--no-package")
    proc = _build(*args, python=py)
    assert proc.returncode == 0, proc.stderr
    assert "[1/2] megatron: write" in proc.stdout and "[2/2] verl: write" in proc.stdout
    where = subprocess.run(
        [py, "-c", "import importlib.util as u; print(u.find_spec('verl').origin); print(u.find_spec('megatron').submodule_search_locations[0])"],
        text=True, capture_output=True, check=True).stdout.split()
    assert where[0] == str((ws / "verl" / "verl" / "__init__.py").resolve())
    assert where[1] == str((ws / "Megatron-LM" / "megatron").resolve())
    again = _build(*args, python=py)
    assert again.returncode == 0 and again.stdout.count("already linked") == 2, again.stdout
    refused = _build("--workspace", str(ws), "--only", "vllm_ascend", "--dry-run", "--no-requirements", python=py)
    assert refused.returncode == 1
    assert "is a pypi-mode tree" in refused.stderr and "--source git --only vllm_ascend" in refused.stderr


def test_build_bad_inputs(tmp_path):
    proc = _build("--workspace", str(tmp_path / "missing"))
    assert proc.returncode == 1 and "does not exist" in proc.stderr
    (tmp_path / "ws").mkdir()
    proc = _build("--workspace", str(tmp_path / "ws"), "--only", "verl", "--dry-run")
    assert proc.returncode == 1 and "verl: no source tree at" in proc.stderr
    proc = _build("--workspace", str(tmp_path / "ws"), "--only", "nope")
    assert proc.returncode == 1 and "unknown framework nope" in proc.stderr
    proc = _build("--workspace", str(tmp_path / "ws"), "--python", "/nonexistent/python", "--only", "verl")
    assert proc.returncode != 0
