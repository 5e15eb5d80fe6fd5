"""Rollout rebalance on vLLM 0.23 (current pin set): the DP engine cores' loop reached through upstream's
``scheduler_cls``, no vLLM patch.

The seed set's seam patch (``patches/vllm/0003``) calls :class:`~qwen3_rl.rollout.vllm_engine_hook.CoreRebalanceHook`
at three points of ``DPEngineCoreProc``'s loop. vLLM 0.23 has no hook there, but every point is a call into the
scheduler that ``SchedulerConfig.scheduler_cls`` (``vllm/config/scheduler.py:125-130``) names:

* the step's outputs: ``Scheduler.update_from_output`` returns them per client (``core.py:466-472``); hosted
  requests' outputs are filtered out there (``hook.filter_outputs``);
* "has work": ``has_requests()`` (``interface.py:185-188``, through ``has_unfinished_requests``) gates the idle wait
  (``EngineCoreProc.has_work``, ``core.py:1210-1216``) and ``step()`` (``core.py:452``); the hook's work (results
  away, hosted requests, outputs to send) is OR-ed in, so a rank whose requests are all away keeps stepping;
* once per loop iteration, after the step and before the dummy batch and the DP all-reduce:
  ``DPEngineCoreProc.run_busy_loop`` asks ``scheduler.has_unfinished_requests()`` (``core.py:1890``). That call
  (recognised by its caller's code object; its ``self`` is the engine core) decides whether the iteration is a step:
  it goes on to a forward, real or dummy (``executed``, work here, or ``engines_running``, ``core.py:1891-1899``);
  every DP rank counts the same iterations, as vLLM's own every-32-steps all-reduce (``core.py:1928-1932``) relies on;
* the hook's step (count, a round when due, which is collective, and the outputs of own requests whose results came
  back, put to the engine core's ``output_queue`` as the patch's ``_after_step_hooks`` did) runs at the next
  iteration's first scheduler call, ``has_requests()`` from ``EngineCore.step`` (``core.py:452``), before any
  forward: run at the loop point it would come before a rank's dummy batch, for which the other rank's real forward
  waits (``coordinate_batch_across_dp``), while that rank waits in the round (seen: a 120 s gloo timeout).

Only a MoE model's DP engine cores run this loop: vLLM 0.23 makes a dense model's DP ranks independent
``EngineCoreProc``s with ``data_parallel_size`` 1 (``core.py:1153-1163``), refused here as DP 1.

The hook itself (request export / import, KV moves, the coordinator) is the seed set's, unchanged; settings come
from ``additional_config = {"qwen3_rl": {"rollout_rebalance": {...}}}`` (:func:`~qwen3_rl.rollout.vllm_engine_hook.
core_settings`). Python gc control rides along (:class:`~qwen3_rl.rollout.gc_scheduler.GcStepSchedulerMixin`,
a no-op without its ``additional_config`` switch), as ``scheduler_cls`` takes one class.

Use: ``AsyncLLM`` / verl's servers with ``data_parallel_size`` > 1 and
``scheduler_cls="qwen3_rl.rollout.rebalance_vllm023.RebalanceScheduler"``. Refused at build with the switch on:
DP 1, async scheduling, the external launcher (no ``DPEngineCoreProc`` loop there).
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import DPEngineCoreProc, EngineCore

from qwen3_rl.rollout.gc_scheduler import GcStepSchedulerMixin
from qwen3_rl.rollout.migration import MigrationError
from qwen3_rl.rollout.vllm_engine_hook import CoreRebalanceHook, core_settings

__all__ = ["RebalanceScheduler", "RebalanceSchedulerMixin", "loop_point_problems"]

#: the code object of the DP engine core loop, whose ``has_unfinished_requests()`` call is the loop point
_DP_LOOP_CODE = DPEngineCoreProc.run_busy_loop.__code__
#: the code object of the engine step, whose first ``has_requests()`` call runs the hook's step
_STEP_CODE = EngineCore.step.__code__


def loop_point_problems(dp_loop: Any = _DP_LOOP_CODE, step: Any = _STEP_CODE) -> list[str]:
    """What the hook relies on that the given code objects (default: the installed vLLM's DP loop and engine step)
    lack: the DP loop must call ``has_unfinished_requests`` and read ``executed`` / ``engines_running``, the step must
    call ``has_requests``. Empty on vLLM 0.23.0; a vLLM that moved them would leave the hook never stepping."""
    problems = []
    need = {"has_unfinished_requests": dp_loop.co_names, "engines_running": dp_loop.co_names,
            "executed": dp_loop.co_varnames}
    problems += [f"DPEngineCoreProc.run_busy_loop has no {n!r}" for n, names in need.items() if n not in names]
    if "has_requests" not in step.co_names:
        problems.append("EngineCore.step does not call 'has_requests'")
    return problems


class RebalanceSchedulerMixin:
    """The rebalance hook's three loop points in the scheduler's methods (see the module docstring)."""

    rebalance_hook: CoreRebalanceHook | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        settings = core_settings(vllm_config)
        self.rebalance_on = bool(settings is not None and settings.enable)
        self.rebalance_hook = None
        self._in_hook = False
        if self.rebalance_on:
            pc, sc = vllm_config.parallel_config, vllm_config.scheduler_config
            problems = []
            if pc.data_parallel_size <= 1:
                problems.append(
                    f"vLLM data_parallel_size is {pc.data_parallel_size} (needs > 1; vLLM 0.23 runs a dense "
                    "model's DP ranks as independent engines)"
                )
            if getattr(sc, "async_scheduling", False):
                problems.append("async scheduling is not supported (output placeholders in flight)")
            if pc.distributed_executor_backend == "external_launcher":
                problems.append("the external launcher has no DP engine core loop")
            problems += [f"this vLLM's loop moved ({p})" for p in loop_point_problems()]
            if problems:
                raise MigrationError("rollout rebalance cannot run on this engine: " + "; ".join(problems))

    def _hook_work(self) -> bool:
        """Work the hook holds (results away, hosted requests, outputs to send)."""
        hook = self.rebalance_hook
        if hook is None or self._in_hook:
            return False
        self._in_hook = True  # the hook asks the scheduler's has_requests() in turn
        try:
            return hook.has_unfinished()
        finally:
            self._in_hook = False

    def has_unfinished_requests(self) -> bool:
        own = super().has_unfinished_requests()  # type: ignore[misc]
        if not self.rebalance_on or self._in_hook:
            return own
        caller = sys._getframe(1)
        if caller.f_code is not _DP_LOOP_CODE:
            return own or self._hook_work()
        return self._loop_point(caller.f_locals["self"], bool(caller.f_locals.get("executed")), own)

    def _loop_point(self, core: Any, executed: bool, own: bool) -> bool:
        """Once per DP loop iteration (``core.py:1890``): decides whether the iteration is a step (it goes on to
        a forward, real or dummy, and the DP all-reduce); returns the rank's "unfinished" flag for the loop."""
        if self.rebalance_hook is None:
            self.rebalance_hook, self._core = CoreRebalanceHook(core), core
        work = own or self._hook_work()
        if executed or work or core.engines_running:
            self._step_pending = True
        return work

    def has_requests(self) -> bool:
        # the first scheduler call of the next iteration (``EngineCore.step``, core.py:452), before any forward on
        # every rank: the hook's step for the iteration before (its round is collective; run at the loop point,
        # before a dummy batch, it would wait for a rank whose forward waits for that dummy batch)
        if getattr(self, "_step_pending", False) and sys._getframe(1).f_code is _STEP_CODE:
            self._step_pending = False
            for item in self.rebalance_hook.after_engine_core_step().items():  # type: ignore[union-attr]
                self._core.output_queue.put_nowait(item)
        return super().has_requests()  # type: ignore[misc]

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        hook = self.rebalance_hook
        if hook is None or not outputs:
            return outputs
        return {client: hook.filter_outputs(out) for client, out in outputs.items()}


class RebalanceScheduler(RebalanceSchedulerMixin, GcStepSchedulerMixin, Scheduler):
    """vLLM's ``Scheduler`` with rollout rebalance's loop points and the gc bracket (no async scheduling)."""
