"""``torch.npu`` on the host: the device runtime calls vLLM-Ascend 0.13.0 makes, as synchronous host equivalents.

* **Device placement** (:class:`NpuOnHost`): the PrivateUse1 backend is renamed ``"npu"`` so ``torch.device("npu:0")``
  parses; a ``TorchFunctionMode`` turns every ``device="npu..."`` (also the one ``with torch.device("npu")``
  injects), ``Tensor.to("npu")`` and ``pin_memory=True`` / ``Tensor.pin_memory()`` into host equivalents, so the
  tensors vLLM-Ascend makes "on the NPU" are host tensors.
* **Factory calls the mode does not see** (:func:`install_factory_fallback`): a ``TorchFunctionMode`` is off while
  its handler runs, so inside a custom op called through it (vLLM's ``moe_forward``, in which vLLM-Ascend's
  all-to-all dispatcher makes ``torch.empty(..., device=torch.npu.current_device())``,
  ``ops/fused_moe/comm_utils.py:89``) an NPU factory call reaches the dispatcher with the PrivateUse1 key; a
  PrivateUse1 fallback kernel re-runs such an op with the device set to the host.
* **Integer ``torch.histc``** (:func:`histc`): the NPU kernel takes integer input (vLLM-Ascend counts expert ids
  with it, ``ops/fused_moe/token_dispatcher.py:537``), the host kernel is float-only: the stand-in counts a float
  copy and returns the input's dtype. Installed as ``torch.histc`` (not in the function mode: a mode is off inside
  the custom ops vLLM-Ascend runs the MoE layer in). The mode is per thread: it is pushed in the thread that
  runs the engine (in-process engine, async scheduling off).
* **Memory** (:class:`DeviceMemory`): a fixed-size "device" of ``capacity`` bytes whose use is the bytes of the
  tensors created on "npu" that are still alive (weights, KV cache, buffers). ``mem_get_info`` /
  ``memory_stats`` / ``max_memory_allocated`` read it, so vLLM-Ascend's profiling (``worker/worker.py:240-300``)
  sees free memory fall as the model loads, and sizes the KV cache from ``capacity * gpu_memory_utilization``.
* **Streams and events**: one host stream; ``record``/``wait``/``synchronize`` are no-ops (the host is
  synchronous), events time with ``perf_counter``.
* **RNG**: the host generator; ``torch.Generator(device="npu")`` (vLLM's per-request seeded generators,
  ``vllm/v1/worker/gpu_model_runner.py:818``) makes a host generator (:class:`HostGenerator`): a device generator
  needs PrivateUse1 C++ hooks, which a Python stand-in cannot register.
* **SoC**: ``get_soc_version`` reports the SoC the vLLM-Ascend build was made for (``vllm_ascend/_build_info.py``:
  ``A2`` -> 223, ``A3`` -> 253), so ``check_ascend_device_type`` (``utils.py:691-709``) agrees with the build.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: Bytes of the stand-in device (``QWEN3_RL_NPU_MEMORY_GIB``, default 4 GiB: the KV cache vLLM-Ascend sizes
#: from it is allocated in host memory).
DEFAULT_CAPACITY_GIB = 4.0
SOC_BY_BUILD = {"A2": 223, "A3": 253, "_310P": 202}


def _is_npu(device: Any) -> bool:
    if isinstance(device, str):
        return device.split(":", 1)[0] in ("npu", "privateuseone")
    if isinstance(device, torch.device):
        return device.type in ("npu", "privateuseone")
    return False


def host_device(device: Any) -> Any:
    """``device`` with an NPU device replaced by the host (others unchanged)."""
    return torch.device("cpu") if _is_npu(device) else device


class DeviceMemory:
    """Bytes held by live tensors created on the stand-in device; current and peak, like the caching allocator's
    ``allocated_bytes.all.{current,peak}``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.current = 0
        self.peak = 0
        self._lock = threading.Lock()

    def track(self, t: torch.Tensor) -> None:
        n = t.untyped_storage().nbytes() if t.layout == torch.strided else 0
        if not n:
            return
        with self._lock:
            self.current += n
            self.peak = max(self.peak, self.current)
        weakref.finalize(t, self._release, n)

    def _release(self, n: int) -> None:
        with self._lock:
            self.current -= n

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def stats(self) -> dict[str, int]:
        return {"allocated_bytes.all.current": self.current, "allocated_bytes.all.peak": self.peak,
                "reserved_bytes.all.current": self.current, "reserved_bytes.all.peak": self.peak,
                "active_bytes.all.current": self.current, "active_bytes.all.peak": self.peak,
                "num_alloc_retries": 0, "num_ooms": 0}


MEMORY = DeviceMemory(int(float(os.environ.get("QWEN3_RL_NPU_MEMORY_GIB", DEFAULT_CAPACITY_GIB)) * 2**30))


