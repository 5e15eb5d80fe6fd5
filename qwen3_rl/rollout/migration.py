"""Rollout rebalance between DP ranks at run time: load exchange, request-state packing, KV block transfer.

The planner (:mod:`qwen3_rl.rollout.rebalance`) decides *what* moves; this module moves it. One
:class:`RebalanceCoordinator` lives in every rollout process, next to its vLLM engine, and is called
by the engine loop every step (:meth:`RebalanceCoordinator.on_step`). Every ``interval_steps`` steps
all DP ranks run one round, in lockstep (vLLM's external-launcher DP already steps all DP ranks
together, ``vllm/v1/engine/llm_engine.py:195-206, 285-288``):

1. each rank reports its load (:class:`~qwen3_rl.rollout.rebalance.RankState`, from the engine hook)
   and the results of migrated requests it finished on behalf of another rank; one ``all_gather`` of
   these small objects (with a timeout) gives every rank the same view;
2. every rank computes the same :class:`~qwen3_rl.rollout.rebalance.MigrationPlan` (deterministic);
3. sources export each moving request (:class:`RequestState`: tokens, sampling params, seed and
   sampler generator state; a target's drafter rebuilds its state from the tokens); the state bytes go
   point-to-point over the (gloo) coordination group; targets allocate blocks; the KV blocks then go
   point-to-point over the KV path (:func:`move_kv_blocks`, batched ``isend``/``irecv``, each waited with
   a timeout) straight from the source's cache into the target's; sources release the request, targets
   import it;
4. results routed back in step 1 are delivered to the origin's front end, so the caller of
   ``LLM.generate`` on the origin rank gets every one of its requests back.

All engine access goes through :class:`EngineHooks` (implemented by the vLLM-side patch, or by a toy
engine in the tests); all communication through :class:`Communicator` (torch.distributed). Two paths
carry the KV (``RebalanceSettings.kv_path``): ``"device"`` (default) sends the blocks over the vLLM DP
group's device communicator (HCCL on an A3, NCCL on GPUs, gloo on vLLM's CPU platform), gathered on the
cache's device into bounded staging buffers, never through host memory; ``"host"`` copies them to host
memory and sends them over the gloo coordination group (the fallback when there is no device group).
The KV link is measured at the first round (:meth:`RebalanceCoordinator.measure_link`) unless configured,
and bounds each round by time (``max_round_s``). A collective or P2P operation that does not
complete within ``timeout_s`` raises :class:`RebalanceTimeoutError` naming the round, the operation
and the peers, instead of hanging.

With tensor parallelism under vLLM's external launcher every TP rank runs an identical scheduler;
each TP rank runs its own coordinator over the DP group of its TP index (same plan everywhere, since
the states are identical) and moves its own KV shard.
"""

from __future__ import annotations

import datetime
import json
import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from qwen3_rl.rollout.rebalance import (
    MigrationPlan,
    Move,
    RankState,
    RebalanceConfig,
    RebalanceSettings,
    plan_rebalance,
    round_config,
)

logger = logging.getLogger("qwen3_rl.rollout.rebalance")

#: bytes of one KV message (one request's blocks of a run of cache tensors); staging holds one message per
#: moving request and direction at a time
DEFAULT_KV_CHUNK_BYTES = 64 << 20
#: bytes each rank sends (and receives) when the first round measures the KV link
DEFAULT_PROBE_BYTES = 64 << 20

_MAGIC = b"QRRS"
_VERSION = 2  # 2: no drafter-state section
_HDR = struct.Struct("<4sIQ")  # magic, version, json header length (bytes)


class MigrationError(RuntimeError):
    """A request or its KV could not be packed, transferred or imported."""


class RebalanceTimeoutError(MigrationError):
    """A rebalance collective / point-to-point transfer did not complete in time (a peer is missing)."""


