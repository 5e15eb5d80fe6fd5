"""Weight sync between the trainer's pool and the rollout's: a stateless collective group (its own TCP store, not
``torch.distributed``'s default group, which both sides already use for Megatron / vLLM) of the trainer's rank 0
(root) and every rollout worker; the trainer's export (HF names, one tensor at a time) goes out in buckets of
same-dtype tensors flattened into one buffer.

The backend is chosen in one place, :func:`collective_backend`: gloo on CPU (run here), HCCL on an Ascend NPU
through torch_npu's ``ProcessGroupHCCL`` (not run here: no NPU on the CPU machines; Ray 2.52.1's
``ray.util.collective`` has no HCCL backend, which is why the group is torch's own).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

#: default bucket size in bytes (one broadcast per bucket)
BUCKET_BYTES = 256 << 20


def collective_backend(device: str) -> str:
    """The collective backend of the weight-sync group for the workers' device: ``"gloo"`` on ``cpu``,
    ``"hccl"`` on ``npu``, ``"nccl"`` on ``cuda``; anything else stops with one line."""
    table = {"cpu": "gloo", "npu": "hccl", "cuda": "nccl"}
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


def make_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = 1800.0,
               listen_fd: int | None = None) -> Any:
    """A process group of ``world`` ranks outside torch's default group: a TCP store served by rank 0 at
    ``host:port`` and a gloo (CPU) or HCCL (NPU) backend on it. Every rank must call it (they meet in the store).
    ``listen_fd`` (rank 0): a socket already bound to ``port`` (:func:`bound_socket`) the store serves on, so the
    port is never free between its choice and the store."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    extra = {} if listen_fd is None or rank != 0 else {"master_listen_fd": listen_fd}
    store = dist.PrefixStore("qwen3_rl_weight_sync",
                             dist.TCPStore(host, port, world, rank == 0, timeout=timeout, **extra))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend == "hccl":  # Ascend: torch_npu's backend on the same store (not run on the CPU machines)
        import torch_npu  # noqa: F401  (registers the backend)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, world, options)
    raise ValueError(f"weight sync: backend '{backend}' not supported")


def specs_of(named: Iterable[tuple[str, Any]]) -> list[TensorSpec]:
    """The :class:`TensorSpec` of each ``(name, tensor)``."""
    return [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]


def send(group: Any, named: Iterable[tuple[str, Any]], specs: Sequence[TensorSpec], buckets: Sequence[Sequence[int]],
         device: str = "cpu") -> list[float]:
    """Root side (rank 0): broadcast the tensors of ``named`` (the export, in ``specs`` order) bucket by bucket;
    returns each tensor's float64 sum (a checksum the receivers' must equal)."""
    import torch

    sums: list[float] = []
    it = iter(named)
    for bucket in buckets:
        parts = []
        for i in bucket:
            name, t = next(it)
            if name != specs[i].name or tuple(t.shape) != specs[i].shape:
                raise RuntimeError(f"weight sync: export gave {name} {tuple(t.shape)}, the plan has {specs[i]}")
            t = t.detach().to(device).contiguous().view(-1)
            sums.append(float(t.double().sum()))
            parts.append(t)
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        group.broadcast(flat, 0).wait()
    return sums


def receive(group: Any, specs: Sequence[TensorSpec], buckets: Sequence[Sequence[int]], device: str = "cpu"
            ) -> Iterator[tuple[str, Any]]:
    """Receiver side: yield ``(name, tensor)`` in ``specs`` order as the root broadcasts each bucket."""
    import torch

    for bucket in buckets:
        dtype = getattr(torch, specs[bucket[0]].dtype)
        flat = torch.empty(sum(specs[i].numel for i in bucket), dtype=dtype, device=device)
        group.broadcast(flat, 0).wait()
        off = 0
        for i in bucket:
            s = specs[i]
            yield s.name, flat[off:off + s.numel].view(s.shape)
            off += s.numel
