"""Rollout-rebalance KV transfer benchmark: bytes per second of both KV paths between 2 processes.

    python -m qwen3_rl.tools.bench.kv_transfer [--sizes-mb 6,25,100,400] [--reps 5] [--layers 94] [--json]

Two processes on 127.0.0.1. Rank 0 holds a paged KV cache shaped like one TP4 shard of Qwen3-235B-A22B
(``--layers`` tensors of ``(2, num_blocks, 128 tokens, 1 KV head, 128)`` bfloat16: 47 KiB per token,
6.16 MB per block) and moves one running request of the given payload to rank 1 through the code the engine
hook runs, ``RebalanceCoordinator._transfer`` (``qwen3_rl/rollout/migration.py``: export, state exchange,
``allocate_blocks``, :func:`~qwen3_rl.rollout.migration.move_kv_blocks`, import), once per KV path:

  device  the DP group's device group (``kv_comm``, batched ``batch_isend_irecv``), KV gathered per run of
          layers into staging on the cache's device. On CPU that group is gloo (vLLM's CPU platform); on an
          A3 it is HCCL and the bytes never touch host memory: this benchmark does not measure an A3.
  host    host memory over the gloo coordination group (the fallback).
  wire    one already gathered buffer over the gloo coordination group (no gather / scatter).

The engine side is a stand-in that hands out block ids (no vLLM); the receiver checks every byte. Per
path and payload (median of ``--reps`` after one warm-up, min-max given): round time (slowest of the two
ranks), KV bytes / time, and ``probe_GB_s`` = what :meth:`RebalanceCoordinator.measure_link` (the engine's
first-round measurement) reports on that path. A least-squares fit ``seconds = per_move_s + bytes /
bytes_per_s`` per path gives the figures of the move-vs-recompute model
(``qwen3_rl.rollout.rebalance.TransferCost``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch

from qwen3_rl.rollout.migration import (
    FinishedRemote,
    KVCacheSpec,
    RebalanceCoordinator,
    RebalanceSettings,
    RequestState,
    TorchDistCommunicator,
    gather_kv_blocks,
)
from qwen3_rl.rollout.rebalance import MigrationPlan, Move, RankState, RebalanceConfig

BLOCK_TOKENS = 128  #: tokens per KV block (vLLM-Ascend's block size for the 235B rollout)
KV_HEADS_PER_RANK = 1  #: Qwen3-235B-A22B has 4 KV heads; TP4 leaves 1 per rank
HEAD_DIM = 128


class _StandInEngine:
    """Minimal :class:`~qwen3_rl.rollout.migration.EngineHooks`: one request, blocks ``0..n-1`` on both ranks."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, num_tokens: int) -> None:
        self.spec, self.num_blocks, self.num_tokens = spec, num_blocks, num_tokens

    def load_state(self, rank: int) -> RankState:  # not used: the plan is given
        return RankState(rank, (), (), 1, self.num_blocks)

    def export_request(self, req_id: str) -> tuple[RequestState, list[int]]:
        st = RequestState(req_id, 0, tuple(range(self.num_tokens)), (), {"temperature": 1.0}, None, None,
                          self.num_tokens, self.num_blocks)
        return st, list(range(self.num_blocks))

    def release_request(self, req_id: str) -> None:
        return None

    def allocate_blocks(self, state: RequestState) -> list[int]:
        return list(range(state.num_kv_blocks))

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.spec

    def import_request(self, state: RequestState, block_ids: list[int]) -> None:
        return None

    def pop_finished_remote(self) -> list[FinishedRemote]:
        return []

    def deliver(self, result: FinishedRemote) -> None:
        return None


def kv_spec(num_blocks: int, layers: int, seed: int | None) -> KVCacheSpec:
    """Paged KV caches: ``layers`` tensors ``(2, num_blocks, BLOCK_TOKENS, KV_HEADS_PER_RANK, HEAD_DIM)`` bf16,
    random from ``seed`` (None: zeros)."""
    shape = (2, num_blocks, BLOCK_TOKENS, KV_HEADS_PER_RANK, HEAD_DIM)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    caches = tuple(torch.randn(shape, generator=gen).to(torch.bfloat16) if gen is not None
                   else torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layers))
    return KVCacheSpec(caches, tuple(1 for _ in caches))


