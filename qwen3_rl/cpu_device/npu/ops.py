"""Plain PyTorch references of the NPU kernels vLLM-Ascend 0.13.0 calls on its eager path (one device, and an A3's
expert parallelism: the all-to-all and MC2 dispatchers).

Each function is written from the kernel's documented semantics (torch_npu / CANN operator docs and the
schemas in vLLM-Ascend's ``csrc/torch_binding.cpp``), computes on host tensors and keeps the kernel's
signature and return structure, so vLLM-Ascend's own code calls it unchanged. Shapes: ``T`` tokens,
``N`` query heads, ``Nkv`` key/value heads, ``D`` head size, ``H`` hidden size, ``E`` experts, ``K`` top-k.
Float math runs in the input dtype except where the kernel documents float32 accumulation (RMSNorm).

Call sites (``vllm_ascend`` 0.13.0): ``ops/layernorm.py:66,72``, ``ops/activation.py:42``,
``ops/rotary_embedding.py:217,229,246``, ``attention/attention_v1.py:596,698``, ``worker/worker.py:425``,
``utils.py:143,148``, ``ops/fused_moe/experts_selector.py:242``, ``ops/fused_moe/token_dispatcher.py:338,367``,
``ops/fused_moe/moe_mlp.py:286,303``; an A3 with EP > 1: ``ops/fused_moe/token_dispatcher.py:201,282`` (MC2
dispatch / combine v2, collectives over the group named by its HCCL comm name) and ``:520,602,612,619`` (token
permute / unpermute around the all-to-all). Unit tests: ``tests/cpu_device/test_npu_ops.py``.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------- norms and activations


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: ``y = x / sqrt(mean(x^2) + eps) * gamma`` (statistics in float32).

    x: ``(..., H)``; gamma: ``(H,)``. Returns ``(y (..., H) in x's dtype, rstd (..., 1) float32)``.
    """
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    y = (xf * rstd).to(x.dtype) * gamma
    return y, rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``s = x1 + x2``; returns ``(rms_norm(s), rstd, s)``; all ``(..., H)``."""
    s = x1 + x2
    y, rstd = npu_rms_norm(s, gamma, epsilon)
    return y, rstd, s


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: ``silu(a) * b`` with ``a, b`` the two halves of ``x`` along ``dim``; ``(..., 2F) -> (..., F)``."""
    a, b = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(a) * b


# ---------------------------------------------------------------- rotary embedding


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def npu_apply_rotary_pos_emb(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             layout: str = "BSND") -> tuple[torch.Tensor, torch.Tensor]:
    """Neox (rotate-half) rotary embedding, in place; returns ``(query, key)``.

    query: ``(B, S, N, D)``, key: ``(B, S, Nkv, D)``, cos/sin: broadcastable ``(B, S, 1, D)`` (both halves
    repeated, as ``update_cos_sin`` builds them).
    """
    if layout != "BSND":
        raise NotImplementedError(f"npu_apply_rotary_pos_emb stand-in: layout {layout!r} (only BSND)")
    q = query * cos + _rotate_half(query) * sin
    k = key * cos + _rotate_half(key) * sin
    query.copy_(q)
    key.copy_(k)
    return query, key


def _rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: (T, heads, rot), cos/sin: (T, 1, rot/2)
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _npu_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                          cos_sin_cache: torch.Tensor, is_neox_style: bool) -> None:
    """Rotary embedding from a ``[cos | sin]`` cache, in place on the flattened heads.

    positions: ``(T,)``; query: ``(T, N*head_size)``; key: ``(T, Nkv*head_size)``;
    cos_sin_cache: ``(max_pos, head_size)`` (first half cos, second half sin, ``head_size/2`` each).
    """
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for t in (query, key):
        v = t.view(t.shape[0], -1, head_size)
        v.copy_(_rope_rotate(v, cos.to(v.dtype), sin.to(v.dtype), is_neox_style))


# ---------------------------------------------------------------- KV cache and attention


