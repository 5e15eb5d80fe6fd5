"""Chunked MoE prefill on vLLM-Ascend 0.23.0.post1 without a patch ([ref 002 §2.1]; current pin set).

The recipe's worker class (``qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker``, chosen by ``worker_cls=
qwen3_rl.spec_decode.rollout_worker.SamWorker``) calls :func:`install` after ``load_model``. With
``additional_config.moe_prefill_chunk_size`` > 0 it gives every ``AscendFusedMoE`` layer of the loaded model an
instance attribute ``forward_impl`` that runs the class's own ``forward_impl`` through
:class:`~qwen3_rl.moe.chunking.ChunkedForwardImpl`'s chunking (one routed path per token chunk, one output).

Why an instance attribute is the whole seam (vLLM-Ascend 0.23.0.post1, file:line):

* ``vllm_ascend/ops/fused_moe/fused_moe.py:290-294`` takes ``AscendFusedMoE`` / ``AscendMoERunner`` from
  ``fused_moe_0_23_0.py`` on vLLM 0.23.0.
* The runner reaches the routed path only through the layer object: ``AscendMoERunner.forward_impl`` calls
  ``layer.forward_impl(hidden_states, router_logits)`` without shared experts, else ``layer.shared_forward_impl``
  (``fused_moe_0_23_0.py:104-123``), which calls ``self.forward_impl(..., return_with_event=True)`` (``:672-701``).
  Attribute look-up finds the instance's callable first; the class method stays the upstream body, untouched.
* ``AscendFusedMoE.forward_impl`` (``fused_moe_0_23_0.py:420-557``) is the routed path of one call: ``prepare``
  (pad/split), ``quant_method.apply`` (routing, dispatch, grouped matmuls, combine), EPLB heat, ``finalize``.
  The TP all-reduce of the ALLGATHER path is the runner's, after ``forward_impl``, on the whole output
  (``:95-101``).
* ``load_model`` runs before the profile run (``determine_available_memory``), so the KV-cache size is measured with
  the chunked peak.

When a step is chunked (:func:`step_plan`): steps with more global rows than the chunk size whose communication is
``ALLTOALL`` (per-call pad to the TP size and split, ``prepare_finalize.py:132-225``, the same as on 0.13; the A3
expert-parallel prefill path) or ``ALLGATHER`` with DP 1 and PCP 1 (``_prepare_with_dp_group`` /
``_finalize_with_dp_group`` then gather and scatter nothing: ``prepare_finalize.py:428-483, 531-548``; the path of a
rollout without DP, e.g. Qwen3-30B-A3B at TP 4, and of the single-process engine test), and never with sequence
parallelism (``flash_comm_v1_enabled``: ``prepare_finalize.py:343-361`` gathers over EP). ALLGATHER with DP > 1 pads
every call to the DP maximum (``:444-452``) and MC2 sizes its buffers from the whole step: upstream path.
Configurations refused as on 0.13: :data:`~qwen3_rl.moe.chunking.INCOMPATIBLE_KEYS`.

Importing this module needs no vLLM-Ascend; :func:`install` and :meth:`Ascend023ChunkedForwardImpl.plan` do.
"""

from __future__ import annotations

import functools
from typing import Any

from qwen3_rl.moe.chunking import (
    CHUNKABLE_COMM_TYPE,
    ChunkedForwardImpl,
    ChunkPlan,
    chunk_plan_for_step,
    moe_prefill_chunk_size_from_config,
)

__all__ = ["Ascend023ChunkedForwardImpl", "install", "step_plan"]

#: the all-gather method, chunkable when nothing is gathered (DP 1, PCP 1)
ALLGATHER = "ALLGATHER"


def step_plan(
    rows: int,
    chunk_tokens: int,
    *,
    comm_type: object,
    max_tokens_across_dp: int | None,
    sp_enabled: bool,
    tp_size: int,
    dp_size: int,
    pcp_size: int,
) -> ChunkPlan | None:
    """The chunk plan of one vLLM-Ascend 0.23 ``AscendFusedMoE.forward_impl`` call of ``rows`` local rows, or
    ``None`` for the upstream path: :func:`~qwen3_rl.moe.chunking.chunk_plan_for_step` with ALLTOALL chunkable, and
    ALLGATHER too when the layer's ``dp_size`` and ``pcp_size`` are 1 (its prepare/finalize then move no rows)."""
    chunkable = (CHUNKABLE_COMM_TYPE, ALLGATHER) if dp_size == 1 and pcp_size == 1 else (CHUNKABLE_COMM_TYPE,)
    return chunk_plan_for_step(
        rows,
        chunk_tokens,
        max_tokens_across_dp=max_tokens_across_dp,
        comm_type=comm_type,
        sp_enabled=sp_enabled,
        tp_size=tp_size,
        chunkable=chunkable,
    )


class Ascend023ChunkedForwardImpl(ChunkedForwardImpl):
    """:class:`~qwen3_rl.moe.chunking.ChunkedForwardImpl` reading vLLM-Ascend 0.23's forward context
    (``ascend_forward_context._EXTRA_CTX``: ``moe_comm_type``, ``max_tokens_across_dp``, ``flash_comm_v1_enabled``)
    and the layer's ``moe_config`` (``dp_size``, ``pcp_size``)."""

    def __init__(self, chunk_tokens: int, layer: Any) -> None:
        super().__init__(chunk_tokens)
        self.dp_size = int(getattr(layer.moe_config, "dp_size", 1))
        self.pcp_size = int(getattr(layer.moe_config, "pcp_size", 1))

    def plan(self, rows: int) -> ChunkPlan | None:
        from vllm.distributed import get_tp_group
        from vllm_ascend.ascend_forward_context import _EXTRA_CTX

        return step_plan(
            rows,
            self.chunk_tokens,
            comm_type=_EXTRA_CTX.moe_comm_type,
            max_tokens_across_dp=_EXTRA_CTX.max_tokens_across_dp,
            sp_enabled=bool(_EXTRA_CTX.flash_comm_v1_enabled),
            tp_size=get_tp_group().world_size,
            dp_size=self.dp_size,
            pcp_size=self.pcp_size,
        )


def install(model: Any, vllm_config: Any) -> int:
    """Wrap ``forward_impl`` of every ``AscendFusedMoE`` in ``model`` (a ``torch.nn.Module``) when
    ``vllm_config.additional_config`` sets ``moe_prefill_chunk_size`` > 0 (validated as on 0.13). Returns the number of
    layers wrapped now (0 with the switch off; a layer already wrapped is left as is)."""
    chunk = moe_prefill_chunk_size_from_config(getattr(vllm_config, "additional_config", None))
    if chunk <= 0:
        return 0
    from vllm_ascend.ops.fused_moe.fused_moe import AscendFusedMoE

    wrapped = 0
    for layer in model.modules():
        if not isinstance(layer, AscendFusedMoE) or "forward_impl" in vars(layer):
            continue
        body = type(layer).forward_impl.__get__(layer)  # the class's (upstream) forward_impl, bound
        layer.forward_impl = functools.partial(Ascend023ChunkedForwardImpl(chunk, layer), body)
        wrapped += 1
    return wrapped
