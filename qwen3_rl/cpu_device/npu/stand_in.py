"""Install the CPU stand-in for ``torch_npu``, ``torch.npu``, ``acl`` and ``torchair`` in this process.

Device and kernel layer only: vLLM, vLLM-Ascend, verl and our patches run above it unchanged. Each item, with
the reason it exists (vLLM-Ascend 0.13.0 file:line):

| item | what it does on the host | why |
|---|---|---|
| PrivateUse1 renamed ``"npu"`` | ``torch.device("npu:0")`` parses | vLLM-Ascend names its device ``npu`` everywhere (``worker/worker.py:220``) |
| ``Tensor.is_npu``, ``Module.npu`` (``generate_methods_for_privateuse1_backend``) | the attributes torch_npu's rename generates | ``torch.compile`` reads ``Tensor.is_npu`` (``torch/overrides.py:1529``) once PrivateUse1 is named ``npu`` (verl's compiled ``mul_reduce`` in the actor of a run whose rollout is on the stand-in) |
| ``torch._C._get_accelerator`` -> host | torch's accelerator query answers "cpu" | a renamed PrivateUse1 without C++ hooks makes it raise (``torch.distributed.barrier``, ``distributed_c10d.py:4860``) |
| ``torch.npu`` (``runtime.py``) | device, memory, streams, events, RNG, SoC, graph-pool ids as host calls; the graph runtime's calls raise | ``worker/worker.py:219-300``, ``worker/model_runner_v1.py:3108-3134``, ``utils.py:696`` |
| ``torch.Generator`` -> ``runtime.HostGenerator`` | ``torch.Generator(device="npu")`` is a host generator | vLLM builds one per seeded request (``vllm/v1/worker/gpu_model_runner.py:818``); a device generator needs PrivateUse1 C++ hooks |
| PrivateUse1 fallback kernel (``runtime.install_factory_fallback``) | an op dispatched to the NPU key by its ``device`` argument re-runs on the host | the function mode is off inside the custom ops it forwards (``moe_forward``): ``torch.empty(device=<npu index>)`` at ``ops/fused_moe/comm_utils.py:89`` |
| ``torch.histc`` -> ``runtime.histc`` | integer input counted on a float copy, result in the input's dtype | the NPU kernel takes the int32 expert ids of the all-to-all dispatcher (``ops/fused_moe/token_dispatcher.py:537``); the host kernel is float-only |
| ``NpuOnHost`` function mode | ``device="npu"``, ``.to("npu")``, ``pin_memory`` -> host | the engine's tensors must exist somewhere; pinning changes no value |
| ``torch_npu`` module | the 12 kernels of ``ops.py`` + ``torch_npu.npu`` = ``torch.npu`` | ``import torch_npu`` at module level (``worker/worker.py:27`` and 18 others) |
| kernels without a host reference (:data:`NO_HOST_REFERENCE`, ``torch_npu.atb``) | present, calling one raises with its name | as on a real torch_npu, ``hasattr`` checks see them and ``mock.patch`` finds them: vLLM-Ascend's unit tests patch them (``tests/ut/{attention,ops,quantization}``, run by ``tests/upstream_own/vllm_ascend_cpu.py``) |
| ``torch.ops.npu.<kernel>`` | the ``torch_npu`` callable of the same name | torch_npu registers its kernels in the ``npu`` op namespace; vLLM-Ascend calls six through it (``attention/context_parallel/attention_cp.py:304``, the compilation passes) |
| ``torch.version.cann`` = None | no CANN on the host | read by ``utils.py:285`` (``find_hccl_library``); torch_npu sets it |
| ``torch_npu._C._npu_get_soc_version``, ``_npu_setStream`` | the SoC of ``get_soc_version``; no-op (one host stream) | ``cpu_binding.py:79,120``; torch_npu's ``torch.npu.set_stream`` calls it (vLLM-Ascend's unit tests patch it) |
| ``torch_npu.op_plugin.atb._atb_ops._register_atb_extensions`` | no-op | ATB extensions load at worker init (``worker/worker.py:29,112``) |
| ``torch_npu.profiler`` | ``dynamic_profile.step`` no-op; the device profiler's names (:data:`PROFILER_NAMES`) raise when called | imported at ``worker/worker.py:30`` (used only with MSMONITOR); the torch profiler set-up (``worker/worker.py:497``) |
| ``torch_npu._C._distributed_c10d.ProcessGroupHCCL`` (``hccl.py``) | ``Options`` with ``hccl_config`` | ``utils.py:932`` |
| ``"hccl"`` backend (``hccl.py``) | gloo with ``get_hccl_comm_name`` | ``worker/worker.py:487``; ``ops/fused_moe/token_dispatcher.py:107,416`` |
| ``torch.distributed.is_hccl_available`` (``hccl.py``) | True: the ``"hccl"`` backend is registered | torch_npu adds it; ``model_loader/netloader/executor/netloader_pg.py:27,73`` |
| ``torch.ops._C_ascend.moe_gating_top_k`` / ``npu_moe_init_routing_custom`` | ``ops.py`` references | called unconditionally (``experts_selector.py:242``, ``token_dispatcher.py:338``); ``vllm_ascend_C`` is a device library |
| vLLM custom ops also for the CPU key | each op registered for ``PrivateUse1`` is registered for ``CPU`` too, same function | ``unified_attention_with_output``, ``moe_forward``, ``maybe_chunk_residual`` (``ops/register_custom_ops.py:315,339,345``) are NPU-key only; host tensors dispatch to CPU |
| ``acl`` | ``acl.rt.memcpy`` raising | imported unguarded by ``device_allocator/camem.py:25`` (used only in sleep mode) |
| ``torchair`` | empty module raising on use | imported by the npugraph_ex compiler backend only (``compilation/compiler_interface.py:96``) |

Not stood in (the stand-in runs eager mode on one host): NPU graphs, sleep mode's ``CaMemAllocator``, quantised
kernels, ``_npu_paged_attention`` (graph mode), the fused MC2 kernels (``FUSED_MC2``: quantised w8a8 only).
"""

