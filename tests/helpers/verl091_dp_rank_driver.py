"""The group router's vLLM DP rank through verl 0.9.1's own client and server code to vLLM's engine-client call, in
a local Ray (127.0.0.1); prints one line ``VERL_DP_RANK_RESULT {json}``.

    python tests/helpers/verl091_dp_rank_driver.py WORK_DIR

Runs in the venv of ``tests/setup_verl091_engine_env.sh`` (verl 0.9.1 + vLLM 0.23). Two servers of the recipe's
class (``get_rollout_replica_class("vllm")`` after ``qwen3_rl.rollout.verl_server_auth.register()`` ->
``server_class``), built from verl's ``RolloutConfig`` (``data_parallel_size=2``) and ``HFModelConfig`` on the tiny
model as ``vLLMReplica.launch_servers`` builds them (``vllm_async_server.py:1377-1396``); verl's
``get_router_handle`` with the shipped router YAML (``qwen3_rl/rollout/verl_router.yaml``: the DP size is asked of
the servers) or without (``default``: verl's own balancer, the control); two verl ``LLMServerClient`` send four
prompts x four samples at once, then a second turn of one request.

Stand-in (named in the output under ``"shims"``): no engine is launched (two DP=2 engines do not fit this host's
two cores); each server's ``engine`` is :class:`EngineClientRecorder`, which takes ``generate`` with vLLM 0.23's
own ``AsyncLLM.generate`` signature (``inspect.Signature.bind``: a keyword vLLM lacks fails), records the call's
keywords and yields vLLM's ``RequestOutput``. Everything between the client and that call is verl's and ours.
Output: {run: {"calls": [[server index, prompt ids, data_parallel_rank or "absent"], ...], "turns": [...],
"fields": [...]}, "dp_asked": int, "shims": [...]}.

    python tests/helpers/verl091_dp_rank_driver.py WORK_DIR engine

prints ``VERL_DP_RANK_ENGINE {json}``: one recipe server launched by verl (``launch_server``: vLLM 0.23's CPU engine,
DP 1; ``qwen3_rl.cpu_device.vllm023_shims`` in the engine's processes by ``verl091_vllm_site``, a device-kernel
keyword), the shipped plugin told ``data_parallel_size: 2`` (``group``) or verl's balancer (``default``), four
prompts x two samples, greedy, 4 tokens: {run: [[request id, prompt index, rank the balancer chose or "absent",
"ok" | "error", token ids | the error's last line], ...], "cores": {run: [[engine index, pid, vLLM's request id], ...]}}
(``cores``: the engine cores' own log, the observer of ``verl091_vllm_site``; the client passes verl's request id
through, ``full_determinism``).

    python tests/helpers/verl091_dp_rank_driver.py WORK_DIR engine 2

the same with the server at ``data_parallel_size=2`` (vLLM's DP coordinator and two engine-core processes, one CPU
each), the shipped plugin as it is (the DP size asked of the server) and four samples per prompt.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from uuid import uuid4

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]
N_SAMPLES = 4
ABSENT = "absent"


class EngineClientRecorder:
    """Stands in for vLLM 0.23's ``AsyncLLM`` at its ``generate`` call: binds the call to that method's signature,
    records ``(prompt ids, data_parallel_rank)``, answers one token (the prompt's first) as a finished request."""

    def __init__(self) -> None:
        import inspect

        from vllm.v1.engine.async_llm import AsyncLLM

        self.signature = inspect.signature(AsyncLLM.generate)
        self.calls: list[list] = []

    def generate(self, *args, **kwargs):
        bound = self.signature.bind(self, *args, **kwargs)  # TypeError on a keyword vLLM's generate lacks
        prompt = list(bound.arguments["prompt"]["prompt_token_ids"])
        self.calls.append([prompt, kwargs.get("data_parallel_rank", ABSENT)])
        return self._answer(bound.arguments["request_id"], prompt)

    async def _answer(self, request_id: str, prompt: list[int]):
        from vllm.outputs import CompletionOutput, RequestOutput

        await asyncio.sleep(0.05)  # requests overlap, as on an engine
        done = CompletionOutput(
            index=0,
            text="",
            token_ids=[prompt[0]],
            cumulative_logprob=None,
            logprobs=None,
            finish_reason="length",
        )
        yield RequestOutput(request_id, None, prompt, None, [done], True)


def _install(server) -> None:
    server.engine = EngineClientRecorder()


def _take(server) -> list:
    engine = getattr(server.engine, "_engine", server.engine)  # under the recipe's RankedEngine once ranked
    out, engine.calls = engine.calls, []
    return out


async def drive(handles: list, clients: list, ray) -> dict:
    async def one(client, rid: str, prompt: list[int]) -> None:
        await client.generate(rid, prompt_ids=prompt, sampling_params={"temperature": 1.0, "max_tokens": 1})

    async def take() -> list:
        out = []
        for i, h in enumerate(handles):
            out += [[i, *c] for c in await h.__ray_call__.remote(_take)]
        return out

    await asyncio.gather(
        *(
            one(clients[(p * N_SAMPLES + s) % 2], uuid4().hex, prompt)
            for p, prompt in enumerate(PROMPTS)
            for s in range(N_SAMPLES)
        )
    )
    out = {"calls": await take(), "turns": []}
    for prompt in (PROMPTS[0], PROMPTS[0] + [99, 98]):
        await one(clients[0], "conversation-1", prompt)
        out["turns"] += await take()
    return out


async def engine_runs(replica, model_dir: Path, work: Path, dp: int) -> dict:
    """One recipe server launched by verl (``launch_server``: vLLM 0.23's ``AsyncLLM`` on CPU, DP ``dp``); the
    shipped plugin (DP 1: told ``data_parallel_size: 2``; DP 2: the servers' size) (``group``) or verl's balancer
    (``default``); per request: the rank the balancer chose (its own record) and the outcome (tokens, or the error's
    last line); and the engine cores' own log of the requests they took (``cores``)."""
    import ray
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.router import get_router_handle

    server = replica.server_class.options(name=f"dp_rank_engine_{os.getpid()}", max_concurrency=64).remote(
        config=replica.config,
        model_config=replica.model_config,
        rollout_mode=RolloutMode.STANDALONE,
        workers=[None] * dp,  # verl checks only their number against the local DP size (:389)
        replica_rank=0,
        node_rank=0,
        gpus_per_node=dp,
        nnodes=1,
        cuda_visible_devices="",
    )
    await asyncio.wait_for(server.launch_server.remote(), 900)
    host, port = await server.get_server_address.remote()
    # full_determinism: verl's client hands the caller's request id to vLLM (llm_server.py:90-96), so the cores'
    # log names the request; the balancer is told nothing of it (get_router_handle's own argument, router.py:303)
    rollout = {"name": "vllm", "full_determinism": True}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})
    router_yaml = work / "router_dp2.yaml"
    plugin = (REPO / "qwen3_rl/rollout/verl_router.yaml").read_text()
    router_yaml.write_text(plugin + ("data_parallel_size: 2\n" if dp == 1 else ""))
    core_log = Path(os.environ.get("QWEN3_RL_CORE_LOG", work / "no-core-log"))
    out: dict = {"cores": {}}
    for run, yaml_path in (("default", None), ("group", str(router_yaml))):
        balancer = get_router_handle({f"{host}:{port}": server}, router_config_path=yaml_path)
        client = LLMServerClient(config, load_balancer_handle=balancer)
        rids = [(f"{run}-{p}-{s}", p) for p in range(len(PROMPTS)) for s in range(2 * dp)]

        async def one(rid: str, p: int, client=client) -> list:
            try:
                res = await client.generate(
                    rid, prompt_ids=PROMPTS[p], sampling_params={"temperature": 0.0, "max_tokens": 4}
                )
                return ["ok", list(res.token_ids)]
            except Exception as e:  # noqa: BLE001 - the engine's refusal is the outcome recorded
                return ["error", str(e).strip().splitlines()[-1][-300:]]

        outcomes = await asyncio.gather(*(one(rid, p) for rid, p in rids))
        sticky = await balancer.__ray_call__.remote(
            lambda lb: {k: list(v) for k, v in getattr(lb, "_sticky", {}).items()}
        )
        out[run] = [
            [rid, p, (sticky.get(rid) or [None, ABSENT])[1], *o]
            for (rid, p), o in zip(rids, outcomes, strict=True)
        ]
        ray.kill(balancer)
        logs = sorted(core_log.glob("core-*.txt"))
        out["cores"][run] = [ln.split() for f in logs for ln in f.read_text().splitlines()]
        for f in logs:
            f.unlink()
    ray.kill(server)
    return out