class NpuOnHost(TorchFunctionMode):
    """Maps NPU placement onto the host (see the module docstring); tracks the bytes placed "on the NPU"."""

    _PASSTHROUGH = {torch.Tensor.pin_memory}

    def __torch_function__(self, func, types_, args=(), kwargs=None):  # noqa: ANN001 (torch protocol)
        kwargs = dict(kwargs or {})
        if func in self._PASSTHROUGH:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        placed = False
        dev = kwargs.get("device")
        if _is_npu(dev) or (isinstance(dev, int) and not isinstance(dev, bool)):  # an index: the current NPU
            kwargs["device"] = torch.device("cpu")
            placed = True
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_full,
                    torch.Tensor.new_ones, torch.Tensor.new_tensor) and args:
            new_args = []
            for a in args:
                if _is_npu(a):
                    a, placed = torch.device("cpu"), True
                new_args.append(a)
            args = tuple(new_args)
        out = func(*args, **kwargs)
        if placed and isinstance(out, torch.Tensor) and not (args and out is args[0]):
            MEMORY.track(out)
        return out


_HOST_HISTC = torch.histc


def histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, *,  # noqa: A002 (torch's names)
          out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.histc`` that also takes integer input, as the NPU kernel does (see the module docstring)."""
    if input.is_floating_point() or out is not None:
        return _HOST_HISTC(input, bins=bins, min=min, max=max, out=out)
    return _HOST_HISTC(input.float(), bins=bins, min=min, max=max).to(input.dtype)


_FALLBACK_LIB = None


def _npu_to_host(op: Any, *args: Any, **kwargs: Any) -> Any:
    """PrivateUse1 fallback: ``op`` with its ``device`` on the host (a factory call "on the NPU")."""
    if _is_npu(kwargs.get("device")):
        kwargs["device"] = torch.device("cpu")
        out = op(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            MEMORY.track(out)
        return out
    raise NotImplementedError(f"{op}: no host equivalent of this NPU call in the CPU stand-in (qwen3_rl/cpu_device/npu)")


def install_factory_fallback() -> None:
    """Register :func:`_npu_to_host` as the PrivateUse1 fallback kernel (idempotent)."""
    global _FALLBACK_LIB
    if _FALLBACK_LIB is None:
        _FALLBACK_LIB = torch.library.Library("_", "IMPL")  # noqa: TOR901 (a fallback, not an op)
        _FALLBACK_LIB.fallback(_npu_to_host, "PrivateUse1")


_MODE_TLS = threading.local()


def enter_host_mode() -> None:
    """Push :class:`NpuOnHost` in this thread (idempotent)."""
    if getattr(_MODE_TLS, "mode", None) is None:
        mode = NpuOnHost()
        mode.__enter__()
        _MODE_TLS.mode = mode


# ------------------------------------------------------------------ generators


class _HostGeneratorMeta(type):
    """Keeps ``isinstance(g, torch.Generator)`` true for every generator (also torch's own default ones)."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, torch._C.Generator)


class HostGenerator(torch._C.Generator, metaclass=_HostGeneratorMeta):
    """``torch.Generator`` with an NPU device mapped to the host: ``HostGenerator(device="npu")`` returns a host
    ``torch._C.Generator`` (same seeding, same stream of numbers as ``torch.Generator("cpu")``)."""

    def __new__(cls, device: Any = "cpu") -> torch._C.Generator:  # type: ignore[misc]
        return torch._C.Generator(host_device(device if device is not None else "cpu"))


# ------------------------------------------------------------------ streams and events


class Stream:
    """A host "stream": work is synchronous, so waiting and synchronising do nothing."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device(torch._C._get_privateuse1_backend_name(), 0)
        self.priority = priority
        self.npu_stream = 0

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Event:
    """A host event: recorded at once; ``elapsed_time`` in ms between two records."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **kwargs: Any) -> None:
        self.t: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Event) -> float:
        return 1000.0 * ((end.t or 0.0) - (self.t or 0.0))


_DEFAULT_STREAM: Stream | None = None


@contextlib.contextmanager
def stream(s: Stream | None = None) -> Iterator[Stream | None]:
    yield s


def current_stream(device: Any = None) -> Stream:
    global _DEFAULT_STREAM
    if _DEFAULT_STREAM is None:
        _DEFAULT_STREAM = Stream()
    return _DEFAULT_STREAM


default_stream = current_stream


