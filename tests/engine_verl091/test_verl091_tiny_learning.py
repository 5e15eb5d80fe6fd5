"""The main job on the current pin set, driven by the product commands a user types: ``python -m qwen3_rl cpu-setup
--pin-set current`` (what ``PIN_SET=current bash setup_cpu.sh`` runs once its environment exists: the current set's
patched trees, the tiny model, the data, the supervised warm-up), then ``PIN_SET=current bash ray_start_npu.sh
internal/train_grpo_tiny_cpu.sh --device cpu``: verl 0.9.1's V1 trainer (``verl.trainer.main_ppo``), the Megatron actor
through verl's engine and mbridge (megatron-core 0.16.1 on gloo, TP 2), vLLM 0.23's CPU engine behind verl's own vLLM
servers (the recipe's keyed server class), the recipe's math-verify reward, the update, the weight sync, a checkpoint
per step, validation before the first step and after the last.

What is checked:

* learning: validation accuracy (verl's ``val-core`` on the test split, greedy) after 6 steps is at least 0.10 above
  the accuracy before the first step;
* weight sync, every sync: each server's parameters (vLLM's fused layout) equal the actor's export exactly
  (``qwen3_rl/cpu_device/probe_verl091.py`` saves both ends); the export carries the HF checkpoint's names and
  shapes; the last sync differs from the first (the update reached the rollout);
* SAM group drafting in verl's servers (``SAM_ENABLE=True SAM_GROUP=True``): every step's metrics carry the servers'
  drafted and accepted token counts (``rollout/spec_decode/*``, trainer mode ``qwen3_rl_sync``); verl's plain server
  counting nothing is the control in ``test_verl091_vllm_server.py``;
* the run's log, step by step (``python -m qwen3_rl report --json``), the last two checkpoints, the launcher's plots;
* resume: the same command with one more step (``TOTAL_TRAINING_STEPS=7``) on a copy of that run's checkpoint
  directory loads ``global_step_6`` (verl's ``trainer.resume_mode=auto``), each rank's model parameters and
  optimizer tensors after the load equal those of the step-6 save, tensor by tensor (the probe saves both), and it
  trains step 7 only. The cheap positive control of the device-layer shim it needs (``FUSED_ADAM``) is in
  ``tests/engine_verl091/test_verl091_fused_adam.py``.

Runs in the venv of ``tests/setup_verl091_engine_env.sh``; device layer only (``qwen3_rl/cpu_device/verl091_site``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from helpers.tiny_launch import LEARNING_MARGIN, Run, _tail, check_step_log_and_ckpt, launch, val_accuracy

REPO = Path(__file__).resolve().parents[2]
GRPO_STEPS = 6  # internal/train_grpo_tiny_cpu.sh's default
CURRENT = {"PIN_SET": "current", "QWEN3_RL_VERL091_ENGINE_VENV": sys.prefix}
#: SAM group drafting in verl's servers, its counters into the trainer's step metrics (trainer mode qwen3_rl_sync)
SWITCHES_ON = {"SAM_ENABLE": "True", "SAM_GROUP": "True"}


def expected_vllm(hf: dict) -> dict:
    """vLLM 0.23's Qwen3 parameter name -> tensor from HF-named full tensors: ``q/k/v_proj`` -> ``qkv_proj``,
    ``gate/up_proj`` -> ``gate_up_proj`` (concatenated along dim 0, in that order; vLLM's ``Qwen3ForCausalLM``
    ``stacked_params_mapping``); every other name kept."""
    import torch

    out, fused = {}, {}
    for name, t in hf.items():
        for parts, target in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            hit = next((p for p in parts if f".{p}." in name), None)
            if hit:
                fused.setdefault(name.replace(f".{hit}.", f".{target}."), {})[parts.index(hit)] = t
                break
        else:
            out[name] = t
    for name, pieces in fused.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
    return out


def check_weight_sync(run: Run, model_dir: Path) -> int:
    """Every sync of every server: engine == expected(actor export) exactly; returns the number of syncs."""
    import torch
    from safetensors.torch import load_file

    actor = run.of("actor_sync")
    engine = run.of("engine_sync")
    assert {e["rank"] for e in actor} == {0, 1}, f"actor syncs seen on ranks {sorted({e['rank'] for e in actor})}"
    n = max(e["n"] for e in actor)
    replicas = sorted({e["replica"] for e in engine})
    assert replicas == [0, 1], f"engine syncs seen on replicas {replicas} (2 servers expected)"
    assert all(max(e["n"] for e in engine if e["replica"] == r) == n for r in replicas), \
        f"actor synced {n} times; servers {[max(e['n'] for e in engine if e['replica'] == r) for r in replicas]}"
    hf = load_file(str(model_dir / "model.safetensors"))
    for k in range(1, n + 1):
        export = load_file(str(run.probe / f"sync-{k}.safetensors"))
        if k == 1:
            assert set(export) == set(hf), f"export names differ from the HF checkpoint's: {sorted(set(export) ^ set(hf))}"
            assert all(export[x].shape == hf[x].shape for x in hf)
        want = expected_vllm(export)
        for r in replicas:
            got = load_file(str(run.probe / f"engine-r{r}-{k}.safetensors"))
            assert set(got) == set(want), f"sync {k} server {r}: names differ {sorted(set(got) ^ set(want))[:6]}"
            bad = [x for x in got if not torch.equal(got[x], want[x].to(got[x].dtype))]
            assert not bad, f"sync {k} server {r}: {len(bad)} of {len(got)} tensors differ from the export: {bad[:6]}"
    first = load_file(str(run.probe / "sync-1.safetensors"))
    last = load_file(str(run.probe / f"sync-{n}.safetensors"))
    assert any(not torch.equal(first[x], last[x]) for x in first), "the last sync sent the first sync's weights"
    print(f"weight sync: {n} syncs x 2 servers, each server's {len(got)} vLLM tensors == the actor's "
          f"{len(export)} exported HF tensors")
    return n


@pytest.fixture(scope="module")
def grpo_run(current_ws: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``PIN_SET=current SAM_ENABLE=True SAM_GROUP=True bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device
    cpu`` from the warmed-up model, once for the learning and the resume test (its probe and checkpoint dirs)."""
    return launch(current_ws, "internal/train_grpo_tiny_cpu.sh", tmp_path_factory.mktemp("grpo-current"),
                  env={**CURRENT, **SWITCHES_ON})


