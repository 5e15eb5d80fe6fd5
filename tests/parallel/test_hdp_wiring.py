"""HDP wiring: RoPE positions vs Megatron's CP split, sub-groups + ring-shaped attention on 4 gloo processes,
loss scaling, and the patched Megatron RoPE executed with an HDP micro-batch."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen3_rl.parallel.hdp import HDPAssignment, Placement, assign_hdp
from qwen3_rl.parallel.hdp_runtime import HDPConfig, HDPRuntime, check_supported
from qwen3_rl.parallel.hdp_wiring import (
    FILLER,
    HDPProcessGroups,
    aligned_blocks,
    assemble_owned_rows,
    filler_length,
    hdp_attention,
    hdp_loss_scale,
    pack_sequences,
    padded_length,
    plan_micro_batches,
    rope_positions,
    sub_cp_para,
    sub_packed_seq_params,
    unpack_outputs,
)

from conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def megatron_thd_positions(cp_rank: int, cp_size: int, padded: int) -> torch.Tensor:
    """Copy of the index arithmetic of megatron-core 0.12.1 rope_utils._get_thd_freqs_on_this_cp_rank
    applied to positions (kept only as a reference; the patched module itself is executed below)."""
    x = torch.empty(padded // cp_size)
    freqs = torch.arange(padded)
    seg = x.size(0) // 2
    full = cp_size * x.size(0)
    return torch.cat([freqs[cp_rank * seg:(cp_rank + 1) * seg], freqs[full - (cp_rank + 1) * seg:full - cp_rank * seg]])


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("s", [1, 7, 64, 1000])
def test_rope_positions_match_megatron_full_cp(k: int, s: int) -> None:
    p = padded_length(s, k, align=2)
    assert p % (2 * k * 2 if k > 1 else 2) == 0 and p >= s
    got = torch.cat([rope_positions(p, k, i) for i in range(k)])
    assert sorted(got.tolist()) == list(range(p))  # the k ranks cover the padded sequence exactly once
    for i in range(k):
        assert torch.equal(rope_positions(p, k, i), megatron_thd_positions(i, k, p))


def two_mb_assignment() -> HDPAssignment:
    # micro-batch 0: seq 0 on all 4 ranks, seq 1 on block (2,3), seqs 2,3 DP on ranks 0 and 1
    # micro-batch 1: seq 4 on block (0,1), seq 5 DP on rank 3
    pl = [Placement(0, 37, 0, 0, 4), Placement(1, 21, 0, 2, 2), Placement(2, 9, 0, 0, 1),
          Placement(3, 12, 0, 1, 1), Placement(4, 17, 1, 0, 2), Placement(5, 5, 1, 3, 1)]
    a = HDPAssignment(4, 10_000, assign_hdp([1], 1, 10).cost_model, pl, 2)
    a.recompute()
    return a


def test_plan_pack_unpack_roundtrip_single_process() -> None:
    a = two_mb_assignment()
    L = 40
    ids = torch.randint(1, 1000, (6, L))
    lens = [p.length for p in a.placements]
    chunks: dict[tuple[int, int], torch.Tensor] = {}
    plans = {r: plan_micro_batches(a, r) for r in range(4)}
    assert {len(v) for v in plans.values()} == {2}
    for r in range(4):
        for mb in plans[r]:
            keys = [s.order_key for s in mb.segments]
            assert keys == sorted(keys)
            if mb.seq_indices == [FILLER]:
                assert r == 2 and mb.micro_batch == 1 and mb.num_tokens == 2  # rank 2 idle in mb 1
                chunks[(r, mb.micro_batch)] = torch.zeros(2, dtype=ids.dtype)
                continue
            packed = pack_sequences(ids[mb.seq_indices], [lens[i] for i in mb.seq_indices], mb)
            assert packed.shape == (mb.num_tokens,)
            assert torch.equal(mb.position_ids(), torch.cat([s.positions() for s in mb.segments]))
            chunks[(r, mb.micro_batch)] = packed
    # unpack with a gather that reads the other ranks' packed tensors
    for r in range(4):
        for mb in plans[r]:
            if mb.seq_indices == [FILLER]:
                continue

            def gather(local, g, mbi=mb.micro_batch):
                out = []
                for q in range(g.block_start, g.block_start + g.block_size):
                    other = next(x for x in plans[q] if x.micro_batch == mbi)
                    og = next(h for h in other.groups() if (h.block_start, h.block_size) == (g.block_start,
                                                                                             g.block_size))
                    out.append(chunks[(q, mbi)][og.lo:og.hi])
                return out
            res = unpack_outputs(chunks[(r, mb.micro_batch)], mb, L, gather)
            for j, i in enumerate(mb.seq_indices):
                assert torch.equal(res[j, :lens[i]], ids[i, :lens[i]])
                assert not res[j, lens[i]:].any()


@pytest.mark.parametrize("align, tokens", [(1, 2), (2, 2), (4, 4), (8, 8)])
def test_filler_is_at_least_two_tokens_and_a_multiple_of_align(align: int, tokens: int) -> None:
    """A filler is one ring group of one sequence on its own rank. MindSpeed's causal-EoD backward fails for a ring
    group whose local sequences all have 1 token (core/context_parallel/utils.py:43-55 gives a float
    torch.tensor([]) index, ring_context_parallel.py:1086 IndexError), so the filler is never 1 token: with align
    (TP size) 1 it is 2 tokens, otherwise align tokens. HDPRuntime.split attends exactly those tokens, no loss."""
    from tensordict import TensorDict

    assert filler_length(align) == tokens
    a = two_mb_assignment()
    (mb,) = [m for m in plan_micro_batches(a, 2, align=align) if m.is_filler]  # rank 2 is idle in micro-batch 1
    (seg,) = mb.segments
    assert (seg.seq, seg.block_start, seg.block_size, seg.ring_index, seg.offset) == (FILLER, 2, 1, 0, 0)
    assert (seg.length, seg.padded, seg.local_length, mb.num_tokens, mb.max_padded) == (tokens,) * 5
    assert mb.local_cu_seqlens() == [0, tokens] and mb.position_ids().tolist() == list(range(tokens))
    assert mb.groups()[0].cu_seqlens_padded == [0, tokens]

    rt = HDPRuntime(HDPConfig(enable=True), 1, 2, align, 64, sync_num_micro_batches=lambda n: 2)
    am = torch.zeros(1, 12, dtype=torch.bool)
    am[0, :9] = True
    batch = TensorDict({"attention_mask": am, "response_mask": am[:, 4:].long()}, batch_size=[1])
    step = rt.plan(am, batch["response_mask"])  # 1 micro-batch padded to the synced 2: the second is filler
    (_, (rows, filler)) = rt.split(batch, step)
    assert filler.is_filler and filler.micro_batch == 1 and filler.segments[0].length == tokens
    assert rows["attention_mask"][0].tolist() == [True] * tokens + [False] * (12 - tokens)
    assert not rows["response_mask"].any()
    with pytest.raises(ValueError, match="align must be >= 1"):
        filler_length(0)


def test_loss_scale_reproduces_group_token_mean_gradient() -> None:
    """Megatron scales micro-batch losses by C/M and DDP averages over C ranks: HDP-scaled per-rank
    token-means then give the gradient of the token-mean over the whole group batch."""
    a = two_mb_assignment()
    C, M = 4, a.num_micro_batches
    torch.manual_seed(0)
    w = torch.randn(6, requires_grad=True)  # one parameter per sequence, loss_i = w_i * tokens_i
    tok = torch.tensor([p.length for p in a.placements], dtype=torch.float)
    total = torch.zeros(())
    for r in range(C):
        for mb in plan_micro_batches(a, r):
            idx = mb.seq_indices
            if idx == [FILLER]:
                continue
            local = sum(tok[i] for i in idx)
            mean = sum(w[i] * tok[i] for i in idx) / local
            # each block member back-propagates only its share (its chunks): weight 1/k of the sequence
            mean_chunks = sum(w[i] * tok[i] / s.block_size for i, s in zip(idx, mb.segments, strict=True)) / local
            scale = hdp_loss_scale(int(local), int(tok.sum()), M)
            # value from the full sequences, gradient through own chunks only
            loss = (mean.detach() + mean_chunks - mean_chunks.detach()) * scale
            total = total + loss * C / M
    (total / C).backward()
    ref = tok / tok.sum()
    assert torch.allclose(w.grad, ref, atol=1e-6)


def test_assemble_owned_rows_and_config() -> None:
    a = two_mb_assignment()
    rows_by_rank = {}
    for r in range(4):
        idx = [mb.seq_indices for mb in plan_micro_batches(a, r)]
        flat = [i for m in idx for i in m]
        rows_by_rank[r] = (torch.tensor([[float(i)] for i in flat]).reshape(-1, 1), idx)
    parts = [assemble_owned_rows(rows, idx, a, r, 6) for r, (rows, idx) in rows_by_rank.items()]
    full = sum(parts)
    assert full[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # each sequence exactly once
    from qwen3_rl.trainer.seam import RecipeConfig, SeamConfigError

    assert RecipeConfig.from_group(None).hdp == HDPConfig() and HDPConfig().enable is False
    with pytest.raises(SeamConfigError, match="qwen3_rl.hdp.enabel: unknown key"):
        RecipeConfig.from_group({"hdp": {"enabel": True}})
    with pytest.raises(SeamConfigError, match="qwen3_rl.hdp: token_budget must be >= 1"):
        RecipeConfig.from_group({"hdp": {"enable": True, "token_budget": 0}})
    with pytest.raises(ValueError, match="loss_agg_mode"):
        check_supported("seq-mean-token-mean", False, None, True)
    check_supported("token-mean", False, None, True)


def test_sub_cp_para_and_blocks() -> None:
    assert aligned_blocks(4) == [(0, 2), (2, 2), (0, 4)]
    made = []
    pgs = HDPProcessGroups.build([[8, 9, 10, 11], [12, 13, 14, 15]], [12, 13, 14, 15],
                                 lambda r: made.append(tuple(r)) or tuple(r))
    assert aligned_blocks(4, min_size=1)[:4] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert made == [(8,), (9,), (10,), (11,), (8, 9), (10, 11), (8, 9, 10, 11),
                    (12,), (13,), (14,), (15,), (12, 13), (14, 15), (12, 13, 14, 15)]
    a = two_mb_assignment()
    mb = plan_micro_batches(a, 3, process_groups=pgs)[0]
    g = [x for x in mb.groups() if x.block_size == 2][0]
    base = {"causal": True, "cp_group": "full", "cp_size": 4, "rank": 3, "cp_global_ranks": [12, 13, 14, 15],
            "cp_inner_ranks": [12, 13], "megatron_cp_in_bnsd": True}
    p = sub_cp_para(base, g, pgs)
    assert p["cp_group"] == (14, 15) and p["cp_size"] == 2 and p["rank"] == 1
    assert p["cp_global_ranks"] == [14, 15] and p["cp_inner_ranks"] == [15] and p["causal"] is True
    assert base["cp_group"] == "full"  # not mutated

    @dataclasses.dataclass
    class PSP:  # field names of megatron.core.packed_seq_params.PackedSeqParams
        qkv_format: str = "thd"
        cu_seqlens_q: torch.Tensor | None = None
        cu_seqlens_kv: torch.Tensor | None = None
        cu_seqlens_q_padded: torch.Tensor | None = None
        cu_seqlens_kv_padded: torch.Tensor | None = None
        max_seqlen_q: int | None = None
        max_seqlen_kv: int | None = None

    mb0 = plan_micro_batches(a, 0)[0]  # rank 0: seq 2 DP, seq 0 on 4 ranks
    g4 = mb0.groups()[-1]
    sp = sub_packed_seq_params(PSP(cu_seqlens_q=torch.zeros(1, dtype=torch.int32)), g4)
    assert sp.cu_seqlens_q_padded.tolist() == [0, 40] and sp.cu_seqlens_q.tolist() == [0, 10]
    assert sp.max_seqlen_q == 40 and not hasattr(sp, "hdp")


# ---------------------------------------------------------------- 4 gloo processes
D = 8  # head dim


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.outer(pos.to(torch.float64), inv)
    emb = torch.cat([f, f], -1)
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def ring_attention(q, k, v, qpos, kpos, group, ring_index, size):
    """Toy ring attention: K/V (with their positions) pass around the ring k-1 times; causal by position."""
    num = torch.zeros_like(q)
    den = torch.zeros(q.shape[0], 1, dtype=q.dtype)
    mx = torch.full((q.shape[0], 1), -torch.inf, dtype=q.dtype)
    cur = torch.cat([k, v, kpos[:, None].to(q.dtype)], 1)
    ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
    for step in range(size):
        kk, vv, kp = cur[:, :D], cur[:, D:2 * D], cur[:, 2 * D].long()
        s = q @ kk.T / D ** 0.5
        s = s.masked_fill(kp[None, :] > qpos[:, None], -torch.inf)
        new_mx = torch.maximum(mx, s.max(-1, keepdim=True).values)
        fin = torch.where(torch.isinf(new_mx), torch.zeros_like(new_mx), new_mx)
        corr = torch.exp(torch.where(torch.isinf(mx), torch.full_like(mx, -torch.inf), mx - fin))
        p = torch.exp(s - fin)
        num = num * corr + p @ vv
        den = den * corr + p.sum(-1, keepdim=True)
        mx = new_mx
        if step + 1 < size:
            nxt = torch.empty_like(cur)
            send_to = ranks[(ring_index + 1) % size]
            recv_from = ranks[(ring_index - 1) % size]
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, send_to, group),
                                           dist.P2POp(dist.irecv, nxt, recv_from, group)])
            for r in reqs:
                r.wait()
            cur = nxt
    return num / den


def reference(x: torch.Tensor, wq, wk, wv) -> torch.Tensor:
    pos = torch.arange(x.shape[0])
    q, k, v = rope(x @ wq, pos), rope(x @ wk, pos), x @ wv
    s = (q @ k.T / D ** 0.5).masked_fill(torch.ones(len(pos), len(pos)).triu(1).bool(), -torch.inf)
    return torch.softmax(s, -1) @ v


def _worker(rank: int, port: int, seqs: list[torch.Tensor], weights, q: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        lens = [len(s) for s in seqs]
        a = assign_hdp(lens, 4, 24, align=1)
        pgs = HDPProcessGroups.build([[0, 1, 2, 3]], [0, 1, 2, 3], lambda r: dist.new_group(r))
        rt = HDPRuntime(HDPConfig(enable=True), rank, 4, 1, 24, pgs, None)
        L = max(lens)
        x_all = torch.zeros(len(seqs), L, D, dtype=torch.float64)
        for i, s in enumerate(seqs):
            x_all[i, :len(s)] = s
        wq, wk, wv = weights
        results = {}
        for mb in plan_micro_batches(a, rank, process_groups=pgs):
            if mb.seq_indices == [FILLER]:
                continue
            x = pack_sequences(x_all[mb.seq_indices], [lens[i] for i in mb.seq_indices], mb)
            pos = mb.position_ids()
            qq, kk, vv = rope(x @ wq, pos), rope(x @ wk, pos), x @ wv

            def ring_fn(q_, k_, v_, g, pos=pos):
                out = []
                for seg in g.segments:
                    lo, hi = seg.offset - g.lo, seg.offset - g.lo + seg.local_length
                    p = pos[seg.offset:seg.offset + seg.local_length]
                    out.append(ring_attention(q_[lo:hi], k_[lo:hi], v_[lo:hi], p, p,
                                              pgs.group(g.block_start, g.block_size), g.ring_index, g.block_size))
                return torch.cat(out)

            def local_fn(q_, k_, v_, g, pos=pos):
                out = []
                for seg in g.segments:
                    lo, hi = seg.offset - g.lo, seg.offset - g.lo + seg.local_length
                    p = pos[seg.offset:seg.offset + seg.local_length]
                    out.append(ring_attention(q_[lo:hi], k_[lo:hi], v_[lo:hi], p, p, None, 0, 1))
                return torch.cat(out)

            o = hdp_attention(qq, kk, vv, mb, ring_fn, local_fn)
            am = torch.zeros(len(mb.segments), L, dtype=torch.bool)
            for j, i in enumerate(mb.seq_indices):
                am[j, :lens[i]] = True
            full = rt.postprocess(o.unsqueeze(0), mb, am)
            for j, i in enumerate(mb.seq_indices):
                results[i] = full[j, :lens[i]]
        q.put((rank, {i: t.tolist() for i, t in results.items()},
               [(p.block_start, p.block_size, p.micro_batch) for p in a.placements]))
    except Exception as e:  # report to the parent instead of hanging it
        q.put((rank, repr(e), None))
        raise
    finally:
        dist.destroy_process_group()


def test_gloo_subgroups_ring_attention_equals_full_computation() -> None:
    torch.manual_seed(1)
    lens = [40, 30, 9, 12, 5, 17, 3]
    seqs = [torch.randn(n, D, dtype=torch.float64) for n in lens]
    weights = tuple(torch.randn(D, D, dtype=torch.float64) / D ** 0.5 for _ in range(3))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, seqs, weights, q)) for r in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in range(4)]
    for p in procs:
        p.join(timeout=60)
    placements = None
    covered = set()
    for rank, res, pl in got:
        assert isinstance(res, dict), f"rank {rank} failed: {res}"
        placements = pl
        for i, vals in res.items():
            ref = reference(seqs[i], *weights)
            assert torch.allclose(torch.tensor(vals, dtype=torch.float64), ref, atol=1e-9), (rank, i)
            covered.add(i)
    assert covered == set(range(len(lens)))
    sizes = {k for _, k, _ in placements}
    assert 1 in sizes and max(sizes) > 1, f"test needs DP and CP blocks, got {placements}"


def test_patched_megatron_rope_uses_hdp_micro_batch(patched_imports: Path, monkeypatch) -> None:
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 4)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: 1)
    a = two_mb_assignment()
    mb = plan_micro_batches(a, 1)[0]  # rank 1: seq 0 on 4 ranks (index 1), seq 3 DP
    torch.manual_seed(0)
    t = torch.randn(mb.num_tokens, 2, D)
    freqs = torch.randn(64, 1, 1, D)
    cu = torch.tensor(mb.local_cu_seqlens(), dtype=torch.int32)
    got = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, hdp=mb)
    # reference: megatron's own function per segment with full CP of the block's size and the ring index
    parts = []
    for seg in mb.segments:
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda k=seg.block_size: k)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda i=seg.ring_index: i)
        x = t[seg.offset:seg.offset + seg.local_length]
        parts.append(rope_utils._apply_rotary_pos_emb_thd(
            x, torch.tensor([0, seg.padded], dtype=torch.int32), freqs))
    assert torch.equal(got, torch.cat(parts))
    # the public entry point routes hdp, and without hdp it is upstream behaviour
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, apply_rope_fusion=False)
    assert torch.equal(rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, hdp=mb), got)
    import inspect

    from megatron.core.transformer import attention
    src = inspect.getsource(attention.Attention.forward)
    assert 'getattr(packed_seq_params, "hdp", None)' in src


def test_patched_verl_forward_and_config_with_hdp(patched_imports: Path) -> None:
    """Patched verl mcore forward with an HDP micro-batch packs this rank's sequences, hands the micro-batch
    to the model on PackedSeqParams.hdp and unpacks the outputs per sequence."""
    from verl.models.mcore.model_forward import model_forward_gen
    from verl.workers.config import McoreActorConfig

    from qwen3_rl.parallel.hdp_runtime import HDPPacking

    cfg = McoreActorConfig(use_dynamic_bsz=True, rollout_n=1, ppo_mini_batch_size=1)
    assert cfg.qwen3_rl == {}  # the actor's group is declared, empty by default
    pl = [Placement(0, 5, 0, 0, 1), Placement(1, 3, 0, 1, 1), Placement(2, 6, 0, 0, 1)]
    a = HDPAssignment(2, 64, assign_hdp([1], 1, 10).cost_model, pl, 1, align=2)
    a.recompute()
    mb = plan_micro_batches(a, 0)[0]  # rank 0: seqs 0 and 2, DP
    assert mb.seq_indices == [0, 2]
    L = 8
    ids = torch.zeros(2, L, dtype=torch.long)
    am = torch.zeros(2, L, dtype=torch.bool)
    ids[0, 1:6] = torch.arange(1, 6)  # left-padded like verl
    am[0, 1:6] = True
    ids[1, 2:8] = torch.arange(11, 17)
    am[1, 2:8] = True
    seen = {}

    class Model(torch.nn.Module):
        pre_process = True
        post_process = True

        def forward(self, input_ids, attention_mask, position_ids, packed_seq_params):
            seen["psp"] = packed_seq_params
            seen["ids"] = input_ids
            return input_ids.float().unsqueeze(-1) * 2  # [1, T, 1]

    def logits_processor(logits, label, label_mask):
        return {"log_probs": logits[..., 0] + label * 0}

    fwd = model_forward_gen(False)
    out = fwd(Model(), ids, am, torch.zeros_like(ids), {}, logits_processor=logits_processor,
              logits_processor_args={"label": ids, "label_mask": am}, packing=HDPPacking(mb))
    assert seen["psp"].hdp is mb and seen["psp"].qkv_format == "thd"
    # packed: seq 0 (5 tokens padded to 6) then seq 2 (6 tokens)
    assert seen["ids"].tolist() == [[1, 2, 3, 4, 5, 0, 11, 12, 13, 14, 15, 16]]
    assert seen["psp"].cu_seqlens_q.tolist() == [0, 6, 12]
    assert torch.equal(out["log_probs"], (ids * 2).float() * am)
