"""The CPU stand-in's NPU kernels (``qwen3_rl/cpu_device/npu/ops.py``) against independent references: torch's own
functional ops (``rms_norm``, ``scaled_dot_product_attention``, ``silu``), transformers' Qwen3 / Qwen3-MoE code
(``apply_rotary_pos_emb``, the MoE block's routing), and per-token loops written here from the kernels' documented
semantics. The stand-in's runtime (device mapping, memory, ``"hccl"`` backend, ``_C_ascend`` op registration) is
tested in a fresh interpreter, since it renames torch's PrivateUse1 backend for the whole process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qwen3_rl.cpu_device.npu import ops

from conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_and_add_rms_norm_match_torch_rms_norm():
    g = _gen()
    x = torch.randn(5, 3, 16, generator=g)
    r = torch.randn(5, 3, 16, generator=g)
    w = torch.randn(16, generator=g)
    ref = torch.nn.functional.rms_norm(x, (16,), w, eps=1e-6)
    y, rstd = ops.npu_rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd.squeeze(-1), 1 / (x.pow(2).mean(-1) + 1e-6).sqrt())
    # non-contiguous input (Qwen3's q/k norm feeds a strided view)
    xs = torch.randn(4, 32, generator=g)[:, ::2]
    torch.testing.assert_close(ops.npu_rms_norm(xs, w, 1e-5)[0], torch.nn.functional.rms_norm(xs, (16,), w, 1e-5))
    y2, _, s = ops.npu_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y2, torch.nn.functional.rms_norm(x + r, (16,), w, eps=1e-6), rtol=1e-6, atol=1e-6)


def test_swiglu_is_silu_of_first_half_times_second():
    x = torch.randn(6, 20, generator=_gen(1))
    torch.testing.assert_close(ops.npu_swiglu(x), torch.nn.functional.silu(x[:, :10]) * x[:, 10:])


def _cos_sin_cache(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def test_rotary_embedding_neox_matches_transformers_qwen3():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    t, n, nkv, d = 7, 4, 2, 32
    g = _gen(2)
    q, k = torch.randn(t, n, d, generator=g), torch.randn(t, nkv, d, generator=g)
    pos = torch.tensor([0, 1, 2, 9, 10, 3, 40])
    cache = _cos_sin_cache(64, d)
    cos_h, sin_h = cache[pos].chunk(2, dim=-1)
    cos, sin = torch.cat((cos_h, cos_h), -1), torch.cat((sin_h, sin_h), -1)  # HF layout: (T, D)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)  # (T, heads, D): cos/sin unsqueezed at dim 1
    qf, kf = q.reshape(t, -1).clone(), k.reshape(t, -1).clone()
    ops._npu_rotary_embedding(pos, qf, kf, d, cache, True)
    torch.testing.assert_close(qf.view(t, n, d), q_ref)
    torch.testing.assert_close(kf.view(t, nkv, d), k_ref)
    # the cos/sin-slice variant (head_size 128 path): (1, T, heads, D) with cos/sin (1, T, 1, D)
    q4, k4 = q.unsqueeze(0).clone(), k.unsqueeze(0).clone()
    out_q, out_k = ops.npu_apply_rotary_pos_emb(q4, k4, cos[None, :, None], sin[None, :, None])
    assert out_q is q4 and out_k is k4  # in place
    torch.testing.assert_close(q4[0], q_ref)
    torch.testing.assert_close(k4[0], k_ref)


def test_rotary_embedding_interleaved_pairs():
    t, d = 3, 8
    q, k = torch.randn(t, d, generator=_gen(3)), torch.randn(t, d, generator=_gen(4))
    pos = torch.tensor([1, 5, 2])
    cache = _cos_sin_cache(8, d)
    qf, kf = q.clone(), k.clone()
    ops._npu_rotary_embedding(pos, qf, kf, d, cache, False)
    for ti in range(t):  # pair (2i, 2i+1) rotated by angle pos * inv_freq[i]
        for i in range(d // 2):
            c, s = cache[pos[ti], i], cache[pos[ti], d // 2 + i]
            a, b = q[ti, 2 * i], q[ti, 2 * i + 1]
            torch.testing.assert_close(qf[ti, 2 * i:2 * i + 2], torch.stack((a * c - b * s, b * c + a * s)))


def test_reshape_and_cache_scatters_by_slot_and_skips_padding():
    blocks, bs, nkv, d = 3, 4, 2, 5
    kc, vc = torch.zeros(blocks, bs, nkv, d), torch.zeros(blocks, bs, nkv, d)
    k, v = torch.randn(4, nkv, d, generator=_gen(5)), torch.randn(4, nkv, d, generator=_gen(6))
    slots = torch.tensor([9, 0, -1, 6])
    ops._npu_reshape_and_cache(k, v, kc, vc, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // bs, s % bs], k[i]) and torch.equal(vc[s // bs, s % bs], v[i])
    assert int((kc.abs().sum((-1, -2)) > 0).sum()) == 3


def _sdpa_bottom_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's SDPA with an explicit bottom-right causal mask and GQA by repeat; (S, N, D) layout."""
    sq, skv = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = torch.ones(sq, skv, dtype=torch.bool).tril(diagonal=skv - sq)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                           v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def test_fused_infer_attention_prefill_without_cache_matches_sdpa():
    n, nkv, d, scale = 4, 2, 16, 0.25
    lens = [3, 5, 1]
    cum = torch.tensor(lens).cumsum(0).tolist()
    g = _gen(7)
    q, k, v = (torch.randn(sum(lens), h, d, generator=g) for h in (n, nkv, nkv))
    out, _ = ops.npu_fused_infer_attention_score(
        q, k, v, block_table=None, input_layout="TND", block_size=128, actual_seq_lengths=cum,
        actual_seq_lengths_kv=cum, num_key_value_heads=nkv, num_heads=n, scale=scale, sparse_mode=3)
    start = 0
    for end in cum:
        torch.testing.assert_close(out[start:end], _sdpa_bottom_right(q[start:end], k[start:end], v[start:end], scale))
        start = end


