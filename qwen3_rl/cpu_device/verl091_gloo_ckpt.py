"""Device-layer shim for verl 0.9.1's fully-async trainer on a CPU host: the weight sync between the trainer's and
the rollout's processes over a gloo group on host memory.

``CPU_CKPT_ENGINE_GLOO``: the fully-async trainer sends the actor's weights to the standalone rollout replicas
through a checkpoint engine (``verl/checkpoint_engine/base.py`` ``CheckpointEngineManager.update_weights``: prepare,
``build_topology``, ``init_process_group``, ``send_weights`` / ``receive_weights``, ``finalize``). verl's engines
for separate processes each need a device transport: ``nccl`` (cupy's NCCL, ``nccl_checkpoint_engine.py:22-23``; on
Ascend verl registers its HCCL engine under that name, ``hccl_checkpoint_engine.py:103``), ``nixl`` / ``delta_sharded``
(cupy, CUDA buffers), ``kimi_ckpt_engine`` / ``mooncake`` (their own libraries); the one engine left on a host without
them, ``naive``, is the colocated hand-over within one process (``base.py:246-300``, its ``prepare`` raises). This
module is the host's collective in their place: backend ``cpu_gloo``, registered in verl's own registry
(``CheckpointEngineRegistry.register``, ``base.py:60``) when verl imports it through
``rollout.checkpoint_engine.custom_backend_module`` (``base.py:336``, ``:422``; ``workers/engine_workers.py:685``).
The CPU profile selects it (``internal/lib/tiny_cpu_layout.sh``, pin set current).

Topology as verl's HCCL engine's: the trainer's rank 0 sends (rank 0 of the group), its other ranks only consume the
weight generator (rank -1; the generator is collective over the trainer's ranks), rollout worker ``i`` is rank
``i + 1``. Per sync a fresh group: a ``TCPStore`` served by the sender on a free port, a ``ProcessGroupGloo`` on it
(the processes' default groups stay untouched). Per bucket two broadcasts: its table (pickled
:class:`~verl.checkpoint_engine.base.TensorMeta` list, uint8 [n_bytes]) after its length (int64 [1]), then the bucket
(uint8 [bucket bytes], at most ``update_weights_bucket_megabytes`` MiB); weights are cut into and merged from chunks
by verl's own ``split_weight_chunks`` / ``merge_weight_chunks``. A receiver's bucket is a fresh tensor each time, so
the weights it yields stay valid after the next bucket arrives.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)

BACKEND = "cpu_gloo"
TIMEOUT = timedelta(minutes=30)


@dataclass
class StoreAddress:
    """Where the sender serves the group's ``TCPStore``."""

    host: str
    port: int


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address().strip("[]")


@CheckpointEngineRegistry.register(BACKEND)
class GlooCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over a host gloo group (see the module docstring).

    Args:
        bucket_size: largest bucket in bytes (``update_weights_bucket_megabytes`` << 20).
        is_master: the trainer's rank 0 (the sender); verl passes it on the trainer's side only.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, **_: Any) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank: int | None = None
        self.world_size: int | None = None
        self.store: dist.TCPStore | None = None
        self.group: dist.ProcessGroup | None = None
        self.address: StoreAddress | None = None

    def prepare(self) -> StoreAddress | None:
        """The sender picks this sync's store address (returned to verl's manager); the others return None."""
        if not self.is_master:
            return None
        host = _node_ip()
        self.address = StoreAddress(host, _free_port(host))
        return self.address

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[Any]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Trainer rank 0 -> group rank 0, other trainer ranks -1 (not in the group), rollout worker i -> i + 1;
        ``metadata[0]`` is the trainer rank 0's :class:`StoreAddress`."""
        world = rollout_world_size + 1
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master_metadata": [metadata[0]] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master_metadata": [metadata[0]] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: StoreAddress) -> None:
        """Join this sync's gloo group (rank < 0: stay out of it) and wait for every member."""
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        self.store = dist.TCPStore(master_metadata.host, master_metadata.port, world_size, is_master=rank == 0,
                                   timeout=TIMEOUT)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, TIMEOUT)
        self._broadcast(torch.ones(1, dtype=torch.int8))  # a barrier: every member is in

    def finalize(self) -> None:
        """Drop the group and the store (a new one each sync)."""
        self.group = None
        self.store = None
        self.rank = self.world_size = None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        assert self.group is not None, "init_process_group first"
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()

    def _broadcast_table(self, table: list[TensorMeta] | None) -> list[TensorMeta]:
        """Group rank 0's bucket table to every member (length int64 [1], then the pickle uint8 [length])."""
        raw = pickle.dumps(table) if self.rank == 0 else b""
        size = torch.tensor([len(raw)], dtype=torch.int64)
        self._broadcast(size)
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(buf)
        return table if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def _send_bucket(self, table: list[TensorMeta], chunks: list[torch.Tensor], is_last: bool) -> None:
        self._broadcast_table([*table, is_last])  # the last entry: whether this is the last bucket
        bucket = torch.cat([c.reshape(-1).cpu() for c in chunks]) if chunks else torch.empty(0, dtype=torch.uint8)
        self._broadcast(bucket)

    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> None:
        """Trainer side: rank 0 broadcasts the weights bucket by bucket; the other trainer ranks consume them."""
        assert self.rank is not None and self.rank <= 0, "only the trainer's ranks send"
        if self.rank < 0:
            for _ in weights:
                pass
            return
        table: list[TensorMeta] = []
        chunks: list[torch.Tensor] = []
        offset = 0
        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            if offset + meta.chunk_size > self.bucket_size:
                self._send_bucket(table, chunks, is_last=False)
                table, chunks, offset = [], [], 0
            meta.offset = offset
            table.append(meta)
            chunks.append(chunk.clone())  # the generator may reuse its buffers
            offset += meta.chunk_size
        self._send_bucket(table, chunks, is_last=True)

    async def receive_weights(self, global_steps: int | None = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Rollout side: (name, tensor) of every weight, merged from the buckets' chunks."""
        async for name, weight in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, weight

    async def _receive_chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        assert self.rank is not None and self.rank > 0, "only the rollout's ranks receive"
        while True:
            *table, is_last = self._broadcast_table(None)
            bucket = torch.empty(sum(m.chunk_size for m in table), dtype=torch.uint8)
            self._broadcast(bucket)
            for meta in table:
                yield meta, bucket[meta.offset: meta.offset + meta.chunk_size]
            if is_last:
                return
