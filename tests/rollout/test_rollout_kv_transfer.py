"""Rollout-rebalance KV transfer: per-round byte cap, per-request move-vs-recompute decision, simulator
bandwidth sweep, config keys, and the gloo benchmark on the coordinator's real transfer code."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from qwen3_rl.rollout.migration import (
    FinishedRemote,
    KVCacheSpec,
    RebalanceCoordinator,
    RebalanceSettings,
    RequestState,
)
from qwen3_rl.rollout.rebalance import (
    RankState,
    RebalanceConfig,
    RunningRequest,
    TransferCost,
    kv_block_budget,
    kv_move_seconds,
    plan_rebalance,
    recompute_seconds,
    should_recompute,
    validate_plan,
)
from qwen3_rl.tools.bench import kv_transfer
from qwen3_rl.tools.sim.lengths import generate_lengths
from qwen3_rl.tools.sim.simulate import SimConfig, StepModel, simulate
from qwen3_rl.tools.sim.simulate import main as sim_main
from qwen3_rl.trainer.seam import settings_from_rollout_config

# one TP4 shard of Qwen3-235B-A22B: 94 layers x K,V x 1 KV head x 128 dims x bf16 = 47 KiB per token
BYTES_PER_TOKEN = 94 * 2 * 1 * 128 * 2
BLOCK = 128
BPB = BYTES_PER_TOKEN * BLOCK  # 5.9 MiB


# ------------------------------------------------------------------------------ cost model (pure)


def test_cost_model_figures() -> None:
    c = TransferCost(BPB, 0.5e9, 10_000.0, 0.001)
    assert BPB == 6_160_384
    assert kv_move_seconds(10, c) == pytest.approx(0.001 + 10 * 6_160_384 / 0.5e9)  # 0.1242 s
    assert recompute_seconds(1280, c) == pytest.approx(0.128)
    assert kv_move_seconds(0, c) == 0.0 and recompute_seconds(0, c) == 0.0
    assert kv_move_seconds(1, TransferCost(BPB, 0.0, 1.0)) == float("inf")
    assert recompute_seconds(1, TransferCost(BPB, 1.0, 0.0)) == float("inf")
    with pytest.raises(ValueError):
        TransferCost(-1)


def test_should_recompute_decides_by_cost() -> None:
    # 47 KiB per token: break-even link = 48128 B x 10k tok/s = 0.48 GB/s for a full block
    assert not should_recompute(1280, 10, TransferCost(BPB, 25e9, 10_000.0))  # HCCL-class: move (2.5 ms vs 128 ms)
    assert should_recompute(1280, 10, TransferCost(BPB, 0.2e9, 10_000.0))  # slow link: recompute (308 ms vs 128 ms)
    # a partly filled last block still travels whole: 129 tokens hold 2 blocks (12.3 MB, 24.6 ms at 0.5 GB/s)
    # while recomputing them takes 12.9 ms; 255 tokens in the same 2 blocks take 25.5 ms: move
    assert should_recompute(129, 2, TransferCost(BPB, 0.5e9, 10_000.0))
    assert not should_recompute(255, 2, TransferCost(BPB, 0.5e9, 10_000.0))
    # the fixed per-transfer cost tips short prefixes to recompute
    assert not should_recompute(100, 1, TransferCost(BPB, 25e9, 10_000.0))
    assert should_recompute(100, 1, TransferCost(BPB, 25e9, 10_000.0, per_move_s=0.02))
    # equal cost: move (the behaviour without a cost model)
    assert not should_recompute(1000, 1, TransferCost(1000, 1000.0, 1000.0))
    # unknown figures: always move
    for cost in (None, TransferCost(0, 1.0, 1e9), TransferCost(BPB, 1.0, 0.0)):
        assert not should_recompute(1280, 10, cost)
    assert not should_recompute(1280, 0, TransferCost(BPB, 1.0, 1e9))  # nothing to move


def test_kv_block_budget() -> None:
    assert kv_block_budget(4_000_000_000, BPB) == 649  # 4 GB of 5.9 MiB blocks
    assert kv_block_budget(BPB - 1, BPB) == 0
    assert kv_block_budget(0, BPB) is None and kv_block_budget(10, 0) is None
    with pytest.raises(ValueError):
        kv_block_budget(-1, BPB)


# ------------------------------------------------------------------------------ planner


def _ranks(counts: Sequence[int], ctx: int = 1000) -> list[RankState]:
    """Lockstep ranks whose running counts only drop a bucket if 4 requests move off rank 0."""
    nb = -(-(ctx + 1) // BLOCK)
    return [RankState(r, (), tuple(RunningRequest(f"{r}-{i}", ctx + i, nb) for i in range(c)), 16, 10_000)
            for r, c in enumerate(counts)]


def test_per_rank_byte_cap_limits_a_round_and_the_rest_waits() -> None:
    states = _ranks([12, 0, 0, 0])  # bucket 16 -> 4 with 8 moves of 8 blocks (47 MiB each)
    free = RebalanceConfig(buckets=(1, 2, 4, 8, 16), block_size=BLOCK)
    plan = plan_rebalance(states, free)
    assert (plan.bucket_after, len(plan.moves), plan.kv_blocks_moved) == (4, 8, 64)
    # cap: 40 blocks a rank may send + receive (rank 0 sends every move): bucket 8 (4 moves, 32 blocks)
    capped = RebalanceConfig(buckets=(1, 2, 4, 8, 16), block_size=BLOCK,
                             max_kv_blocks_per_rank=kv_block_budget(40 * BPB, BPB))
    plan1 = plan_rebalance(states, capped)
    assert (plan1.bucket_after, len(plan1.moves), plan1.kv_blocks_moved) == (8, 4, 32)
    validate_plan(states, plan1, capped)
    # the next round moves the rest
    from qwen3_rl.rollout.rebalance import apply_plan

    after = apply_plan(states, plan1)
    plan2 = plan_rebalance(after, capped)
    assert (plan2.bucket_before, plan2.bucket_after, len(plan2.moves)) == (8, 4, 4)
    validate_plan(after, plan2, capped)
    # a cap below one request's KV moves nothing
    assert plan_rebalance(states, RebalanceConfig(buckets=(1, 2, 4, 8, 16), block_size=BLOCK,
                                                  max_kv_blocks_per_rank=7)).empty


def test_planner_recomputes_where_moving_costs_more() -> None:
    states = _ranks([12, 0, 0, 0])
    slow = RebalanceConfig(buckets=(1, 2, 4, 8, 16), block_size=BLOCK, max_kv_blocks_per_rank=0,
                           transfer=TransferCost(BPB, 0.2e9, 10_000.0))
    plan = plan_rebalance(states, slow)  # a zero byte cap: only recomputed moves can go
    assert len(plan.moves) == 8 and all(m.recompute and m.kv_blocks == 0 and m.phase == 2 for m in plan.moves)
    assert plan.bucket_after == 4
    validate_plan(states, plan, slow)
    fast = RebalanceConfig(buckets=(1, 2, 4, 8, 16), block_size=BLOCK, transfer=TransferCost(BPB, 25e9, 10_000.0))
    plan = plan_rebalance(states, fast)
    assert len(plan.moves) == 8 and not any(m.recompute for m in plan.moves)
    assert plan.kv_blocks_moved == 64


# ------------------------------------------------------------------------------ coordinator


class _ThreadComm:
    """In-process Communicator for coordinators running in threads (one per DP rank)."""

    def __init__(self, rank: int, size: int, shared: dict[str, Any]) -> None:
        self.rank, self.size, self.shared = rank, size, shared

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        sh = self.shared
        with sh["lock"]:
            sh["objs"][self.rank] = obj
        sh["barrier"].wait()
        out = list(sh["objs"])
        sh["barrier"].wait()
        return out

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 what: str) -> None:
        sh = self.shared
        with sh["lock"]:
            for dst, t in sends:
                sh["wire"][(self.rank, dst)].append(t.clone())
                sh["bytes"][self.rank] += t.numel() * t.element_size()
        sh["barrier"].wait()
        with sh["lock"]:
            for src, buf in recvs:
                buf.copy_(sh["wire"][(src, self.rank)].pop(0))
        sh["barrier"].wait()


class _Engine:
    """Toy engine: rank 0 runs ``n`` requests of ``ctx`` tokens, rank 1 none; records what arrives."""

    def __init__(self, rank: int, n: int, ctx: int, spec: KVCacheSpec) -> None:
        self.rank, self.ctx, self.spec = rank, ctx, spec
        nb = -(-ctx // BLOCK_T)
        self.running = {f"r0|{i}": list(range(i * nb, (i + 1) * nb)) for i in range(n)} if rank == 0 else {}
        self.imported: list[tuple[RequestState, list[int]]] = []
        self.next_block = 0

    def load_state(self, rank: int) -> RankState:
        return RankState(rank, (), tuple(RunningRequest(k, self.ctx, len(v)) for k, v in self.running.items()),
                         16, 64)

    def export_request(self, req_id: str) -> tuple[RequestState, list[int]]:
        blocks = self.running[req_id]
        return RequestState(req_id, 0, tuple(range(self.ctx - 3)), (7, 8, 9), {}, None, None, self.ctx,
                            len(blocks), {"status": "running"}), blocks

    def release_request(self, req_id: str) -> None:
        del self.running[req_id]

    def allocate_blocks(self, state: RequestState) -> list[int]:
        ids = list(range(self.next_block, self.next_block + state.num_kv_blocks))
        self.next_block += state.num_kv_blocks
        return ids

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.spec

    def import_request(self, state: RequestState, block_ids: list[int]) -> None:
        self.imported.append((state, block_ids))

    def pop_finished_remote(self) -> list[FinishedRemote]:
        return []

    def deliver(self, result: FinishedRemote) -> None:
        raise AssertionError("nothing is returned in this test")


BLOCK_T = 4  # tokens per block of the toy KV cache


def _run_round(settings: RebalanceSettings, n: int = 6, ctx: int = 10) -> tuple[list[Any], list[_Engine], dict]:
    """Two coordinators (threads) run one round; rank 0 holds ``n`` running requests, rank 1 none."""
    shared: dict[str, Any] = {"lock": threading.Lock(), "barrier": threading.Barrier(2), "objs": [None, None],
                              "wire": defaultdict(list), "bytes": defaultdict(int)}
    engines, reps, errors = [], [None, None], []
    cfg = RebalanceConfig(buckets=(1, 2, 4, 8), block_size=BLOCK_T)
    for r in range(2):
        # 2 caches (num_blocks, BLOCK_T, 8) float32: 256 bytes per block
        spec = KVCacheSpec(tuple(torch.full((64, BLOCK_T, 8), float(r + 1)) for _ in range(2)), (0, 0))
        engines.append(_Engine(r, n, ctx, spec))

    def run(r: int) -> None:
        try:
            reps[r] = RebalanceCoordinator(engines[r], _ThreadComm(r, 2, shared), cfg, settings).run_round()
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return reps, engines, shared


def test_coordinator_applies_the_byte_cap_per_round() -> None:
    # 6 requests of 10 tokens = 3 blocks (768 B) each on rank 0: bucket 8 -> 4 needs 2 moves (1536 B sent
    # by rank 0); a cap one byte short allows 1 move, which drops no bucket: the round moves nothing
    reps, engines, _ = _run_round(RebalanceSettings(enable=True, max_kv_bytes=1535, prefill_tokens_per_s=0.0))
    assert reps[0].plan.empty and reps[0].plan.bucket_before == 8 and not engines[1].imported
    reps, engines, shared = _run_round(RebalanceSettings(enable=True, max_kv_bytes=1536, prefill_tokens_per_s=0.0))
    assert len(reps[0].sent) == 2 and reps[0].kv_bytes_sent == 2 * 3 * 256 == reps[1].kv_bytes_received
    assert all(len(b) == 3 for _, b in engines[1].imported)
    # the KV arrived in the target's blocks (rank 0's caches hold 1.0, rank 1's 2.0)
    assert all(float(c[:6].max()) == 1.0 and float(c[6:].min()) == 2.0 for c in engines[1].spec.caches)
    assert reps[0].recomputed == ()


def test_coordinator_recomputes_instead_of_moving_when_cheaper() -> None:
    # 256 B per block; link 1e-6 GB/s = 1000 B/s -> 0.77 s per request; prefill 1e6 tok/s -> 10 us
    st = RebalanceSettings(enable=True, max_kv_bytes=0, kv_link_gb_s=1e-6, prefill_tokens_per_s=1e6)
    reps, engines, _ = _run_round(st)
    assert len(reps[0].sent) == 2 and set(reps[0].recomputed) == set(reps[0].sent) == set(reps[1].recomputed)
    assert reps[0].kv_bytes_sent == 0 and reps[1].kv_bytes_received == 0
    for state, blocks in engines[1].imported:
        # arrives like a preempted request: no KV, no computed tokens, tokens and params intact
        assert blocks == [] and state.num_computed_tokens == 0 and state.num_kv_blocks == 0
        assert state.extra["status"] == "preempted" and state.output_token_ids == (7, 8, 9)
    # same round with a fast link: KV moves
    reps, engines, _ = _run_round(RebalanceSettings(enable=True, max_kv_bytes=0, kv_link_gb_s=25.0,
                                                    prefill_tokens_per_s=1e6))
    assert reps[0].recomputed == () and reps[0].kv_bytes_sent == 2 * 3 * 256


def test_round_config_combines_the_byte_cap_with_a_configured_block_cap() -> None:
    spec = KVCacheSpec((torch.zeros(8, BLOCK_T, 8),), (0,))
    eng = _Engine(0, 0, 10, spec)
    coord = RebalanceCoordinator(eng, _ThreadComm(0, 1, {}), RebalanceConfig(buckets=(1,), block_size=BLOCK_T),
                                 RebalanceSettings(enable=True, max_kv_bytes=1000, kv_link_gb_s=0.5))
    cfg = coord.round_config(128)
    assert cfg.max_kv_blocks_per_rank == 7 and cfg.transfer == TransferCost(128, 0.5e9, 10_000.0)
    assert cfg.max_round_s == 10.0
    coord.cfg = RebalanceConfig(buckets=(1,), block_size=BLOCK_T, max_kv_blocks_per_rank=3)
    assert coord.round_config(128).max_kv_blocks_per_rank == 3
    coord.settings = RebalanceSettings(enable=True, max_kv_bytes=0)
    assert coord.round_config(128).max_kv_blocks_per_rank == 3


def test_settings_read_the_new_keys() -> None:
    s, _ = settings_from_rollout_config({"rollout_rebalance": True})
    # defaults: no byte cap, a 10 s round bound, the device path, the link measured at the first round
    assert (s.max_kv_bytes, s.kv_link_gb_s, s.prefill_tokens_per_s, s.max_round_s, s.kv_path) == (
        0, 0.0, 10_000.0, 10.0, "device")
    s, _ = settings_from_rollout_config({"rollout_rebalance": True, "rollout_rebalance_max_kv_bytes": 4_000_000_000,
                                         "rollout_rebalance_kv_link_gb_s": 25, "rollout_rebalance_max_round_s": 0,
                                         "rollout_rebalance_kv_path": "host",
                                         "rollout_rebalance_prefill_tokens_per_s": 0})
    assert (s.max_kv_bytes, s.kv_link_gb_s, s.prefill_tokens_per_s, s.max_round_s, s.kv_path) == (
        4_000_000_000, 25.0, 0.0, 0.0, "host")
    for bad in ({"rollout_rebalance_max_kv_bytes": -1}, {"rollout_rebalance_max_kv_bytes": 1.5},
                {"rollout_rebalance_kv_link_gb_s": -1}, {"rollout_rebalance_prefill_tokens_per_s": -1},
                {"rollout_rebalance_max_round_s": -1}, {"rollout_rebalance_kv_path": "nvlink"}):
        with pytest.raises(ValueError):
            settings_from_rollout_config({"rollout_rebalance": True, **bad})


# ------------------------------------------------------------------------------ simulator


def test_simulator_bandwidth_recompute_and_cap() -> None:
    lengths = generate_lengths(64, 8, mean_response=700, max_response=4096, seed=0)
    base = SimConfig(dp=8, max_num_seqs=64, policy="rollout-rebalance", max_kv_bytes=0, max_round_s=0.0,
                     recompute=False)
    runs = {}
    for link in (0.05, 25.0):
        step = StepModel(link_gb_s=link)
        runs[link, "move"] = simulate(lengths, SimConfig(**{**base.__dict__, "step": step}))
        runs[link, "auto"] = simulate(lengths, SimConfig(**{**base.__dict__, "step": step, "recompute": True}))
    fast_move, slow_move = runs[25.0, "move"], runs[0.05, "move"]
    assert fast_move.migrations > 0 and fast_move.kv_gb_moved > 0
    # the same moves cost more transfer time on a slow link
    assert slow_move.kv_gb_moved == pytest.approx(fast_move.kv_gb_moved)
    assert slow_move.transfer_s == pytest.approx(fast_move.transfer_s * 500, rel=1e-6)
    assert slow_move.makespan_s > fast_move.makespan_s
    # at 25 GB/s moving always wins (44.9 KB/token: 1.8 us vs 100 us per token of prefill)
    assert runs[25.0, "auto"].recomputed == 0 and runs[25.0, "auto"].makespan_s == fast_move.makespan_s
    # at 0.05 GB/s recomputing wins: no KV travels and the rollout ends sooner than moving it
    slow_auto = runs[0.05, "auto"]
    assert slow_auto.recomputed == slow_auto.migrations - _phase1_moves(slow_auto) > 0
    assert slow_auto.kv_gb_moved == 0 and slow_auto.makespan_s < slow_move.makespan_s
    # a per-rank cap below one request's KV stops every running move
    capped = simulate(lengths, SimConfig(**{**base.__dict__, "max_kv_bytes": 1000}))
    assert capped.kv_gb_moved == 0


def _phase1_moves(res: Any) -> int:
    return res.migrations - res.recomputed if res.kv_gb_moved == 0 else 0


def test_simulator_cli_link_list(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from qwen3_rl.tools.sim.lengths import write_lengths

    f = tmp_path / "l.jsonl"
    write_lengths(generate_lengths(32, 4, mean_response=300, max_response=2048, seed=1), f)
    assert sim_main(["rollout", "--lengths", str(f), "--dp", "4", "--max-num-seqs", "16",
                     "--policy", "default,rollout-rebalance", "--link-gb-s", "0.5,25,100"]) == 0
    out = capsys.readouterr().out
    for label in ("default ", "rollout-rebalance@0.5GB/s", "rollout-rebalance@25GB/s", "rollout-rebalance@100GB/s"):
        assert label in out
    assert sim_main(["rollout", "--lengths", str(f), "--dp", "4", "--max-num-seqs", "16", "--link-gb-s", "0"]) == 2


# ------------------------------------------------------------------------------ benchmark


def test_benchmark_moves_real_bytes_over_gloo() -> None:
    """Both KV paths (device group = a batched gloo group on CPU; host) and the bare wire move the payload
    (the receiver compares every byte, else the worker fails); the first-round probe reports a link."""
    rows = kv_transfer.measure([0.5, 3.0], reps=1, layers=2)
    assert [(r["path"], r["blocks"]) for r in rows] == [(p, b) for b in (4, 23) for p in ("device", "host", "wire")]
    for r in rows:  # 2 layers: 128 KiB per block
        assert r["kv_bytes"] == r["blocks"] * 2 * 2 * 128 * 128 * 2
        assert r["round_s"] > 0 and r["round_bytes_per_s"] == pytest.approx(r["kv_bytes"] / r["round_s"])
        assert (r["probe_bytes_per_s"] > 0) == (r["path"] != "wire")


def test_benchmark_fit_line() -> None:
    rows = [{"kv_bytes": b, "round_s": 0.002 + b / 5e8} for b in (1e6, 1e7, 1e8)]
    a, b = kv_transfer.fit_line(rows)
    assert a == pytest.approx(0.002) and b == pytest.approx(5e8)
    assert kv_transfer.fit_line(rows[:1]) == (0.0, pytest.approx(1e6 / rows[0]["round_s"]))


def test_train_script_maps_the_byte_cap() -> None:
    from pathlib import Path

    from qwen3_rl.tools.launch.train_script import TrainScriptError, parse_train_script

    script = Path(__file__).resolve().parents[2] / "internal" / "train_grpo_qwen3_235b_128die_true_weight.sh"
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    key = "+qwen3_rl.rollout_rebalance.max_kv_bytes="

    def cap(extra: dict[str, str]) -> list[str]:
        return [o for o in parse_train_script(script, env={**env, **extra}).overrides if o.startswith(key)]

    assert cap({}) == [key + "0"]  # no byte cap by default: the round is bounded by time
    assert cap({"ROLLOUT_REBALANCE_MAX_KV_BYTES": "4000000000"}) == [key + "4000000000"]
    with pytest.raises(TrainScriptError, match="error: ROLLOUT_REBALANCE_MAX_KV_BYTES='4e9': expected an integer >= 0"):
        cap({"ROLLOUT_REBALANCE_MAX_KV_BYTES": "4e9"})


# ------------------------------------------------------------------------------ time bound


def test_time_bound_splits_a_round_between_moving_and_recomputing() -> None:
    """12 requests of 8 blocks on rank 0 (bucket 16 -> 4 needs 8 moves). Moving one costs 0.06 s at each end,
    recomputing it 0.1 s on the target: moving is cheaper. A 0.35 s bound lets rank 0 send 5; the other 3
    are recomputed on targets with time left; nothing is lost and the bucket still drops to 4."""
    states = _ranks([12, 0, 0, 0])
    link = 8 * BPB / 0.06
    cost = TransferCost(BPB, link, 10_000.0)
    assert not should_recompute(1000, 8, cost)  # 0.06 s move < 0.1 s recompute
    buckets = (1, 2, 4, 8, 16)
    free = RebalanceConfig(buckets=buckets, block_size=BLOCK, transfer=cost)
    plan = plan_rebalance(states, free)
    assert plan.bucket_after == 4 and len(plan.moves) == 8 and not any(m.recompute for m in plan.moves)
    bounded = RebalanceConfig(buckets=buckets, block_size=BLOCK, transfer=cost, max_round_s=0.35)
    plan = plan_rebalance(states, bounded)
    moved = [m for m in plan.moves if not m.recompute]
    recomputed = [m for m in plan.moves if m.recompute]
    assert plan.bucket_after == 4 and (len(moved), len(recomputed)) == (5, 3)
    assert all(m.kv_blocks == 8 for m in moved) and all(m.kv_blocks == 0 for m in recomputed)
    validate_plan(states, plan, bounded)  # includes: no rank spends more than 0.35 s, no request lost


def test_time_bound_leaves_the_rest_for_the_next_round_when_recompute_is_off() -> None:
    states = _ranks([12, 0, 0, 0])
    cost = TransferCost(BPB, 8 * BPB / 0.06, 0.0)  # no recompute: what does not fit waits
    bounded = RebalanceConfig(buckets=(1, 2, 4, 8, 16), block_size=BLOCK, transfer=cost, max_round_s=0.35)
    plan1 = plan_rebalance(states, bounded)
    assert (plan1.bucket_after, len(plan1.moves)) == (8, 4) and not any(m.recompute for m in plan1.moves)
    validate_plan(states, plan1, bounded)
    from qwen3_rl.rollout.rebalance import apply_plan

    after = apply_plan(states, plan1)
    plan2 = plan_rebalance(after, bounded)
    assert (plan2.bucket_before, plan2.bucket_after, len(plan2.moves)) == (8, 4, 4)
    validate_plan(after, plan2, bounded)
    final = apply_plan(after, plan2)
    assert sorted(r.req_id for s in final for r in s.running) == sorted(r.req_id for s in states for r in s.running)


def _run_round_n(settings: RebalanceSettings, ranks: int, n: int = 6, ctx: int = 10) -> tuple[list[Any], list[_Engine]]:
    """``ranks`` coordinators (threads) run one round; rank 0 holds ``n`` running requests, the others none."""
    shared: dict[str, Any] = {"lock": threading.Lock(), "barrier": threading.Barrier(ranks),
                              "objs": [None] * ranks, "wire": defaultdict(list), "bytes": defaultdict(int)}
    engines = [_Engine(r, n, ctx, KVCacheSpec(tuple(torch.full((64, BLOCK_T, 8), float(r + 1)) for _ in range(2)),
                                               (0, 0))) for r in range(ranks)]
    reps: list[Any] = [None] * ranks
    errors: list[BaseException] = []
    cfg = RebalanceConfig(buckets=(1, 2, 4, 8), block_size=BLOCK_T)

    def run(r: int) -> None:
        try:
            reps[r] = RebalanceCoordinator(engines[r], _ThreadComm(r, ranks, shared), cfg, settings).run_round()
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return reps, engines


def test_coordinator_round_over_its_time_bound_moves_some_and_recomputes_the_rest() -> None:
    """3 ranks, 6 requests of 3 blocks (768 B) on rank 0, bucket 8 -> 2 needs 4 moves. Link 1000 B/s: a move
    costs 0.768 s at each end; prefill 12 tokens/s: recomputing 10 tokens costs 0.833 s on the target. A 1.7 s
    bound lets rank 0 send 2 (1.536 s); the other 2 are recomputed, one on each target."""
    st = RebalanceSettings(enable=True, kv_link_gb_s=1e-6, prefill_tokens_per_s=12.0, max_round_s=1.7)
    reps, engines = _run_round_n(st, 3)
    plan = reps[0].plan
    assert all(r.plan == plan for r in reps) and plan.bucket_after == 2 and len(plan.moves) == 4
    assert len(reps[0].sent) == 4 and len(reps[0].recomputed) == 2
    assert reps[0].kv_bytes_sent == 2 * 768 == reps[1].kv_bytes_received + reps[2].kv_bytes_received
    arrived = {s.req_id: (s, b) for e in engines[1:] for s, b in e.imported}
    assert sorted(arrived) == sorted(reps[0].sent)
    for rid, (state, blocks) in arrived.items():
        if rid in reps[0].recomputed:  # no KV: queued like a preempted request, tokens intact
            assert blocks == [] and state.num_computed_tokens == 0 and state.extra["status"] == "preempted"
        else:  # KV written into the target's blocks (rank 0's caches hold 1.0)
            assert len(blocks) == 3 and state.num_computed_tokens == 10
            eng = next(e for e in engines[1:] if (state, blocks) in e.imported)
            assert all(float(c[blocks].min()) == float(c[blocks].max()) == 1.0 for c in eng.spec.caches)
    # nothing lost: what rank 0 still runs plus what arrived is every request
    assert sorted([*engines[0].running, *arrived]) == [f"r0|{i}" for i in range(6)]


# ------------------------------------------------------------------------------ simulator = run-time planner


def test_simulator_and_runtime_planner_make_the_same_decisions() -> None:
    """The simulator's planner config and the coordinator's, from the same figures (block bytes, link, prefill
    rate, time bound, byte cap), are equal, so both plan the same moves on the same states; checked on the
    simulator's own rank states at the rounds where a bounded plan moves and recomputes."""
    from dataclasses import replace

    from qwen3_rl.tools.sim.simulate import _assignment
    from qwen3_rl.tools.sim.simulate import _Engine as SimEngine

    lengths = generate_lengths(64, 8, mean_response=1500, max_response=8192, seed=3)
    for link, bound, cap in ((0.5, 1.0, 0), (25.0, 10.0, 0), (2.5, 0.05, 200_000_000)):
        cfg = SimConfig(dp=8, max_num_seqs=32, policy="rollout-rebalance", step=StepModel(link_gb_s=link),
                        max_round_s=bound, max_kv_bytes=cap)
        sim_cfg = cfg.rebalance_config()
        settings = RebalanceSettings(enable=True, kv_link_gb_s=link, prefill_tokens_per_s=1e6 / cfg.step.per_prefill_ktok_ms,
                                     max_round_s=bound, max_kv_bytes=cap)
        base = RebalanceConfig(buckets=cfg.graph_buckets, block_size=cfg.block_size, max_moves=cfg.max_moves,
                               max_kv_blocks=cfg.max_kv_blocks)
        coord = RebalanceCoordinator(_Engine(0, 0, 10, KVCacheSpec((torch.zeros(1, 1),), (0,))),
                                     _ThreadComm(0, 1, {}), base, settings)
        bpb = int(round(cfg.step.kv_bytes_per_token * cfg.block_size))
        assert coord.round_config(bpb) == sim_cfg
        # the simulator's states every 32 steps of a default-layout lockstep run, planned by both configs
        eng = SimEngine(lengths, replace(cfg, policy="default"), _assignment(lengths, cfg.dp, False), False)
        kinds: set[str] = set()
        step = 0
        while (k := eng.admit_all(step)) is not None:
            k = min(k, 32 - step % 32)
            for r in range(eng.ndp):
                eng.advance(r, k)
            step += k
            if step % 32 == 0:
                states = eng.states()
                plan = plan_rebalance(states, sim_cfg)
                assert plan == plan_rebalance(states, coord.round_config(bpb))
                validate_plan(states, plan, sim_cfg)
                kinds |= {"recompute" if m.recompute else ("kv" if m.kv_blocks else "wait") for m in plan.moves}
        assert "kv" in kinds and ("recompute" in kinds or link > 0.5), (link, kinds)
