"""verl 0.9.1's NPU Megatron engine (``MindspeedEngineWithLMHead``) with MindSpeed core_r0.16.0's adaptor imported
the way verl imports it on an NPU, on CPU over gloo; the rest is ``verl091_engine_driver.engine_main``.

    python tests/helpers/verl091_mindspeed_driver.py engine HF_DIR OUT_DIR   # every rank (RANK / WORLD_SIZE / ...)
    python tests/helpers/verl091_mindspeed_driver.py adaptor OUT_JSON        # one process
    python tests/helpers/verl091_mindspeed_driver.py repatch CASES OUT_JSON  # one process (repatch_main)
    python tests/helpers/verl091_mindspeed_driver.py check present|as-is     # one process (check_main)

The MindSpeed tree (pinned archive, ``patches/current/mindspeed`` applied) is on ``PYTHONPATH``. How verl 0.9.1 applies
MindSpeed on an NPU (``verl/workers/engine/``):

* ``__init__.py:54-61``: ``from .mindspeed import ...`` ("must be imported before Megatron"), inside
  ``try / except ImportError`` (a warning);
* ``mindspeed/transformer_impl.py:18-21``: ``from mindspeed.megatron_adaptor import repatch``, inside
  ``try / except ImportError: repatch = None`` (no message). Importing ``mindspeed.megatron_adaptor`` runs MindSpeed's
  whole patch pass (``megatron_adaptor.py:66`` -> ``patch_features``, ``:23-42``: the features' pre-patches and
  patches);
* ``:56``: ``MindspeedEngineWithLMHead`` is the engine registered for ``device="npu"``; ``EngineRegistry`` picks it by
  ``get_device_name()`` or ``VERL_ENGINE_DEVICE`` (``workers/engine/base.py:402-406``);
* ``:40-53, 67-74``: before ``initialize_model_parallel`` the engine calls ``repatch(config)`` (MindSpeed's
  ``megatron_adaptor.py:57-63``: remove every patch, apply them again with verl's ``override_transformer_config`` and
  ``use_flash_attn``), only ``if repatch is not None``.

This driver: the device layer of the plain check without its Transformer Engine stand-in (:func:`install_device_shims`:
on an NPU MindSpeed supplies TE), the stand-ins MindSpeed needs (:func:`install_npu_stand_ins`), verl's own switches
``VERL_PLATFORM=cpu_host`` (its platform stays the host) and ``VERL_ENGINE_DEVICE=npu`` (the NPU engine class), then
``import verl.workers.engine`` as verl's worker does. What MindSpeed did is recorded (:func:`verl_state`) before the
engine runs; rank 0 writes OUT_DIR/mindspeed.json and, after ``engine_main`` (as the plain check: OUT_DIR/engine.pt,
params_rank*.pt), OUT_DIR/kernels.json (calls of each torch_npu kernel stand-in).

Stand-ins, each named with its reason. Device and kernel layer:

* ``torch_npu`` (``tests/helpers/mindspeed_shims.py``: the TND attention kernels and ``mindspeed.op_builder``), plus:
  ``NPU_SPEC`` (accelerate's ``is_npu_available`` calls ``find_spec("torch_npu")``, ``accelerate/utils/imports.py:379``,
  which raises for a module without a spec); ``NO_NPU`` (``torch.npu.is_available()`` False, ``device_count()`` 0: no
  NPU on the host); ``MSTX`` (``torch_npu.npu.mstx``: MindSpeed maps ``torch.cuda.nvtx.range_push/pop`` onto its
  profiler markers, ``requirements_basic.py:35-36``; no-ops); ``DEVICE_RUNTIME`` (``_lazy_call``, ``device``:
  ``core/megatron_basic/megatron_basic.py:9``); ``RNG`` (``torch.npu.default_generators``: MindSpeed's
  ``_set_cuda_rng_state``, ``:42``, on the host generator); ``DTYPES`` (``torch_npu.unsupported_dtype``, read while
  MindSpeed validates the TransformerConfig mbridge builds, ``core/multi_modal/dist_train/dist_communication.py:23``);
  ``HCCL_OPTIONS`` (``ProcessGroupHCCL.Options`` of ``qwen3_rl/cpu_device/npu/hccl.py``: MindSpeed names every group
  in them, ``functional/profiler/profiler_info.py:9-16``; the groups stay gloo's); ``KERNELS`` (the repo's PyTorch
  references of torch_npu's kernels, ``qwen3_rl/cpu_device/npu/ops.py``, e.g. ``npu_rms_norm`` for MindSpeed's
  ``TELayerNormColumnParallelLinear``, ``te/pytorch/module/layernorm_column_parallel_linear.py:248``; counted);
  ``CAUSAL_MODE`` (MindSpeed's flash attention asks ``sparse_mode`` 2, the TND stand-in has the equal mode 3 where
  queries and keys have the same lengths, checked); ``NPU_DEVICE`` (MindSpeed's TE modules allocate on
  ``device="npu"``: the host, as ``CUDA_CALLS`` has it for ``"cuda"``); ``OP_LIBRARY`` (``mindspeed.op_builder``'s
  ``builder`` / per-op modules: CANN op builders, which import ``torchair``; the library records the NPU kernels
  MindSpeed's ops modules register);
* ``torch_npu.contrib.transfer_to_npu`` (``TRANSFER_TO_NPU``, ``megatron_adaptor.py:11``): on an NPU it renames
  ``cuda`` to ``npu`` in torch's device calls; ``CUDA_CALLS`` maps them to the host already: an empty module;
* ``triton`` (``TRITON``): MindSpeed imports its Triton kernels at patch time (``requirements_basic.py:32`` ->
  ``ops/triton/l2norm.py:9``, ``ops/triton/utils.py:18-21``, which asks the active driver's backend at import);
  triton-ascend is the NPU image's kernel compiler. Kernel objects raise when launched, ``triton.language`` names are
  placeholders, the driver's backend is ``"npu"``; installed after torch's inductor is imported.

Not device layer, one environment stand-in: ``TRANSFORMERS_ALIASES``. MindSpeed's patch pass looks up each patched
name on every module in ``sys.modules`` (``mindspeed/patch_utils.py:126-128``, also ``:95-97``); transformers 5's
backward-compatibility alias modules (``transformers/__init__.py:803-847``, 204 of them once verl is imported) import
their target on any lookup, and the image-processor targets import torchvision. The cluster image has torchvision (a
vLLM requirement); this venv cannot (PyPI's torchvision 0.28.0 is CUDA-linked: ``operator torchvision::nms does not
exist`` against torch 2.13.0+cpu). So the alias modules leave ``sys.modules`` just before the adaptor is imported and
again before the engine's ``repatch``. The ``adaptor`` mode runs verl's import without it and records what happens
then: the adaptor's ImportError (torchvision), swallowed by verl (``repatch`` None), no patch applied.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

from qwen3_rl.cpu_device import megatron16_shims, verl091_cpu


def install_device_shims() -> None:
    """``megatron16_shims`` without its Transformer Engine stand-in (``TE_MODULES``, ``TE_SPEC``): on an NPU MindSpeed
    provides the TE classes (``transformer_engine_basic.py:108-131``) and the TE package megatron imports
    (``requirements_basic.py:37-57``, dummies), so here too. The rest as in the plain engine check: gloo for the
    device backend, ``torch.cuda``'s calls on the host, the RNG tracker on the host generator, the MoE host copy,
    the router GEMM; then the host as verl's platform."""
    from qwen3_rl.cpu_device import megatron_shims

    megatron_shims._dist_backend()
    megatron_shims._torch_cpu_device()
    megatron_shims._cuda_calls()
    megatron_shims._rng_tracker()
    megatron_shims._moe_host_copy()
    megatron16_shims._router_gemm()
    verl091_cpu.install()


