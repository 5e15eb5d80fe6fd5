"""MoE expert-weight resharding plan, Megatron training layout -> vLLM rollout layout, for one all-to-allv.

Pure index arithmetic (no communication here): for every (source rank, destination rank) pair the ordered
list of expert-weight shards the source sends, chosen so that

* every rollout rank receives exactly the expert shards its vLLM ``FusedMoE`` layer holds,
* every needed shard is sent exactly once, from one training rank that holds it (zero redundant traffic;
  a rank that already holds a shard it needs "sends" it to itself, which costs no network bytes),
* among several holders (expert data-parallel replicas) the least-loaded one is chosen (send balance).

Training side (megatron-core 0.12.1, ``parallel_state.py`` expert RankGenerator, order ``tp-cp-ep-dp-pp`` with
cp=1 for experts): global rank = etp_rank + ETP * (ep_rank + EP * (edp_rank + EDP * pp_rank)) with
EDP = world / (ETP * EP * PP).  Expert-parallel rank ``r`` holds experts ``[r*E/EP, (r+1)*E/EP)``
(``moe_layer.py``: ``num_local_experts = E // EP``).  Expert-tensor-parallel rank ``t`` holds rows
``[t*F/ETP, (t+1)*F/ETP)`` of the intermediate dimension F (``moe_intermediate_size``) of gate, up
(``linear_fc1`` = [gate_t; up_t], shape [2F/ETP, H]) and the matching columns of down (``linear_fc2``,
shape [H, F/ETP]).  Pipeline stage ``p`` holds a contiguous block of decoder layers.

Rollout side (vLLM 0.13 ``fused_moe/config.py`` ``FusedMoEParallelConfig.make`` and ``layer.py``
``determine_expert_map``): rollout rank = dp_rank * TP + tp_rank.  With expert parallel enabled,
EP = TP * DP, ep_rank = rollout rank, expert TP = 1, and ep_rank ``r`` holds a contiguous ("linear")
block of experts, the first ``E % EP`` ranks one extra.  Without expert parallel every rank holds every
expert, sharded over the flattened TP = TP * DP along F (``_load_w13`` / ``_load_w2`` narrow by
``shard_size * tp_rank``): w13 = [gate_s; up_s] shape [2F/S, H], w2 shape [H, F/S].

Unit of transfer: an :class:`ShardItem` ``(layer, expert, f0, f1)`` = rows ``[f0, f1)`` of the
intermediate dimension of gate, up and down of one expert of one layer: ``3 * (f1 - f0) * H`` elements,
packed in the order gate rows, up rows, down columns (see :func:`pack_items` / :func:`unpack_items`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "MoEShape",
    "TrainLayout",
    "RolloutLayout",
    "ShardItem",
    "ReshardPlan",
    "plan_moe_reshard",
    "train_rank",
    "train_stage_layers",
    "train_holders",
    "rollout_expert_range",
    "rollout_needs",
    "layer_buckets",
    "GroupExchange",
    "expert_group_exchange",
    "pack_items",
    "unpack_items",
]


@dataclass(frozen=True)
class MoEShape:
    """Model dimensions that matter for expert resharding.

    num_layers: decoder layers (all MoE for Qwen3-MoE); num_experts: routed experts E (0 = dense model);
    hidden_size: H; moe_intermediate_size: F (per-expert FFN width); dtype_bytes: bytes per element.
    """

    num_layers: int
    num_experts: int
    hidden_size: int
    moe_intermediate_size: int
    dtype_bytes: int = 2


@dataclass(frozen=True)
class TrainLayout:
    """Megatron layout. world = TP*CP*DP*PP = ETP*EP*EDP*PP. Uneven pipelines: first/last stage layer counts
    as megatron's ``num_layers_in_first/last_pipeline_stage`` (None = even split)."""

    tp: int
    pp: int
    ep: int
    etp: int
    world: int
    cp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def edp(self) -> int:
        """Expert data-parallel size (replicas of each expert shard within a pipeline stage)."""
        return self.world // (self.etp * self.ep * self.pp)