class _GraphNotOnHost:
    """``NPUGraph`` & co.: referenced at import (``compilation/acl_graph.py:30,587-589``); graph capture needs the
    device runtime, so building one raises (the stand-in runs eager mode only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("NPU graph capture is not available on the CPU stand-in: run with enforce_eager=True")


#: ``torch.npu`` calls of the NPU graph runtime that vLLM-Ascend makes in graph mode only.
GRAPH_RUNTIME_CALLS = ("graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin",
                       "graph_task_update_end", "_launch_host_func", "_subscribe_report", "_unsubscribe_report")


# ------------------------------------------------------------------ the torch.npu module


def _soc_version() -> int:
    try:
        from vllm_ascend import _build_info  # type: ignore[import-not-found]

        return SOC_BY_BUILD.get(getattr(_build_info, "__device_type__", "A2"), 223)
    except ImportError:
        return SOC_BY_BUILD["A3"]


def _visible_devices() -> int:
    vis = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    return len([v for v in vis.split(",") if v.strip()]) if vis else 16


_CURRENT = threading.local()
_POOL_IDS = itertools.count(1)


def build_npu_module() -> types.ModuleType:
    """The ``torch.npu`` (= ``torch_npu.npu``) stand-in module."""
    m = types.ModuleType("torch.npu")
    m.__doc__ = __doc__
    m.Stream, m.Event, m.ExternalEvent = Stream, Event, Event
    m.NPUGraph = m.graph = _GraphNotOnHost
    # an opaque pool id, as torch.cuda.graph_pool_handle returns: NPUPlatform.get_global_graph_pool
    # (vllm/platforms/interface.py:602) takes one when an ACLGraphWrapper is built (compilation/acl_graph.py:79),
    # before any capture; capturing still raises (NPUGraph)
    m.graph_pool_handle = lambda: (0, next(_POOL_IDS))
    # the graph runtime's parameter updates and host callbacks (compilation/acl_graph.py: full-graph attention
    # updates; worker/model_runner_v1.py): graph mode only, raising like NPUGraph
    for name in GRAPH_RUNTIME_CALLS:
        setattr(m, name, _GraphNotOnHost)
    m.stream, m.current_stream, m.default_stream = stream, current_stream, default_stream
    m.set_stream = lambda s=None: None
    m.is_available = lambda: True
    m.is_initialized = lambda: True
    m.init = lambda: None
    m.device_count = _visible_devices
    m.current_device = lambda: getattr(_CURRENT, "index", 0)

    def set_device(device: Any) -> None:
        idx = device.index if isinstance(device, torch.device) else (
            int(str(device).split(":")[1]) if ":" in str(device) else int(device) if str(device).isdigit() else 0)
        _CURRENT.index = idx or 0
        enter_host_mode()

    m.set_device = set_device
    m.device = lambda device=None: contextlib.nullcontext()
    m.get_device_name = lambda device=None: "Ascend CPU stand-in"
    m.get_device_capability = lambda device=None: None
    m.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="Ascend CPU stand-in", total_memory=MEMORY.capacity, multi_processor_count=1, cube_core_num=1,
        vector_core_num=1)
    m.get_soc_version = _soc_version
    m.synchronize = lambda device=None: None
    m.empty_cache = lambda: None
    m.mem_get_info = lambda device=None: (MEMORY.capacity - MEMORY.current, MEMORY.capacity)
    m.memory_stats = lambda device=None: MEMORY.stats()
    m.memory_allocated = lambda device=None: MEMORY.current
    m.max_memory_allocated = lambda device=None: MEMORY.peak
    m.memory_reserved = lambda device=None: MEMORY.current
    m.max_memory_reserved = lambda device=None: MEMORY.peak
    m.reset_peak_memory_stats = lambda device=None: MEMORY.reset_peak()
    m.reset_max_memory_allocated = m.reset_peak_memory_stats
    m.manual_seed = m.manual_seed_all = lambda seed: torch.manual_seed(seed)
    m.seed = m.seed_all = lambda: torch.seed()
    m.initial_seed = torch.initial_seed
    m.get_rng_state = lambda device=None: torch.get_rng_state()
    m.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    m.set_compile_mode = lambda **kwargs: None
    m.set_option = lambda *a, **k: None
    m.config = types.SimpleNamespace(allow_internal_format=False)
    m.utils = types.SimpleNamespace(_get_device_index=lambda d=None, optional=False: 0)
    m.memory = types.SimpleNamespace(_set_allocator_settings=lambda *a, **k: None,
                                     NPUPluggableAllocator=_GraphNotOnHost, MemPool=_GraphNotOnHost)
    m._lazy_init = lambda: None
    # profiler range markers (verl/utils/profiler/mstx_profile.py:23 imports them on an NPU): nothing to mark
    m.mstx = types.SimpleNamespace(range_start=lambda message=None, *a, **k: 0, range_end=lambda *a, **k: None,
                                   mark=lambda *a, **k: None, mstx_range=lambda *a, **k: (lambda f: f))
    return m