from __future__ import annotations

import collections
import functools
import importlib.machinery
import sys
import types
from typing import Any

_INSTALLED = False
#: torch_npu kernels other libraries import by name but the stand-in's path never calls (calling one raises):
#: transformers' NPU flash-attention integration imports ``npu_fusion_attention`` and verl's NPU model patches
#: (``verl/models/transformers/npu_patch.py:24``, imported by ``verl/__init__.py`` on an NPU) ``npu_rotary_mul``.
IMPORTED_ONLY = ("npu_fusion_attention", "npu_rotary_mul")
#: torch_npu 2.8 kernels vLLM-Ascend 0.13.0 names (its package, as ``torch_npu.<name>`` or ``torch.ops.npu.<name>``;
#: the last four only as its unit tests' ``mock.patch`` targets) that have no host reference here: graph-mode,
#: quantised, MLA / context-parallel, MC2 v1 and fused kernels.
NO_HOST_REFERENCE = (
    "_npu_flash_attention_unpad", "_npu_fused_infer_attention_score_get_max_workspace", "_npu_group_topk",
    "_npu_paged_attention", "_npu_paged_attention_get_workspace", "_reshape_and_cache", "npu_add_rms_norm_quant",
    "npu_attention_update", "npu_convert_weight_to_int4pack", "npu_dequant_swiglu_quant", "npu_dynamic_mx_quant",
    "npu_dynamic_quant", "npu_fast_gelu", "npu_grouped_matmul_swiglu_quant", "npu_interleave_rope",
    "npu_kronecker_quant", "npu_kv_rmsnorm_rope_cache", "npu_mm_all_reduce_base", "npu_mm_reduce_scatter_base",
    "npu_moe_distribute_combine", "npu_moe_distribute_dispatch", "npu_moe_finalize_routing", "npu_moe_init_routing_v2",
    "npu_mrope", "npu_prefetch", "npu_quant_matmul", "npu_quantize", "npu_scatter_nd_update_",
    "npu_scatter_pa_kv_cache", "npu_transpose_batchmatmul", "npu_weight_quant_batchmatmul",
    "npu_moe_compute_expert_tokens", "npu_moe_gating_top_k", "npu_moe_gating_top_k_softmax", "npu_moe_init_routing")