if __name__ == "__main__":  # both modes
    install_device_shims()  # before megatron is imported

import torch  # noqa: E402


class _Placeholder:
    """A ``triton.language`` name: any attribute, call or subscript is another placeholder (never run)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder(f"{self._name}()")

    def __getitem__(self, key: object) -> _Placeholder:
        return self


class _TritonKernel:
    """A ``@triton.jit`` function: launching it raises (no host reference)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def _fail(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"triton kernel {self.__name__}: no host reference (CPU stand-in)")

    def __getitem__(self, grid: object) -> Any:
        return self._fail

    __call__ = _fail


def _decorator(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0] if isinstance(args[0], _TritonKernel) else _TritonKernel(args[0])
    return lambda fn: fn if isinstance(fn, _TritonKernel) else _TritonKernel(fn)


class _LanguageModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _RecordingLibrary(torch.library.Library):
    """MindSpeed's ``AS_LIBRARY`` (``op_builder/builder.py:11``) for ops no builder defines here: ``define`` and
    ``impl`` record the names (CANN kernels, never called on this path) and register nothing."""

    def __init__(self, ns: str, kind: str) -> None:
        self.ns, self.kind = ns, kind
        self.defined: list[str] = []
        self.implemented: list[str] = []

    def define(self, schema: str, *args: object, **kwargs: object) -> str:
        self.defined.append(schema)
        return schema.split("(", 1)[0]

    def impl(
        self, op_name: object, fn: object, dispatch_key: str = "", *args: object, **kwargs: object
    ) -> None:
        self.implemented.append(f"{op_name}:{dispatch_key}")

    def _destroy(self) -> None:
        pass

    def __del__(self) -> None:
        pass


