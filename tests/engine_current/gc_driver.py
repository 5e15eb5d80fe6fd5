"""Run vLLM 0.23.0's real CPU engine with the recipe's gc scheduler / worker classes (probed, ``gc_probe.py``) three
times and print one JSON line (``GC_RESULT {...}``) with the gc traces of every process.

    python tests/engine_current/gc_driver.py MODEL_DIR TRACE_DIR

1. ``core_on``: ``LLM`` with vLLM's engine core process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``; vLLM-CPU then runs
   the model in a worker process of the multiprocess executor), ``additional_config`` switching gc control on.
2. ``core_off``: the same without the switch (positive control).
3. ``inproc``: the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the switch on in ``additional_config``
   for the first ``generate``, then off for the second (``set_decode_gc_disabled(False)``, as verl's rollout does
   after the engine is built) on the same engine; its worker is the plain ``GcStepCPUWorker`` (nested in the
   scheduler's bracket).

The two engine-core runs come first: the in-process engine core caches vLLM's environment (``enable_envs_cache``,
``core.py:233``) in this process. Every run: float32, eager, native PyTorch ops, 256 KV blocks, greedy, 8 requests
of 48 tokens each.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]] * 2
TOKENS = 48
ON = {"qwen3_rl": {"disable_gc": True}}
#: gc_probe.TRACE_DIR_ENV (gc_probe imports vLLM: imported in the run only)
TRACE_ENV = "QWEN3_RL_GC_TRACE_DIR"


def engine_kwargs(model: str) -> dict:
    return dict(
        model=model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        compilation_config={"custom_ops": ["none"]},
        max_model_len=256,
        gpu_memory_utilization=0.2,  # the share of RAM vLLM-CPU 0.23 needs free to start (engine_driver.py)
        num_gpu_blocks_override=256,
        scheduler_cls="gc_probe.ProbeScheduler",
    )


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    res = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in PROMPTS], [params] * len(PROMPTS), use_tqdm=False
    )
    return [list(r.outputs[0].token_ids) for r in res]


def read_traces(folder: Path) -> dict[str, dict]:
    """The trace files of a run's child processes, by role (one process per role)."""
    out = {}
    for f in sorted(folder.glob("*.json")):
        t = json.loads(f.read_text())
        assert t["role"] not in out, f"two {t['role']} processes in {folder}"
        out[t["role"]] = t
    return out


def core_run(model: str, trace_root: Path, name: str, extra: dict | None) -> dict:
    from vllm import LLM

    folder = trace_root / name
    folder.mkdir(parents=True)
    os.environ[TRACE_ENV] = str(folder)
    t0 = time.perf_counter()
    kwargs = engine_kwargs(model) | {"worker_cls": "gc_probe.ProbeWorker"}
    if extra is not None:
        kwargs["additional_config"] = extra
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core
    outputs = generate(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {
        "name": name,
        "client": type(core).__name__,
        "front_pid": os.getpid(),
        "outputs": outputs,
        "traces": read_traces(folder),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def inproc_run(model: str) -> dict:
    import gc_probe
    from vllm import LLM

    from qwen3_rl.rollout import gc_control

    os.environ.pop(TRACE_ENV, None)
    t0 = time.perf_counter()
    llm = LLM(
        **engine_kwargs(model), worker_cls="qwen3_rl.rollout.gc_worker.GcStepCPUWorker", additional_config=ON
    )
    core = llm.llm_engine.engine_core
    trace = gc_probe.TRACES["scheduler"]
    phases = {"policy_after_build": gc_control.decode_gc_disabled()}
    for phase, policy in (("on", True), ("off", False)):
        gc_control.set_decode_gc_disabled(policy)
        trace.reset()
        outputs = generate(llm)
        phases[phase] = {"outputs": outputs, "trace": trace.snapshot()}
    worker = core.engine_core.model_executor.driver_worker.worker
    return {
        "name": "inproc",
        "client": type(core).__name__,
        "worker": type(worker).__name__,
        "phases": phases,
        "gc_enabled_after": gc.isenabled(),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main() -> int:
    model, trace_root = sys.argv[1], Path(sys.argv[2])
    sys.path.insert(0, str(HERE))  # gc_probe for scheduler_cls / worker_cls, here and in the child processes
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    results = []
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    results.append(core_run(model, trace_root, "core_on", ON))
    results.append(core_run(model, trace_root, "core_off", None))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    results.append(inproc_run(model))
    print("GC_RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