# ---------------------------------------------------------------------------------------------------
# request state
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestState:
    """Everything a target rank needs to continue a request where the source left it.

    ``prompt_token_ids`` / ``output_token_ids``: int token ids (shapes ``(P,)`` / ``(O,)``).
    ``sampling_params``: the request's own parameters as a JSON-serialisable dict (the vLLM hook converts
    ``SamplingParams`` with ``msgspec.structs.asdict``); ``seed`` its seed (None: unseeded).
    ``generator_state``: bytes of the per-request sampler generator (``torch.Generator.get_state()``) so a
    seeded request continues the same random stream; None for unseeded requests.
    ``num_computed_tokens``: tokens whose KV exists (0 for a waiting request); ``num_kv_blocks``: blocks
    that travel with it (a speculative-decoding drafter's state does not travel: the target's drafter
    rebuilds it from the request's tokens). ``origin_rank``: DP rank whose front end owns the request.
    ``extra``: engine-specific JSON-serialisable fields (arrival time, priority, ...).
    """

    req_id: str
    origin_rank: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling_params: dict[str, Any]
    seed: int | None = None
    generator_state: bytes | None = None
    num_computed_tokens: int = 0
    num_kv_blocks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def pack_request(state: RequestState) -> np.ndarray:
    """Serialise a :class:`RequestState` to bytes (no pickle): ``uint8`` array of shape ``(nbytes,)``.

    Layout: ``magic 'QRRS' | u32 version | u64 header length | JSON header | int64 prompt ids |
    int64 output ids | generator state`` (little endian).
    """
    prompt = np.asarray(state.prompt_token_ids, dtype="<i8")
    output = np.asarray(state.output_token_ids, dtype="<i8")
    gen = state.generator_state or b""
    header = {
        "req_id": state.req_id, "origin_rank": int(state.origin_rank), "sampling_params": state.sampling_params,
        "seed": state.seed, "num_computed_tokens": int(state.num_computed_tokens),
        "num_kv_blocks": int(state.num_kv_blocks), "extra": state.extra,
        "n_prompt": int(prompt.shape[0]), "n_output": int(output.shape[0]),
        "gen_bytes": len(gen) if state.generator_state is not None else -1,
    }
    try:
        hjson = json.dumps(header, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise MigrationError(f"request {state.req_id}: state is not JSON-serialisable: {e}") from e
    blob = b"".join([_HDR.pack(_MAGIC, _VERSION, len(hjson)), hjson, prompt.tobytes(), output.tobytes(), gen])
    return np.frombuffer(blob, dtype=np.uint8).copy()


def unpack_request(buf: np.ndarray | bytes) -> RequestState:
    """Inverse of :func:`pack_request`; raises :class:`MigrationError` on a malformed buffer."""
    raw = bytes(buf) if not isinstance(buf, np.ndarray) else buf.astype(np.uint8, copy=False).tobytes()
    if len(raw) < _HDR.size:
        raise MigrationError(f"request state too short ({len(raw)} bytes)")
    magic, version, hlen = _HDR.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION:
        raise MigrationError(f"not a request state (magic {magic!r}, version {version})")
    off = _HDR.size
    try:
        h = json.loads(raw[off:off + hlen])
    except ValueError as e:
        raise MigrationError(f"request state header is not valid JSON: {e}") from e
    off += hlen
    need = off + 8 * (h["n_prompt"] + h["n_output"]) + max(h["gen_bytes"], 0)
    if len(raw) != need:
        raise MigrationError(f"request {h.get('req_id')}: state has {len(raw)} bytes, header says {need}")
    prompt = np.frombuffer(raw, dtype="<i8", count=h["n_prompt"], offset=off)
    off += 8 * h["n_prompt"]
    output = np.frombuffer(raw, dtype="<i8", count=h["n_output"], offset=off)
    off += 8 * h["n_output"]
    gen = None
    if h["gen_bytes"] >= 0:
        gen, off = raw[off:off + h["gen_bytes"]], off + h["gen_bytes"]
    return RequestState(h["req_id"], h["origin_rank"], tuple(int(t) for t in prompt), tuple(int(t) for t in output),
                        h["sampling_params"], h["seed"], gen, h["num_computed_tokens"], h["num_kv_blocks"],
                        h["extra"])


# ---------------------------------------------------------------------------------------------------
# KV blocks
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCacheSpec:
    """The engine's KV cache tensors and, for each, the axis that indexes blocks.

    vLLM v1 attention layers hold e.g. ``(2, num_blocks, block_size, heads, head_dim)`` (block axis 1)
    or separate K and V tensors ``(num_blocks, block_size, heads, head_dim)`` (axis 0); any dtype.
    """

    caches: tuple[torch.Tensor, ...]
    block_axes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.caches) != len(self.block_axes) or not self.caches:
            raise MigrationError("KVCacheSpec needs one block axis per cache tensor (and at least one tensor)")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies over all cache tensors."""
        return sum(c.numel() // c.shape[a] * c.element_size() for c, a in zip(self.caches, self.block_axes,
                                                                             strict=True))


def gather_kv_blocks(spec: KVCacheSpec, block_ids: Sequence[int]) -> torch.Tensor:
    """Copy the given blocks of every cache into one flat ``uint8`` tensor of ``len(ids) * bytes_per_block``.

    Order: cache by cache, each ``index_select`` along its block axis (block order as given).
    """
    if not block_ids:
        return torch.empty(0, dtype=torch.uint8, device=spec.caches[0].device)
    parts = []
    for cache, axis in zip(spec.caches, spec.block_axes, strict=True):
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
        parts.append(cache.index_select(axis, idx).contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def kv_chunks(spec: KVCacheSpec, num_blocks: int, chunk_bytes: int) -> list[KVCacheSpec]:
    """Split ``spec``'s cache tensors into consecutive runs whose ``num_blocks`` blocks fit ``chunk_bytes``
    (at least one tensor per run): one KV message per run. Sender and receiver compute the same runs from
    the same block count (cache shapes are equal on all DP ranks)."""
    runs: list[KVCacheSpec] = []
    start, acc = 0, 0
    n = len(spec.caches)
    for i in range(n):
        one = KVCacheSpec((spec.caches[i],), (spec.block_axes[i],)).bytes_per_block * num_blocks
        if i > start and acc + one > chunk_bytes:
            runs.append(KVCacheSpec(spec.caches[start:i], spec.block_axes[start:i]))
            start, acc = i, 0
        acc += one
    runs.append(KVCacheSpec(spec.caches[start:n], spec.block_axes[start:n]))
    return runs


def move_kv_blocks(spec: KVCacheSpec, comm: Communicator, sends: Sequence[tuple[int, Sequence[int]]],
                   recvs: Sequence[tuple[int, Sequence[int]]], *, staging: torch.device | str | None = None,
                   chunk_bytes: int = DEFAULT_KV_CHUNK_BYTES, recv_spec: KVCacheSpec | None = None,
                   what: str = "KV blocks (P2P)") -> tuple[int, int]:
    """Move KV blocks between DP ranks: ``sends`` = ``(dst, my block ids)``, ``recvs`` = ``(src, my block ids
    to fill)``, each in plan order (both ends list the messages between two ranks in the same order).

    The cache tensors are cut into runs of at most ``chunk_bytes`` per request (:func:`kv_chunks`); step
    ``k`` gathers the blocks of run ``k`` of every outgoing request, one ``index_select`` per cache tensor,
    into staging on ``staging`` (None: the cache's device, i.e. no host copy), posts every send and
    receive of the step at once through ``comm.exchange`` (batched ``isend``/``irecv``: one message per
    request and cache tensor), waits, and writes what arrived into ``recv_spec`` (default ``spec``) with
    ``index_copy_``. Staging memory: one run per request and direction. Returns ``(bytes sent, bytes
    received)``.
    """
    rspec = recv_spec or spec
    dev = torch.device(staging) if staging is not None else spec.caches[0].device
    out_runs = [(dst, list(ids), kv_chunks(spec, len(ids), chunk_bytes)) for dst, ids in sends if len(ids)]
    in_runs = [(src, list(ids), kv_chunks(rspec, len(ids), chunk_bytes)) for src, ids in recvs if len(ids)]
    steps = max((len(r) for _, _, r in (*out_runs, *in_runs)), default=0)
    sent = received = 0
    for k in range(steps):
        # one message per (request, cache tensor): index_select is the only copy on the sending side
        step_sends: list[tuple[int, torch.Tensor]] = []
        for dst, ids, runs in out_runs:
            if k < len(runs):
                for cache, axis in zip(runs[k].caches, runs[k].block_axes, strict=True):
                    idx = torch.as_tensor(ids, dtype=torch.long, device=cache.device)
                    step_sends.append((dst, cache.index_select(axis, idx).to(dev)))
        step_recvs: list[tuple[int, torch.Tensor, torch.Tensor, int, torch.Tensor]] = []
        for src, ids, runs in in_runs:
            if k < len(runs):
                for cache, axis in zip(runs[k].caches, runs[k].block_axes, strict=True):
                    shape = list(cache.shape)
                    shape[axis] = len(ids)
                    step_recvs.append((src, torch.empty(shape, dtype=cache.dtype, device=dev), cache, axis,
                                       torch.as_tensor(ids, dtype=torch.long, device=cache.device)))
        comm.exchange(step_sends, [(src, buf) for src, buf, *_ in step_recvs], f"{what}, part {k + 1}/{steps}")
        for _, buf, cache, axis, idx in step_recvs:
            cache.index_copy_(axis, idx, buf.to(cache.device))
        sent += sum(t.numel() * t.element_size() for _, t in step_sends)
        received += sum(b.numel() * b.element_size() for _, b, *_ in step_recvs)
    return sent, received


def probe_link_time(spec: KVCacheSpec, kv_comm: Communicator, probe_bytes: int, chunk_bytes: int,
                    staging: torch.device | None) -> tuple[float, int, int]:
    """Collective over ``kv_comm``: send ``probe_bytes`` of this rank's KV blocks (read only) to the next rank and
    receive as much from the previous one into a scratch cache, twice. Returns (the faster time in s, bytes sent,
    bytes received)."""
    bpb = spec.bytes_per_block
    size, rank = kv_comm.size, kv_comm.rank
    avail = min(c.shape[a] for c, a in zip(spec.caches, spec.block_axes, strict=True))
    nb = max(1, min(avail, -(-probe_bytes // max(bpb, 1))))
    shapes = []
    for c, a in zip(spec.caches, spec.block_axes, strict=True):
        shape = list(c.shape)
        shape[a] = nb
        shapes.append(torch.zeros(shape, dtype=c.dtype, device=c.device))  # touched before the clock starts
    scratch = KVCacheSpec(tuple(shapes), spec.block_axes)
    ids = list(range(nb))
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    times = []
    out = inn = 0
    for _ in range(2):  # the faster of two: the first pays one-off set-up (buffers, connections)
        t0 = time.perf_counter()
        out, inn = move_kv_blocks(spec, kv_comm, [(nxt, ids)], [(prv, ids)], staging=staging,
                                  chunk_bytes=chunk_bytes, recv_spec=scratch, what="KV link probe (P2P)")
        times.append(time.perf_counter() - t0)
    return min(times), out, inn


def scatter_kv_blocks(spec: KVCacheSpec, block_ids: Sequence[int], flat: torch.Tensor) -> None:
    """Write a :func:`gather_kv_blocks` buffer into ``block_ids`` of every cache (in place)."""
    expect = len(block_ids) * spec.bytes_per_block
    if flat.numel() != expect:
        raise MigrationError(f"KV buffer has {flat.numel()} bytes, {len(block_ids)} blocks need {expect}")
    off = 0
    for cache, axis in zip(spec.caches, spec.block_axes, strict=True):
        shape = list(cache.shape)
        shape[axis] = len(block_ids)
        nbytes = int(np.prod(shape)) * cache.element_size()
        chunk = flat[off:off + nbytes].to(cache.device).view(cache.dtype).reshape(shape)
        cache.index_copy_(axis, torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device), chunk)
        off += nbytes


# ---------------------------------------------------------------------------------------------------
# communication
# ---------------------------------------------------------------------------------------------------
class Communicator(Protocol):
    """What the coordinator needs from the DP group (ranks are DP ranks ``0..size-1``)."""

    rank: int
    size: int

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order; raises :class:`RebalanceTimeoutError` on timeout."""
        ...

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 what: str) -> None:
        """Post all sends ``(dst, tensor)`` and receives ``(src, buffer)``, wait for all; timeout -> error."""
        ...