def _worker(rank: int, port: int, sizes_mb: list[float], reps: int, layers: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = TorchDistCommunicator(None, timeout_s=600.0)  # coordination group (and the host path's wire)
    # the device path's group: on vLLM's CPU platform the DP group's device group is a gloo group
    dev = TorchDistCommunicator(dist.new_group(ranks=[0, 1], backend="gloo"), timeout_s=600.0, batched=True)
    bytes_per_block = 2 * BLOCK_TOKENS * KV_HEADS_PER_RANK * HEAD_DIM * 2 * layers
    rows = []
    for mb in sizes_mb:
        nb = max(1, round(mb * 1e6 / bytes_per_block))
        spec = kv_spec(nb, layers, nb if rank == 0 else None)  # the receiver starts from zeros
        eng = _StandInEngine(spec, nb, nb * BLOCK_TOKENS - 1)
        plan = MigrationPlan(moves=(Move("r0|0", 0, 1, 2, nb),))
        ref = gather_kv_blocks(kv_spec(nb, layers, nb), list(range(nb))) if rank == 1 else None
        for path in ("device", "host"):
            coord = RebalanceCoordinator(eng, comm, RebalanceConfig(buckets=(1,), block_size=BLOCK_TOKENS),
                                         RebalanceSettings(enable=True, timeout_s=600.0, kv_path=path),
                                         kv_comm=dev if path == "device" else None, kv_path=path)
            if rank == 1:
                for c in spec.caches:
                    c.zero_()
            round_s = []
            for i in range(reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                coord._transfer(plan)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i:  # first repetition is a warm-up
                    round_s.append(float(dt))
            if rank == 1 and not torch.equal(gather_kv_blocks(spec, list(range(nb))), ref):
                raise RuntimeError(f"{path} path: received KV bytes differ from the sent ones")
            probe = coord.measure_link()  # what the engine measures and logs at its first round
            kv_bytes = nb * bytes_per_block
            r = statistics.median(round_s)
            rows.append({"path": path, "kv_bytes": kv_bytes, "blocks": nb, "round_s": r,
                         "round_bytes_per_s": kv_bytes / r, "round_spread_s": [min(round_s), max(round_s)],
                         "probe_bytes_per_s": probe})
            del coord
        # the wire alone: one gathered buffer over the coordination gloo group
        flat = gather_kv_blocks(spec, list(range(nb))) if rank == 0 else torch.zeros(nb * bytes_per_block,
                                                                                      dtype=torch.uint8)
        wire_s = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            comm.exchange([(1, flat)], [], "bench wire") if rank == 0 else comm.exchange([], [(0, flat)], "bench wire")
            dw = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dw, op=dist.ReduceOp.MAX)
            if i:
                wire_s.append(float(dw))
        if rank == 1 and not torch.equal(flat, ref):
            raise RuntimeError("wire: received bytes differ from the sent ones")
        w = statistics.median(wire_s)
        rows.append({"path": "wire", "kv_bytes": nb * bytes_per_block, "blocks": nb, "round_s": w,
                     "round_bytes_per_s": nb * bytes_per_block / w, "round_spread_s": [min(wire_s), max(wire_s)],
                     "probe_bytes_per_s": 0.0})
        del spec, eng, flat, ref
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(sizes_mb: list[float], reps: int = 5, layers: int = 94) -> list[dict[str, float]]:
    """Run the 2-process benchmark; one dict per payload (bytes, seconds, bytes/s)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, sizes_mb, reps, layers, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"benchmark process failed (exit codes {[p.exitcode for p in procs]})")
    return q.get()


def fit_line(rows: list[dict[str, float]], key: str = "round_s") -> tuple[float, float]:
    """Least-squares ``seconds = a + bytes / b`` over the rows; returns ``(a seconds, b bytes/s)``
    (b is inf when the time does not grow with the payload; one row: a = 0)."""
    x = [float(r["kv_bytes"]) for r in rows]
    y = [float(r[key]) for r in rows]
    if len(rows) == 1:
        return 0.0, x[0] / y[0]
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((xi - mx) ** 2 for xi in x)
    slope = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, (1.0 / slope if slope > 0 else float("inf"))


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints the table (or JSON) and returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m qwen3_rl.tools.bench.kv_transfer", description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", default="6,25,100,400",
                   help="KV payloads per moved request, MB (1e6 B; rounded to whole 6.16 MB blocks)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per payload (after one warm-up)")
    p.add_argument("--layers", type=int, default=94, help="KV cache tensors (Qwen3-235B-A22B: 94 layers)")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    sizes = [float(x) for x in ns.sizes_mb.split(",") if x.strip()]
    if not sizes or min(sizes) <= 0 or ns.reps < 1 or ns.layers < 1:
        p.error("--sizes-mb must be positive numbers, --reps and --layers >= 1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rows = measure(sizes, ns.reps, ns.layers)
    paths = ("device", "host", "wire")
    fits = {path: fit_line([r for r in rows if r["path"] == path]) for path in paths}
    if ns.json:
        print(json.dumps({"layers": ns.layers, "reps": ns.reps, "torch": torch.__version__, "rows": rows,
                          "fit": {k: {"per_move_s": a, "bytes_per_s": b} for k, (a, b) in fits.items()}}, indent=1))
        return 0
    print(f"2 processes on 127.0.0.1, {ns.layers} KV tensors, torch {torch.__version__}, median of {ns.reps} "
          "(min-max in brackets)")
    print("device = DP group's device group (gloo on CPU; HCCL on an A3), batched P2P from the cache tensors; "
          "host = host memory over the gloo coordination group; wire = one gathered buffer over gloo")
    print(f"{'path':<7} {'kv_MB':>9} {'blocks':>6} {'round_ms':>9} {'(min-max)':>17} {'GB_s':>7} {'probe_GB_s':>10}")
    for r in rows:
        lo, hi = r["round_spread_s"]
        probe = f"{r['probe_bytes_per_s'] / 1e9:>10.3f}" if r["probe_bytes_per_s"] else f"{'-':>10}"
        print(f"{r['path']:<7} {r['kv_bytes'] / 1e6:>9.1f} {r['blocks']:>6d} {1e3 * r['round_s']:>9.2f} "
              f"{f'({1e3 * lo:.1f}-{1e3 * hi:.1f})':>17} {r['round_bytes_per_s'] / 1e9:>7.3f} {probe}")
    for k, (a, b) in fits.items():
        print(f"fit {k:<6}: {1e3 * a:.2f} ms per transfer + bytes / {b / 1e9:.3f} GB/s")
    print("GB_s = KV bytes / time (one sender, one receiver); probe_GB_s = the engine's first-round figure "
          "(bytes sent + received per rank / time, both ranks sending)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
