"""History coverage from the placement (``qwen3_rl.tools.sim.drafting.placement_coverage``), the default of
``simulate rollout --history-coverage``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen3_rl.tools.sim.drafting import EPOCH_STEPS, HISTORY_MAX_BYTES, placement_coverage
from qwen3_rl.tools.sim.simulate import SimError, main

MEAN = 7345.0


def test_235b_placements() -> None:
    """DP 32, n 16, 512 prompts a step, 512 MiB store, 79-step epoch. Data rebalance + exchange: half the next
    visits land on the rank half that ran the prompt, whose store keeps 256 prompts x 4 responses a step, so
    18 of 79 steps; contiguous: 1 rank in 32, its 16 prompts a step fit the store for the whole epoch; without
    the exchange a spread rank holds one response of four; fully-async dispatch lands a sample on a rank that
    ran one of the 16 with probability 1 - (31/32)^16."""
    step_bytes = 512 * 16 / 32 * 4 * MEAN * 4
    stored = HISTORY_MAX_BYTES / step_bytes / EPOCH_STEPS
    assert 0.2 < stored < 0.25
    assert placement_coverage("interleaved", 32, 16, True, 512, MEAN) == pytest.approx(0.5 * stored)
    assert placement_coverage("contiguous", 32, 16, False, 512, MEAN) == pytest.approx(1 / 32)
    one = 512 * 16 / 32 * 1 * MEAN * 4
    assert placement_coverage("interleaved", 32, 16, False, 512, MEAN) == pytest.approx(
        0.5 * 0.25 * min(1.0, HISTORY_MAX_BYTES / one / EPOCH_STEPS))
    land = 1 - (31 / 32) ** 16
    touched = 512 * land * 4 * MEAN * 4
    assert placement_coverage("random", 32, 16, True, 512, MEAN) == pytest.approx(
        land * HISTORY_MAX_BYTES / touched / EPOCH_STEPS)


def test_bounds_and_errors() -> None:
    assert placement_coverage("contiguous", 1, 4, False, 8, 100.0) == 1.0  # one rank, a store that holds all
    assert placement_coverage("interleaved", 4, 8, True, 8, 100.0, store_bytes=0) == 0.0
    assert placement_coverage("random", 8, 8, True, 8, 100.0, store_bytes=1 << 40) == pytest.approx(
        1 - (7 / 8) ** 8)  # a store larger than the epoch: only the landing counts
    for bad in (("scatter", 4), ("random", 0)):
        with pytest.raises(SimError):
            placement_coverage(bad[0], bad[1], 4, True, 8, 100.0)


def test_cli_default_is_the_placement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --history-coverage each history row carries its placement's coverage (contiguous vs interleaved),
    and history helps less at it than at full coverage; --history-coverage sets one value for all."""
    lens = tmp_path / "len.jsonl"
    assert main(["gen-lengths", "--out", str(lens), "--num-prompts", "32", "--n", "4", "--seed", "4"]) == 0
    capsys.readouterr()
    base = ["rollout", "--lengths", str(lens), "--dp", "8", "--max-num-seqs", "16", "--policy", "default,both",
            "--drafting", "sam_group+history", "--json", "--history-max-bytes", str(1 << 20)]

    def run(*extra: str) -> dict:
        assert main([*base, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    out = run()
    res = out["results"]
    assert out["config"]["history_coverage"] == "placement"
    assert res["default+sam_group+history"]["history_coverage"] == pytest.approx(
        placement_coverage("contiguous", 8, 4, False, 32, _mean(lens), store_bytes=1 << 20))
    assert res["both+sam_group+history"]["history_coverage"] == pytest.approx(
        placement_coverage("interleaved", 8, 4, False, 32, _mean(lens), store_bytes=1 << 20))
    full = run("--history-coverage", "1")["results"]
    assert all(full[k]["history_coverage"] == 1.0 for k in full)
    assert full["both+sam_group+history"]["makespan_s"] < res["both+sam_group+history"]["makespan_s"]


def _mean(path: Path) -> float:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return sum(r["response_len"] for r in rows) / len(rows)
