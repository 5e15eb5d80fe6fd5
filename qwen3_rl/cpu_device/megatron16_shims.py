"""Device-layer shims for megatron-core 0.16.1 (the current set) under verl 0.9.1 + mbridge 0.15.1 on a CPU host.

:func:`install` applies them in the current process (idempotent; before megatron is imported). Everything above them
(mbridge's model build and HF weight loading, verl's ``make_megatron_module`` and ``load_mcore_dist_weights``,
megatron-core's GPTModel, MoE layer, token dispatcher and dist checkpointing) is the real upstream code. The shims:

1. ``SEED_DEVICE_CALLS``: the seed set's ``DIST_BACKEND``, ``TORCH_CPU_DEVICE``, ``CUDA_CALLS``, ``RNG_TRACKER``
   and ``MOE_HOST_COPY`` (``megatron_shims.py`` 1-5), for the same reasons; on 0.16.1 the dist-checkpoint writer
   also syncs the device (``dist_checkpointing/strategies/filesystem_async.py:230``) and puts its failure flag on
   ``torch.cuda.current_device()`` (``state_dict_saver.py:252``).
2. ``TE_MODULES``: mbridge builds the model with ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``
   (``mbridge/core/llm_bridge.py:149-151``), megatron's Transformer Engine wrappers, which are CUDA kernels. On an A3
   MindSpeed replaces them (``mindspeed/features_manager/megatron_basic/transformer_engine_basic.py``). Here
   ``megatron.core.extensions.transformer_engine`` is the CPU module of ``megatron16_te_cpu.py`` (the seed stand-in's
   maths with 0.16.1's constructor arguments); the TE names 0.16.1 imports but this model never builds
   (``TE16_ABSENT``: TE's op fuser, plain ``TELinear``, MLA's split helper, the FP8 input-saving hook) are None.
3. ``TE_SPEC``: 0.16.1's spec module decides "TE is installed" by ``import transformer_engine``
   (``megatron/core/models/gpt/gpt_layer_specs.py:42-50``) and binds ``TENorm`` / ``TESpecProvider`` only then.
   MindSpeed makes that import succeed with a dummy ``transformer_engine`` package
   (``mindspeed/features_manager/megatron_basic/requirements_basic.py:41-57``); a dummy package here would also turn
   on megatron's FP8 / fused-optimizer imports (``fp8_utils.py:24-60``, ``optimizer/__init__.py:13``), so only the
   spec module is told: after its import it gets ``HAVE_TE = True`` and the stand-in's ``TENorm``,
   ``TESpecProvider`` (megatron's own, over the stand-in classes) and ``TEFusedMLP = None`` (the op fuser is off).
4. ``ROUTER_GEMM``: without TE, 0.16.1's MoE router reads the name ``te_general_gemm`` that only its TE import binds
   (``megatron/core/transformer/moe/moe_utils.py:22-39``, read at ``:1192`` and ``:1225``: a NameError); it is set
   to None, the value that selects the router's plain ``torch`` matmul there.
5. ``HOST_PIN_MEMORY``: page-locked host memory is the CUDA driver's (``torch.Tensor.pin_memory`` raises "Found no
   NVIDIA driver" without one); verl 0.9.1's fully-async trainer keeps the actor's old weights in pinned host copies
   (``verl/utils/megatron_utils.py`` ``copy_megatron_model_to_cpu``, called from
   ``experimental/separation/engine_workers.py:137``). On the host the tensor is already host memory: returned as is.
6. ``FUSED_ADAM``: MindSpeed's ``apex.optimizers.FusedAdam``, as in the seed set (``megatron_shims.py`` 8). On an A3
   MindSpeed core_r0.16.0 registers its AdamW under that name (``mindspeed/features_manager/megatron_basic/
   requirements_basic.py:89-95``, default ``--optimizer-selection fused_adamw``: ``mindspeed/arguments.py:345``),
   so megatron-core 0.16.1 takes its Apex
   branch (``megatron/core/optimizer/distrib_optimizer.py:21-36``, ``optimizer/__init__.py:12-34``). Without it
   megatron runs torch's Adam, whose fresh state has no ``step``: resuming from a checkpoint fails in
   ``DistributedOptimizer.state_dict`` (``distrib_optimizer.py:640-642``, ``assert len(steps) == 1``), a path an A3
   never takes. ``apex.optimizers.FusedAdam`` is :class:`CpuFusedAdam16`: the seed stand-in's update and layout
   (``state[p]`` = ``exp_avg`` / ``exp_avg_sq``, the step count in the param group: MindSpeed's ``AdamW``,
   ``mindspeed/core/optimizer/adamw.py:140-165``), with core_r0.16.0's two differences: the group's step is a Python
   ``int`` (``adamw.py:141-143``, ``_to_step_int``; 0.16.1 collects the groups' steps in a set and asserts one,
   ``distrib_optimizer.py:654-664``: 0-d tensors hash by identity, one per group) and ``adam_w_mode`` is accepted
   and unused (``adamw.py:96``; 0.16.1 passes it, ``optimizer/__init__.py:362``). The other choice,
   ``fused_torch_adamw`` (``FusedTorchAdamW``, ``adamw.py:64-91``: torch's AdamW, a ``step`` per parameter), is not
   stood in for.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

from qwen3_rl.cpu_device import megatron_shims

TE_MODULE = megatron_shims.TE_MODULE
#: TE names megatron-core 0.16.1 imports at module level that the Qwen3(-MoE) GPTModel never builds
TE16_ABSENT = (
    "TEActivationOp",
    "TELinear",
    "TEFusedMLP",
    "split_te_layernorm_column_parallel_linear",
    "set_save_original_input",
)
TE16_CLASSES = megatron_shims.TE_CLASSES
SPEC_MODULE = "megatron.core.models.gpt.gpt_layer_specs"
_INSTALLED = False


class _CpuTransformerEngine16(types.ModuleType):
    """``megatron.core.extensions.transformer_engine`` on CPU for 0.16.1; classes load on first use (they subclass
    megatron's layers, which import this module)."""

    QWEN3_RL_CPU_TE = True

    def __getattr__(self, name: str):
        if name not in TE16_CLASSES:
            raise AttributeError(name)
        self.load_classes()
        return getattr(self, name)

    def load_classes(self) -> None:
        """Bind every stand-in class on the module. The first TE name megatron asks for
        (``tensor_parallel/inference_layers.py:7``, at ``import megatron.core``) loads them all, so that later star
        imports (``transformer/custom_layers/transformer_engine.py``), which see only bound names, find them."""
        spec = importlib.util.spec_from_file_location(
            "qwen3_rl_megatron16_te_cpu", Path(__file__).with_name("megatron16_te_cpu.py")
        )
        assert spec is not None and spec.loader is not None
        impl = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(impl)
        for n in TE16_CLASSES:
            setattr(self, n, getattr(impl, n))


def _te_modules() -> None:
    early = [m for m in (TE_MODULE, SPEC_MODULE, *megatron_shims.TE_IMPORTERS) if m in sys.modules]
    if early:  # they bind TE names at import: the stand-in must be in place first
        raise RuntimeError(f"megatron16_shims.install() must run before {early} are imported")
    mod = _CpuTransformerEngine16(TE_MODULE, __doc__)
    for f in (
        megatron_shims.fused_apply_rotary_pos_emb,
        megatron_shims.fused_apply_rotary_pos_emb_thd,
        megatron_shims.get_cpu_offload_context,
        megatron_shims.te_checkpoint,
    ):
        setattr(mod, f.__name__, f)
    for n in (*megatron_shims.TE_ABSENT, *TE16_ABSENT):
        setattr(mod, n, None)
    sys.modules[TE_MODULE] = mod
    from post_import import after_import

    after_import("megatron.core.utils", megatron_shims._set_te_version)
    after_import(SPEC_MODULE, _te_spec)


def _te_spec(specs) -> None:  # noqa: ANN001 (the gpt_layer_specs module)
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    te = sys.modules[TE_MODULE]
    specs.HAVE_TE = True
    specs.TENorm = te.TENorm
    specs.TESpecProvider = TESpecProvider
    specs.TEFusedMLP = None


def _router_gemm() -> None:
    from post_import import after_import

    def absent(moe_utils) -> None:  # noqa: ANN001 (the moe_utils module)
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None

    after_import("megatron.core.transformer.moe.moe_utils", absent)


def _host_pin_memory() -> None:
    import torch

    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


class CpuFusedAdam16(megatron_shims.CpuFusedAdam):
    """MindSpeed core_r0.16.0's ``apex.optimizers.FusedAdam`` on the CPU: :class:`megatron_shims.CpuFusedAdam` (AdamW,
    ``state[p]`` = ``exp_avg`` / ``exp_avg_sq``, shape of ``p``) with ``group["step"]`` a Python ``int`` (steps
    taken) and the ``adam_w_mode`` argument megatron-core 0.16.1 passes (MindSpeed's ``AdamW`` ignores it)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        adam_w_mode: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize
        )

    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer.step's signature)
        loss = super().step(closure)
        for group in self.param_groups:
            group["step"] = int(group["step"])
        return loss


def _fused_adam() -> None:
    if "apex" in sys.modules:  # a real Apex, or MindSpeed's registration, already there
        return
    megatron_shims._fused_adam()
    sys.modules["apex.optimizers"].FusedAdam = CpuFusedAdam16


def install(fused_adam: bool = True) -> None:
    """Apply the shims above in this process (idempotent). ``qwen3_rl/cpu_device`` must be on ``sys.path``
    (``post_import``), as the seed set's shims need. ``fused_adam=False`` leaves out ``FUSED_ADAM`` (6) for a model
    built on megatron's local spec: its ``import apex`` would pick ``FusedLayerNorm``
    (``transformer/transformer_block.py:44-63``, ``models/gpt/gpt_layer_specs.py:59-64``), which refuses RMSNorm and
    which only MindSpeed's norm patch makes take it on an NPU."""
    global _INSTALLED
    if _INSTALLED:
        return
    _te_modules()
    megatron_shims._dist_backend()
    megatron_shims._torch_cpu_device()
    megatron_shims._cuda_calls()
    megatron_shims._rng_tracker()
    megatron_shims._moe_host_copy()
    _router_gemm()
    _host_pin_memory()
    if fused_adam:
        _fused_adam()
    _INSTALLED = True