class _OpBuilderModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``mindspeed.op_builder.<name>`` submodules (the per-op builder files, which import ``torchair``, the
    NPU graph compiler) as modules whose ``*Builder`` names are the stand-in's builders."""

    PREFIX = "mindspeed.op_builder."

    def __init__(self, package: types.ModuleType) -> None:
        self.package = package

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name.startswith(self.PREFIX) and name.count(".") == 2 and name not in sys.modules:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = types.ModuleType(spec.name)
        mod.__getattr__ = self.package.__getattr__  # type: ignore[method-assign]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _HostGenerators:
    """``torch.npu.default_generators``: every device index names the host's default generator."""

    def __getitem__(self, idx: object) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return 1


class _HostDevice:
    """``torch_npu.npu.device(idx)``: a context that selects a device; the host has one."""

    def __init__(self, device: object = None) -> None:
        self.device = device

    def __enter__(self) -> _HostDevice:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


def _module(name: str, cls: type = types.ModuleType, **attrs: Any) -> types.ModuleType:
    mod = cls(name)
    mod.__path__ = []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


def install_triton_stand_in() -> None:
    """``TRITON`` (module docstring)."""
    # torch's inductor takes an importable triton for the real compiler (runtime/hints.py:57, triton_compat.py:18):
    # it is imported first, while there is none
    import torch._inductor.runtime.hints  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401

    _module(
        "triton",
        jit=_decorator,
        autotune=_decorator,
        heuristics=_decorator,
        Config=lambda *a, **k: (a, k),
        cdiv=lambda a, b: -(-a // b),
        next_power_of_2=lambda n: 1 << (int(n) - 1).bit_length(),
        __version__="3.2.0",
    )
    for name in ("triton.language", "triton.language.extra", "triton.language.extra.libdevice"):
        _module(name, _LanguageModule)
    target = types.SimpleNamespace(backend="npu", arch="Ascend910_93", warp_size=0)
    _module("triton.runtime")
    _module("triton.runtime.driver", active=types.SimpleNamespace(get_current_target=lambda: target))
    _module("triton.testing")


#: calls of each torch_npu kernel stand-in in this process
KERNEL_CALLS: dict[str, int] = {}
#: the CANN of the current set's image (pins.toml [sets.current] cann), for ``CANN_VERSION``
CANN_VERSION = "9.1.0"


def npu_rotary_position_embedding(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: int = 0
) -> torch.Tensor:
    """PyTorch reference of MindSpeed's RoPE kernel: ``x * cos + rotate(x) * sin``, x [..., D], cos / sin
    broadcastable to x; mode 0 rotates halves (x1, x2) -> (-x2, x1), mode 1 interleaved pairs."""
    if mode == 0:
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    elif mode == 1:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise NotImplementedError(f"npu_rotary_position_embedding stand-in: mode {mode}")
    return x * cos + rot * sin


def _counted(name: str, fn: Any) -> Any:
    import functools

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        KERNEL_CALLS[name] = KERNEL_CALLS.get(name, 0) + 1
        return fn(*args, **kwargs)

    return call


def _left_up_causal(fn: Any) -> Any:
    """``CAUSAL_MODE``: MindSpeed's flash attention asks ``sparse_mode`` 2 (left-up causal, j <= i); the TND stand-in
    has 3 (right-down, j <= i + S_kv - S_q), the same mask where every sequence has as many keys as queries (checked),
    as in self-attention."""
    import functools

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("sparse_mode") == 2:
            q, kv = kwargs.get("actual_seq_qlen"), kwargs.get("actual_seq_kvlen")
            if q is None or kv is None or list(q) != list(kv):
                raise NotImplementedError("sparse_mode 2 with unequal query / key lengths")
            kwargs["sparse_mode"] = 3
        return fn(*args, **kwargs)

    return call


def _host(device: object) -> object:
    """``"npu"``, ``"npu:N"`` or ``torch.device("npu", N)`` -> ``"cpu"``; anything else unchanged."""
    if isinstance(device, str) and device.split(":")[0] == "npu":
        return "cpu"
    if isinstance(device, torch.device) and device.type == "npu":
        return "cpu"
    return device


def _npu_device_on_host() -> None:
    """``NPU_DEVICE``: MindSpeed's TE modules make their tensors on ``device="npu"`` (e.g.
    ``te/pytorch/module/layernorm_column_parallel_linear.py:137``); the NPU is the host here, as ``megatron_shims``'
    ``CUDA_CALLS`` has it for ``"cuda"``: PrivateUse1 is named ``npu`` (so the name parses) and torch's factories,
    ``Tensor.to`` / ``Module.to`` and ``Tensor.npu`` put such tensors on the host."""
    import functools

    from qwen3_rl.cpu_device import megatron_shims

    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    # a renamed PrivateUse1 without C++ hooks makes torch's accelerator query raise (torch.distributed.barrier,
    # distributed_c10d.py:5327): the accelerator is the host (as qwen3_rl/cpu_device/npu/stand_in.py has it)
    torch._C._get_accelerator = lambda check=False: torch.device("cpu")

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _host(kwargs["device"])
            return fn(*args, **kwargs)

        return call

    for name in megatron_shims.DEVICE_FACTORIES:
        setattr(torch, name, wrap(getattr(torch, name)))

    def wrap_to(fn: Any) -> Any:
        @functools.wraps(fn)
        def to(self: Any, *args: Any, **kwargs: Any) -> Any:
            if args:
                args = (_host(args[0]), *args[1:])
            if "device" in kwargs:
                kwargs["device"] = _host(kwargs["device"])
            return fn(self, *args, **kwargs)

        return to

    torch.Tensor.to = wrap_to(torch.Tensor.to)
    torch.nn.Module.to = wrap_to(torch.nn.Module.to)
    torch.Tensor.npu = lambda self, *args, **kwargs: self  # type: ignore[attr-defined]


def install_npu_stand_ins(repo_tests: Path) -> None:
    """The stand-ins of the module docstring, before anything imports MindSpeed."""
    sys.path.insert(0, str(repo_tests))
    from helpers import mindspeed_shims

    mindspeed_shims.install()
    # its megatron.training stand-in is for the seed set's MindSpeed; core_r0.16.0 checks for the real package
    # (patch_utils.py:10-27), which the megatron-core wheel does not ship
    del sys.modules["megatron.training"]
    tnpu = sys.modules["torch_npu"]
    tnpu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None, is_package=True)  # NPU_SPEC
    tnpu.__path__ = []
    npu = torch.npu
    npu.is_available = lambda: False  # NO_NPU
    npu.device_count = lambda: 0
    npu.mstx = types.SimpleNamespace(range_start=lambda *a, **k: 0, range_end=lambda *a, **k: None)  # MSTX
    npu.Stream = type("Stream", (), {})  # annotation only (dot_product_attention.py:162, 257)
    # DEVICE_RUNTIME: torch_npu's lazy-init queue and device context (core/megatron_basic/megatron_basic.py:9); the host
    # needs no initialisation and has one device
    npu._lazy_call = lambda callback, **kwargs: callback()
    npu.device = _HostDevice
    # RNG: MindSpeed's _set_cuda_rng_state sets torch.npu.default_generators[idx] (core/megatron_basic/
    # megatron_basic.py:42); the device's generator is the host's (as megatron_shims' RNG_TRACKER has it)
    npu.default_generators = _HostGenerators()
    tnpu.npu = npu
    # KERNELS: the repo's PyTorch references of torch_npu kernels (qwen3_rl/cpu_device/npu/ops.py, unit-tested in
    # tests/cpu_device/test_npu_ops.py), counted in KERNEL_CALLS; MindSpeed's TE modules call them (e.g.
    # npu_rms_norm, te/pytorch/module/layernorm_column_parallel_linear.py:248)
    from qwen3_rl.cpu_device.npu.ops import TORCH_NPU_OPS

    for name, fn in TORCH_NPU_OPS.items():
        setattr(tnpu, name, _counted(name, fn))
    for name in ("npu_fusion_attention", "npu_fusion_attention_grad"):
        setattr(tnpu, name, _counted(name, _left_up_causal(getattr(tnpu, name))))
    # DTYPES: torch_npu's list of dtypes the NPU lacks (MindSpeed's dist-train feature reads it while validating the
    # TransformerConfig mbridge builds, core/multi_modal/dist_train/dist_communication.py:23): the quantized ones
    tnpu.unsupported_dtype = [torch.quint8, torch.quint4x2, torch.quint2x4, torch.qint32, torch.qint8]
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None, is_package=True)
    npu.__path__ = []
    sys.modules["torch_npu.npu"] = npu
    # OP_LIBRARY: mindspeed_shims' op_builder stand-in as a package with ``builder`` (MindSpeed's ops modules import
    # ``AS_LIBRARY`` / ``MindSpeedOpBuilder`` from it at import, e.g. ops/npu_all_to_all_all_gather_bmm.py:6, 20, and
    # register NPU-key kernels of CANN ops the builders would define); the library records them, registers nothing
    ob = sys.modules["mindspeed.op_builder"]
    ob.__path__ = []
    ob.__spec__ = importlib.machinery.ModuleSpec("mindspeed.op_builder", None, is_package=True)
    _module(
        "mindspeed.op_builder.builder",
        AS_LIBRARY=_RecordingLibrary("mindspeed", "DEF"),
        MindSpeedOpBuilder=mindspeed_shims._NpuOpBuilder,
    )
    sys.meta_path.insert(0, _OpBuilderModules(ob))  # mindspeed.op_builder.<name>_builder: the same builders
    # HCCL_OPTIONS: MindSpeed wraps megatron's get_nccl_options to name each group in torch_npu's HCCL options
    # (functional/profiler/profiler_info.py:9-16); the options type of the repo's stand-in (qwen3_rl/cpu_device/npu/
    # hccl.py); the groups are gloo's, which megatron16_shims' DIST_BACKEND creates without device options
    from qwen3_rl.cpu_device.npu.hccl import ProcessGroupHCCL

    _module("torch_npu._C")
    _module("torch_npu._C._distributed_c10d", ProcessGroupHCCL=ProcessGroupHCCL)
    _npu_device_on_host()
    _module("torch_npu.contrib")
    _module("torch_npu.contrib.transfer_to_npu")  # TRANSFER_TO_NPU
    install_triton_stand_in()
    # ACL / CANN_VERSION: MindSpeed's MoE overlap modules ask pyACL for the SoC and torch_npu for the CANN version at
    # import (moe_feature/overlap/moe_layer_overlap_allgather.py:4, :63; token_dispatcher.py:5, :53): an A3 SoC and
    # pins.toml's CANN of the current set
    _module("acl", get_soc_name=lambda: "Ascend910_93")
    _module("torch_npu.utils")
    _module("torch_npu.utils.collect_env", get_cann_version=lambda: CANN_VERSION)
    # ROPE_KERNEL: MindSpeed's fused RoPE (core/fusions/fused_rope.py:68-70) loads its CANN kernel through
    # RotaryPositionEmbeddingOpBuilder (ops/npu_rotary_position_embedding.py:7-12): the PyTorch reference, counted
    rope = _counted("npu_rotary_position_embedding", npu_rotary_position_embedding)
    ob.RotaryPositionEmbeddingOpBuilder = type(
        "RotaryPositionEmbeddingOpBuilder",
        (mindspeed_shims._NpuOpBuilder,),
        {"load": lambda self: types.SimpleNamespace(npu_rotary_position_embedding=rope)},
    )