#: ``torch_npu.atb`` kernels (ATB) vLLM-Ascend names, none with a host reference (MLA with context parallelism).
ATB_NO_HOST_REFERENCE = ("npu_ring_mla", "npu_paged_cache_load")
#: ``torch_npu.profiler`` names vLLM-Ascend's torch profiler set-up reads (``worker/worker.py:497``, only
#: with ``VLLM_TORCH_PROFILER_DIR``): the device profiler, not on the host.
PROFILER_NAMES = ("profile", "ProfilerActivity", "ProfilerLevel", "ExportType", "AiCMetrics", "_ExperimentalConfig",
                  "tensorboard_trace_handler")
#: Kernels vLLM-Ascend calls as ``torch.ops.npu.<name>`` (torch_npu's op namespace).
TORCH_OPS_NPU = ("npu_add_rms_norm", "npu_add_rms_norm_quant", "npu_apply_rotary_pos_emb",
                 "npu_fused_infer_attention_score", "npu_quantize", "npu_rms_norm")


class _StandInModule(types.ModuleType):
    """A stand-in module whose missing names fail with the name and the reason (``hasattr`` stays False)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{self.__name__}.{name}: not provided by the qwen3_rl CPU stand-in "
                             "(qwen3_rl/cpu_device/npu): no host reference for it yet")


#: Calls of each stand-in kernel in this process (``torch_npu.<name>`` and ``_C_ascend.<name>``): tests read it to
#: show which kernels vLLM-Ascend really called.
CALLS: collections.Counter[str] = collections.Counter()


def _counted(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        return fn(*args, **kwargs)

    return call


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = sys.modules.get(name)
    if m is None:
        m = _StandInModule(name)
        m.__file__ = __file__
        m.__path__ = []  # a package, so submodules import
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = m
        parent, _, child = name.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, m)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def _not_on_host(what: str):
    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{what}: needs the Ascend device runtime; not available on the CPU stand-in")

    return fail


def _register_c_ascend_ops() -> None:
    import torch

    from qwen3_rl.cpu_device.npu.ops import C_ASCEND_OPS

    global _C_ASCEND_LIB
    if hasattr(torch.ops, "_C_ascend") and all(hasattr(torch.ops._C_ascend, n) for n in C_ASCEND_OPS):
        return
    _C_ASCEND_LIB = torch.library.Library("_C_ascend", "DEF")
    for name, (schema, fn) in C_ASCEND_OPS.items():
        _C_ASCEND_LIB.define(schema)
        _C_ASCEND_LIB.impl(name, _counted(f"_C_ascend.{name}", fn), "CPU")


_C_ASCEND_LIB = None


def _also_register_for_cpu() -> None:
    """Wrap ``vllm.utils.torch_utils.direct_register_custom_op`` so an op registered for the NPU key
    (``PrivateUse1``) is registered for ``CPU`` too, with the same function."""
    try:
        import vllm.utils.torch_utils as tu
    except ImportError:
        return
    if getattr(tu.direct_register_custom_op, "_qwen3_rl_cpu_too", False):
        return
    orig = tu.direct_register_custom_op

    def direct_register_custom_op(op_name: str, op_func: Any, mutates_args: Any = None, fake_impl: Any = None,
                                  target_lib: Any = None, dispatch_key: str | None = None,
                                  tags: tuple = ()) -> None:
        if dispatch_key is None:
            from vllm.platforms import current_platform

            dispatch_key = current_platform.dispatch_key
        orig(op_name, op_func, mutates_args=mutates_args, fake_impl=fake_impl, target_lib=target_lib,
             dispatch_key=dispatch_key, tags=tags)
        if dispatch_key == "PrivateUse1":
            (target_lib or tu.vllm_lib).impl(op_name, op_func, dispatch_key="CPU")

    direct_register_custom_op._qwen3_rl_cpu_too = True  # type: ignore[attr-defined]
    tu.direct_register_custom_op = direct_register_custom_op


def install() -> None:
    """Install every stand-in item (idempotent). Call before ``vllm_ascend`` is imported."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch

    from qwen3_rl.cpu_device.npu import hccl, ops, runtime

    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    # torch asks the accelerator's C++ hooks (e.g. torch.distributed.barrier, distributed_c10d.py:4860); a renamed
    # PrivateUse1 backend has none (they can only be registered from C++): the accelerator is the host
    torch._C._get_accelerator = lambda check=False: torch.device("cpu")
    npu = runtime.build_npu_module()
    torch._register_device_module("npu", npu)
    if not hasattr(torch.Tensor, "is_npu"):
        # Tensor.is_npu & co., as torch_npu defines them: torch.compile's override table reads
        # Tensor.is_<privateuse1 name> (torch/overrides.py:1529), e.g. verl's compiled mul_reduce in the actor
        torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=False)
    torch.Generator = runtime.HostGenerator  # type: ignore[misc]
    torch.histc = runtime.histc
    runtime.install_factory_fallback()
    torch.Tensor.npu = lambda self, device=None, non_blocking=False, **kw: self.to("npu")  # type: ignore[attr-defined]

    tnpu = _module("torch_npu", npu=npu, __version__="2.8.0.post2",
                   **{n: _counted(f"torch_npu.{n}", f) for n, f in ops.TORCH_NPU_OPS.items()})
    for name in (*IMPORTED_ONLY, *NO_HOST_REFERENCE):
        setattr(tnpu, name, _not_on_host(f"torch_npu.{name}"))
    # the graph-mode overload (full-graph attention updates, compilation/acl_graph.py): no host equivalent
    tnpu.npu_fused_infer_attention_score.out = _not_on_host("torch_npu.npu_fused_infer_attention_score.out")
    for name in TORCH_OPS_NPU:
        setattr(torch.ops.npu, name, getattr(tnpu, name))
    torch.version.cann = None  # type: ignore[attr-defined]
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None, is_package=True)
    sys.modules["torch_npu.npu"] = npu
    _module("torch_npu.npu.streams", Event=runtime.Event, Stream=runtime.Stream)
    _module("torch_npu.op_plugin")
    _module("torch_npu.op_plugin.atb")
    _module("torch_npu.op_plugin.atb._atb_ops", _register_atb_extensions=lambda: None)
    prof = _module("torch_npu.profiler", **{n: _not_on_host(f"torch_npu.profiler.{n}") for n in PROFILER_NAMES})
    _module("torch_npu.profiler.dynamic_profile", step=lambda: None, init=lambda *a, **k: None)
    prof.dynamic_profile = sys.modules["torch_npu.profiler.dynamic_profile"]
    _module("torch_npu._C", _NPUTaskGroupHandle=runtime._GraphNotOnHost,  # a type annotation (acl_graph.py:589)
            _npu_get_soc_version=runtime._soc_version,
            _npu_setStream=lambda *a, **k: None)  # torch_npu's stream switch: the host has one stream
    _module("torch_npu.atb", **{n: _not_on_host(f"torch_npu.atb.{n}") for n in ATB_NO_HOST_REFERENCE})
    _module("torch_npu._C._distributed_c10d", ProcessGroupHCCL=hccl.ProcessGroupHCCL)
    tnpu._C = sys.modules["torch_npu._C"]
    _module("acl", init=lambda *a, **k: 0)
    _module("acl.rt", memcpy=_not_on_host("acl.rt.memcpy"))
    _module("torchair")
    _register_c_ascend_ops()
    hccl.install()
    _also_register_for_cpu()
    runtime.enter_host_mode()
    _INSTALLED = True
