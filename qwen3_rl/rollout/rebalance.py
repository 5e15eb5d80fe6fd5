"""Rollout rebalance between DP ranks: the two-phase migration planner (pure logic, no torch, no I/O).

Every few engine steps the DP ranks exchange their load (:class:`RankState`: waiting requests, running
requests with their context length and KV blocks, capacities). Each rank runs :func:`plan_rebalance`
on the same gathered states and gets the same :class:`MigrationPlan` (the planner is deterministic).

Phase 1 — waiting requests (no KV to move). After each rank admits what it can of its own queue
(FCFS, limited by ``max_num_seqs`` and free KV blocks), a rank with requests still queued is
*overloaded*, a rank with free slots and blocks left has *room*. Queued requests move, tail of the
queue first, from the most overloaded rank to the rank with the most room that can hold their
prompt's KV, until no pair is left or the round's budget is spent. Each moved request is admitted
on arrival.

Phase 2 — running requests (KV moves with them), only when no request is left queued after phase 1
(the drain phase of the rollout, where the length tail lives). In lockstep decoding (MoE with expert parallelism
across the DP ranks, vLLM pads every DP rank to the largest batch: ``vllm/v1/worker/dp_utils.py``
``coordinate_batch_across_dp``), the step runs the graph bucket of the *busiest* rank. If moving
running requests lets every rank fit a smaller bucket ``b`` (all counts ``<= b``), the planner moves
them — requests with the fewest KV blocks first, to the ranks with the most headroom under ``b`` —
choosing the smallest such bucket reachable within the budget. Otherwise phase 2 moves nothing:
partial moves would not lower the bucket and would only cost transfers.

Invariants (checked by :func:`validate_plan`, tested on random states): every request is in exactly
one place after the plan (none lost or duplicated, one move per request at most); no rank exceeds
``max_num_seqs`` or its KV blocks; an already balanced state gets an empty plan; a round moves at
most ``max_moves`` requests and ``max_kv_blocks`` KV blocks, and no rank sends plus receives more than
``max_kv_blocks_per_rank``.

Move or recompute (phase 2): a running request can travel with its KV blocks or without them, in which
case the target recomputes its prefix like after a local preemption (the fallback verl's async mode
uses). :func:`should_recompute` decides per request from :class:`TransferCost`: KV bytes / link
bandwidth against prefix tokens / prefill throughput. A recomputed move carries no KV bytes, so it
does not count against the KV budgets (``max_kv_blocks_per_rank`` is the optional per-round byte cap
converted to blocks by :func:`kv_block_budget`).

Time bound (``max_round_s``): a round may cost each rank at most that many seconds: its KV transfer
(bytes sent + received / link) plus the prefill of the prefixes it recomputes for requests it receives.
Each running request takes the cheaper of moving and recomputing that still fits the budgets of both
ends; when neither fits it stays where it is for a later round (the planner then settles for a larger
bucket, or moves nothing). :func:`round_config` turns the run-time figures (link, prefill rate, bound,
optional byte cap) into a round's config: the simulator and the coordinator both call it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class WaitingRequest:
    """A queued request (holds no KV yet).

    ``num_tokens``: tokens whose KV must be computed on admission (prompt + tokens generated before a
    preemption), so admission needs ``ceil((num_tokens + 1) / block_size)`` blocks.
    """

    req_id: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request being decoded: ``num_tokens`` context tokens (prompt + generated), ``kv_blocks`` held."""

    req_id: str
    num_tokens: int
    kv_blocks: int


@dataclass(frozen=True, slots=True)
class RankState:
    """Load of one DP rank at a rebalance round.

    ``waiting`` is in the rank's FCFS order; ``max_num_seqs`` caps running requests; ``num_kv_blocks``
    is the rank's total KV block pool (blocks of ``RebalanceConfig.block_size`` tokens).
    """

    rank: int
    waiting: tuple[WaitingRequest, ...]
    running: tuple[RunningRequest, ...]
    max_num_seqs: int
    num_kv_blocks: int

    @property
    def used_blocks(self) -> int:
        """KV blocks held by the running requests."""
        return sum(r.kv_blocks for r in self.running)