def hide_transformers_aliases() -> list[str]:
    """``TRANSFORMERS_ALIASES`` (not a device shim; the environment's missing torchvision, see the module docstring):
    transformers' backward-compatibility alias modules (``transformers/__init__.py:803-847``: ``*_fast`` names whose
    module ``__getattr__`` imports the target for any name) leave ``sys.modules``. Returns their names."""
    import transformers  # noqa: F401

    names = [
        k
        for k, m in list(sys.modules.items())
        if k.startswith("transformers.") and k.endswith("_fast") and getattr(m, "__file__", 1) is None
    ]
    for k in names:
        del sys.modules[k]
    return names


class _HideAliasesBeforeAdaptor(importlib.abc.MetaPathFinder):
    """Runs :func:`hide_transformers_aliases` when ``mindspeed.megatron_adaptor`` is about to be imported (inside
    verl's ``import verl.workers.engine``, whose FSDP engine import brings the aliases back); finds nothing itself."""

    def __init__(self) -> None:
        self.hidden: list[str] = []

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "mindspeed.megatron_adaptor":
            self.hidden += hide_transformers_aliases()
        return None


def patches() -> dict:
    """MindSpeed's patch registry in this process: names registered, applied, and applied to megatron."""
    from mindspeed.patch_utils import MindSpeedPatchesManager

    info = MindSpeedPatchesManager.patches_info
    applied = sorted(k for k, p in info.items() if p.is_applied)
    return {
        "registered": sorted(info),
        "applied": applied,
        "megatron_applied": [k for k in applied if k.startswith("megatron.")],
    }


