"""ROLLOUT_REBALANCE on the current set: requests moved between the two DP engine cores of vLLM 0.23.0's real CPU
engine (``AsyncLLM``, ``data_parallel_size`` 2) through upstream's ``scheduler_cls``
(``qwen3_rl.rollout.rebalance_vllm023.RebalanceScheduler``), no vLLM patch; the seed set's hook, planner and KV
moves unchanged.

One driver process (``rebalance_driver.py``), two engine starts: the switch off (positive control: no round, every
request served where it was sent) and on. Six requests all sent to DP rank 0 (``data_parallel_rank=0``; 4 run at
once, ``max_num_seqs`` 4): two short ones wait in rank 0's queue, rank 1 is idle. vLLM 0.23 runs DP engine cores in
lockstep only for a MoE model (a dense model's ranks are independent engines, ``core.py:1153-1163``): the tiny
Qwen3-MoE, its expert width 128 (vLLM-CPU's fused-MoE kernel refuses the default 32 split over the two ranks,
``cpu_fused_moe.cpp:247``). Shim (device layer, the driver's ``CPU_GATHERV``): the CPU communicator's
``all_gatherv`` / ``reduce_scatterv`` for the MoE layers' DP dispatch / combine. vLLM-CPU runs the model in worker
processes: the KV moves between the workers over their vLLM DP group (the hook's ``workers`` path).
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import run_driver

PROMPTS = [
    [11, 12, 13, 14, 15, 16],
    [21, 22, 23, 24, 25, 26, 27, 28],
    [31, 32, 33, 34, 35],
    [41, 42, 43, 44, 45, 46, 47],
    [51, 52, 53, 54, 55],
    [61, 62, 63, 64, 65, 66],
]
MAX_TOKENS = [60, 70, 80, 90, 6, 8]
# running requests always travel with their KV (no recompute, no round-time bound), whatever the measured
# link of a loaded host would price
ON = {"enable": True, "interval_steps": 4, "timeout_s": 120.0, "prefill_tokens_per_s": 0.0, "max_round_s": 0.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("rebalance023")
    model = make_tiny_model(root / "moe", TinySpec(moe=True, moe_intermediate_size=128))
    (root / "probe").mkdir()
    spec = {
        "runs": [{"name": "off", "rebalance": {"enable": False}}, {"name": "on", "rebalance": ON}],
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "dp_ranks": [0] * len(PROMPTS),
    }
    (root / "spec.json").write_text(json.dumps(spec))
    return run_driver(
        "rebalance_driver.py", [str(model), str(root / "probe"), str(root / "spec.json")], "REBALANCE_RESULT"
    )


def _base(req_id: str) -> str:
    """``req-<i>`` of a request id as an engine core sees it (vLLM 0.23 appends ``-<hex>``; a hosted request
    carries its origin, ``r<rank>|``)."""
    return re.sub(r"-[0-9a-f]{8}$", "", req_id.split("|")[-1])


def served(steps: list[dict]) -> dict[str, set[int]]:
    """``req-<i>`` -> the DP ranks whose worker ran it (the probe's per-step records)."""
    out: dict[str, set[int]] = {}
    for s in steps:
        for rid in s["req_ids"]:
            out.setdefault(_base(rid), set()).add(s["dp_rank"])
    return out


def test_switch_off_moves_nothing(runs: dict[str, dict]) -> None:
    off = runs["off"]
    assert off["rounds"] == []
    assert served(off["steps"]) == {f"req-{i}": {0} for i in range(len(PROMPTS))}
    assert [len(o) for o in off["outputs"]] == MAX_TOKENS


def test_queued_and_running_requests_move_to_the_idle_core_losslessly(runs: dict[str, dict]) -> None:
    off, on = runs["off"], runs["on"]
    rounds = {r: {x["round"]: x for x in on["rounds"] if x["dp_rank"] == r} for r in (0, 1)}
    assert rounds[0] and rounds[1]
    both = rounds[0].keys() & rounds[1].keys()
    assert all(
        rounds[0][k]["moves"] == rounds[1][k]["moves"] for k in both
    )  # one plan, computed on each rank
    moves = [tuple(m) for k in sorted(rounds[0]) for m in rounds[0][k]["moves"]]
    queued = [m for m in moves if m[3] == 1]
    with_kv = [m for m in moves if m[3] == 2 and m[4] > 0 and not m[5]]
    assert {_base(m[0]) for m in queued} == {"req-4", "req-5"} and all(m[1:3] == (0, 1) for m in queued), (
        moves
    )
    assert with_kv and all(m[1:3] == (0, 1) for m in with_kv), moves
    sent = sum(x["kv_bytes_sent"] for x in rounds[0].values())
    assert sent > 0 and sent == sum(x["kv_bytes_received"] for x in rounds[1].values())
    assert all(x["kv_path"] == "workers" for x in on["rounds"])
    # each core's served requests: the moved ones ran on rank 1, the rest only on rank 0
    seen = served(on["steps"])
    moved = {_base(m[0]) for m in moves}
    for i in range(len(PROMPTS)):
        rid = f"req-{i}"
        assert 1 in seen[rid] if rid in moved else seen[rid] == {0}, (rid, seen)
    assert {_base(m[0]) for m in queued} == {r for r, ranks in seen.items() if ranks == {1}}
    # results home: every moved request delivered to rank 0, greedy tokens equal the run without rebalance
    delivered = {d for x in rounds[0].values() for d in x["delivered"]}
    assert {m[0] for m in moves} <= delivered
    assert on["outputs"] == off["outputs"]
    print("moves", moves, "KV bytes", sent, "link GB/s", rounds[0][1]["link_gb_s"])


def test_loop_points_checked_against_the_installed_vllm() -> None:
    """The hook finds vLLM 0.23.0's DP loop point and step call (nothing refused); a loop without them (positive
    control: a function standing for a moved loop) is named, which refuses the switch at the scheduler's build."""
    from qwen3_rl.rollout.rebalance_vllm023 import loop_point_problems

    assert loop_point_problems() == []

    def moved_loop(self):  # noqa: ANN001, ANN202 (a stand-in for a loop that no longer asks the scheduler)
        return self.scheduler.has_work()

    assert loop_point_problems(moved_loop.__code__, moved_loop.__code__) == [
        "DPEngineCoreProc.run_busy_loop has no 'has_unfinished_requests'",
        "DPEngineCoreProc.run_busy_loop has no 'engines_running'",
        "DPEngineCoreProc.run_busy_loop has no 'executed'",
        "EngineCore.step does not call 'has_requests'",
    ]
