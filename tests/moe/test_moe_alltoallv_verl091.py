"""MOE_ALLTOALLV on the current set (verl 0.9.1 + mbridge 0.15.1): the plug-in ``qwen3_rl.moe.alltoallv_verl091``.

In the current set's training venv (``tests/setup_verl091_env.sh``; a missing venv fails), on 4 gloo ranks
(``tests/helpers/verl091_moe_alltoallv_driver.py``): megatron EP 2, verl rollout TP 1 x DP 4 with expert parallel
(vLLM EP 4), the tiny Qwen3-MoE (8 experts, 2 layers) built through ``AutoBridge`` with the plug-in registered,
weights synced by verl's real ``ActorRolloutRefWorker.update_weights`` -> ``MegatronEngine.get_per_tensor_param``.
Checked: with the switch each rank's rollout side receives exactly mbridge's own export filtered to the experts of
its vLLM EP rank (names and tensors, nothing twice); the expert bytes drop as the bench's count model says, with no
EP all-gather left; switch off = mbridge's own export (positive control, its all-gathers counted); the refusals
name their setting and the switch-on run of the same code is the positive control for them. PP 2 runs the same
check through mbridge's PP broadcast.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO
from helpers.current_verl import run_in_venv

WORLD, EP, EXPERTS, LAYERS = 4, 2, 8, 2
DRIVER = REPO / "tests" / "helpers" / "verl091_moe_alltoallv_driver.py"
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def _run(tmp_path: Path, pp: int) -> list[dict]:
    import torch

    proc = run_in_venv(
        [
            str(DRIVER),
            str(tmp_path),
            "--world",
            str(WORLD),
            "--ep",
            str(EP),
            "--pp",
            str(pp),
            "--experts",
            str(EXPERTS),
            "--layers",
            str(LAYERS),
        ],
        path=[REPO],
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run(tmp_path_factory.mktemp("a2a-verl091"), pp=1)


def _expert(name: str) -> int | None:
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def _check_tensors(ranks: list[dict]) -> None:
    import torch

    for r, res in enumerate(ranks):
        assert res["ep_rank"] == r and res["held"] == [
            2 * r,
            2 * r + 1,
        ]  # one replica: EP rank = trainer rank
        assert res["mbridge_class"] == "mbridge.models.qwen3moe.Qwen3MoEBridge"
        assert not res["mbridge_before_plugin"]  # registered by the import hook when verl loads mbridge
        want = {n: t for n, t in res["mbridge"].items() if _expert(n) is None or _expert(n) in res["held"]}
        assert sorted(res["on"]) == sorted(want) and res["dup_on"] == 0
        assert all(torch.equal(res["on"][n], t) for n, t in want.items())
        # the filter is not empty: mbridge exports every expert (gate / up / down), the rank gets its 2
        assert sum(_expert(n) is not None for n in res["mbridge"]) == LAYERS * EXPERTS * 3
        assert sum(_expert(n) is not None for n in res["on"]) == LAYERS * 2 * 3
        # positive control: switch off hands the rollout mbridge's own export, same order, same tensors
        assert list(res["off"]) == list(res["mbridge"]) and res["dup_off"] == 0
        assert all(torch.equal(res["off"][n], t) for n, t in res["mbridge"].items())


def test_switch_sends_each_rank_exactly_its_vllm_experts(ranks: list[dict]) -> None:
    _check_tensors(ranks)


def test_expert_bytes_drop_as_the_count_model_says(ranks: list[dict]) -> None:
    from qwen3_rl.tools.bench.moe_sync_verl091 import tiny_counts

    model = tiny_counts(EXPERTS, LAYERS, WORLD, EP)
    for res in ranks:
        off, on = res["counts_off"], res["counts_on"]
        ag = off["all_gather"]
        assert {k: ag[k] for k in model["mbridge"]} == model["mbridge"]  # upstream: the EP all-gathers
        assert "all_to_all_single" not in off and "all_gather" not in on  # no EP all-gather with the switch
        a2a = on["all_to_all_single"]
        assert (a2a["calls"], a2a["out_bytes"]) == (
            model["alltoallv"]["calls"],
            model["alltoallv"]["out_bytes"],
        )
        assert a2a["out_bytes"] * 4 == ag["out_bytes"]  # 2 of 8 experts per layer instead of 8
        # the rest of mbridge's export is untouched: same PP broadcasts
        for op in ("broadcast", "broadcast_object_list"):
            assert {k: v for k, v in on[op].items() if k != "seconds"} == {
                k: v for k, v in off[op].items() if k != "seconds"
            }
    # ranks 1, 2 get their experts from the other EP member, ranks 0, 3 hold theirs already
    peers = [res["counts_on"]["all_to_all_single"]["peer_bytes"] for res in ranks]
    assert peers[1] == peers[2] == model["alltoallv"]["peer_bytes"] > 0 == peers[0] == peers[3]


def test_refused_where_it_cannot_apply(ranks: list[dict]) -> None:
    """Switch on but a non-naive checkpoint engine, EPLB, no colocated rollout, vLLM EP off: one line naming the
    setting, raised at the export (before any collective); the switch-on sync above is the positive control."""
    names = {
        "nccl": "checkpoint_engine.backend=nccl",
        "eplb": "engine_kwargs.vllm.enable_eplb",
        "not_colocated": "no colocated rollout",
        "ep_off": "expert_parallel_size<=1",
    }
    for res in ranks:
        assert set(res["refused"]) == set(names)
        for case, key in names.items():
            msg = res["refused"][case]
            assert msg is not None and msg.startswith("qwen3_rl.moe_alltoallv refused: ") and key in msg, (
                case,
                msg,
            )
            assert "\n" not in msg


def test_pipeline_parallel_goes_through_mbridges_pp_broadcast(tmp_path: Path) -> None:
    """Megatron PP 2 (one layer per stage) x EP 2: every rank still gets both layers' experts of its vLLM EP rank."""
    _check_tensors(_run(tmp_path, pp=2))