def test_fused_infer_attention_paged_cache_decode_and_chunk_match_sdpa():
    """Paged KV: per-request KV lengths, query packed with cumulative ends; a request with 1 query token
    (decode), one with 3 (a prefill chunk / spec-decode verification) and one with 2."""
    n, nkv, d, bs, scale = 4, 2, 8, 4, 0.3
    kv_lens, q_lens = [6, 9, 2], [1, 3, 2]
    g = _gen(8)
    blocks = 8
    kc, vc = torch.randn(blocks, bs, nkv * d, generator=g), torch.randn(blocks, bs, nkv * d, generator=g)
    table = torch.tensor([[5, 2, 0], [1, 7, 3], [4, 0, 0]], dtype=torch.int32)
    q = torch.randn(sum(q_lens), n, d, generator=g)
    out, _ = ops.npu_fused_infer_attention_score(
        q, kc, vc, block_table=table, input_layout="TND", block_size=bs,
        actual_seq_lengths=torch.tensor(q_lens).cumsum(0).tolist(), actual_seq_lengths_kv=kv_lens,
        num_key_value_heads=nkv, num_heads=n, scale=scale, sparse_mode=3)
    start = 0
    for r, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        # gather this request's keys token by token from the page table
        idx = [(int(table[r, p // bs]), p % bs) for p in range(kl)]
        k = torch.stack([kc[b, o] for b, o in idx]).view(kl, nkv, d)
        v = torch.stack([vc[b, o] for b, o in idx]).view(kl, nkv, d)
        torch.testing.assert_close(out[start:start + ql], _sdpa_bottom_right(q[start:start + ql], k, v, scale))
        start += ql


def test_matmul_add_fp32_and_format_cast():
    x, w, c = torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, 4)
    ref = c + x.t() @ w
    assert ops._npu_matmul_add_fp32(x, w, c) is c
    torch.testing.assert_close(c, ref)
    assert ops.npu_format_cast(x, 29) is x


def test_moe_gating_top_k_matches_qwen3_moe_routing():
    """Qwen3-MoE (transformers): softmax over experts, top-k, renormalise (norm_topk_prob)."""
    logits = torch.randn(9, 8, generator=_gen(9))
    w, ids, _ = ops.moe_gating_top_k(logits, k=2, k_group=1, group_count=1, group_select_mode=1, renorm=1,
                                     norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20)
    probs = torch.softmax(logits, dim=-1)
    ref_w, ref_ids = torch.topk(probs, 2, dim=-1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w, ref_w)
    # no renorm: the raw softmax weights, times the scaling factor
    w0, _, scores = ops.moe_gating_top_k(logits, k=2, renorm=0, norm_type=0, out_flag=True,
                                         routed_scaling_factor=2.5)
    torch.testing.assert_close(w0, probs.gather(1, ref_ids) * 2.5)
    torch.testing.assert_close(scores, probs)


def test_moe_gating_top_k_sigmoid_groups_and_bias():
    """DeepSeek-style grouped selection written as a per-token loop: sigmoid scores, bias for selection only,
    groups ranked by the sum of their two best biased scores, top-k inside the kept groups, weights from the
    unbiased scores renormalised."""
    t, e, groups, k_group, k = 5, 16, 4, 2, 3
    g = _gen(10)
    logits, bias = torch.randn(t, e, generator=g), torch.randn(e, generator=g) * 0.1
    w, ids, _ = ops.moe_gating_top_k(logits, k=k, k_group=k_group, group_count=groups, group_select_mode=1,
                                     renorm=0, norm_type=1, out_flag=False, routed_scaling_factor=1.5,
                                     eps=1e-20, bias_opt=bias)
    for ti in range(t):
        s = torch.sigmoid(logits[ti])
        b = s + bias
        per = e // groups
        gscore = [sorted(b[gi * per:(gi + 1) * per].tolist())[-2:] for gi in range(groups)]
        kept = sorted(range(groups), key=lambda gi: -sum(gscore[gi]))[:k_group]
        cand = [j for gi in kept for j in range(gi * per, (gi + 1) * per)]
        top = sorted(cand, key=lambda j: -float(b[j]))[:k]
        assert ids[ti].tolist() == top
        ref = s[top] / s[top].sum() * 1.5
        torch.testing.assert_close(w[ti], ref)


def _dense_moe_reference(x, topk_ids, topk_w, w13, w2):
    """Per token, per chosen expert: silu(gate) * up -> down, weighted (Qwen3-MoE expert MLP). w13: (E, 2F, H)
    and w2: (E, H, F) in vLLM's layout."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gu = w13[e] @ x[t]
            f = gu.shape[0] // 2
            out[t] += topk_w[t, j] * (w2[e] @ (torch.nn.functional.silu(gu[:f]) * gu[f:]))
    return out


def test_moe_routing_grouped_matmul_unpermute_pipeline_matches_per_token_experts():
    """The unquantised all-gather MoE path of vLLM-Ascend (token_dispatcher.py:338-367, moe_mlp.py:280-310) built
    from the stand-in's four kernels equals the per-token expert loop."""
    t, h, f, e, k = 11, 8, 6, 4, 2
    g = _gen(11)
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * f, h, generator=g), torch.randn(e, h, f, generator=g)
    w, ids, _ = ops.moe_gating_top_k(torch.randn(t, e, generator=g), k=k, renorm=1, norm_type=0)
    sorted_x, row_idx, counts, _ = ops.npu_moe_init_routing_custom(
        x, ids, scale=None, active_num=t * k, expert_num=e, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, e], quant_mode=-1)
    assert counts.tolist() == torch.bincount(ids.flatten().long(), minlength=e).tolist()
    # rows are sorted by expert id, ties in flat (token, slot) order
    flat = ids.flatten().long()
    assert torch.equal(sorted_x, x[torch.sort(flat, stable=True).indices // k])
    assert sorted(row_idx.tolist()) == list(range(t * k))
    gu = ops.npu_grouped_matmul(x=[sorted_x], weight=[w13.transpose(1, 2)], split_item=2, group_list_type=1,
                                group_type=0, group_list=counts)[0]
    down = ops.npu_grouped_matmul(x=[ops.npu_swiglu(gu)], weight=[w2.transpose(1, 2)], split_item=2,
                                  group_list_type=1, group_type=0, group_list=counts)[0]
    out = ops.npu_moe_token_unpermute(permuted_tokens=down, sorted_indices=row_idx.abs(), probs=w)
    torch.testing.assert_close(out, _dense_moe_reference(x, ids, w, w13, w2), rtol=1e-5, atol=1e-5)


def test_moe_init_routing_expert_range_and_inverse_row_index():
    """Experts outside ``active_expert_range`` are dropped (row index -1, not counted); ``row_idx_type=1`` gives the
    inverse permutation; cumulative counts with ``expert_tokens_num_type=0``."""
    ids = torch.tensor([[3, 0], [1, 2], [2, 3]], dtype=torch.int32)
    x = torch.arange(3.0).unsqueeze(1).repeat(1, 4)
    ex, row, counts, _ = ops.npu_moe_init_routing_custom(x, ids, expert_num=4, expert_tokens_num_type=1,
                                                         active_expert_range=[1, 3], quant_mode=-1)
    # kept (flat): 2 (e1), 3 (e2), 4 (e2) -> positions 0, 1, 2
    assert row.tolist() == [-1, -1, 0, 1, 2, -1]
    assert counts.tolist() == [1, 2]
    assert ex[:3, 0].tolist() == [1.0, 1.0, 2.0] and ex[3:].abs().sum() == 0
    _, inv, cum, _ = ops.npu_moe_init_routing_custom(x, ids, expert_num=4, expert_tokens_num_type=0,
                                                     active_expert_range=[0, 4], quant_mode=-1, row_idx_type=1)
    assert inv.tolist() == [1, 2, 3, 4, 0, 5]
    assert cum.tolist() == [1, 2, 4, 6]


def test_token_permute_sorts_pairs_by_expert_and_unpermute_inverts_it():
    """``npu_moe_token_permute``: rows sorted by expert id, ties in flat (token, slot) order, the returned index maps
    each flat pair to its row; with ``npu_moe_token_unpermute`` it rebuilds the per-token weighted sum (checked
    against a per-token loop); 1-D indices (K = 1) are a plain stable sort of the rows."""
    t, h, e, k = 9, 5, 4, 2
    g = _gen(21)
    x = torch.randn(t, h, generator=g)
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32)
    probs = torch.rand(t, k, generator=g)
    perm, rows = ops.npu_moe_token_permute(x, ids, num_out_tokens=t * k)
    expected_order = [(int(ids[i, j]), i * k + j) for i in range(t) for j in range(k)]
    expected_order.sort()  # by expert, then flat index
    for r, (_, flat) in enumerate(expected_order):
        assert rows[flat] == r and torch.equal(perm[r], x[flat // k])
    y = torch.randn(t * k, h, generator=g)  # "expert outputs", one per row
    out = ops.npu_moe_token_unpermute(y, rows, probs=probs, restore_shape=x.shape)
    ref = torch.stack([sum(probs[i, j] * y[int(rows[i * k + j])] for j in range(k)) for i in range(t)])
    torch.testing.assert_close(out, ref)
    one = torch.tensor([1, 0, 1, 0, 2], dtype=torch.int32)
    p1, r1 = ops.npu_moe_token_permute(x[:5], one)
    assert r1.tolist() == [2, 0, 3, 1, 4] and torch.equal(p1, x[[1, 3, 0, 2, 4]])
    torch.testing.assert_close(ops.npu_moe_token_unpermute(p1, r1), x[:5])


MC2_PROBE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch, torch.distributed as dist
    from qwen3_rl.cpu_device.npu import hccl, ops
    hccl.install()
    rank, world = int(os.environ["RANK"]), 2
    dist.init_process_group("gloo", rank=rank, world_size=world)
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    name = be.get_hccl_comm_name(rank)
    t_max, h, f, e, k = 6, 8, 4, 4, 2
    g = torch.Generator().manual_seed(5)  # the same draws on both ranks: each knows every rank's tokens
    xs = [torch.randn(t_max, h, generator=g) for _ in range(world)]
    ids_all = [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t_max)]).int() for _ in range(world)]
    ws = [torch.rand(t_max, k, generator=g) for _ in range(world)]
    w13, w2 = torch.randn(e, 2 * f, h, generator=g), torch.randn(e, h, f, generator=g)
    n = (5, 3)[rank]  # tokens on this rank (fewer than the per-rank maximum)
    x, ids, w = xs[rank][:n], ids_all[rank][:n], ws[rank][:n]
    out = ops.npu_moe_distribute_dispatch_v2(x=x, expert_ids=ids, group_ep=name, ep_world_size=world,
        ep_rank_id=rank, moe_expert_num=e, global_bs=t_max * world, expert_token_nums_type=0,
        expert_shard_type=0, shared_expert_rank_num=0, quant_mode=0, scales=None, group_tp=name,
        tp_world_size=1, tp_rank_id=0)
    ex, _, assist, cum, ep_recv, tp_recv, _ = out
    local = range(rank * e // world, (rank + 1) * e // world)
    # what this rank must receive: every (rank, token, slot) routed to its experts, grouped by expert
    want = [(le, s, tt, j) for le in local for s in range(world) for tt in range((5, 3)[s]) for j in range(k)
            if int(ids_all[s][tt, j]) == le]
    assert ex.shape[0] == len(want), (ex.shape, len(want))
    for r, (le, s, tt, j) in enumerate(want):
        assert torch.equal(ex[r], xs[s][tt])
    assert cum.tolist() == torch.tensor([sum(1 for w_ in want if w_[0] == le) for le in local]).cumsum(0).tolist()
    # the experts (vLLM-Ascend's unquantised MLP on the stand-in's grouped matmul)
    w13l, w2l = w13[list(local)].transpose(1, 2), w2[list(local)].transpose(1, 2)
    gu = ops.npu_grouped_matmul([ex], [w13l], group_list=cum, group_list_type=0, split_item=2, group_type=0)[0]
    y = ops.npu_grouped_matmul([ops.npu_swiglu(gu)], [w2l], group_list=cum, group_list_type=0, split_item=2,
                               group_type=0)[0]
    combined = ops.npu_moe_distribute_combine_v2(expand_x=y, expert_ids=ids, assist_info_for_combine=assist,
        ep_send_counts=ep_recv, expert_scales=w, group_ep=name, ep_world_size=world, ep_rank_id=rank,
        moe_expert_num=e, global_bs=t_max * world, tp_send_counts=tp_recv, group_tp=name, tp_world_size=1,
        tp_rank_id=0, expert_shard_type=0, shared_expert_rank_num=0)
    ref = torch.zeros(n, h)
    for tt in range(n):
        for j in range(k):
            ee = int(ids[tt, j]); a = w13[ee] @ x[tt]
            ref[tt] += w[tt, j] * (w2[ee] @ (torch.nn.functional.silu(a[:f]) * a[f:]))
    torch.testing.assert_close(combined, ref, rtol=1e-5, atol=1e-5)
    print("MC2_OK", json.dumps({"rank": rank, "received": ex.shape[0]}), flush=True)
    # both ranks done before either tears gloo down (a rank leaving first aborts its peer's gloo threads); then no
    # interpreter teardown: a clean-clone CI run saw rank 0 abort there after MC2_OK and the destroy ("terminate
    # called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)
""")


def test_mc2_dispatch_experts_combine_over_two_ranks_matches_per_token_experts():
    """``npu_moe_distribute_dispatch_v2`` -> grouped-matmul experts -> ``npu_moe_distribute_combine_v2`` on two gloo
    ranks (4 experts, 2 per rank, 5 and 3 tokens): each rank receives exactly the (token, slot) pairs routed to its
    experts, grouped by expert; the combined output equals the per-token expert loop."""
    import os

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", MC2_PROBE, str(REPO)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "MC2_OK" in out, out[-3000:]


def test_unsupported_modes_fail_loudly():
    with pytest.raises(NotImplementedError):
        ops.npu_moe_init_routing_custom(torch.zeros(2, 2), torch.zeros(2, 1, dtype=torch.int32), quant_mode=1)
    with pytest.raises(NotImplementedError):
        ops.npu_fused_infer_attention_score(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1),
                                            input_layout="BSH")


RUNTIME_PROBE = textwrap.dedent("""
    import gc, os, sys
    sys.path.insert(0, sys.argv[1])
    from qwen3_rl.cpu_device.npu import stand_in
    stand_in.install()
    import torch, torch_npu, acl
    assert torch.npu is torch_npu.npu and torch.npu.is_available()
    free0, total = torch.npu.mem_get_info()
    with torch.device("npu:0"):
        w = torch.empty(1024, 256)  # 1 MiB "on the NPU"
    a = torch.zeros(10, device="npu")
    assert w.device.type == "cpu" and a.device.type == "cpu"
    assert torch.npu.mem_get_info()[0] == free0 - 2**20 - 40
    peak = torch.npu.memory_stats()["allocated_bytes.all.peak"]
    del w; gc.collect()
    assert torch.npu.memory_stats()["allocated_bytes.all.current"] == 40
    assert torch.npu.max_memory_allocated() == peak
    assert torch.ones(2).pin_memory().is_pinned() is False
    assert torch.empty(2, pin_memory=True).device.type == "cpu"
    assert torch.ones(3).npu().device.type == "cpu"
    ids = torch.tensor([[3, 0], [1, 3]], dtype=torch.int32)
    h = torch.histc(ids, bins=4, min=0, max=4)
    assert h.dtype == torch.int32 and h.tolist() == [1, 1, 0, 2]
    assert torch.device("npu:1").type == "npu" and torch.ones(1).is_npu is False
    ev, s = torch.npu.Event(enable_timing=True), torch.npu.Stream()
    ev.record(s); torch.npu.current_stream().wait_stream(s); ev.synchronize()
    with torch.npu.stream(s):
        pass
    assert torch.npu.get_soc_version() in (223, 253)
    x = torch.randn(4, 8)
    y, ids, _ = torch.ops._C_ascend.moe_gating_top_k(x, k=2, k_group=1, group_count=1, group_select_mode=1,
                                                    renorm=1, norm_type=0, out_flag=False,
                                                    routed_scaling_factor=1.0, eps=1e-20)
    assert ids.shape == (4, 2) and torch.allclose(y.sum(-1), torch.ones(4))
    sx, row, cnt, _ = torch.ops._C_ascend.npu_moe_init_routing_custom(
        x, ids, active_num=8, expert_num=8, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        active_expert_range=[0, 8], quant_mode=-1)
    assert int(cnt.sum()) == 8
    try:
        torch_npu.npu_not_a_kernel
        raise SystemExit("missing kernel did not raise")
    except AttributeError as e:
        assert "stand-in" in str(e)
    assert not hasattr(torch_npu, "npu_not_a_kernel") and hasattr(torch_npu, "npu_moe_distribute_dispatch_v2")
    # named without a host reference: present (hasattr, mock.patch), raising with the name when called
    for name, f in (("npu_moe_distribute_dispatch", torch_npu.npu_moe_distribute_dispatch),
                    ("npu_quant_matmul", torch_npu.npu_quant_matmul), ("atb.npu_ring_mla", torch_npu.atb.npu_ring_mla),
                    ("npu_fused_infer_attention_score.out", torch_npu.npu_fused_infer_attention_score.out),
                    ("profiler.ProfilerActivity", torch_npu.profiler.ProfilerActivity),
                    ("NPU graph", torch.npu.graph_task_update_begin)):
        try:
            f()
            raise SystemExit(f"{name} did not raise")
        except RuntimeError as e:
            assert name in str(e) and "stand-in" in str(e), e
    assert torch.ops.npu.npu_rms_norm is torch_npu.npu_rms_norm
    assert torch.ops.npu.npu_fused_infer_attention_score is torch_npu.npu_fused_infer_attention_score
    assert torch.version.cann is None and torch.distributed.is_hccl_available()
    assert torch_npu._C._npu_get_soc_version() == torch.npu.get_soc_version()
    assert torch_npu._C._npu_setStream(torch.npu.current_stream()) is None
    assert torch.npu.graph_pool_handle() != torch.npu.graph_pool_handle()
    # seeded generators "on the NPU" are host generators: same numbers as the host's for the same seed
    g = torch.Generator(device="npu").manual_seed(7)
    assert isinstance(g, torch.Generator) and isinstance(torch.default_generator, torch.Generator)
    assert g.device.type == "cpu"
    assert torch.equal(torch.rand(5, generator=g, device="npu"), torch.rand(5, generator=torch._C.Generator().manual_seed(7)))
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("hccl", rank=0, world_size=1)
    opts = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    opts.hccl_config = {"hccl_buffer_size": 200, "hccl_op_expansion_mode": "AIV"}
    g = dist.new_group([0], backend="hccl", pg_options=opts)
    t = torch.ones(3, device="npu"); dist.all_reduce(t, group=g)
    name = g._get_backend(torch.device("npu")).get_hccl_comm_name(0)
    from qwen3_rl.cpu_device.npu import hccl
    assert hccl.GROUP_OPTIONS[dist._get_process_group_name(g)] == opts.hccl_config
    assert isinstance(name, str) and name
    dist.destroy_process_group()
    print("RUNTIME_OK")
""")


def test_runtime_stand_in_in_a_fresh_interpreter():
    port = free_port()
    proc = subprocess.run([sys.executable, "-c", RUNTIME_PROBE, str(REPO), str(port)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "RUNTIME_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