def te_classes() -> dict[str, str]:
    """The classes megatron's TE module holds now (MindSpeed's ``TransformerEngineBasicFeature`` replaces them,
    ``transformer_engine_basic.py:108-131``; unpatched they are ``megatron16_shims``' CPU stand-ins)."""
    from megatron.core.extensions import transformer_engine as te

    names = ("TEDotProductAttention", "TELayerNormColumnParallelLinear", "TERowParallelLinear")
    return {
        n: f"{getattr(te, n).__module__}.{getattr(te, n, None).__qualname__}"
        if isinstance(getattr(te, n), type)
        else repr(getattr(te, n))
        for n in names
    }


def verl_state() -> dict:
    """After ``import verl.workers.engine``: the engine class verl's registry gives, verl's ``repatch`` (None when
    the adaptor's import raised an ImportError), MindSpeed's patches, megatron's TE classes."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.mindspeed import transformer_impl

    cls = EngineRegistry.get_engine_cls("language_model", "megatron")
    import mindspeed

    return {
        "engine_class": f"{cls.__module__}.{cls.__qualname__}",
        "repatch_is_none": transformer_impl.repatch is None,
        "mindspeed_file": mindspeed.__file__,
        "adaptor_in_sys_modules": "mindspeed.megatron_adaptor" in sys.modules,
        **patches(),
        "te_classes": te_classes(),
    }


def adaptor_main(out: Path) -> int:
    """``adaptor`` mode: verl's import of its engines (``import verl.workers.engine``, MindSpeed's adaptor inside) with
    the stand-ins and nothing else; OUT (JSON): :func:`verl_state`, and "error": what the adaptor's import raised
    ({"type", "message", "frames": ["file:line function", ...]} or None, observed by ``mindspeed_check._WatchAdaptor``)."""
    here = Path(__file__).resolve().parent
    install_npu_stand_ins(here.parent)
    os.environ["VERL_PLATFORM"] = verl091_cpu.PLATFORM_NAME
    os.environ["VERL_ENGINE_DEVICE"] = "npu"
    from qwen3_rl.tools.launch import mindspeed_check

    watch = mindspeed_check._WatchAdaptor()  # the preflight check's observer of the adaptor's import
    sys.meta_path.insert(0, watch)
    import verl.workers.engine  # noqa: F401

    res: dict = {**verl_state(), "error": None}
    if watch.error is not None:
        frames = traceback.extract_tb(watch.error.__traceback__)
        res["error"] = {
            "type": type(watch.error).__name__,
            "message": str(watch.error),
            "frames": [f"{f.filename}:{f.lineno} {f.name}" for f in frames],
        }
    out.write_text(json.dumps(res, indent=1))
    return 0


#: MindSpeed's options of the switches FUSED_ROPE, MOE_ALLTOALL_OVERLAP, MOE_ZERO_MEMORY(_NUM_LAYERS) (features.toml)
SWITCH_ARGS = (
    "use_fused_rotary_pos_emb",
    "position_embedding_type",
    "moe_alltoall_overlap_comm",
    "moe_token_dispatcher_type",
    "moe_zero_memory",
    "moe_zero_memory_num_layers",
)


def switch_args() -> dict[str, Any]:
    """MindSpeed's runtime args (``args_utils.get_full_args``, what its patched functions read) of :data:`SWITCH_ARGS`
    ("<absent>" where MindSpeed has no such arg)."""
    from mindspeed.args_utils import get_full_args

    args = get_full_args()
    return {k: getattr(args, k, "<absent>") for k in SWITCH_ARGS}


def _qualname(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def moe_classes() -> dict[str, str]:
    """What megatron's MoE names hold now: the MoE layer class and the shared experts' / MLP's forward (MindSpeed's
    overlap replaces the layer, ``features_manager/moe/moe_alltoall_overlap.py:49-68``; zero memory the shared
    experts' forward, ``moe_zero_memory.py:36-41``)."""
    from megatron.core.transformer import mlp
    from megatron.core.transformer.moe import moe_layer, shared_experts

    return {
        "MoELayer": _qualname(moe_layer.MoELayer),
        "SharedExpertMLP.forward": _qualname(shared_experts.SharedExpertMLP.forward),
        "MLP.__init__": _qualname(mlp.MLP.__init__),
    }


