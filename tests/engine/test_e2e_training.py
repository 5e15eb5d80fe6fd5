"""Whole training runs on CPU (marker ``e2e``): ``ray_start_npu.sh --device cpu`` starts Ray on 127.0.0.1 and runs
``internal/train_{grpo,dapo}_tiny_cpu.sh`` as it would on a cluster: verl's trainer, the Megatron actor
(megatron-core 0.12.1 on gloo, TP 2 + EP 2 for GRPO, PP 2 for DAPO), the real vLLM 0.13 CPU engine in verl's sync
SPMD rollout, our math-verify reward, the update, the weight sync, a checkpoint per step, resume.

What is checked, per run: the launcher's exit status; after every weight sync each engine's parameters equal the
actor's exported weights exactly (``qwen3_rl/cpu_device/probe.py``), the export carries the HF checkpoint's names and shapes,
and the last sync differs from the first (the rollout sees the update); ``python -m qwen3_rl report`` parses the
log with two steps; checkpoints ``global_step_1`` and ``global_step_2``. Faults: a worker killed by pid during step 2 stops
the run with an error inside a bound, and the same command then resumes from step 1's checkpoint and finishes
step 2 on the same prompts as an uninterrupted run.

Device-layer shims only (``qwen3_rl/cpu_device/``); ``bash tests/run_tests.sh -m e2e`` runs these tests alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import workspace
from conftest import gloo_port

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUN_TIMEOUT_S = 1500  # one launcher run, start to exit
KILL_EXIT_TIMEOUT_S = 180  # a killed worker must end the run within this (verl 0018: the driver stops at once)

SWITCHES_ON = {"SAM_ENABLE": "True", "SAM_GROUP": "True", "DATA_REBALANCE": "True",
               "USE_CURRENT_LOG_PROB_AS_OLD": "True"}


@dataclass
class Run:
    rc: int
    log: str
    events: list[dict] = field(default_factory=list)
    probe: Path = Path()
    ckpt: Path = Path()
    seconds: float = 0.0

    def of(self, event: str) -> list[dict]:
        return [e for e in self.events if e["event"] == event]


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3-MoE (4 experts, top-2) + 48/16 generated gsm8k-style problems, as the README's commands make."""
    from qwen3_rl.tools.tiny_data import make_tiny_data
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    make_tiny_model(root / "qwen3_moe_tiny", TinySpec(moe=True))
    make_tiny_data(root / "data")
    return root


