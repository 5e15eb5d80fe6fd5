"""Python gc off during each engine step on vLLM 0.23 (current pin set), through upstream's ``scheduler_cls``.

vLLM 0.23 has no engine-step hook (the seed set's seam patch adds one); its ``SchedulerConfig.scheduler_cls``
(``vllm/config/scheduler.py:125-130``) names the class ``EngineCore.__init__`` builds (``core.py:136-157``). One
engine-core step is ``EngineCore.step`` (``core.py:443-472``): ``scheduler.schedule()`` -> the model
(``execute_model`` / ``sample_tokens``, in this thread with the in-process executor, in the worker processes with
vLLM's multiprocess executor) -> ``scheduler.update_from_output()``; then ``post_step`` (draft token ids) and, in
the engine core process, the busy loop's input handling (``run_busy_loop``, ``core.py:1223-1281``; the DP loop
``core.py:1869-1925`` adds request-count publishing, a dummy batch on an idle rank and the all-reduce). The
schedulers here open :class:`~qwen3_rl.rollout.gc_control.GcStepBracket` at ``schedule()`` and close it at the end
of ``update_from_output()``: the collector is off from scheduling to the scheduler's output processing of every
step, model step included when it runs in this process, and back on between steps.

Batch queue (``EngineCore.step_with_batch_queue``, ``core.py:484-597``; used when ``max_concurrent_batches`` > 1:
async scheduling or pipeline parallelism): each call schedules at most one batch and updates at most one. In the
steady state every call does both, so the bracket covers each call and gc is on between calls. A call that only
fills the queue (the first after idle, PP's pipeline fill) returns without ``update_from_output()``: the bracket
stays open over that one gap and closes at the next call's update. A call that only drains (nothing left to
schedule) is bracketed by ``update_from_output()`` alone. On vLLM-CPU this path needs pipeline parallelism: the CPU
platform switches async scheduling off (``platforms/cpu.py:140-141``).

Outside the bracket: ``post_step``, the DP dummy batch (the worker class of
:mod:`qwen3_rl.rollout.gc_worker` brackets it in the process that runs the model), the in-process ``LLMEngine``'s
output processing (detokenisation, ``RequestOutput``; the seed set's hook covered it), the front-end process of
``AsyncLLM``.

Use (the class must match the engine's async-scheduling choice; a mismatch is refused at build)::

    LLM(..., scheduler_cls="qwen3_rl.rollout.gc_scheduler.GcStepScheduler",
        additional_config={"qwen3_rl": {"disable_gc": True}})
    # async scheduling (GPU / NPU default when the executor supports it): GcStepAsyncScheduler

The policy is :mod:`qwen3_rl.rollout.gc_control`'s, per process and read at each step: ``additional_config``
applies it when the scheduler is built (absent: the process's policy is kept, so verl's
``set_decode_gc_disabled`` still works on an in-process engine).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from qwen3_rl.rollout.gc_control import GcStepBracket, configure_from_vllm_config

__all__ = ["GcStepAsyncScheduler", "GcStepScheduler", "GcStepSchedulerMixin", "scheduler_cls_name"]


class GcStepSchedulerMixin:
    """Collector off from ``schedule()`` to the end of ``update_from_output()`` (see the module docstring); the
    bracket is closed at ``shutdown()`` too, so an engine that died between the two leaves gc as it found it."""

    gc_bracket: GcStepBracket

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        wants_async = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
        if wants_async != isinstance(self, AsyncScheduler):
            raise ValueError(
                f"scheduler_cls {type(self).__name__} does not match async_scheduling={wants_async}: "
                f"use {scheduler_cls_name(wants_async)}"
            )
        configure_from_vllm_config(vllm_config, keep_if_absent=True)
        self.gc_bracket = GcStepBracket()

    def schedule(self) -> Any:
        self.gc_bracket.open()
        try:
            return super().schedule()  # type: ignore[misc]
        except BaseException:
            self.gc_bracket.close()
            raise

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        self.gc_bracket.open()  # a drain-only call of the batch queue: no schedule() before it in this call
        try:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.gc_bracket.close()

    def shutdown(self) -> None:
        self.gc_bracket.close()
        super().shutdown()  # type: ignore[misc]


class GcStepScheduler(GcStepSchedulerMixin, Scheduler):
    """vLLM's ``Scheduler`` with the gc bracket (engines without async scheduling; vLLM-CPU always)."""


class GcStepAsyncScheduler(GcStepSchedulerMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the gc bracket (engines with async scheduling)."""


def scheduler_cls_name(async_scheduling: bool) -> str:
    """The ``scheduler_cls`` qualified name for an engine with or without async scheduling."""
    cls = GcStepAsyncScheduler if async_scheduling else GcStepScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
