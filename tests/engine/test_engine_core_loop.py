"""The vLLM seam's engine-step hooks in the engine core process that ``AsyncLLM`` drives (verl's servers),
vLLM DP-rank routing in a real DP engine, and rollout rebalance between the DP engine cores of one server: vLLM
0.13.0's ``AsyncLLM`` on the CPU build with the patch series, its engine cores in their own processes
(``core_loop_driver.py``; what the cores saw is recorded by a probe in their worker, in the core process).

vLLM's CPU worker binds OpenMP threads per NUMA node by default and refuses two DP engines on this kind of host
(``cpu_worker.py`` ``_get_autobind_cpu_ids``: "VLLM_CPU_NUM_OF_RESERVED_CPU (1) should less than 0"); the tests
run with ``VLLM_CPU_OMP_THREADS_BIND=nobind``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_engine

pytestmark = pytest.mark.server

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [16, 17, 18]]


def core_env(ws: Path) -> dict[str, str]:
    import workspace

    return {**workspace.run_env(ws), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def engine_of(steps: list[dict]) -> dict[str, set[int]]:
    """Request id -> the DP ranks whose engine core scheduled it (from the cores' own records)."""
    out: dict[str, set[int]] = {}
    for s in steps:
        for rid in s["req_ids"]:
            out.setdefault(rid, set()).add(s["dp_rank"])
    return out


@pytest.fixture(scope="module")
def dp_runs(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    from qwen3_rl.rollout.server_routing import GroupRouter

    tmp = tmp_path_factory.mktemp("core-dp")
    (tmp / "probe").mkdir()
    # 4 prompts x 2 samples, routed as verl's servers route them (one server, vLLM DP 2): siblings carry one rank
    prompts = [p for p in PROMPTS for _ in range(2)]
    router = GroupRouter(1, dp=2)
    ranks = [router.choose(f"req-{i}", p) % 2 for i, p in enumerate(prompts)]
    spec = {"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": prompts,
            "probe_dir": str(tmp / "probe"), "runs": [
                {"name": "dp1", "max_tokens": 8,  # and the gc policy on (test_gc_guard_runs_in_the_engine_core_process)
                 "engine": {"additional_config": {"qwen3_rl": {"disable_gc": True}}}},
                {"name": "routed", "max_tokens": 8, "dp_ranks": ranks, "engine": {"data_parallel_size": 2}},
                # on the routed run's engine (one DP 2 engine start less): the same two engine cores, ranks flipped
                {"name": "flipped", "max_tokens": 8, "dp_ranks": [1 - r for r in ranks],
                 "engine": {"data_parallel_size": 2}, "same_engine": True},
            ]}
    result = run_engine(spec, tmp, env=core_env(engine_ws), driver="core_loop_driver.py")
    result["ranks"] = ranks
    return result


def test_data_parallel_rank_lands_on_that_engine_core(dp_runs: dict) -> None:
    # AsyncLLM with data_parallel_size=2 on the CPU engine: two DP engine core processes; each request ran only on
    # the engine core of the rank it carried (generate(data_parallel_rank=...)), read from the cores' scheduled
    # requests; a prompt's two samples on one engine; flipping the ranks moves every request (the rank decides,
    # not vLLM's balancer); greedy outputs equal one engine's.
    ranks = dp_runs["ranks"]
    assert set(ranks) == {0, 1}
    for name, want in (("routed", ranks), ("flipped", [1 - r for r in ranks])):
        r = dp_runs[name]
        assert len({s["pid"] for s in r["steps"]}) == 2 and {s["dp_rank"] for s in r["steps"]} == {0, 1}
        seen = engine_of(r["steps"])
        assert seen == {f"req-{i}": {want[i]} for i in range(len(want))}
        for i in range(0, len(want), 2):  # siblings
            assert seen[f"req-{i}"] == seen[f"req-{i + 1}"]
        assert r["outputs"] == dp_runs["dp1"]["outputs"]


def test_gc_guard_runs_in_the_engine_core_process(dp_runs: dict) -> None:
    # gc_guard (order 10) is built by EngineCoreProc and takes its policy from additional_config.qwen3_rl there:
    # with it ("dp1": one engine core), the collector is off in every model step of the core process and on again
    # between steps; without it (positive control: the DP 2 runs' two engine cores), on in every step. The steps
    # ran in the core processes, not the driver's; the outputs are the same.
    on = dp_runs["dp1"]
    for r in (on, dp_runs["routed"], dp_runs["flipped"]):
        assert len(r["steps"]) >= 8
        assert {s["pid"] for s in r["steps"]} and r["driver_pid"] not in {s["pid"] for s in r["steps"]}
        assert r["outputs"] == on["outputs"]
    assert all(s["gc_enabled"] for name in ("routed", "flipped") for s in dp_runs[name]["steps"])
    assert not any(s["gc_enabled"] for s in on["steps"])
    (pid, enabled), = on["gc_between_steps"]
    assert pid == on["steps"][0]["pid"] and enabled is True
    assert all(len(o) == 8 for o in on["outputs"])


REBALANCE_PROMPTS = [[(11 * i + k) % 200 + 10 for k in range(6 + 2 * i)] for i in range(4)] + [
    [(7 * i + k) % 200 + 10 for k in range(5)] for i in range(2)]
REBALANCE_RANKS = [0, 0, 0, 0, 1, 1]
REBALANCE_TOKENS = [60 + 10 * i for i in range(4)] + [6, 8]


@pytest.fixture(scope="module")
def rebalance_runs(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("core-rebalance")
    (tmp / "probe").mkdir()
    engine = {"data_parallel_size": 2, "max_num_seqs": 4}
    on = {**engine, "additional_config": {"qwen3_rl": {"rollout_rebalance": {
        "enable": True, "interval_steps": 4, "timeout_s": 120.0,
        "prefill_tokens_per_s": 0.0, "max_round_s": 0.0}}}}  # always with KV, whatever the loaded link measures
    base = {"max_tokens": REBALANCE_TOKENS, "dp_ranks": REBALANCE_RANKS}
    spec = {"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": REBALANCE_PROMPTS,
            "probe_dir": str(tmp / "probe"), "runs": [
                {"name": "off", **base, "engine": engine},
                {"name": "on", **base, "engine": on},
                {"name": "control", **base, "engine": on, "corrupt_kv": True},
                # the model in worker processes behind the engine cores: verl's layout, below
                # (test_rollout_rebalance_through_verls_zeromq_executor_and_hybrid_workers)
            ]}
    return run_engine(spec, tmp, env=core_env(engine_ws), driver="core_loop_driver.py")


def test_rollout_rebalance_moves_running_requests_between_a_servers_dp_engine_cores(rebalance_runs: dict) -> None:
    # rollout_rebalance (order 30) in DPEngineCoreProc's loop: rank 0's engine core gets 4 long requests, rank 1's
    # two short ones; once rank 1 is done, running requests move with their KV blocks from rank 0 to rank 1 (over
    # the vLLM DP group's device group: gloo on the CPU platform), run there (the engine cores' own records), and
    # their results return as rank 0's EngineCoreOutputs to AsyncLLM's front end: greedy outputs equal the run
    # without rebalance token for token. Negative control: the same moves with the KV zeroed on arrival change them.
    off, on, bad = rebalance_runs["off"], rebalance_runs["on"], rebalance_runs["control"]
    assert engine_of(off["steps"]) == {f"req-{i}": {r} for i, r in enumerate(REBALANCE_RANKS)}
    rounds = {r: [x for x in on["rounds"] if x["dp_rank"] == r] for r in (0, 1)}
    # one plan: each round both ranks record the same moves; a last empty round may be missing on one rank (its
    # record cut by the engine's shutdown, seen once in CI), never a round with moves
    plans = [{x["round"]: x["moves"] for x in rounds[r]} for r in (0, 1)]
    assert rounds[0] and all(plans[0][k] == plans[1][k] for k in plans[0].keys() & plans[1].keys()), plans
    assert not [m for k in plans[0].keys() ^ plans[1].keys() for m in (plans[0] | plans[1])[k]], plans
    moves = [tuple(m) for x in rounds[0] for m in x["moves"]]
    kv_moves = [m for m in moves if m[3] == 2 and m[4] > 0 and not m[5]]
    assert kv_moves and all(m[1:3] == (0, 1) for m in kv_moves), moves
    sent = sum(x["kv_bytes_sent"] for x in rounds[0])
    assert sent > 0 and sent == sum(x["kv_bytes_received"] for x in rounds[1])
    assert all(x["kv_path"] == "device" for x in on["rounds"]) and rounds[0][0]["link_gb_s"] > 0
    # the moved requests ran on rank 1's engine core under their global id, and came home to rank 0's front end
    seen = engine_of(on["steps"])
    for req_id, *_ in kv_moves:
        assert req_id.startswith("r0|req-") and seen[req_id] == {1}, (req_id, seen)
    delivered = {d for x in rounds[0] for d in x["delivered"]}
    assert {m[0] for m in kv_moves} <= delivered
    assert on["outputs"] == off["outputs"]
    assert [len(o) for o in on["outputs"]] == REBALANCE_TOKENS
    assert [tuple(m) for x in bad["rounds"] if x["dp_rank"] == 0 for m in x["moves"]] == moves
    assert bad["outputs"] != off["outputs"]
    print("moves", moves, "KV bytes", sent, "link GB/s", rounds[0][0]["link_gb_s"])


@pytest.fixture(scope="module")
def worker_rebalance_runs(engine_ws: Path, tiny_models: dict[str, Path],
                          tmp_path_factory: pytest.TempPathFactory) -> dict:
    from qwen3_rl.trainer.seam import ServerHooks

    tmp = tmp_path_factory.mktemp("worker-rebalance")
    (tmp / "probe").mkdir()
    # the engine cores' additional_config as the verl seam's server_args makes it from the rollout config's group
    group = {"rollout_rebalance": {"enable": True, "interval_steps": 4, "timeout_s": 120.0,
                                   "prefill_tokens_per_s": 0.0, "max_round_s": 0.0},  # always with KV
             "server_auth": {"enable": False}}
    extra = ServerHooks.from_rollout_config({"qwen3_rl": group}).server_args({})["additional_config"]
    base = {"dp": 2, "expert_parallel": True, "max_tokens": REBALANCE_TOKENS, "dp_ranks": REBALANCE_RANKS}
    on = {"max_num_seqs": 4, "additional_config": extra}
    core_gc = {"additional_config": {"qwen3_rl": {"disable_gc": True}}}
    spec = {"workspace": str(engine_ws), "model": str(tiny_models["moe"]), "prompts": REBALANCE_PROMPTS,
            "probe_dir": str(tmp / "probe"), "runs": [
                # dp1 and off also carry the gc test (test_gc_control_in_verl_hybrid_worker_behind_the_zeromq_executor):
                # the engine cores' gc policy in both, the rollout config's (the workers') on in dp1 only
                {"name": "dp1", "dp": 1, "max_tokens": REBALANCE_TOKENS, "engine": {"max_num_seqs": 4, **core_gc},
                 "qwen3_rl": {"disable_gc": {"enable": True}}},
                {"name": "off", **base, "engine": {"max_num_seqs": 4, **core_gc},
                 "qwen3_rl": {"disable_gc": {"enable": False}}},
                {"name": "on", **base, "engine": on, "qwen3_rl": group},
                {"name": "control", **base, "engine": on, "qwen3_rl": group, "corrupt_kv": True},
            ]}
    return run_engine(spec, tmp, env=core_env(engine_ws), driver="server_worker_driver.py")


def test_rollout_rebalance_through_verls_zeromq_executor_and_hybrid_workers(worker_rebalance_runs: dict) -> None:
    # verl's server layout for a MoE with vLLM DP 2 x EP 2 (the tiny Qwen3-MoE): two DP engine cores, each driving
    # its own verl rollout worker (vLLMAsyncRollout, a process of its own) through verl's
    # ExternalZeroMQDistributedExecutor; the settings come from the verl seam's server_args. Expert parallel on the
    # CPU engine (shims.py EP_DISPATCH_COMBINE, MOE_EXPERT_MAP) gives the outputs of one engine without EP. The
    # rebalance hook's worker calls (collective_rpc of pickled functions) reach the workers through verl's executor,
    # and the workers move the KV over their vLLM DP group: running requests of rank 0 ran in rank 1's worker (its
    # records), outputs equal the run without rebalance, and zeroing the moved KV on arrival changes them.
    dp1, off, on, bad = (worker_rebalance_runs[k] for k in ("dp1", "off", "on", "control"))
    assert off["outputs"] == dp1["outputs"]
    assert {s["pid"] for s in on["steps"]} == set(on["worker_pids"]) and len(on["worker_pids"]) == 2
    assert engine_of(off["steps"]) == {f"req-{i}": {r} for i, r in enumerate(REBALANCE_RANKS)}
    seen = engine_of(on["steps"])
    moved = sorted(r for r in seen if r.startswith("r0|req-"))
    assert moved and all(seen[r] == {1} for r in moved), seen
    assert on["outputs"] == off["outputs"] and [len(o) for o in on["outputs"]] == REBALANCE_TOKENS
    assert sorted(r for r in engine_of(bad["steps"]) if r.startswith("r0|req-")) == moved
    assert bad["outputs"] != off["outputs"]
    print("moved through verl's executor", moved)


def test_gc_control_in_verl_hybrid_worker_behind_the_zeromq_executor(worker_rebalance_runs: dict) -> None:
    # verl's server layout: the engine core drives the model in verl's rollout worker (vLLMAsyncRollout, its own
    # process) through verl's ExternalZeroMQDistributedExecutor. The engine core's policy (additional_config) does
    # not reach that process (positive control "off": gc on in every model step of both workers); with the
    # rollout config's qwen3_rl.disable_gc on ("dp1"), the verl seam's worker_call switches the collector off in
    # every model step of the worker, and it is on again between steps; same outputs.
    on, core_only = worker_rebalance_runs["dp1"], worker_rebalance_runs["off"]
    for r in (core_only, on):
        assert len(r["steps"]) >= 8
        assert {s["pid"] for s in r["steps"]} == set(r["worker_pids"]) and r["driver_pid"] not in r["worker_pids"]
    assert all(s["gc_enabled"] for s in core_only["steps"])
    assert not any(s["gc_enabled"] for s in on["steps"])
    (pid, enabled), = on["gc_between_steps"]
    assert [pid] == on["worker_pids"] and enabled is True
    assert on["outputs"] == core_only["outputs"] and [len(o) for o in on["outputs"]] == REBALANCE_TOKENS

