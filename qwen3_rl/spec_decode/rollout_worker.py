"""The recipe's vLLM 0.23 worker class (``worker_cls``) for the current pin set's train scripts, chosen in the
worker's own process by vLLM's platform, as the seed set's drafter is chosen by its runner at run time
(``qwen3_rl.vllm_plugin.build_sam_drafter``).

    worker_cls="qwen3_rl.spec_decode.rollout_worker.SamWorker"

vLLM resolves ``worker_cls`` in each worker process by importing the module and reading the attribute
(``resolve_obj_by_qualname``); this module answers ``SamWorker`` (PEP 562 ``__getattr__``) with:

======================  =====================================================  =====================================
``current_platform``    class                                                  SAM drafter seat
======================  =====================================================  =====================================
``npu`` (vLLM-Ascend)   ``ascend023_worker.SamNPUWorker``                      vLLM-Ascend's ``AscendNgramProposer``
``cpu`` (vLLM-CPU)      ``custom_class_worker.SamCPUWorker``                   vLLM's ``NgramProposer``
======================  =====================================================  =====================================

Both carry the gc guard (``additional_config.qwen3_rl.disable_gc``) and take SAM's options from
``additional_config.qwen3_rl.sam_config`` with ``speculative_config.method="ngram"``: one command for the CPU profile
and the NPUs. Another platform stops with one line. Both platforms set their own worker only when ``worker_cls`` is
"auto" (vLLM-CPU ``platforms/cpu.py``; vLLM-Ascend 0.23 ``platform.py:659-669``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["NAME", "WORKERS", "worker_class"]

#: the qualified name the train scripts pass as ``engine_kwargs.vllm.worker_cls``
NAME = "qwen3_rl.spec_decode.rollout_worker.SamWorker"
#: vLLM platform ``device_type`` -> the worker class's qualified name
WORKERS = {
    "npu": "qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker",
    "cpu": "qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker",
}


def worker_class(device_type: str | None = None) -> type:
    """The worker class for ``device_type`` (None: vLLM's ``current_platform.device_type`` in this process).

    Raises:
        ValueError: one line, for a platform the recipe has no worker for.
    """
    import importlib

    if device_type is None:
        from vllm.platforms import current_platform

        device_type = str(current_platform.device_type)
    name = WORKERS.get(device_type)
    if name is None:
        raise ValueError(
            f"{NAME}: no recipe worker for vLLM platform {device_type!r} (built: {', '.join(sorted(WORKERS))})"
        )
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def __getattr__(name: str) -> Any:
    if name == "SamWorker":
        return worker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
