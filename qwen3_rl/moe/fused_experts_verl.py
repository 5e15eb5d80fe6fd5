"""verl wiring of the GroupedMLP (``weight1`` / ``weight2``) expert layout (``qwen3_rl.grouped_mlp_weights``).

Two directions:

* HF -> Megatron (``scripts/converter_hf_to_mcore.py --moe_use_legacy_grouped_gemm``, which imports this module
  lazily, only with that flag): ``copy_hf_experts_to_grouped_mlp`` fills one layer's
  ``experts.weight1`` / ``experts.weight2`` from the HF expert modules (exact copies).
* Megatron -> HF weight sync to the rollout (``verl/utils/megatron_utils.py:per_tensor_generator``):
  ``grouped_mlp_sync_params`` turns one rank's ``decoder.layers.L.mlp.experts.weight1|2`` into the per-expert HF
  tensors of all ranks of its EP x ETP group. Each local expert's block is cut out in the TEGroupedMLP form
  (``linear_fc1.weight{e}`` [2f, H], ``linear_fc2.weight{e}`` [H, f]), all-gathered over EP (global expert id =
  ``ep_rank * E_local + e``, as verl does for ``linear_fc1.weight{e}``) and over the expert-TP group, and handed to
  verl's own TP merge (``default_tp_concat_fn``) and name converter (``McoreToHFWeightConverterQwen2Moe``) under
  its TEGroupedMLP name, so the rollout receives exactly what the TEGroupedMLP path sends. verl's seam hands
  :class:`GroupedMLPGatherSync` to ``per_tensor_generator`` as its ``expert_sync`` when
  ``qwen3_rl.grouped_mlp_weights.enable`` is on and the model has GroupedMLP experts
  (:class:`qwen3_rl.trainer.seam.WeightSyncHooks`).

When does a model carry ``weight1`` / ``weight2``? megatron-core 0.12.1 builds the legacy ``GroupedMLP`` when
``moe_grouped_gemm`` and ``moe_use_legacy_grouped_gemm`` (``megatron/core/models/gpt/moe_module_specs.py:41-56``),
and MindSpeed v2.2.0_core_r0.12.1 replaces the experts by a GroupedMLP subclass when ``moe_alltoall_overlap_comm``
or ``moe_allgather_overlap_comm`` is on (``mindspeed/core/transformer/moe/moe_feature/overlap/moe_layer.py:101,
148, 209``; those keys reach the TransformerConfig through MindSpeed's ``repatch`` / args fields).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from qwen3_rl.moe.fused_experts import grouped_to_te_experts, hf_to_grouped

__all__ = [
    "GROUPED_MLP_KEYS",
    "GroupedMLPGatherSync",
    "copy_hf_experts_to_grouped_mlp",
    "grouped_mlp_sync_params",
    "grouped_mlp_weights_enabled",
    "is_grouped_mlp_param",
    "process_group_all_gather",
]

#: TransformerConfig keys of which one (with ``moe_grouped_gemm``) makes the experts a GroupedMLP.
GROUPED_MLP_KEYS = ("moe_use_legacy_grouped_gemm", "moe_alltoall_overlap_comm", "moe_allgather_overlap_comm")

_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?decoder\.layers\.\d+\.mlp\.experts)\.weight(?P<which>[12])$")

Gather = Callable[[torch.Tensor], list[torch.Tensor]]


def _get(cfg: Any, key: str) -> Any:
    if cfg is None:
        return None
    if isinstance(cfg, Mapping):
        return cfg.get(key)
    return getattr(cfg, key, None)


def grouped_mlp_weights_enabled(cfg: Any) -> bool:
    """True when a model built from ``cfg`` (TransformerConfig, or a mapping of its overrides) has GroupedMLP
    experts: ``moe_grouped_gemm`` and one of ``GROUPED_MLP_KEYS``. ``None`` / missing keys -> False."""
    return bool(_get(cfg, "moe_grouped_gemm")) and any(bool(_get(cfg, k)) for k in GROUPED_MLP_KEYS)


def is_grouped_mlp_param(name: str) -> bool:
    """``...decoder.layers.L.mlp.experts.weight1`` / ``weight2`` (not TEGroupedMLP's ``linear_fc1.weight{e}``)."""
    return _NAME.match(name) is not None


def copy_hf_experts_to_grouped_mlp(hf_experts: Sequence[torch.nn.Module], experts: torch.nn.Module,
                                   expert_ids: Sequence[int] | None = None, tp_size: int = 1,
                                   tp_rank: int = 0) -> int:
    """Copy HF expert modules (``gate_proj`` / ``up_proj`` [F, H], ``down_proj`` [H, F]) into a GroupedMLP's
    ``weight1`` [H, E_local*2F/tp] / ``weight2`` [E_local*F/tp, H] in place.

    ``expert_ids``: global ids of the local experts (default: all of ``hf_experts``). Dtypes must match
    (ValueError otherwise, as the converter's ``safe_copy``); shapes must equal the allocation (ValueError).
    Returns the number of HF elements this rank's slice covers (the whole experts when tp_size == 1).
    """
    ids = list(range(len(hf_experts))) if expert_ids is None else list(expert_ids)
    gate = [hf_experts[e].gate_proj.weight for e in ids]
    up = [hf_experts[e].up_proj.weight for e in ids]
    down = [hf_experts[e].down_proj.weight for e in ids]
    w1, w2 = hf_to_grouped(gate, up, down, tp_size, tp_rank)
    numel = 0
    for src, dst, label in ((w1, experts.weight1, "weight1"), (w2, experts.weight2, "weight2")):
        if src.dtype != dst.dtype:
            raise ValueError(f"Get source dtype {src.dtype}, but target dtype {dst.dtype} ({label})")
        if src.shape != dst.shape:
            raise ValueError(f"{label}: converted shape {tuple(src.shape)} != parameter {tuple(dst.shape)}")
        dst.data.copy_(src)
        numel += src.numel()
    return numel


def process_group_all_gather(group: Any, size: int) -> Gather:
    """``t -> [t of rank 0, ..., t of rank size-1]`` over ``group`` (torch.distributed.all_gather; no
    communication when size == 1)."""

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        if size <= 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(out, t, group=group)
        return out

    return gather


def grouped_mlp_sync_params(
    name: str,
    tensor: torch.Tensor,
    num_experts: int,
    ep_size: int,
    gather_ep: Gather,
    gather_etp: Gather,
    tp_concat: Callable[[str, list[torch.Tensor]], torch.Tensor | list[torch.Tensor]],
    convert: Callable[[str, list[torch.Tensor]], tuple[list[str], list[torch.Tensor]]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of every expert of the EP group for one GroupedMLP parameter of this rank.

    name: ``...decoder.layers.L.mlp.experts.weight1|2`` (PP-normalised); tensor: this rank's parameter
    (weight1 [H, E_local*2f], weight2 [E_local*f, H], f = F / expert-TP size). Collective: every rank of the
    EP and expert-TP groups must call it for the same name (gathers are issued in the same order on all).
    Order of the output = verl's TEGroupedMLP EP path: for each local expert e, for each EP rank r, the
    expert ``r * E_local + e``. ``tp_concat(te_name, shards)`` / ``convert(te_name, params)``: verl's
    ``default_tp_concat_fn`` / ``weight_converter.convert_param`` bound to their other arguments.
    """
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"not a GroupedMLP weight name: {name}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts {num_experts} not divisible by EP size {ep_size}")
    which = int(m.group("which"))
    local = num_experts // ep_size
    te_prefix = f"{m.group('prefix')}.linear_fc{which}.weight"
    for e, block in enumerate(grouped_to_te_experts(tensor, which, local)):
        for r, ep_block in enumerate(gather_ep(block)):
            te_name = f"{te_prefix}{r * local + e}"
            merged = tp_concat(te_name, gather_etp(ep_block))
            params = merged if isinstance(merged, list) else [merged]
            names, tensors = convert(te_name, params)
            yield from zip(names, [t.detach() for t in tensors], strict=True)


class GroupedMLPGatherSync:
    """``per_tensor_generator``'s path for GroupedMLP ``weight1`` / ``weight2`` on one rank (the seam's
    ``expert_sync``): :func:`grouped_mlp_sync_params` with the EP and expert-TP all-gathers of megatron's groups.

    ``handles(name)``: a GroupedMLP expert weight (TEGroupedMLP names stay on verl's own EP path).
    ``sync_params(name, tensor, tp_concat, convert)``: the HF (name, tensor) pairs of every expert of the EP group.
    """

    def __init__(self, num_experts: int, ep_size: int, gather_ep: Gather, gather_etp: Gather) -> None:
        self.num_experts = int(num_experts)
        self.ep_size = int(ep_size)
        self.gather_ep = gather_ep
        self.gather_etp = gather_etp

    @classmethod
    def from_megatron(cls, mpu: Any, num_experts: int) -> GroupedMLPGatherSync:
        """From megatron-core's parallel state (``megatron.core.parallel_state``): EP / expert-TP groups and sizes."""
        ep_size = mpu.get_expert_model_parallel_world_size()
        etp_size = mpu.get_expert_tensor_parallel_world_size()
        return cls(num_experts, ep_size,
                   process_group_all_gather(mpu.get_expert_model_parallel_group(), ep_size),
                   process_group_all_gather(mpu.get_expert_tensor_parallel_group(), etp_size))

    def handles(self, name: str) -> bool:
        return is_grouped_mlp_param(name)

    def sync_params(self, name: str, tensor: torch.Tensor,
                    tp_concat: Callable[[str, list[torch.Tensor]], torch.Tensor | list[torch.Tensor]],
                    convert: Callable[[str, list[torch.Tensor]], tuple[list[str], list[torch.Tensor]]],
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from grouped_mlp_sync_params(name, tensor, self.num_experts, self.ep_size, self.gather_ep,
                                           self.gather_etp, tp_concat, convert)