#: default optional byte cap: KV bytes one DP rank may send + receive per round (0 = none; the round is
#: bounded by time, ``DEFAULT_MAX_ROUND_S``); see docs/rollout_balancing.md
DEFAULT_MAX_KV_BYTES = 0
#: default time bound of a round per rank, seconds (KV transfer + recompute); about a sixth of the default
#: 60 s timeout, the bound the former 4 GB cap gave on the measured 0.44 GB/s host path
DEFAULT_MAX_ROUND_S = 10.0
#: default KV path bandwidth, GB/s: 0 = measured by the engine at its first round (the simulator's default
#: is a device-class figure, ``qwen3_rl.tools.sim.simulate.DEVICE_LINK_GB_S``)
DEFAULT_KV_LINK_GB_S = 0.0
#: default prefill throughput of one rollout engine, tokens/s (the simulator's 100 ms per 1000 tokens)
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0


@dataclass(frozen=True)
class TransferCost:
    """Cost model of moving a running request's KV vs recomputing its prefix on the target.

    ``kv_bytes_per_block``: bytes one KV block occupies on one rank (all layers, K and V; 0 = unknown:
    always move). ``link_bytes_per_s``: KV transfer bandwidth per rank in bytes/s (gather to host, gloo
    send, scatter; 0 = unknown: always move). ``prefill_tokens_per_s``: prefill throughput of the target
    engine in tokens/s (0 = recompute never considered). ``per_move_s``: fixed cost of one KV transfer
    (message latency), seconds.
    """

    kv_bytes_per_block: int = 0
    link_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    per_move_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.kv_bytes_per_block, self.link_bytes_per_s, self.prefill_tokens_per_s, self.per_move_s) < 0:
            raise ValueError(f"TransferCost fields must be >= 0, got {self}")


def kv_move_seconds(kv_blocks: int, cost: TransferCost) -> float:
    """Seconds to move ``kv_blocks`` blocks: ``per_move_s + blocks * bytes_per_block / link`` (inf if the link is 0)."""
    if kv_blocks <= 0:
        return 0.0
    if cost.link_bytes_per_s <= 0:
        return float("inf")
    return cost.per_move_s + kv_blocks * cost.kv_bytes_per_block / cost.link_bytes_per_s


def recompute_seconds(num_tokens: int, cost: TransferCost) -> float:
    """Seconds to recompute a ``num_tokens`` prefix on the target: ``tokens / prefill throughput`` (inf if 0)."""
    if num_tokens <= 0:
        return 0.0
    if cost.prefill_tokens_per_s <= 0:
        return float("inf")
    return num_tokens / cost.prefill_tokens_per_s


def should_recompute(num_tokens: int, kv_blocks: int, cost: TransferCost | None) -> bool:
    """True when recomputing the ``num_tokens`` prefix costs less than moving its ``kv_blocks`` KV blocks.

    Unknown figures (``cost`` None, zero bytes per block, zero link with zero prefill throughput) mean
    "move", the behaviour without a cost model.
    """
    if cost is None or kv_blocks <= 0 or cost.kv_bytes_per_block <= 0 or cost.prefill_tokens_per_s <= 0:
        return False
    return recompute_seconds(num_tokens, cost) < kv_move_seconds(kv_blocks, cost)


def round_config(base: RebalanceConfig, *, kv_bytes_per_block: int, link_bytes_per_s: float,
                 prefill_tokens_per_s: float, max_round_s: float | None, max_kv_bytes: int = 0,
                 per_move_s: float = 0.0) -> RebalanceConfig:
    """The planner config of one round from the run-time figures (shared by the coordinator and the simulator).

    Args:
        base: buckets, block size, move budgets; a ``transfer`` / ``max_round_s`` / per-rank block cap set
            here wins over the figures below (a cap is combined with the byte cap by ``min``).
        kv_bytes_per_block: bytes of one KV block on one rank (all layers, K and V).
        link_bytes_per_s: KV path bandwidth, bytes sent + received per second and rank.
        prefill_tokens_per_s: prefill throughput of the receiving engine (0 = never recompute).
        max_round_s: seconds a round may cost one rank (KV transfer + recompute); None or 0 = no bound.
        max_kv_bytes: optional byte cap per rank and round (0 = none).
        per_move_s: fixed cost of one KV transfer, seconds.
    """
    cap = kv_block_budget(max_kv_bytes, kv_bytes_per_block)
    if base.max_kv_blocks_per_rank is not None:
        cap = base.max_kv_blocks_per_rank if cap is None else min(cap, base.max_kv_blocks_per_rank)
    cost = base.transfer or TransferCost(int(kv_bytes_per_block), float(link_bytes_per_s),
                                         float(prefill_tokens_per_s), float(per_move_s))
    bound = base.max_round_s if base.max_round_s is not None else (float(max_round_s) if max_round_s else None)
    return replace(base, max_kv_blocks_per_rank=cap, transfer=cost, max_round_s=bound)