@dataclass(frozen=True)
class RolloutLayout:
    """vLLM layout (colocated: rollout world = TP * DP = training world). ``expert_parallel`` is vLLM's
    ``enable_expert_parallel``; then vLLM's EP size is TP * DP."""

    tp: int
    dp: int
    expert_parallel: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def ep(self) -> int:
        """vLLM expert-parallel size (1 when expert parallel is off)."""
        return self.tp * self.dp if self.expert_parallel else 1

    @property
    def expert_tp(self) -> int:
        """vLLM's MoE tensor-parallel size: 1 with EP, else TP flattened across DP."""
        return 1 if self.expert_parallel else self.tp * self.dp


@dataclass(frozen=True, order=True)
class ShardItem:
    """Rows [f0, f1) of the intermediate dim of gate/up/down of ``expert`` in decoder ``layer``."""

    layer: int
    expert: int
    f0: int
    f1: int

    def numel(self, hidden_size: int) -> int:
        """Elements: gate + up ((f1-f0) x H each) + down (H x (f1-f0))."""
        return 3 * (self.f1 - self.f0) * hidden_size


@dataclass
class ReshardPlan:
    """Result of :func:`plan_moe_reshard`.

    sends[(src, dst)]: items src sends to dst, sorted (the packing order of that pair's chunk).
    numel: [world, world] int64 matrix, numel[src, dst] = elements src sends to dst; row ``r`` is rank r's
    ``input_split_sizes`` and column ``r`` its ``output_split_sizes`` for ``all_to_all_single`` on a flat
    buffer of the weight dtype.
    """

    world: int
    shape: MoEShape
    sends: dict[tuple[int, int], tuple[ShardItem, ...]]
    numel: np.ndarray = field(repr=False)

    def input_split_sizes(self, rank: int) -> list[int]:
        """Elements ``rank`` sends to each destination (all_to_all_single input_split_sizes)."""
        return [int(x) for x in self.numel[rank]]

    def output_split_sizes(self, rank: int) -> list[int]:
        """Elements ``rank`` receives from each source (all_to_all_single output_split_sizes)."""
        return [int(x) for x in self.numel[:, rank]]

    def items(self, src: int, dst: int) -> tuple[ShardItem, ...]:
        return self.sends.get((src, dst), ())

    def bytes_matrix(self) -> np.ndarray:
        """[world, world] bytes src -> dst (diagonal = local copies, no network)."""
        return self.numel * self.shape.dtype_bytes

    def stats(self) -> dict[str, float]:
        """Totals in bytes. ``send_max_over_mean``: busiest rank's network send bytes / mean (1.0 = balanced)."""
        b = self.bytes_matrix()
        net = b - np.diag(np.diag(b))
        send = net.sum(axis=1)
        recv = net.sum(axis=0)
        mean = float(send.mean()) if self.world else 0.0
        return {
            "total_bytes": float(b.sum()),
            "network_bytes": float(net.sum()),
            "local_bytes": float(np.trace(b)),
            "max_send_bytes": float(send.max()),
            "mean_send_bytes": mean,
            "send_max_over_mean": float(send.max()) / mean if mean > 0 else 1.0,
            "max_recv_bytes": float(recv.max()),
        }


def _check_positive(**kw: int) -> None:
    for k, v in kw.items():
        if v < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")


