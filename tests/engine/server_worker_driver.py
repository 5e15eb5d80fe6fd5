"""Run vLLM 0.13.0's ``AsyncLLM`` (CPU build, patched trees) the way verl 0.6.1's server does in hybrid mode: the
engine core(s) in their own processes drive the model through verl's ``ExternalZeroMQDistributedExecutor``, which
calls verl's rollout worker ``vLLMAsyncRollout`` (one per vLLM DP rank, each in its own worker process, as verl's
hybrid workers) over ZeroMQ. Print one JSON line.

    python tests/engine/server_worker_driver.py SPEC.json
    python tests/engine/server_worker_driver.py --worker SPEC.json RUN_INDEX   (a worker process; started by the driver)

SPEC: {"workspace": DIR, "model": DIR, "prompts": [[token ids], ...], "probe_dir": DIR, "runs": [RUN, ...]}
RUN:  {"name": str, "dp": int (vLLM DP ranks = worker processes), "expert_parallel": bool (verl's server sets it
       with DP > 1; vLLM 0.13 refuses it for a dense model; on the CPU engine it needs shims.py's EP shims),
       "qwen3_rl": the rollout config's ``qwen3_rl`` group in the workers, "engine": {AsyncEngineArgs kwargs},
       "max_tokens": int or [int per prompt], "dp_ranks": optional [DP rank per prompt],
       "corrupt_kv": optional bool}

What the workers saw is recorded by ``core_loop_driver.CoreProbe`` (vLLM's ``worker_extension_cls``: each
``execute_model`` call's pid, DP rank, ``gc.isenabled()`` and request ids, and each rebalance round). Each result:
{"name", "driver_pid", "worker_pids", "outputs", "steps", "rounds", "gc_between_steps"}.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent / "helpers"))  # ports: outside the ephemeral range

from core_loop_driver import collect, drive  # noqa: E402
from ports import free_port  # noqa: E402

import workspace  # noqa: E402


def _rollout_config(spec: dict, run: dict):  # noqa: ANN202
    from verl.workers.config import RolloutConfig

    dp = int(run.get("dp", 1))
    return RolloutConfig(name="vllm", mode="async", tensor_model_parallel_size=1, data_parallel_size=dp,
                         expert_parallel_size=dp, free_cache_engine=False, prompt_length=64, response_length=64,
                         **({"qwen3_rl": run["qwen3_rl"]} if run.get("qwen3_rl") else {}))


def worker_main(spec: dict, run: dict) -> None:
    """One hybrid rollout worker: verl's ``vLLMAsyncRollout`` serving its ZeroMQ socket until killed."""
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMAsyncRollout

    async def serve() -> None:
        rollout = vLLMAsyncRollout(_rollout_config(spec, run), HFModelConfig(path=spec["model"]), None)
        print("WORKER_ADDRESS " + rollout.address, flush=True)
        await rollout.zmq_loop_task

    asyncio.run(serve())


async def run_one(spec: dict, index: int, run: dict) -> dict:
    from verl.workers.rollout.vllm_rollout.vllm_async_server import ExternalZeroMQDistributedExecutor
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    dp = int(run.get("dp", 1))
    env = {**os.environ, "WORLD_SIZE": str(dp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RAY_LOCAL_WORLD_SIZE": str(dp), "LOCAL_RANK": "0"}
    spec_file = Path(spec["probe_dir"]) / f"{run['name']}-spec.json"
    spec_file.write_text(json.dumps(spec))
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(spec_file), str(index)],
                                env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
               for r in range(dp)]
    try:
        addresses = []
        for w in workers:
            line = ""
            while not line.startswith("WORKER_ADDRESS "):
                line = w.stdout.readline()
                if not line:
                    raise RuntimeError(f"worker {w.pid} exited (rc {w.wait()}) before its ZeroMQ address")
            addresses.append(line.split()[1])
        os.environ["VERL_VLLM_ZMQ_ADDRESSES"] = ",".join(addresses)  # read by the executor in the core processes
        kwargs = dict(model=spec["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=128,
                      compilation_config={"custom_ops": ["none"]}, gpu_memory_utilization=0.5,
                      worker_extension_cls="core_loop_driver.CoreProbe",
                      distributed_executor_backend=ExternalZeroMQDistributedExecutor)
        if dp > 1:  # verl's server adds enable_expert_parallel (it starts vLLM DP only with it): "expert_parallel"
            kwargs.update(data_parallel_size=dp, data_parallel_size_local=dp,
                          enable_expert_parallel=bool(run.get("expert_parallel", False)))
        kwargs.update(run.get("engine", {}))
        outputs, between = await drive(AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs)), spec, run)
    finally:
        for w in workers:
            w.kill()
            w.wait(timeout=60)
    return {**collect(spec, run, outputs, between), "worker_pids": [w.pid for w in workers]}


def main() -> int:
    if sys.argv[1] == "--worker":
        spec = json.loads(Path(sys.argv[2]).read_text())
        workspace.activate(Path(spec["workspace"]))
        worker_main(spec, spec["runs"][int(sys.argv[3])])
        return 0
    spec = json.loads(Path(sys.argv[1]).read_text())
    workspace.activate(Path(spec["workspace"]))
    results = [asyncio.run(run_one(spec, i, run)) for i, run in enumerate(spec["runs"])]
    print("ENGINE_RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