def _npu_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """Write each token's K/V into the paged cache at its slot (``block * block_size + offset``); slot < 0
    is padding and is skipped.

    key/value: ``(T, Nkv, D)``; key_cache/value_cache: ``(blocks, block_size, Nkv, D)``; slot_indices: ``(T,)``.
    """
    block_size = key_cache.shape[1]
    slots = slot_indices.long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offs = slots // block_size, slots % block_size
    key_cache[blocks, offs] = key[: slot_indices.shape[0]][keep].to(key_cache.dtype)
    value_cache[blocks, offs] = value[: slot_indices.shape[0]][keep].to(value_cache.dtype)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      bottom_right: bool) -> torch.Tensor:
    # q (Sq, N, D), k/v (Skv, Nkv, D) -> (Sq, N, D)
    n, nkv = q.shape[1], k.shape[1]
    if n != nkv:
        k = k.repeat_interleave(n // nkv, dim=1)
        v = v.repeat_interleave(n // nkv, dim=1)
    scores = torch.einsum("qnd,knd->nqk", q, k) * scale
    if bottom_right:
        sq, skv = q.shape[0], k.shape[0]
        qi = torch.arange(sq).unsqueeze(1) + (skv - sq)
        ki = torch.arange(skv).unsqueeze(0)
        scores = scores.masked_fill(ki > qi, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("nqk,knd->qnd", probs, v)


def npu_fused_infer_attention_score(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                    atten_mask: torch.Tensor | None = None,
                                    block_table: torch.Tensor | None = None, input_layout: str = "BSH",
                                    block_size: int = 0, actual_seq_lengths: list[int] | None = None,
                                    actual_seq_lengths_kv: list[int] | None = None,
                                    num_key_value_heads: int = 0, num_heads: int = 1, scale: float = 1.0,
                                    sparse_mode: int = 0, **unused) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused inference attention, TND layout, as vLLM-Ascend calls it (``attention_v1.py:596``).

    query: ``(T, N, D)``, requests packed; ``actual_seq_lengths`` = cumulative query ends per request.
    Without ``block_table``: key/value ``(T_kv, Nkv, D)`` packed the same way, ``actual_seq_lengths_kv``
    cumulative. With ``block_table`` ``(R, max_blocks)``: key/value are the paged caches
    ``(blocks, block_size, Nkv*D)`` and ``actual_seq_lengths_kv`` are per-request KV lengths.
    ``sparse_mode=3``: causal mask aligned to the bottom right (query i of a request of ``Sq`` queries and
    ``Skv`` keys sees keys ``<= Skv - Sq + i``); ``sparse_mode=0`` with no mask: no masking. GQA: query head
    ``h`` reads KV head ``h // (N / Nkv)``. Returns ``(out (T, N, D), softmax_lse placeholder)``.
    """
    if input_layout != "TND":
        raise NotImplementedError(f"npu_fused_infer_attention_score stand-in: layout {input_layout!r} (only TND)")
    if sparse_mode not in (0, 3):
        raise NotImplementedError(f"npu_fused_infer_attention_score stand-in: sparse_mode {sparse_mode}")
    causal = sparse_mode == 3
    nkv = num_key_value_heads or num_heads
    d = query.shape[-1]
    q_ends = list(actual_seq_lengths or [])
    kv = list(actual_seq_lengths_kv or [])
    out = torch.zeros_like(query)
    q_start = 0
    for r, q_end in enumerate(q_ends):
        q = query[q_start:q_end]
        if block_table is None:
            kv_start = kv[r - 1] if r else 0
            k, v = key[kv_start:kv[r]], value[kv_start:kv[r]]
        else:
            length = int(kv[r])
            nblocks = -(-length // block_size)
            blocks = block_table[r, :nblocks].long()
            k = key[blocks].reshape(-1, nkv, d)[:length]
            v = value[blocks].reshape(-1, nkv, d)[:length]
        if q.shape[0]:
            out[q_start:q_end] = _causal_attention(q, k.to(q.dtype), v.to(q.dtype), scale, causal)
        q_start = q_end
    return out, torch.empty(0)


def _npu_matmul_add_fp32(x: torch.Tensor, weight: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """ATB MatmulAdd: ``c += x^T @ weight`` in float32, in place. x: ``(M, K)``, weight: ``(M, N)``, c: ``(K, N)``."""
    c.add_(x.float().t() @ weight.float())
    return c


def npu_format_cast(x: torch.Tensor, acl_format: int, *args, **kwargs) -> torch.Tensor:
    """Storage-format cast (ND <-> FRACTAL_NZ = 29). Host tensors have one format: identity."""
    return x


def get_npu_format(x: torch.Tensor) -> int:
    """The ACL storage format: 2 (ND) for every host tensor."""
    return 2


# ---------------------------------------------------------------- MoE


def moe_gating_top_k(x: torch.Tensor, k: int, k_group: int = 1, group_count: int = 1, group_select_mode: int = 0,
                     renorm: int = 0, norm_type: int = 0, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0, eps: float = 1e-20,
                     bias_opt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE gating: score (softmax ``norm_type=0`` / sigmoid ``1``) -> optional bias -> group selection
    (keep the ``k_group`` best of ``group_count`` groups, ranked by max (``group_select_mode=0``) or by the sum
    of the two best scores (``1``)) -> top-``k`` by biased score -> weights are the unbiased scores,
    renormalised to sum 1 when ``renorm=1`` or sigmoid, times ``routed_scaling_factor``.

    x: ``(T, E)`` router logits. Returns ``(weights (T, k) in x's dtype, expert ids (T, k) int32,
    scores (T, E) float32 if out_flag else empty)``. Ties: lower expert id first.
    """
    xf = x.float()
    scores = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    sel = scores if bias_opt is None else scores + bias_opt.float()
    if group_count > 1:
        g = sel.view(sel.shape[0], group_count, -1)
        gscore = g.amax(-1) if group_select_mode == 0 else g.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gscore, dtype=torch.bool)
        keep.scatter_(1, torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :k_group], True)
        sel = g.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(sel)
    ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    w = scores.gather(1, ids)
    if renorm == 1 or norm_type == 1:
        w = w / (w.sum(dim=-1, keepdim=True) + eps)
    w = w * routed_scaling_factor
    return w.to(x.dtype), ids.to(torch.int32), (scores if out_flag else torch.empty(0))


def npu_moe_init_routing_custom(x: torch.Tensor, expert_idx: torch.Tensor, *, scale: torch.Tensor | None = None,
                                offset: torch.Tensor | None = None, active_num: int = -1,
                                expert_capacity: int = -1, expert_num: int = -1, drop_pad_mode: int = 0,
                                expert_tokens_num_type: int = 0, expert_tokens_num_flag: bool = False,
                                quant_mode: int = 0, active_expert_range: list[int] | None = None,
                                row_idx_type: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE routing (dropless, unquantised: ``drop_pad_mode=0``, ``quant_mode=-1``): sort the ``T*K``
    (token, slot) pairs by expert id (stable: ties keep flat order), keep the experts in
    ``[start, end) = active_expert_range``, and gather one row of ``x`` per kept pair.

    x: ``(T, H)``; expert_idx: ``(T, K)``. Returns ``(expanded_x (T*K, H), expanded_row_idx (T*K,) int32,
    expert_tokens (end-start,) int64, expanded_scale)``: rows past the kept count are zero;
    ``row_idx_type=0``: ``expanded_row_idx[flat] = sorted position`` (-1 if dropped), ``1``: the inverse
    (``sorted position -> flat``); expert_tokens: per-expert counts (type 1) or their cumsum (type 0).
    """
    if drop_pad_mode != 0 or quant_mode != -1:
        raise NotImplementedError("npu_moe_init_routing_custom stand-in: dropless, unquantised routing only")
    if expert_tokens_num_type not in (0, 1):
        raise NotImplementedError(f"npu_moe_init_routing_custom stand-in: expert_tokens_num_type {expert_tokens_num_type}")
    t, kk = expert_idx.shape
    start, end = (active_expert_range or [0, expert_num])[:2]
    flat = expert_idx.reshape(-1).long()
    inside = (flat >= start) & (flat < end)
    n_kept = int(inside.sum())
    sort_key = torch.where(inside, flat, torch.full_like(flat, end))
    order = torch.sort(sort_key, stable=True).indices  # sorted position -> flat index
    kept = order[:n_kept]
    expanded_x = torch.zeros((t * kk, x.shape[-1]), dtype=x.dtype)
    expanded_x[:n_kept] = x[kept // kk]
    if row_idx_type == 0:
        row_idx = torch.full((t * kk,), -1, dtype=torch.int32)
        row_idx[kept] = torch.arange(n_kept, dtype=torch.int32)
    else:
        row_idx = kept.to(torch.int32)
    counts = torch.bincount(flat[kept] - start, minlength=end - start).to(torch.int64)
    if expert_tokens_num_type == 0:
        counts = counts.cumsum(0)
    expanded_scale = torch.empty(0) if scale is None else scale.reshape(-1)[kept // kk]
    return expanded_x, row_idx, counts, expanded_scale


def npu_grouped_matmul(x: list[torch.Tensor], weight: list[torch.Tensor] | torch.Tensor, *,
                       group_list: torch.Tensor | list[int] | None = None, group_list_type: int = 0,
                       split_item: int = 2, group_type: int = 0, bias=None, scale=None, per_token_scale=None,
                       output_dtype=None, **unused) -> list[torch.Tensor]:
    """Grouped GEMM over row segments: rows of ``x[0]`` are split into consecutive per-expert segments
    (``group_list``: counts if ``group_list_type=1``, cumulative ends if ``0``) and segment ``e`` is
    multiplied by ``weight[0][e]``.

    x[0]: ``(M, K)``; weight[0]: ``(E, K, N)``. Returns ``[out (M, N)]`` (rows past the last segment: 0).
    Only ``split_item=2, group_type=0`` without bias/quantisation (vLLM-Ascend's unquantised MoE MLP).
    """
    if split_item not in (2, 3) or group_type != 0 or bias is not None or scale is not None:
        raise NotImplementedError("npu_grouped_matmul stand-in: split_item 2/3, group_type 0, no bias/scale")
    a = x[0]
    w = weight[0] if isinstance(weight, (list, tuple)) else weight
    gl = torch.as_tensor(group_list).long()
    ends = gl.cumsum(0) if group_list_type == 1 else gl
    out = torch.zeros((a.shape[0], w.shape[-1]), dtype=output_dtype or a.dtype)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = (a[start:end] @ w[e]).to(out.dtype)
        start = end
    return [out]


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs: torch.Tensor | None = None, padded_mode: bool = False,
                            restore_shape=None) -> torch.Tensor:
    """Combine the experts' rows back per token: ``out[t] = sum_k permuted_tokens[sorted_indices[t*K + k]]
    * probs[t, k]`` (``sorted_indices`` maps each flat (token, slot) to its row, as
    ``npu_moe_init_routing_custom``'s ``expanded_row_idx`` with ``row_idx_type=0``).

    permuted_tokens: ``(T*K, H)``; sorted_indices: ``(T*K,)``; probs: ``(T, K)`` (None: K=1, weight 1).
    Returns ``(T, H)`` in permuted_tokens' dtype.
    """
    if padded_mode:
        raise NotImplementedError("npu_moe_token_unpermute stand-in: padded_mode")
    kk = 1 if probs is None else probs.shape[-1]
    rows = permuted_tokens[sorted_indices.long()].view(-1, kk, permuted_tokens.shape[-1])
    if probs is None:
        return rows.sum(1)
    return (rows * probs.to(rows.dtype).unsqueeze(-1)).sum(1)


# ---------------------------------------------------------------- expert parallelism on an A3 (all-to-all, MC2)


def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None,
                          padded_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the ``T*K`` (token, slot) pairs by expert id (stable: ties keep flat order) and gather one row of
    ``tokens`` per pair; pairs past ``num_out_tokens`` (if given, ``> 0``) are dropped.

    tokens: ``(T, H)``; indices: ``(T, K)`` expert ids (or ``(T,)``: ``K = 1``). Returns ``(permuted (n, H),
    sorted_indices (T*K,) int32)`` with ``sorted_indices[flat] = row of the pair in permuted`` (the convention
    :func:`npu_moe_token_unpermute` reads, the same as ``npu_moe_init_routing_custom``'s ``row_idx_type=0``;
    vLLM-Ascend feeds one kernel's output to the other: ``ops/fused_moe/token_dispatcher.py:520,612,619``).
    """
    if padded_mode:
        raise NotImplementedError("npu_moe_token_permute stand-in: padded_mode")
    kk = 1 if indices.dim() == 1 else indices.shape[-1]
    flat = indices.reshape(-1).long()
    n = flat.numel() if not num_out_tokens or num_out_tokens <= 0 else min(int(num_out_tokens), flat.numel())
    order = torch.sort(flat, stable=True).indices[:n]  # row -> flat index
    rows = torch.full((flat.numel(),), -1, dtype=torch.int32)
    rows[order] = torch.arange(n, dtype=torch.int32)
    return tokens[order // kk], rows


def _mc2_group(group_ep: str, ep_world_size: int, ep_rank_id: int):
    """The process group (the stand-in's gloo-backed ``"hccl"`` backend) named by ``group_ep``."""
    from qwen3_rl.cpu_device.npu.hccl import backend_for_comm_name

    be = backend_for_comm_name(group_ep)
    if be.size() != ep_world_size or be.rank() != ep_rank_id:
        raise ValueError(f"MC2 stand-in: group {group_ep} has rank {be.rank()}/{be.size()}, the call says "
                         f"{ep_rank_id}/{ep_world_size}")
    return be


def _all_gather_rows(be, t: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """All ranks' ``t`` (first dim ``<= rows``, zero-padded to ``rows`` on the wire), each cut back to its own
    length: a list over the group's ranks."""
    n = torch.tensor([t.shape[0]], dtype=torch.int64)
    ns = [torch.zeros(1, dtype=torch.int64) for _ in range(be.size())]
    be.allgather([ns], [n]).wait()
    pad = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    pad[:t.shape[0]] = t
    outs = [torch.zeros_like(pad) for _ in range(be.size())]
    be.allgather([outs], [pad.contiguous()]).wait()
    return [o[:int(k)] for o, k in zip(outs, ns, strict=True)]


def npu_moe_distribute_dispatch_v2(x: torch.Tensor, expert_ids: torch.Tensor, group_ep: str, ep_world_size: int,
                                   ep_rank_id: int, moe_expert_num: int, *, scales=None, x_active_mask=None,
                                   expert_scales: torch.Tensor | None = None, group_tp: str = "",
                                   tp_world_size: int = 1, tp_rank_id: int = 0, expert_shard_type: int = 0,
                                   shared_expert_num: int = 1, shared_expert_rank_num: int = 0,
                                   quant_mode: int = 0, global_bs: int = 0, expert_token_nums_type: int = 1,
                                   **unused) -> tuple[torch.Tensor, ...]:
    """MC2 dispatch (a collective over the EP group ``group_ep``): every rank sends each of its (token, slot)
    pairs to the rank owning the pair's expert (``moe_expert_num / ep_world_size`` consecutive experts per rank,
    no shared-expert ranks); each rank returns the rows it received, grouped by its local expert, within an
    expert by source rank, token and slot.

    x: ``(Tl, H)`` this rank's tokens (``Tl <= global_bs / ep_world_size``); expert_ids: ``(Tl, K)`` global ids.
    Returns ``(expand_x (n, H), dynamic_scales (empty: unquantised), assist_info_for_combine (n, 3) int32 = (source
    rank, token, slot) per row, expert_token_nums (local experts,) int64 (cumsum if ``expert_token_nums_type=0``),
    ep_recv_counts (ep_world_size,) int32 rows per source rank, tp_recv_counts (1,) int32, expand_scales (n,)
    float32 (empty without ``expert_scales``))``. The layout of ``assist_info_for_combine`` / ``ep_recv_counts``
    is this stand-in's own (the device kernel's is opaque): only :func:`npu_moe_distribute_combine_v2` reads it.
    The exchange all-gathers padded rows (the device kernel writes only the needed ones).
    """
    if quant_mode != 0 or scales is not None or shared_expert_rank_num != 0 or expert_shard_type != 0:
        raise NotImplementedError("MC2 dispatch stand-in: unquantised, no shared-expert ranks, shard type 0")
    if tp_world_size != 1 or x_active_mask is not None:
        raise NotImplementedError("MC2 dispatch stand-in: tp_world_size 1, no x_active_mask")
    be = _mc2_group(group_ep, ep_world_size, ep_rank_id)
    per_rank = global_bs // ep_world_size if global_bs else x.shape[0]
    if x.shape[0] > per_rank:
        raise ValueError(f"MC2 dispatch: {x.shape[0]} tokens > global_bs / ep_world_size = {per_rank}")
    local = moe_expert_num // ep_world_size
    es = torch.zeros(expert_ids.shape, dtype=torch.float32) if expert_scales is None else expert_scales.float()
    xs = _all_gather_rows(be, x, per_rank)
    ids = _all_gather_rows(be, expert_ids.to(torch.int64), per_rank)
    sc = _all_gather_rows(be, es, per_rank)
    rows, info, scl, per_expert, per_src = [], [], [], [], [0] * ep_world_size
    for e in range(ep_rank_id * local, (ep_rank_id + 1) * local):
        n_e = 0
        for src in range(ep_world_size):
            for t, j in (ids[src] == e).nonzero().tolist():
                rows.append(xs[src][t])
                info.append((src, t, j))
                scl.append(sc[src][t, j])
                per_src[src] += 1
                n_e += 1
        per_expert.append(n_e)
    expand_x = torch.stack(rows) if rows else x.new_zeros((0, x.shape[-1]))
    counts = torch.tensor(per_expert, dtype=torch.int64)
    if expert_token_nums_type == 0:
        counts = counts.cumsum(0)
    expand_scales = torch.stack(scl) if (scl and expert_scales is not None) else torch.empty(0)
    return (expand_x, torch.empty(0), torch.tensor(info, dtype=torch.int32).view(-1, 3), counts,
            torch.tensor(per_src, dtype=torch.int32), torch.ones(1, dtype=torch.int32), expand_scales)


def npu_moe_distribute_combine_v2(expand_x: torch.Tensor, expert_ids: torch.Tensor,
                                  assist_info_for_combine: torch.Tensor, ep_send_counts: torch.Tensor,
                                  expert_scales: torch.Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
                                  moe_expert_num: int, *, tp_send_counts=None, x_active_mask=None,
                                  expand_scales=None, group_tp: str = "", tp_world_size: int = 1,
                                  tp_rank_id: int = 0, expert_shard_type: int = 0, shared_expert_num: int = 1,
                                  shared_expert_rank_num: int = 0, global_bs: int = 0, **unused) -> torch.Tensor:
    """MC2 combine (a collective over ``group_ep``): the inverse of :func:`npu_moe_distribute_dispatch_v2`. Each
    row of ``expand_x`` (the experts' outputs, in dispatch order) goes back to its source rank, which sums, per
    token, its ``K`` rows weighted by ``expert_scales``: ``out[t] = sum_j expert_scales[t, j] * y(t, j)``.

    expand_x: ``(n, H)``; expert_ids / expert_scales: ``(Tl, K)`` this rank's; assist_info_for_combine: the
    dispatch's ``(n, 3)``. Returns ``(Tl, H)`` in expand_x's dtype (sums in float32).
    """
    if shared_expert_rank_num != 0 or tp_world_size != 1 or x_active_mask is not None:
        raise NotImplementedError("MC2 combine stand-in: no shared-expert ranks, tp_world_size 1, no mask")
    be = _mc2_group(group_ep, ep_world_size, ep_rank_id)
    tl, kk = expert_ids.shape
    rows_max = (global_bs // ep_world_size if global_bs else tl) * kk * ep_world_size
    ys = _all_gather_rows(be, expand_x, rows_max)
    infos = _all_gather_rows(be, assist_info_for_combine.to(torch.int64), rows_max)
    gathered = torch.zeros((tl, kk, expand_x.shape[-1]), dtype=torch.float32)
    for y, info in zip(ys, infos, strict=True):
        for r, (src, t, j) in enumerate(info.tolist()):
            if src == ep_rank_id:
                gathered[t, j] = y[r].float()
    return (gathered * expert_scales.float().unsqueeze(-1)).sum(1).to(expand_x.dtype)


#: torch_npu names -> reference (the ``torch_npu`` stand-in module exposes exactly these ops).
TORCH_NPU_OPS = {f.__name__: f for f in (
    npu_rms_norm, npu_add_rms_norm, npu_swiglu, npu_apply_rotary_pos_emb, _npu_rotary_embedding,
    _npu_reshape_and_cache, npu_fused_infer_attention_score, _npu_matmul_add_fp32, npu_format_cast,
    get_npu_format, npu_grouped_matmul, npu_moe_token_unpermute, npu_moe_token_permute,
    npu_moe_distribute_dispatch_v2, npu_moe_distribute_combine_v2)}
#: vLLM-Ascend's own ``_C_ascend`` kernels (schemas of ``csrc/torch_binding.cpp``) -> reference.
C_ASCEND_OPS = {
    "moe_gating_top_k": ("moe_gating_top_k(Tensor x, int k, int k_group, int group_count, int group_select_mode, "
                         "int renorm, int norm_type, bool out_flag, float routed_scaling_factor, float eps, "
                         "Tensor? bias_opt=None) -> (Tensor y, Tensor expert_idx, Tensor out)", moe_gating_top_k),
    "npu_moe_init_routing_custom": (
        "npu_moe_init_routing_custom(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=0, "
        "int[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)",
        npu_moe_init_routing_custom),
}
