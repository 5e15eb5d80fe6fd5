"""``qwen3_rl.tools.bench.moe_sync_verl091``: mbridge 0.15.1's expert export (the current set's weight sync) against
our all-to-allv, counted at torch.distributed.

The measured run is the bench itself in the current set's training venv (``tests/setup_verl091_env.sh``; a missing
venv fails): 4 gloo processes, megatron EP 2 (expert-DP 2), vLLM TP 1 x DP 4 with expert parallel, so two ranks get
their experts from the other EP member and two hold theirs already. Checked: our tensors are mbridge's own export of
the same names, exactly the experts of each rank's vLLM EP rank, and the instrument's counts equal the count model
that gives the train scripts' layout figures. No time is asserted (the bench prints them).
"""

from __future__ import annotations

import json

import pytest

from qwen3_rl.moe.reshard import MoEShape, RolloutLayout, TrainLayout, rollout_expert_range
from qwen3_rl.tools.bench.moe_sync_verl091 import LAYOUTS, expert_groups, layout_counts, tiny_counts

from conftest import REPO
from helpers.current_verl import run_in_venv

EXPERTS, LAYERS, WORLD, EP = 8, 2, 4, 2


def test_count_model_on_the_train_script_layouts() -> None:
    """235B: mbridge all-gathers every expert of the model into every rank (the seed doc's 454,192,791,552 B); ours
    only the 1 expert per layer its vLLM EP rank holds; both 752 calls. 30B-A3B: 4 of 128 experts per layer."""
    per_expert = {94: 3 * 4096 * 1536 * 2, 48: 3 * 2048 * 768 * 2}
    for shape, train, rollout in LAYOUTS.values():
        got = layout_counts(shape, train, rollout)
        shard = per_expert[shape.num_layers]
        calls = shape.num_layers * shape.num_experts // train.ep * 2
        assert got["mbridge"] == {
            "calls": calls,
            "out_bytes": shape.num_layers * shape.num_experts * shard,
            "peer_bytes": shape.num_layers * shape.num_experts * shard * (train.ep - 1) // train.ep,
        }
        held = shape.num_experts // rollout.ep
        assert got["alltoallv"]["calls"] == calls
        assert got["alltoallv"]["out_bytes"] == shape.num_layers * held * shard
        # every rank of every expert group needs only experts its own group holds (after mbridge's PP broadcast)
        assert sorted(g for ranks in expert_groups(train) for g in ranks) == list(range(train.world))
    first = next(iter(LAYOUTS.values()))
    assert layout_counts(*first)["mbridge"]["out_bytes"] == 454_192_791_552
    assert layout_counts(*first)["alltoallv"]["out_bytes"] == 3_548_381_184


def test_count_model_with_expert_tp() -> None:
    """ETP 2: mbridge adds one ETP all-gather per gathered expert (EP of them per tensor); ours stays one call and
    receives both ETP shards of each held expert."""
    shape, train = MoEShape(1, 4, 8, 4, 1), TrainLayout(tp=2, pp=1, ep=2, etp=2, world=4)
    got = layout_counts(shape, train, RolloutLayout(2, 2))
    shard = 3 * 8 * 4 // 2
    assert got["mbridge"] == {
        "calls": 2 * 2 * (1 + 2),
        "out_bytes": 2 * 2 * shard * 3,
        "peer_bytes": 2 * (shard + 2 * shard),
    }
    assert got["alltoallv"]["calls"] == 4 and got["alltoallv"]["out_bytes"] == 1 * 2 * shard


@pytest.fixture(scope="module")
def measured() -> dict:
    proc = run_in_venv(
        [
            "-m",
            "qwen3_rl.tools.bench.moe_sync_verl091",
            "--runs",
            "1",
            "--experts",
            str(EXPERTS),
            "--layers",
            str(LAYERS),
            "--world",
            str(WORLD),
            "--ep",
            str(EP),
            "--json",
        ],
        path=[REPO],
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def test_measured_export_equals_mbridge_and_counts_match_the_model(measured: dict) -> None:
    model = tiny_counts(EXPERTS, LAYERS, WORLD, EP)
    assert measured["count_model"] == model
    peers = []
    for rank, res in enumerate(measured["measured"]):
        held = len(rollout_expert_range(EXPERTS, WORLD, rank))
        assert len(res["runs"]) == 2
        for run in res["runs"]:
            assert run["names_equal"] and run["tensors_equal"], (rank, run)
            # HF gate / up / down per expert: mbridge yields every expert, ours the held ones
            assert run["n_mbridge_experts"] == LAYERS * EXPERTS * 3 > run["n_alltoallv"] == LAYERS * held * 3
            ag, a2a = run["mbridge"]["all_gather"], run["alltoallv"]["all_to_all_single"]
            assert {k: ag[k] for k in model["mbridge"]} == model["mbridge"]
            assert set(run["alltoallv"]) == {"all_to_all_single"}  # ours: nothing but the exchange
            assert (a2a["calls"], a2a["out_bytes"]) == (
                model["alltoallv"]["calls"],
                model["alltoallv"]["out_bytes"],
            )
            assert a2a["calls"] == ag["calls"] == LAYERS * EXPERTS // EP * 2  # one per layer, local id, fc
        peers.append(res["runs"][-1]["alltoallv"]["all_to_all_single"]["peer_bytes"])
    # ranks 1 and 2 get their experts from the other EP member, ranks 0 and 3 hold theirs: the instrument sees both
    assert peers[1] == peers[2] == model["alltoallv"]["peer_bytes"] > 0 and peers[0] == peers[3] == 0
