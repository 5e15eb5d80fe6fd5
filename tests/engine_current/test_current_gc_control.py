"""DISABLE_GC_IN_ENGINE_STEP on the current set: Python gc off during each engine step of vLLM 0.23.0's real CPU
engine through upstream's ``scheduler_cls`` / ``worker_cls`` (``qwen3_rl.rollout.gc_scheduler`` / ``gc_worker``),
switched by ``additional_config = {"qwen3_rl": {"disable_gc": true}}`` as on the seed set.

One driver process (``gc_driver.py``), three engine starts: ``LLM`` with its engine core process (switch on; switch
off as the positive control) and the in-process ``LLM`` (on, then off on the same engine). ``gc_probe.py`` records
each process's collections (``gc.callbacks``, time stamps, step index) under the recipe's classes and makes
unreachable reference cycles inside every step (gen-0 threshold 100), so that collections start inside steps
unless the collector is off there. The batch-queue path (``EngineCore.step_with_batch_queue``), which vLLM-CPU runs
only with pipeline parallelism, is driven with upstream's own method over a stood-in executor and scheduler base.
"""

from __future__ import annotations

import bisect
import gc
from collections import deque
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import run_driver

ON = {"qwen3_rl": {"disable_gc": True}}


@pytest.fixture(scope="module")
def gc_runs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """``gc_driver.py`` on the dense tiny model: {run name: result}."""
    root = tmp_path_factory.mktemp("gc-traces")
    return run_driver("gc_driver.py", [str(tiny_models["dense"]), str(root)], "GC_RESULT")


def summary(trace: dict) -> dict[str, int]:
    """Counts of one process's trace: steps, collections inside / outside a step (by the probe's flag and, again,
    by time stamp against the step intervals), collections that ran with the collector disabled (explicit
    ``gc.collect``), step bodies run with the collector off / on, steps entered / left with it on."""
    steps, cols = trace["steps"], trace["collections"]
    starts = [s[0] for s in steps]

    def in_a_step(t: float) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and steps[i][0] <= t <= steps[i][1]

    return {
        "steps": len(steps),
        "collections": len(cols),
        "inside": sum(1 for c in cols if c[2]),
        "inside_by_time": sum(1 for c in cols if in_a_step(c[0])),
        "outside": sum(1 for c in cols if not c[2]),
        "explicit": sum(1 for c in cols if not c[4]),
        "body_off": trace["enabled_inside"][0],
        "body_on": trace["enabled_inside"][1],
        "entered_on": trace["enabled_at_entry"][1],
        "entered_off": trace["enabled_at_entry"][0],
        "left_on": trace["enabled_after"][1],
        "left_off": trace["enabled_after"][0],
    }


def assert_gc_off_in_steps(s: dict[str, int], what: str) -> None:
    assert s["steps"] >= 40, (what, s)  # 8 requests x 48 tokens
    assert s["inside"] == 0 and s["inside_by_time"] == 0, f"{what}: collections inside steps {s}"
    assert s["body_off"] == s["steps"] and s["body_on"] == 0, (what, s)
    # back on between steps: every step entered and left with the collector on, and collections do happen there
    assert s["entered_off"] == 0 and s["left_off"] == 0 and s["outside"] > 0, (what, s)


def assert_gc_runs_in_steps(s: dict[str, int], what: str) -> None:
    assert s["steps"] >= 40, (what, s)
    assert s["inside"] > 0 and s["inside_by_time"] == s["inside"], f"{what}: no collection inside steps {s}"
    assert s["body_on"] == s["steps"] and s["entered_off"] == 0 and s["left_off"] == 0, (what, s)


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_engine_core_process_no_collection_inside_a_step_with_the_switch(gc_runs: dict, role: str) -> None:
    on, off = gc_runs["core_on"], gc_runs["core_off"]
    assert on["client"] == off["client"] == "SyncMPClient"  # the engine core runs in its own process
    pids = {on["front_pid"], on["traces"]["scheduler"]["pid"], on["traces"]["worker"]["pid"]}
    assert len(pids) == 3, f"front end, engine core and worker are not three processes: {pids}"
    s_on, s_off = summary(on["traces"][role]), summary(off["traces"][role])
    print(
        f"engine core process, {role}: switch on {s_on}; off {s_off}; {on['seconds']} s / {off['seconds']} s"
    )
    assert s_on["explicit"] == 0 and s_off["explicit"] == 0, (s_on, s_off)
    assert_gc_off_in_steps(s_on, f"{role}, switch on")
    # positive control: the pressure collects inside steps
    assert_gc_runs_in_steps(s_off, f"{role}, switch off")
    assert on["outputs"] == off["outputs"] and all(len(o) == 48 for o in on["outputs"])


def test_in_process_engine_no_collection_inside_a_step_with_the_switch(gc_runs: dict) -> None:
    r = gc_runs["inproc"]
    assert r["client"] == "InprocClient" and r["worker"] == "GcStepCPUWorker", r
    assert r["phases"]["policy_after_build"] is True  # additional_config reached the in-process scheduler
    s_on, s_off = summary(r["phases"]["on"]["trace"]), summary(r["phases"]["off"]["trace"])
    print(f"in-process engine: switch on {s_on}; off {s_off}; {r['seconds']} s")
    assert_gc_off_in_steps(s_on, "in-process, switch on")  # model step included (the in-process executor)
    assert_gc_runs_in_steps(s_off, "in-process, switch off")
    assert r["gc_enabled_after"] is True
    assert r["phases"]["on"]["outputs"] == r["phases"]["off"]["outputs"] == gc_runs["core_on"]["outputs"]


# -- the batch queue (EngineCore.step_with_batch_queue): upstream's method over stand-ins --------------------------


