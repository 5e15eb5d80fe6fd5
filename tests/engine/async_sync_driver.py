"""The fully-async weight sync on a MoE server with vLLM DP x EP, in verl's server layout: vLLM 0.13.0's
``AsyncLLM`` (CPU build, patched trees) whose DP engine cores drive, through verl's
``ExternalZeroMQDistributedExecutor``, one rollout worker per DP rank; each worker is our
``WeightReceivingRollout`` (verl's ``vLLMAsyncRollout`` + the weight receive), in its own process. The pause,
abort and resume are our ``PartialServerMixin``'s (the fully-async server's methods, on this ``AsyncLLM``); this
process is also the trainer's rank 0 (the broadcast root). Print one JSON line.

    python tests/engine/async_sync_driver.py SPEC.json
    python tests/engine/async_sync_driver.py --worker SPEC.json   (a rollout worker; started by the driver)

SPEC: {"workspace": DIR, "model": DIR (tiny Qwen3-MoE), "prompts": [[token ids], ...], "probe_dir": DIR, "dp": int,
       "syncs": int, "max_model_len": int, "steps_before_sync": int (model steps of the workers, all ranks, after the
       start or the last resume before the next sync), "sync_timeout_s": float,
       "no_idle_wait": optional bool (the control: the pause returns without waiting for the DP engine cores)}

As in verl, a worker runs the weight receive on the event loop that serves its ZeroMQ socket (Ray runs an async
actor's methods on the loop ``vLLMAsyncRollout._init_zeromq`` starts its socket task on): here a second ZeroMQ
socket on that loop takes the driver's calls (``join``, ``receive``, ``digest``). A probe (vLLM's
``worker_extension_cls``, :class:`SyncProbe`) records each model step of a worker (``execute_model`` and
``execute_dummy_batch``: the DP engine cores' dummy forwards) with its start and end time.

Each sync: the requests run until the workers made ``steps_before_sync`` more model steps; then the server's
``qwen3_rl_pause(abort=True)``, the broadcast of version k (the model's tensors x (1 + k / 64), in buckets), its
checksums on both sides, ``qwen3_rl_resume(k)``. Every request that was aborted is sent again with its tokens so
far (the partial rollout's agent loop) until it reaches ``max_model_len``.

Result: {"syncs": [{"version", "aborted", "pause_s", "weight_sync_s", "resume_s", "paused_at", "synced_at",
"sent", "received", "timed_out"}], "samples": [{"tokens", "segments": [[version, n_tokens, aborted]]}],
"steps": [probe records {"pid", "dp_rank", "kind", "t0", "t1"}], "receives": [{"rank", "t0", "t1"}],
"digests": [{name: checksum} per worker], "expected_digest": {name: checksum}, "worker_pids", "seconds"}.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent / "helpers"))  # ports: outside the ephemeral range

from ports import free_port  # noqa: E402

import workspace  # noqa: E402

#: parameters compared exactly between the trainer's last version and each worker's model after the last sync
DIGEST_PARAMS = ("model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.o_proj.weight")


class SyncProbe:
    """Worker extension: records each model step (real or dummy) of this worker with its times."""

    def probe_install(self, path: str) -> int:
        dp_rank = int(self.vllm_config.parallel_config.data_parallel_rank)

        def recorded(kind, inner):  # noqa: ANN001, ANN202
            def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                t0 = time.time()
                try:
                    return inner(*args, **kwargs)
                finally:
                    with open(path.replace("{pid}", str(os.getpid())), "a") as f:
                        f.write(json.dumps({"pid": os.getpid(), "dp_rank": dp_rank, "kind": kind, "t0": t0,
                                            "t1": time.time()}) + "\n")
            return call

        self.execute_model = recorded("model", self.execute_model)
        self.execute_dummy_batch = recorded("dummy", self.execute_dummy_batch)
        return os.getpid()


def worker_main(spec: dict) -> None:
    """One rollout worker: ``WeightReceivingRollout`` serving verl's ZeroMQ socket and, on the same event loop,
    the driver's calls."""
    import zmq
    import zmq.asyncio
    from verl.workers.config import HFModelConfig, RolloutConfig

    from qwen3_rl.trainer.fully_async.rollout import WeightReceivingRollout
    from qwen3_rl.trainer.fully_async.weight_sync import byte_checksum

    dp = int(spec["dp"])
    rank = int(os.environ["RANK"])

    async def serve() -> None:
        config = RolloutConfig(name="vllm", mode="async", tensor_model_parallel_size=1, data_parallel_size=dp,
                               expert_parallel_size=dp, free_cache_engine=False, prompt_length=64,
                               response_length=64)
        rollout = WeightReceivingRollout(config, HFModelConfig(path=spec["model"]), None)
        ctl = zmq.asyncio.Context().socket(zmq.REP)
        ctl_address = f"ipc://{spec['probe_dir']}/ctl-{rank}.ipc"
        ctl.bind(ctl_address)
        print(f"WORKER_ADDRESS {rollout.address} {ctl_address}", flush=True)
        while True:
            method, args = pickle.loads(await ctl.recv())
            try:
                if method == "join":
                    out = rollout.qwen3_rl_join_group(*args)
                elif method == "receive":
                    t0 = time.time()
                    sums = await rollout.qwen3_rl_receive(*args)
                    out = {"sums": sums, "t0": t0, "t1": time.time()}
                else:  # digest
                    params = dict(rollout.inference_engine.worker.model_runner.model.named_parameters())
                    out = {n: list(byte_checksum(params[n])) for n in DIGEST_PARAMS if n in params}
            except Exception as e:  # noqa: BLE001 (sent back to the driver)
                out = RuntimeError(f"worker {rank}: {method}: {type(e).__name__}: {e}")
            await ctl.send(pickle.dumps(out))

    asyncio.run(serve())