class TorchDistCommunicator:
    """:class:`Communicator` over a ``torch.distributed`` group (gloo on CPU; HCCL/NCCL device group).

    Args:
        group: the DP process group (None = the default group); its ranks are the DP ranks.
        timeout_s: seconds each collective / point-to-point wait may take before
            :class:`RebalanceTimeoutError`. The object all-gather relies on the group's own timeout,
            so create the group with ``timeout=`` no larger than this (see :func:`new_rebalance_group`).
    """

    def __init__(self, group: Any = None, timeout_s: float = 60.0, *, batched: bool = False) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self.batched = bool(batched)
        self.round = 0

    @property
    def backend(self) -> str:
        """The group's backend (``gloo``, ``hccl``, ``nccl``), for the log."""
        return str(self._dist.get_backend(self.group))

    def _global(self, r: int) -> int:
        return r if self.group is None else self._dist.get_global_rank(self.group, r)

    def _fail(self, what: str, peers: Sequence[int], err: BaseException | None) -> RebalanceTimeoutError:
        return RebalanceTimeoutError(
            f"rollout rebalance round {self.round}, DP rank {self.rank}: {what} with DP rank(s) "
            f"{sorted(set(peers))} did not complete within {self.timeout_s:g} s ({err or 'wait returned False'}); "
            "a DP rank probably left the engine loop or skipped this round (all ranks must call on_step "
            "every engine step)")

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.size
        try:
            self._dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:  # gloo/hccl timeout or a closed connection
            raise self._fail(what, [r for r in range(self.size) if r != self.rank], e) from e
        return out

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 what: str) -> None:
        dist = self._dist
        works: list[tuple[Any, int]] = []
        try:
            # tag = position among the messages to / from the same peer: sender and receiver walk the
            # plan in the same order, so the k-th message A -> B matches B's k-th receive from A
            seq: dict[tuple[str, int], int] = {}
            ops: list[tuple[Any, torch.Tensor, int, int]] = []  # (isend | irecv, tensor, peer, tag)
            for dst, t in sends:
                tag = seq.setdefault(("s", dst), 0)
                seq["s", dst] = tag + 1
                ops.append((dist.isend, t, dst, tag))
            for src, t in recvs:
                tag = seq.setdefault(("r", src), 0)
                seq["r", src] = tag + 1
                ops.append((dist.irecv, t, src, tag))
            if self.batched and ops:  # one batch (device communicators group the P2P calls)
                reqs = dist.batch_isend_irecv([dist.P2POp(op, t, self._global(peer), self.group, tag)
                                               for op, t, peer, tag in ops])
                works = list(zip(reqs, [peer for _, _, peer, _ in ops], strict=True))
            else:
                for op, t, peer, tag in ops:
                    key = "dst" if op is dist.isend else "src"
                    works.append((op(t, **{key: self._global(peer)}, group=self.group, tag=tag), peer))
            for w, peer in works:
                if w is not None and not w.wait(timeout=datetime.timedelta(seconds=self.timeout_s)):
                    raise self._fail(what, [peer], None)
        except RuntimeError as e:
            if isinstance(e, RebalanceTimeoutError):
                raise
            raise self._fail(what, [p for _, p in works] or [p for p, _ in (*sends, *recvs)], e) from e


