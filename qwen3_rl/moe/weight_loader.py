"""Layout-aware loading of HF expert weights into vLLM(-Ascend) fused-MoE layers (verl patch 0010).

The problem (pinned trees, line numbers of the pristine wheels):

* vLLM 0.13 ``UnquantizedFusedMoEMethod.create_weights``
  (``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py:139-189``) allocates the
  per-rank expert weights in what we call the **vLLM layout**::

      w13_weight: [E_local, 2 * F_tp, H]   (gate rows then up rows; F_tp rows without act-and-mul)
      w2_weight:  [E_local, H, F_tp]

  with ``E_local = layer.local_num_experts``, ``H = layer.hidden_size``,
  ``F_tp = layer.intermediate_size_per_partition`` (moe_intermediate_size / MoE-TP size).
  ``FusedMoE.weight_loader`` (``vllm/model_executor/layers/fused_moe/layer.py:1109-1368``,
  ``_load_w13`` :990, ``_load_w2`` :1019) narrows an HF tensor (gate/up ``[F, H]``, down ``[H, F]``)
  along dim 0 (w1/w3) or dim 1 (w2) of the expert slice and ``copy_``-s it in.
* vLLM-Ascend 0.13 ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading``
  (``vllm_ascend/ops/fused_moe/fused_moe.py:77-92``) replaces both by new Parameters holding
  ``transpose(1, 2).contiguous()`` copies, the **transposed (kernel) layout** that
  ``npu_grouped_matmul`` reads (``moe_mlp.py:275-290``, ``need_trans`` False)::

      w13_weight: [E_local, H, 2 * F_tp]
      w2_weight:  [E_local, F_tp, H]

  The new Parameters have no ``weight_loader`` and no ``is_transposed``.
* verl 0.6.1 re-attaches ``experts.weight_loader`` to them (``verl/utils/vllm/patch.py:63-118``) and
  loads HF tensors each training step (``vllm_rollout_spmd.py:473-496``). vLLM's loader then narrows
  dim 0 of a transposed slice: a shape error on ``copy_`` — or, when ``2 * F_tp == H`` (w13) or
  ``F_tp == H`` (w2), silently transposed values. ``is_transposed = True`` would flip the shard dim
  but vLLM then expects the *loaded* tensor transposed too (GPTQ convention), so it is no fix.
* vLLM-Ascend 0.13 ``NPUWorker.wake_up`` (``vllm_ascend/worker/worker.py:180-207``) re-wraps the two
  params as ``param.transpose(1, 2)`` views (vLLM-layout shape, same storage) when weights wake up,
  expecting the caller to run vLLM's ``process_weights_after_loading`` after ``load_weights``
  (vllm-ascend commit b230e7e "move weight transpose to wakeup for RL scenarios"). verl 0.6.1 never
  does; the views stay, and the NPU kernel would read a ``[E, 2F, H]`` tensor as ``[E, H, 2F]``.

The fix (this module, installed by verl's ``patch_vllm_moe_model_weight_loader``):

1. :func:`restore_kernel_layout` turns such wake-up views back into Parameters of the transposed
   layout — ``view.transpose(1, 2)`` is the contiguous storage itself: zero copy, same device memory,
   so vLLM's sleep-mode memory pool still owns the weights.
2. :class:`LayoutAwareExpertLoader` decides per parameter which layout it is in
   (:func:`expert_param_layout`) and, for the transposed layout, hands vLLM's own
   ``FusedMoE.weight_loader`` the vLLM-layout view ``param.data.transpose(1, 2)`` of the same storage.
   vLLM then does its usual expert mapping (non-local experts -> not loaded, ``False`` returned),
   TP narrowing and gate/up placement, and the values land transposed in the kernel tensor.

Layers whose quant method does not transpose (vLLM's GPU ``UnquantizedFusedMoEMethod``, quantized
methods) keep vLLM's plain ``experts.weight_loader``: exactly verl's previous behaviour.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TRANSPOSING_METHODS",
    "VLLM_LAYOUT_METHODS",
    "ExpertDims",
    "ExpertLayout",
    "ExpertLayoutError",
    "LayoutAwareExpertLoader",
    "expert_param_kind",
    "expert_param_layout",
    "expert_weight_loader",
    "method_transposes",
    "restore_kernel_layout",
]

#: Quant-method class names (anywhere in the MRO) whose ``process_weights_after_loading`` leaves
#: ``w13_weight`` / ``w2_weight`` transposed to ``[E, H, 2F]`` / ``[E, F, H]``.
TRANSPOSING_METHODS: frozenset[str] = frozenset({"AscendUnquantizedFusedMoEMethod"})
#: Quant-method class names that keep vLLM's ``[E, 2F, H]`` / ``[E, H, F]`` layout after loading.
VLLM_LAYOUT_METHODS: frozenset[str] = frozenset({"UnquantizedFusedMoEMethod"})

_KINDS = ("w13", "w2")


class ExpertLayout(enum.Enum):
    """Memory layout of one fused-expert weight parameter (see the module docstring)."""

    VLLM = "vllm"
    TRANSPOSED = "transposed"


class ExpertLayoutError(RuntimeError):
    """The layout of an expert parameter cannot be determined (or matches neither layout)."""


@dataclass(frozen=True)
class ExpertDims:
    """Per-rank sizes of a vLLM ``FusedMoE`` layer (attribute names as in vLLM 0.13 ``layer.py``).

    Attributes:
        local_num_experts: experts held by this rank, ``E_local`` (``layer.local_num_experts``).
        hidden_size: model hidden size ``H`` (``layer.hidden_size``).
        intermediate_size_per_partition: expert FFN size on this MoE-TP rank, ``F_tp``
            (``layer.intermediate_size_per_partition``).
        is_act_and_mul: gate and up fused in ``w13`` (``layer.moe_config.is_act_and_mul``); then the
            w13 rows are ``2 * F_tp``, else ``F_tp``.
    """

    local_num_experts: int
    hidden_size: int
    intermediate_size_per_partition: int
    is_act_and_mul: bool = True

    @classmethod
    def from_layer(cls, layer: Any) -> ExpertDims:
        """Read the sizes from a vLLM ``FusedMoE`` (or subclass) instance."""
        moe_config = getattr(layer, "moe_config", None)
        return cls(
            local_num_experts=int(layer.local_num_experts),
            hidden_size=int(layer.hidden_size),
            intermediate_size_per_partition=int(layer.intermediate_size_per_partition),
            is_act_and_mul=bool(getattr(moe_config, "is_act_and_mul", True)),
        )

    def vllm_shape(self, kind: str) -> tuple[int, int, int]:
        """vLLM-layout shape of ``w13`` (``[E, 2F_tp, H]``) or ``w2`` (``[E, H, F_tp]``)."""
        e, h, f = self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition
        if kind == "w13":
            return (e, 2 * f if self.is_act_and_mul else f, h)
        if kind == "w2":
            return (e, h, f)
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")

    def transposed_shape(self, kind: str) -> tuple[int, int, int]:
        """Transposed (Ascend kernel) shape: ``w13`` ``[E, H, 2F_tp]``, ``w2`` ``[E, F_tp, H]``."""
        e, a, b = self.vllm_shape(kind)
        return (e, b, a)


def expert_param_kind(name: str) -> str | None:
    """``"w13"`` / ``"w2"`` for a fused-expert *weight* name (``...experts.w13_weight``), else None.

    Scales, biases and zero points (``w13_weight_scale``, ``w2_bias`` ...) are not weights here.
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "w13_weight":
        return "w13"
    if leaf == "w2_weight":
        return "w2"
    return None