def tf_config(override: dict[str, Any]) -> Any:
    """The TransformerConfig verl's engine gets for a 4-layer Qwen3-MoE (4 experts, top 2; hidden 16) with
    ``override`` (its mapped ``override_transformer_config``): mbridge's ``AutoBridge.from_config`` and
    ``set_extra_args(**override)``, ``.config``, as ``transformer_impl.py:329-332`` (the overrides become
    TransformerConfig kwargs, ``mbridge/core/llm_bridge.py:97-107``; MindSpeed's init wrapper keeps the ones megatron
    lacks and merges its args in, ``core/megatron_basic/arguments_basic.py:102-127``, then validates its features'
    args, ``:72-97``)."""
    from transformers import Qwen3MoeConfig
    from verl.models.mcore.mbridge import AutoBridge

    hf = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    bridge = AutoBridge.from_config(hf, dtype=torch.float32)
    bridge.set_extra_args(**override)
    return bridge.config


def rope_probe(cfg: Any) -> dict[str, Any]:
    """megatron's ``apply_rotary_pos_emb`` (MindSpeed's, ``core/fusions/fused_rope.py:93-120``) with ``cfg`` on a
    [S=5, B=1, H=2, D=8] tensor: the result and how often the RoPE kernel ran."""
    from megatron.core.models.common.embeddings import rope_utils

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(5, 1, 2, 8, generator=gen)
    freqs = torch.randn(5, 1, 1, 8, generator=gen)
    before = KERNEL_CALLS.get("npu_rotary_position_embedding", 0)
    out = rope_utils.apply_rotary_pos_emb(t, freqs, cfg)
    return {"out": out, "kernel_calls": KERNEL_CALLS.get("npu_rotary_position_embedding", 0) - before}


