"""The package-side default of the vLLM seam's engine-step hook interface (``vllm.plugins.extensions
.EngineStepHook``), without importing vLLM: every method leaves the step unchanged. A hook subclasses it and
overrides the points where it acts.

Two engine loops build hooks: the in-process ``LLMEngine`` (verl's sync SPMD rollout) and the engine core
process ``EngineCoreProc`` / ``DPEngineCoreProc`` that ``AsyncLLM`` drives (verl's servers). Both call
``step_context``, ``has_unfinished`` and ``filter_outputs`` (on ``EngineCoreOutputs``); only ``LLMEngine`` calls
``idle_in_lockstep`` and ``after_step`` (request outputs), only the engine core ``after_engine_core_step`` (more
``EngineCoreOutputs`` per client index). :func:`is_engine_core` tells a factory which loop built it."""

from __future__ import annotations

import contextlib
from typing import Any


class EngineStepHookDefaults:
    """No-op engine-step hook: nothing around the step, no pending work, no idle lockstep step, outputs unchanged."""

    def step_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def has_unfinished(self) -> bool:
        return False

    def idle_in_lockstep(self) -> bool:
        return False

    def filter_outputs(self, outputs: Any) -> Any:
        return outputs

    def after_step(self, request_outputs: list[Any]) -> list[Any]:
        return request_outputs

    def after_engine_core_step(self) -> dict[int, Any]:
        return {}


def is_engine_core(engine: Any) -> bool:
    """True when a hook factory is called by vLLM's engine core process object (``EngineCoreProc``: a
    ``scheduler``, no ``output_processor``), False for ``LLMEngine``."""
    return hasattr(engine, "scheduler") and not hasattr(engine, "output_processor")
