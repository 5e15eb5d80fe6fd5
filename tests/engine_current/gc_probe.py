"""Test instrumentation for ``test_current_gc_control.py``: the recipe's gc scheduler / worker classes
(``qwen3_rl.rollout.gc_scheduler`` / ``gc_worker``) with a recorder underneath them, loaded by vLLM 0.23 through
``scheduler_cls`` / ``worker_cls`` (``gc_probe.ProbeScheduler``, ``gc_probe.ProbeWorker``) in whichever process
builds them (the in-process engine, the engine core process, the worker process).

Each process's :class:`Trace` records, through ``gc.callbacks``, every collection (monotonic time in s, generation,
whether it fell inside a step, the step index, whether the collector was enabled) and every step's interval. A step
is, for the scheduler, from the begin of vLLM's ``Scheduler.schedule()`` to the end of its ``update_from_output()``
(the model runs in between with the in-process executor); for the worker, one ``execute_model`` or ``sample_tokens``
call. Those intervals are marked by classes *under* the recipe's mixins (inside its bracket, as vLLM's own code is),
and each creates :data:`PRESSURE` unreachable reference cycles, so that with the collector enabled gen-0 collections
start inside steps (the positive control) and with the recipe's bracket they start after it. The classes above the
mixins record whether the collector is enabled when a step is entered and after it returned (between steps).

The trace goes to ``$QWEN3_RL_GC_TRACE_DIR/<role>-<pid>.json``, rewritten after every step; in the driver's own
process :data:`TRACES` holds it too.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.cpu_worker import CPUWorker

from qwen3_rl.rollout.gc_scheduler import GcStepSchedulerMixin
from qwen3_rl.rollout.gc_worker import GcStepWorkerMixin

#: env var naming the folder of the per-process trace files
TRACE_DIR_ENV = "QWEN3_RL_GC_TRACE_DIR"
#: unreachable reference cycles made in each marked half step (objects; gen-0 threshold below)
PRESSURE = 150
#: gen-0 threshold of the probed processes (allocations): low, so that a step's allocations cross it
GEN0_THRESHOLD = 100

#: this process's traces by role ("scheduler", "worker")
TRACES: dict[str, Trace] = {}


class Trace:
    """Collections and step intervals of one role in one process (see the module docstring)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.inside = False
        self.step = 0
        self.t0 = 0.0
        self.collections: list[list[Any]] = []  # [t (s), generation, inside, step index, gc enabled]
        self.steps: list[list[float]] = []  # [t begin, t end] (s)
        self.enabled_at_entry = [0, 0]  # steps entered with the collector [disabled, enabled]
        self.enabled_after = [0, 0]  # steps returned with the collector [disabled, enabled]
        self.enabled_inside = [0, 0]  # step bodies that ran with the collector [disabled, enabled]
        gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.collections.append(
                [time.monotonic(), info["generation"], self.inside, self.step, gc.isenabled()]
            )

    def begin(self) -> None:
        """Start of a step body (already inside the recipe's bracket, when it is on)."""
        self.t0 = time.monotonic()
        self.inside = True
        self.enabled_inside[gc.isenabled()] += 1
        _pressure()

    def end(self) -> None:
        """End of a step body."""
        _pressure()
        self.inside = False
        self.steps.append([self.t0, time.monotonic()])
        self.step += 1

    def snapshot(self) -> dict[str, Any]:
        """The trace as JSON-able data."""
        return {
            "role": self.role,
            "pid": os.getpid(),
            "steps": self.steps,
            "collections": self.collections,
            "enabled_at_entry": self.enabled_at_entry,
            "enabled_after": self.enabled_after,
            "enabled_inside": self.enabled_inside,
            "thresholds": list(gc.get_threshold()),
        }

    def reset(self) -> None:
        """Forget what was recorded (a new phase of the same engine)."""
        self.collections, self.steps = [], []
        self.enabled_at_entry, self.enabled_after, self.enabled_inside = [0, 0], [0, 0], [0, 0]

    def dump(self) -> None:
        """Rewrite this process's trace file, if a trace folder is set."""
        folder = os.environ.get(TRACE_DIR_ENV)
        if folder:
            path = Path(folder) / f"{self.role}-{os.getpid()}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.snapshot()))
            tmp.replace(path)


def _pressure() -> None:
    for _ in range(PRESSURE):
        a: list[Any] = []
        a.append(a)


def _trace(role: str) -> Trace:
    if role not in TRACES:
        TRACES[role] = Trace(role)
    return TRACES[role]


class _MarkedScheduler(Scheduler):
    """vLLM's scheduler with the step body marked (under the recipe's mixin)."""

    def schedule(self) -> Any:
        _trace("scheduler").begin()
        return super().schedule()

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        out = super().update_from_output(*args, **kwargs)
        _trace("scheduler").end()
        return out


class ProbeScheduler(GcStepSchedulerMixin, _MarkedScheduler):
    """The recipe's gc scheduler over the marked one; records the collector's state at entry and after a step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _trace("scheduler")

    def schedule(self) -> Any:
        _trace("scheduler").enabled_at_entry[gc.isenabled()] += 1
        return super().schedule()

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        out = super().update_from_output(*args, **kwargs)
        t = _trace("scheduler")
        t.enabled_after[gc.isenabled()] += 1
        t.dump()
        return out


class _MarkedWorker(CPUWorker):
    """vLLM-CPU's worker with each model call marked (under the recipe's mixin)."""

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        t = _trace("worker")
        t.begin()
        try:
            return super().execute_model(*args, **kwargs)
        finally:
            t.end()

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        t = _trace("worker")
        t.begin()
        try:
            return super().sample_tokens(*args, **kwargs)
        finally:
            t.end()


class ProbeWorker(GcStepWorkerMixin, _MarkedWorker):
    """The recipe's gc worker over the marked one; records the collector's state at entry and after each call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _trace("worker")

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        t = _trace("worker")
        t.enabled_at_entry[gc.isenabled()] += 1
        out = getattr(super(), name)(*args, **kwargs)
        t.enabled_after[gc.isenabled()] += 1
        t.dump()
        return out

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("execute_model", *args, **kwargs)

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("sample_tokens", *args, **kwargs)