def train_stage_layers(train: TrainLayout, num_layers: int) -> list[range]:
    """Decoder layers of each pipeline stage (megatron: first/last stages may be set, middle stages even)."""
    pp = train.pp
    if pp == 1:
        return [range(num_layers)]
    first, last = train.first_stage_layers, train.last_stage_layers
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"num_layers={num_layers} not divisible by PP={pp}: set first/last_stage_layers")
        n = num_layers // pp
        return [range(i * n, (i + 1) * n) for i in range(pp)]
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle_stages == 0:
        if rest != 0:
            raise ValueError(f"first+last stage layers must sum to num_layers={num_layers} with PP=2")
        counts = [first or 0, last or 0]
    else:
        if rest < 0 or rest % middle_stages:
            raise ValueError(f"{rest} remaining layers not divisible by the {middle_stages} middle PP stages")
        mid = [rest // middle_stages] * middle_stages
        counts = ([first] if first is not None else []) + mid + ([last] if last is not None else [])
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def train_rank(train: TrainLayout, *, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
    """Global rank in megatron-core 0.12.1's expert rank grid (order tp-ep-dp-pp, tp fastest)."""
    return etp_rank + train.etp * (ep_rank + train.ep * (edp_rank + train.edp * pp_rank))


def train_holders(train: TrainLayout, shape: MoEShape, stage: int, expert: int, etp_rank: int) -> list[int]:
    """Ranks holding ETP shard ``etp_rank`` of ``expert`` in pipeline ``stage`` (one per expert-DP replica)."""
    ep_rank = expert // (shape.num_experts // train.ep)
    return [
        train_rank(train, etp_rank=etp_rank, ep_rank=ep_rank, edp_rank=d, pp_rank=stage)
        for d in range(train.edp)
    ]


def rollout_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Experts held by vLLM ep_rank (``determine_expert_map``, linear placement: first E%EP ranks get +1)."""
    base, rem = divmod(num_experts, ep_size)
    n = base + 1 if ep_rank < rem else base
    start = ep_rank * base + min(ep_rank, rem)
    return range(start, start + n)


def rollout_needs(rollout: RolloutLayout, shape: MoEShape, rank: int) -> list[tuple[int, int, int]]:
    """(expert, f0, f1) rank ``rank`` holds in every layer: full experts of its EP block with EP, else
    every expert's F-slice ``rank`` of the flattened TP (vLLM ``_load_w13``/``_load_w2``)."""
    F = shape.moe_intermediate_size
    if rollout.expert_parallel:
        return [(e, 0, F) for e in rollout_expert_range(shape.num_experts, rollout.ep, rank)]
    s = F // rollout.expert_tp
    return [(e, rank * s, (rank + 1) * s) for e in range(shape.num_experts)]


def _validate(train: TrainLayout, rollout: RolloutLayout, shape: MoEShape) -> None:
    if shape.num_experts == 0:
        raise ValueError(
            "dense model (num_experts=0): there are no expert weights to reshard; the dense path keeps "
            "verl's per-tensor weight sync unchanged"
        )
    _check_positive(
        train_tp=train.tp, train_pp=train.pp, train_ep=train.ep, train_etp=train.etp, train_cp=train.cp,
        train_world=train.world, rollout_tp=rollout.tp, rollout_dp=rollout.dp, num_layers=shape.num_layers,
        num_experts=shape.num_experts, hidden_size=shape.hidden_size,
        moe_intermediate_size=shape.moe_intermediate_size, dtype_bytes=shape.dtype_bytes,
    )
    if train.world % (train.tp * train.cp * train.pp):
        raise ValueError(f"train world {train.world} not divisible by TP*CP*PP={train.tp * train.cp * train.pp}")
    if train.world % (train.etp * train.ep * train.pp):
        raise ValueError(
            f"train world {train.world} not divisible by ETP*EP*PP={train.etp * train.ep * train.pp} "
            "(megatron expert grid)"
        )
    if shape.num_experts % train.ep:
        raise ValueError(f"num_experts={shape.num_experts} not divisible by train EP={train.ep} (megatron)")
    if shape.moe_intermediate_size % train.etp:
        raise ValueError(f"moe_intermediate_size={shape.moe_intermediate_size} not divisible by train ETP={train.etp}")
    if rollout.world != train.world:
        raise ValueError(
            f"rollout TP*DP={rollout.world} != train world {train.world}: the all-to-allv reshard needs the "
            "colocated (hybrid engine) layout where every train rank is also one rollout rank"
        )
    if not rollout.expert_parallel and shape.moe_intermediate_size % rollout.expert_tp:
        raise ValueError(
            f"moe_intermediate_size={shape.moe_intermediate_size} not divisible by vLLM MoE TP="
            f"TP*DP={rollout.expert_tp} (expert parallel off)"
        )
    if rollout.expert_parallel and rollout.ep > shape.num_experts:
        raise ValueError(f"vLLM EP={rollout.ep} > num_experts={shape.num_experts}: some EP ranks would hold no expert")


def plan_moe_reshard(
    train: TrainLayout,
    rollout: RolloutLayout,
    shape: MoEShape,
    layers: Sequence[int] | None = None,
) -> ReshardPlan:
    """Zero-redundancy all-to-allv plan moving routed-expert weights from the train to the rollout layout.

    Any rollout EP works (it need not be a multiple of train EP): needs are cut at train ETP boundaries
    and each piece is sent once. ``layers`` restricts the plan to a subset (e.g. one bucket of layers per
    all_to_all_single call to bound buffer memory). Raises ValueError naming the violated constraint.
    """
    _validate(train, rollout, shape)
    stages = train_stage_layers(train, shape.num_layers)
    stage_of = {layer: p for p, rng in enumerate(stages) for layer in rng}
    sel = range(shape.num_layers) if layers is None else sorted(set(layers))
    for layer in sel:
        if layer not in stage_of:
            raise ValueError(f"layer {layer} out of range [0, {shape.num_layers})")
    world, H, F = train.world, shape.hidden_size, shape.moe_intermediate_size
    fe = F // train.etp  # rows per train ETP shard
    load = np.zeros(world, dtype=np.int64)  # network elements sent so far per source
    sends: dict[tuple[int, int], list[ShardItem]] = {}
    numel = np.zeros((world, world), dtype=np.int64)
    needs = [rollout_needs(rollout, shape, d) for d in range(world)]
    for layer in sel:
        stage = stage_of[layer]
        for dst in range(world):
            for expert, a, b in needs[dst]:
                f = a
                while f < b:
                    t = f // fe
                    g = min(b, (t + 1) * fe)
                    holders = train_holders(train, shape, stage, expert, t)
                    if dst in holders:
                        src = dst
                    else:  # least loaded; ties rotate with the destination to spread evenly
                        src = min(holders, key=lambda r: (load[r], (r - dst) % world))
                    item = ShardItem(layer, expert, f, g)
                    n = item.numel(H)
                    if src != dst:
                        load[src] += n
                    numel[src, dst] += n
                    sends.setdefault((src, dst), []).append(item)
                    f = g
    frozen = {k: tuple(sorted(v)) for k, v in sends.items()}
    return ReshardPlan(world=world, shape=shape, sends=frozen, numel=numel)


def layer_buckets(train: TrainLayout, num_layers: int, layers_per_stage: int) -> list[list[int]]:
    """Split all layers into buckets for one all_to_all_single each, taking ``layers_per_stage`` layers from
    every pipeline stage per bucket, so every stage (hence every source rank) sends in every bucket."""
    if layers_per_stage < 1:
        raise ValueError("layers_per_stage must be >= 1")
    stages = [list(r) for r in train_stage_layers(train, num_layers)]
    n = max(math.ceil(len(s) / layers_per_stage) for s in stages)
    out = []
    for i in range(n):
        b = [layer for s in stages for layer in s[i * layers_per_stage : (i + 1) * layers_per_stage]]
        out.append(b)
    return out


# --------------------------------------------------------------------------- packing (torch, lazily imported)

LocalGetter = Callable[[int, int], tuple["object", "object", int]]


def pack_items(items: Sequence[ShardItem], get_local: LocalGetter) -> list:
    """Flat pieces (torch tensors) for ``items`` in order: gate rows, up rows, down columns of each item.

    get_local(layer, expert) -> (fc1 [2*f_local, H] = [gate; up], fc2 [H, f_local], f_offset) for the
    caller's local copy of that expert, ``f_offset`` = first intermediate row it holds (train ETP shard start).
    Concatenate the result (``torch.cat``) per destination to form the send buffer.
    """
    out = []
    for it in items:
        fc1, fc2, off = get_local(it.layer, it.expert)
        fl = fc1.shape[0] // 2
        lo, hi = it.f0 - off, it.f1 - off
        if lo < 0 or hi > fl:
            raise ValueError(f"{it} is not inside the local shard rows [{off}, {off + fl})")
        out.append(fc1[lo:hi].reshape(-1))
        out.append(fc1[fl + lo : fl + hi].reshape(-1))
        out.append(fc2[:, lo:hi].reshape(-1))
    return out


def unpack_items(items: Sequence[ShardItem], buf, hidden_size: int, dest: dict, dest_f0: int = 0) -> None:
    """Write a received chunk ``buf`` (1-D, items in order) into vLLM-layout tensors.

    dest[(layer, expert)] = (w13 [2*f_local, H] = [gate; up], w2 [H, f_local]); ``dest_f0`` = first
    intermediate row of the rollout rank's F-slice (0 with expert parallel).
    """
    H, pos = hidden_size, 0
    for it in items:
        w13, w2 = dest[(it.layer, it.expert)]
        fl = w13.shape[0] // 2
        n = it.f1 - it.f0
        lo = it.f0 - dest_f0
        w13[lo : lo + n].copy_(buf[pos : pos + n * H].view(n, H))
        pos += n * H
        w13[fl + lo : fl + lo + n].copy_(buf[pos : pos + n * H].view(n, H))
        pos += n * H
        w2[:, lo : lo + n].copy_(buf[pos : pos + n * H].view(H, n))
        pos += n * H
    if pos != buf.numel():
        raise ValueError(f"chunk has {buf.numel()} elements, items account for {pos}")


# --------------------------------------------------------------------------- per-tensor exchange (verl hook)


@dataclass(frozen=True)
class GroupExchange:
    """All-to-allv of one per-expert tensor inside megatron's expert-tensor-and-model-parallel group.

    Group members are ordered etp fastest: member m = etp_rank + ETP * ep_rank, and member m holds ETP
    shard ``etp_rank`` of expert ``ep_rank * E/EP + local_expert_id``.  ``send_to[m]``: members m sends its
    shard to; ``recv_from[m]``: (source member, global expert, etp shard) m receives, in source order, i.e.
    the order of ``all_to_all_single``'s output chunks.  Split sizes: ``numel`` for every listed pair, else 0.
    """

    send_to: tuple[tuple[int, ...], ...]
    recv_from: tuple[tuple[tuple[int, int, int], ...], ...]

    def split_sizes(self, member: int, numel: int) -> tuple[list[int], list[int]]:
        """(input_split_sizes, output_split_sizes) of ``member`` for a shard of ``numel`` elements."""
        n = len(self.send_to)
        inp = [numel if d in self.send_to[member] else 0 for d in range(n)]
        src = {s for s, _, _ in self.recv_from[member]}
        out = [numel if s in src else 0 for s in range(n)]
        return inp, out


def expert_group_exchange(
    num_experts: int, ep: int, etp: int, local_expert_id: int, group_ranks: Sequence[int], rollout: RolloutLayout
) -> GroupExchange:
    """Exchange for verl's per-tensor weight sync (one local expert id of one layer at a time), replacing the
    EP (+ETP) all-gather where every rank receives every expert: each rank receives only the ETP shards of the
    experts its vLLM EP rank holds (``rollout_expert_range``; rollout rank = global rank, colocated).

    group_ranks: global ranks of the group in member order (etp fastest, see :class:`GroupExchange`).
    Requires vLLM expert parallel (without it every rank needs every expert: the all-gather is already exact).
    """
    if not rollout.expert_parallel:
        raise ValueError("expert_group_exchange needs vLLM expert parallel (enable_expert_parallel=True)")
    if num_experts % ep or not 0 <= local_expert_id < num_experts // ep:
        raise ValueError(f"num_experts={num_experts} must be divisible by EP={ep}, local id < E/EP")
    if len(group_ranks) != ep * etp:
        raise ValueError(f"group has {len(group_ranks)} ranks, expected EP*ETP={ep * etp}")
    per_ep = num_experts // ep
    send: list[list[int]] = [[] for _ in group_ranks]
    recv: list[list[tuple[int, int, int]]] = [[] for _ in group_ranks]
    for d, g in enumerate(group_ranks):
        needed = rollout_expert_range(num_experts, rollout.ep, g)
        for s in range(len(group_ranks)):
            t, k = s % etp, s // etp
            expert = k * per_ep + local_expert_id
            if expert in needed:
                send[s].append(d)
                recv[d].append((s, expert, t))
    return GroupExchange(tuple(tuple(x) for x in send), tuple(tuple(x) for x in recv))