def kv_block_budget(max_kv_bytes: int, kv_bytes_per_block: int) -> int | None:
    """KV blocks a byte cap allows (whole blocks, rounded down); None = no cap (``max_kv_bytes`` 0, or the
    block size unknown)."""
    if max_kv_bytes < 0 or kv_bytes_per_block < 0:
        raise ValueError("max_kv_bytes and kv_bytes_per_block must be >= 0")
    if max_kv_bytes == 0 or kv_bytes_per_block == 0:
        return None
    return max_kv_bytes // kv_bytes_per_block


@dataclass(frozen=True)
class RebalanceConfig:
    """Planner settings.

    ``buckets``: graph batch sizes (ascending; a count above the largest runs unpadded).
    ``block_size``: tokens per KV block. ``max_moves``: requests migrated per round (both phases).
    ``max_kv_blocks``: KV blocks transferred per round (phase 2). ``watermark_blocks``: blocks each
    rank keeps free (not offered to migrations or admissions). ``phase1``/``phase2``: enable phases.
    ``max_kv_blocks_per_rank``: KV blocks one rank may send plus receive per round (phase 2; None = no
    per-rank cap): the transfer time of a round is set by its busiest rank, and in lockstep every rank
    waits for it. ``transfer``: move-vs-recompute cost model for phase 2 (None: running requests always
    move their KV). ``max_round_s``: seconds one round may cost a rank, KV transfer (bytes sent + received
    / ``transfer.link_bytes_per_s``) plus the prefill of prefixes it recomputes (None: no bound; needs
    ``transfer``).
    """

    buckets: tuple[int, ...]
    block_size: int = 128
    max_moves: int = 128
    max_kv_blocks: int = 32768
    watermark_blocks: int = 0
    phase1: bool = True
    phase2: bool = True
    max_kv_blocks_per_rank: int | None = None
    transfer: TransferCost | None = None
    max_round_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_round_s is not None and not self.max_round_s > 0:
            raise ValueError(f"max_round_s must be > 0 (or None), got {self.max_round_s}")
        if not self.buckets or any(b < 1 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets must be strictly ascending positive ints, got {self.buckets}")
        if self.max_kv_blocks_per_rank is not None and self.max_kv_blocks_per_rank < 0:
            raise ValueError("max_kv_blocks_per_rank must be >= 0 (or None)")
        if self.block_size < 1 or self.max_moves < 0 or self.max_kv_blocks < 0 or self.watermark_blocks < 0:
            raise ValueError("block_size must be >= 1 and the budgets/watermark >= 0")


@dataclass(frozen=True, slots=True)
class Move:
    """Migrate ``req_id`` from rank ``src`` to ``dst``; ``phase`` 1 (waiting) or 2 (running, ``kv_blocks`` moved).

    ``recompute``: a running request that travels without its KV (``kv_blocks`` 0); the target recomputes
    its prefix as after a preemption.
    """

    req_id: str
    src: int
    dst: int
    phase: int
    kv_blocks: int
    recompute: bool = False


@dataclass(frozen=True)
class MigrationPlan:
    """Result of one round: the moves, and the lockstep graph bucket before/after (counts incl. admissions)."""

    moves: tuple[Move, ...] = ()
    bucket_before: int = 0
    bucket_after: int = 0
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def empty(self) -> bool:
        """True when nothing moves."""
        return not self.moves

    @property
    def kv_blocks_moved(self) -> int:
        """Total KV blocks transferred by the plan."""
        return sum(m.kv_blocks for m in self.moves)


def bucket_for(count: int, buckets: Sequence[int]) -> int:
    """Graph batch size that runs ``count`` sequences: smallest bucket >= count (``count`` if above all; 0 for 0)."""
    if count <= 0:
        return 0
    i = bisect.bisect_left(buckets, count)
    return buckets[i] if i < len(buckets) else count


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """KV blocks to admit a request with ``num_tokens`` context tokens and room for its next token."""
    return -(-(num_tokens + 1) // block_size)


@dataclass
class _Work:
    """Mutable per-rank bookkeeping while planning."""

    rank: int
    cap_seqs: int
    cap_blocks: int
    running: list[RunningRequest]
    admitted: list[WaitingRequest]  # local queue entries admitted this round (FCFS head)
    stuck: list[WaitingRequest]  # still queued after local admission
    used_blocks: int

    @property
    def count(self) -> int:
        return len(self.running) + len(self.admitted)

    @property
    def free_seqs(self) -> int:
        return self.cap_seqs - self.count

    @property
    def free_blocks(self) -> int:
        return self.cap_blocks - self.used_blocks


def _local_admission(state: RankState, cfg: RebalanceConfig) -> _Work:
    cap_blocks = state.num_kv_blocks - cfg.watermark_blocks
    w = _Work(state.rank, state.max_num_seqs, cap_blocks, list(state.running), [], [], state.used_blocks)
    blocked = False
    for req in state.waiting:
        need = blocks_needed(req.num_tokens, cfg.block_size)
        if not blocked and w.free_seqs > 0 and need <= w.free_blocks:
            w.admitted.append(req)
            w.used_blocks += need
        else:
            blocked = True  # FCFS: nothing behind a blocked request is admitted
            w.stuck.append(req)
    return w


def _phase1(works: list[_Work], cfg: RebalanceConfig, budget: int) -> list[Move]:
    moves: list[Move] = []
    while len(moves) < budget:
        donors = sorted((w for w in works if w.stuck), key=lambda w: (-len(w.stuck), w.rank))
        moved = False
        for donor in donors:
            for qi in range(len(donor.stuck) - 1, -1, -1):
                req = donor.stuck[qi]
                need = blocks_needed(req.num_tokens, cfg.block_size)
                dsts = [w for w in works
                        if w is not donor and not w.stuck and w.free_seqs > 0 and w.free_blocks >= need]
                if not dsts:
                    continue
                dst = max(dsts, key=lambda w: (w.free_seqs, w.free_blocks, -w.rank))
                donor.stuck.pop(qi)
                dst.admitted.append(req)
                dst.used_blocks += need
                moves.append(Move(req.req_id, donor.rank, dst.rank, 1, 0))
                moved = True
                break
            if moved:
                break
        if not moved:
            break
    return moves


_P2Move = tuple[str, int, int, int, bool, bool]  # req_id, src, dst, kv_blocks moved, was_waiting, recompute


def _phase2(works: list[_Work], cfg: RebalanceConfig, move_budget: int) -> tuple[list[_P2Move], int, int]:
    """Returns (moves as (req_id, src, dst, kv_blocks, was_waiting, recompute), bucket_before, bucket_after)."""
    counts = [w.count for w in works]
    total = sum(counts)
    before = bucket_for(max(counts, default=0), cfg.buckets)
    if total == 0:
        return [], before, before
    for b in cfg.buckets:
        if b >= before:
            break
        if sum(min(b, w.cap_seqs) for w in works) < total:
            continue
        plan = _try_bucket(works, cfg, b, move_budget)
        if plan is not None:
            return plan, before, b
    return [], before, before


#: one way a phase-2 candidate can travel: blocks it needs on the target, KV blocks transferred, whether
#: it is recomputed, seconds it costs the source and the target (KV transfer; recompute on the target)
_Option = tuple[int, int, bool, float, float]


def _options(r: RunningRequest, cfg: RebalanceConfig) -> list[_Option]:
    """The ways a running request can travel, cheapest first (move with its KV, or recompute on the target)."""
    cost = cfg.transfer
    mv_s = kv_move_seconds(r.kv_blocks, cost) if cost is not None else 0.0
    move: _Option = (r.kv_blocks, r.kv_blocks, False, mv_s, mv_s)
    if cost is None or cost.prefill_tokens_per_s <= 0 or cost.kv_bytes_per_block <= 0:
        return [move]
    rc: _Option = (max(r.kv_blocks, blocks_needed(r.num_tokens, cfg.block_size)), 0, True, 0.0,
                   recompute_seconds(r.num_tokens, cost))
    return [rc, move] if should_recompute(r.num_tokens, r.kv_blocks, cost) else [move, rc]


def _try_bucket(works: list[_Work], cfg: RebalanceConfig, b: int, move_budget: int) -> list[_P2Move] | None:
    need_moves = sum(max(0, w.count - min(b, w.cap_seqs)) for w in works)
    if need_moves > move_budget:
        return None
    head = {w.rank: min(b, w.cap_seqs) - w.count for w in works}  # >0: room under b
    # A rank that still has its own queue blocked (KV-bound) admits that queue first; it receives nothing.
    receivers = {w.rank for w in works if not w.stuck}
    free_blocks = {w.rank: w.free_blocks for w in works}
    out: list[_P2Move] = []
    kv_total = 0
    per_rank = cfg.max_kv_blocks_per_rank
    kv_io = {w.rank: 0 for w in works}  # blocks sent + received per rank this round
    bound = cfg.max_round_s if cfg.transfer is not None else None
    spent = {w.rank: 0.0 for w in works}  # seconds of transfer + recompute per rank this round

    def fits(rank: int, kv: int, secs: float) -> bool:
        if per_rank is not None and kv and kv_io[rank] + kv > per_rank:
            return False
        return bound is None or secs <= 0 or spent[rank] + secs <= bound

    for w in sorted(works, key=lambda w: w.rank):
        excess = -head[w.rank]
        if excess <= 0:
            continue
        # Cheapest first: requests admitted this round (no KV yet), then running by KV blocks held.
        cands: list[tuple[str, bool, list[_Option]]] = [
            (r.req_id, True, [(blocks_needed(r.num_tokens, cfg.block_size), 0, False, 0.0, 0.0)])
            for r in reversed(w.admitted)
        ]
        cands += [(r.req_id, False, _options(r, cfg)) for r in sorted(w.running, key=lambda r: (r.kv_blocks, r.req_id))]
        taken = 0
        for req_id, was_waiting, options in cands:
            if taken == excess:
                break
            for blocks_at_dst, kv_moved, recompute, src_s, dst_s in options:
                if kv_total + kv_moved > cfg.max_kv_blocks or not fits(w.rank, kv_moved, src_s):
                    continue
                dsts = [r for r in receivers if r != w.rank and head[r] > 0 and free_blocks[r] >= blocks_at_dst
                        and fits(r, kv_moved, dst_s)]
                if not dsts:
                    continue
                dst = max(dsts, key=lambda r: (head[r], free_blocks[r], -r))
                head[dst] -= 1
                free_blocks[dst] -= blocks_at_dst
                head[w.rank] += 1
                kv_total += kv_moved
                kv_io[w.rank] += kv_moved
                kv_io[dst] += kv_moved
                spent[w.rank] += src_s
                spent[dst] += dst_s
                out.append((req_id, w.rank, dst, kv_moved, was_waiting, recompute))
                taken += 1
                break  # the request travels one way; otherwise it stays for a later round
        if taken < excess:
            return None
    return out


def plan_rebalance(states: Sequence[RankState], cfg: RebalanceConfig) -> MigrationPlan:
    """Plan one rebalance round over all DP ranks (deterministic: every rank computes the same plan).

    Args:
        states: one :class:`RankState` per DP rank (distinct ``rank`` ids, request ids unique overall).
        cfg: buckets, block size and per-round budgets.

    Returns:
        A :class:`MigrationPlan`; empty when the state is already balanced (no queued request could be
        admitted elsewhere, and the lockstep bucket cannot drop).
    """
    ranks = [s.rank for s in states]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"duplicate rank ids in states: {ranks}")
    ids = [r.req_id for s in states for r in (*s.waiting, *s.running)]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate request ids across rank states")
    works = [_local_admission(s, cfg) for s in states]
    p1 = _phase1(works, cfg, cfg.max_moves) if cfg.phase1 else []
    before = after = bucket_for(max((w.count for w in works), default=0), cfg.buckets)
    p2: list[_P2Move] = []
    if cfg.phase2 and not any(w.stuck for w in works):
        # Only once every queue is admitted: while requests still wait for slots, a slot freed by a
        # migration is refilled from the local queue (or phase 1) and the bucket would not drop.
        p2, before, after = _phase2(works, cfg, cfg.max_moves - len(p1))
    # Merge so that each request moves at most once: a phase-1 request moved again in phase 2 goes
    # straight from its original rank to its final one.
    origin = {m.req_id: m.src for m in p1}
    final: dict[str, Move] = {m.req_id: m for m in p1}
    for req_id, src, dst, kv, was_waiting, recompute in p2:
        src0 = origin.get(req_id, src)
        if src0 == dst:
            final.pop(req_id, None)
        else:
            final[req_id] = Move(req_id, src0, dst, 1 if was_waiting else 2, kv, recompute)
    moves = tuple(sorted(final.values(), key=lambda m: (m.phase, m.src, m.dst, m.req_id)))
    return MigrationPlan(moves=moves, bucket_before=before, bucket_after=after)


def apply_plan(states: Sequence[RankState], plan: MigrationPlan) -> list[RankState]:
    """States after migration: moved waiting requests join the end of the target's queue, moved running
    requests join the target's running set with their KV blocks. Pure; raises ``ValueError`` on a move
    whose request is not on its ``src`` rank."""
    by_rank = {s.rank: s for s in states}
    waiting = {s.rank: list(s.waiting) for s in states}
    running = {s.rank: list(s.running) for s in states}
    for m in plan.moves:
        if m.src not in by_rank or m.dst not in by_rank:
            raise ValueError(f"move {m} names an unknown rank")
        src_w = [r for r in waiting[m.src] if r.req_id == m.req_id]
        src_r = [r for r in running[m.src] if r.req_id == m.req_id]
        if m.phase == 1 and len(src_w) == 1:
            waiting[m.src].remove(src_w[0])
            waiting[m.dst].append(src_w[0])
        elif m.phase == 2 and len(src_r) == 1:
            running[m.src].remove(src_r[0])
            running[m.dst].append(src_r[0])
        else:
            raise ValueError(f"move {m}: request not found on rank {m.src} in the expected state")
    return [replace(s, waiting=tuple(waiting[s.rank]), running=tuple(running[s.rank])) for s in states]


def validate_plan(states: Sequence[RankState], plan: MigrationPlan, cfg: RebalanceConfig) -> None:
    """Check a plan's invariants against the states it was made from; raises ``AssertionError`` on a violation.

    Checks: one move per request at most, each from the rank holding it; budgets; after the plan and
    each rank's FCFS admission, no rank exceeds ``max_num_seqs`` running or its KV block pool, and
    every request appears exactly once.
    """
    ids = [m.req_id for m in plan.moves]
    assert len(ids) == len(set(ids)), "a request moves twice"
    assert len(plan.moves) <= cfg.max_moves, f"{len(plan.moves)} moves > max_moves {cfg.max_moves}"
    assert plan.kv_blocks_moved <= cfg.max_kv_blocks, "KV blocks moved exceed the budget"
    if cfg.max_kv_blocks_per_rank is not None:
        io = {s.rank: 0 for s in states}
        for m in plan.moves:
            io[m.src] += m.kv_blocks
            io[m.dst] += m.kv_blocks
        assert max(io.values(), default=0) <= cfg.max_kv_blocks_per_rank, f"per-rank KV blocks {io} exceed the cap"
    for m in plan.moves:
        assert not m.recompute or (m.phase == 2 and m.kv_blocks == 0), f"recomputed move {m} carries KV"
    if cfg.max_round_s is not None and cfg.transfer is not None:
        tokens = {r.req_id: r.num_tokens for s in states for r in s.running}
        spent = {s.rank: 0.0 for s in states}
        for m in plan.moves:
            mv = kv_move_seconds(m.kv_blocks, cfg.transfer)
            spent[m.src] += mv
            spent[m.dst] += recompute_seconds(tokens[m.req_id], cfg.transfer) if m.recompute else mv
        worst = max(spent.values(), default=0.0)
        assert worst <= cfg.max_round_s * (1 + 1e-9), f"a rank spends {worst:.3f} s > max_round_s {cfg.max_round_s}"
    new = apply_plan(states, plan)
    before = sorted(r.req_id for s in states for r in (*s.waiting, *s.running))
    after = sorted(r.req_id for s in new for r in (*s.waiting, *s.running))
    assert before == after, "requests lost or duplicated"
    for s in new:
        w = _local_admission(s, cfg)
        assert w.count <= s.max_num_seqs, f"rank {s.rank}: {w.count} running > max_num_seqs {s.max_num_seqs}"
        assert w.used_blocks <= s.num_kv_blocks, f"rank {s.rank}: KV blocks {w.used_blocks} > {s.num_kv_blocks}"
    for s in new:
        admitted = {r.req_id for r in _local_admission(s, cfg).admitted}
        for m in plan.moves:
            if m.dst == s.rank and m.phase == 1:
                assert m.req_id in admitted, f"moved waiting request {m.req_id} not admitted on rank {s.rank}"


#: where moved KV blocks travel: the DP group's device communicator, or host memory over gloo
KV_PATHS = ("device", "host")


@dataclass(frozen=True)
class RebalanceSettings:
    """Run-time switches: the ``qwen3_rl.rollout_rebalance`` section of the recipe's config group (its keys,
    types and defaults are declared here only; :mod:`qwen3_rl.trainer.seam` validates the group into it).

    ``interval_steps``: engine steps between rounds. ``max_moves``: requests moved per round.
    ``timeout_s``: seconds any rebalance collective / transfer may take before a clear error.

    ``max_round_s``: seconds one round may cost a DP rank (KV bytes sent + received / link, plus the
    prefill of prefixes it recomputes; 0 = no bound). ``max_kv_bytes``: optional byte cap per rank and
    round (0 = none). ``kv_link_gb_s``: KV path bandwidth in GB/s (1e9 B/s, bytes sent + received per
    second and rank); 0 = measured at the first round. ``prefill_tokens_per_s``: prefill throughput
    (tokens/s, 0 = never recompute). Together they drive the per-request move-vs-recompute decision
    (:func:`qwen3_rl.rollout.rebalance.should_recompute`) and the time bound. ``kv_path``: ``"device"`` (the
    DP group's device communicator; host path when the engine has none) or ``"host"`` (host memory over
    gloo).
    """

    enable: bool = False
    interval_steps: int = 32
    timeout_s: float = 60.0
    max_kv_bytes: int = DEFAULT_MAX_KV_BYTES
    kv_link_gb_s: float = DEFAULT_KV_LINK_GB_S
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    max_round_s: float = DEFAULT_MAX_ROUND_S
    kv_path: str = "device"
    max_moves: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            raise ValueError(f"rollout_rebalance must be a bool, got {self.enable!r}")
        if isinstance(self.max_moves, bool) or int(self.max_moves) < 1:
            raise ValueError(f"max_moves must be >= 1, got {self.max_moves!r}")
        if self.interval_steps < 1 or self.timeout_s <= 0:
            raise ValueError(f"interval_steps ({self.interval_steps}) must be >= 1 and timeout_s "
                             f"({self.timeout_s}) > 0")
        if self.max_kv_bytes < 0 or self.kv_link_gb_s < 0 or self.prefill_tokens_per_s < 0 or self.max_round_s < 0:
            raise ValueError(f"max_kv_bytes ({self.max_kv_bytes}), kv_link_gb_s ({self.kv_link_gb_s}), "
                             f"prefill_tokens_per_s ({self.prefill_tokens_per_s}) and max_round_s "
                             f"({self.max_round_s}) must be >= 0")
        if self.kv_path not in KV_PATHS:
            raise ValueError(f"rollout_rebalance_kv_path must be one of {', '.join(KV_PATHS)}, got {self.kv_path!r}")

    def transfer_cost(self, kv_bytes_per_block: int, link_bytes_per_s: float | None = None) -> TransferCost:
        """The planner's move-vs-recompute cost model for KV blocks of ``kv_bytes_per_block`` bytes (link:
        the given bytes/s, else ``kv_link_gb_s``)."""
        link = link_bytes_per_s if link_bytes_per_s is not None else self.kv_link_gb_s * 1e9
        return TransferCost(int(kv_bytes_per_block), float(link), self.prefill_tokens_per_s)
