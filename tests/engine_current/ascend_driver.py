"""Run vLLM-Ascend 0.23.0.post1's own engine (``NPUWorker`` -> ``NPUModelRunner``, Ascend attention, norms, rotary and
fused MoE) on vLLM 0.23.0 over the recipe's CPU stand-in for torch_npu, in this process; print one JSON line.

    python tests/engine_current/ascend_driver.py SPEC.json

SPEC: {"tree": the vLLM-Ascend 0.23 source tree (pristine or patched), "model": DIR, "prompts": [[token ids], ...],
       "runs": [{"name": str, "model": optional DIR (default SPEC's), "llm": {LLM kwargs},
                 "sampling": {SamplingParams kwargs},
                 "phases": optional [{"name": str, "prompts": [[token ids], ...], "waves": [[prompt indices], ...],
                                      "rpc": optional [worker method, argument]}, ...]}, ...]}
Each result: {"name", "outputs": [[token ids] per prompt], "platform": vLLM's current platform class,
"runner": the worker's model-runner class, "attn_backends": the attention layers' implementation classes,
"npu_calls": the stand-in kernels called so far ({name: calls}), "metrics": vLLM's spec-decode counters
(``LLM.get_metrics()``), "drafter": the runner's drafter class}. A run with phases gives one result per phase, named
"<run>:<phase>", in the same engine: the worker RPC first (``LLM.collective_rpc``; its return value is "rpc"), then one
``generate`` per wave; "outputs" in the phase's prompt order, "metrics" counted over the phase alone,
"sam": our SAM drafter's group mode and k (absent for other drafters).

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
        phases = run.get("phases") or [{"name": None, "prompts": spec["prompts"]}]
        for phase in phases:
            prompts = phase["prompts"]
            rpc = llm.collective_rpc(phase["rpc"][0], args=(phase["rpc"][1],)) if phase.get("rpc") else None
            before = counters(llm)
            outs: dict[int, list[int]] = {}
            for wave in phase.get("waves") or [list(range(len(prompts)))]:
                res = llm.generate(
                    [TokensPrompt(prompt_token_ids=prompts[i]) for i in wave],
                    [SamplingParams(**base) for _ in wave],
                    use_tqdm=False,
                )
                outs.update({i: list(o.outputs[0].token_ids) for i, o in zip(wave, res, strict=True)})
            after = counters(llm)
            name = run["name"] if phase["name"] is None else f"{run['name']}:{phase['name']}"
            results.append(
                result(
                    llm,
                    name,
                    [outs[i] for i in sorted(outs)],
                    stand_in.CALLS,
                    {k: v - before.get(k, 0.0) for k, v in after.items()},
                    rpc,
                )
            )
        del llm
        gc.collect()
    print("ENGINE_RESULT " + json.dumps(results))
    return 0


def result(llm, name: str, outputs: list[list[int]], calls: dict, metrics: dict, rpc: object) -> dict:  # noqa: ANN001
    """One result entry (see the module docstring)."""
    from vllm.platforms import current_platform

    runner = runner_of(llm)
    layers = runner.vllm_config.compilation_config.static_forward_context.values()
    drafter = getattr(runner, "drafter", None)
    sam = getattr(drafter, "sam", None)
    out = {
        "name": name,
        "outputs": outputs,
        "platform": type(current_platform).__name__,
        "runner": f"{type(runner).__module__}.{type(runner).__name__}",
        "attn_backends": sorted(
            {type(getattr(m, "impl", None)).__name__ for m in layers if getattr(m, "impl", None) is not None}
        ),
        "npu_calls": dict(calls),
        "metrics": metrics,
        "drafter": type(drafter).__name__,
        "rpc": rpc,
    }
    if sam is not None:
        out["sam"] = {"group_mode": bool(sam.config.group_mode), "k": int(sam.k)}
    return out


if __name__ == "__main__":
    sys.exit(main())