def new_rebalance_group(ranks: Sequence[int] | None = None, timeout_s: float = 60.0, backend: str = "gloo") -> Any:
    """A process group for the coordinator's load exchange with ``timeout_s`` on every operation."""
    import torch.distributed as dist

    return dist.new_group(ranks=list(ranks) if ranks is not None else None,
                          timeout=datetime.timedelta(seconds=timeout_s), backend=backend)


def _pair_order(moves: Sequence[Move], me: int) -> tuple[list[Move], list[Move]]:
    """My outgoing and incoming moves, each in plan order, so sender and receiver post the same
    sequence of messages per peer (tags are positions within that sequence)."""
    return [m for m in moves if m.src == me], [m for m in moves if m.dst == me]


# ---------------------------------------------------------------------------------------------------
# engine side
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FinishedRemote:
    """A migrated request finished on a host rank, to be delivered to its origin's front end.

    ``output_token_ids``: all tokens generated (on every rank it visited); ``finish_reason``: e.g.
    ``"length"``/``"stop"``; ``extra``: JSON-serialisable (logprobs, stop reason, ...)."""

    req_id: str
    origin_rank: int
    output_token_ids: tuple[int, ...]
    finish_reason: str
    extra: dict[str, Any] = field(default_factory=dict)


class EngineHooks(Protocol):
    """What the engine (vLLM scheduler + worker, or a toy engine) provides to the coordinator.

    An engine whose KV cache lives in other processes (the model workers behind a vLLM engine core) also has an
    attribute ``remote_kv`` with ``move_kv(sends, recvs, chunk_bytes, what) -> (bytes sent, bytes received)`` and
    ``probe_link(probe_bytes, chunk_bytes) -> (seconds, bytes sent, bytes received)``: the coordinator then hands
    the KV moves of a round and the link probe to it (``kv_cache_spec`` need only give ``bytes_per_block``).
    """

    def load_state(self, rank: int) -> RankState:
        """Waiting (FCFS order) and running requests with token counts and KV blocks held; capacities."""
        ...

    def export_request(self, req_id: str) -> tuple[RequestState, list[int]]:
        """The request's state and the KV block ids it holds (``[]`` for a waiting request)."""
        ...

    def release_request(self, req_id: str) -> None:
        """Remove the (exported, sent) request from the scheduler and free its blocks; the front end
        keeps waiting for it (the coordinator delivers its result later)."""
        ...

    def allocate_blocks(self, state: RequestState) -> list[int]:
        """Reserve ``state.num_kv_blocks`` blocks for an incoming request; raise if impossible."""
        ...

    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache tensors and their block axes."""
        ...

    def import_request(self, state: RequestState, block_ids: list[int]) -> None:
        """Insert an incoming request: running with ``block_ids`` holding its KV, or waiting if none."""
        ...

    def pop_finished_remote(self) -> list[FinishedRemote]:
        """Requests of other origins that finished here since the last call (and are removed here)."""
        ...

    def deliver(self, result: FinishedRemote) -> None:
        """Hand a returned result of one of this rank's own requests to the front end."""
        ...


