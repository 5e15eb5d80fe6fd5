"""Server-mode placements (``qwen3_rl.tools.sim.server``) and the simulator's server rows: ``--placement``,
rebalance scoped to a server (KV moves) or the cluster (abort-reprefill), sibling tables, drafting on independent
engines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from qwen3_rl.tools.sim.drafting import TPS, TPS_SIBLINGS8, draft_model, sibling_tables
from qwen3_rl.tools.sim.lengths import Lengths, generate_lengths
from qwen3_rl.tools.sim.server import server_assignment, siblings_on_engine
from qwen3_rl.tools.sim.simulate import Drafting, SimConfig, SimError, StepModel, main, simulate

SM = StepModel(t0_ms=5.0, per_seq_ms=0.5, per_kctx_ms=2.0, per_prefill_ktok_ms=30.0)


def _flat(assign: list[np.ndarray]) -> list[list[int]]:
    return [a.tolist() for a in assign]


def test_verl_spread_is_round_robin_and_group_keeps_prompts_together() -> None:
    """One agent-loop worker, one server of 4 engines, 8 prompts x 4: verl's least-assigned choice deals row i to
    engine i mod 4 (a prompt on 4 engines); group routing puts each prompt on one engine, 2 prompts per engine at
    slack 0 (the least busy engines take the next prompt)."""
    spread = server_assignment(8, 4, 4, 1, "spread", agent_workers=1)
    assert _flat(spread) == [list(range(e, 32, 4)) for e in range(4)]
    assert (siblings_on_engine(spread, 4, 32) == 1).all()
    group = server_assignment(8, 4, 4, 1, "group", agent_workers=1)
    assert sorted(len(a) for a in group) == [8, 8, 8, 8]
    assert (siblings_on_engine(group, 4, 32) == 4).all()
    assert sorted(r for a in group for r in a) == list(range(32))


def test_verl_spread_over_servers_then_dp_ranks() -> None:
    """4 servers of DP 1, n 16 (the 32B layout): verl's server choice deals a prompt's 16 samples 4 per server."""
    spread = server_assignment(8, 16, 4, 4, "spread", agent_workers=8)
    assert (siblings_on_engine(spread, 16, 128) == 4).all()
    assert [len(a) for a in spread] == [32] * 4


def test_one_engine_placements_are_equal() -> None:
    """One engine: both routers have one choice, so the queues (send order, workers interleaved) and the
    simulated rollouts are the same."""
    a = server_assignment(16, 4, 1, 1, "spread", agent_workers=4)
    b = server_assignment(16, 4, 1, 1, "group", agent_workers=4)
    assert _flat(a) == _flat(b)
    assert a[0][:4].tolist() == [0, 16, 32, 48]  # position 0 of each worker's piece first
    lens = generate_lengths(16, 4, mean_response=80, max_response=400, seed=1)
    cfg = SimConfig(dp=1, max_num_seqs=8, step=SM)
    res = {p: simulate(lens, replace(cfg, placement=p)).makespan_s for p in ("spread", "group")}
    assert res["spread"] == res["group"]


@pytest.mark.parametrize("coupling", ["lockstep", "independent"])
def test_equal_lengths_make_placements_equal(coupling: str) -> None:
    """Zero length variance and balanced request counts: every placement gives the same makespan."""
    eq = Lengths(32, 4, np.full(128, 20), np.full(128, 150))
    cfg = SimConfig(dp=4, max_num_seqs=8, coupling=coupling, step=SM)
    out = {p: simulate(eq, replace(cfg, placement=p)).makespan_s for p in ("sync", "spread", "group")}
    assert out["spread"] == pytest.approx(out["sync"], rel=1e-12)
    assert out["group"] == pytest.approx(out["sync"], rel=1e-12)


def test_kv_moves_stay_inside_a_server_reprefill_crosses() -> None:
    """4 servers of DP 1 (dense, independent): rollout rebalance has no DP peer and changes nothing; abort-reprefill
    moves requests between servers without KV bytes, every running move re-prefilled, no token lost."""
    lens = generate_lengths(32, 4, mean_response=300, max_response=2000, seed=2)
    cfg = SimConfig(dp=4, max_num_seqs=8, coupling="independent", step=SM, servers=4, placement="group",
                    rebalance_interval=8)
    none = simulate(lens, cfg)
    kv = simulate(lens, replace(cfg, policy="rollout-rebalance"))
    rp = simulate(lens, replace(cfg, policy="abort-reprefill"))
    assert kv.makespan_s == none.makespan_s and kv.migrations == 0
    assert rp.migrations > 0 and rp.recomputed > 0 and rp.kv_gb_moved == 0.0
    assert rp.generated_tokens == none.generated_tokens == int(lens.response_len.sum())
    one = simulate(lens, replace(cfg, policy="rollout-rebalance", servers=1))  # one server of 4: KV moves act
    assert one.migrations > 0


def test_reprefill_equals_kv_moves_on_a_slow_link() -> None:
    """Where moving the KV costs more than recomputing it, the planner recomputes every move: rollout rebalance
    and abort-reprefill run the same plan (a positive control: at 25 GB/s they differ)."""
    lens = generate_lengths(32, 8, mean_response=500, max_response=3000, seed=3)
    cfg = SimConfig(dp=8, max_num_seqs=16, step=replace(SM, link_gb_s=1e-4), placement="group",
                    rebalance_interval=8)
    kv = simulate(lens, replace(cfg, policy="rollout-rebalance"))
    rp = simulate(lens, replace(cfg, policy="abort-reprefill"))
    assert kv.migrations > 0 and kv.recomputed == rp.recomputed
    assert kv.makespan_s == pytest.approx(rp.makespan_s, rel=1e-12)
    fast = simulate(lens, replace(cfg, policy="rollout-rebalance", step=replace(SM, link_gb_s=25.0)))
    assert fast.recomputed == 0 and fast.makespan_s != rp.makespan_s


def test_config_errors() -> None:
    with pytest.raises(SimError, match="data rebalance"):
        SimConfig(dp=4, max_num_seqs=8, policy="data-rebalance", placement="group")
    with pytest.raises(SimError, match="lockstep"):
        SimConfig(dp=4, max_num_seqs=8, servers=2)
    with pytest.raises(SimError, match="multiple of --servers"):
        SimConfig(dp=4, max_num_seqs=8, servers=3, coupling="independent")
    with pytest.raises(SimError, match="prefill"):
        SimConfig(dp=4, max_num_seqs=8, policy="abort-reprefill", recompute=False)
    with pytest.raises(SimError, match="agent-loop workers"):
        simulate(generate_lengths(3, 4, seed=0), SimConfig(dp=2, max_num_seqs=8, placement="spread"))
    with pytest.raises(ValueError, match="unknown server placement"):
        server_assignment(2, 2, 2, 1, "scatter")


def test_sibling_tables_hit_the_measured_tables() -> None:
    d = Drafting()
    w = np.ones(6)
    for s, want in ((4, TPS), (8, TPS_SIBLINGS8), (16, TPS_SIBLINGS8)):
        got = sibling_tables(np.full(6, s), w, d)
        assert got[("current", "bulk")] == pytest.approx(want[("current", "bulk")], rel=1e-12)
        assert got[("current", "tail")] == pytest.approx(want[("current", "tail")], rel=1e-12)
    one = sibling_tables(np.ones(6), w, d)[("current", "bulk")]
    assert one == pytest.approx([x * d.spread / d.together for x in TPS_SIBLINGS8[("current", "bulk")]])
    # token-weighted harmonic mean: a request of 3 tokens at s = 4 and one of 1 token at s = 8
    mix = sibling_tables(np.array([4, 8]), np.array([3.0, 1.0]), d)[("current", "bulk")][2]
    a, b = TPS[("current", "bulk")][2], TPS_SIBLINGS8[("current", "bulk")][2]
    assert mix == pytest.approx(4 / (3 / a + 1 / b))
    with pytest.raises(SimError):
        sibling_tables(np.array([0, 2]), np.ones(2), d)


def test_drafting_on_independent_engines() -> None:
    """One engine: the lockstep and the independent runner see the same rank, so SAM verification steps cost the
    same in both; with rebalance rounds (a finite step budget) the drafted rollout loses no token and beats the
    undrafted one."""
    lens = generate_lengths(8, 4, mean_response=200, max_response=1000, seed=4)
    d = Drafting()
    dm = draft_model("sam_group+adaptive", "default", d, current=sibling_tables(np.full(32, 4), np.ones(32), d))
    cfg = SimConfig(dp=1, max_num_seqs=8, step=SM)
    lock = simulate(lens, cfg, draft=dm).makespan_s
    ind = simulate(lens, replace(cfg, coupling="independent"), draft=dm).makespan_s
    assert ind == pytest.approx(lock, rel=1e-9)
    cfg4 = SimConfig(dp=4, max_num_seqs=4, coupling="independent", step=SM, policy="abort-reprefill",
                     placement="group", rebalance_interval=4)
    lens4 = generate_lengths(16, 4, mean_response=200, max_response=1000, seed=5)
    drafted = simulate(lens4, cfg4, draft=dm)
    plain = simulate(lens4, cfg4)
    assert drafted.generated_tokens == plain.generated_tokens == int(lens4.response_len.sum())
    assert drafted.makespan_s < plain.makespan_s * 0.8


def test_cli_server_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "len.jsonl"
    assert main(["gen-lengths", "--out", str(f), "--num-prompts", "32", "--n", "4", "--mean-response", "300",
                 "--max-response", "2000", "--seed", "6"]) == 0
    capsys.readouterr()
    base = ["rollout", "--lengths", str(f), "--dp", "4", "--max-num-seqs", "8", "--json"]
    assert main([*base, "--placement", "group,spread", "--policy", "all",
                 "--drafting", "none,sam_group+adaptive,sam_group+history"]) == 0
    out = json.loads(capsys.readouterr().out)
    pols = ("default", "rollout-rebalance", "abort-reprefill")
    want = {f"{p}:{q}{d}" for p in ("group", "spread") for q in pols for d in ("", "+sam_group+adaptive")}
    assert set(out["results"]) == want  # no data-rebalance / both rows, no history rows in server mode
    sync = out["config"]["sync_default_makespan_s"]
    for row in out["results"].values():
        assert row["gain_vs_sync_default"] == pytest.approx(sync / row["makespan_s"])
    assert out["results"]["group:default+sam_group+adaptive"]["tokens_per_step"] == pytest.approx(
        TPS[("current", "bulk")][2])  # 4 siblings on the engine: the 4-sibling table
    assert main([*base, "--placement", "group", "--policy", "both"]) == 2
    assert "no row" in capsys.readouterr().err
    assert main([*base, "--placement", "nearby"]) == 2
    assert "unknown placement" in capsys.readouterr().err
