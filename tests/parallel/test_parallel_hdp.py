"""HDP assignment (qwen3_rl.parallel.hdp) and its benchmark CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen3_rl.parallel import hdp

REPO = Path(__file__).resolve().parents[2]


def check(a: hdp.HDPAssignment, lens: list[int], C: int, B: int) -> None:
    assert [p.seq for p in a.placements] == list(range(len(lens)))  # each sequence exactly once
    assert [p.length for p in a.placements] == lens
    for p in a.placements:
        assert p.block_size & (p.block_size - 1) == 0 and C % p.block_size == 0
        assert p.block_start % p.block_size == 0 and p.block_start + p.block_size <= C
        assert 0 <= p.micro_batch < a.num_micro_batches
    # recompute tokens independently: never above the budget
    tok = [[0] * C for _ in range(a.num_micro_batches)]
    for p in a.placements:
        for r in p.ranks:
            tok[p.micro_batch][r] += hdp.tokens_on_rank(p.length, p.block_size)
    assert tok == a.rank_tokens
    assert max(max(row) for row in tok) <= B
    assert a.max_cost >= hdp.lower_bound(lens, C, B, a.cost_model) * (1 - 1e-12)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 9000), min_size=1, max_size=40),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1200, 9000),
)
def test_never_exceeds_budget(lens: list[int], C: int, B: int) -> None:
    if any(hdp.tokens_on_rank(s, C) > B for s in lens):
        with pytest.raises(hdp.HDPInfeasibleError):
            hdp.assign_hdp(lens, C, B)
        return
    check(hdp.assign_hdp(lens, C, B), lens, C, B)


def test_short_sequences_go_dp_long_ones_get_cp_blocks() -> None:
    lens = [30000, 20000, 9000] + [1000] * 24
    a = hdp.assign_hdp(lens, 8, 8192)
    check(a, lens, 8, 8192)
    assert a.placements[0].block_size >= 4  # 30000 tokens need >= 4 ranks under 8192/rank
    assert a.placements[1].block_size >= 4
    assert a.placements[2].block_size >= 2
    assert all(p.block_size == 1 for p in a.placements[3:])


def test_close_to_lower_bound_on_reference_like_batch() -> None:
    from qwen3_rl.tools.bench.hdp import default_budget, reference_like_lengths

    lens = reference_like_lengths(96, seed=1)
    a = hdp.assign_hdp(lens, 8, default_budget(8))
    check(a, lens, 8, default_budget(8))
    assert a.max_cost / hdp.lower_bound(lens, 8, default_budget(8)) < 1.1


def test_impossible_inputs_raise() -> None:
    with pytest.raises(hdp.HDPInfeasibleError, match="34816 tokens"):
        hdp.assign_hdp([1000, 34816], 4, 8192)
    with pytest.raises(ValueError, match="power of two"):
        hdp.assign_hdp([10], 6, 100)
    with pytest.raises(ValueError, match="> 0"):
        hdp.assign_hdp([0], 2, 100)


def test_rank_view_chunks_cover_each_sequence() -> None:
    lens = [17000, 5000, 3000, 40]
    a = hdp.assign_hdp(lens, 4, 8192)
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(lens))}
    for r in range(4):
        for mb in a.rank_view(r):
            for sl in mb:
                assert sl.ring_ranks[sl.ring_index] == r
                covered[sl.seq].extend(x for x in sl.token_ranges if x[1] > x[0])
    for i, s in enumerate(lens):
        spans = sorted(covered[i])
        assert spans[0][0] == 0 and spans[-1][1] == s
        assert all(a_[1] == b_[0] for a_, b_ in zip(spans, spans[1:], strict=False))


def test_cost_model_and_lower_bound() -> None:
    cm = hdp.CostModel(a=1.0, b=0.001, g=0.5)
    assert cm.cost(100, 1) == pytest.approx(100 + 10)
    # k=2: 4 chunks of 25 -> 50 tokens per rank; attention 0.001*100^2/2; ring 0.5*50*1
    assert cm.cost(100, 2) == pytest.approx(50 + 5 + 25)
    assert hdp.tokens_on_rank(101, 2) == 52
    assert hdp.lower_bound([100, 100], 2, 1000, cm) == pytest.approx(110)


def test_bench_cli_json(pristine_workspace: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "qwen3_rl.tools.bench.hdp", "--sizes", "16", "--cp", "4", "--batches", "1", "--json",
         "--verl-tree", str(pristine_workspace / "verl")],
        cwd=REPO, text=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    case = res["cases"]["cp4_n16"]
    assert case["hdp_ratio"] >= 1.0 and case["pure_cp_ratio"] >= 1.0
    assert case["speedup_vs_pure_cp"] >= 1.0