def main() -> int:
    work = Path(sys.argv[1])
    if sys.argv[2:3] == ["engine"]:
        return main_engine(work, int(sys.argv[3]) if sys.argv[3:] else 1)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from omegaconf import OmegaConf
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class
    from verl.workers.rollout.router import get_router_handle

    from qwen3_rl.rollout import verl_server_auth
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    model = make_tiny_model(work / "dense", TinySpec(moe=False))
    verl_server_auth.register()
    replica_cls = get_rollout_replica_class("vllm")
    rollout = RolloutConfig(
        name="vllm",
        tensor_model_parallel_size=1,
        data_parallel_size=2,
        expert_parallel_size=2,
        n_gpus_per_node=2,
        nnodes=1,
        dtype="float32",
        load_format="auto",
        max_model_len=256,
        prompt_length=64,
        response_length=8,
        custom={"qwen3_rl": {"server_auth": {"enable": False}}},
    )
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}}})
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}},
        log_to_driver=False,
    )
    out: dict = {"shims": ["EngineClientRecorder: vLLM's AsyncLLM at its generate call (no engine launched)"]}
    try:
        replica = replica_cls(replica_rank=0, config=rollout, model_config=HFModelConfig(path=str(model)))
        for run, router_yaml in (
            ("default", None),
            ("group", str(REPO / "qwen3_rl/rollout/verl_router.yaml")),
        ):
            handles = [
                replica.server_class.options(
                    name=f"dp_rank_{run}_{i}_{os.getpid()}", max_concurrency=64
                ).remote(
                    config=replica.config,
                    model_config=replica.model_config,
                    rollout_mode=RolloutMode.STANDALONE,
                    workers=[],
                    replica_rank=i,
                    node_rank=0,
                    gpus_per_node=2,
                    nnodes=1,
                    cuda_visible_devices="",
                )
                for i in range(2)
            ]
            ray.get([h.__ray_call__.remote(_install) for h in handles], timeout=300)
            out["server_mro"] = ray.get(
                handles[0].__ray_call__.remote(
                    lambda s: [f"{c.__module__}.{c.__qualname__}" for c in type(s).__mro__]
                )
            )
            servers = {f"127.0.0.1:{9000 + i}": h for i, h in enumerate(handles)}
            balancer = get_router_handle(servers, router_config_path=router_yaml)
            clients = [LLMServerClient(config, load_balancer_handle=balancer) for _ in range(2)]
            res = asyncio.run(drive(handles, clients, ray))
            res["fields"] = ray.get(balancer.require_acquire_fields.remote())
            if run == "group":
                out["dp_asked"] = ray.get(balancer.__ray_call__.remote(lambda lb: lb.router.dp))
            out[run] = res
            for h in [*handles, balancer]:
                ray.kill(h)
    finally:
        ray.shutdown()
    print("VERL_DP_RANK_RESULT " + json.dumps(out), flush=True)
    return 0


