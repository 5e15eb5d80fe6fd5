"""``python -m qwen3_rl.cpu_device.npu.run`` on the current set: a user's plain vLLM script, unchanged, runs on
vLLM-Ascend 0.23.0.post1's own engine on CPU (this venv's vLLM 0.23.0, the patched vLLM-Ascend tree given with
``--path``), as ``tests/engine/test_ascend_run_wrapper.py`` shows it on the seed set. The wrapper reads vLLM's
release and adds the 0.23 device-kernel shim itself; the script's greedy tokens equal vLLM 0.23's own CPU engine's
(``conftest``'s ``shipped_engine``, the same prompt and length, no shim).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_current_ascend_engine import A2_BUILD_INFO, PROMPTS, TOKENS, patched_ascend_tree

from conftest import ENGINE_TIMEOUT_S, REPO

USER_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, num_gpu_blocks_override=64,
              gpu_memory_utilization=0.5)
    prompt = json.loads(sys.argv[2])
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True))
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    print("USER_SCRIPT", type(worker).__name__, type(worker.model_runner).__name__, list(out[0].outputs[0].token_ids))
""")


def test_user_script_runs_unchanged_on_vllm_ascend_023(
    tiny_models: dict[str, Path], shipped_engine: dict[str, dict], tmp_path: Path
) -> None:
    tree = patched_ascend_tree(tmp_path / "ws")
    assert (tree / "vllm_ascend" / "_build_info.py").read_text() == A2_BUILD_INFO
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_TARGET_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-m", "qwen3_rl.cpu_device.npu.run", "--path", str(tree), str(script),
         str(tiny_models["dense"]), json.dumps(PROMPTS[0]), str(TOKENS)],
        capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, env=env, cwd=tmp_path,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("USER_SCRIPT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    worker, runner, tokens = lines[-1].split(" ", 3)[1:]
    assert (worker, runner) == ("NPUWorker", "NPUModelRunner")
    assert json.loads(tokens) == shipped_engine["dense"]["outputs"][0]
    assert len(json.loads(tokens)) == TOKENS


def test_wrapper_refuses_a_vllm_of_neither_pin_set(tmp_path: Path) -> None:
    """One line, before anything is imported, when the importable vLLM is neither 0.13 nor 0.23 (a stand-in package
    holding only ``_version.py`` first on the path); control: this venv's vLLM 0.23 is read as (0, 23)."""
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "_version.py").write_text("__version__ = version = '0.19.1'\n")
    (tmp_path / "site" / "vllm_ascend").mkdir()
    (tmp_path / "site" / "vllm_ascend" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl.cpu_device.npu.run", str(tmp_path / "none.py")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == "error: vLLM 0.19 is neither pin set's (0.13 seed, 0.23 current)"
    from qwen3_rl.cpu_device.npu.run import vllm_release

    assert vllm_release() == (0, 23)


pytestmark = pytest.mark.current
