"""``qwen3_rl.tools.bench.hdp_mcore``: HDP against megatron-core 0.16.1's ``BalancedCPScheduler`` (real, from the
pristine 0.16.1 tree of the current set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qwen3_rl.parallel import hdp
from qwen3_rl.tools.bench.hdp_mcore import upstream_costs

from conftest import REPO
from helpers.current_set import pristine_megatron


def test_upstream_costs_by_hand() -> None:
    """Two groups on 4 ranks: a sample on ranks 0-1 (CP 2) and two DP samples; then one sample on all 4 ranks."""
    cm = hdp.CostModel()
    lens = [8000, 3000, 2000, 20000]
    groups = [[[0], [0], [1], [2]], [[3], [3], [3], [3]]]
    got = upstream_costs(lens, groups, 8192, cm)
    g0 = [cm.cost(8000, 2), cm.cost(8000, 2), cm.cost(3000, 1), cm.cost(2000, 1)]
    g1 = [cm.cost(20000, 4)] * 4
    assert got["step"] == pytest.approx(max(g0) + max(g1))
    assert got["totals"] == pytest.approx([a + b for a, b in zip(g0, g1, strict=True)])
    assert got["groups"] == 2 and got["forwards"] == 2
    with pytest.raises(AssertionError, match="left out or repeated"):
        upstream_costs(lens, groups[:1], 8192, cm)
    with pytest.raises(AssertionError):  # 20000 tokens on one rank: over the budget
        upstream_costs(lens, [[[0], [0], [1], [2]], [[3], [], [], []]], 8192, cm)


def test_cli_runs_megatrons_scheduler() -> None:
    """One small batch through megatron-core 0.16.1's scheduler and ours: both place every sample within the
    budget (checked inside), and the figures are ratios >= 1 to the lower bound."""
    proc = subprocess.run(
        [sys.executable, "-m", "qwen3_rl.tools.bench.hdp_mcore", "--megatron-tree", str(pristine_megatron()),
         "--sizes", "32", "--cp", "4", "--batches", "1", "--json"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    case = json.loads(proc.stdout)["cases"]["cp4_n32"]
    assert case["ours_step"] >= 1.0 and case["upstream_step"] >= 1.0
    assert case["upstream_groups"] >= 1 and case["upstream_forwards"] >= 32 / 4
    assert case["upstream_over_ours"] == pytest.approx(case["upstream_step"] / case["ours_step"], rel=1e-3)
