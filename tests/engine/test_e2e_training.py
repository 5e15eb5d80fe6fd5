"""Whole training runs on CPU (marker ``e2e``), driven by the product commands a user types: ``python -m qwen3_rl
cpu-setup`` (what ``bash setup_cpu.sh`` runs once the engine environment exists) makes the patched trees, the tiny
models, the data and the supervised warm-up in a workspace; ``ray_start_npu.sh internal/train_{grpo,dapo}_tiny_cpu.sh
--device cpu`` finds them (its CPU profile) and runs verl's trainer, the Megatron actor (megatron-core 0.12.1 on
gloo, TP 2 for GRPO, PP 2 for DAPO), the real vLLM 0.13 CPU engine in verl's sync SPMD rollout, our math-verify
reward, the update, the weight sync, a checkpoint per step, resume.

What is checked:

* learning: the GRPO run's validation accuracy (verl's ``val-core`` on the test split, greedy) after 6 steps is at
  least 0.10 above the accuracy before the first step;
* weight sync, every sync: each engine's parameters equal the actor's export exactly (``qwen3_rl/cpu_device/
  probe.py``), the export carries the HF checkpoint's names and shapes, the update reaches the rollout; and,
  independently of the actor's exporter, the last step's Megatron checkpoint merged to HF by verl's model merger
  (``python -m qwen3_rl eval merge``) equals what the engine holds after that step's sync (vLLM's fused layout);
* faults: a worker killed by pid during step 2 stops the run with an error inside a bound; the same command then
  resumes from step 1's checkpoint: its first weight sync equals the killed run's step-1 weights bitwise, the
  optimizer state it loads equals the one saved at step 1 tensor by tensor, and it trains step 2 on the same
  prompts as an uninterrupted run;
* switches, each with a positive control: SAM drafts tokens (on) / no draft metrics (off); the old-log-prob pass is
  skipped (on) / timed (off); DAPO's dynamic sampling filters groups (and keeps some) and its overlong penalty
  lowers rewards below the lowest answer score (-1).

The resumed run's rollout runs on vLLM-Ascend's own engine over the NPU stand-in with SAM on (``NPUWorker``, the
vllm_ascend seam's ``SamAscendProposer``): the checkpoint is the actor's, whichever engine it syncs into.

Device-layer shims only (``qwen3_rl/cpu_device/``); ``bash tests/run_tests.sh -m e2e`` runs these tests alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import gloo_port
from helpers.tiny_launch import (  # noqa: F401 (re-exported: the other tiny-run tests import them from here)
    LEARNING_MARGIN,
    RUN_TIMEOUT_S,
    Run,
    _events,
    _tail,
    actor_death_watch,
    check_step_log_and_ckpt,
    engine_venv,
    launch,
    launch_env,
    report,
    val_accuracy,
)

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KILL_EXIT_TIMEOUT_S = 180  # a killed worker must end the run within this (verl 0009: the driver stops at once)
GRPO_STEPS = 6  # internal/train_grpo_tiny_cpu.sh's default

SWITCHES_ON = {"SAM_ENABLE": "True", "SAM_GROUP": "True", "DATA_REBALANCE": "True",
               "USE_CURRENT_LOG_PROB_AS_OLD": "True"}
#: the fault / resume runs: 2 steps, no validation (what they check is the checkpoint, not learning)
SHORT = {"TOTAL_TRAINING_STEPS": "2", "VAL_BEFORE_TRAIN": "False", "TEST_FREQ": "-1"}
#: the rollout on vLLM-Ascend's own engine over the NPU stand-in, SAM on (the resumed run): the device layer's
#: ``sitecustomize`` installs the stand-in in each process when it first imports vLLM (after verl has settled on the
#: CPU device) and selects vLLM-Ascend's platform: ``NPUWorker`` -> ``NPUModelRunner`` -> the Ascend attention backend
#: and ``SamAscendProposer`` (the vllm_ascend seam, 0002) instead of vLLM's CPU runner
ASCEND_ROLLOUT = {"SAM_ENABLE": "True", "SAM_GROUP": "True", "QWEN3_RL_CPU_ROLLOUT": "ascend",
                  # the stand-in's device size: vLLM-Ascend sizes the KV cache from it (ROLLOUT_GPU_MEMORY_UTILIZATION)
                  "QWEN3_RL_NPU_MEMORY_GIB": "1"}


def check_weight_sync(run: Run, model_dir: Path) -> None:
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
    hf = load_file(str(model_dir / "model.safetensors"))
    assert set(first) == set(hf), f"exported names differ from the HF checkpoint's: {sorted(set(first) ^ set(hf))[:6]}"
    assert all(first[n].shape == hf[n].shape for n in hf)
    last = load_file(str(run.probe / f"sync-{len(later)}.safetensors"))
    changed = [n for n in first if not torch.equal(first[n], last[n])]
    assert changed, "the last sync sent the initial weights: the update never reached the rollout"


def stage_seconds(doc: dict, run: Run) -> dict[str, float]:
    """Per-stage seconds of the last step (verl's timing_s/*) and the mean weight sync (probe)."""
    last = doc["steps"][str(max(int(s) for s, m in doc["steps"].items() if "timing_s/step" in m))]
    keys = {"generate": "timing_s/gen", "reward": "timing_s/reward", "old_log_prob": "timing_s/old_log_prob",
            "update": "timing_s/update_actor", "step": "timing_s/step"}
    out = {k: float(last[v]) for k, v in keys.items() if v in last}
    syncs = [e["seconds"] for e in run.of("weight_sync")]
    out["weight_sync"] = sum(syncs) / len(syncs)
    out["launcher_total"] = run.seconds
    return out


def prompts_of_step(run_dir: Path, step: int) -> list[str]:
    f = run_dir / "rollout_data" / f"{step}.jsonl"
    assert f.is_file(), f"verl wrote no rollout dump {f}"
    return sorted(json.loads(line)["input"] for line in f.read_text().splitlines() if line.strip())


def merge_checkpoint(ws: Path, ckpt: Path, step: int, out: Path) -> dict:
    """``python -m qwen3_rl eval merge CKPT --step N --target OUT`` (verl's own model merger) in the CPU profile's
    environment; returns the merged HF tensors."""
    from safetensors.torch import load_file

    env_proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "cpu-env", "--workspace", str(ws)], cwd=REPO,
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "QWEN3_RL_ENGINE_VENV": str(engine_venv())})
    assert env_proc.returncode == 0, env_proc.stderr
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in env_proc.stdout.split("\0") if kv)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gloo_port()))
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "eval", "merge", str(ckpt), "--step", str(step),
                           "--target", str(out)], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    merged: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        merged.update(load_file(str(f)))
    return merged


