"""Weight sync between the trainer's pool and the rollout's: a stateless collective group (its own TCP store, not
``torch.distributed``'s default group, which both sides already use for Megatron / vLLM) of the trainer's rank 0
(root) and every rollout worker; the trainer's export (HF names, one tensor at a time) goes out in buckets of
same-dtype tensors flattened into one buffer.

The backend is chosen in one place, :func:`collective_backend`, from the device the trainer's rank 0 worker reports
for its weights, never by probing devices where the choice runs (the driver is a Ray actor without devices): gloo
on CPU (run here), HCCL on an Ascend NPU through torch_npu's ``ProcessGroupHCCL`` (not run here: no NPU on the CPU
machines; Ray 2.52.1's ``ray.util.collective`` has no HCCL backend, which is why the group is torch's own). Both
sides put the tensors on the device of the group's backend (:attr:`SyncGroup.device`).

Each tensor's check is :func:`byte_checksum`: exact integer sums over its raw bytes, computed on the device in
bounded chunks (no float64 copy of the weight; equal bytes give equal sums whatever the reduction order).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

#: default bucket size in bytes (one broadcast per bucket)
BUCKET_BYTES = 256 << 20
#: the device each backend moves tensors on
BACKEND_DEVICE = {"gloo": "cpu", "hccl": "npu", "nccl": "cuda"}
#: 16-bit words per step of :func:`byte_checksum` (its int64 working tensors: 3 x 32 MiB)
CHECKSUM_CHUNK = 1 << 22
#: the position weights of :func:`byte_checksum` cycle with this period (the largest prime below 2**16)
CHECKSUM_PERIOD = 65521
#: seconds :func:`gather_sync` waits, after a call failed, for Ray to report a dead process behind the failure
DEATH_GRACE_S = 5.0


def collective_backend(device: str) -> str:
    """The collective backend of the weight-sync group for the workers' device: ``"gloo"`` on ``cpu``,
    ``"hccl"`` on ``npu``, ``"nccl"`` on ``cuda``; anything else stops with one line."""
    table = {device: backend for backend, device in BACKEND_DEVICE.items()}
    if device not in table:
        raise ValueError(f"weight sync: no collective backend for device '{device}' (known: {sorted(table)})")
    return table[device]


@dataclass(frozen=True)
class TensorSpec:
    """One exported tensor: its HF name, shape and dtype name (``"float32"``, ``"bfloat16"``, ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


def plan_buckets(specs: Sequence[TensorSpec], itemsize: dict[str, int], bucket_bytes: int = BUCKET_BYTES
                 ) -> list[list[int]]:
    """Group the export's tensors (indices into ``specs``, in order) into buckets: consecutive tensors of one dtype
    whose bytes sum to at most ``bucket_bytes`` (a larger tensor gets a bucket of its own). ``itemsize``: bytes
    per element of each dtype name."""
    buckets: list[list[int]] = []
    size = 0
    for i, s in enumerate(specs):
        nbytes = s.numel * itemsize[s.dtype]
        if buckets and specs[buckets[-1][0]].dtype == s.dtype and size + nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


def bound_socket() -> tuple[int, int]:
    """A TCP socket bound to a free port on every interface, for rank 0's store (:func:`make_group`'s
    ``listen_fd``): (its file descriptor, now owned by the caller; the port)."""
    import socket

    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    return s.detach(), port


@dataclass(frozen=True)
class SyncGroup:
    """The weight-sync process group, its backend and the device its tensors must be on."""

    pg: Any
    backend: str

    @property
    def device(self) -> str:
        return BACKEND_DEVICE[self.backend]


def make_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = 1800.0,
               listen_fd: int | None = None) -> SyncGroup:
    """A process group of ``world`` ranks outside torch's default group: a TCP store served by rank 0 at
    ``host:port`` and a gloo (CPU) or HCCL (NPU) backend on it. Every rank must call it (they meet in the store).
    ``listen_fd`` (rank 0): a socket already bound to ``port`` (:func:`bound_socket`) the store serves on, so the
    port is never free between its choice and the store."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend not in ("gloo", "hccl"):
        raise ValueError(f"weight sync: backend '{backend}' not supported")
    extra = {} if listen_fd is None or rank != 0 else {"master_listen_fd": listen_fd}
    store = dist.PrefixStore("qwen3_rl_weight_sync",
                             dist.TCPStore(host, port, world, rank == 0, timeout=timeout, **extra))
    if backend == "gloo":
        return SyncGroup(dist.ProcessGroupGloo(store, rank, world, timeout), backend)
    # Ascend: torch_npu's backend on the same store (not run on the CPU machines)
    import torch_npu  # noqa: F401  (registers the backend)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    return SyncGroup(ProcessGroupHCCL(store, rank, world, options), backend)


def byte_checksum(t: Any) -> tuple[int, int]:
    """An exact check of a tensor's raw bytes (row-major order, as ``.contiguous()`` lays them out), computed on
    the tensor's device without a float copy: the bytes read as 16-bit signed words ``x_i`` (single bytes for
    1-byte dtypes), ``(sum x_i, sum w_i x_i)`` with ``w_i = i mod CHECKSUM_PERIOD + 1``, in int64 chunks of
    ``CHECKSUM_CHUNK`` words (no overflow: |w x| < 2**31, 2**22 terms) added up as Python ints. Integer sums do not
    depend on the reduction order, so equal bytes give equal results on any device and for any shape or view;
    any change of one word changes the first sum, a swap of two different words the second (unless their
    positions are a multiple of CHECKSUM_PERIOD apart). Memory: 3 x 8 bytes x CHECKSUM_CHUNK (96 MiB)."""
    import torch

    flat = t.detach().contiguous().view(-1)
    words = flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)
    s1 = s2 = 0
    for lo in range(0, words.numel(), CHECKSUM_CHUNK):
        x = words[lo:lo + CHECKSUM_CHUNK].to(torch.int64)
        w = torch.arange(lo, lo + x.numel(), dtype=torch.int64, device=x.device).remainder_(CHECKSUM_PERIOD).add_(1)
        s1 += int(x.sum())
        s2 += int(w.mul_(x).sum())
    return s1, s2


def specs_of(named: Iterable[tuple[str, Any]]) -> list[TensorSpec]:
    """The :class:`TensorSpec` of each ``(name, tensor)``."""
    return [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]


def send(group: SyncGroup, named: Iterable[tuple[str, Any]], specs: Sequence[TensorSpec],
         buckets: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Root side (rank 0): broadcast the tensors of ``named`` (the export, in ``specs`` order) bucket by bucket, on
    the group's device; returns each tensor's :func:`byte_checksum` (the receivers' must equal it)."""
    import torch

    sums: list[tuple[int, int]] = []
    it = iter(named)
    for bucket in buckets:
        parts = []
        for i in bucket:
            name, t = next(it)
            if name != specs[i].name or tuple(t.shape) != specs[i].shape:
                raise RuntimeError(f"weight sync: export gave {name} {tuple(t.shape)}, the plan has {specs[i]}")
            t = t.detach().to(group.device).contiguous().view(-1)
            sums.append(byte_checksum(t))
            parts.append(t)
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        group.pg.broadcast(flat, 0).wait()
    return sums


