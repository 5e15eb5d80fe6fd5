"""``CPU_CKPT_ENGINE_GLOO`` (``qwen3_rl/cpu_device/verl091_gloo_ckpt.py``): the CPU profile's checkpoint engine for
verl 0.9.1's fully-async weight sync, driven the way verl's ``CheckpointEngineManager.update_weights`` drives an
engine (``verl/checkpoint_engine/base.py``: ``prepare`` on every process, ``build_topology`` from the results,
``init_process_group``, ``send_weights`` / ``receive_weights``, ``finalize``) between separate processes: two
trainer ranks (rank 0 sends, rank 1 only consumes its generator) and two rollout workers.

What is checked: verl finds the backend through ``custom_backend_module`` (its own ``import_external_libs`` and
registry); each receiver gets every weight with its name, dtype, shape and values exactly, through buckets smaller
than the largest tensor (chunked and merged by verl's helpers); two syncs in a row on fresh groups, the second
with changed weights arriving as changed.

Runs in the venv of ``tests/setup_verl091_engine_env.sh``.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing as mp
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODULE = "qwen3_rl.cpu_device.verl091_gloo_ckpt"
BUCKET = 1024  # bytes: the 40 x 30 float32 weight (4800 bytes) goes in five chunks
TIMEOUT_S = 120


def weights(sync: int) -> list[tuple[str, Any]]:
    """The trainer's weights at ``sync`` (1, 2, ...): float32 [40, 30], int64 [7], bfloat16 [3]."""
    import torch

    g = torch.Generator().manual_seed(sync)
    return [("layer.weight", torch.randn(40, 30, generator=g)), ("ids", torch.arange(7, dtype=torch.int64) * sync),
            ("norm.bias", torch.randn(3, generator=g).bfloat16())]


def _process(role: str, index: int, addr_qs: list[Any], out_q: Any, syncs: int, receivers: int) -> None:
    """One process of the sync: ``role`` trainer (index 0 = the master) or rollout; puts what it received.
    ``addr_qs``: one queue per other process (trainer 1, rollout 0, 1, ...), through which the master hands out each
    sync's store address (what verl's manager does with ``prepare``'s results)."""
    import sys

    sys.path.insert(0, str(REPO))
    import torch
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)  # what verl does with rollout.checkpoint_engine.custom_backend_module
    kwargs = {"is_master": index == 0} if role == "trainer" else {}
    engine = CheckpointEngineRegistry.new("cpu_gloo", bucket_size=BUCKET, **kwargs)
    got: list[dict[str, torch.Tensor]] = []
    for sync in range(1, syncs + 1):
        meta = engine.prepare()
        if meta is not None:
            for q in addr_qs:
                q.put(meta)
        else:
            meta = addr_qs[index if role == "rollout" else receivers].get(timeout=TIMEOUT_S)
        actor, rollout = type(engine).build_topology(2, receivers, [meta, None] + [None] * receivers)
        mine = actor if role == "trainer" else rollout
        engine.init_process_group(**{k: v[index] for k, v in mine.items()})
        if role == "trainer":
            asyncio.run(engine.send_weights(iter(weights(sync))))
        else:
            async def receive() -> dict[str, torch.Tensor]:
                return {name: t.clone() async for name, t in engine.receive_weights()}

            got.append(asyncio.run(receive()))
        engine.finalize()
    buf = io.BytesIO()  # as bytes: a tensor through the queue would be shared memory of a process about to exit
    torch.save(got, buf)
    out_q.put((role, index, buf.getvalue()))


def test_gloo_engine_syncs_exactly_between_processes() -> None:
    import torch

    receivers, syncs = 2, 2
    ctx = mp.get_context("spawn")
    addr_qs, out_q = [ctx.Queue() for _ in range(receivers + 1)], ctx.Queue()  # rollout 0..n-1, trainer 1
    procs = [ctx.Process(target=_process, args=("trainer", i, addr_qs, out_q, syncs, receivers)) for i in range(2)]
    procs += [ctx.Process(target=_process, args=("rollout", i, addr_qs, out_q, syncs, receivers))
              for i in range(receivers)]
    for p in procs:
        p.start()
    try:
        results = [out_q.get(timeout=TIMEOUT_S * syncs) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = {i: torch.load(io.BytesIO(g)) for role, i, g in results if role == "rollout"}
    assert sorted(got) == list(range(receivers))
    for i, per_sync in got.items():
        assert len(per_sync) == syncs
        for sync, received in enumerate(per_sync, start=1):
            sent = dict(weights(sync))
            assert list(received) == list(sent), f"receiver {i} sync {sync}: names {list(received)}"
            for name, t in sent.items():
                r = received[name]
                assert r.dtype == t.dtype and r.shape == t.shape and torch.equal(r, t), (i, sync, name)
        assert not torch.equal(per_sync[0]["layer.weight"], per_sync[1]["layer.weight"])  # the second sync's own
    print(f"cpu_gloo: {syncs} syncs x {receivers} receivers, {len(weights(1))} tensors each exact "
          f"(bucket {BUCKET} B)")