class _Server:
    """The fully-async server's pause / abort / resume / generate (``PartialServerMixin``) on an ``AsyncLLM``."""


async def run(spec: dict) -> dict:  # noqa: C901 - one scenario, step by step
    import torch
    import zmq
    import zmq.asyncio
    from omegaconf import OmegaConf
    from safetensors.torch import load_file
    from verl.workers.rollout.vllm_rollout.vllm_async_server import ExternalZeroMQDistributedExecutor
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from qwen3_rl.trainer.fully_async.rollout import PartialServerMixin
    from qwen3_rl.trainer.fully_async.weight_sync import (
        byte_checksum,
        make_group,
        plan_buckets,
        send,
        specs_of,
    )

    t_start = time.monotonic()
    dp, syncs, max_len = int(spec["dp"]), int(spec["syncs"]), int(spec["max_model_len"])
    timeout_s = float(spec["sync_timeout_s"])
    env = {**os.environ, "WORLD_SIZE": str(dp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RAY_LOCAL_WORLD_SIZE": str(dp), "LOCAL_RANK": "0"}
    spec_file = Path(spec["probe_dir"]) / "spec.json"
    spec_file.write_text(json.dumps(spec))
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(spec_file)], env={**env, "RANK": str(r)},
                                stdout=subprocess.PIPE, text=True) for r in range(dp)]
    ctx = zmq.asyncio.Context()
    engine = None
    result: dict = {"syncs": [], "worker_pids": [w.pid for w in workers]}
    try:
        addresses, ctls = [], []
        for w in workers:
            line = ""
            while not line.startswith("WORKER_ADDRESS "):
                line = w.stdout.readline()
                if not line:
                    raise RuntimeError(f"worker {w.pid} exited (rc {w.wait()}) before its ZeroMQ address")
            _, zmq_address, ctl_address = line.split()
            addresses.append(zmq_address)
            ctl = ctx.socket(zmq.REQ)
            ctl.connect(ctl_address)
            ctls.append(ctl)
        os.environ["VERL_VLLM_ZMQ_ADDRESSES"] = ",".join(addresses)  # read by the executor in the core processes
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=spec["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=max_len,
            compilation_config={"custom_ops": ["none"]}, gpu_memory_utilization=0.5, max_num_seqs=len(spec["prompts"]),
            worker_extension_cls="async_sync_driver.SyncProbe", distributed_executor_backend=ExternalZeroMQDistributedExecutor,
            data_parallel_size=dp, data_parallel_size_local=dp, enable_expert_parallel=True))
        await engine.collective_rpc("probe_install", args=(str(Path(spec["probe_dir"]) / "steps-{pid}.jsonl"),))
        server = type("Server", (PartialServerMixin, _Server), {})()
        server.engine = engine
        server.config = OmegaConf.create({"max_model_len": max_len})
        if spec.get("no_idle_wait"):  # the control: the pause without its wait for the DP engine cores

            async def no_wait() -> None:
                return None

            server._q3_wait_engines_idle = no_wait

        async def call(i: int, method: str, *args):  # noqa: ANN202
            await ctls[i].send(pickle.dumps((method, args)))
            out = pickle.loads(await ctls[i].recv())
            if isinstance(out, Exception):
                raise out
            return out

        # the trainer's side: the model's tensors (HF names), version k = x (1 + k / 64)
        base = {}
        for f in sorted(Path(spec["model"]).glob("*.safetensors")):
            base.update(load_file(str(f)))
        names = sorted(base)

        def export(k: int) -> list[tuple[str, torch.Tensor]]:
            return [(n, base[n] * (1 + k / 64) if base[n].is_floating_point() else base[n]) for n in names]

        specs = specs_of(export(0))
        sizes = {s.dtype: torch.empty(0, dtype=getattr(torch, s.dtype)).element_size() for s in specs}
        buckets = plan_buckets(specs, sizes, bucket_bytes=1 << 20)
        port = free_port()
        joins = [asyncio.ensure_future(call(i, "join", "127.0.0.1", port, 1 + i, 1 + dp, "gloo")) for i in range(dp)]
        group = await asyncio.to_thread(make_group, "127.0.0.1", port, 0, 1 + dp, "gloo", 600.0)
        await asyncio.gather(*joins)

        async def sample(i: int, prompt: list[int]) -> dict:
            tokens: list[int] = []
            segments = []
            while len(prompt) + len(tokens) < max_len:
                out = await server.generate(prompt + tokens, {"temperature": 0.0, "ignore_eos": True},
                                            f"req-{i}")
                tokens += list(out.token_ids)
                segments.append([out.param_version, len(out.token_ids), bool(out.aborted)])
                if not out.aborted:
                    break
            return {"tokens": tokens, "segments": segments}

        def model_steps_since(t: float) -> int:
            n = 0
            for f in Path(spec["probe_dir"]).glob("steps-*.jsonl"):
                n += sum(1 for line in f.read_text().splitlines() if '"model"' in line and json.loads(line)["t0"] > t)
            return n

        tasks = [asyncio.ensure_future(sample(i, p)) for i, p in enumerate(spec["prompts"])]
        since = time.time()
        for k in range(1, syncs + 1):
            while model_steps_since(since) < int(spec["steps_before_sync"]):
                if all(t.done() for t in tasks):
                    raise RuntimeError(f"every request finished before sync {k}: nothing to abort")
                await asyncio.sleep(0.05)
            t0 = time.time()
            aborted = await server.qwen3_rl_pause(True)
            t1 = time.time()
            named = export(k)
            recv = [asyncio.ensure_future(call(i, "receive", specs, buckets)) for i in range(dp)]
            sent_f = asyncio.ensure_future(asyncio.to_thread(send, group, named, specs, buckets))
            rec = {"version": k, "aborted": aborted, "paused_at": t1, "pause_s": t1 - t0, "timed_out": False}
            try:
                sent = await asyncio.wait_for(sent_f, timeout_s)
                got = await asyncio.wait_for(asyncio.gather(*recv), timeout_s)
            except TimeoutError:
                rec.update(timed_out=True, weight_sync_s=time.time() - t1)
                result["syncs"].append(rec)
                break
            t2 = time.time()
            await server.qwen3_rl_resume(k)
            rec.update(synced_at=t2, weight_sync_s=t2 - t1, resume_s=time.time() - t2, sent=sent,
                       received=[g["sums"] for g in got])
            result.setdefault("receives", []).extend({"rank": i, "t0": g["t0"], "t1": g["t1"]}
                                                     for i, g in enumerate(got))
            result["syncs"].append(rec)
            since = time.time()
        else:
            result["samples"] = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
            result["digests"] = [await call(i, "digest") for i in range(dp)]
            last = dict(export(syncs))
            # the engine runs float32 (the tiny model's dtype too: the cast changes no byte then)
            result["expected_digest"] = {n: list(byte_checksum(last[n].float())) for n in DIGEST_PARAMS}
            result["initial_digest"] = {n: list(byte_checksum(base[n].float())) for n in DIGEST_PARAMS}
    finally:
        if engine is not None:
            engine.shutdown()
        for w in workers:
            w.kill()
            w.wait(timeout=60)
    result["steps"] = [json.loads(line) for f in sorted(Path(spec["probe_dir"]).glob("steps-*.jsonl"))
                       for line in f.read_text().splitlines()]
    result["seconds"] = time.monotonic() - t_start
    return result


def main() -> int:
    if sys.argv[1] == "--worker":
        spec = json.loads(Path(sys.argv[2]).read_text())
        workspace.activate(Path(spec["workspace"]))
        worker_main(spec)
        return 0
    spec = json.loads(Path(sys.argv[1]).read_text())
    workspace.activate(Path(spec["workspace"]))
    result = asyncio.run(run(spec))
    print("ENGINE_RESULT " + json.dumps(result), flush=True)
    # a timed-out sync leaves threads blocked in the collective: leave without joining them
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