def zero_memory_layers(cfg: Any) -> dict[str, Any]:
    """``cfg``'s switch fields and per layer MindSpeed's zero-memory choice ``only_recompute_activation``
    (``moe_feature/overlap/moe_common.py:306-331``, from ``cfg.moe_zero_memory_num_layers``: True = level1 keeps
    only the activation's recompute on that layer)."""
    from mindspeed.core.transformer.moe.moe_feature.overlap.moe_common import only_recompute_activation

    return {
        "config": {k: getattr(cfg, k, "<absent>") for k in SWITCH_ARGS},
        "only_recompute_activation": [bool(only_recompute_activation(cfg, n)) for n in range(1, 5)],
    }


def _default_switch_args() -> None:
    """:data:`SWITCH_ARGS` back to MindSpeed's defaults (absent where it has none): ``repatch`` sets the given keys on
    the one args object and resets none (``megatron_adaptor.py:57-63``); a worker repatches once, each case here
    starts as a fresh worker would."""
    from mindspeed.args_utils import get_full_args, get_mindspeed_args

    args, defaults = get_full_args(), get_mindspeed_args(get_defaults=True)
    for k in SWITCH_ARGS:
        if hasattr(defaults, k):
            setattr(args, k, getattr(defaults, k))
        elif hasattr(args, k):
            delattr(args, k)


def _one_rank_model_parallel() -> None:
    """World of one (gloo on 127.0.0.1, a free port) and megatron's model-parallel groups, all of size 1 (mbridge
    reads the sizes from them, ``mbridge/core/llm_bridge.py:70-75``)."""
    from megatron.core import parallel_state
    from ports import free_port

    port = free_port()  # tests/helpers/ports.py: outside the ephemeral range
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()


