"""Start-up hook for every Python process of verl 0.9.1's V1 trainer on CPU: the current set's CPU profile
(``PIN_SET=current bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu``).

Its environment (``python -m qwen3_rl cpu-env``) puts this folder, the checkout and ``qwen3_rl/cpu_device`` on every
process's ``PYTHONPATH``; with
``QWEN3_RL_VERL091_CPU=1`` each process gets the device layer, lazily, so processes that never import verl or megatron
(Ray's own, vLLM's engine core) are untouched:

* on the first import of ``megatron`` (only the trainer's worker processes build the Megatron engine):
  ``megatron16_shims.install()`` just before it (the stand-in TE module must be in place before megatron binds TE
  names; each shim and its reason in that module);
* right after ``verl.plugin.platform.platform_manager`` is imported (every verl process, before its platform is first
  asked): ``verl091_cpu.install()`` (``PLATFORM_CPU_HOST``: the host as verl's one device, see that module);
* right after ``vllm.model_executor.layers.utils`` is imported (vLLM's CPU worker): ``vllm023_reload.install()``
  (``CPU_LINEAR_KEEPS_WEIGHT``: vLLM-CPU's linear layers keep their weight, so the trainer's sync can reload it);
* right after ``vllm.utils.cpu_triton_utils`` is imported (vLLM's CPU worker, before its runner copies the kernel):
  ``vllm023_shims.install()`` (vLLM-CPU 0.23's rejection kernel lacks the ``USE_FP64_GUMBEL`` keyword its rejection
  sampler passes: drafting with sampling stops without it; its ``expand_kernel`` loses the float temperature / top-p
  of draft positions: drafting with sampling samples from a wrong distribution without it);
* right after ``vllm.model_executor.layers.fused_moe.cpu_fused_moe`` is imported (vLLM's CPU worker, a MoE model):
  ``vllm023_shims.install_moe_silu()`` (on a host with AMX, vLLM-CPU 0.23's MoE fallback for non-bfloat16 weights
  builds a ``CustomOp`` at forward time and stops with "Current vLLM config is not set": vllm-project/vllm#45447);
* with ``QWEN3_RL_E2E_PROBE_DIR`` set (a test): the weight-sync probes of ``probe_verl091.py``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any


class _BeforeMegatron(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first ``import megatron`` installs the megatron-core 0.16.1 device shims, then
    lets the real finders load it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "megatron":
            return None
        sys.meta_path.remove(self)
        from qwen3_rl.cpu_device import megatron16_shims

        megatron16_shims.install()
        return None


if os.environ.get("QWEN3_RL_VERL091_CPU") == "1":
    import post_import  # qwen3_rl/cpu_device, on PYTHONPATH

    sys.meta_path.insert(0, _BeforeMegatron())

    def _platform(_module: Any) -> None:
        from qwen3_rl.cpu_device import verl091_cpu

        verl091_cpu.install()

    post_import.after_import("verl.plugin.platform.platform_manager", _platform)

    def _vllm_reload(_module: Any) -> None:
        from qwen3_rl.cpu_device import vllm023_reload

        vllm023_reload.install()

    post_import.after_import("vllm.model_executor.layers.utils", _vllm_reload)

    def _rejection_kernel(_module: Any) -> None:
        from qwen3_rl.cpu_device import vllm023_shims

        vllm023_shims.install()

    post_import.after_import("vllm.utils.cpu_triton_utils", _rejection_kernel)

    def _moe_silu(_module: Any) -> None:
        from qwen3_rl.cpu_device import vllm023_shims

        vllm023_shims.install_moe_silu()

    post_import.after_import("vllm.model_executor.layers.fused_moe.cpu_fused_moe", _moe_silu)

    if os.environ.get("QWEN3_RL_E2E_PROBE_DIR"):  # the tiny run's test: both ends of the weight sync observed
        import probe_verl091

        probe_verl091.install(os.environ["QWEN3_RL_E2E_PROBE_DIR"])
