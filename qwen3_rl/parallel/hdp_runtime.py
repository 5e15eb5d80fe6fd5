"""HDP in verl's Megatron actor: config, per-step micro-batching and the forward's pre/post-processing.

The verl seam's actor hooks (:class:`qwen3_rl.trainer.seam.ActorHooks`) build one ``HDPRuntime`` per actor when
``qwen3_rl.hdp.enable`` is true (default false) and call it from the Megatron actor's hook points in
``forward_backward_batch`` / ``compute_log_prob`` and the mcore forward's ``packing`` argument.
Every rank of a CP group holds the same mini-batch (verl dispatches by DP), computes the same assignment
from the sequence lengths (deterministic), and runs its own ``HDPMicroBatch`` list; all ranks of the CP group
get the same number of micro-batches (Megatron's schedule needs it). Across data-parallel groups the mini-batches
differ, and so would the micro-batch counts; but the MoE expert-parallel all-to-alls span the DP ranks, so a rank
that ran fewer micro-batches would leave the others waiting in an all-to-all. ``plan`` therefore takes the world-wide
maximum of the count (all-reduce MAX, as verl 0.6.1's ``rearrange_micro_batches`` does for dynamic batching,
verl/utils/seqlen_balancing.py:304-307) and pads with filler-only micro-batches that carry no loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qwen3_rl.parallel.hdp import HDPAssignment, HDPConfig, assign_hdp
from qwen3_rl.parallel.hdp_wiring import (
    FILLER,
    HDPGroupSlice,
    HDPMicroBatch,
    HDPProcessGroups,
    assemble_owned_rows,
    hdp_loss_scale,
    pack_sequences,
    plan_micro_batches,
    unpack_outputs,
)

__all__ = ["HDPConfig", "HDPPacking", "HDPRuntime", "HDPStep"]

# HDP sub-groups per set of CP groups, made once per process (new_group is collective and, on HCCL, slow; a second
# actor built with the same layout reuses them instead of creating another set). Value: (the default process group
# they were made in, the groups); a re-initialised default group makes them stale.
_PROCESS_GROUPS: dict[tuple[tuple[int, ...], ...], tuple[Any, HDPProcessGroups]] = {}


@dataclass
class HDPStep:
    """One mini-batch under HDP on one rank: the assignment and this rank's micro-batches."""

    assignment: HDPAssignment
    micro_batches: list[HDPMicroBatch]

    @property
    def indices(self) -> list[list[int]]:
        return [mb.seq_indices for mb in self.micro_batches]


