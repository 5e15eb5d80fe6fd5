"""MoE train -> rollout reshard plan (qwen3_rl.moe.reshard): coverage, no duplicates, holders, balance,
upstream rank/expert conventions, and a real 4-process gloo all_to_all_single with the plan's split sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen3_rl.moe.reshard import (
    MoEShape,
    ReshardPlan,
    RolloutLayout,
    ShardItem,
    TrainLayout,
    expert_group_exchange,
    layer_buckets,
    plan_moe_reshard,
    rollout_expert_range,
    train_rank,
    train_stage_layers,
)

from conftest import free_port

REPO = Path(__file__).resolve().parents[2]
QWEN3_235B = MoEShape(num_layers=94, num_experts=128, hidden_size=4096, moe_intermediate_size=1536)
TRAIN_235B = TrainLayout(tp=4, pp=4, cp=4, ep=32, etp=1, world=128, first_stage_layers=23, last_stage_layers=23)
ROLLOUT_235B = RolloutLayout(tp=4, dp=32, expert_parallel=True)


# ----------------------------------------------------------------------------- independent reference model


def _decode_train(train: TrainLayout, rank: int) -> tuple[int, int, int]:
    """(pp_stage, ep_rank, etp_rank) of a rank, by peeling megatron's tp-ep-dp-pp order (tp fastest)."""
    etp_r, rest = rank % train.etp, rank // train.etp
    ep_r, rest = rest % train.ep, rest // train.ep
    edp = train.world // (train.etp * train.ep * train.pp)
    return rest // edp, ep_r, etp_r


def _holds(train: TrainLayout, shape: MoEShape, rank: int, it: ShardItem) -> bool:
    stage, ep_r, etp_r = _decode_train(train, rank)
    layers = train_stage_layers(train, shape.num_layers)[stage]
    per_ep = shape.num_experts // train.ep
    fe = shape.moe_intermediate_size // train.etp
    return (
        it.layer in layers
        and ep_r * per_ep <= it.expert < (ep_r + 1) * per_ep
        and etp_r * fe <= it.f0 < it.f1 <= (etp_r + 1) * fe
    )


