"""Chunked MoE in prefill for vLLM-Ascend 0.13 ([ref 002 §2.1]; the ``ascend_moe_forward_impl`` point of
the vLLM-Ascend seam patch, registered by :mod:`qwen3_rl.vllm_plugin`).

What it does
------------
A prefill step of the Qwen3-235B rollout runs up to ``max_num_batched_tokens`` tokens (34816 by default)
through every MoE layer at once. The routed-expert path of vLLM-Ascend's ``AscendFusedMoE.forward_impl``
keeps intermediates that grow with the token count (the permuted/dispatched copies ``[tokens*topk, H]``
and the grouped-matmul activations ``[tokens*topk, 2F]``), which sets the step's memory peak and, through
the profile run, shrinks the KV cache. With the switch on, a step with more tokens than the chunk size
runs the WHOLE routed path (prepare/TP split, routing, dispatch all-to-all, experts, combine all-to-all,
finalize/TP all-gather) once per token chunk and writes each chunk's output into one output tensor.
Routing is per token, so the result is the same as the unchunked forward (up to kernel reduction order).

Collective safety
-----------------
Dispatch and combine are collectives over the EP group (all TP x DP ranks): every rank must issue the
same number of them. The chunk count is therefore derived from the step's GLOBAL token count,
``max(local rows, forward_context.max_tokens_across_dp)``, which is the same number on every rank,
and a rank with fewer local rows runs shorter (possibly empty) chunks. In vLLM-Ascend 0.13 every DP rank
already runs the model with the DP maximum (``worker/model_runner_v1.py`` ``_sync_metadata_across_dp``
returns ``max_tokens_across_dp`` and ``_prepare_inputs`` slices ``input_ids[:num_input_tokens]`` with it;
``_dummy_run`` does the same for idle ranks), so in practice all ranks have equal rows and equal chunks.
An empty chunk still takes part in every collective: ``PrepareAndFinalizeWithAll2All.prepare`` pads it
to ``tp_size`` rows (``ops/fused_moe/prepare_finalize.py:158-165``).

Chunking happens only where that reasoning holds (:func:`chunk_plan_for_step`): the ``ALLTOALL``
communication method (the A3 prefill path with expert parallelism; MC2/FUSED_MC2 size their buffers and
``mc2_mask`` from the whole step, ALLGATHER pads every call to the DP maximum), no sequence parallelism
(flashcomm1 shards rows and precomputes pads for the whole step), and only for steps with more global
tokens than the chunk size (decode and small steps take the upstream path unchanged). Configurations
that break the equal-count argument or the shared-expert bookkeeping are refused when the config is read
(:func:`moe_prefill_chunk_size_from_config`): ``multistream_overlap_gate`` (computes routing and shared
experts once for the whole step on a side stream) and ``recompute_scheduler_enable`` (lets DP ranks skip
the token-count all-reduce, ``model_runner_v1.py`` ``_skip_all_reduce_across_dp_group``).

Memory model (per rank, one MoE layer call, ALLTOALL path, unquantized; :func:`moe_routed_peak_bytes`)
-------------------------------------------------------------------------------------------------
``N`` rows enter the layer on a rank, TP size ``t``: each rank routes ``n = ceil(N / t)`` rows (the TP
split in ``prepare``). With top-``k`` routing a rank sends ``n*k`` rows and receives ``R = rho*n*k``
(``rho`` = imbalance, 1 = balanced). ``b`` bytes per element, hidden size ``H``, expert FFN size ``F``.
Live intermediates per stage (from ``token_dispatcher.py`` TokenDispatcherWithAll2AllV,
``moe_mlp.py`` unquant_apply_mlp, ``moe_comm_method.py`` MoECommMethod.fused_experts, which holds the
received tokens until it returns):

==============  =================================================  ==========================
stage           live tensors                                       elements
==============  =================================================  ==========================
dispatch        permuted ``[n*k, H]`` + received ``[R, H]``           ``(n*k + R) * H``
local permute   received + its expert-sorted copy (only if >1 expert  ``2 * R * H``
                per rank)
gate_up+swiglu  received + ``[R, 2F]`` + ``[R, F]``                    ``R * (H + 3F)``
down proj       received + ``[R, F]`` + ``[R, H]``                      ``R * (2H + F)``
combine         received + expert out ``[R, H]`` + back ``[n*k, H]``   ``(2R + n*k) * H``
                (+ the expert-order copy ``[R, H]`` if >1 expert)    (``(3R + n*k) * H``)
unpermute       received + back ``[n*k, H]`` + out ``[n, H]``           ``(R + n*k + n) * H``
==============  =================================================  ==========================

peak = ``b * max(stages)``; routing tensors (``[n, k]`` ids and weights) are left out (< 0.1 %).
Chunked with chunk size ``c``: the same maximum with ``N`` replaced by the largest chunk (balanced chunks
of at most ``c`` rounded up to a multiple of ``t`` rows), plus the chunk's own ``[chunk rows, H]`` output
copied into the ``[N, H]`` result (the unchunked path returns an ``[N, H]`` output too, so only the chunk
copy is extra). For Qwen3-235B-A22B (H 4096, F 1536, top-8, bf16, one expert per rank at EP 128, TP 4,
balanced) the combine stage dominates: ``3 * n * k * H * 2`` bytes = 192 KiB per routed row, i.e.
34816 tokens per DP rank -> 1.59 GiB; chunk size 4096 (9 chunks of <= 3872 rows) -> 0.21 GiB
(:func:`qwen3_235b_prefill_peak`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CONFIG_KEY",
    "ChunkPlan",
    "ChunkedForwardImpl",
    "MoeShape",
    "QWEN3_235B",
    "chunk_plan_for_step",
    "forward_impl_hook",
    "forward_in_chunks",
    "moe_prefill_chunk_size_from_config",
    "moe_routed_peak_bytes",
    "plan_chunks",
    "qwen3_235b_prefill_peak",
    "run_chunked",
]

#: vLLM ``additional_config`` key (read by :func:`forward_impl_hook`, the plugin's factory); 0 / absent = off.
CONFIG_KEY = "moe_prefill_chunk_size"
#: the communication method whose prepare/dispatch/combine/finalize are per call (chunkable)
CHUNKABLE_COMM_TYPE = "ALLTOALL"
#: ``additional_config`` keys the switch refuses, with the reason
INCOMPATIBLE_KEYS = {
    "multistream_overlap_gate": "it routes and runs the shared experts once for the whole step on a side "
                                "stream (flash_common3 context), which per-chunk forwards would overwrite",
    "recompute_scheduler_enable": "it lets DP ranks skip the token-count all-reduce "
                                  "(model_runner_v1.py _skip_all_reduce_across_dp_group), so ranks could "
                                  "plan different chunk counts and hang in the EP all-to-all",
}

ChunkPlan = list[tuple[int, int]]
_log = logging.getLogger(__name__)
_warned: set[str] = set()


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def plan_chunks(num_tokens_local: int, max_tokens_across_dp: int, chunk_tokens: int,
                align: int = 1) -> ChunkPlan:
    """Row ranges ``[(start, end), ...]`` splitting this rank's ``num_tokens_local`` rows into chunks.

    Sizes are counted in units of ``align`` rows (the TP size in the patch: every chunk but the last
    non-empty one is then split evenly over the TP ranks, as a whole step with a TP-divisible row count
    is upstream). With the global row count ``G = max(num_tokens_local, max_tokens_across_dp)``, the
    number of chunks is ``ceil(ceil(G / align) / ceil(chunk_tokens / align))`` (at least 1), so every
    rank given the same ``max_tokens_across_dp`` (>= its own rows), ``chunk_tokens`` and ``align`` gets
    the same count. The local rows are spread evenly over the chunks (unit counts differ by at most 1);
    each chunk has at most ``chunk_tokens`` rounded up to a multiple of ``align`` rows. A rank with fewer
    rows than chunks gets empty ranges (``start == end``), which it must still run (collectives). The
    ranges are contiguous, start at 0 and end at ``num_tokens_local``.
    """
    _check_int("num_tokens_local", num_tokens_local, 0)
    _check_int("max_tokens_across_dp", max_tokens_across_dp, 0)
    _check_int("chunk_tokens", chunk_tokens, 1)
    _check_int("align", align, 1)
    global_units = math.ceil(max(num_tokens_local, max_tokens_across_dp) / align)
    chunk_units = math.ceil(chunk_tokens / align)
    count = max(1, math.ceil(global_units / chunk_units))
    local_units = math.ceil(num_tokens_local / align)
    bounds = [min(num_tokens_local, (i * local_units // count) * align) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def moe_prefill_chunk_size_from_config(additional_config: Mapping[str, Any] | None) -> int:
    """The chunk size in tokens from vLLM's ``additional_config`` (0 = off = upstream path).

    Accepts an int or a decimal string (Hydra/JSON may hand either); ``None``/absent is 0. Raises
    ``ValueError``/``TypeError`` with the key's name for a negative, fractional, boolean or non-numeric
    value, and ``ValueError`` when a positive size is combined with a key in :data:`INCOMPATIBLE_KEYS`.
    """
    config = additional_config or {}
    raw = config.get(CONFIG_KEY, 0)
    if raw is None:
        return 0
    if isinstance(raw, str) and raw.strip().lstrip("+-").isdigit():
        raw = int(raw.strip())
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise TypeError(f"additional_config {CONFIG_KEY} must be an integer number of tokens "
                        f"(0 = off), got {raw!r}")
    if raw < 0:
        raise ValueError(f"additional_config {CONFIG_KEY} must be >= 0 (0 = off), got {raw}")
    if raw > 0:
        for key, why in INCOMPATIBLE_KEYS.items():
            if config.get(key):
                raise ValueError(f"additional_config {CONFIG_KEY}={raw} cannot be combined with {key}: {why}")
    return raw


def _comm_name(comm_type: object) -> str | None:
    """``MoECommType.ALLTOALL`` -> ``"ALLTOALL"`` (enum name), a plain string as is, ``None`` as is."""
    if comm_type is None or isinstance(comm_type, str):
        return comm_type
    return getattr(comm_type, "name", str(comm_type))


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _log.warning(message)


def chunk_plan_for_step(num_tokens_local: int, chunk_tokens: int, *, max_tokens_across_dp: int | None,
                        comm_type: object, sp_enabled: bool, tp_size: int = 1,
                        chunkable: Sequence[str] = (CHUNKABLE_COMM_TYPE,)) -> ChunkPlan | None:
    """The chunk plan for one ``AscendFusedMoE.forward_impl`` call, or ``None`` for the upstream path.

    ``None`` when the switch is off (``chunk_tokens <= 0``), the step's communication method is not in
    ``chunkable`` (default :data:`CHUNKABLE_COMM_TYPE`), sequence parallelism is on for the step, or the step has at most
    ``chunk_tokens`` global rows (decode and small steps). Every input that decides this is the same on
    all EP ranks of a step (config; comm type and sp flag are chosen from the DP-synced token count;
    ``max_tokens_across_dp`` is the DP all-reduce result), so either all ranks chunk, with equal chunk
    counts, or none does. Chunks are aligned to ``tp_size`` rows (:func:`plan_chunks`).
    """
    if chunk_tokens <= 0:
        return None
    name = _comm_name(comm_type)
    if name not in chunkable:
        return None
    if sp_enabled:
        _warn_once("sp", f"{CONFIG_KEY}={chunk_tokens}: not chunking MoE steps with sequence parallelism "
                         "(flashcomm1) on; the upstream path runs")
        return None
    global_rows = max(num_tokens_local, max_tokens_across_dp or 0)
    if global_rows <= chunk_tokens:
        return None
    return plan_chunks(num_tokens_local, global_rows, chunk_tokens, align=tp_size)


def _check_plan(plan: Sequence[tuple[int, int]], rows: int) -> None:
    if not plan:
        raise ValueError("empty chunk plan")
    expect = 0
    for start, end in plan:
        if start != expect or end < start:
            raise ValueError(f"chunk plan {list(plan)} is not contiguous from 0 (bad range ({start}, {end}))")
        expect = end
    if expect != rows:
        raise ValueError(f"chunk plan {list(plan)} covers {expect} rows, the input has {rows}")


def forward_in_chunks(forward_one: Callable[[torch.Tensor, torch.Tensor], Any], hidden_states: torch.Tensor,
                      router_logits: torch.Tensor, plan: Sequence[tuple[int, int]], *,
                      routed_out_of: Callable[[Any], torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, Any, Any]:
    """Run ``forward_one(hidden_states[s:e], router_logits[s:e])`` for every ``(s, e)`` of ``plan`` in order
    (empty ranges included) and write each chunk's routed output into one ``[N, ...]`` tensor.

    ``hidden_states`` ``[N, H]`` and ``router_logits`` ``[N, E]`` share the row count ``N``; the plan must
    cover ``0..N`` contiguously. ``routed_out_of(result)`` extracts the ``[e - s, ...]`` tensor from what
    ``forward_one`` returns (default: the result is the tensor). Returns ``(output, first_result,
    last_result)``; the caller takes per-call side data (events) from the first/last chunk. The output is
    allocated once with the first chunk's dtype/device and trailing shape; chunk outputs are copied in,
    so the extra memory is one chunk's output.
    """
    rows = hidden_states.shape[0]
    if router_logits.shape[0] != rows:
        raise ValueError(f"hidden_states has {rows} rows, router_logits {router_logits.shape[0]}")
    _check_plan(plan, rows)
    out: torch.Tensor | None = None
    first = last = None
    for i, (start, end) in enumerate(plan):
        result = forward_one(hidden_states[start:end], router_logits[start:end])
        chunk = routed_out_of(result) if routed_out_of is not None else result
        if not isinstance(chunk, torch.Tensor) or chunk.shape[0] != end - start:
            shape = tuple(chunk.shape) if isinstance(chunk, torch.Tensor) else type(chunk).__name__
            raise ValueError(f"chunk {i} ({start}, {end}): forward returned {shape}, expected {end - start} rows")
        if out is None:
            out = torch.empty((rows, *chunk.shape[1:]), dtype=chunk.dtype, device=chunk.device)
        out[start:end].copy_(chunk)
        if i == 0:
            first = result
        last = result
    assert out is not None  # plan is non-empty
    return out, first, last


class ChunkedForwardImpl:
    """The ``ascend_moe_forward_impl`` hook of one ``AscendFusedMoE`` layer (vLLM-Ascend seam patch).

    Called as ``hook(forward_impl_body, hidden_states [N, H], router_logits [N, E], return_with_event)``
    in place of the layer's ``forward_impl``: with a plan from :func:`chunk_plan_for_step` it runs the
    upstream body once per token chunk through :func:`forward_in_chunks` (events: the first chunk's
    ``before_dispatch_evt``, the last chunk's ``before_combine_evt`` and, on 0.23, ``before_gmm2_evt``); without
    one, the body once.
    """

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens

    def plan(self, rows: int) -> ChunkPlan | None:
        """The plan for a forward of ``rows`` local rows, from vLLM-Ascend 0.13's forward context."""
        from vllm.distributed import get_tp_group
        from vllm.forward_context import get_forward_context

        forward_context = get_forward_context()
        return chunk_plan_for_step(rows, self.chunk_tokens,
                                   max_tokens_across_dp=forward_context.max_tokens_across_dp,
                                   comm_type=forward_context.moe_comm_type,
                                   sp_enabled=forward_context.sp_enabled,
                                   tp_size=get_tp_group().world_size)

    def __call__(self, forward_impl_body: Callable[..., Any], hidden_states: torch.Tensor,
                 router_logits: torch.Tensor, return_with_event: bool = False) -> Any:
        plan = self.plan(hidden_states.shape[0])
        if plan is None:
            return forward_impl_body(hidden_states, router_logits, return_with_event)
        routed_out, first, last = forward_in_chunks(
            lambda h, r: forward_impl_body(h, r, return_with_event), hidden_states, router_logits, plan,
            routed_out_of=(lambda res: res.routed_out) if return_with_event else None)
        if not return_with_event:
            return routed_out
        # events the shared experts wait on after dispatch: the last chunk's (vLLM-Ascend 0.23 adds before_gmm2_evt)
        later = {f: getattr(last, f) for f in ("before_gmm2_evt", "before_combine_evt") if hasattr(last, f)}
        return dataclasses.replace(first, routed_out=routed_out, **later)


def forward_impl_hook(layer: Any, vllm_config: Any) -> ChunkedForwardImpl | None:
    """Factory of the ``ascend_moe_forward_impl`` extension point: the chunking hook of ``layer`` when
    ``additional_config`` sets :data:`CONFIG_KEY` > 0 (validated by :func:`moe_prefill_chunk_size_from_config`),
    else None (the upstream forward runs alone)."""
    chunk = moe_prefill_chunk_size_from_config(getattr(vllm_config, "additional_config", None))
    return ChunkedForwardImpl(chunk) if chunk > 0 else None


def run_chunked(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hidden_states: torch.Tensor,
                router_logits: torch.Tensor, plan: Sequence[tuple[int, int]]) -> torch.Tensor:
    """:func:`forward_in_chunks` for a ``fn`` returning the routed output tensor itself: ``[N, ...]``."""
    return forward_in_chunks(fn, hidden_states, router_logits, plan)[0]


# ---- memory model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer as the rollout runs it: hidden size ``hidden`` (H), expert FFN size ``ffn`` (F, per
    expert, unsharded: EP over TP x DP keeps experts whole), ``topk`` experts per token, ``dtype_bytes``
    per activation element, ``tp`` ranks splitting a DP rank's rows, ``local_experts`` experts per rank."""

    hidden: int
    ffn: int
    topk: int
    dtype_bytes: int = 2
    tp: int = 1
    local_experts: int = 1