def receive(group: SyncGroup, specs: Sequence[TensorSpec], buckets: Sequence[Sequence[int]]
            ) -> Iterator[tuple[str, Any]]:
    """Receiver side: yield ``(name, tensor)`` in ``specs`` order, on the group's device, as the root broadcasts
    each bucket."""
    import torch

    for bucket in buckets:
        dtype = getattr(torch, specs[bucket[0]].dtype)
        flat = torch.empty(sum(specs[i].numel for i in bucket), dtype=dtype, device=group.device)
        group.pg.broadcast(flat, 0).wait()
        off = 0
        for i in bucket:
            s = specs[i]
            yield s.name, flat[off:off + s.numel].view(s.shape)
            off += s.numel


def gather_sync(send_refs: Sequence[Any], recv_refs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Wait for one sync's Ray calls: the trainer ranks' sends (``send_refs``) and the rollout workers' receives
    (``recv_refs``), in the order they finish. The first failure ends the wait at once with one line naming the
    side (a dead rollout worker: its reference fails with ``RayActorError`` while the trainer's send may still block
    in the collective, which on HCCL notices a dead peer only at the group's timeout). Returns the values of
    ``send_refs`` and of ``recv_refs``, each in order."""
    import ray

    refs = [*send_refs, *recv_refs]
    names = [f"trainer rank {i}" for i in range(len(send_refs))] + [f"rollout worker {i}" for i in range(len(recv_refs))]
    values: list[Any] = [None] * len(refs)
    pending = {ref: i for i, ref in enumerate(refs)}

    def died(i: int, e: BaseException) -> RuntimeError:
        return RuntimeError(f"weight sync: {names[i]} died during the sync ({type(e).__name__}); "
                            f"{len(pending)} of {len(refs)} calls unfinished, the run stops")

    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            i = pending.pop(ref)
            try:
                values[i] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise died(i, e) from None
            except ray.exceptions.RayTaskError as e:
                # a peer's death often surfaces first as the collective's error on another rank ("Connection
                # closed by peer"): name the dead process if Ray reports one within DEATH_GRACE_S
                deadline = time.monotonic() + DEATH_GRACE_S
                while pending and (left := deadline - time.monotonic()) > 0:
                    for ref2 in ray.wait(list(pending), num_returns=1, timeout=left)[0]:
                        j = pending.pop(ref2)
                        try:
                            ray.get(ref2)
                        except ray.exceptions.RayActorError as e2:
                            raise died(j, e2) from None
                        except ray.exceptions.RayError:
                            pass
                cause = getattr(e, "cause", None) or e
                last = (str(cause).strip().splitlines() or [""])[-1]
                raise RuntimeError(f"weight sync: {names[i]} failed: {type(cause).__name__}: {last}") from e
    return values[:len(send_refs)], values[len(send_refs):]
