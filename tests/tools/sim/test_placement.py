"""``simulate placement``: data rebalance by group key against by batch position over epochs, on reference-like
lengths (``simulate gen-lengths``, the 235B layout) and the dev rollouts: the load imbalance by key stays within
``IMBALANCE_BOUND`` of the dealing by position, and the history coverage it gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen3_rl.tools.sim.drafting import keyed_home_share, placement_coverage
from qwen3_rl.tools.sim.lengths import generate_lengths
from qwen3_rl.tools.sim.placement import load_any, main, replay

REPO = Path(__file__).resolve().parents[3]
CORPUS = REPO.parent / "shared" / "bench" / "rollouts_dev.jsonl"
#: by key, the mean over steps of (largest rank load / mean rank load) is at most IMBALANCE_BOUND (relative) above
#: the dealing by position's, and the worst step at most WORST_STEP_BOUND above its worst (one step of 24: noisy)
IMBALANCE_BOUND = 0.02
WORST_STEP_BOUND = 0.10


@pytest.mark.parametrize("n,prompts", [(16, 512), (8, 256)])
def test_by_key_keeps_the_load_of_the_dealing_and_covers_the_next_visit(n: int, prompts: int) -> None:
    for seed in range(3):
        res = replay(generate_lengths(prompts, n, seed=seed), 32, steps_per_epoch=8, epochs=3, seed=seed)["placements"]
        key, pos, cont = res["key"], res["position"], res["contiguous"]
        print(f"n {n} seed {seed}: imbalance mean/max contiguous {cont['imbalance_mean']:.4f}/"
              f"{cont['imbalance_max']:.4f} position {pos['imbalance_mean']:.4f}/{pos['imbalance_max']:.4f} key "
              f"{key['imbalance_mean']:.4f}/{key['imbalance_max']:.4f}; coverage position {pos['coverage']:.3f} key "
              f"{key['coverage']:.3f} (home {key['home']:.3f})")
        assert key["imbalance_mean"] <= pos["imbalance_mean"] * (1 + IMBALANCE_BOUND)
        assert key["imbalance_max"] <= pos["imbalance_max"] * (1 + WORST_STEP_BOUND)
        assert cont["imbalance_mean"] > pos["imbalance_mean"] * 1.1  # the metric sees a worse placement
        assert pos["coverage"] == pytest.approx(n / 32, abs=0.02)
        assert key["coverage"] >= 0.93
        # the simulator's default coverage model (keyed_home_share) matches the replay
        assert keyed_home_share(prompts, n, 32) == pytest.approx(key["coverage"], abs=0.02)


def test_dev_rollouts_and_cli(capsys) -> None:
    lens = load_any(CORPUS)
    assert (lens.num_prompts, lens.n, lens.size) == (22, 8, 176) and int(lens.response_len.sum()) == 68961
    assert main(["--lengths", str(CORPUS), "--dp", "11", "--epochs", "6", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["placements"]
    print(res)
    assert res["key"]["coverage"] > res["position"]["coverage"] + 0.1
    assert main(["--lengths", str(CORPUS), "--dp", "5"]) == 2
    assert "not a multiple of --dp 5" in capsys.readouterr().err


def test_simulator_default_coverage_follows_the_placement() -> None:
    """235B layout (DP 32, n 16, 512 prompts, 79 steps an epoch) with the exchange: by position about half the
    visits land on their history, by key nearly all; the store bound multiplies both."""
    epoch_bytes = 512 * 16 / 32 * 4 * 7345 * 4 * 79  # bytes per rank to keep an epoch at 4 responses of 7345 tokens
    full = {pl: placement_coverage(pl, 32, 16, True, 512, 7345.0, store_bytes=epoch_bytes)
            for pl in ("interleaved", "keyed")}
    assert full["interleaved"] == pytest.approx(0.5)
    assert full["keyed"] == pytest.approx(keyed_home_share(512, 16, 32)) and full["keyed"] > 0.95
    assert placement_coverage("keyed", 32, 16, True, 512, 7345.0, store_bytes=epoch_bytes / 2) == pytest.approx(
        full["keyed"] / 2)


def test_rollout_by_key_takes_the_keyed_coverage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``simulate rollout --rebalance-by-key``: the data-rebalance row runs the keyed layout and, without
    --history-coverage, carries the keyed placement's coverage (store holding the epoch, the default); by
    position it carries the interleaved one."""
    import math

    from qwen3_rl.tools.sim.lengths import load_lengths
    from qwen3_rl.tools.sim.simulate import main as sim_main

    lens = tmp_path / "len.jsonl"
    assert sim_main(["gen-lengths", "--out", str(lens), "--num-prompts", "64", "--n", "4", "--seed", "4"]) == 0
    capsys.readouterr()
    mean = float(load_lengths(lens).response_len.mean())
    base = ["rollout", "--lengths", str(lens), "--dp", "16", "--max-num-seqs", "16", "--policy", "both",
            "--drafting", "sam_group_exchange+history", "--json"]
    runs = {}
    for name, extra in (("position", []), ("key", ["--rebalance-by-key"])):
        assert sim_main([*base, *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)  # one row: the output is the row
    pos, key = runs["position"], runs["key"]
    assert pos["policy"] == key["policy"] == "both+sam_group_exchange+history"
    assert pos["history_coverage"] == pytest.approx(
        placement_coverage("interleaved", 16, 4, True, 64, mean, store_bytes=math.inf)) == pytest.approx(0.25)
    assert key["history_coverage"] == pytest.approx(
        placement_coverage("keyed", 16, 4, True, 64, mean, store_bytes=math.inf))
    assert key["history_coverage"] > 0.8
    print(f"makespan both+exchange+history: by position {pos['makespan_s']:.1f} s (coverage "
          f"{pos['history_coverage']:.3f}), by key {key['makespan_s']:.1f} s (coverage {key['history_coverage']:.3f})")
    assert key["makespan_s"] < pos["makespan_s"]
