"""``python -m qwen3_rl.cpu_device.npu.run``: a user's plain vLLM script, unchanged, runs on vLLM-Ascend's engine on
CPU (the engine venv's installed vLLM, the patched vLLM-Ascend tree given with ``--path``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ENGINE_TIMEOUT_S
from test_ascend_engine import hf_greedy

pytestmark = pytest.mark.ascend

USER_SCRIPT = textwrap.dedent("""
    import sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, num_gpu_blocks_override=64)
    out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], SamplingParams(temperature=0.0, max_tokens=12))
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    print("USER_SCRIPT", type(worker).__name__, type(worker.model_runner).__name__, list(out[0].outputs[0].token_ids))
""")


def test_user_script_runs_unchanged_on_vllm_ascend(engine_ws: Path, tiny_models: dict[str, Path],
                                                    tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    # the patched vLLM tree first (the vLLM-Ascend seam calls vLLM's extension points), then vLLM-Ascend's
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl.cpu_device.npu.run", "--path", str(engine_ws / "vllm"),
                           "--path", str(engine_ws / "vllm-ascend"), str(script), str(tiny_models["dense"])],
                          capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("USER_SCRIPT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    worker, runner, *_ = lines[-1].split(" ", 3)[1:]
    assert (worker, runner) == ("NPUWorker", "NPUModelRunner")
    tokens = json.loads(lines[-1].split(" ", 3)[3])
    assert tokens == hf_greedy(tiny_models["dense"], [[5, 6, 7, 8]], 12)[0]