#: Qwen3-235B-A22B in the 235B rollout layout: H 4096, moe_intermediate_size 1536, top-8, bf16,
#: TP 4 with EP over 128 dies (128 experts -> one per rank).
QWEN3_235B = MoeShape(hidden=4096, ffn=1536, topk=8, dtype_bytes=2, tp=4, local_experts=1)


def moe_routed_peak_bytes(rows: int, shape: MoeShape, imbalance: float = 1.0) -> int:
    """Peak bytes of the routed path's intermediates for ``rows`` tokens entering the layer on one rank
    (before the TP split), per the stage table in the module docstring. ``imbalance`` (>= 1 for hot
    ranks) scales the rows this rank receives: ``R = imbalance * ceil(rows / tp) * topk``."""
    _check_int("rows", rows, 0)
    if imbalance <= 0:
        raise ValueError(f"imbalance must be > 0, got {imbalance}")
    n = math.ceil(rows / shape.tp)
    sent = n * shape.topk
    recv = math.ceil(imbalance * sent)
    h, f = shape.hidden, shape.ffn
    stages = [
        (sent + recv) * h,  # dispatch all-to-all
        recv * (h + 3 * f),  # gate_up grouped matmul + swiglu
        recv * (2 * h + f),  # down grouped matmul
        (2 * recv + sent) * h,  # combine all-to-all
        (recv + sent + n) * h,  # unpermute
    ]
    if shape.local_experts > 1:
        stages.append(2 * recv * h)  # local expert permute of the received rows
        stages.append((3 * recv + sent) * h)  # combine: expert output, its unpermuted copy, received, back
    return max(stages) * shape.dtype_bytes


