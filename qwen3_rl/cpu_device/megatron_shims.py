"""Device-layer shims for verl 0.6.1's Megatron worker (megatron-core 0.12.1) on a CPU-only host.

:func:`install` applies them in the current process (idempotent). Everything above them — verl's
``ActorRolloutRefWorker``, ``MegatronPPOActor``, the weight converter and ``per_tensor_generator``,
megatron-core's parallel state, GPTModel, MoE layer and token dispatcher, DDP, optimizer and pipeline
schedules — is the real (patched) code. Each shim stands in for a device call or a fused kernel only:

1. ``DIST_BACKEND``: verl asks ``init_process_group(backend=get_nccl_backend())`` = ``"nccl"``
   (``verl/utils/device.py:76-85``, used at ``verl/workers/megatron_workers.py:216-217``); megatron-core
   asks NCCL for its groups (``megatron/core/parallel_state.py`` ``new_group`` calls). A device backend
   (nccl/hccl) becomes ``gloo``, the CPU collective backend (torch 2.9's gloo has every collective megatron
   uses here, ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` included).
2. ``TORCH_CPU_DEVICE``: verl drives the device through ``get_torch_device()`` = ``torch.cpu`` on a host
   without accelerator (``verl/utils/device.py:60-65``), which lacks ``get_rng_state``, ``set_rng_state``,
   ``manual_seed``, ``empty_cache``, ``max_memory_allocated``/``reserved`` (called at
   ``verl/workers/megatron_workers.py:441-445,580,617-618,639-640,663-664``): they are added, the RNG ones
   acting on the CPU generator, the memory ones reporting 0. ``torch.cpu.current_device()`` (``"cpu"``) is
   the device ``"cpu"`` that formats as ``0``: verl builds ``f"{get_device_name()}:{get_device_id()}"``
   (``verl/utils/megatron_utils.py:135``), an accelerator index, and elsewhere uses it as the device.
3. ``CUDA_CALLS``: megatron-core allocates on ``torch.cuda.current_device()`` and calls CUDA streams,
   events and synchronisation (e.g. ``megatron/core/distributed/param_and_grad_buffer.py``,
   ``megatron/core/tensor_parallel/layers.py``, ``megatron/core/transformer/moe/moe_utils.py``): those
   ``torch.cuda`` functions act on the CPU (device ``"cpu"``, no-op synchronisation/streams);
   ``Tensor.cuda()`` returns the tensor on the CPU. ``torch.cuda.is_available()`` stays False. Device names
   ``"cuda"`` given to torch's tensor factories and ``.to()`` become ``"cpu"`` (megatron-core writes
   ``device='cuda'``, e.g. ``megatron/core/optimizer/optimizer.py:369``): on an A3 the same renaming to
   ``"npu"`` is ``torch_npu.contrib.transfer_to_npu``, imported by MindSpeed (``mindspeed/megatron_adaptor.py:11``).
   ``Tensor.type()`` (no argument) names a CPU tensor as the device's (``torch.cuda.FloatTensor``): megatron's
   optimizers accept only those names (``megatron/core/optimizer/distrib_optimizer.py:335,387``,
   ``optimizer.py:548,567``, ``clip_grads.py:167``).
4. ``RNG_TRACKER``: megatron's ``_get_cuda_rng_state``/``_set_cuda_rng_state``
   (``megatron/core/tensor_parallel/random.py:39-110``) read and write ``torch.cuda.default_generators``;
   here they act on the CPU generator, as the tracker's own ``torch.cuda.get_rng_state``/``manual_seed``
   calls (``random.py:176-230``) do through ``CUDA_CALLS``: the named streams (model-parallel, expert,
   data-parallel seeds) and forks keep their semantics, and CPU-initialised weights draw from them.
5. ``MOE_HOST_COPY``: megatron's all-to-all token dispatcher copies its split sizes to the host as numpy
   (``megatron/core/transformer/moe/moe_utils.py:746-761`` ``maybe_move_tensor_to_cpu``, only for
   ``tensor.is_cuda``; used at ``megatron/core/transformer/moe/token_dispatcher.py:686-693``); on a CPU the
   tensors already live on the host, so the copy is done for them too (``all_to_all_single`` takes the
   split sizes as a list, not a tensor).
6. ``FP8_CAST``: after every step the distributed optimizer casts its FP8 parameters with TE's kernels
   (``megatron/core/optimizer/distrib_optimizer.py:2040`` ``quantize_param_shard``); without TE,
   megatron-core 0.12.1 raises there even when there are none (``megatron/core/fp8_utils.py:296-302``).
   With no FP8 parameter the cast is empty (MindSpeed replaces the same function on an A3:
   ``mindspeed/features_manager/megatron_basic/megatron_basic.py:64-66``); any FP8 parameter still raises.
7. ``TE_MODULES``: verl builds the model with ``use_transformer_engine=True``
   (``verl/models/mcore/model_initializer.py:156``: ``get_gpt_decoder_block_spec(..., use_transformer_engine=True)``),
   i.e. megatron's Transformer Engine wrappers (``megatron/core/extensions/transformer_engine.py``), which
   are CUDA kernels. On an A3, MindSpeed replaces exactly these classes (``mindspeed/features_manager/
   megatron_basic/transformer_engine_basic.py:14-30``, ``megatron_basic.py:47``). Here the module
   ``megatron.core.extensions.transformer_engine`` is a CPU module with the same class names and parameter
   names (so verl's weight converter sees TE's names): ``TENorm`` (RMSNorm), ``TELayerNormColumnParallelLinear``
   (RMSNorm + megatron's ``ColumnParallelLinear``), ``TEColumnParallelLinear``/``TERowParallelLinear``
   (megatron's ``ColumnParallelLinear``/``RowParallelLinear``, as MindSpeed maps them),
   ``TEColumnParallelGroupedLinear``/``TERowParallelGroupedLinear`` (one matmul per local expert,
   weights ``weight0..N``), ``TEDotProductAttention`` (causal GQA softmax attention per packed sequence,
   ``thd`` and ``sbhd``), and the fused RoPE functions (megatron's own unfused RoPE).
8. ``FUSED_ADAM``: megatron-core takes its Adam from Transformer Engine, else Apex, else ``torch.optim.AdamW``
   (``megatron/core/optimizer/__init__.py:10-25``, ``distrib_optimizer.py:13-22``). On an A3 MindSpeed registers
   its fused AdamW as ``apex.optimizers.FusedAdam`` (``mindspeed/features_manager/megatron_basic/
   requirements_basic.py:61-67``; class ``mindspeed/core/optimizer/adamw.py`` ``AdamW``, which imports torch_npu),
   so megatron runs its Apex/TE branch (``HAVE_APEX_OR_TE``): the step count lives in each param group, the state
   holds ``exp_avg``/``exp_avg_sq`` only. Here ``apex.optimizers.FusedAdam`` is a CPU optimizer with that layout and
   the same update (``torch._fused_adamw_``, which has a CPU kernel), and ``FusedSGD`` is ``torch.optim.SGD`` as
   MindSpeed registers it. Without it megatron's torch-AdamW branch cannot resume: a fresh distributed optimizer
   has no per-parameter ``step`` to read (``distrib_optimizer.py:604-606``, ``assert len(steps) == 1``), a path an
   A3 never takes.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import torch

_INSTALLED = False
DEVICE_BACKENDS = ("nccl", "hccl", "cuda:nccl", "npu:hccl")


def install() -> None:
    """Apply every shim in this process (idempotent). Call before megatron is imported; the shims of
    megatron's own modules are applied when those modules are first imported (``post_import.py``)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _te_modules()
    _dist_backend()
    _torch_cpu_device()
    _cuda_calls()
    _rng_tracker()
    _moe_host_copy()
    _fp8_cast()
    _fused_adam()
    _INSTALLED = True


