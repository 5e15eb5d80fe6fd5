"""The vLLM seam's engine-step hooks in the engine core process that ``AsyncLLM`` drives (verl's servers), and
vLLM DP-rank routing in a real DP engine: vLLM 0.13.0's ``AsyncLLM`` on the CPU build with the patch series, its
engine cores in their own processes (``core_loop_driver.py``; what the cores saw is recorded by a probe in their
worker, in the core process).

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
def gc_runs(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("core-gc")
    (tmp / "probe").mkdir()
    spec = {"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": PROMPTS,
            "probe_dir": str(tmp / "probe"), "runs": [
                {"name": "off", "max_tokens": 8},
                {"name": "on", "max_tokens": 8,
                 "engine": {"additional_config": {"qwen3_rl": {"disable_gc": True}}}},
            ]}
    return run_engine(spec, tmp, env=core_env(engine_ws), driver="core_loop_driver.py")


def test_gc_guard_runs_in_the_engine_core_process(gc_runs: dict) -> None:
    # gc_guard (order 10) is built by EngineCoreProc and takes its policy from additional_config.qwen3_rl there:
    # with it, the collector is off in every model step of the core process and on again between steps; without
    # it (positive control), on in every step. The steps ran in the core process, not the driver's.
    off, on = gc_runs["off"], gc_runs["on"]
    for r in (off, on):
        assert len(r["steps"]) >= 8
        assert {s["pid"] for s in r["steps"]} and r["driver_pid"] not in {s["pid"] for s in r["steps"]}
    assert all(s["gc_enabled"] for s in off["steps"])
    assert not any(s["gc_enabled"] for s in on["steps"])
    (pid, enabled), = on["gc_between_steps"]
    assert pid == on["steps"][0]["pid"] and enabled is True
    assert on["outputs"] == off["outputs"] and all(len(o) == 8 for o in on["outputs"])


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
                {"name": "dp1", "max_tokens": 8},
                {"name": "routed", "max_tokens": 8, "dp_ranks": ranks, "engine": {"data_parallel_size": 2}},
                {"name": "flipped", "max_tokens": 8, "dp_ranks": [1 - r for r in ranks],
                 "engine": {"data_parallel_size": 2}},
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