@dataclass(frozen=True)
class RoundReport:
    """What one round did on this rank (``kv_path``: the path the KV took; ``link_gb_s``: the link the
    round planned with)."""

    round: int
    plan: MigrationPlan
    sent: tuple[str, ...]
    received: tuple[str, ...]
    delivered: tuple[str, ...]
    kv_bytes_sent: int
    kv_bytes_received: int
    recomputed: tuple[str, ...] = ()
    kv_path: str = "host"
    link_gb_s: float = 0.0


class RebalanceCoordinator:
    """Runs rebalance rounds for one DP rank (see the module docstring for the protocol).

    Args:
        hooks: the engine.
        comm: the coordination group (gloo): load exchange, request sizes and states.
        cfg: planner config (buckets, block size, move budgets).
        settings: the switches.
        kv_comm: the KV path's group (the DP group's device communicator, ``batched``); None = the host path
            over ``comm``.
        kv_path: ``"device"`` or ``"host"`` (what the log and the reports name; ``"device"`` needs
            ``kv_comm``).

    Bookkeeping: ``away`` = this rank's own requests currently served elsewhere (their results not back
    yet); :meth:`has_pending` must be OR-ed into the engine's "has unfinished requests" so the DP ranks
    keep stepping (and running rounds) until every result is home.
    """

    def __init__(self, hooks: EngineHooks, comm: Communicator, cfg: RebalanceConfig,
                 settings: RebalanceSettings, *, kv_comm: Communicator | None = None,
                 kv_path: str | None = None, chunk_bytes: int = DEFAULT_KV_CHUNK_BYTES,
                 probe_bytes: int = DEFAULT_PROBE_BYTES) -> None:
        self.hooks, self.comm, self.cfg, self.settings = hooks, comm, cfg, settings
        self.kv_path = kv_path or ("device" if kv_comm is not None else "host")
        if self.kv_path == "device" and kv_comm is None:
            raise MigrationError("the device KV path needs the DP group's device communicator (kv_comm)")
        self.kv_comm: Communicator = kv_comm if (kv_comm is not None and self.kv_path == "device") else comm
        if self.kv_comm.rank != comm.rank or self.kv_comm.size != comm.size:
            raise MigrationError(f"KV group rank {self.kv_comm.rank}/{self.kv_comm.size} differs from the "
                                 f"coordination group's {comm.rank}/{comm.size}")
        self.chunk_bytes, self.probe_bytes = int(chunk_bytes), int(probe_bytes)
        self.rank = comm.rank
        self.rounds = 0
        self.away: set[str] = set()
        self.reports: list[RoundReport] = []
        #: KV link, bytes sent + received per second and rank (configured, or measured at the first round)
        self.link_bytes_per_s: float | None = settings.kv_link_gb_s * 1e9 if settings.kv_link_gb_s > 0 else None

    @property
    def staging(self) -> torch.device | None:
        """Where KV messages are staged: the cache's device (device path) or host memory."""
        return None if self.kv_path == "device" else torch.device("cpu")

    def has_pending(self) -> bool:
        """True while some of this rank's requests are served by another rank."""
        return bool(self.away)

    def on_step(self, step: int) -> RoundReport | None:
        """Call after every engine step (``step`` counts from 1, equal on all DP ranks)."""
        if not self.settings.enable or step % self.settings.interval_steps:
            return None
        return self.run_round()

    def measure_link(self) -> float:
        """Measure the KV path (collective: every DP rank calls it): each rank sends ``probe_bytes`` of its
        own KV blocks (read only) to the next rank and receives as much from the previous one into a
        scratch cache, through :func:`move_kv_blocks`, twice; link = bytes sent + received / the slowest
        rank's faster time. Returns bytes/s (the same on every rank) and logs it."""
        size = self.comm.size
        if size < 2:
            return float("inf")
        remote = getattr(self.hooks, "remote_kv", None)
        if remote is not None:  # the KV lives in worker processes: they probe the link
            dt, out, inn = remote.probe_link(self.probe_bytes, self.chunk_bytes)
        else:
            dt, out, inn = probe_link_time(self.hooks.kv_cache_spec(), self.kv_comm, self.probe_bytes,
                                           self.chunk_bytes, self.staging)
        slowest = max(float(x) for x in self.comm.all_gather_object(dt, "KV link probe time (all_gather)"))
        link = (out + inn) / max(slowest, 1e-9)
        logger.info("rollout rebalance: DP rank %d, KV path %s (%s): measured %.3f GB/s (bytes sent + received "
                    "per second; %d + %d bytes in %.3f s, slowest rank)", self.rank, self.kv_path,
                    getattr(self.kv_comm, "backend", "?"), link / 1e9, out, inn, slowest)
        return link

    def run_round(self) -> RoundReport:
        """One round: gather loads and returns, plan, transfer, import, deliver."""
        me = self.rank
        self.rounds += 1
        for c in {id(self.comm): self.comm, id(self.kv_comm): self.kv_comm}.values():
            if hasattr(c, "round"):
                c.round = self.rounds
        if self.link_bytes_per_s is None:
            self.link_bytes_per_s = self.measure_link()
        state = self.hooks.load_state(me)
        if state.rank != me:
            raise MigrationError(f"load_state returned rank {state.rank} on DP rank {me}")
        returns = [(f.origin_rank, f) for f in self.hooks.pop_finished_remote()]
        bpb = int(self.hooks.kv_cache_spec().bytes_per_block)
        gathered = self.comm.all_gather_object({"state": state, "returns": returns, "away": len(self.away),
                                                "kv_bytes_per_block": bpb}, "load exchange (all_gather)")
        delivered = []
        for g in gathered:
            for origin, res in g["returns"]:
                if origin == me:
                    if res.req_id not in self.away:
                        raise MigrationError(f"DP rank {me}: result for {res.req_id} that is not away from here")
                    self.away.discard(res.req_id)
                    self.hooks.deliver(res)
                    delivered.append(res.req_id)
        # every rank plans with the same figures: the largest block size of the group (equal in practice)
        cfg = self.round_config(max(int(g["kv_bytes_per_block"]) for g in gathered))
        plan = plan_rebalance([g["state"] for g in gathered], cfg)
        sent, received, kv_out, kv_in = self._transfer(plan)
        rep = RoundReport(self.rounds, plan, tuple(sent), tuple(received), tuple(delivered), kv_out, kv_in,
                          tuple(m.req_id for m in plan.moves if m.recompute and me in (m.src, m.dst)),
                          self.kv_path, (self.link_bytes_per_s or 0.0) / 1e9)
        self.reports.append(rep)
        return rep

    def round_config(self, kv_bytes_per_block: int) -> RebalanceConfig:
        """Planner config of one round (:func:`qwen3_rl.rollout.rebalance.round_config`, as the simulator
        makes it): the time bound ``settings.max_round_s`` on the measured or configured link, the optional
        byte cap, the move-vs-recompute cost model (unless the configured planner config carries its own)."""
        st = self.settings
        link = self.link_bytes_per_s if self.link_bytes_per_s is not None else st.kv_link_gb_s * 1e9
        return round_config(self.cfg, kv_bytes_per_block=kv_bytes_per_block, link_bytes_per_s=link,
                            prefill_tokens_per_s=st.prefill_tokens_per_s, max_round_s=st.max_round_s,
                            max_kv_bytes=st.max_kv_bytes)

    def _transfer(self, plan: MigrationPlan) -> tuple[list[str], list[str], int, int]:
        me = self.rank
        outgoing, incoming = _pair_order(plan.moves, me)
        if not outgoing and not incoming:
            return [], [], 0, 0
        spec = self.hooks.kv_cache_spec()
        # stage 1: request states (sizes first) over the coordination group
        packed, out_blocks, origins = [], [], []
        for m in outgoing:
            st, blocks = self.hooks.export_request(m.req_id)
            if m.recompute:  # travels without KV: the target queues it to recompute its prefix (as a preemption)
                status = "preempted" if st.output_token_ids else "waiting"
                st, blocks = replace(st, num_computed_tokens=0, num_kv_blocks=0,
                                     extra={**st.extra, "status": status}), []
            origins.append(st.origin_rank)
            if st.req_id != m.req_id or len(blocks) != m.kv_blocks:
                raise MigrationError(f"DP rank {me}: export of {m.req_id} gave {st.req_id} with {len(blocks)} "
                                     f"blocks, plan says {m.kv_blocks}")
            packed.append(torch.from_numpy(pack_request(st)))
            out_blocks.append(list(blocks))
        sizes_out = [torch.tensor([p.numel()], dtype=torch.int64) for p in packed]
        sizes_in = [torch.zeros(1, dtype=torch.int64) for _ in incoming]
        self.comm.exchange([(m.dst, s) for m, s in zip(outgoing, sizes_out, strict=True)],
                           [(m.src, s) for m, s in zip(incoming, sizes_in, strict=True)], "request sizes (P2P)")
        st_in = [torch.empty(int(s[0]), dtype=torch.uint8) for s in sizes_in]
        self.comm.exchange([(m.dst, p) for m, p in zip(outgoing, packed, strict=True)],
                           [(m.src, b) for m, b in zip(incoming, st_in, strict=True)], "request states (P2P)")
        # stage 2: targets reserve blocks; the KV goes from the source's blocks into the target's
        states, in_blocks = [], []
        for m, sb in zip(incoming, st_in, strict=True):
            st = unpack_request(sb.numpy())
            if st.req_id != m.req_id or st.num_kv_blocks != m.kv_blocks:
                raise MigrationError(f"DP rank {me}: expected {m.req_id} with {m.kv_blocks} KV blocks from rank "
                                     f"{m.src}, got {st.req_id} with {st.num_kv_blocks}")
            blocks = self.hooks.allocate_blocks(st) if st.num_kv_blocks else []
            if len(blocks) != st.num_kv_blocks:
                raise MigrationError(f"DP rank {me}: got {len(blocks)} blocks for {st.req_id}, need {st.num_kv_blocks}")
            states.append(st)
            in_blocks.append(blocks)
        kv_sends = [(m.dst, b) for m, b in zip(outgoing, out_blocks, strict=True)]
        kv_recvs = [(m.src, b) for m, b in zip(incoming, in_blocks, strict=True)]
        remote = getattr(self.hooks, "remote_kv", None)
        if remote is not None:  # the workers of both ends move their KV (shards) themselves
            kv_out, kv_in = remote.move_kv(kv_sends, kv_recvs, self.chunk_bytes,
                                           f"KV blocks over the {self.kv_path} path (P2P)")
        else:
            kv_out, kv_in = move_kv_blocks(spec, self.kv_comm, kv_sends, kv_recvs, staging=self.staging,
                                           chunk_bytes=self.chunk_bytes,
                                           what=f"KV blocks over the {self.kv_path} path (P2P)")
        for m in outgoing:
            self.hooks.release_request(m.req_id)
        received = []
        for st, blocks in zip(states, in_blocks, strict=True):
            self.hooks.import_request(st, blocks)
            received.append(st.req_id)
            if st.origin_rank == me:
                self.away.discard(st.req_id)  # one of ours came back home: served here again
        for m, origin in zip(outgoing, origins, strict=True):
            if origin == me:  # a foreign request moving on stays in its origin's ledger
                self.away.add(m.req_id)
        return [m.req_id for m in outgoing], received, kv_out, kv_in