# ---- 1. DIST_BACKEND -------------------------------------------------------------------------------------
def _to_gloo(backend):
    if backend is None:
        return backend
    if isinstance(backend, str) and any(b in backend for b in DEVICE_BACKENDS):
        return "gloo"
    return backend


def _dist_backend() -> None:
    import torch.distributed as dist

    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(*args, **kwargs):
        if args:
            args = (_to_gloo(args[0]), *args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = _to_gloo(kwargs["backend"])
        if not args and kwargs.get("backend") is None:
            kwargs["backend"] = "gloo"
        return init(*args, **kwargs)

    def new_group_gloo(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = _to_gloo(kwargs["backend"])
        kwargs.pop("pg_options", None)  # NCCL communicator options (megatron's nccl_comm_cfgs): not gloo's
        return new_group(*args, **kwargs)

    dist.init_process_group = init_process_group
    dist.new_group = new_group_gloo


# ---- 2. TORCH_CPU_DEVICE ---------------------------------------------------------------------------------
def _torch_cpu_device() -> None:
    import torch

    cpu = torch.cpu
    fills = {
        "get_rng_state": lambda device=None: torch.get_rng_state(),
        "set_rng_state": lambda state, device=None: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
        "empty_cache": lambda: None,
        "max_memory_allocated": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "mem_get_info": lambda device=None: (0, 0),
    }
    for name, fn in fills.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    cpu.current_device = lambda: CPU_DEVICE_ID


class _CpuDeviceId(str):
    """``torch.cpu.current_device()``: the device ``"cpu"`` that formats as index 0, since verl formats
    ``f"{get_device_name()}:{get_device_id()}"`` for an accelerator index (``verl/utils/megatron_utils.py:135``)
    and elsewhere passes ``get_device_id()`` as the device itself (e.g. ``verl/utils/megatron_utils.py:706``)."""

    def __format__(self, spec: str) -> str:
        return "0"


CPU_DEVICE_ID = _CpuDeviceId("cpu")


# ---- 3. CUDA_CALLS ---------------------------------------------------------------------------------------
class _NoStream:
    """``torch.cuda.Stream``/``Event`` on the CPU: work is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs):
        return _NoStream()

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def _cuda_calls() -> None:
    import contextlib

    import torch

    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NoStream
    cuda.Event = _NoStream
    cuda.current_stream = lambda device=None: _NoStream()
    cuda.default_stream = lambda device=None: _NoStream()
    cuda.stream = lambda s=None: contextlib.nullcontext()
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # the "device" generator is the CPU one (torch.manual_seed itself calls cuda.manual_seed_all)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = cuda.manual_seed
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(cuda, name, lambda device=None: 0)
    cuda.reset_peak_memory_stats = lambda device=None: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    _transfer_to_cpu()


#: torch functions taking ``device=`` that megatron-core calls with ``"cuda"`` (e.g.
#: megatron/core/optimizer/optimizer.py:369, clip_grads.py, grad_scaler.py, tensor_parallel/random.py)
DEVICE_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
                    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "eye",
                    "linspace", "empty_strided", "randperm")


def _cpu_device(device):
    """``"cuda"``, ``"cuda:N"`` or ``torch.device("cuda", N)`` -> ``"cpu"``; anything else unchanged."""
    import torch

    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _transfer_to_cpu() -> None:
    """What ``torch_npu.contrib.transfer_to_npu`` does on an A3 (imported by MindSpeed,
    ``mindspeed/megatron_adaptor.py:11``: CUDA device names become NPU), with the CPU as the device."""
    import functools

    import torch

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return call

    for name in DEVICE_FACTORIES:
        setattr(torch, name, wrap(getattr(torch, name)))

    def wrap_to(fn):
        @functools.wraps(fn)
        def to(self, *args, **kwargs):
            if args:
                args = (_cpu_device(args[0]), *args[1:])
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(self, *args, **kwargs)

        return to

    torch.Tensor.to = wrap_to(torch.Tensor.to)
    torch.nn.Module.to = wrap_to(torch.nn.Module.to)

    tensor_type = torch.Tensor.type

    @functools.wraps(tensor_type)
    def type_name(self, *args, **kwargs):
        name = tensor_type(self, *args, **kwargs)
        # already renamed: a torch function mode (the NPU stand-in's, a run whose rollout is on vLLM-Ascend) hands
        # the call back to this wrapper, so it can run twice for one call
        if (not args and not kwargs and isinstance(name, str) and name.startswith("torch.")
                and not name.startswith("torch.cuda.") and self.device.type == "cpu"):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = type_name


# ---- 4-6. RNG_TRACKER, MOE_HOST_COPY, FP8_CAST -----------------------------------------------------------
def _rng_tracker() -> None:
    from post_import import after_import

    after_import("megatron.core.tensor_parallel.random", _patch_rng_module)


def _moe_host_copy() -> None:
    from post_import import after_import

    after_import("megatron.core.transformer.moe.moe_utils", _patch_moe_utils)


def _patch_moe_utils(moe_utils) -> None:
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        """The device-to-host copy of the dispatcher's split sizes: the "device" tensors already live on the
        host, the copy is the conversion (numpy for the all-to-all split lists)."""
        if torch.is_tensor(tensor):
            tensor = tensor.detach().clone()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    import torch

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _fp8_cast() -> None:
    from post_import import after_import

    after_import("megatron.core.fp8_utils", _patch_fp8_utils)


def _patch_fp8_utils(fp8_utils) -> None:
    def quantize_param_shard_no_fp8(model_params, main_params, start_offsets, data_parallel_group,
                                    fsdp_shard_model_params=None):
        """Without TE there are no FP8 parameters: nothing to cast."""
        if len(model_params):
            raise RuntimeError("CPU shim: FP8 parameters need Transformer Engine's cast kernels")

    fp8_utils._quantize_param_shard_impl = quantize_param_shard_no_fp8


def _patch_rng_module(mrandom) -> None:
    import torch

    def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()


# ---- 7. TE_MODULES ---------------------------------------------------------------------------------------
TE_MODULE = "megatron.core.extensions.transformer_engine"
#: the TE version the stand-in reports: its API level (TENorm q/k norm >= 1.9, grouped linear >= 1.11)
TE_VERSION = "1.13.0"
#: classes of the stand-in, built on first use from megatron_te_cpu.py (they subclass megatron's layers)
TE_CLASSES = ("TENorm", "TELayerNormColumnParallelLinear", "TELayerNormColumnParallelLinearGathered",
              "TEColumnParallelLinear", "TERowParallelLinear", "TEGroupedLinear", "TEColumnParallelGroupedLinear",
              "TERowParallelGroupedLinear", "TEDotProductAttention")
#: TE-only features the model never reaches on CPU (FP8, fused permutation, fused cross entropy): None, the
#: value megatron's own "is it there" checks test for (e.g. megatron/core/transformer/moe/moe_utils.py:258)
TE_ABSENT = ("Fp8Padding", "Fp8Unpadding", "TEDelayedScaling", "TECudaRNGStatesTracker", "SplitAlongDim",
             "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
             "fused_sort_chunks_by_index_with_probs", "fused_unpermute", "te_parallel_cross_entropy")


#: megatron modules that import TE names at their own import (e.g. megatron/core/models/gpt/gpt_layer_specs.py:38-49)
TE_IMPORTERS = ("megatron.core.models.common.embeddings.rope_utils", "megatron.core.models.gpt.gpt_layer_specs",
                "megatron.core.models.gpt.moe_module_specs", "megatron.core.transformer.transformer_block",
                "megatron.core.transformer.moe.experts", "megatron.core.transformer.moe.moe_utils",
                "megatron.core.transformer.attention", "megatron.core.fp8_utils")


class _CpuTransformerEngine(types.ModuleType):
    """``megatron.core.extensions.transformer_engine`` on CPU. Registered before megatron is imported (its
    modules bind TE names at import); the classes load lazily, once megatron's layers exist."""

    QWEN3_RL_CPU_TE = True

    def __getattr__(self, name: str):
        if name not in TE_CLASSES:
            raise AttributeError(name)
        spec = importlib.util.spec_from_file_location("qwen3_rl_megatron_te_cpu",
                                                      Path(__file__).with_name("megatron_te_cpu.py"))
        assert spec is not None and spec.loader is not None
        impl = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(impl)
        for n in TE_CLASSES:
            setattr(self, n, getattr(impl, n))
        return getattr(impl, name)


def fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=False, interleaved=False):
    """TE's fused RoPE, bshd (t [s, b, h, d]) -> megatron's unfused implementation."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


def fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_size=1, cp_rank=0):
    """TE's fused RoPE, thd (t [t, h, d]) -> megatron's unfused implementation (CP read from parallel_state)."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs)


def get_cpu_offload_context(*args, **kwargs):
    """TE's activation offloading to host memory: activations already live there."""
    return contextlib.nullcontext(), None


def te_checkpoint(*args, **kwargs):
    raise NotImplementedError("CPU TE stand-in: te_checkpoint (FP8 recompute) is not available")


def _te_modules() -> None:
    mod = sys.modules.get(TE_MODULE)
    if mod is not None and getattr(mod, "QWEN3_RL_CPU_TE", False):
        return
    early = [m for m in (TE_MODULE, *TE_IMPORTERS) if m in sys.modules]
    if early:  # they bind TE names at import: the stand-in must be in place first
        raise RuntimeError(f"megatron_shims.install() must run before {early} are imported")
    mod = _CpuTransformerEngine(TE_MODULE, __doc__)
    for f in (fused_apply_rotary_pos_emb, fused_apply_rotary_pos_emb_thd, get_cpu_offload_context, te_checkpoint):
        setattr(mod, f.__name__, f)
    for n in TE_ABSENT:
        setattr(mod, n, None)
    sys.modules[TE_MODULE] = mod
    from post_import import after_import

    after_import("megatron.core.utils", _set_te_version)


def _set_te_version(mutils) -> None:
    """megatron asks TE's version for its spec choices (megatron/core/utils.py:245-265, e.g. the q/k norm at
    megatron/core/models/gpt/gpt_layer_specs.py:146 is TENorm from TE 1.9): the stand-in answers TE_VERSION."""
    from packaging.version import Version

    mutils._te_version = Version(TE_VERSION)


# ---- 8. FUSED_ADAM ---------------------------------------------------------------------------------------
class CpuFusedAdam(torch.optim.Optimizer):
    """AdamW with the state layout of MindSpeed's ``apex.optimizers.FusedAdam``: ``group["step"]`` is a 0-d float
    tensor counting the group's steps, ``state[p]`` holds ``exp_avg`` and ``exp_avg_sq`` (shape of ``p``)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False) -> None:
        if amsgrad:
            raise ValueError("CpuFusedAdam: amsgrad is not used by megatron-core")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            step = group.get("step")
            group["step"] = torch.ones((), dtype=torch.float32) if step is None else \
                torch.as_tensor(step, dtype=torch.float32) + 1
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(params, [p.grad for p in params], [self.state[p]["exp_avg"] for p in params],
                                [self.state[p]["exp_avg_sq"] for p in params], [],
                                [group["step"].clone() for _ in params], amsgrad=False, lr=group["lr"],
                                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                                maximize=group["maximize"])
        return loss


def _fused_adam() -> None:
    if "apex" in sys.modules:
        return
    apex, optimizers = types.ModuleType("apex"), types.ModuleType("apex.optimizers")
    # a package without submodules (apex.normalization etc. still raise ImportError) and without a distribution,
    # so importlib.util.find_spec works and transformers' is_apex_available() stays False
    apex.__spec__ = importlib.machinery.ModuleSpec("apex", None, is_package=True)
    optimizers.__spec__ = importlib.machinery.ModuleSpec("apex.optimizers", None)
    apex.__path__ = []
    optimizers.FusedAdam, optimizers.FusedSGD = CpuFusedAdam, torch.optim.SGD
    apex.optimizers = optimizers
    sys.modules["apex"], sys.modules["apex.optimizers"] = apex, optimizers
