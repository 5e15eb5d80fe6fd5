"""The CPU profile's set-up pieces that need no engine: the launcher's device detection, the one-line error of
``python -m qwen3_rl cpu-env`` when the set-up is missing, the warm-up's unmarked targets, the ``sum`` problems."""

from __future__ import annotations

import json
import os
import re
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


def test_cpu_env_of_the_current_set(tmp_path: Path) -> None:
    """``PIN_SET=current``: nothing set up names ``PIN_SET=current bash setup_cpu.sh`` (one line); with its parts in
    place (stamps written as cpu-setup writes them) the environment is the current set's: its venv's python, the
    verl 0.9.1 device layer's ``sitecustomize`` folder first on ``PYTHONPATH``, then the patched verl / megatron-core
    trees; the seed set's device layer (``QWEN3_RL_CPU_SHIMS``) off. Control: the same workspace under the seed set
    still misses the seed set's parts."""
    from qwen3_rl.tools import engine_workspace

    venv, ws = tmp_path / "venv091", tmp_path / "ws"
    env = {**os.environ, "QWEN3_RL_WORKSPACE": str(ws), "QWEN3_RL_VERL091_ENGINE_VENV": str(venv),
           "QWEN3_RL_ENGINE_VENV": str(tmp_path / "venv"), "PYTHONPATH": str(REPO), "PIN_SET": "current"}
    env.pop("LAUNCH_DEVICE", None)

    def cpu_env(pin_set: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "qwen3_rl", "cpu-env", "--launcher-args", "x.sh", "--device",
                               "cpu"], capture_output=True, text=True, env={**env, "PIN_SET": pin_set}, cwd=REPO,
                              timeout=60)

    proc = cpu_env("current")
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.strip().endswith("run PIN_SET=current bash setup_cpu.sh"), proc.stderr
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    engine = ws / "cpu-engine-current"
    engine.mkdir(parents=True)
    (engine / engine_workspace.STAMP).write_text("x\n")
    (engine / engine_workspace.SOURCES).write_text(engine_workspace.current_sources_digest() + "\n")
    for d in ("qwen3_tiny", "data_sum"):
        (ws / "tiny" / d).mkdir(parents=True)
        (ws / "tiny" / d / ".qwen3_rl-stamp").write_text("x\n")
    proc = cpu_env("current")
    assert proc.returncode == 0, proc.stderr
    got = dict(kv.split("=", 1) for kv in proc.stdout.split("\0") if kv)
    assert got["QWEN3_RL_PYTHON"] == str(venv / "bin" / "python") and got["QWEN3_RL_VERL091_CPU"] == "1"
    path = got["PYTHONPATH"].split(":")
    assert path[:3] == [str(engine_workspace.CURRENT_SITE), str(engine / "verl"), str(engine / "Megatron-LM")]
    assert (engine_workspace.CURRENT_SITE / "sitecustomize.py").is_file() and "QWEN3_RL_CPU_SHIMS" not in got
    # stale trees (other patches) are refused with the current set's command
    (engine / engine_workspace.SOURCES).write_text("other\n")
    proc = cpu_env("current")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("run PIN_SET=current bash setup_cpu.sh")
    # control: the seed set's profile over the same workspace misses its own parts
    proc = cpu_env("seed")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("run bash setup_cpu.sh"), proc.stderr


def test_launcher_gives_verl091_its_gpu_slots_on_the_current_set_only(tmp_path: Path) -> None:
    """The CPU profile's ``ray start``: with ``PIN_SET=current`` the worker slots are also Ray's ``GPU`` resource (verl
    0.9.1 places its workers on it); on the seed set not (control)."""
    plans = {}
    for pin_set in ("current", "seed"):
        env = {**os.environ, "PIN_SET": pin_set, "QWEN3_RL_WORKSPACE": str(tmp_path / "ws")}
        env.pop("LAUNCH_DEVICE", None)
        proc = subprocess.run(["bash", str(REPO / "ray_start_npu.sh"), "internal/train_grpo_tiny_cpu.sh", "--device",
                               "cpu", "--dry-run"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        assert proc.returncode == 0, proc.stderr
        plans[pin_set] = [line for line in proc.stdout.splitlines() if "ray start --head" in line]
        assert len(plans[pin_set]) == 1, proc.stdout
    npus = re.search(r'"NPU": (\d+)', plans["current"][0]).group(1)  # the slots (no set-up here: the default 16)
    assert f"--num-gpus={npus}" in plans["current"][0].split()
    assert not any(a.startswith("--num-gpus") for a in plans["seed"][0].split())


def test_vllm_cache_per_pin_set(tmp_path: Path, monkeypatch) -> None:
    """Each set's CPU profile has its own vLLM cache root (the two vLLMs' model-info entries share file names); a
    root the user set is kept."""
    from qwen3_rl.tools import engine_workspace as ew

    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seed, current = ew.run_env(tmp_path)["VLLM_CACHE_ROOT"], ew.current_run_env(tmp_path)["VLLM_CACHE_ROOT"]
    assert (seed, current) == (str(tmp_path / "vllm" / "pin-set-seed"), str(tmp_path / "vllm" / "pin-set-current"))
    assert ew.host_env("current") == {**ew.HOST_ENV, "VLLM_CACHE_ROOT": current}  # the engine tests' conftests
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))
    assert "VLLM_CACHE_ROOT" not in ew.run_env(tmp_path) and "VLLM_CACHE_ROOT" not in ew.current_run_env(tmp_path)