def check_independent_conversion(ws: Path, run: Run, step: int, sync: int, tmp: Path) -> None:
    """The step's saved Megatron checkpoint merged to HF by verl's model merger, laid out as vLLM fuses it, equals
    the engine's parameters after sync ``sync`` (rank 0), exactly: the actor's exporter is not on this path."""
    import torch
    from safetensors.torch import load_file

    from probe import expected_vllm_params

    merged = merge_checkpoint(ws, run.ckpt, step, tmp / f"merged-{step}")
    engine = load_file(str(run.probe / f"engine-{sync}.safetensors"))
    want = expected_vllm_params(merged)
    assert set(want) == set(engine), f"names differ: {sorted(set(want) ^ set(engine))[:6]}"
    bad = [n for n in engine if want[n].shape != engine[n].shape or not torch.equal(want[n].to(engine[n].dtype),
                                                                                   engine[n])]
    assert not bad, f"merged global_step_{step} differs from the engine after sync {sync}: {bad[:6]}"
    print(f"independent conversion: merged global_step_{step} == engine after sync {sync}, {len(engine)} tensors")


def check_ascend_rollout(run: Run, metrics: dict[str, float], sync_rollout: bool = True) -> None:
    """The run's rollout ran on vLLM-Ascend's engine (:data:`ASCEND_ROLLOUT`): SAM drafted and accepted tokens in the
    step whose ``metrics`` are given; in each rollout worker the probe (``qwen3_rl/cpu_device/probe.py``) saw
    vLLM-Ascend's worker, runner and SAM adapter hold the weights the actor synced (all equal); with the sync rollout
    (the probe wraps its ``generate_sequences``) the stand-in's NPU kernels ran during generation on both ranks."""
    drafted = metrics.get("rollout/spec_decode/draft_tokens", 0)
    accepted = metrics.get("rollout/spec_decode/accepted_tokens", 0)
    print(f"vLLM-Ascend: {drafted} draft tokens, {accepted} accepted ({run.seconds:.0f} s launcher run)")
    assert drafted > 0 and accepted > 0, {k: v for k, v in metrics.items() if "spec_decode" in k}
    syncs = run.of("weight_sync")
    assert {e["rank"] for e in syncs} == {0, 1}
    for e in syncs:
        print(f"rank {e['rank']}: {e['worker']} / {e['runner']} / {e['drafter']}, weights equal: {e['all_equal']}")
        assert (e["worker"], e["runner"], e["drafter"]) == ("NPUWorker", "NPUModelRunner", "SamAscendProposer")
        assert e["all_equal"] and e["compared"] == e["engine_params"] > 0
    if sync_rollout:
        gens = run.of("generate_end")
        assert {e["rank"] for e in gens} == {0, 1}
        for e in gens:
            assert e["npu_calls"] and e["npu_calls"].get("torch_npu.npu_fused_infer_attention_score", 0) > 0, e