def _needed(rollout: RolloutLayout, shape: MoEShape, rank: int) -> dict[int, tuple[int, int]]:
    """expert -> (f0, f1) rank needs in every layer (vLLM: EP blocks, first E%EP ranks one more; else F/S)."""
    E, F = shape.num_experts, shape.moe_intermediate_size
    if rollout.expert_parallel:
        ep = rollout.tp * rollout.dp
        counts = [E // ep + (1 if r < E % ep else 0) for r in range(ep)]
        start = sum(counts[:rank])
        return {e: (0, F) for e in range(start, start + counts[rank])}
    s = F // (rollout.tp * rollout.dp)
    return {e: (rank * s, (rank + 1) * s) for e in range(E)}


def check_plan(plan: ReshardPlan, train: TrainLayout, rollout: RolloutLayout, shape: MoEShape,
               layers: list[int] | None = None) -> None:
    """Every destination gets exactly its needed rows, once; every source holds what it sends; split sizes
    match the items; network traffic equals the unavoidable minimum; replica groups balanced by greedy."""
    world, H = train.world, shape.hidden_size
    layers = list(range(shape.num_layers)) if layers is None else layers
    got: dict[tuple[int, int, int], list[tuple[int, int]]] = defaultdict(list)
    for (src, dst), items in plan.sends.items():
        assert list(items) == sorted(items)
        assert plan.numel[src, dst] == sum(it.numel(H) for it in items)
        for it in items:
            assert _holds(train, shape, src, it), f"rank {src} does not hold {it}"
            got[(dst, it.layer, it.expert)].append((it.f0, it.f1))
    assert int(plan.numel.sum()) == sum(it.numel(H) for v in plan.sends.values() for it in v)
    min_network = 0
    for dst in range(world):
        need = _needed(rollout, shape, dst)
        for layer in layers:
            for e, (a, b) in need.items():
                ivs = sorted(got.pop((dst, layer, e), []))
                assert ivs, f"rank {dst} gets nothing of layer {layer} expert {e}"
                assert ivs[0][0] == a and ivs[-1][1] == b, (dst, layer, e, ivs)
                for (_, x1), (y0, _) in zip(ivs, ivs[1:], strict=False):
                    assert x1 == y0, f"gap/overlap for rank {dst} layer {layer} expert {e}: {ivs}"
                for f0, f1 in ivs:
                    if not _holds(train, shape, dst, ShardItem(layer, e, f0, f1)):
                        min_network += 3 * (f1 - f0) * H
    assert not got, f"unneeded shards sent: {list(got)[:5]}"
    net = plan.numel - np.diag(np.diag(plan.numel))
    assert int(net.sum()) == min_network  # zero redundant traffic, local copies used whenever possible
    # greedy balance inside each replica group (ranks holding the same shards): spread <= largest item
    send = net.sum(axis=1)
    groups: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for r in range(world):
        groups[_decode_train(train, r)].append(r)
    biggest = max((it.numel(H) for v in plan.sends.values() for it in v), default=0)
    for members in groups.values():
        assert send[members].max() - send[members].min() <= biggest


# ----------------------------------------------------------------------------- the configured 235B layout


def test_235b_train_ep32_to_rollout_ep128() -> None:
    plan = plan_moe_reshard(TRAIN_235B, ROLLOUT_235B, QWEN3_235B)
    check_plan(plan, TRAIN_235B, ROLLOUT_235B, QWEN3_235B)
    st_ = plan.stats()
    print("235B EP32->EP128 reshard:", json.dumps(st_))
    one_expert_layer = 3 * 1536 * 4096 * 2
    assert st_["total_bytes"] == 94 * 128 * one_expert_layer  # every expert weight moves exactly once
    assert st_["max_recv_bytes"] <= 94 * one_expert_layer  # each rollout rank: 1 expert x 94 layers
    # edp = 1: no choice of source; the busiest rank sends its 4 experts x 24 layers (23/24/24/23 pipeline)
    assert st_["max_send_bytes"] == 24 * 4 * one_expert_layer
    assert st_["mean_send_bytes"] == st_["network_bytes"] / 128
    assert st_["send_max_over_mean"] < 1.03
    assert plan.input_split_sizes(5) == [int(x) for x in plan.numel[5]]
    assert sum(plan.output_split_sizes(7)) == 94 * 3 * 1536 * 4096


def test_235b_layer_buckets_keep_every_stage_sending() -> None:
    buckets = layer_buckets(TRAIN_235B, 94, 2)
    assert sorted(x for b in buckets for x in b) == list(range(94))
    plan = plan_moe_reshard(TRAIN_235B, ROLLOUT_235B, QWEN3_235B, layers=buckets[0])
    check_plan(plan, TRAIN_235B, ROLLOUT_235B, QWEN3_235B, layers=buckets[0])
    assert plan.stats()["send_max_over_mean"] < 1.01  # only local copies (no network) make ranks differ
    assert (plan.numel.sum(axis=1) > 0).all()  # every rank sends in the first bucket


def test_235b_rollout_without_expert_parallel_few_layers() -> None:
    rollout = RolloutLayout(tp=4, dp=32, expert_parallel=False)  # vLLM MoE TP = 128: 12 rows of F each
    layers = [0, 30, 93]
    plan = plan_moe_reshard(TRAIN_235B, rollout, QWEN3_235B, layers=layers)
    check_plan(plan, TRAIN_235B, rollout, QWEN3_235B, layers=layers)


def test_rollout_ep_not_multiple_of_train_ep_is_supported() -> None:
    shape = MoEShape(num_layers=4, num_experts=30, hidden_size=8, moe_intermediate_size=12)
    train = TrainLayout(tp=2, pp=2, ep=3, etp=2, world=24, cp=1)  # edp = 2
    rollout = RolloutLayout(tp=4, dp=6)  # vLLM EP 24, 30 experts: 6 ranks with 2, 18 with 1
    plan = plan_moe_reshard(train, rollout, shape)
    check_plan(plan, train, rollout, shape)


def test_replicas_balance_send_volume() -> None:
    shape = MoEShape(num_layers=2, num_experts=4, hidden_size=4, moe_intermediate_size=8)
    train = TrainLayout(tp=1, pp=1, ep=2, etp=1, world=8)  # edp = 4: each expert on 4 ranks
    rollout = RolloutLayout(tp=2, dp=4, expert_parallel=False)
    plan = plan_moe_reshard(train, rollout, shape)
    check_plan(plan, train, rollout, shape)
    assert plan.stats()["send_max_over_mean"] == pytest.approx(1.0)


@st.composite
def _layouts(draw):
    etp = draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([1, 2, 4]))
    edp = draw(st.sampled_from([1, 2]))
    pp = draw(st.sampled_from([1, 2]))
    world = etp * ep * edp * pp
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if (world // pp) % d == 0]))
    rtp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if world % d == 0]))
    expert_parallel = draw(st.booleans())
    num_experts = ep * draw(st.integers(1, 4))
    if expert_parallel and num_experts < world:
        num_experts = ep * -(-world // ep)
    s = 1 if expert_parallel else world
    f = np.lcm(etp, s) * draw(st.integers(1, 3))
    layers = pp * draw(st.integers(1, 3))
    shape = MoEShape(num_layers=layers, num_experts=num_experts, hidden_size=draw(st.integers(1, 4)),
                     moe_intermediate_size=int(f), dtype_bytes=2)
    return (TrainLayout(tp=tp, pp=pp, ep=ep, etp=etp, world=world, cp=1),
            RolloutLayout(tp=rtp, dp=world // rtp, expert_parallel=expert_parallel), shape)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layouts())
def test_random_small_layouts(case) -> None:
    train, rollout, shape = case
    plan = plan_moe_reshard(train, rollout, shape)
    check_plan(plan, train, rollout, shape)


# ----------------------------------------------------------------------------- constraints


@pytest.mark.parametrize(
    ("train", "rollout", "shape", "match"),
    [
        (TRAIN_235B, ROLLOUT_235B, MoEShape(64, 0, 5120, 0), "dense model"),
        (TRAIN_235B, RolloutLayout(tp=4, dp=16), QWEN3_235B, "colocated"),
        (TrainLayout(tp=1, pp=1, ep=3, etp=1, world=3), RolloutLayout(tp=1, dp=3), MoEShape(2, 8, 4, 4),
         "not divisible by train EP"),
        (TrainLayout(tp=1, pp=1, ep=2, etp=1, world=4), RolloutLayout(tp=2, dp=2, expert_parallel=False),
         MoEShape(2, 4, 4, 6), "vLLM MoE TP"),
        (TrainLayout(tp=1, pp=1, ep=2, etp=1, world=4), RolloutLayout(tp=2, dp=2), MoEShape(2, 2, 4, 4),
         "some EP ranks would hold no expert"),
        (TrainLayout(tp=1, pp=4, ep=1, etp=1, world=4), RolloutLayout(tp=2, dp=2), MoEShape(94, 4, 4, 4),
         "first/last_stage_layers"),
        (TrainLayout(tp=1, pp=1, ep=2, etp=3, world=6), RolloutLayout(tp=2, dp=3), MoEShape(2, 6, 4, 4),
         "ETP"),
    ],
)
def test_constraints_raise_named_error(train, rollout, shape, match) -> None:
    with pytest.raises(ValueError, match=match):
        plan_moe_reshard(train, rollout, shape)


# ----------------------------------------------------------------------------- upstream conventions

_UPSTREAM_PROBE = r"""
import json, sys
from megatron.core.parallel_state import RankGenerator
from vllm.model_executor.layers.fused_moe.layer import determine_expert_map
out = {"meg": [], "vllm": []}
for etp, ep, edp, pp in [(1, 32, 1, 4), (2, 2, 2, 2), (2, 3, 1, 2)]:
    g = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out["meg"].append({k: g.get_ranks(k) for k in ("tp", "ep", "dp", "pp")})
for ep, e in [(128, 128), (24, 30), (5, 18), (7, 7)]:
    out["vllm"].append([determine_expert_map(ep, r, e)[1].tolist() for r in range(ep)])
print("JSON" + json.dumps(out))
"""


def test_rank_and_expert_conventions_match_pristine_upstream(pristine_workspace: Path) -> None:
    """train_rank == megatron-core 0.12.1 expert RankGenerator groups; rollout_expert_range == vLLM 0.13's
    determine_expert_map (run in a subprocess on the pristine trees)."""
    env = dict(os.environ, VLLM_PLUGINS="none", VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join(str(pristine_workspace / d) for d in ("Megatron-LM", "vllm")))
    proc = subprocess.run([sys.executable, "-c", _UPSTREAM_PROBE], capture_output=True, text=True, env=env,
                          timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("JSON")]
    assert line, proc.stdout + proc.stderr
    out = json.loads(line[0][4:])
    for (etp, ep, edp, pp), groups in zip([(1, 32, 1, 4), (2, 2, 2, 2), (2, 3, 1, 2)], out["meg"], strict=True):
        t = TrainLayout(tp=1, pp=pp, ep=ep, etp=etp, world=etp * ep * edp * pp)
        coords = {(a, b, c, d): train_rank(t, etp_rank=a, ep_rank=b, edp_rank=c, pp_rank=d)
                  for a in range(etp) for b in range(ep) for c in range(edp) for d in range(pp)}
        mine = {
            "tp": sorted(sorted(coords[(a, b, c, d)] for a in range(etp))
                         for b in range(ep) for c in range(edp) for d in range(pp)),
            "ep": sorted(sorted(coords[(a, b, c, d)] for b in range(ep))
                         for a in range(etp) for c in range(edp) for d in range(pp)),
            "dp": sorted(sorted(coords[(a, b, c, d)] for c in range(edp))
                         for a in range(etp) for b in range(ep) for d in range(pp)),
            "pp": sorted(sorted(coords[(a, b, c, d)] for d in range(pp))
                         for a in range(etp) for b in range(ep) for c in range(edp)),
        }
        for k in mine:
            assert mine[k] == sorted(sorted(g) for g in groups[k]), (etp, ep, edp, pp, k)
    for (ep, e), maps in zip([(128, 128), (24, 30), (5, 18), (7, 7)], out["vllm"], strict=True):
        for r, m in enumerate(maps):
            assert [i for i, x in enumerate(m) if x >= 0] == list(rollout_expert_range(e, ep, r))


# ----------------------------------------------------------------------------- real all_to_all_single (gloo)

_CASES = [
    # train TP2 ETP2 EP2 (world 4) -> vLLM EP4 with 6 experts (2,2,1,1 per rank)
    (TrainLayout(tp=2, pp=1, ep=2, etp=2, world=4), RolloutLayout(tp=2, dp=2), MoEShape(2, 6, 3, 4, 4)),
    # train PP2 EP2 -> vLLM without EP (MoE TP = 4 over F=8)
    (TrainLayout(tp=1, pp=2, ep=2, etp=1, world=4), RolloutLayout(tp=2, dp=2, expert_parallel=False),
     MoEShape(4, 4, 3, 8, 4)),
    # train EP1 edp2 PP2 (replicated experts) -> vLLM EP4, rollout EP not a multiple of... EP1 -> EP4
    (TrainLayout(tp=1, pp=2, ep=1, etp=1, world=4), RolloutLayout(tp=1, dp=4), MoEShape(2, 5, 2, 2, 4)),
]


def _full_weights(shape: MoEShape, layer: int, expert: int):
    import torch

    g = torch.Generator().manual_seed(1000 * layer + expert)
    F, H = shape.moe_intermediate_size, shape.hidden_size
    return (torch.randn(F, H, generator=g), torch.randn(F, H, generator=g), torch.randn(H, F, generator=g))


def _worker(rank: int, world: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from qwen3_rl.moe.reshard import pack_items, unpack_items

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ok = []
        for train, rollout, shape in _CASES:
            stage, ep_r, etp_r = _decode_train(train, rank)
            fe = shape.moe_intermediate_size // train.etp
            per_ep = shape.num_experts // train.ep
            local = {}  # megatron layout: fc1 [2*fe, H] = [gate_t; up_t], fc2 [H, fe]
            for layer in train_stage_layers(train, shape.num_layers)[stage]:
                for e in range(ep_r * per_ep, (ep_r + 1) * per_ep):
                    gate, up, down = _full_weights(shape, layer, e)
                    sl = slice(etp_r * fe, (etp_r + 1) * fe)
                    local[(layer, e)] = (torch.cat([gate[sl], up[sl]]), down[:, sl].contiguous(), etp_r * fe)
            plan = plan_moe_reshard(train, rollout, shape)
            pieces = []
            for dst in range(world):
                pieces += pack_items(plan.items(rank, dst), lambda la, ex, _l=local: _l[(la, ex)])
            send = torch.cat(pieces) if pieces else torch.empty(0)
            assert send.numel() == sum(plan.input_split_sizes(rank))
            recv = torch.empty(sum(plan.output_split_sizes(rank)))
            dist.all_to_all_single(recv, send, plan.output_split_sizes(rank), plan.input_split_sizes(rank))
            need = _needed(rollout, shape, rank)
            f0 = next(iter(need.values()))[0]
            fl = next(iter(need.values()))[1] - f0
            H = shape.hidden_size
            dest = {(la, e): (torch.full((2 * fl, H), float("nan")), torch.full((H, fl), float("nan")))
                    for la in range(shape.num_layers) for e in need}
            chunks = torch.split(recv, plan.output_split_sizes(rank))
            for src in range(world):
                unpack_items(plan.items(src, rank), chunks[src], H, dest, dest_f0=f0)
            good = True
            for (la, e), (w13, w2) in dest.items():
                gate, up, down = _full_weights(shape, la, e)
                good &= torch.equal(w13, torch.cat([gate[f0:f0 + fl], up[f0:f0 + fl]]))
                good &= torch.equal(w2, down[:, f0:f0 + fl])
            ok.append((bool(good), len(dest)))
        # per-tensor exchange (verl hook): EP2 x ETP2 group = whole world, 6 experts -> vLLM EP4
        ep, etp, E, F, H = 2, 2, 6, 4, 3
        got = {}
        for j in range(E // ep):
            ex = expert_group_exchange(E, ep, etp, j, list(range(world)), RolloutLayout(tp=2, dp=2))
            t, k = rank % etp, rank // etp
            gate, up, down = _full_weights(MoEShape(1, E, H, F), 0, k * (E // ep) + j)
            fc1 = torch.cat([gate[t * 2:(t + 1) * 2], up[t * 2:(t + 1) * 2]])  # megatron fc1 shard [2F/etp, H]
            inp, out = ex.split_sizes(rank, fc1.numel())
            send = torch.cat([fc1.reshape(-1)] * sum(1 for x in inp if x))
            recv = torch.empty(sum(out))
            dist.all_to_all_single(recv, send, out, inp)
            chunks = [c for c in torch.split(recv, out) if c.numel()]
            for (_, expert, shard), c in zip(ex.recv_from[rank], chunks, strict=True):
                got[(expert, shard)] = c.view(4, H)
        need = _needed(RolloutLayout(tp=2, dp=2), MoEShape(1, E, H, F), rank)
        good = sorted(got) == sorted((e, t) for e in need for t in range(etp))
        for (expert, t), c in got.items():
            gate, up, _ = _full_weights(MoEShape(1, E, H, F), 0, expert)
            good &= torch.equal(c, torch.cat([gate[t * 2:(t + 1) * 2], up[t * 2:(t + 1) * 2]]))
        ok.append((bool(good), len(got)))
        results[rank] = ok
    finally:
        dist.destroy_process_group()


def test_gloo_all_to_all_single_delivers_exact_expert_weights() -> None:

    import torch.multiprocessing as mp

    port = free_port()
    world = 4
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, port, results), nprocs=world, join=True)
        res = dict(results)
    assert sorted(res) == list(range(world))
    for rank, per_case in res.items():
        assert [g for g, _ in per_case] == [True] * (len(_CASES) + 1), (rank, per_case)
        assert all(n > 0 for _, n in per_case)


def test_checker_rejects_corrupted_plans() -> None:
    """The verifier itself catches a duplicated shard, a missing shard and a wrong source."""
    shape = MoEShape(num_layers=2, num_experts=4, hidden_size=2, moe_intermediate_size=4)
    train = TrainLayout(tp=1, pp=1, ep=2, etp=1, world=4)
    rollout = RolloutLayout(tp=2, dp=2)
    good = plan_moe_reshard(train, rollout, shape)
    check_plan(good, train, rollout, shape)
    (src, dst), items = next((k, v) for k, v in good.sends.items() if k[0] != k[1])
    H = shape.hidden_size
    variants = []
    dup = dict(good.sends)
    dup[(src, dst)] = tuple(sorted(items + items[:1]))
    variants.append(dup)
    missing = dict(good.sends)
    missing[(src, dst)] = items[1:]
    variants.append(missing)
    wrong = {k: v for k, v in good.sends.items() if k != (src, dst)}
    other = next(r for r in range(4) if _decode_train(train, r)[1] != _decode_train(train, src)[1])
    wrong[(other, dst)] = tuple(sorted(wrong.get((other, dst), ()) + items))
    variants.append(wrong)
    for sends in variants:
        numel = np.zeros((4, 4), dtype=np.int64)
        for (a, b), v in sends.items():
            numel[a, b] = sum(it.numel(H) for it in v)
        with pytest.raises(AssertionError):
            check_plan(ReshardPlan(world=4, shape=shape, sends=sends, numel=numel), train, rollout, shape)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
       st.integers(1, 3), st.data())
def test_expert_group_exchange_covers_exactly(etp, ep, edp, pp, per_ep, data) -> None:
    """Over all expert groups and local expert ids, every rank receives every ETP shard of exactly the experts
    its vLLM EP rank holds, once, from the member holding it."""
    world = etp * ep * edp * pp
    E = max(ep * per_ep, ep * -(-world // ep))
    rtp = data.draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0]))
    rollout = RolloutLayout(tp=rtp, dp=world // rtp)
    train = TrainLayout(tp=1, pp=pp, ep=ep, etp=etp, world=world)
    got: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for p in range(pp):
        for d in range(edp):
            ranks = [train_rank(train, etp_rank=t, ep_rank=k, edp_rank=d, pp_rank=p)
                     for k in range(ep) for t in range(etp)]
            for j in range(E // ep):
                ex = expert_group_exchange(E, ep, etp, j, ranks, rollout)
                for m, lst in enumerate(ex.recv_from):
                    for s, expert, t in lst:
                        assert m in ex.send_to[s]
                        assert (_decode_train(train, ranks[s])[1:]) == (expert // (E // ep), t)
                        assert expert % (E // ep) == j
                        got[ranks[m]].append((expert, t))
    # pp stages and edp replicas are separate groups: each holds every expert once per rank
    for r in range(world):
        want = sorted((e, t) for e in rollout_expert_range(E, world, r) for t in range(etp))
        assert sorted(got[r]) == sorted(want * 1), (r, got[r], want)


def test_expert_group_exchange_rejects_non_ep_rollout() -> None:
    with pytest.raises(ValueError, match="expert parallel"):
        expert_group_exchange(4, 2, 1, 0, [0, 1], RolloutLayout(tp=2, dp=1, expert_parallel=False))