def method_transposes(quant_method: object) -> bool | None:
    """Whether a fused-MoE quant method keeps its weights transposed after loading.

    Returns:
        True for vLLM-Ascend's ``AscendUnquantizedFusedMoEMethod`` (and subclasses), False for
        vLLM's ``UnquantizedFusedMoEMethod`` (and non-Ascend subclasses), None for anything else
        (quantized methods, unknown classes): the layout is then not known from the class.
    """
    names = {cls.__name__ for cls in type(quant_method).__mro__}
    if names & TRANSPOSING_METHODS:
        return True
    if names & VLLM_LAYOUT_METHODS:
        return False
    return None


def expert_param_layout(kind: str, shape: tuple[int, ...], dims: ExpertDims,
                        transposes: bool | None) -> ExpertLayout:
    """Layout of a ``w13`` / ``w2`` parameter of the given shape.

    Args:
        kind: ``"w13"`` or ``"w2"``.
        shape: the parameter's shape, 3-D ``[E_local, ., .]``.
        dims: the layer's sizes.
        transposes: :func:`method_transposes` of the layer's quant method; decides only when the shape
            fits both layouts (``2F_tp == H`` for w13, ``F_tp == H`` for w2).

    Raises:
        ExpertLayoutError: the shape fits neither layout, or fits both and ``transposes`` is None.
    """
    vllm_shape, t_shape = dims.vllm_shape(kind), dims.transposed_shape(kind)
    shape = tuple(int(s) for s in shape)
    is_vllm, is_t = shape == vllm_shape, shape == t_shape
    if is_vllm and not is_t:
        return ExpertLayout.VLLM
    if is_t and not is_vllm:
        return ExpertLayout.TRANSPOSED
    if is_vllm and is_t:
        if transposes is None:
            raise ExpertLayoutError(
                f"{kind}_weight shape {shape} fits both the vLLM and the transposed layout and the quant "
                "method does not tell which one it keeps; refusing to guess")
        return ExpertLayout.TRANSPOSED if transposes else ExpertLayout.VLLM
    raise ExpertLayoutError(
        f"{kind}_weight shape {shape} is neither the vLLM layout {vllm_shape} nor the transposed layout "
        f"{t_shape} for local_num_experts={dims.local_num_experts}, hidden_size={dims.hidden_size}, "
        f"intermediate_size_per_partition={dims.intermediate_size_per_partition}")