def qwen3_235b_prefill_peak(num_tokens: int, chunk_tokens: int = 0, shape: MoeShape = QWEN3_235B,
                            imbalance: float = 1.0) -> dict[str, float | int]:
    """Routed-path peak of one MoE layer call of a prefill step with ``num_tokens`` rows per DP rank,
    unchunked and with ``chunk_tokens`` (0 = off): bytes and GiB, plus the chunk count and largest chunk.
    Chunked adds the largest chunk's ``[rows, H]`` output copy."""
    _check_int("num_tokens", num_tokens, 0)
    _check_int("chunk_tokens", chunk_tokens, 0)
    before = moe_routed_peak_bytes(num_tokens, shape, imbalance)
    if chunk_tokens == 0 or num_tokens <= chunk_tokens:
        plan = [(0, num_tokens)]
        after = before
    else:
        plan = plan_chunks(num_tokens, num_tokens, chunk_tokens, align=shape.tp)
        largest = max(e - s for s, e in plan)
        after = moe_routed_peak_bytes(largest, shape, imbalance) + largest * shape.hidden * shape.dtype_bytes
    return {
        "num_tokens": num_tokens,
        "chunk_tokens": chunk_tokens,
        "chunks": len(plan),
        "largest_chunk": max(e - s for s, e in plan),
        "peak_bytes_unchunked": before,
        "peak_bytes_chunked": after,
        "peak_gib_unchunked": round(before / 2**30, 3),
        "peak_gib_chunked": round(after / 2**30, 3),
        "saved_gib": round((before - after) / 2**30, 3),
    }
