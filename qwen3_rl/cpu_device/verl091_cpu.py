"""Device-layer shim for verl 0.9.1 on a CPU host: the host as verl's one accelerator, registered through verl's own
platform registry.

``PLATFORM_CPU_HOST``: verl 0.9.1 has no CPU platform: the host as its one device.
verl reaches the device only through its platform (``verl/plugin/platform/``: ``get_device_name``,
``get_torch_device``, ``get_device_id``, ``get_nccl_backend``, ``verl/utils/device.py:96-134``). On a host without an
accelerator its detection falls back to ``"nvidia"`` (``platform_manager.py:110-114``), whose ``PlatformCUDA``
counts ``torch.cuda``'s zero devices. With megatron-core 0.16.1 under ``megatron16_shims`` (``CUDA_CALLS``:
``torch.cuda``'s device calls act on the CPU, as the seed set's verl 0.6.1 Megatron worker runs) three answers of
that device module are missing; :class:`PlatformCPUHost` is verl's ``PlatformCUDA`` (device name ``"cuda"``, so the
engines verl registers for ``cuda`` are found, ``workers/engine/base.py:402-419``) with a device module that is
``torch.cuda`` but for them, registered with ``PlatformRegistry.register("cpu_host")`` (``platform_manager.py:43``)
and detected only where none of verl's own platforms is (no CUDA, NPU or ROCm device):
``device_count()`` = 1: the Megatron engine seeds megatron's CUDA RNG tracker only when the device module counts a
device (``verl/workers/engine/megatron/utils.py:35-38``; on an NPU ``torch.npu`` counts the cards); unseeded,
megatron's layers refuse to initialise (``tensor_parallel/random.py:248``);
``mem_get_info()`` = the host's free / total memory: verl logs it after building the engine
(``transformer_impl.py:657`` -> ``utils/profiler/performance.py:54``), ``torch.cuda`` answers only for a CUDA device;
``get_device_name()`` = ``"CPU"``: the worker's MFU figure looks up the peak FLOPS by name
(``utils/flops_counter.py:76-80``; ``"CPU"`` is the name verl itself gives the host there, ``:77-78``).
The platform's ``is_ipc_supported()`` is False (CUDA's answers True, ``platform_cuda.py:140-141``): the colocated
weight sync to the vLLM server sends host tensors through verl's shared-memory fallback instead of CUDA IPC handles.

:func:`install` registers it (idempotent); call it after ``megatron16_shims.install()`` and before verl's platform
is first asked (the first ``get_device_name()``).
"""

from __future__ import annotations

import os
import types

PLATFORM_NAME = "cpu_host"
_INSTALLED = False


class _HostCudaModule(types.ModuleType):
    """``torch.cuda`` as verl's device module on the host: every attribute is ``torch.cuda``'s (under the
    ``CUDA_CALLS`` shim) but ``device_count``, ``get_device_name``, ``mem_get_info``, ``synchronize`` and
    ``empty_cache`` (the host; the last two also in processes without ``CUDA_CALLS``, e.g. vLLM's CPU worker, where
    verl's weight receiver synchronizes the device, ``vllm_rollout/bucketed_weight_transfer.py:336``)."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch.cuda, name)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: object = None) -> str:
        """``"CPU"``, the name verl gives the host."""
        return "CPU"

    @staticmethod
    def synchronize(device: object = None) -> None:
        """Nothing to wait for: host ops are complete when they return."""

    @staticmethod
    def empty_cache() -> None:
        """Nothing to release: the host has no caching device allocator."""

    @staticmethod
    def mem_get_info(device: object = None) -> tuple[int, int]:
        """(free, total) bytes of the host's memory."""
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _platform_class() -> type:
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    host_module = _HostCudaModule("torch.cuda (CPU host)")

    class PlatformCPUHost(PlatformCUDA):
        """verl's CUDA platform with the CPU host as its one device (see the module docstring)."""

        @property
        def vendor_name(self) -> str:
            return "cpu_host"

        @property
        def device_module(self) -> types.ModuleType:
            return host_module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            import torch

            npu = getattr(torch, "npu", None)
            has_npu = npu is not None and npu.is_available()
            return not (torch.cuda.is_available() or has_npu or torch.version.hip is not None)

        def device_count(self) -> int:
            return 1

        def is_ipc_supported(self) -> bool:
            """False: host tensors have no device IPC handle; verl's colocated weight sync then takes its own
            shared-memory path (``workers/rollout/vllm_rollout/vllm_rollout.py:143``)."""
            return False

    return PlatformCPUHost


def install() -> None:
    """Register :class:`PlatformCPUHost` with verl's platform registry (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from verl.plugin.platform.platform_manager import PlatformRegistry

    PlatformRegistry.register(PLATFORM_NAME)(_platform_class())
    _INSTALLED = True
