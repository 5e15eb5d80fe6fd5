"""The tiny fully-async run on the current pin set, driven by the product command a user types:
``PIN_SET=current bash ray_start_npu.sh internal/train_grpo_tiny_cpu_fully_async.sh --device cpu`` (after
``python -m qwen3_rl cpu-setup --pin-set current``, the ``current_ws`` fixture of conftest.py): verl 0.9.1's own
fully-async trainer (``verl.experimental.fully_async_policy.fully_async_main``): the trainer (Megatron actor, 1
process) and the rollouter (1 standalone vLLM 0.23 CPU server) as separate Ray actors, prompts streamed one at a time,
stale samples allowed (staleness 1), partial rollout on, the weights sent after every update over the CPU profile's
checkpoint engine (``cpu_gloo``, ``qwen3_rl/cpu_device/verl091_gloo_ckpt.py``).

What is checked:

* it runs through the launcher's preflight (no ``--no-preflight``) and exits 0;
* the trainer makes the run's 6 updates (SYNCS 6 x TRIGGER_SYNC_STEPS 1: ``[FullyAsyncTrainer] global_steps`` 1..6)
  and the weight sync goes over ``cpu_gloo``; the rollout trains on samples of later weight versions (verl's
  ``fully_async/count/current_param_version`` reaches at least 3 in the logged steps);
* learning: verl's ``val-core`` accuracy on the test split (greedy, the rollouter's validation) after the last update
  (logged at the step of the last weight version) is at least 0.10 above the one before the first (by hand:
  0.047 -> 0.625).

Runs in the venv of ``tests/setup_verl091_engine_env.sh``; device layer only (``qwen3_rl/cpu_device/verl091_site``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from helpers.tiny_launch import LEARNING_MARGIN, _tail, launch

UPDATES = 6  # internal/train_grpo_tiny_cpu_fully_async.sh: SYNCS 6 x TRIGGER_SYNC_STEPS 1
CURRENT = {"PIN_SET": "current", "QWEN3_RL_VERL091_ENGINE_VENV": sys.prefix}


_VAL_RE = re.compile(r"step:(\d+) - rollouter/validate_time.*?val-core/[^ ]*/acc/mean@1:(?:np\.float64\()?([0-9.]+)")


def val_by_step(log: str) -> dict[int, float]:
    """verl's ``val-core`` accuracy by logged step from the run's console lines. verl logs a validation at the step of
    its weight version (fully_async_trainer.py:829-830: every test_freq versions, and once more after the last update
    when the run did not end on one, :529-533) on a line of its own, next to that step's training line (``python -m
    qwen3_rl report`` merges the two into one record; read here from the validation lines themselves)."""
    return {int(m.group(1)): float(m.group(2)) for m in _VAL_RE.finditer(log)}


@pytest.mark.timeout(2400)
def test_grpo_tiny_fully_async_learns_on_the_current_set(current_ws: Path, tmp_path: Path) -> None:
    """The fully-async tiny run on verl 0.9.1: 6 updates, weights synced over cpu_gloo, val accuracy +0.10."""
    run = launch(current_ws, "internal/train_grpo_tiny_cpu_fully_async.sh", tmp_path, env=CURRENT)
    assert run.rc == 0, _tail(run)
    assert "preflight (pin set current): 0 error(s)" in run.log, _tail(run)
    assert "[FullyAsyncTrainer] Checkpoint manager initialized (backend=cpu_gloo)" in run.log, _tail(run)
    steps = [int(s) for s in re.findall(r"\[FullyAsyncTrainer\] global_steps: (\d+)", run.log)]
    assert steps == list(range(1, UPDATES + 1)), f"trainer updates {steps}"
    versions = [float(v) for v in re.findall(r"fully_async/count/current_param_version:([0-9.]+)", run.log)]
    assert versions and max(versions) >= 3, f"weight versions seen by the rollout: {versions}"
    acc = val_by_step(run.log)
    assert 0 in acc and len(acc) >= 2, f"validations at steps {sorted(acc)}"
    last = max(acc)
    before, after = acc[0], acc[last]
    print(f"current set fully-async GRPO val-core accuracy: before {before:.3f}, after {UPDATES} updates (weight "
          f"version {last}) {after:.3f} (versions seen by the rollout up to {max(versions):.0f}; launcher "
          f"{run.seconds:.0f} s)")
    assert after >= before + LEARNING_MARGIN, f"no learning: val accuracy {before:.3f} -> {after:.3f}"