@pytest.mark.timeout(2400)
def test_grpo_tiny_learns_on_the_current_set(current_ws: Path, grpo_run: Run) -> None:
    """The run of ``grpo_run``: validation accuracy rises by LEARNING_MARGIN, every weight sync exact, SAM drafts
    and is accepted in every step, 6 steps logged, checkpoints kept."""
    run = grpo_run
    assert run.rc == 0, _tail(run)
    assert "pin set current" in run.log and "KeyedvLLMHttpServer" in run.log, _tail(run)
    check_weight_sync(run, current_ws / "tiny" / "qwen3_tiny")
    doc = check_step_log_and_ckpt(run, list(range(1, GRPO_STEPS + 1)))
    before, after = val_accuracy(doc, 0), val_accuracy(doc, GRPO_STEPS)
    print(f"current set GRPO val-core accuracy: before {before:.3f}, after {GRPO_STEPS} steps {after:.3f} "
          f"(launcher {run.seconds:.0f} s)")
    assert after >= before + LEARNING_MARGIN, f"no learning: val accuracy {before:.3f} -> {after:.3f}"
    assert "[ray_start_npu] plots:" in run.log, _tail(run)
    # SAM drafted in the servers in every step and the trainer logged it (the servers' counters, step by step);
    # under sampling, with vllm023_shims' CPU_EXPAND_KERNEL_DTYPE (tests/engine_current/test_current_spec_sampling.py)
    drafted = {s: doc["steps"][str(s)].get("rollout/spec_decode/draft_tokens", 0) for s in range(1, GRPO_STEPS + 1)}
    accepted = {s: doc["steps"][str(s)].get("rollout/spec_decode/accepted_tokens", 0) for s in drafted}
    assert all(v > 0 for v in drafted.values()), f"steps without drafts: {drafted}"
    assert all(v > 0 for v in accepted.values()), f"steps without accepted draft tokens: {accepted}"
    print(f"SAM in the servers: drafted per step {list(drafted.values())}, accepted {list(accepted.values())}")