def main_engine(work: Path, dp: int) -> int:
    """``WORK_DIR engine [DP]``: :func:`engine_runs` in a local Ray; prints ``VERL_DP_RANK_ENGINE {json}``."""
    import ray
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    from qwen3_rl.rollout import verl_server_auth
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    model = make_tiny_model(work / "dense", TinySpec(moe=False))
    verl_server_auth.register()
    rollout = RolloutConfig(
        name="vllm",
        tensor_model_parallel_size=1,
        data_parallel_size=dp,
        n_gpus_per_node=dp,
        nnodes=1,
        dtype="float32",
        load_format="auto",
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=256,
        max_num_seqs=8,
        prompt_length=64,
        response_length=8,
        enable_sleep_mode=False,
        free_cache_engine=False,
        seed=0,
        skip_tokenizer_init=False,
        engine_kwargs={"vllm": {"num_gpu_blocks_override": 256}},
        custom={"qwen3_rl": {"server_auth": {"enable": False}}},
    )
    replica = get_rollout_replica_class("vllm")(
        replica_rank=0, config=rollout, model_config=HFModelConfig(path=str(model)), gpus_per_node=dp
    )
    site = REPO / "tests" / "helpers" / "verl091_vllm_site"
    cpus = sorted(os.sched_getaffinity(0))
    bind = "|".join(str(cpus[r % len(cpus)]) for r in range(dp)) if dp > 1 else "auto"
    env = {
        "RAY_AUTH_MODE": "disabled",
        "QWEN3_RL_VLLM023_SHIMS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "QWEN3_RL_CORE_LOG": str(work / "core-log"),
        # vLLM-CPU binds each engine core's OpenMP threads to a NUMA node of its own by default (DP 2 on this
        # one-node host: "Not enough allowed NUMA nodes", ompmultiprocessing.py:204-212); one CPU per DP rank instead
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    }
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": env},
        log_to_driver=False,
    )
    (work / "core-log").mkdir()
    os.environ["QWEN3_RL_CORE_LOG"] = str(work / "core-log")  # for engine_runs (this process starts no core)
    try:
        out = asyncio.run(engine_runs(replica, model, work, dp))
    finally:
        ray.shutdown()
    print("VERL_DP_RANK_ENGINE " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
