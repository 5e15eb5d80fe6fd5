"""EPLB placement (qwen3_rl.moe.eplb), its vLLM-Ascend adapter and the benchmark CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen3_rl.moe import eplb
from qwen3_rl.moe.eplb_ascend_policy import PackingAwareAscendPolicy
from qwen3_rl.tools.bench.eplb import (
    ascend_initial_table,
    hierarchical_bound,
    hot_loads,
    load_vllm_default,
    slot_workload,
    synthetic_loads,
)

REPO = Path(__file__).resolve().parents[2]


def check_valid(w: torch.Tensor, out: tuple, num_replicas: int, num_ranks: int, distinct: bool = False) -> None:
    """vLLM contract: shapes, every expert >= 1 replica, phy2log/log2phy/logcnt consistent."""
    phy2log, log2phy, logcnt = out[:3]
    L, E = w.shape
    assert phy2log.shape == (L, num_replicas) and phy2log.dtype == torch.int64
    assert log2phy.shape == (L, E, num_replicas - E + 1)
    assert logcnt.shape == (L, E)
    for layer in range(L):
        p = phy2log[layer].numpy()
        cnt = np.bincount(p, minlength=E)
        assert cnt.min() >= 1 and cnt.shape[0] == E
        assert np.array_equal(cnt, logcnt[layer].numpy())
        for e in range(E):
            slots = np.flatnonzero(p == e)
            row = log2phy[layer, e].numpy()
            assert np.array_equal(np.sort(row[: cnt[e]]), slots)
            assert np.all(row[cnt[e]:] == -1)
        if distinct:
            per_rank = p.reshape(num_ranks, -1)
            assert all(len(set(r)) == len(r) for r in per_rank)


@pytest.fixture(scope="module")
def vllm_default(pristine_workspace: Path):
    """vLLM 0.13's DefaultEplbPolicy, loaded by path from the pristine vllm tree (no vllm import)."""
    return load_vllm_default(pristine_workspace / "vllm")


@pytest.mark.parametrize(
    "E,R,X,groups,nodes",
    [(16, 4, 0, 1, 1), (16, 4, 4, 1, 2), (32, 8, 8, 4, 2), (16, 4, 12, 1, 1), (32, 16, 16, 8, 4)],
)
def test_output_valid(E: int, R: int, X: int, groups: int, nodes: int) -> None:
    w = torch.from_numpy(synthetic_loads(3, E, 1.0, 2000, 8, seed=E + X).astype(np.float64))
    if nodes > 1 and groups % nodes == 0:  # vLLM's hierarchical mode: not implemented, an error (not ignored)
        with pytest.raises(ValueError, match="hierarchical placement"):
            eplb.rebalance_experts(w, E + X, groups, nodes, R)
        with pytest.raises(ValueError, match="hierarchical placement"):
            eplb.rebalance_experts_migration_aware(w, E + X, groups, nodes, R, torch.arange(E + X).remainder(E)
                                                   .expand(3, -1))
        groups = 1  # the global placement of the same sizes
    out = eplb.rebalance_experts(w, E + X, groups, nodes, R)
    check_valid(w, out, E + X, R)
    out_d = eplb.rebalance_experts(w, E + X, groups, nodes, R, eplb.EplbOptions(distinct=True))
    check_valid(w, out_d, E + X, R, distinct=True)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 1000), min_size=16, max_size=16),
    st.sampled_from([(4, 0), (4, 4), (8, 8), (2, 6)]),
)
def test_valid_on_any_loads(loads: list[int], rx: tuple[int, int]) -> None:
    R, X = rx
    w = torch.tensor([loads], dtype=torch.float64)
    check_valid(w, eplb.rebalance_experts(w, 16 + X, 1, 1, R), 16 + X, R)
    check_valid(w, eplb.rebalance_experts(w, 16 + X, 1, 1, R, eplb.EplbOptions(distinct=True)), 16 + X, R, True)


@pytest.mark.parametrize("zipf", [0.6, 1.0])
def test_better_than_identity_on_skewed_loads(zipf: float) -> None:
    w = synthetic_loads(6, 64, zipf, 8000, 8, seed=3).astype(np.float64)
    ident = eplb.balancedness(w, eplb.identity_placement(6, 64), 16)
    for X in (0, 16):
        ours = eplb.balancedness(w, eplb.rebalance_experts(torch.from_numpy(w), 64 + X, 1, 1, 16)[0], 16)
        assert ours.mean() >= ident.mean()
        assert np.all(ours >= ident - 1e-12)
    assert eplb.balancedness(w, eplb.rebalance_experts(torch.from_numpy(w), 80, 1, 1, 16)[0], 16).mean() > 1.5 * ident.mean()


