"""Python gc off during each model step of a vLLM 0.23 worker (current pin set), through upstream's ``worker_cls``.

With vLLM's multiprocess executor (vLLM-CPU uses it whenever ``VLLM_ENABLE_V1_MULTIPROCESSING`` is on,
``platforms/cpu.py:143-151``; tensor parallelism and every NPU setup) the model runs in worker processes that the
engine core's scheduler (:mod:`qwen3_rl.rollout.gc_scheduler`) does not reach. The worker here wraps each
``execute_model``, ``sample_tokens`` and ``execute_dummy_batch`` (the DP idle rank's dummy step) in
:func:`~qwen3_rl.rollout.gc_control.engine_step_gc_guard`: the collector is off during the call and restored
after it while the policy is on, untouched while it is off (the seed set's hybrid-worker guard,
``trainer.seam.RolloutHooks.worker_call``, covers the same two model calls). With the in-process executor the worker
runs inside the scheduler's bracket; the guard nests and restores what it found.

    LLM(..., worker_cls="qwen3_rl.rollout.gc_worker.GcStepCPUWorker",
        additional_config={"qwen3_rl": {"disable_gc": True}})

Only the CPU worker is built and run here; the mixin on ``vllm.v1.worker.gpu_worker.Worker`` or vLLM-Ascend's
``NPUWorker`` is the device one (not run: no device). ``qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker`` (SAM
group mode) carries this mixin too: one engine takes one ``worker_cls``.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from qwen3_rl.rollout.gc_control import configure_from_vllm_config, engine_step_gc_guard

__all__ = ["GcStepCPUWorker", "GcStepWorkerMixin"]


class GcStepWorkerMixin:
    """Collector off during each model call of the worker while the process's policy is on; the policy comes
    from ``additional_config`` when the worker is built (absent: the process's policy is kept)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        configure_from_vllm_config(kwargs.get("vllm_config", args[0] if args else None), keep_if_absent=True)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        with engine_step_gc_guard():
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        with engine_step_gc_guard():
            return super().sample_tokens(*args, **kwargs)  # type: ignore[misc]

    def execute_dummy_batch(self, *args: Any, **kwargs: Any) -> Any:
        with engine_step_gc_guard():
            return super().execute_dummy_batch(*args, **kwargs)  # type: ignore[misc]


class GcStepCPUWorker(GcStepWorkerMixin, CPUWorker):
    """vLLM-CPU's ``CPUWorker`` with the per-call gc guard."""
