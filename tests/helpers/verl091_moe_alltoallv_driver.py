"""MOE_ALLTOALLV on the current set: verl 0.9.1's colocated weight sync with and without the switch, on gloo ranks.

    python tests/helpers/verl091_moe_alltoallv_driver.py OUT_DIR [--world 4] [--ep 2] [--pp 1] [--experts 8] [--layers 2]

Each rank (megatron TP 1 PP ``--pp`` EP ``--ep``; verl rollout TP 1 x DP ``--world`` with expert parallel, one replica)
imports the plug-in (:mod:`qwen3_rl.moe.alltoallv_verl091`, as verl's ``external_lib`` hook does), builds the tiny
Qwen3-MoE through ``AutoBridge`` (the bench's ``_build``: verl's vanilla-mbridge branch), then runs verl's real
``ActorRolloutRefWorker.update_weights`` (``workers/engine_workers.py:725-806``) whose export is verl's real
``MegatronEngine.get_per_tensor_param`` (``transformer_impl.py:1033-1062``) over that bridge. The worker object
around them is a stand-in holding only what ``update_weights`` reads (config, engine, rollout); its ``rollout``
stands in for verl's ``ServerAdapter`` (whose constructor needs a Ray job, ``vllm_rollout.py:132``): it carries the
adapter's ``rollout_rank`` / ``replica_rank`` / ``node_rank`` by the adapter's formula (``:81-83``, one replica,
one node) and records the (name, tensor) pairs ``update_weights`` hands it, i.e. what the ZMQ sender would ship to
the colocated vLLM worker. Every torch.distributed call is counted by the bench's ``CollectiveCounter``.

Runs per rank: ``off`` (switch off: upstream's path), ``on``, ``mbridge`` (mbridge's own ``Qwen3MoEBridge``
``export_weights`` called directly), then the refusals with the switch on (``nccl`` checkpoint engine, EPLB on,
no colocated rollout, expert parallel off). OUT_DIR/rank{r}.pt: {"ep_rank", "held", "mbridge_before_plugin", "off", "on", "mbridge"
({name: tensor}), "counts_off", "counts_on", "dup_on", "refused": {case: message or None}}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class _Collector:
    """Stand-in for verl's vLLM ``ServerAdapter`` (see the module docstring): records what it is handed."""

    def __init__(self, rank: int, world: int, config: Any) -> None:
        self.rollout_rank, self.replica_rank, self.node_rank = rank % world, rank // world, 0
        self.config = config
        self.received: list[tuple[str, Any]] | None = None

    async def update_weights(self, weights: Any, **kw: Any) -> None:
        self.received = [(n, t.clone()) for n, t in weights]

    async def resume(self, tags: list[str]) -> None:  # not reached: free_cache_engine False
        raise AssertionError("resume called")


def _worker_config(
    world: int, enable: bool, backend: str = "naive", eplb: bool = False, ep: bool = True
) -> Any:
    from omegaconf import OmegaConf

    vllm_kw = {"enable_eplb": True} if eplb else {}
    return OmegaConf.create(
        {
            "rollout": {
                "name": "vllm",
                "mode": "async",
                "tensor_model_parallel_size": 1,
                "data_parallel_size": world,
                "expert_parallel_size": world if ep else 1,
                "pipeline_model_parallel_size": 1,
                "free_cache_engine": False,
                "load_format": "auto",
                "engine_kwargs": {"vllm": vllm_kw},
                "checkpoint_engine": {"backend": backend, "update_weights_bucket_megabytes": 64},
            },
            "qwen3_rl": {"moe_alltoallv": {"enable": enable}},
        }
    )


def _sync(bridge: Any, module: list, rank: int, world: int, cfg: Any, colocated: bool = True) -> _Collector:
    """verl's ``update_weights`` on a stand-in worker; returns the rollout stand-in with what it received."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    from verl.workers.engine_workers import ActorRolloutRefWorker

    engine = SimpleNamespace(
        module=module,
        bridge=bridge,
        vanilla_bridge=True,
        peft_cls=None,
        _qat_enabled=False,
        model_config=SimpleNamespace(lora={}),
        is_param_offload_enabled=False,
    )
    engine.get_per_tensor_param = lambda **kw: MegatronEngine.get_per_tensor_param(engine, **kw)
    rollout = _Collector(rank, world, cfg.rollout)
    worker = SimpleNamespace(
        config=cfg,
        actor=SimpleNamespace(engine=engine),
        rollout=rollout if colocated else None,
        layered_summon=False,
        peft_merge=False,
        base_sync_done=True,
        checkpoint_engine=SimpleNamespace(send_weights=None),
    )
    asyncio.run(ActorRolloutRefWorker.update_weights(worker, global_steps=1))
    return rollout


def _rank(
    rank: int, world: int, ep: int, pp: int, port: int, experts: int, layers: int, out_dir: str
) -> None:
    sys.path.insert(0, str(REPO / "qwen3_rl" / "cpu_device"))
    from qwen3_rl.cpu_device import megatron16_shims, verl091_cpu

    megatron16_shims.install()  # device shims, before megatron is imported
    verl091_cpu.install()
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), RAY_LOCAL_WORLD_SIZE=str(world)
    )
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    mbridge_before_plugin = "mbridge" in sys.modules
    import qwen3_rl.moe.alltoallv_verl091 as plugin  # what verl's external_lib hook imports
    from qwen3_rl.moe.reshard import rollout_expert_range
    from qwen3_rl.tools.bench.moe_sync_verl091 import CollectiveCounter, _build

    mpu.initialize_model_parallel(1, pp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    bridge, module = _build(experts, layers)
    assert type(bridge).__name__ == "AlltoallvQwen3MoeBridge", type(bridge)
    res: dict[str, Any] = {"ep_rank": plugin.vllm_ep_rank(_Collector(rank, world, None), 1, world)}
    res["mbridge_before_plugin"] = mbridge_before_plugin
    res["held"] = list(rollout_expert_range(experts, world, res["ep_rank"]))
    for case, enable in (("off", False), ("on", True)):
        counter = CollectiveCounter()
        torch.distributed.barrier()
        with counter.active():
            got = _sync(bridge, module, rank, world, _worker_config(world, enable)).received
        res[case] = dict(got)
        res[f"dup_{case}"] = len(got) - len(res[case])
        res[f"counts_{case}"] = counter.as_dict()
    torch.distributed.barrier()
    res["mbridge"] = {n: t.clone() for n, t in type(bridge).__mro__[1].export_weights(bridge, module)}
    res["mbridge_class"] = type(bridge).__mro__[1].__module__ + "." + type(bridge).__mro__[1].__name__
    refused: dict[str, str | None] = {}
    for case, cfg, colocated in (
        ("nccl", _worker_config(world, True, backend="nccl"), True),
        ("eplb", _worker_config(world, True, eplb=True), True),
        ("not_colocated", _worker_config(world, True), False),
        ("ep_off", _worker_config(world, True, ep=False), True),
    ):
        try:
            _sync(bridge, module, rank, world, cfg, colocated)
            refused[case] = None
        except ValueError as e:
            refused[case] = str(e)
    res["refused"] = refused
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=800.0)
    a = ap.parse_args()
    import torch.multiprocessing as mp
    from ports import free_port

    port = free_port()  # tests/helpers/ports.py: outside the ephemeral range
    ctx = mp.start_processes(
        _rank,
        args=(a.world, a.ep, a.pp, port, a.experts, a.layers, a.out_dir),
        nprocs=a.world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + a.timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"ranks still running after {a.timeout} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
