"""The prompt stream's part of a checkpoint: its state file, the weight version it records, the order of the
carried prompts and where it is saved / loaded (the carried prompt rows themselves: tests/engine/test_fully_async.py,
which resumes a real run)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from qwen3_rl.trainer.fully_async.checkpoint import (
    STATE_FILE,
    StreamState,
    checkpoint_version,
    load_stream,
    resume_folder,
    save_stream,
    step_folder,
    untrained_prompts,
)


def test_state_round_trips_and_rejects_missing_or_negative_fields() -> None:
    s = StreamState(step=5, param_version=5, epoch=1, carried=16, queued=3, inflight=13, not_started=0)
    assert StreamState.from_json(s.to_json()) == s
    with pytest.raises(ValueError, match="missing field 'epoch'"):
        StreamState.from_json('{"step": 1, "param_version": 1, "carried": 0}')
    with pytest.raises(ValueError, match="negative"):
        StreamState.from_json('{"step": 1, "param_version": 1, "epoch": 0, "carried": -1}')


def test_checkpoint_version_is_ahead_of_the_rollout_without_a_sync() -> None:
    assert checkpoint_version(3, synced=True) == 3  # the rollout already holds these weights as version 3
    assert checkpoint_version(3, synced=False) == 4  # trained past version 3, not synced yet: a new version


def test_untrained_prompts_queued_then_inflight_then_not_started() -> None:
    assert untrained_prompts(["q1", "q2"], ["f1"], ["n1", "n2"]) == ["q1", "q2", "f1", "n1", "n2"]
    assert untrained_prompts([], [], []) == []


def test_folders_follow_verls_save_and_load_paths(tmp_path: Path) -> None:
    assert step_folder("ckpt", 7, cwd=str(tmp_path)) == tmp_path / "ckpt" / "global_step_7"
    assert step_folder(str(tmp_path / "abs"), 2, cwd="/elsewhere") == tmp_path / "abs" / "global_step_2"
    auto = SimpleNamespace(resume_mode="auto", default_local_dir="ckpt", resume_from_path=None)
    assert resume_folder(auto, 5, cwd=str(tmp_path)) == tmp_path / "ckpt" / "global_step_5"
    path = SimpleNamespace(resume_mode="resume_path", default_local_dir="ckpt",
                           resume_from_path=str(tmp_path / "old" / "global_step_3"))
    assert resume_folder(path, 3, cwd="/elsewhere") == tmp_path / "old" / "global_step_3"


def test_state_without_prompts_saves_and_loads(tmp_path: Path) -> None:
    s = StreamState(step=6, param_version=6, epoch=0, carried=0)
    save_stream(tmp_path / "global_step_6", s, [])
    assert load_stream(tmp_path / "global_step_6") == (s, [])
    assert load_stream(tmp_path / "none") == (None, [])  # a checkpoint saved by another trainer: no stream state
    with pytest.raises(ValueError, match="1 prompt rows for a state carrying 0"):
        save_stream(tmp_path / "bad", s, ["row"])
    assert not (tmp_path / "bad" / STATE_FILE).exists()
