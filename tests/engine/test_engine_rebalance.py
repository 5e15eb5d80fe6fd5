"""Rollout rebalance in the real vLLM 0.13.0 engine (CPU build, patched tree): 2 DP ranks under the external
launcher, one process each (``rebalance_driver.py``), as verl's SPMD rollout runs them.

Rank 0 gets 4 long requests, rank 1 two short ones; once rank 1 is done, the planner moves running requests
with their KV blocks from rank 0 to rank 1 over the DP group's device group (gloo on vLLM's CPU platform;
HCCL on an A3). Greedy output must equal the run without rebalance token for token; with the moved KV
zeroed on arrival (negative control) it must not. Shim (device layer): vLLM's CPU platform would turn the
external launcher into ``mp`` (``keep_external_launcher_on_cpu`` in the driver); OpenMP threads unbound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ENGINE_TIMEOUT_S, gloo_port

HERE = Path(__file__).resolve().parent
PROMPTS = {"0": [[(11 * i + k) % 200 + 10 for k in range(6 + 2 * i)] for i in range(4)],
           "1": [[(7 * i + k) % 200 + 10 for k in range(5)] for i in range(2)]}
MAX_TOKENS = {"0": [60 + 10 * i for i in range(4)], "1": [6, 8]}


def _run_pair(spec: dict, tmp_path: Path, name: str) -> list[dict]:
    f = tmp_path / f"{name}.json"
    f.write_text(json.dumps(spec))
    port = gloo_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "rebalance_driver.py"), str(f)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=ENGINE_TIMEOUT_S)
            lines = [ln for ln in text.splitlines() if ln.startswith("ENGINE_RESULT ")]
            assert p.returncode == 0 and lines, f"{name}: rank failed (rc {p.returncode}):\n" + "\n".join(
                text.splitlines()[-40:])
            out.append(json.loads(lines[-1][len("ENGINE_RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(out, key=lambda r: r["rank"])


def test_running_requests_move_with_their_kv_over_the_device_group_losslessly(engine_ws: Path, tiny_models,
                                                                              tmp_path: Path) -> None:
    base = {"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": PROMPTS,
            "max_tokens": MAX_TOKENS, "interval": 4, "max_num_seqs": 4}
    off = _run_pair({**base, "rebalance": False}, tmp_path, "off")
    on = _run_pair({**base, "rebalance": True, "kv_path": "device"}, tmp_path, "on")
    bad = _run_pair({**base, "rebalance": True, "kv_path": "device", "corrupt_kv": True}, tmp_path, "control")
    for r in on:
        assert (r["kv_path"], r["backend"]) == ("device", "gloo") and r["link_gb_s"] > 0  # measured, round 1
    moves = [tuple(m) for rep in on[0]["reports"] for m in rep["moves"]]
    assert moves == [tuple(m) for rep in on[1]["reports"] for m in rep["moves"]]  # same plan on both ranks
    kv_moves = [m for m in moves if m[3] == 2 and m[4] > 0 and not m[5]]
    assert kv_moves and all(m[1:3] == (0, 1) for m in kv_moves), moves  # running requests moved with KV
    sent = sum(rep["kv_bytes_sent"] for rep in on[0]["reports"])
    assert sent > 0 and sent == sum(rep["kv_bytes_received"] for rep in on[1]["reports"])
    for rank in range(2):
        assert on[rank]["outputs"] == off[rank]["outputs"], rank  # greedy: token for token
        assert [len(o) for o in on[rank]["outputs"]] == MAX_TOKENS[str(rank)]
    # negative control: the same moves with the KV zeroed on arrival change what rank 0's requests produce
    assert [tuple(m) for rep in bad[0]["reports"] for m in rep["moves"]] == moves
    assert bad[0]["outputs"] != off[0]["outputs"]
    print("moves", moves, "KV bytes", sent, "link GB/s", on[0]["link_gb_s"])
