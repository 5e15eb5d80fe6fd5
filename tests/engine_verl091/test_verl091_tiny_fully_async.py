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
  0.047 -> 0.625);
* resume (the run saves at weight versions 3 and 6, ``SAVE_FREQ=3``): the same command with one more weight version
  (``SYNCS=7``) on a copy of its checkpoints loads ``global_step_6`` as verl's fully-async trainer and rollouter
  restore it (``fully_async_trainer.py:980-1031``, ``fully_async_rollouter.py:671-727``): the actor's parameters and
  optimizer tensors equal those of the version-6 save (the probe saves both), the weight version goes on at 6 (the
  rollout is synced with the loaded weights first and the update trains version 7), the rollouter's prompt count
  (6 x 16 + 1) and its dataloader position (``data.pt``) go on where the first run stopped, and it makes one update
  and saves ``global_step_7``. Not restored by verl (no state saved for them): the staleness counters (recounted from
  0 at the first sync, ``reset_staleness``), the sample / stale-trajectory totals, and prompts in flight at a save
  (``fully_async_rollouter.py:656-660``; none at the last version here: the run's 96 prompts are all trained).

Runs in the venv of ``tests/setup_verl091_engine_env.sh``; device layer only (``qwen3_rl/cpu_device/verl091_site``).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from test_verl091_tiny_learning import check_restored_state

from helpers.tiny_launch import LEARNING_MARGIN, Run, _tail, launch

UPDATES = 6  # internal/train_grpo_tiny_cpu_fully_async.sh: SYNCS 6 x TRIGGER_SYNC_STEPS 1
PROMPTS_PER_UPDATE = 16  # its REQUIRE_BATCHES 1 x PPO_MINI_BATCH_SIZE 16
CURRENT = {"PIN_SET": "current", "QWEN3_RL_VERL091_ENGINE_VENV": sys.prefix}
SAVE_FREQ = 3  # checkpoints at weight versions 3 and 6 (the resume test's positive control compares the two)
SAVES = {"SAVE_FREQ": str(SAVE_FREQ)}


_VAL_RE = re.compile(
    r"step:(\d+) - rollouter/validate_time.*?val-core/[^ ]*/acc/mean@1:(?:np\.float64\()?([0-9.]+)"
)


def val_by_step(log: str) -> dict[int, float]:
    """verl's ``val-core`` accuracy by logged step from the run's console lines. verl logs a validation at the step of
    its weight version (fully_async_trainer.py:829-830: every test_freq versions, and once more after the last update
    when the run did not end on one, :529-533) on a line of its own, next to that step's training line (``python -m
    qwen3_rl report`` merges the two into one record; read here from the validation lines themselves)."""
    return {int(m.group(1)): float(m.group(2)) for m in _VAL_RE.finditer(log)}


@pytest.fixture(scope="module")
def fa_run(current_ws: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``PIN_SET=current SAVE_FREQ=3 bash ray_start_npu.sh internal/train_grpo_tiny_cpu_fully_async.sh --device cpu``
    from the warmed-up model, once for the learning and the resume test (its probe and checkpoint dirs)."""
    return launch(
        current_ws,
        "internal/train_grpo_tiny_cpu_fully_async.sh",
        tmp_path_factory.mktemp("fa-current"),
        env={**CURRENT, **SAVES},
    )


@pytest.mark.timeout(2400)
def test_grpo_tiny_fully_async_learns_on_the_current_set(fa_run: Run) -> None:
    """The fully-async tiny run on verl 0.9.1: 6 updates, weights synced over cpu_gloo, val accuracy +0.10."""
    run = fa_run
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
    print(
        f"current set fully-async GRPO val-core accuracy: before {before:.3f}, after {UPDATES} updates (weight "
        f"version {last}) {after:.3f} (versions seen by the rollout up to {max(versions):.0f}; launcher "
        f"{run.seconds:.0f} s)"
    )
    assert after >= before + LEARNING_MARGIN, f"no learning: val accuracy {before:.3f} -> {after:.3f}"


def data_position(step_dir: Path) -> int:
    """The prompts the rollouter's dataloader had handed out when verl saved ``step_dir`` (its ``data.pt``, torchdata's
    ``StatefulDataLoader.state_dict``; one prompt a batch, ``data.gen_batch_size`` 1)."""
    import torch

    state = torch.load(step_dir / "data.pt", weights_only=False)
    return int(state["_num_yielded"])


@pytest.mark.timeout(2400)
def test_grpo_tiny_fully_async_resumes_on_the_current_set(
    current_ws: Path, fa_run: Run, tmp_path: Path
) -> None:
    """The same command with ``SYNCS=7`` on a copy of ``fa_run``'s checkpoints: verl's fully-async trainer and
    rollouter resume from global_step_6 (``trainer.resume_mode=auto``): weights and optimizer state equal the saved
    ones, weight version, prompt count and data position go on, and the run makes one update (version 7).

    verl's trainer prints the update as ``global_steps: 8`` (not 7: ``load_checkpoint`` sets version x sync steps + 1
    and ``fit`` adds 1 more, ``fully_async_trainer.py:1011``, ``:513``); its training metrics of a sync cycle are logged
    at the next sync (``fit_step``: ``_fit_log_aggregated_training_metrics`` before ``_fit_postprocess_step`` adds the
    step's, ``:601-604``), so the last cycle's are not when the run ends on a validation version (``:529-533``; here:
    the only cycle)."""
    assert fa_run.rc == 0, _tail(fa_run)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fa_run.ckpt, ckpt)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(UPDATES)
    saved_position = data_position(ckpt / f"global_step_{UPDATES}")
    assert saved_position == UPDATES * PROMPTS_PER_UPDATE, f"data position at the save: {saved_position}"
    resumed = launch(
        current_ws,
        "internal/train_grpo_tiny_cpu_fully_async.sh",
        tmp_path / "resume",
        ckpt=ckpt,
        env={**CURRENT, **SAVES, "SYNCS": str(UPDATES + 1), "VAL_BEFORE_TRAIN": "False"},
    )
    check_resumed(fa_run, resumed, ckpt, saved_position)


def check_resumed(fa_run: Run, resumed: Run, ckpt: Path, saved_position: int) -> None:
    """The resumed run of :func:`test_grpo_tiny_fully_async_resumes_on_the_current_set` on its checkpoint directory
    ``ckpt`` (the copy of ``fa_run``'s), whose version-6 data position was ``saved_position``."""
    assert resumed.rc == 0, _tail(resumed)
    log = resumed.log
    # the trainer: the actor loaded on its one rank, equal to the version-6 save tensor by tensor
    step_dir = str(ckpt / f"global_step_{UPDATES}")
    assert f"[FullyAsyncTrainer] Load from checkpoint folder: {step_dir}" in log, _tail(resumed)
    loads = resumed.of("checkpoint_load")
    assert [(e["rank"], Path(e["path"]).resolve()) for e in loads] == [
        (0, (Path(step_dir) / "actor").resolve())
    ], loads
    n = check_restored_state(fa_run, resumed, UPDATES, ranks=(0,), before=UPDATES - SAVE_FREQ)
    # the weight version: the loaded weights synced to the rollout as version 6 before it generates, one update
    assert f"current_param_version to {UPDATES}" in log, _tail(resumed)
    syncs = [int(v) for v in re.findall(r"_fit_update_weights, .*self.current_param_version: (\d+)", log)]
    assert syncs == [UPDATES, UPDATES + 1], f"weight syncs at versions {syncs}"
    updates = re.findall(r"\[FullyAsyncTrainer\] global_steps: (\d+)", log)
    assert len(updates) == 1, f"updates of the resumed run: {updates}"
    # the staleness count is not restored: the first sync recounts it from what is queued or running (none yet)
    resets = re.findall(r"\[reset_staleness\] reset staleness_samples to: (\d+)", log)
    assert resets[:1] == ["0"], f"staleness counts at the resumed run's syncs: {resets}"
    # the rollouter: its prompt count and dataloader position go on from the save (the positive control: a fresh
    # start would count from 1 and hand out the first prompts again)
    assert f"[FullyAsyncRollouter] Setting global_steps to {UPDATES * PROMPTS_PER_UPDATE + 1}" in log, _tail(
        resumed
    )
    assert f"[FullyAsyncRollouter] Loaded dataloader state from {step_dir}/data.pt" in log, _tail(resumed)
    end_position = data_position(ckpt / f"global_step_{UPDATES + 1}")
    assert end_position == (UPDATES + 1) * PROMPTS_PER_UPDATE, (
        f"data position after the resumed run: {end_position}"
    )
    # the resumed run's save at its end (version 7, verl's forced last save): the actor, the optimizer's step count
    # going on from 6
    saves = sorted({e["step"] for e in resumed.of("checkpoint_save")})
    assert saves == [UPDATES + 1], f"the resumed run saved versions {saves}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(UPDATES + 1)
    import torch

    state = torch.load(resumed.probe / f"state-save-step{UPDATES + 1}-rank0.pt")
    steps = {float(v) for k, v in state.items() if k.endswith("/step")}
    assert steps == {float(UPDATES + 1)}, f"optimizer step counts after the resumed update: {steps}"
    # verl's lack, printed: an earlier save's data position counts the prompts in flight, which a resume skips
    early = data_position(fa_run.ckpt / f"global_step_{UPDATES - SAVE_FREQ}")
    print(
        f"version-{UPDATES - SAVE_FREQ} save: data position {early}, prompts trained "
        f"{(UPDATES - SAVE_FREQ) * PROMPTS_PER_UPDATE} (a resume from it skips the difference)"
    )
    print(
        f"fully-async resume from global_step_{UPDATES}: {n} tensors restored exactly, weight version {UPDATES} "
        f"-> {UPDATES + 1}, data position {saved_position} -> {end_position}, verl's trainer step printed "
        f"{updates[0]} ({resumed.seconds:.0f} s)"
    )
