"""Run vLLM-Ascend 0.23.0.post1's own engine (``NPUWorker`` -> ``NPUModelRunner``, Ascend attention, norms, rotary and
fused MoE) on vLLM 0.23.0 over the recipe's CPU stand-in for torch_npu, in this process; print one JSON line.

    python tests/engine_current/ascend_driver.py SPEC.json

SPEC: {"tree": the vLLM-Ascend 0.23 source tree (pristine or patched), "model": DIR, "prompts": [[token ids], ...],
       "runs": [{"name": str, "model": optional DIR (default SPEC's), "llm": {LLM kwargs},
                 "sampling": {SamplingParams kwargs}}, ...]}
Each result: {"name", "outputs": [[token ids] per prompt], "platform": vLLM's current platform class,
"runner": the worker's model-runner class, "attn_backends": the attention layers' implementation classes,
"npu_calls": the stand-in kernels called so far ({name: calls}), "metrics": vLLM's spec-decode counters
(``LLM.get_metrics()``), "drafter": the runner's drafter class}.

Every run: float32, eager (NPU graphs need the device runtime), vLLM-Ascend's custom ops (its default), the
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), 64 KV blocks.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

from engine_driver import counters  # this folder's vLLM-CPU driver (the script's folder is on sys.path)


def runner_of(llm):  # noqa: ANN001, ANN201
    """The in-process engine's model runner (uniproc executor)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    # vLLM-Ascend's platform plugin and ours, whatever the caller's environment says (the tests' conftest selects
    # "qwen3_rl" alone and the CPU target device for vLLM's own CPU engine)
    os.environ["VLLM_PLUGINS"] = "ascend,qwen3_rl"
    os.environ.pop("VLLM_TARGET_DEVICE", None)
    from qwen3_rl.cpu_device.npu import run as ascend_run
    from qwen3_rl.cpu_device.npu import stand_in

    ascend_run.prepare([spec["tree"]])
    from qwen3_rl.cpu_device import vllm023_shims

    vllm023_shims.install_ascend()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    results = []
    for run in spec["runs"]:
        kwargs = dict(
            model=run.get("model", spec["model"]),
            dtype="float32",
            enforce_eager=True,
            seed=0,
            max_model_len=512,
            gpu_memory_utilization=0.5,
            num_gpu_blocks_override=64,
            disable_log_stats=False,
        )
        kwargs.update(run.get("llm", {}))
        llm = LLM(**kwargs)
        base = {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True, **run.get("sampling", {})}
        res = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]],
            [SamplingParams(**base) for _ in spec["prompts"]],
            use_tqdm=False,
        )
        runner = runner_of(llm)
        layers = runner.vllm_config.compilation_config.static_forward_context.values()
        results.append(
            {
                "name": run["name"],
                "outputs": [list(o.outputs[0].token_ids) for o in res],
                "platform": type(current_platform).__name__,
                "runner": f"{type(runner).__module__}.{type(runner).__name__}",
                "attn_backends": sorted(
                    {
                        type(getattr(m, "impl", None)).__name__
                        for m in layers
                        if getattr(m, "impl", None) is not None
                    }
                ),
                "npu_calls": dict(stand_in.CALLS),
                "metrics": counters(llm),
                "drafter": type(getattr(runner, "drafter", None)).__name__,
            }
        )
        del llm
        gc.collect()
    print("ENGINE_RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
