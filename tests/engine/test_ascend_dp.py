"""vLLM data parallelism over 2 processes on vLLM-Ascend's own engine (CPU stand-in for torch_npu), launched as
verl's sync rollout does (``external_launcher``, one engine per rank): dense DP 2 (with rollout rebalance), and MoE
DP 2 with expert parallelism (EP 2: each rank holds and routes to half the experts, vLLM-Ascend's all-gather MoE path
with an expert map). Each rank decodes its own share of the prompts; together they must equal HF transformers' greedy
output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ENGINE_TIMEOUT_S, HERE, gloo_port
from test_ascend_engine import PROMPTS, hf_greedy

pytestmark = pytest.mark.ascend
TOKENS = 24


def run_dp(ws: Path, model: Path, tmp_path: Path, ep: bool, **extra) -> list[dict]:
    spec = tmp_path / "dp-spec.json"
    spec.write_text(json.dumps({"workspace": str(ws), "model": str(model), "prompts": PROMPTS, "max_tokens": TOKENS,
                                "enable_expert_parallel": ep, **extra}))
    port = str(gloo_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(HERE / "ascend_dp_driver.py"), str(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=ENGINE_TIMEOUT_S)
        lines = [ln for ln in out.splitlines() if ln.startswith("ENGINE_RESULT ")]
        assert p.returncode == 0 and lines, "\n".join(out.splitlines()[-60:])
        results.append(json.loads(lines[-1][len("ENGINE_RESULT "):]))
    return results


# dense DP 2 (no EP) runs in test_rollout_rebalance_moves_a_running_request_between_the_dp_engines: the same two
# engines, its outputs equal to HF transformers' too (one pair of engine processes less)
@pytest.mark.parametrize("model,ep", [("moe", True)])
def test_dp2_on_vllm_ascend_equals_transformers(engine_ws: Path, tiny_models: dict[str, Path], tmp_path: Path,
                                                model: str, ep: bool) -> None:
    r0, r1 = run_dp(engine_ws, tiny_models[model], tmp_path, ep)
    print(f"{model} DP2 (EP {r0['ep']}): rank 0 {r0['npu_calls']}, routing ranges {r0['routing_ranges']} / "
          f"{r1['routing_ranges']}")
    assert (r0["dp"], r1["dp"]) == ([0, 2], [1, 2])
    assert r0["outputs"] + r1["outputs"] == hf_greedy(tiny_models[model], PROMPTS, TOKENS)
    if ep:  # EP 2 over 4 experts: each rank routes to its own 2 experts
        assert r0["ep"] == r1["ep"] == 2
        assert r0["routing_ranges"] == [[0, 2]] and r1["routing_ranges"] == [[2, 4]]
        _check_eplb_type4(r0["eplb"])


def _check_eplb_type4(e: dict) -> None:
    """vllm_ascend 0002 (seam): policy type 4 is ours; its placement of the load recorded by the two EP ranks' routing is a
    valid expert map (every expert once per layer, same shape) whose busiest rank carries no more than before."""
    print(f"EPLB type 4: workload {e['workload']} table {e['table']} -> changed {e['changed']}, {e['new_table']}")
    assert e["policy"] == "PackingAwareAscendPolicy"
    work, old, new = e["workload"], e["table"], e["new_table"]
    assert sum(map(sum, work[0])) > 0
    for layer in range(len(old)):
        assert sorted(x for rank in new[layer] for x in rank) == sorted(x for rank in old[layer] for x in rank)
        per_expert = {old[layer][r][s]: work[layer][r][s] for r in range(len(old[layer])) for s in range(len(old[layer][r]))}
        peak = max(sum(per_expert[x] for x in rank) for rank in new[layer])
        assert peak <= max(sum(rank) for rank in work[layer])


def test_rollout_rebalance_moves_a_running_request_between_the_dp_engines(engine_ws: Path, tiny_models: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """vllm 0003 (seam) + qwen3_rl.rollout (as verl 0013 configures it): rank 0 starts with 3 requests, rank 1 with 1; a
    rebalance round every 4 engine steps moves running requests (their KV blocks) to rank 1, which decodes them on
    and returns the results; every request's output equals HF transformers'."""
    rb = {"rollout_rebalance": True, "rollout_rebalance_interval_steps": 4, "rollout_rebalance_prefill_tokens_per_s": 0}
    r0, r1 = run_dp(engine_ws, tiny_models["dense"], tmp_path, False, rebalance=rb, rebalance_split=[[0, 1, 2], [3]])
    print(f"rebalance: rank 0 {r0['rebalance']}, rank 1 {r1['rebalance']}")
    assert (r0["dp"], r1["dp"]) == ([0, 2], [1, 2])
    assert r0["rebalance"]["sent"] and r0["rebalance"]["sent"] == r1["rebalance"]["received"]
    assert r0["rebalance"]["kv_out"] > 0 and sorted(r0["rebalance"]["delivered"]) == sorted(r0["rebalance"]["sent"])
    ref = hf_greedy(tiny_models["dense"], PROMPTS, TOKENS)
    assert r0["outputs"] == ref[:3] and r1["outputs"] == ref[3:]