class HDPRuntime:
    """Per-actor HDP state that does not change between steps: sizes, token budget, process groups."""

    def __init__(self, cfg: HDPConfig, cp_rank: int, cp_size: int, tp_size: int, token_budget: int,
                 process_groups: HDPProcessGroups | None = None, cp_group: Any = None,
                 sync_num_micro_batches: Callable[[int], int] | None = None) -> None:
        """sync_num_micro_batches: this rank's micro-batch count -> the count every rank runs (the maximum over
        all ranks whose schedules meet in collectives; collective). None: the local count (single process)."""
        if cp_size < 2 or cp_size & (cp_size - 1):
            raise ValueError(f"HDP needs a power-of-two context_parallel_size >= 2, got {cp_size}")
        self.cfg = cfg
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.align = tp_size
        self.token_budget = int(cfg.token_budget or token_budget)
        self.process_groups = process_groups
        self.cp_group = cp_group
        self.sync_num_micro_batches = sync_num_micro_batches

    @classmethod
    def from_megatron(cls, cfg: HDPConfig, mpu: Any, default_token_budget: int,
                      device: torch.device | str | int | None = None) -> HDPRuntime:
        """Build with Megatron's parallel state (collective: every rank of the world must call it).

        device: where the micro-batch-count all-reduce runs (the accelerator for HCCL/NCCL; None = CPU, gloo).
        The sub-groups are created once per process; the whole-CP-group block reuses Megatron's CP group.
        """
        import torch.distributed as dist

        mine = list(mpu.get_context_parallel_global_ranks())
        world: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(world, mine)
        cp_groups = tuple(sorted({tuple(g) for g in world if g is not None}))
        cp_group = mpu.get_context_parallel_group()
        made_in, pgs = _PROCESS_GROUPS.get(cp_groups, (None, None))
        if pgs is None or made_in is not dist.group.WORLD:
            pgs = HDPProcessGroups.build([list(g) for g in cp_groups], mine, lambda ranks: dist.new_group(ranks),
                                         cp_group=cp_group)
            _PROCESS_GROUPS[cp_groups] = (dist.group.WORLD, pgs)

        def world_max(n: int) -> int:
            # every rank of the world, as verl's rearrange_micro_batches(dp_group=None): DP x CP (TP and PP peers
            # hold the same mini-batch, so they agree anyway)
            t = torch.tensor([int(n)], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return int(t.item())

        return cls(cfg, mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size(),
                   mpu.get_tensor_model_parallel_world_size(), default_token_budget, pgs, cp_group, world_max)

    def plan(self, attention_mask: torch.Tensor, loss_mask: torch.Tensor | None = None) -> HDPStep:
        """Assignment and this rank's micro-batches; attention_mask [B, L] bool, loss_mask [B, R] (tokens the
        loss averages over, e.g. response_mask; None -> no loss scaling). Collective when
        ``sync_num_micro_batches`` is set: the micro-batch count is the maximum over the ranks, the micro-batches
        past this CP group's own count are filler-only (loss scale 0)."""
        lens = attention_mask.sum(-1).tolist()
        a = assign_hdp(lens, self.cp_size, self.token_budget, self.cfg.cost_model, align=self.align)
        n = a.num_micro_batches
        if self.sync_num_micro_batches is not None:
            n = self.sync_num_micro_batches(n)
        mbs = plan_micro_batches(a, self.cp_rank, process_groups=self.process_groups, num_micro_batches=n)
        if loss_mask is not None:
            per_seq = loss_mask.sum(-1).tolist()
            group_tokens = sum(per_seq)
            if group_tokens > 0:
                # Megatron scales each micro-batch loss by C / (micro-batches it runs): the padded count
                mbs = [dataclasses.replace(mb, loss_scale=hdp_loss_scale(
                    sum(per_seq[i] for i in mb.seq_indices if i != FILLER), group_tokens, n))
                       for mb in mbs]
        return HDPStep(a, mbs)

    def split(self, batch: Any, step: HDPStep,
              mask_keys: Sequence[str] = ("response_mask",)) -> list[tuple[Any, HDPMicroBatch]]:
        """verl TensorDict mini-batch -> [(rows of micro-batch m in segment order, its HDPMicroBatch)].

        A filler segment takes a copy of row 0 with its segment's length (``filler_length(align)``) of attended
        tokens and ``mask_keys`` zeroed (no loss).
        """
        out = []
        for mb in step.micro_batches:
            if mb.seq_indices == [FILLER]:
                rows = batch[torch.tensor([0], dtype=torch.long)].clone()
                am = torch.zeros_like(rows["attention_mask"], dtype=torch.bool)
                am[:, : mb.segments[0].length] = True
                rows["attention_mask"] = am
                for key in mask_keys:
                    if key in rows.keys():
                        rows[key] = torch.zeros_like(rows[key])
            else:
                rows = batch[torch.tensor(mb.seq_indices, dtype=torch.long)]
            out.append((rows, mb))
        return out

    @staticmethod
    def preprocess(input_ids: torch.Tensor, attention_mask: torch.Tensor, mb: HDPMicroBatch,
                   packed_seq_params_cls: type) -> tuple[torch.Tensor, Any]:
        """verl's preprocess_packed_seqs under HDP: input_ids / attention_mask [n, L] (rows = mb segments,
        right-padded) -> (packed ids [1, T], PackedSeqParams with ``.hdp = mb``)."""
        lengths = attention_mask.sum(-1).tolist()
        rows = torch.zeros_like(input_ids)
        for j in range(input_ids.shape[0]):
            v = input_ids[j][attention_mask[j]]
            rows[j, : v.numel()] = v
        packed = pack_sequences(rows, lengths, mb).to(input_ids.device)
        cu = torch.tensor(mb.local_cu_seqlens(), dtype=torch.int32, device=input_ids.device)
        psp = packed_seq_params_cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                    cu_seqlens_kv_padded=cu, max_seqlen_q=mb.max_padded,
                                    max_seqlen_kv=mb.max_padded)
        psp.hdp = mb
        return packed.unsqueeze(0), psp

    @staticmethod
    def postprocess(output: torch.Tensor, mb: HDPMicroBatch, attention_mask: torch.Tensor) -> torch.Tensor:
        """verl's postprocess_packed_seqs under HDP: output [1, T, ...] -> [n, L, ...] (valid tokens placed
        at ``attention_mask``), the block's chunks gathered over its sub-group."""
        import torch.distributed as dist

        def gather(local: torch.Tensor, g: HDPGroupSlice) -> list[torch.Tensor]:
            assert mb.process_groups is not None
            parts = [torch.empty_like(local) for _ in range(g.block_size)]
            dist.all_gather(parts, local.detach().contiguous(), group=mb.process_groups.group(g.block_start,
                                                                                              g.block_size))
            parts[g.ring_index] = local
            return parts

        seq_len = attention_mask.shape[1]
        left = unpack_outputs(output[0], mb, seq_len, gather)  # [n, L, ...] left-aligned
        res = torch.zeros_like(left)
        for j in range(left.shape[0]):
            n = int(attention_mask[j].sum())
            res[j, attention_mask[j]] = left[j, :n]
        return res

    def assemble(self, rows: torch.Tensor, step: HDPStep, batch_size: int) -> torch.Tensor:
        """Full-batch rows [B, ...] on every CP rank from this rank's rows (micro-batch order)."""
        import torch.distributed as dist

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t, group=self.cp_group)

        return assemble_owned_rows(rows, step.indices, step.assignment, self.cp_rank, batch_size,
                                   all_reduce if self.cp_group is not None else None)