def _is_transposed_view(t: torch.Tensor) -> bool:
    """True for a 3-D non-contiguous tensor whose dims 1 and 2 swapped back are contiguous."""
    return t.dim() == 3 and not t.is_contiguous() and t.transpose(1, 2).is_contiguous()


def restore_kernel_layout(layer: torch.nn.Module) -> list[str]:
    """Undo vLLM-Ascend's wake-up views: make ``w13_weight`` / ``w2_weight`` kernel-layout again.

    Only for layers whose quant method transposes (:func:`method_transposes` is True). A parameter
    that is a ``transpose(1, 2)`` view of a contiguous tensor (what ``NPUWorker.wake_up`` leaves,
    vLLM-layout shape ``[E, 2F_tp, H]`` / ``[E, H, F_tp]``) is replaced by a Parameter holding
    ``view.transpose(1, 2)`` — the contiguous ``[E, H, 2F_tp]`` / ``[E, F_tp, H]`` storage itself
    (same ``data_ptr``, no copy). Contiguous parameters are left alone.

    Returns:
        Names of the replaced parameters (empty if none).

    Raises:
        ExpertLayoutError: a wake-up view whose shape is not the vLLM layout of the layer's sizes.
    """
    if method_transposes(getattr(layer, "quant_method", None)) is not True:
        return []
    dims = ExpertDims.from_layer(layer)
    replaced = []
    for kind in _KINDS:
        name = f"{kind}_weight"
        param = getattr(layer, name, None)
        if param is None or not _is_transposed_view(param):
            continue
        if tuple(param.shape) != dims.vllm_shape(kind):
            raise ExpertLayoutError(
                f"{name} is a transposed view of shape {tuple(param.shape)}, expected the vLLM layout "
                f"{dims.vllm_shape(kind)}")
        restored = torch.nn.Parameter(param.data.transpose(1, 2), requires_grad=False)
        setattr(layer, name, restored)
        replaced.append(name)
    return replaced


class LayoutAwareExpertLoader:
    """``weight_loader`` for a fused-MoE layer whose expert weights may be in the transposed layout.

    Same call signature as vLLM's ``FusedMoE.weight_loader``::

        loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False)

    ``loaded_weight`` is an HF tensor: gate/up (``shard_id`` ``"w1"``/``"w3"``) ``[F, H]``, down
    (``"w2"``) ``[H, F]`` (full, not TP-sharded), or 3-D with all experts. For ``w13_weight`` /
    ``w2_weight`` in the transposed layout the layer's own loader gets the vLLM-layout view
    ``param.data.transpose(1, 2)`` of the same storage; everything else (vLLM-layout weights, scales,
    biases) goes to the layer's loader unchanged. The return value is the layer loader's (with
    ``return_success=True``: False when ``expert_id`` is not local to this EP rank).
    """

    def __init__(self, layer: torch.nn.Module,
                 loader: Callable[..., bool | None] | None = None) -> None:
        """Wrap ``loader`` (default: ``layer.weight_loader``, vLLM's bound ``FusedMoE.weight_loader``)."""
        self.layer = layer
        self.loader = loader if loader is not None else layer.weight_loader

    def layout(self, param: torch.Tensor, weight_name: str) -> ExpertLayout | None:
        """Layout of ``param`` if ``weight_name`` names a fused-expert weight, else None."""
        kind = expert_param_kind(weight_name)
        if kind is None:
            return None
        return expert_param_layout(kind, tuple(param.shape), ExpertDims.from_layer(self.layer),
                                   method_transposes(getattr(self.layer, "quant_method", None)))

    def __call__(self, param: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str,
                 shard_id: str, expert_id: int, return_success: bool = False) -> bool | None:
        """Load one HF expert tensor (see the class docstring)."""
        target = param
        if self.layout(param, weight_name) is ExpertLayout.TRANSPOSED:
            target = param.data.transpose(1, 2)
        return self.loader(target, loaded_weight, weight_name, shard_id=shard_id, expert_id=expert_id,
                           return_success=return_success)


def expert_weight_loader(layer: torch.nn.Module) -> Callable[..., bool | None]:
    """The ``weight_loader`` verl should attach to a fused-MoE layer's expert parameters.

    For a layer whose quant method transposes (vLLM-Ascend unquantized): first
    :func:`restore_kernel_layout` (wake-up views -> kernel layout, zero copy), then a
    :class:`LayoutAwareExpertLoader`. For every other layer: ``layer.weight_loader`` itself, as verl
    0.6.1 attaches it (GPU vLLM and quantized methods behave exactly as before).
    """
    if method_transposes(getattr(layer, "quant_method", None)) is not True:
        return layer.weight_loader
    restore_kernel_layout(layer)
    return LayoutAwareExpertLoader(layer)
