"""The prompt stream's bookkeeping: generation quota per weight version, per-batch staleness and resume counts."""

from __future__ import annotations

import pytest

from qwen3_rl.trainer.fully_async.stream import resume_metrics, staleness_metrics, version_quota


def test_version_quota_is_one_plus_staleness_versions_rounded_up() -> None:
    assert version_quota(8, 0.0) == 8
    assert version_quota(8, 1.0) == 16
    assert version_quota(8, 0.5) == 12
    assert version_quota(3, 0.5) == 5  # 4.5 rounded up


def test_staleness_is_trainer_version_minus_start_version() -> None:
    m = staleness_metrics(3, [3, 2, 2, 1])
    assert m == {"fully_async/staleness/mean": 1.0, "fully_async/staleness/max": 2.0,
                 "fully_async/staleness/min": 0.0}
    with pytest.raises(ValueError, match="version 4 > trainer version 3"):
        staleness_metrics(3, [4])
    with pytest.raises(ValueError, match="empty"):
        staleness_metrics(0, [])


def test_resume_counts_trajectories_and_keeps_a_running_total() -> None:
    m, total = resume_metrics([0, 2, 1, 0], 5)
    assert total == 7
    assert m == {"fully_async/partial/resumed": 2.0, "fully_async/partial/resumes": 3.0,
                 "fully_async/partial/resumed_total": 7.0}
    m, total = resume_metrics([0, 0], total)
    assert total == 7 and m["fully_async/partial/resumed"] == 0.0