def test_hot_experts_packing_aware_vs_vllm(vllm_default) -> None:
    """All tokens on 16 of 128 experts, 128 ranks, 128 redundant: vLLM 0.5625, ours 1.0 (same signature)."""
    w = torch.from_numpy(hot_loads(2, 128, 16, 1000).astype(np.float64))
    ours = eplb.rebalance_experts(w, 256, 1, 8, 128)
    theirs = vllm_default.rebalance_experts(w.clone(), 256, 1, 8, 128)
    check_valid(w, ours, 256, 128)
    check_valid(w, theirs, 256, 128)  # same contract as vLLM's own output
    assert eplb.balancedness(w, theirs[0], 128).mean() == pytest.approx(0.5625)
    assert eplb.balancedness(w, ours[0], 128).mean() == pytest.approx(1.0)


@pytest.mark.parametrize("E,R,X,groups,nodes", [(64, 16, 16, 1, 2), (64, 32, 32, 1, 4), (64, 8, 0, 1, 1)])
def test_not_worse_than_vllm_default(vllm_default, E: int, R: int, X: int, groups: int, nodes: int) -> None:
    for zipf in (0.5, 1.0):
        w = torch.from_numpy(synthetic_loads(8, E, zipf, 10000, 8, seed=7).astype(np.float64))
        ours = eplb.balancedness(w, eplb.rebalance_experts(w, E + X, groups, nodes, R)[0], R)
        theirs = eplb.balancedness(w, vllm_default.rebalance_experts(w.clone(), E + X, groups, nodes, R)[0], R)
        assert ours.mean() >= theirs.mean() - 1e-12, (zipf, ours.mean(), theirs.mean())


def test_migration_aware_keeps_optimal_placement() -> None:
    w = torch.from_numpy(synthetic_loads(5, 64, 0.8, 8000, 8, seed=11).astype(np.float64))
    prev = eplb.rebalance_experts(w, 96, 1, 1, 16)[0]
    new, log2phy, logcnt, moved = eplb.rebalance_experts_migration_aware(w, 96, 1, 1, 16, prev, 0.002)
    assert moved.tolist() == [0] * 5
    assert torch.equal(new, prev)
    # a perfectly balanced previous placement is kept even with a tiny migration weight
    flat = torch.full((2, 64), 100.0)
    p0 = torch.arange(64).repeat(2, 1)
    assert eplb.rebalance_experts_migration_aware(flat, 64, 1, 1, 16, p0, 1e-6)[3].tolist() == [0, 0]


def test_migration_aware_moves_when_it_pays() -> None:
    w = torch.from_numpy(synthetic_loads(4, 64, 1.0, 8000, 8, seed=5).astype(np.float64))
    prev = torch.arange(96).remainder(64).repeat(4, 1)  # naive placement, badly balanced
    fresh = eplb.rebalance_experts(w, 96, 1, 1, 16)[0]
    new, _, _, moved = eplb.rebalance_experts_migration_aware(w, 96, 1, 1, 16, prev, 0.0005)
    check_valid(w, (new, *eplb.log2phy_from_phy2log(new, 64, 33)), 96, 16)
    b_prev = eplb.balancedness(w, prev, 16).mean()
    b_new = eplb.balancedness(w, new, 16).mean()
    assert b_new > b_prev + 0.1
    assert moved.sum() > 0
    assert moved.sum() <= eplb.moved_slots(prev, fresh).sum()  # relabelled ranks move no more than fresh
    # an enormous migration weight moves nothing
    assert eplb.rebalance_experts_migration_aware(w, 96, 1, 1, 16, prev, 10.0)[3].sum() == 0


def _ascend_checks(old: torch.Tensor, new: torch.Tensor) -> None:
    """The three checks of vllm-ascend 0.13 EplbWorker.check_expert_placement (re-stated)."""
    for layer in range(old.shape[0]):
        assert torch.unique(new[layer]).numel() == torch.unique(old[layer]).numel()
        for r in range(old.shape[1]):
            n, o = new[layer, r], old[layer, r]
            assert n.numel() == torch.unique(n).numel()
            keep = torch.isin(n, o)
            assert torch.equal(n[keep], o[keep])