@dataclass(frozen=True)
class HDPPacking:
    """One HDP micro-batch as verl's mcore forward takes it (its ``packing`` argument, the verl seam):
    ``pack`` / ``unpack`` replace ``preprocess_packed_seqs`` / ``postprocess_packed_seqs``."""

    mb: HDPMicroBatch

    @property
    def loss_scale(self) -> float:
        return self.mb.loss_scale

    @property
    def is_filler(self) -> bool:
        return self.mb.is_filler

    def pack(self, tensor: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """[n, L] rows of the micro-batch -> (packed [1, T], PackedSeqParams with ``.hdp``)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return HDPRuntime.preprocess(tensor, attention_mask, self.mb, PackedSeqParams)

    def unpack(self, output: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [n, L, ...] (the block's chunks gathered over its sub-group)."""
        return HDPRuntime.postprocess(output, self.mb, attention_mask)


def check_supported(loss_agg_mode: str, use_fused_kernels: bool, vpp_size: int | None,
                    use_dynamic_bsz: bool) -> None:
    """Raise ValueError for actor settings HDP does not support (named)."""
    problems: Sequence[str] = [
        msg for bad, msg in (
            (loss_agg_mode != "token-mean", f"loss_agg_mode={loss_agg_mode!r} (HDP needs 'token-mean')"),
            (use_fused_kernels, "actor_rollout_ref.model.use_fused_kernels=True (HDP uses the unfused forward)"),
            (vpp_size not in (None, 1), f"virtual pipeline size {vpp_size} (HDP needs none)"),
            (not use_dynamic_bsz, "use_dynamic_bsz=False (HDP replaces dynamic micro-batching; set it True)"),
        ) if bad
    ]
    if problems:
        raise ValueError("qwen3_rl.hdp.enable=True is not supported with: " + "; ".join(problems))
