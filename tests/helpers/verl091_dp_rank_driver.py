"""The group router's vLLM DP rank through verl 0.9.1's own client and server code into vLLM 0.23's CPU engine, in a
local Ray (127.0.0.1). Runs in the venv of ``tests/setup_verl091_engine_env.sh`` (verl 0.9.1 + vLLM 0.23).

    python tests/helpers/verl091_dp_rank_driver.py WORK_DIR engine [DP]

prints ``VERL_DP_RANK_ENGINE {json}``: one recipe server (``get_rollout_replica_class("vllm")`` after
``qwen3_rl.rollout.verl_server_auth.register()`` -> ``server_class``, built from verl's ``RolloutConfig`` and
``HFModelConfig`` on the tiny model) launched by verl (``launch_server``: vLLM 0.23's CPU engine at DP ``DP``, default 1;
``qwen3_rl.cpu_device.vllm023_shims`` in the engine's processes by ``verl091_vllm_site``, a device-kernel keyword);
verl's ``get_router_handle`` with the shipped plugin (``group``: at DP 1 told ``data_parallel_size: 2``, at DP 2 the
DP size asked of the server; at DP 2 also ``over``: told one rank more than the server has) or without it
(``default``: verl's own balancer, the control); verl's ``LLMServerClient`` sends four prompts x 2·DP samples at once,
greedy, 4 tokens: {run: [[request id, prompt index, rank the balancer chose or "absent", "ok" | "error", token ids |
the error's last line], ...], "cores": {run: [[engine index, pid, vLLM's request id], ...]}, "server_mro": [the
server's classes], "released": processes killed by pid at the end, "seconds": the wall time} (``cores``: the engine
cores' own log, the observer of ``verl091_vllm_site``; the client passes verl's request id through,
``full_determinism``). At DP 2: vLLM's DP coordinator and two engine-core processes, one CPU each.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]
ABSENT = "absent"


def _own_pids(_actor) -> list[int]:
    """Run in an actor: its process and all its descendants (a server's vLLM engine cores and DP coordinator)."""
    import psutil

    me = psutil.Process()
    return [me.pid, *(c.pid for c in me.children(recursive=True))]


def _release(handles: list, timeout_s: float = 120.0) -> int:
    """Kills the actors ``handles`` and waits until their processes and those processes' children are gone (a
    zombie counts as gone: it holds no CPU or memory); a process still running after ``timeout_s`` is killed by its
    pid. Returns how many had to be."""
    import psutil
    import ray

    procs = []
    for h in handles:
        for pid in ray.get(h.__ray_call__.remote(_own_pids), timeout=60):
            try:
                procs.append(psutil.Process(pid))  # its start time too: is_running() is not fooled by a reused pid
            except psutil.NoSuchProcess:
                pass
    for h in handles:
        ray.kill(h)

    def running(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in alive:
        p.kill()
    return len(alive)


def engine_env(core_log: Path, dp: int) -> dict[str, str]:
    """The environment of the engine server actor (its Ray ``runtime_env``): vLLM's engine-core processes, which the
    server spawns, inherit it."""
    site = REPO / "tests" / "helpers" / "verl091_vllm_site"
    cpus = sorted(os.sched_getaffinity(0))
    bind = "|".join(str(cpus[r % len(cpus)]) for r in range(dp)) if dp > 1 else "auto"
    return {
        "RAY_AUTH_MODE": "disabled",
        "QWEN3_RL_VLLM023_SHIMS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "QWEN3_RL_CORE_LOG": str(core_log),
        # vLLM-CPU binds each engine core's OpenMP threads to a NUMA node of its own by default (DP 2 on this
        # one-node host: "Not enough allowed NUMA nodes", ompmultiprocessing.py:204-212); one CPU per DP rank instead
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def engine_replica(model: Path, dp: int):
    """verl's replica of the recipe's server class for one engine at DP ``dp`` (its ``server_class``, ``config``)."""
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from verl091_tiny_rollout import tiny_rollout_config

    rollout = tiny_rollout_config(
        data_parallel_size=dp,
        n_gpus_per_node=dp,
        gpu_memory_utilization=0.2,
        response_length=8,
        engine_kwargs={"vllm": {"num_gpu_blocks_override": 256}},
        custom={"qwen3_rl": {"server_auth": {"enable": False}}},
    )
    return get_rollout_replica_class("vllm")(
        replica_rank=0, config=rollout, model_config=HFModelConfig(path=str(model)), gpus_per_node=dp
    )


async def engine_runs(replica, work: Path, dp: int) -> tuple[dict, int]:
    """One recipe server launched by verl (``launch_server``: vLLM 0.23's ``AsyncLLM`` on CPU, DP ``dp``); the
    shipped plugin (``group``; DP 1: told ``data_parallel_size: 2``; DP 2: the server's size; DP 2 also ``over``: told
    ``dp + 1`` ranks) or verl's balancer (``default``); per request: the rank the balancer chose (its own record) and
    the outcome (tokens, or the error's last line); and the engine cores' own log of the requests they took
    (``cores``). Returns that and how many of the server's processes :func:`_release` had to kill by pid."""
    import ray
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.router import get_router_handle

    core_log = work / f"core-log-dp{dp}"
    core_log.mkdir()
    # the DP size's settings ride on this actor (its runtime_env), not on the Ray job: vLLM reads them when its
    # engine processes start (VLLM_CPU_OMP_THREADS_BIND)
    server = replica.server_class.options(
        name=f"dp_rank_engine_dp{dp}_{os.getpid()}",
        max_concurrency=64,
        runtime_env={"env_vars": engine_env(core_log, dp)},
    ).remote(
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
    mro = await server.__ray_call__.remote(lambda s: [f"{c.__module__}.{c.__qualname__}" for c in type(s).__mro__])
    # full_determinism: verl's client hands the caller's request id to vLLM (llm_server.py:90-96), so the cores'
    # log names the request; the balancer is told nothing of it (get_router_handle's own argument, router.py:303)
    rollout = {"name": "vllm", "full_determinism": True}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})
    plugin = (REPO / "qwen3_rl/rollout/verl_router.yaml").read_text()
    # the plugin's YAML per run (None: verl's own balancer): at DP 1 told two ranks, at DP 2 the server's own size
    # and (``over``) one rank more than the server has
    told = {"default": None, "group": "data_parallel_size: 2\n" if dp == 1 else ""}
    if dp > 1:
        told["over"] = f"data_parallel_size: {dp + 1}\n"
    out: dict = {"cores": {}, "server_mro": mro}
    for run, extra in told.items():
        yaml_path = None
        if extra is not None:
            yaml_path = work / f"router_dp{dp}_{run}.yaml"
            yaml_path.write_text(plugin + extra)
        balancer = get_router_handle({f"{host}:{port}": server}, router_config_path=yaml_path and str(yaml_path))
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
    # the server actor, vLLM's engine cores and (DP 2) its DP coordinator gone before Ray shuts down: no engine
    # process outlives the run
    return out, _release([server])


def main() -> int:
    """``WORK_DIR engine [DP]``: the run named in the module docstring, in one local Ray."""
    work = Path(sys.argv[1])
    if sys.argv[2:3] != ["engine"]:
        raise SystemExit(f"usage: {sys.argv[0]} WORK_DIR engine [DP] (got {sys.argv[2:]})")
    dp = int(sys.argv[3]) if sys.argv[3:] else 1
    # before Ray starts: its daemons and every worker inherit it
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from qwen3_rl.rollout import verl_server_auth
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    model = make_tiny_model(work / "dense", TinySpec(moe=False))
    verl_server_auth.register()
    # the Ray job's own environment: our checkout on PYTHONPATH; the engine server's additions (the start-up hook
    # verl091_vllm_site, the CPU binding of its DP size, the cores' log folder) ride on that server actor (engine_env)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}},
        log_to_driver=False,
    )
    try:
        t0 = time.monotonic()
        out, released = asyncio.run(engine_runs(engine_replica(model, dp), work, dp))
        out["released"], out["seconds"] = released, round(time.monotonic() - t0)
    finally:
        ray.shutdown()
    print("VERL_DP_RANK_ENGINE " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