def _events(probe: Path) -> list[dict]:
    out = []
    for f in sorted(probe.glob("events-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["time"])


def launch(engine_ws: Path, tiny_root: Path, script: str, run_dir: Path, env: dict[str, str] | None = None,
           ckpt: Path | None = None, on_event=None, timeout_s: float = RUN_TIMEOUT_S) -> Run:
    """``bash ray_start_npu.sh <script> --device cpu --npus-per-node 2`` with the engine workspace on PYTHONPATH.

    ``on_event(events, proc)`` is called every second while the run is alive (the fault test kills from it).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / "probe"
    ckpt = ckpt or run_dir / "ckpt"
    venv_bin = str(Path(sys.executable).parent)
    pypath = [str(workspace.CPU_DEVICE), *(str(engine_ws / d) for d in workspace.PATH_TREES), str(REPO),
              str(engine_ws / ".dist-info")]
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VLLM_", "QWEN3_RL_"))}
    full.update({
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}", "QWEN3_RL_PYTHON": sys.executable,
        "PYTHONPATH": ":".join(pypath), "QWEN3_RL_CPU_SHIMS": "1", "QWEN3_RL_ENGINE_WS": str(engine_ws),
        "QWEN3_RL_E2E_PROBE_DIR": str(probe),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "none", "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "MODEL_PATH": str(tiny_root / "qwen3_moe_tiny"), "DATA_DIR": str(tiny_root / "data"),
        "CKPT_DIR": str(ckpt), "ROLLOUT_DATA_DIR": str(run_dir / "rollout_data"),
        "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
    })
    full.update(env or {})
    ray_tmp = tempfile.mkdtemp(prefix="q3r", dir="/tmp")  # Ray's socket paths must stay under 107 characters
    cmd = ["bash", str(REPO / "ray_start_npu.sh"), str(REPO / script), "--device", "cpu", "--npus-per-node", "2",
           "--port", str(gloo_port()), "--temp-dir", ray_tmp, "--log-dir", str(run_dir / "logs"),
           "--timeout", "180"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out_file = run_dir / "launcher.out"
    try:
        with open(out_file, "w") as sink:
            import threading

            pump = threading.Thread(target=lambda: shutil.copyfileobj(proc.stdout, sink), daemon=True)
            pump.start()
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    raise AssertionError(f"{script}: no exit within {timeout_s} s (see {out_file})")
                if on_event is not None:
                    on_event(_events(probe), proc)
                time.sleep(1.0)
            pump.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    log = out_file.read_text(errors="replace")
    return Run(proc.returncode, log, _events(probe), probe, ckpt, time.monotonic() - t0)


def _tail(run: Run, n: int = 80) -> str:
    return "\n".join(run.log.splitlines()[-n:])


def check_weight_sync(run: Run, tiny_root: Path) -> None:
    """Every sync: engine == actor export exactly, on both ranks; the export has the HF checkpoint's names and shapes;
    the last sync differs from the first (the update reached the rollout)."""
    import torch
    from safetensors.torch import load_file

    syncs = run.of("weight_sync")
    assert {e["rank"] for e in syncs} == {0, 1}, f"weight syncs seen on ranks {sorted({e['rank'] for e in syncs})}"
    for e in syncs:
        assert e["all_equal"], f"rank {e['rank']} sync {e['n']}: unequal {e['unequal'][:5]} missing {e['missing'][:5]}"
        assert e["compared"] == e["engine_params"] > 0 and not e["unused"], e
    first, later = load_file(str(run.probe / "sync-1.safetensors")), sorted(run.probe.glob("sync-*.safetensors"))
    assert len(later) >= 2, f"rank 0 synced {len(later)} time(s); two steps need two"
    hf = load_file(str(tiny_root / "qwen3_moe_tiny" / "model.safetensors"))
    assert set(first) == set(hf), f"exported names differ from the HF checkpoint's: {sorted(set(first) ^ set(hf))[:6]}"
    assert all(first[n].shape == hf[n].shape for n in hf)
    last = load_file(str(later[-1]))
    changed = [n for n in first if not torch.equal(first[n], last[n])]
    assert changed, "the last sync sent the initial weights: the update never reached the rollout"


def check_step_log_and_ckpt(run: Run, steps: list[int]) -> dict:
    """``qwen3_rl report --json`` parses the log with exactly ``steps``; checkpoints exist for the last of them."""
    log_files = sorted((run.probe.parent / "logs").glob("train_*_head_*.log"))
    assert log_files, f"no training log under {run.probe.parent / 'logs'}"
    rep = subprocess.run([sys.executable, "-m", "qwen3_rl", "report", str(log_files[0]), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    doc = json.loads(rep.stdout)
    got = sorted(int(s) for s in doc["steps"])
    assert got == steps, f"report found steps {got}, expected {steps}"
    for s in steps:
        assert (run.ckpt / f"global_step_{s}" / "actor").is_dir(), f"no checkpoint global_step_{s}/actor"
    assert (run.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps[-1])
    return doc


def stage_seconds(doc: dict, run: Run) -> dict[str, float]:
    """Per-stage seconds of the last step (verl's timing_s/*) and the mean weight sync (probe)."""
    last = doc["steps"][str(max(int(s) for s in doc["steps"]))]
    keys = {"generate": "timing_s/gen", "reward": "timing_s/reward", "old_log_prob": "timing_s/old_log_prob",
            "update": "timing_s/update_actor", "step": "timing_s/step"}
    out = {k: float(last[v]) for k, v in keys.items() if v in last}
    syncs = [e["seconds"] for e in run.of("weight_sync")]
    out["weight_sync"] = sum(syncs) / len(syncs)
    out["launcher_total"] = run.seconds
    return out


def _prompts_of_step(run_dir: Path, step: int) -> list[str]:
    f = run_dir / "rollout_data" / f"{step}.jsonl"
    assert f.is_file(), f"verl wrote no rollout dump {f}"
    return sorted(json.loads(line)["input"] for line in f.read_text().splitlines() if line.strip())


def test_grpo_switches_on_then_off_with_fault_and_resume(engine_ws: Path, tiny_root: Path, tmp_path: Path) -> None:
    """GRPO, 2 steps, with SAM (group mode), data rebalance and the current log-prob as old. Then the same setup
    with every switch off: a worker is killed during step 2, which must stop the run with an error; the same
    command again resumes from step 1 and finishes step 2 on the first run's step-2 prompts (the prompts a step
    trains on come from the seeded dataloader; the switches only reorder and decode them)."""
    on = launch(engine_ws, tiny_root, "internal/train_grpo_tiny_cpu.sh", tmp_path / "on", env=SWITCHES_ON)
    assert on.rc == 0, _tail(on)
    check_weight_sync(on, tiny_root)
    doc = check_step_log_and_ckpt(on, [1, 2])
    last = doc["steps"]["2"]
    assert last.get("rollout/spec_decode/num_drafts", 0) > 0, "SAM drafted nothing in step 2"
    assert "timing_s/old_log_prob" not in last, "USE_CURRENT_LOG_PROB_AS_OLD=True still ran the old-log-prob pass"
    print("stage seconds (GRPO, switches on):", json.dumps(stage_seconds(doc, on)))

    killed: dict[str, float] = {}

    def kill_in_step_2(events: list[dict], proc: subprocess.Popen) -> None:
        if killed:
            assert time.monotonic() - killed["at"] < KILL_EXIT_TIMEOUT_S, \
                f"the run is still alive {KILL_EXIT_TIMEOUT_S} s after its worker was killed"
            return
        starts = [e for e in events if e["event"] == "generate_start" and e["n"] == 2 and e["rank"] == 1]
        if starts:
            os.kill(starts[0]["pid"], signal.SIGKILL)
            killed.update(at=time.monotonic(), pid=starts[0]["pid"])

    run_dir = tmp_path / "off"
    faulty = launch(engine_ws, tiny_root, "internal/train_grpo_tiny_cpu.sh", run_dir, on_event=kill_in_step_2)
    assert killed, "step 2 never started on rank 1"
    assert faulty.rc != 0, "the run exited 0 although a worker was killed"
    assert "ActorDiedError" in faulty.log or "actor died" in faulty.log.lower(), _tail(faulty)
    check_weight_sync(faulty, tiny_root)
    assert (faulty.ckpt / "global_step_1" / "actor").is_dir() and not (faulty.ckpt / "global_step_2").exists()
    print(f"killed worker pid {killed['pid']}: the launcher exited {faulty.rc}, "
          f"{time.monotonic() - killed['at']:.0f} s after the kill")

    (run_dir / "logs").rename(run_dir / "logs.faulty")
    (run_dir / "probe").rename(run_dir / "probe.faulty")
    resumed = launch(engine_ws, tiny_root, "internal/train_grpo_tiny_cpu.sh", run_dir)
    assert resumed.rc == 0, _tail(resumed)
    assert "global_step_1" in resumed.log, "the rerun did not say it loaded global_step_1"
    doc = check_step_log_and_ckpt(resumed, [2])
    assert all(e["all_equal"] for e in resumed.of("weight_sync")) and resumed.of("weight_sync")
    assert _prompts_of_step(run_dir, 2) == _prompts_of_step(tmp_path / "on", 2), \
        "the resumed step 2 trained on other prompts than the uninterrupted run's step 2"
    print("stage seconds (GRPO, switches off, resumed step 2):", json.dumps(stage_seconds(doc, resumed)))


def test_dapo(engine_ws: Path, tiny_root: Path, tmp_path: Path) -> None:
    """Our DAPO trainer, 2 steps, dynamic sampling and the overlong buffer on."""
    run = launch(engine_ws, tiny_root, "internal/train_dapo_tiny_cpu.sh", tmp_path)
    assert run.rc == 0, _tail(run)
    check_weight_sync(run, tiny_root)
    doc = check_step_log_and_ckpt(run, [1, 2])
    print("stage seconds (dapo):", json.dumps(stage_seconds(doc, run)))

