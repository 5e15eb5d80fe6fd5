"""The CPU profile's set-up pieces that need no engine: the launcher's device detection, the one-line error of
``python -m qwen3_rl cpu-env`` when the set-up is missing, the warm-up's unmarked targets, the ``sum`` problems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from qwen3_rl.tools.cpu_setup import launcher_device
from qwen3_rl.tools.tiny_sft import unmarked

REPO = Path(__file__).resolve().parents[2]


def test_launcher_device() -> None:
    assert launcher_device(["internal/x.sh", "--device", "cpu"]) == "cpu"
    assert launcher_device(["internal/x.sh", "--device=cpu", "--nnodes", "1"]) == "cpu"
    assert launcher_device(["internal/x.sh", "--", "--device", "cpu"]) == "npu"  # a Hydra override, not ours
    assert launcher_device(["internal/x.sh"]) in ("npu", os.environ.get("LAUNCH_DEVICE", "npu"))


def _cpu_env(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QWEN3_RL_WORKSPACE": str(tmp_path / "ws"), "QWEN3_RL_ENGINE_VENV": str(tmp_path / "venv"),
           "PYTHONPATH": str(REPO)}
    env.pop("LAUNCH_DEVICE", None)
    return subprocess.run([sys.executable, "-m", "qwen3_rl", "cpu-env", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=60)


def test_cpu_env_names_the_setup_command(tmp_path: Path) -> None:
    """Nothing set up: one line naming ``bash setup_cpu.sh``, exit 1; not the CPU profile: nothing at all."""
    proc = _cpu_env(tmp_path, "--launcher-args", "internal/train_grpo_tiny_cpu.sh", "--device", "cpu")
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.strip().endswith("run bash setup_cpu.sh")
    assert str(tmp_path / "venv" / "bin" / "python") in proc.stderr  # the first missing part: the engine env
    proc = _cpu_env(tmp_path, "--launcher-args", "internal/train_grpo_tiny_cpu.sh")
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""
    # the launcher's own arguments pass verbatim, Hydra overrides after "--" included
    proc = _cpu_env(tmp_path, "--launcher-args", "internal/train_grpo_tiny_cpu.sh", "--device", "cpu", "--",
                    "data.seed=1")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("run bash setup_cpu.sh"), proc.stderr
    # a dry run still shows the plan: the missing set-up is a one-line warning, and no environment is printed
    proc = _cpu_env(tmp_path, "--launcher-args", "internal/train_grpo_tiny_cpu.sh", "--device", "cpu", "--dry-run")
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("warning: ") and proc.stderr.strip().endswith("run bash setup_cpu.sh")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_launcher_cpu_profile_stops_with_one_line(tmp_path: Path) -> None:
    """``ray_start_npu.sh --device cpu`` without the set-up stops before anything starts, naming the command."""
    env = {**os.environ, "QWEN3_RL_WORKSPACE": str(tmp_path / "ws"), "QWEN3_RL_ENGINE_VENV": str(tmp_path / "venv")}
    proc = subprocess.run(["bash", str(REPO / "ray_start_npu.sh"), "internal/train_grpo_tiny_cpu.sh", "--device",
                           "cpu"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].endswith("run bash setup_cpu.sh"), proc.stderr
    assert "ray start" not in proc.stdout


def test_unmarked_target() -> None:
    assert unmarked("3 + 4 = 7. \\boxed{7}") == "3 + 4 = 7."
    assert unmarked("no marked answer") == "no marked answer"


def test_tiny_data_sum_kind(tmp_path: Path) -> None:
    from qwen3_rl.tools.tiny_data import make_tiny_data

    paths = make_tiny_data(tmp_path, 8, 4, seed=1, kind="sum")
    rows = [json.loads(line) for line in (tmp_path / "raw" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and paths["test"].is_file()
    for r in rows:
        a, rest = r["answer"].split(" + ", 1)
        b, s = rest.split(" = ", 1)
        total = int(a) + int(b)
        assert 1 <= int(a) <= 9 and 1 <= int(b) <= 9
        assert r["answer"] == f"{a} + {b} = {total}. \\boxed{{{total}}}\n#### {total}"


def test_cpu_env_refuses_trees_built_from_other_patches(tmp_path: Path) -> None:
    """Every part present but the patched trees built from other patches (e.g. after a ``git pull``): one line
    naming the set-up command; the same set-up with this checkout's sources digest passes (positive control)."""
    from qwen3_rl.tools import cpu_setup, engine_workspace

    ws = tmp_path / "ws"
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    (ws / "cpu-engine").mkdir(parents=True)
    (ws / "cpu-engine" / engine_workspace.STAMP).write_text("x\n")
    for d in ("qwen3_tiny", "data_sum", "qwen3_moe_tiny", "data"):
        (ws / "tiny" / d).mkdir(parents=True)
        (ws / "tiny" / d / cpu_setup._STAMP).write_text("x\n")
    (ws / "cpu-engine" / engine_workspace.SOURCES).write_text("0" * 64 + "\n")
    proc = _cpu_env(tmp_path, "--launcher-args", "internal/train_grpo_tiny_cpu.sh", "--device", "cpu")
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "other patches" in proc.stderr
    assert proc.stderr.strip().endswith("run bash setup_cpu.sh")
    (ws / "cpu-engine" / engine_workspace.SOURCES).write_text(engine_workspace.sources_digest() + "\n")
    proc = _cpu_env(tmp_path, "--launcher-args", "internal/train_grpo_tiny_cpu.sh", "--device", "cpu")
    assert proc.returncode == 0 and "QWEN3_RL_SHIMS" not in proc.stderr and "PYTHONPATH=" in proc.stdout