def repatch_main(cases_json: Path, out: Path) -> int:
    """``repatch`` mode: verl's import of its engines as in ``engine`` mode, then per case {"name", "overrides":
    Hydra overrides of ``ppo_megatron_trainer.yaml``} in order: the actor's engine config as verl's worker converts it
    (``omega_conf_to_dataclass(actor_rollout_ref.actor.megatron)``: ``McoreEngineConfig``), verl's own ``_mindspeed_repatch`` on it (what
    the NPU engine runs before ``initialize_model_parallel``, ``transformer_impl.py:40-53, 67-74``), then
    :func:`switch_args`, :func:`moe_classes`, :func:`rope_probe`, :func:`zero_memory_layers`. OUT: JSON per case
    (the RoPE outputs compared here: ``rope_equal_to_first``)."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.megatron_utils import mapping_string_to_attn_backend

    here = Path(__file__).resolve().parent
    install_npu_stand_ins(here.parent)
    os.environ["VERL_PLATFORM"] = verl091_cpu.PLATFORM_NAME
    os.environ["VERL_ENGINE_DEVICE"] = "npu"
    sys.meta_path.insert(0, _HideAliasesBeforeAdaptor())
    import verl.workers.engine  # noqa: F401
    from verl.workers.engine.mindspeed import transformer_impl

    hide_transformers_aliases()
    conf_dir = Path(verl.__file__).parent / "trainer" / "config"
    res, first = [], None
    for case in json.loads(cases_json.read_text()):
        with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
            cfg = compose("ppo_megatron_trainer", overrides=case["overrides"])
        engine_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.megatron)
        _default_switch_args()
        transformer_impl._mindspeed_repatch(engine_cfg)
        # one rank, after the first repatch as the engine orders it
        if not torch.distributed.is_initialized():
            _one_rank_model_parallel()
        override = mapping_string_to_attn_backend({**engine_cfg.override_transformer_config})
        try:
            cfg_tf = tf_config(override)
        except Exception as exc:  # noqa: BLE001 - a refused config is this case's result
            res.append(
                {
                    "name": case["name"],
                    "args": switch_args(),
                    "tf_config_error": f"{type(exc).__name__}: {exc}",
                }
            )
            continue
        rope = rope_probe(cfg_tf)
        first = rope["out"] if first is None else first
        res.append(
            {
                "name": case["name"],
                "override": {k: v for k, v in override.items() if k in SWITCH_ARGS},
                "args": switch_args(),
                "classes": moe_classes(),
                "rope_kernel_calls": rope["kernel_calls"],
                "rope_equal_to_first": bool(torch.allclose(rope["out"], first, rtol=0, atol=1e-6)),
                **zero_memory_layers(cfg_tf),
            }
        )
    out.write_text(json.dumps(res, indent=1, default=str))
    return 0


def main(hf_dir: str, out_dir: Path, extra: tuple[str, ...] = ()) -> int:
    here = Path(__file__).resolve().parent
    install_npu_stand_ins(here.parent)
    # verl's own switches: its platform stays the host (platform_manager.py:92-95; with torch_npu importable it would
    # detect its NPU platform) and the engine class is the NPU one (workers/engine/base.py:405-406)
    os.environ["VERL_PLATFORM"] = verl091_cpu.PLATFORM_NAME
    os.environ["VERL_ENGINE_DEVICE"] = "npu"
    hide = _HideAliasesBeforeAdaptor()
    sys.meta_path.insert(0, hide)
    import verl.workers.engine  # noqa: F401  (as verl's worker imports it: MindSpeed's adaptor, then Megatron)

    state = {**verl_state(), "aliases_hidden": len(hide.hidden)}
    hide_transformers_aliases()  # again before the engine's repatch (its second scan of sys.modules)
    out_dir.mkdir(parents=True, exist_ok=True)
    if int(os.environ["RANK"]) == 0:
        (out_dir / "mindspeed.json").write_text(json.dumps(state, indent=1))
    sys.path.insert(0, str(here))
    # its module-level shim install (mode "engine") is not wanted here
    argv, sys.argv = sys.argv, ["", "imported"]
    from verl091_engine_driver import engine_main

    sys.argv = argv
    rc = engine_main(hf_dir, out_dir, extra)
    if int(os.environ["RANK"]) == 0:
        (out_dir / "kernels.json").write_text(json.dumps(KERNEL_CALLS))
        (out_dir / "switch_args.json").write_text(json.dumps(switch_args(), default=str))
    return rc


def check_main(mode: str) -> int:
    """``check`` mode: the preflight's MindSpeed import check (``qwen3_rl.tools.launch.mindspeed_check``, its JSON
    line on stdout) with the stand-ins; ``present``: transformers' alias modules hidden as in ``engine`` mode (the
    torchvision they need is not in the way), ``as-is``: not hidden (torchvision missing, as the ``adaptor`` mode
    records)."""
    from qwen3_rl.tools.launch import mindspeed_check

    install_npu_stand_ins(Path(__file__).resolve().parent.parent)
    os.environ["VERL_PLATFORM"] = verl091_cpu.PLATFORM_NAME
    os.environ["VERL_ENGINE_DEVICE"] = "npu"
    if mode == "present":  # the check's own finder comes first on sys.meta_path: the hiding runs inside it
        find_spec = mindspeed_check._WatchAdaptor.find_spec

        def hide_then_find(self: Any, name: str, path: Any = None, target: Any = None) -> Any:
            if name == mindspeed_check.ADAPTOR:
                hide_transformers_aliases()
            return find_spec(self, name, path, target)

        mindspeed_check._WatchAdaptor.find_spec = hide_then_find  # type: ignore[method-assign]
    return mindspeed_check.main()


if __name__ == "__main__":
    if sys.argv[1] == "check":
        raise SystemExit(check_main(sys.argv[2]))
    if sys.argv[1] == "adaptor":
        raise SystemExit(adaptor_main(Path(sys.argv[2])))
    if sys.argv[1] == "repatch":
        raise SystemExit(repatch_main(Path(sys.argv[2]), Path(sys.argv[3])))
    raise SystemExit(main(sys.argv[2], Path(sys.argv[3]), tuple(sys.argv[4:])))