def check_resume_state(faulty: Run, resumed: Run, step: int = 1, saved_sync: int = 2, earlier_sync: int = 1,
                       ranks: tuple[int, ...] = (0, 1)) -> None:
    """The resumed run's first weight sync equals the weights of the checkpoint it loaded (step ``step``), which the
    first run sent in its sync ``saved_sync`` (here the killed run's step-2 sync, the weights after update 1),
    bitwise; the optimizer state it loaded equals the one the first run saved at ``step``, tensor by tensor, on each
    of ``ranks``. Positive control: the saved weights differ from the first run's sync ``earlier_sync``."""
    import torch
    from safetensors.torch import load_file

    saved_w = load_file(str(faulty.probe / f"sync-{saved_sync}.safetensors"))
    first = load_file(str(resumed.probe / "sync-1.safetensors"))
    earlier = load_file(str(faulty.probe / f"sync-{earlier_sync}.safetensors"))
    assert set(saved_w) == set(first)
    assert [n for n in first if not torch.equal(first[n], saved_w[n])] == [], \
        f"the resumed run's first sync differs from the first run's step-{step} weights"
    # positive control: the saved weights are not the earlier ones (a reload of the earlier weights fails)
    assert any(not torch.equal(earlier[n], saved_w[n]) for n in earlier), \
        f"sync {saved_sync} sent the same weights as sync {earlier_sync}"
    for rank in ranks:
        saved = torch.load(faulty.probe / f"optim-save-step{step}-rank{rank}.pt")
        loaded = torch.load(resumed.probe / f"optim-load-rank{rank}.pt")
        assert saved and set(saved) == set(loaded), f"rank {rank}: optimizer tensors differ in names"
        assert any(k.endswith(("exp_avg", "exp_avg_sq")) for k in saved), sorted(saved)[:8]
        bad = [k for k in saved if saved[k].shape != loaded[k].shape or not torch.equal(saved[k], loaded[k])]
        assert not bad, f"rank {rank}: loaded optimizer state differs from the saved one: {bad[:6]}"
        print(f"rank {rank}: {len(saved)} optimizer tensors loaded equal to the step-{step} save, "
              f"first sync == saved weights ({len(first)} tensors)")


