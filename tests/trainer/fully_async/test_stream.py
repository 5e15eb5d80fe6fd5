"""The prompt stream's bookkeeping: generation quota per weight version, per-batch staleness and resume counts.

The staleness bound is checked on the driver's own bookkeeping (:class:`PromptStream`) driven the way
``FullyAsyncTrainer.fit`` drives it, with requests finishing in random order: staleness 0 trains on-policy batches
only, staleness s never trains a sample more than ``ceil(s)`` versions old. Positive controls in the same
simulation: the count the driver used before (prompts running or queued < quota, batches in finish order) breaks
both; verl's per-version counter with batches in finish order keeps staleness 0 on-policy but breaks the bound
above it (hence the oldest-version-first batches)."""

from __future__ import annotations

import random

import pytest

from qwen3_rl.trainer.fully_async.stream import (
    PromptStream,
    resume_metrics,
    staleness_bound,
    staleness_metrics,
    version_quota,
)


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


def test_counter_is_per_version_and_restarts_from_the_untrained_prompts() -> None:
    st = PromptStream(quota=4)
    for k in range(4):
        assert st.may_start()
        st.start(k, f"p{k}")
    assert not st.may_start() and st.started_in_version == 4
    with pytest.raises(RuntimeError, match="past the version quota 4"):
        st.start(9, "p9")
    for k in range(4):
        st.finish(k, f"g{k}")
    assert [v for _, v in st.take_batch(2)] == [0, 0]
    # nothing starts until the sync, although only two prompts are left untrained (the old count let two start)
    assert not st.may_start()
    st.new_version(1)
    assert st.counted == 2 and st.started_in_version == 0
    st.start(10, "p10")
    st.start(11, "p11")
    assert not st.may_start()
    with pytest.raises(ValueError, match="version 1 after 1"):
        st.new_version(1)


def test_batches_take_the_oldest_start_version_and_wait_for_an_older_running_prompt() -> None:
    st = PromptStream(quota=8)
    st.start("a", "a")  # version 0, still running below
    st.start("b", "b")
    st.new_version(1)
    st.start("c", "c")
    st.start("d", "d")
    st.finish("d", "gd")
    st.finish("c", "gc")
    st.finish("b", "gb")
    assert st.take_batch(4) is None  # 3 finished
    assert st.take_batch(2) is None  # b (v0) and d (v1): "a" (v0) runs, it goes before any version-1 group
    assert st.take_batch(1) == [("gb", 0)]  # a version-0 batch may go
    st.finish("a", "ga")
    assert st.take_batch(2) == [("ga", 0), ("gd", 1)]  # oldest version first, then finish order
    assert st.ready == [("gc", 1)]


def simulate(threshold: float, per_update: int, trigger: int, updates: int, seed: int, *,
             old_rule: bool = False, finish_order: bool = False) -> list[int]:
    """The driver loop of ``FullyAsyncTrainer.fit`` on :class:`PromptStream` with random generation and update
    times (the rollout runs several requests at once, each finishing after a random number of ticks); returns the
    maximum staleness of each trained batch. ``old_rule``: the count before (running + queued prompts < quota,
    batches in finish order, no reset at a sync); ``finish_order``: batches in finish order."""
    rng = random.Random(seed)
    quota = version_quota(per_update * trigger, threshold)
    st = PromptStream(quota)
    left: dict[int, int] = {}  # prompt -> ticks of generation left
    next_id, version, done_updates, training, out = 0, 0, 0, None, []
    while done_updates < updates:
        while (len(st.inflight) + len(st.ready) < quota) if old_rule else st.may_start():
            st.inflight[next_id] = (next_id, st.version)  # PromptStream.start without the per-version counter
            if not old_rule:
                st.counted += 1
            left[next_id] = rng.choice([1, 2, 3, 20])  # a long tail
            next_id += 1
        for k in list(st.inflight):
            left[k] -= 1
            if left[k] <= 0:
                st.finish(k, k)
        if training is None:
            if old_rule or finish_order:
                taken = st.ready[:per_update] if len(st.ready) >= per_update else None
                st.ready = st.ready[per_update:] if taken else st.ready
            else:
                taken = st.take_batch(per_update)
            if taken is not None:
                training = (rng.randint(1, 6), [version - v for _, v in taken])
        elif training[0] <= 1:
            out.append(max(training[1]))
            training, done_updates = None, done_updates + 1
            if done_updates % trigger == 0:
                version += 1
                if old_rule:
                    st.version = version
                else:
                    st.new_version(version)
        else:
            training = (training[0] - 1, training[1])
    return out


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize(("per_update", "trigger"), [(4, 1), (3, 2)])
def test_staleness_stays_within_its_bound_when_requests_finish_out_of_order(threshold, per_update, trigger) -> None:
    bound = staleness_bound(threshold)
    worst = [max(simulate(threshold, per_update, trigger, 40, seed)) for seed in range(30)]
    assert max(worst) <= bound, (bound, worst)
    if threshold == 0:
        assert max(worst) == 0
    else:  # the bound is reached: stale samples do get trained
        assert max(worst) == bound, (bound, worst)


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_the_old_count_breaks_the_bound(threshold) -> None:
    """Positive control: the same simulation with the count the driver had before exceeds the bound."""
    worst = max(max(simulate(threshold, 4, 1, 40, seed, old_rule=True)) for seed in range(30))
    assert worst > staleness_bound(threshold), worst


def test_finish_order_batches_break_the_bound_above_zero() -> None:
    """Positive control: verl's counter alone is on-policy at 0 but lets a slow sample grow older than ceil(s)."""
    worst = {s: max(max(simulate(s, 4, 1, 40, seed, finish_order=True)) for seed in range(30)) for s in (0.0, 1.0)}
    assert worst[0.0] == 0 and worst[1.0] > staleness_bound(1.0), worst


def test_staleness_bound_is_the_threshold_rounded_up() -> None:
    assert [staleness_bound(s) for s in (0.0, 0.5, 1.0, 1.5)] == [0, 1, 1, 2]
