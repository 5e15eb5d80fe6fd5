"""The package-side default of the vLLM seam's engine-step hook interface (``vllm.plugins.extensions
.EngineStepHook``), without importing vLLM: every method leaves the step unchanged. A hook subclasses it and
overrides the points where it acts."""

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