@pytest.mark.ascend
@pytest.mark.timeout(2400)  # set-up, then three launcher runs
def test_grpo_learns_then_fault_and_resume(cpu_ws: Path, grpo_on_run: Run, tmp_path: Path) -> None:
    """GRPO from the warmed-up model, GRPO_STEPS steps, with SAM (group mode), data rebalance and the current log-prob as
    old: validation accuracy rises by LEARNING_MARGIN; the last checkpoint merged by verl's merger equals the engine.
    Then 2 steps with every switch off: a worker is killed during step 2, which must stop the run with an error;
    the same command again resumes from step 1 (weights and optimizer state restored, checked) and finishes
    step 2 on the first run's step-2 prompts (the prompts a step trains on come from the seeded dataloader; the
    switches only reorder and decode them). The resumed run's rollout is vLLM-Ascend's engine on the NPU stand-in
    with SAM on (:data:`ASCEND_ROLLOUT`, checked by :func:`check_ascend_rollout`): the checkpoint is the actor's,
    whichever engine the run syncs into."""
    model = cpu_ws / "tiny" / "qwen3_tiny"
    on = grpo_on_run  # launched by the fixture (conftest.py): the server-mode test compares its validation dump
    assert on.rc == 0, _tail(on)
    check_weight_sync(on, model)
    doc = check_step_log_and_ckpt(on, list(range(1, GRPO_STEPS + 1)))
    before, after = val_accuracy(doc, 0), val_accuracy(doc, GRPO_STEPS)
    print(f"GRPO val-core accuracy: before {before:.3f}, after {GRPO_STEPS} steps {after:.3f} ({on.seconds:.0f} s)")
    assert after >= before + LEARNING_MARGIN, f"no learning: val accuracy {before:.3f} -> {after:.3f}"
    last = doc["steps"][str(GRPO_STEPS)]
    assert last.get("rollout/spec_decode/num_drafts", 0) > 0, "SAM drafted nothing in the last step"
    assert "timing_s/old_log_prob" not in last, "USE_CURRENT_LOG_PROB_AS_OLD=True still ran the old-log-prob pass"
    # the last sync (the final validation's, after the last update) holds the last checkpoint's weights
    check_independent_conversion(cpu_ws, on, GRPO_STEPS, len(on.of("weight_sync")) // 2, tmp_path)
    assert "[ray_start_npu] plots:" in on.log, _tail(on)
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
    faulty = launch(cpu_ws, "internal/train_grpo_tiny_cpu.sh", run_dir, env=SHORT, on_event=kill_in_step_2)
    assert killed, "step 2 never started on rank 1"
    assert faulty.rc != 0, "the run exited 0 although a worker was killed"
    # verl's own error, or the launcher's actor-death watch (qwen3_rl.tools.launch.ray_actors) naming the killed
    # worker by its pid, whichever stops the run first (the watch won in a clean-clone CI run)
    watch = actor_death_watch(killed["pid"]).search(faulty.log)
    assert "ActorDiedError" in faulty.log or "actor died" in faulty.log.lower() or watch, _tail(faulty)
    check_weight_sync(faulty, model)
    assert (faulty.ckpt / "global_step_1" / "actor").is_dir() and not (faulty.ckpt / "global_step_2").exists()
    # positive control of the switches-on run's skip: with USE_CURRENT_LOG_PROB_AS_OLD off the pass is timed
    step1 = report(faulty)["steps"]["1"]
    assert step1.get("timing_s/old_log_prob", 0) > 0, "switch off, yet no old-log-prob pass was timed"
    assert step1.get("rollout/spec_decode/num_drafts", 0) == 0, "SAM off, yet drafts were counted"
    print(f"killed worker pid {killed['pid']}: the launcher exited {faulty.rc}, "
          f"{time.monotonic() - killed['at']:.0f} s after the kill")

    (run_dir / "logs").rename(run_dir / "logs.faulty")
    (run_dir / "probe").rename(run_dir / "probe.faulty")
    faulty.probe = run_dir / "probe.faulty"
    resumed = launch(cpu_ws, "internal/train_grpo_tiny_cpu.sh", run_dir, env={**SHORT, **ASCEND_ROLLOUT})
    assert resumed.rc == 0, _tail(resumed)
    assert "global_step_1" in resumed.log, "the rerun did not say it loaded global_step_1"
    doc = check_step_log_and_ckpt(resumed, [2])  # positive control of "no global_step_2" above: now it exists
    assert all(e["all_equal"] for e in resumed.of("weight_sync")) and resumed.of("weight_sync")
    check_resume_state(faulty, resumed)
    check_ascend_rollout(resumed, doc["steps"]["2"])
    assert prompts_of_step(run_dir, 2) == prompts_of_step(on.probe.parent, 2), \
        "the resumed step 2 trained on other prompts than the uninterrupted run's step 2"
    print("stage seconds (GRPO, resumed step 2 on vLLM-Ascend, SAM on):", json.dumps(stage_seconds(doc, resumed)))


@pytest.mark.timeout(1500)
def test_dapo(cpu_ws: Path, tmp_path: Path) -> None:
    """Our DAPO trainer, 2 steps, dynamic sampling and the overlong buffer on: groups are filtered out (count > 0)
    and the overlong penalty lowers the reward of responses that run into the buffer (a sequence reward below the
    lowest answer score)."""
    run = launch(cpu_ws, "internal/train_dapo_tiny_cpu.sh", tmp_path)
    assert run.rc == 0, _tail(run)
    check_weight_sync(run, cpu_ws / "tiny" / "qwen3_moe_tiny")
    doc = check_step_log_and_ckpt(run, [1, 2])
    for s in ("1", "2"):
        m = doc["steps"][s]
        filtered = m["dapo/generated_groups"] * (1.0 - m["dapo/kept_group_ratio"])
        assert filtered > 0, f"step {s}: dynamic sampling filtered no group ({m['dapo/generated_groups']} generated)"
        # positive control: groups were kept too (the step trained on something)
        assert m["dapo/kept_group_ratio"] > 0
    # DAPO's answer scores are +1 / -1 (custom_reward_function.reward_kwargs in qwen3_rl/trainer/config/
    # dapo_megatron_trainer.yaml); only verl's overlong penalty (between -OVERLONG_PENALTY_FACTOR = -1 and 0) can take
    # a sequence reward below -1
    mins = [doc["steps"][s]["critic/score/min"] for s in ("1", "2")]
    assert min(mins) < -1.0, f"no sequence reward below -1 (min per step {mins}): the overlong penalty was not applied"
    assert min(mins) >= -2.0 - 1e-6, mins
    filtered = [doc["steps"][s]["dapo/generated_groups"] * (1 - doc["steps"][s]["dapo/kept_group_ratio"])
                for s in ("1", "2")]
    print(f"dapo: filtered groups per step {filtered}, min sequence reward per step {mins}")
    print("stage seconds (dapo):", json.dumps(stage_seconds(doc, run)))