def check_restored_state(saved_run: Run, resumed: Run, step: int, ranks: tuple[int, ...] = (0, 1),
                         before: int | None = None) -> int:
    """Each rank's model parameters and optimizer tensors right after the resumed run's ``load_checkpoint`` equal
    those right after the first run's save of ``step`` (``probe_verl091.actor_state``), tensor by tensor; returns the
    number of tensors compared. Positive control: the step-``step`` save differs from the step-``before`` save
    (default ``step - 1``)."""
    import torch

    before = step - 1 if before is None else before
    total = 0
    for rank in ranks:
        saved = torch.load(saved_run.probe / f"state-save-step{step}-rank{rank}.pt")
        earlier = torch.load(saved_run.probe / f"state-save-step{before}-rank{rank}.pt")
        loaded = torch.load(resumed.probe / f"state-load-rank{rank}.pt")
        assert saved and set(saved) == set(loaded), f"rank {rank}: names differ {sorted(set(saved) ^ set(loaded))[:6]}"
        assert any(k.startswith("model0/") for k in saved), sorted(saved)[:8]
        for kind in ("exp_avg", "exp_avg_sq", "param", "step"):
            assert any(k.endswith(f"/{kind}") for k in saved), f"rank {rank}: no {kind} in {sorted(saved)[:8]}"
        bad = [k for k in saved if saved[k].dtype != loaded[k].dtype or not torch.equal(saved[k], loaded[k])]
        assert not bad, f"rank {rank}: {len(bad)} of {len(saved)} loaded tensors differ from the step-{step} save: " \
            f"{bad[:6]}"
        moved = [k for k in saved if k.startswith("model0/") and not torch.equal(saved[k], earlier[k])]
        assert moved, f"rank {rank}: the step-{step} save holds the step-{before} weights"
        steps = {float(saved[k]) for k in saved if k.endswith("/step")}
        n_model = sum(k.startswith("model") for k in saved)
        print(f"rank {rank}: {len(saved)} tensors loaded equal to the step-{step} save ({n_model} model, "
              f"{len(saved) - n_model} optimizer; optimizer step count {sorted(steps)}); {len(moved)} weights moved "
              f"since step {before}")
        total += len(saved)
    return total


def optimizer_steps(run: Run, step: int) -> set[float]:
    """The optimizer's step counts (every group, ranks 0 and 1) in ``run``'s save of ``step``."""
    import torch

    out: set[float] = set()
    for rank in (0, 1):
        state = torch.load(run.probe / f"state-save-step{step}-rank{rank}.pt")
        out |= {float(v) for k, v in state.items() if k.endswith("/step")}
    return out


@pytest.mark.timeout(2400)
def test_grpo_tiny_resumes_on_the_current_set(current_ws: Path, grpo_run: Run, tmp_path: Path) -> None:
    """The same command with ``TOTAL_TRAINING_STEPS=7`` on a copy of ``grpo_run``'s checkpoints: verl resumes from
    global_step_6 (``trainer.resume_mode=auto``), the restored weights and optimizer state equal the saved ones, and
    the run trains step 7 only (no validation before it: ``trainer.val_before_train=False``)."""
    assert grpo_run.rc == 0, _tail(grpo_run)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(grpo_run.ckpt, ckpt)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(GRPO_STEPS)
    resumed = launch(current_ws, "internal/train_grpo_tiny_cpu.sh", tmp_path / "resume", ckpt=ckpt,
                     env={**CURRENT, **SWITCHES_ON, "TOTAL_TRAINING_STEPS": str(GRPO_STEPS + 1)},
                     args=["trainer.val_before_train=False"])
    assert resumed.rc == 0, _tail(resumed)
    loads = resumed.of("checkpoint_load")
    assert {e["rank"] for e in loads} == {0, 1}, loads
    assert all(Path(e["path"]).name == "actor" and Path(e["path"]).parent.name == f"global_step_{GRPO_STEPS}"
               for e in loads), loads
    n = check_restored_state(grpo_run, resumed, GRPO_STEPS)
    check_step_log_and_ckpt(resumed, [GRPO_STEPS + 1])
    saves = sorted({e["step"] for e in resumed.of("checkpoint_save")})
    assert saves == [GRPO_STEPS + 1], f"the resumed run saved steps {saves}"
    assert optimizer_steps(resumed, GRPO_STEPS + 1) == {float(GRPO_STEPS + 1)}, "the optimizer's count did not go on"
    print(f"resumed from global_step_{GRPO_STEPS}: {n} tensors restored exactly on 2 ranks, then trained step "
          f"{GRPO_STEPS + 1} ({resumed.seconds:.0f} s)")