def test_ascend_adapter_contract() -> None:
    E, R, X, L = 64, 16, 16, 4
    loads = synthetic_loads(L, E, 1.0, 8000, 8, seed=2).astype(np.float64)
    table = torch.from_numpy(np.broadcast_to(ascend_initial_table(E, R, X), (L, R, (E + X) // R)).copy())
    work = torch.from_numpy(slot_workload(loads, table.numpy()))
    policy = PackingAwareAscendPolicy(config=None, migration_weight=0.0005)
    changed, priority, new = policy.rebalance_experts(table.clone(), work)
    assert changed == 1 and sorted(priority.tolist()) == list(range(L))
    assert new.shape == table.shape and new.dtype == torch.int64
    _ascend_checks(table, new)
    before = eplb.balancedness(loads, table.reshape(L, -1), R).mean()
    after = eplb.balancedness(loads, new.reshape(L, -1), R).mean()
    assert after > before
    # second call on its own output with the same loads: nothing to do
    work2 = torch.from_numpy(slot_workload(loads, new.numpy()))
    changed2, _, new2 = policy.rebalance_experts(new.clone(), work2)
    assert changed2 == 0 and torch.equal(new2, new)


def test_ascend_adapter_does_not_import_vllm_ascend() -> None:
    code = "import sys, qwen3_rl.moe.eplb_ascend_policy; assert 'vllm_ascend' not in sys.modules; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_bench_cli_json(pristine_workspace: Path, tmp_path: Path) -> None:
    csv = tmp_path / "loads.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "qwen3_rl.tools.bench.eplb", "--write-synthetic", str(csv), "--layers", "3",
         "--experts", "16", "--zipf", "1.0", "--tokens", "500"], cwd=REPO, text=True, capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert np.loadtxt(csv, delimiter=",").shape == (3, 16)
    proc = subprocess.run(
        [sys.executable, "-m", "qwen3_rl.tools.bench.eplb", "--loads", str(csv), "--num-ranks", "4", "--num-nodes", "2",
         "--num-groups", "1", "--redundant", "4", "--json",
         "--policies", "identity,vllm_default,ours,ours_migration,ascend_dynamic_ep",
         "--vllm-tree", str(pristine_workspace / "vllm"), "--ascend-tree", str(pristine_workspace / "vllm-ascend")],
        cwd=REPO, text=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    for name in ("identity", "vllm_default", "ours", "ours_migration", "ascend_dynamic_ep"):
        assert 0.0 < res[name]["balancedness"] <= 1.0, (name, res[name])
        assert res[name]["ms"] >= 0.0
    assert res["ours"]["balancedness"] >= res["vllm_default"]["balancedness"] - 1e-9
    assert res["ours_migration"]["moved_total"] >= 0


@pytest.mark.parametrize("G,N,R,X,seed", [(8, 8, 32, 32, 0), (8, 4, 16, 16, 1), (4, 2, 8, 8, 2), (8, 8, 128, 128, 3)])
def test_hierarchical_bound_holds(vllm_default, G: int, N: int, R: int, X: int, seed: int) -> None:
    """No hierarchical placement (vLLM's DefaultEplbPolicy, which honours the contract; any of its layers)
    beats the bound, and the bound is attained on loads that are uniform (every group and expert equally hot)."""
    loads = synthetic_loads(num_layers=6, num_experts=64 if R < 128 else 128, zipf=1.0, tokens=4000, seed=seed)
    E = loads.shape[1]
    phy = vllm_default.rebalance_experts(torch.from_numpy(loads.astype(np.float64)), E + X, G, N, R)[0].numpy()
    bal = eplb.balancedness(loads, phy, R)
    bound = hierarchical_bound(loads, G, N, R, E + X)
    assert np.all(bal <= bound + 1e-9), (bal, bound)
    uniform = np.full((2, E), 100)
    assert np.allclose(hierarchical_bound(uniform, G, N, R, E + X), 1.0)


def test_bench_hierarchical_case_reports_contracts(pristine_workspace: Path, tmp_path: Path) -> None:
    """A hierarchical case prints the bound vLLM's placement (under the contract) stays below, and ours placed
    globally beside vLLM-Ascend's policies, which ignore groups; each entry says which contract it honours."""
    from qwen3_rl.tools.bench.eplb import run_case

    loads = synthetic_loads(num_layers=4, num_experts=32, zipf=1.0, tokens=4000, seed=5)
    res = run_case(loads, 16, 4, 4, 16, ("vllm_default", "ours", "ascend_dynamic_ep"),
                   vllm_tree=pristine_workspace / "vllm", ascend_tree=pristine_workspace / "vllm-ascend")
    assert "hierarchical" in res["meta"]["constraint"]
    assert res["vllm_default"]["balancedness"] <= res["hierarchical_bound"]["balancedness"] + 1e-9
    assert res["ours"]["constraint"].startswith("global")
    assert res["ascend_dynamic_ep"]["constraint"].startswith("global")
    assert res["ours"]["balancedness"] >= res["ascend_dynamic_ep"]["balancedness"] - 1e-9