# ---------------------------------------------------------------------------------------------------
# rollout config switch (the verl seam's engine_built hook applies it after building vllm.LLM)
# ---------------------------------------------------------------------------------------------------
#: attribute the vLLM engine-loop hook sets on ``LLMEngine`` when it can run a coordinator
ENGINE_HOOK_ATTR = "qwen3_rl_rebalance_hook"


def apply_rebalance_settings(settings: RebalanceSettings, llm: Any) -> RebalanceSettings:
    """Hand validated settings to a ``vllm.LLM``'s engine-loop hook (the seam's ``engine_built`` hook).

    Off: touches nothing. On: the engine must carry the hook, else :class:`MigrationError`."""
    if not settings.enable:
        return settings
    engine = getattr(llm, "llm_engine", None)
    hook = getattr(engine, ENGINE_HOOK_ATTR, None)
    if hook is None:
        raise MigrationError(
            "qwen3_rl.rollout_rebalance.enable=True needs the vLLM engine-loop hook that runs the "
            "rebalance coordinator inside LLMEngine.step; this vLLM build has none (apply the recipe's "
            "patches/vllm/0003-vllm-feature-extension_seam.patch and the qwen3_rl vllm.general_plugins entry point, see docs/rollout_balancing.md) or switch "
            "rollout_rebalance off.")
    hook.configure(settings, settings.max_moves)
    return settings