class _StandInSchedulerBase:
    """The scheduler calls ``step_with_batch_queue`` makes, over ``n`` one-token batches; records whether the
    collector is on in each call."""

    def __init__(self, *args: Any, n: int = 5, **kwargs: Any) -> None:
        self.n, self.scheduled, self.updated = n, 0, 0
        self.gc_in: list[tuple[str, bool]] = []

    def has_requests(self) -> bool:
        return self.scheduled < self.n

    def schedule(self) -> Any:
        self.scheduled += 1
        self.gc_in.append(("schedule", gc.isenabled()))
        return SimpleNamespace(total_num_scheduled_tokens=1, pending_structured_output_tokens=False)

    def get_grammar_bitmask(self, scheduler_output: Any) -> None:
        return None

    def update_from_output(self, scheduler_output: Any, model_output: Any) -> dict[int, Any]:
        self.updated += 1
        self.gc_in.append(("update", gc.isenabled()))
        return {0: model_output}

    def shutdown(self) -> None:
        pass


class _StandInExecutor:
    """``execute_model`` / ``sample_tokens`` as finished futures; records whether the collector is on."""

    def __init__(self) -> None:
        self.gc_in: list[tuple[str, bool]] = []

    def _done(self, value: Any) -> Future:
        f: Future = Future()
        f.set_result(value)
        return f

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Future:
        self.gc_in.append(("execute_model", gc.isenabled()))
        return self._done(None)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Future:
        self.gc_in.append(("sample_tokens", gc.isenabled()))
        return self._done("sampled")


def _batch_queue_run(policy: bool, queue_size: int = 2, n: int = 5) -> dict[str, Any]:
    """Drive ``EngineCore.step_with_batch_queue`` until the stand-in scheduler's ``n`` batches are updated."""
    from vllm.v1.engine.core import EngineCore

    from qwen3_rl.rollout import gc_control
    from qwen3_rl.rollout.gc_scheduler import GcStepSchedulerMixin

    class Sched(GcStepSchedulerMixin, _StandInSchedulerBase):
        pass

    cfg = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=False),
        additional_config={"qwen3_rl": {"disable_gc": policy}},
    )
    core = SimpleNamespace(
        batch_queue=deque(maxlen=queue_size),
        batch_queue_size=queue_size,
        scheduler=Sched(vllm_config=cfg, n=n),
        model_executor=_StandInExecutor(),
        is_ec_consumer=True,
        is_pooling_model=False,
        use_spec_decode=False,
        log_error_detail=lambda *_: nullcontext(),
        log_iteration_details=lambda *_: nullcontext(),
        _process_aborts_queue=lambda: None,
    )
    between, returned = [], []
    try:
        for _ in range(3 * n):
            if not (core.scheduler.has_requests() or core.batch_queue):
                break
            out, _executed = EngineCore.step_with_batch_queue(core)
            returned.append(out is not None)
            between.append(gc.isenabled())
    finally:
        gc_control.set_decode_gc_disabled(False)
        gc.enable()
    return {
        "between": between,
        "returned": returned,
        "sched": core.scheduler.gc_in,
        "exec": core.model_executor.gc_in,
        "updated": core.scheduler.updated,
    }


def test_batch_queue_path_gc_off_from_schedule_to_update() -> None:
    on, off = _batch_queue_run(True), _batch_queue_run(False)
    print(
        f"batch queue (size 2, 5 batches): switch on, gc enabled after each call {on['between']}, outputs "
        f"{on['returned']}; off {off['between']}"
    )
    # upstream's call pattern: the first call only fills the queue, then one schedule + one update per call, the
    # last call only drains
    assert on["returned"] == off["returned"] == [False, True, True, True, True, True]
    assert on["updated"] == 5
    # switch on: off in every scheduler call and model call; back on after every call that updated a batch; the
    # queue-filling call leaves it off until the next update (documented in gc_scheduler)
    assert all(not enabled for _, enabled in on["sched"] + on["exec"]), on
    assert on["between"] == [False, True, True, True, True, True]
    # positive control: switch off, the collector stays on throughout
    assert all(enabled for _, enabled in off["sched"] + off["exec"]) and all(off["between"]), off


def test_scheduler_class_must_match_async_scheduling() -> None:
    from qwen3_rl.rollout.gc_scheduler import GcStepSchedulerMixin, scheduler_cls_name

    class Sched(GcStepSchedulerMixin, _StandInSchedulerBase):
        pass

    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True), additional_config=None)
    with pytest.raises(ValueError, match="GcStepAsyncScheduler"):
        Sched(vllm_config=cfg)
    cfg.scheduler_config.async_scheduling = False
    assert Sched(vllm_config=cfg).gc_bracket.is_open is False  # positive control: the matching class builds
    assert scheduler_cls_name(True) == "qwen3_rl.rollout.gc_scheduler.GcStepAsyncScheduler"
    assert scheduler_cls_name(False) == "qwen3_rl.rollout.gc_scheduler.GcStepScheduler"


def test_sam_worker_carries_the_gc_guard() -> None:
    # one engine takes one worker_cls: SAM's binding worker has the same guarded model calls as GcStepCPUWorker (the
    # mixin the real-engine runs above check through ProbeWorker), and still binds its drafter after init_device
    from qwen3_rl.rollout.gc_worker import GcStepCPUWorker, GcStepWorkerMixin
    from qwen3_rl.spec_decode.custom_class_worker import BindsDrafterMixin, SamCPUWorker

    for name in ("execute_model", "sample_tokens", "execute_dummy_batch"):
        assert getattr(SamCPUWorker, name) is getattr(GcStepWorkerMixin, name) is getattr(GcStepCPUWorker, name)
    assert SamCPUWorker.__init__ is GcStepWorkerMixin.__init__
    assert SamCPUWorker.init_device is BindsDrafterMixin.init_device
