"""Rollout simulator: continuous batching per DP rank, default vs data rebalance vs rollout rebalance.

Commands (``python -m qwen3_rl simulate ...``)::

    simulate rollout --lengths FILE --dp N --max-num-seqs M --policy P [--coupling C] [--plot out.png] [--json]
        [--drafting D] [--step-table F --shape NAME] [--trainer fully-async --staleness S --rollout-dies R ...]
        [--placement sync|spread|group --servers S --routing-slack N --agent-workers W]
    simulate gen-lengths --out FILE [--num-prompts 512 --n 16 --seed 0 ...]
    simulate fit-step-model --lengths FILE [--dp 32 --max-num-seqs 256]

Model
-----
The batch (``B = num_prompts * n`` samples, dataset order, samples of a prompt adjacent) is cut into
``dp`` contiguous chunks, one per DP rank (verl ``DataProto.chunk``); ``data-rebalance`` first applies
:func:`qwen3_rl.rollout.data_rebalance.rebalance_permutation`. Each rank runs continuous batching:
FCFS admission while fewer than ``max_num_seqs`` run; a request admitted at step ``s`` emits one token
per step and leaves after ``response_len`` steps. KV capacity is not simulated (the 32K reference run,
[ref 002 §2.1], runs 256 sequences per rank by design); the rebalance planner gets an unlimited KV pool unless
``--kv-blocks-per-rank`` is given.

Step time (milliseconds), one decode step of a rank holding ``R`` running requests whose context
lengths sum to ``C`` tokens, ``P`` prompt tokens prefilled in the step::

    t = t0 + per_seq * bucket(R) + per_kctx * C / 1000 + per_prefill_ktok * P / 1000

``bucket(R)`` is the graph batch size the step runs (smallest bucket >= R; vLLM's default capture
sizes up to ``max_num_seqs`` unless ``--buckets`` is given).

* ``independent`` coupling (dense model, DP ranks are separate engines): each rank steps on its own
  clock with its own ``R, C, P``; a rank with nothing to run is idle.
* ``lockstep`` coupling (MoE whose expert parallelism spans the DP ranks, e.g. 235B's EP128): all
  ranks step together; vLLM pads every rank to the largest batch (``coordinate_batch_across_dp``), and
  the EP all-to-alls make every layer wait for the slowest rank, so
  ``t = t0 + per_seq * bucket(max_r R_r) + per_kctx * max_r C_r / 1000 + per_prefill_ktok * max_r P_r / 1000``.
  A rank with no requests still steps (dummy batch) but does no useful work: it is counted idle.

``rollout-rebalance``: every ``--rebalance-interval`` steps (lockstep) or every
``interval * t(max bucket, C=0)`` seconds (independent) the ranks exchange load and apply
:func:`qwen3_rl.rollout.rebalance.plan_rebalance`; a round costs ``round_overhead_ms`` plus the KV
transfer time ``max_r bytes_r / link`` (bytes sent + received by rank ``r``, ``kv_bytes_per_token`` per
context token of a migrated running request). ``abort-reprefill``: the same rounds without a KV path, every moved
running request prefilled again (prompt + generated tokens) on its target.

Server mode (``--placement spread|group``, ``sim/server.py``): the batch is placed request by request by the
product's routers instead of verl's chunks; ``--servers S`` splits the ``dp`` engines into servers (lockstep
coupling: one server). KV moves (``rollout-rebalance``) stay inside a server; ``abort-reprefill`` may cross servers
(verl's agent loop resubmits the aborted request). Gains are against the sync default.

Lower bound: the makespan if requests could be rebalanced perfectly and for free at every step — one
pooled queue with ``dp * max_num_seqs`` slots, each step costing ``t0 + per_seq * bucket(ceil(R/dp)) +
per_kctx * (C/dp) / 1000 + per_prefill_ktok * (P/dp) / 1000``.

Default step-model parameters (fitted, see :func:`fit_step_model` and ``docs/rollout_balancing.md``):
``t0`` is set so that a small-batch step costs about 60 ms (published figure after rebalancing),
``per_seq`` and ``per_kctx`` so that on the reference-like lengths (DP 32, 256 sequences per rank,
lockstep, default layout) the mean step is 137.64 ms ([ref 002 §2.2] baseline) and the slowest step 200 ms (the
upper end of the published 125-200 ms per output token before rebalancing).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from qwen3_rl.rollout.data_rebalance import (
    contiguous_rank_of_rows,
    keyed_permutation,
    rank_sizes,
    rebalance_permutation,
)
from qwen3_rl.rollout.rebalance import (
    DEFAULT_MAX_KV_BYTES,
    DEFAULT_MAX_ROUND_S,
    RankState,
    RebalanceConfig,
    RunningRequest,
    WaitingRequest,
    bucket_for,
    plan_rebalance,
    round_config,
)
from qwen3_rl.tools.sim.lengths import (
    REF_DP,
    REF_MAX_RESPONSE,
    REF_MEAN_PROMPT,
    REF_MEAN_RESPONSE,
    REF_N,
    REF_NUM_PROMPTS,
    Lengths,
    LengthsError,
    default_spreads,
    generate_lengths,
    load_lengths,
    write_lengths,
)

POLICIES = ("default", "data-rebalance", "rollout-rebalance", "both")
#: rollout rebalance without the KV: a moved running request is aborted and prefilled again (prompt + generated
#: tokens) on its target engine, any engine of the cluster (server mode: the agent loop resubmits it)
REPREFILL = "abort-reprefill"
#: policies of the server placements (``--placement spread|group``): no rebalance, KV moves inside a server, re-prefill
SERVER_POLICIES = ("default", "rollout-rebalance", REPREFILL)
PLACEMENTS = ("sync", "spread", "group")  # sync: verl's SPMD chunks; spread / group: server mode (sim/server.py)
COUPLINGS = ("lockstep", "independent")
KV_BYTES_PER_TOKEN = 1.47e9 / 32768  # [ref 002 §2.1]: one 32K sequence holds 1.47 GB of KV cache
#: default KV link per rank, GB/s: a device-class figure, one 200 Gb/s RoCE port per NPU (the scale-out
#: port each NPU of an Atlas 800T A2 / A3 server has) = 25 GB/s; assumed, not measured on an A3 (HCCS
#: inside a node or super-node is faster; the CPU host path measures 0.4-0.7 GB/s, section 6 of
#: docs/rollout_balancing.md)
DEVICE_LINK_GB_S = 25.0
DEVICE_LINK_SOURCE = "device-class default: one 200 Gb/s RoCE port per NPU (assumed, not measured on an A3)"


class SimError(ValueError):
    """Bad simulator input (reported as a one-line error by the CLI)."""


def vllm_default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM 0.13's default graph capture sizes (``[1, 2, 4] + range(8, 256, 8) + range(256, 513, 16)``)
    that a decode batch of at most ``max_num_seqs`` can use, plus ``max_num_seqs`` itself."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, min(2 * max_num_seqs, 512) + 1, 16)]
    out = sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})
    return tuple(out)


@dataclass(frozen=True)
class StepModel:
    """Decode step time model (see module docstring). Times in ms, link in GB/s."""

    t0_ms: float = 59.64
    per_seq_ms: float = 0.3614
    per_kctx_ms: float = 0.07064
    per_prefill_ktok_ms: float = 100.0
    kv_bytes_per_token: float = KV_BYTES_PER_TOKEN
    link_gb_s: float = DEVICE_LINK_GB_S
    round_overhead_ms: float = 1.0

    def step_ms(self, bucket: float, ctx_tokens: float, prefill_tokens: float = 0.0) -> float:
        """One step: ``bucket`` padded sequences, ``ctx_tokens`` context tokens, ``prefill_tokens`` prompt tokens."""
        return (self.t0_ms + self.per_seq_ms * bucket + self.per_kctx_ms * ctx_tokens / 1000.0
                + self.per_prefill_ktok_ms * prefill_tokens / 1000.0)


@dataclass(frozen=True)
class SimConfig:
    """One simulation: DP size, per-rank batch cap, policy, coupling, graph buckets, step model, rebalance knobs."""

    dp: int
    max_num_seqs: int
    policy: str = "default"
    coupling: str = "lockstep"
    buckets: tuple[int, ...] = ()
    step: StepModel = field(default_factory=StepModel)
    rebalance_interval: int = 32
    max_moves: int = 128
    max_kv_blocks: int = 1 << 20
    block_size: int = 128
    kv_blocks_per_rank: int | None = None
    max_kv_bytes: int = DEFAULT_MAX_KV_BYTES
    max_round_s: float = DEFAULT_MAX_ROUND_S
    recompute: bool = True
    placement: str = "sync"
    servers: int = 1  # the dp engines form this many servers; KV moves stay inside one
    routing_slack: int = 0  # group placement: GroupRouter's slack
    agent_workers: int = 8  # server placements: routers, one per agent-loop worker
    rebalance_by_key: bool = False  # data rebalance places a prompt's samples by its group key (DATA_REBALANCE_BY_KEY)

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise SimError(f"--dp must be >= 1, got {self.dp}")
        if self.max_num_seqs < 1:
            raise SimError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in (*POLICIES, REPREFILL):
            raise SimError(f"unknown policy {self.policy!r} (choose from {', '.join((*POLICIES, REPREFILL))})")
        if self.placement not in PLACEMENTS:
            raise SimError(f"unknown placement {self.placement!r} (choose from {', '.join(PLACEMENTS)})")
        if self.servers < 1 or self.dp % self.servers:
            raise SimError(f"--dp {self.dp} must be a multiple of --servers {self.servers}")
        if self.placement != "sync" and self.data_rebalance:
            raise SimError("data rebalance permutes the SPMD batch; server placements route each request")
        if self.coupling == "lockstep" and self.servers > 1:
            raise SimError("lockstep coupling spans one server's DP ranks: use --servers 1 or --coupling independent")
        if self.routing_slack < 0 or self.agent_workers < 1:
            raise SimError("--routing-slack must be >= 0 and --agent-workers >= 1")
        if self.policy == REPREFILL and (not self.recompute or self.step.per_prefill_ktok_ms <= 0):
            raise SimError(f"{REPREFILL} re-prefills moved requests: it needs recompute and a prefill cost > 0")
        if self.coupling not in COUPLINGS:
            raise SimError(f"unknown coupling {self.coupling!r} (choose from {', '.join(COUPLINGS)})")
        if self.rebalance_interval < 1:
            raise SimError("--rebalance-interval must be >= 1")
        if self.buckets and list(self.buckets) != sorted(set(self.buckets)):
            raise SimError("--buckets must be strictly ascending")

    def rebalance_config(self) -> RebalanceConfig:
        """The planner's config, made by :func:`qwen3_rl.rollout.rebalance.round_config` as the run-time
        coordinator makes it: blocks of ``kv_bytes_per_token * block_size`` bytes, ``link_gb_s``, the prefill
        rate ``1e6 / per_prefill_ktok_ms`` tokens/s (0 without ``recompute``), ``max_round_s`` and the
        optional byte cap ``max_kv_bytes``."""
        sm = self.step
        bpb = int(round(sm.kv_bytes_per_token * self.block_size))
        prefill = 1e6 / sm.per_prefill_ktok_ms if self.recompute and sm.per_prefill_ktok_ms > 0 else 0.0
        base = RebalanceConfig(buckets=self.graph_buckets, block_size=self.block_size, max_moves=self.max_moves,
                               max_kv_blocks=self.max_kv_blocks)
        # abort-reprefill: no KV path (link 0), so every running move is a recompute (rebalance._options)
        link = 0.0 if self.policy == REPREFILL else sm.link_gb_s * 1e9
        return round_config(base, kv_bytes_per_block=bpb, link_bytes_per_s=link,
                            prefill_tokens_per_s=prefill, max_round_s=self.max_round_s, max_kv_bytes=self.max_kv_bytes)

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """Buckets in use (vLLM defaults if none were given)."""
        return self.buckets or vllm_default_buckets(self.max_num_seqs)

    @property
    def data_rebalance(self) -> bool:
        """Whether the batch is permuted before chunking."""
        return self.policy in ("data-rebalance", "both")

    @property
    def rollout_rebalance(self) -> bool:
        """Whether ranks migrate requests during the rollout."""
        return self.policy in ("rollout-rebalance", "both", REPREFILL)

    @property
    def rebalance_groups(self) -> list[range]:
        """Ranks that exchange requests: one server's DP ranks each (KV moves), all ranks for abort-reprefill."""
        if self.policy == REPREFILL:
            return [range(self.dp)]
        size = self.dp // self.servers
        return [range(g * size, (g + 1) * size) for g in range(self.servers)]

    @property
    def rebalancing(self) -> bool:
        """Whether a rebalance round can move anything (a policy that migrates, a group of two ranks or more)."""
        return self.rollout_rebalance and max(len(g) for g in self.rebalance_groups) > 1


@dataclass
class SimResult:
    """Outcome of one simulation. Times in seconds; ``first_idle_share`` in [0, 1]."""

    policy: str
    coupling: str
    makespan_s: float
    rank_finish_s: list[float]
    first_idle_share: float
    steps: int
    mean_step_ms: float
    rounds: int = 0
    migrations: int = 0
    kv_gb_moved: float = 0.0
    recomputed: int = 0
    transfer_s: float = 0.0
    link_gb_s: float = 0.0
    generated_tokens: int = 0
    lower_bound_s: float | None = None
    timeline: list[list[tuple[float, float, int]]] | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        """JSON-ready dict (timeline left out)."""
        d = asdict(self)
        d.pop("timeline")
        if self.lower_bound_s:
            d["makespan_over_lower_bound"] = self.makespan_s / self.lower_bound_s
        return d


# --------------------------------------------------------------------------------------- engine


class _Engine:
    """Per-rank continuous-batching state. Request ``i``: generated tokens = ``S[rank[i]] - base[i]``."""

    def __init__(self, lengths: Lengths, cfg: SimConfig, assignment: Sequence[np.ndarray], record: bool) -> None:
        self.cfg = cfg
        self.plen = lengths.prompt_len.astype(np.int64)
        self.rlen = lengths.response_len.astype(np.int64)
        nreq = self.rlen.shape[0]
        self.base = np.zeros(nreq, dtype=np.int64)
        self.rank = np.full(nreq, -1, dtype=np.int64)
        self.epoch = np.zeros(nreq, dtype=np.int64)
        self.ndp = len(assignment)
        self.waiting: list[deque[int]] = [deque(int(i) for i in a) for a in assignment]
        for r, a in enumerate(assignment):
            self.rank[np.asarray(a, dtype=np.int64)] = r
        self.heaps: list[list[tuple[int, int, int]]] = [[] for _ in range(self.ndp)]
        self.R = np.zeros(self.ndp, dtype=np.int64)
        self.C = np.zeros(self.ndp, dtype=np.int64)
        self.P = np.zeros(self.ndp, dtype=np.int64)
        self.S = np.zeros(self.ndp, dtype=np.int64)
        self.t = np.zeros(self.ndp, dtype=np.float64)
        self.finish = np.zeros(self.ndp, dtype=np.float64)
        self.timeline: list[list[tuple[float, float, int]]] | None = [[] for _ in range(self.ndp)] if record else None
        self.cap = cfg.max_num_seqs

    def has_work(self, r: int) -> bool:
        return bool(self.R[r] or self.waiting[r])

    def any_work(self) -> bool:
        return bool(self.R.any()) or any(self.waiting)

    def admit(self, r: int) -> None:
        wq = self.waiting[r]
        while wq and self.R[r] < self.cap:
            i = wq.popleft()
            self.base[i] = self.S[r]
            heapq.heappush(self.heaps[r], (int(self.S[r] + self.rlen[i]), i, int(self.epoch[i])))
            self.R[r] += 1
            self.C[r] += self.plen[i]
            self.P[r] += self.plen[i]

    def admit_all(self, step: int) -> int | None:
        """Admit waiting requests on every rank; steps from ``step`` to the next finish (None: nothing runs)."""
        for r in range(self.ndp):
            self.admit(r)
        if not self.R.any():
            return None
        return min(f - step for r in range(self.ndp) if (f := self.next_finish(r)) is not None)

    def next_finish(self, r: int) -> int | None:
        h = self.heaps[r]
        while h and (self.epoch[h[0][1]] != h[0][2] or self.rank[h[0][1]] != r):
            heapq.heappop(h)
        return h[0][0] if h else None

    def advance(self, r: int, k: int) -> None:
        """Rank ``r`` completes ``k`` steps (time handled by the caller); finished requests leave."""
        self.S[r] += k
        self.C[r] += k * self.R[r]
        self.P[r] = 0
        h = self.heaps[r]
        while True:
            f = self.next_finish(r)
            if f is None or f > self.S[r]:
                break
            _, i, _ = heapq.heappop(h)
            self.R[r] -= 1
            self.C[r] -= self.plen[i] + self.rlen[i]
            self.rank[i] = -2  # done

    def record(self, r: int, t0: float, t1: float, count: int) -> None:
        if self.timeline is not None and t1 > t0:
            tl = self.timeline[r]
            if tl and tl[-1][2] == count and abs(tl[-1][1] - t0) < 1e-12:
                tl[-1] = (tl[-1][0], t1, count)
            else:
                tl.append((t0, t1, count))

    # -- rebalance ------------------------------------------------------------------------------

    def running_ids(self, r: int) -> list[int]:
        return [i for (_, i, e) in self.heaps[r] if self.epoch[i] == e and self.rank[i] == r]

    def states(self) -> list[RankState]:
        cfg = self.cfg
        kv = cfg.kv_blocks_per_rank
        if kv is None:
            kv = self.cap * (-(-int(self.plen.max() + self.rlen.max() + 1) // cfg.block_size))
        out = []
        for r in range(self.ndp):
            run = []
            for i in self.running_ids(r):
                ctx = int(self.plen[i] + self.S[r] - self.base[i])
                run.append(RunningRequest(str(i), ctx, -(-(ctx + 1) // cfg.block_size)))
            wait = tuple(WaitingRequest(str(i), int(self.plen[i])) for i in self.waiting[r])
            out.append(RankState(r, wait, tuple(run), self.cap, kv))
        return out

    def maybe_plan_needed(self, buckets: Sequence[int]) -> bool:
        """Cheap pre-check on counts (exact for the unlimited-KV case): could a plan be non-empty?"""
        stuck = any(len(w) > 0 for w in self.waiting)
        room = bool((self.R < self.cap).any())
        if stuck and room:
            return True
        total = int(self.R.sum())
        cur = bucket_for(int(self.R.max()), buckets)
        for b in buckets:
            if b >= cur:
                return False
            if self.ndp * min(b, self.cap) >= total:
                return True
        return False

    def migrate(self, plan_states: list[RankState], rcfg: RebalanceConfig) -> tuple[int, np.ndarray, int]:
        """Plan and apply one round. Returns (#moves, bytes sent+received per rank, #moves recomputed).

        A recomputed move carries no KV: its context is prefilled on the target in the next step."""
        moves = [m for g in self.cfg.rebalance_groups if len(g) > 1
                 for m in plan_rebalance([plan_states[r] for r in g], rcfg).moves]
        io = np.zeros(self.ndp, dtype=np.float64)
        for m in moves:
            i = int(m.req_id)
            if m.phase == 1:
                self.waiting[m.src].remove(i)
                self.waiting[m.dst].append(i)
                self.rank[i] = m.dst
                continue
            g = int(self.S[m.src] - self.base[i])
            ctx = int(self.plen[i]) + g
            self.R[m.src] -= 1
            self.C[m.src] -= ctx
            self.epoch[i] += 1
            self.rank[i] = m.dst
            self.base[i] = self.S[m.dst] - g
            heapq.heappush(self.heaps[m.dst], (int(self.S[m.dst] + self.rlen[i] - g), i, int(self.epoch[i])))
            self.R[m.dst] += 1
            self.C[m.dst] += ctx
            if m.recompute:
                self.P[m.dst] += ctx
                continue
            nbytes = ctx * self.cfg.step.kv_bytes_per_token
            io[m.src] += nbytes
            io[m.dst] += nbytes
        return len(moves), io, sum(1 for m in moves if m.recompute)


def _assignment(lengths: Lengths, dp: int, data_rebalance: bool, cfg: SimConfig | None = None) -> list[np.ndarray]:
    """Rows (request ids, in rank queue order) that each DP rank receives (``cfg``'s server placement if any)."""
    size = lengths.size
    if cfg is not None and cfg.placement != "sync":
        from qwen3_rl.tools.sim.server import server_assignment

        try:
            return server_assignment(lengths.num_prompts, lengths.n, dp, cfg.servers, cfg.placement,
                                     cfg.routing_slack, cfg.agent_workers)
        except ValueError as e:
            raise SimError(str(e)) from None
    if data_rebalance and cfg is not None and cfg.rebalance_by_key:
        if size % dp:
            raise SimError(f"--rebalance-by-key: a batch of {size} rows is not a multiple of --dp {dp}")
        keys = np.random.default_rng(0).integers(0, np.iinfo(np.int64).max, lengths.num_prompts).astype(np.uint64)
        perm = keyed_permutation(keys, lengths.n, dp)
        return list(perm.reshape(dp, size // dp))
    if data_rebalance:
        perm = rebalance_permutation(size, lengths.n, dp, uneven="array_split")
        offs = np.r_[0, np.cumsum(rank_sizes(size, dp))]
        return [perm[offs[r]:offs[r + 1]] for r in range(dp)]
    ranks = contiguous_rank_of_rows(size, dp)
    return [np.flatnonzero(ranks == r) for r in range(dp)]


def _sum_max_lines(C: np.ndarray, R: np.ndarray, k: int) -> tuple[float, float]:
    """``sum_{j<k} max_r (C_r + j R_r)`` and its maximum term, exactly (numpy, chunked)."""
    total = 0.0
    peak = 0.0
    start = 0
    Cf = C.astype(np.float64)[:, None]
    Rf = R.astype(np.float64)[:, None]
    while start < k:
        j = np.arange(start, min(k, start + 8192), dtype=np.float64)[None, :]
        m = (Cf + Rf * j).max(axis=0)
        total += float(m.sum())
        peak = max(peak, float(m.max()))
        start += j.shape[1]
    return total, peak


class DraftModelLike(Protocol):
    """``sim.drafting.DraftModel``: the time of a segment run as SAM verification steps (``record``: count its k)."""

    def segment_ms(self, sm: StepModel, nsteps: int, running: int, bucket: int, ctx_sum: float,
                   prefill_tokens: float, record: bool = True) -> float: ...


@dataclass
class _Stats:
    steps: int = 0
    busy_ms: float = 0.0
    rounds: int = 0
    migrations: int = 0
    recomputed: int = 0
    transfer_s: float = 0.0
    bytes_moved: float = 0.0
    peak_step_ms: float = 0.0
    step_ms_sum: float = 0.0
    tokens: int = 0


def _run_lockstep(eng: _Engine, cfg: SimConfig, share: int = 1, draft: DraftModelLike | None = None) -> _Stats:
    """All ranks step together. ``share > 1`` (one pooled rank) gives the perfect-rebalancing lower bound.
    ``draft``: SAM verification steps (``sim/drafting.py``: a segment's time from its draft length)."""
    sm = cfg.step
    buckets = cfg.graph_buckets
    st = _Stats()
    rcfg = cfg.rebalance_config()
    next_round = cfg.rebalance_interval
    rebalancing = cfg.rebalancing and share == 1 and eng.ndp > 1  # one rank: nothing to balance
    t = 0.0
    S = 0
    while True:
        k = eng.admit_all(S)
        if k is None:
            break
        if rebalancing:
            k = min(k, next_round - S)
        maxR = int(eng.R.max())
        bucket = bucket_for(-(-maxR // share), buckets)
        csum, cpeak = _sum_max_lines(eng.C, eng.R, k)
        pre = float(eng.P.max()) / share
        seg_ms = k * (sm.t0_ms + sm.per_seq_ms * bucket) + sm.per_kctx_ms * csum / share / 1000.0 \
            + sm.per_prefill_ktok_ms * pre / 1000.0
        if draft is not None:
            seg_ms = draft.segment_ms(sm, k, maxR, bucket, csum / share, pre)
        first_ms = sm.step_ms(bucket, float(eng.C.max()) / share, pre)
        last_ms = sm.step_ms(bucket, cpeak / share)
        st.peak_step_ms = max(st.peak_step_ms, first_ms, last_ms)
        t1 = t + seg_ms / 1000.0
        for r in range(eng.ndp):
            eng.record(r, t, t1, int(eng.R[r]))
            if eng.R[r]:
                eng.finish[r] = t1
        t = t1
        S += k
        st.steps += k
        st.step_ms_sum += seg_ms
        st.tokens += k * int(eng.R.sum())
        for r in range(eng.ndp):
            eng.advance(r, k)
        if rebalancing and S == next_round:
            next_round += cfg.rebalance_interval
            st.rounds += 1
            for r in range(eng.ndp):
                eng.admit(r)
            # admissions above are counted as prefill of the next step (P kept)
            extra_ms = sm.round_overhead_ms
            if eng.any_work() and eng.maybe_plan_needed(buckets):
                nmov, io, nrec = eng.migrate(eng.states(), rcfg)
                st.migrations += nmov
                st.recomputed += nrec
                st.bytes_moved += float(io.sum()) / 2
                st.transfer_s += float(io.max()) / (sm.link_gb_s * 1e9)
                extra_ms += float(io.max()) / (sm.link_gb_s * 1e9) * 1000.0
            t += extra_ms / 1000.0
    eng.t[:] = t
    return st


def _steps_until(sm: StepModel, bucket: int, C: int, R: int, budget_ms: float, pre_ms: float) -> int:
    """Smallest k >= 1 whose k-step time (independent rank) reaches ``budget_ms``."""
    a = sm.per_kctx_ms * R / 2000.0  # ms per step^2 / 2 ... time(k) = k*b0 + a*k*(k-1) + pre
    b0 = sm.t0_ms + sm.per_seq_ms * bucket + sm.per_kctx_ms * C / 1000.0
    need = budget_ms - pre_ms
    if need <= b0:
        return 1
    if a <= 0:
        return max(1, math.ceil(need / b0))
    # a k^2 + (b0 - a) k - need >= 0
    bb = b0 - a
    k = math.ceil((-bb + math.sqrt(bb * bb + 4 * a * need)) / (2 * a))
    while k > 1 and (k - 1) * b0 + a * (k - 1) * (k - 2) >= need:
        k -= 1
    while k * b0 + a * k * (k - 1) < need:
        k += 1
    return max(1, k)


def _draft_steps_until(draft: DraftModelLike, sm: StepModel, k_max: int, running: int, bucket: int, C0: float,
                       budget_ms: float, prefill_tokens: float) -> int:
    """Smallest k in [1, k_max] whose drafted segment (independent rank) reaches ``budget_ms``, else ``k_max``."""

    def seg(k: int) -> float:
        return draft.segment_ms(sm, k, running, bucket, k * C0 + running * k * (k - 1) / 2, prefill_tokens,
                                record=False)

    if seg(k_max) < budget_ms:
        return k_max
    lo, hi = 1, k_max
    while lo < hi:
        mid = (lo + hi) // 2
        if seg(mid) >= budget_ms:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _advance_independent(eng: _Engine, cfg: SimConfig, r: int, until_s: float, st: _Stats,
                         draft: DraftModelLike | None = None) -> None:
    """Run rank ``r`` on its own clock until it passes ``until_s`` or runs out of work (``draft``: SAM steps)."""
    sm = cfg.step
    buckets = cfg.graph_buckets
    while eng.t[r] < until_s:
        eng.admit(r)
        if not eng.R[r]:
            return
        f = eng.next_finish(r)
        assert f is not None
        k = int(f - eng.S[r])
        bucket = bucket_for(int(eng.R[r]), buckets)
        pre_ms = sm.per_prefill_ktok_ms * float(eng.P[r]) / 1000.0
        C0, R0 = float(eng.C[r]), float(eng.R[r])
        if math.isfinite(until_s):
            budget = (until_s - eng.t[r]) * 1000.0
            k = min(k, _steps_until(sm, bucket, int(eng.C[r]), int(eng.R[r]), budget, pre_ms)) if draft is None \
                else _draft_steps_until(draft, sm, k, int(R0), bucket, C0, budget, float(eng.P[r]))
        seg_ms = k * (sm.t0_ms + sm.per_seq_ms * bucket + sm.per_kctx_ms * C0 / 1000.0) \
            + sm.per_kctx_ms * R0 * k * (k - 1) / 2 / 1000.0 + pre_ms
        if draft is not None:
            seg_ms = draft.segment_ms(sm, k, int(R0), bucket, k * C0 + R0 * k * (k - 1) / 2, float(eng.P[r]))
        st.peak_step_ms = max(st.peak_step_ms, sm.step_ms(bucket, C0 + R0 * (k - 1)), sm.step_ms(bucket, C0) + pre_ms)
        t1 = eng.t[r] + seg_ms / 1000.0
        eng.record(r, float(eng.t[r]), t1, int(eng.R[r]))
        eng.t[r] = t1
        eng.finish[r] = t1
        st.steps += k
        st.step_ms_sum += seg_ms
        st.tokens += k * int(eng.R[r])
        eng.advance(r, k)


def _run_independent(eng: _Engine, cfg: SimConfig, draft: DraftModelLike | None = None) -> _Stats:
    st = _Stats()
    if not cfg.rebalancing or eng.ndp == 1:
        for r in range(eng.ndp):
            _advance_independent(eng, cfg, r, math.inf, st, draft)
        return st
    sm = cfg.step
    buckets = cfg.graph_buckets
    rcfg = cfg.rebalance_config()
    period = cfg.rebalance_interval * sm.step_ms(buckets[-1], 0.0) / 1000.0
    tau = 0.0
    while eng.any_work():
        tau += period
        for r in range(eng.ndp):
            _advance_independent(eng, cfg, r, tau, st, draft)
        if not eng.any_work():
            break
        st.rounds += 1
        for r in range(eng.ndp):
            eng.admit(r)
        if eng.maybe_plan_needed(buckets):
            nmov, io, nrec = eng.migrate(eng.states(), rcfg)
            st.migrations += nmov
            st.recomputed += nrec
            st.bytes_moved += float(io.sum()) / 2
            st.transfer_s += float(io.max()) / (sm.link_gb_s * 1e9)
            for r in range(eng.ndp):
                if io[r] > 0:  # both ends pay the transfer; an idle receiver starts no earlier than the round
                    eng.t[r] = max(float(eng.t[r]), tau) + io[r] / (sm.link_gb_s * 1e9) + sm.round_overhead_ms / 1000.0
        for r in range(eng.ndp):
            if eng.has_work(r) and eng.t[r] < tau:
                eng.t[r] = tau  # idle until the round brought it work
    return st


def simulate(lengths: Lengths, cfg: SimConfig, *, record_timeline: bool = False,
             draft: DraftModelLike | None = None) -> SimResult:
    """Simulate one rollout of ``lengths`` under ``cfg``; returns makespan, rank finish times, idle share.
    ``draft``: SAM verification steps with per-step k (``sim/drafting.py``)."""
    eng = _Engine(lengths, cfg, _assignment(lengths, cfg.dp, cfg.data_rebalance, cfg), record_timeline)
    st = _run_lockstep(eng, cfg, draft=draft) if cfg.coupling == "lockstep" else _run_independent(eng, cfg, draft)
    finish = [float(x) for x in eng.finish]
    makespan = max(finish) if finish else 0.0
    idle = (makespan - min(finish)) / makespan if makespan > 0 else 0.0
    nsteps = st.steps if cfg.coupling == "lockstep" else int(eng.S.max())
    return SimResult(
        policy=cfg.policy, coupling=cfg.coupling, makespan_s=makespan, rank_finish_s=finish,
        first_idle_share=idle, steps=nsteps,
        mean_step_ms=(st.step_ms_sum / st.steps) if st.steps else 0.0,
        rounds=st.rounds, migrations=st.migrations, kv_gb_moved=st.bytes_moved / 1e9, recomputed=st.recomputed,
        transfer_s=st.transfer_s, link_gb_s=cfg.step.link_gb_s if cfg.rollout_rebalance else 0.0,
        generated_tokens=st.tokens, timeline=eng.timeline,
    )


def lower_bound(lengths: Lengths, cfg: SimConfig) -> float:
    """Makespan (s) with perfect, free rebalancing at every step: one pooled queue, load split evenly."""
    pooled = replace(cfg, policy="default", coupling="lockstep", max_num_seqs=cfg.dp * cfg.max_num_seqs,
                     buckets=cfg.graph_buckets, placement="sync", servers=1)
    eng = _Engine(lengths, pooled, [np.arange(lengths.size)], False)
    _run_lockstep(eng, pooled, share=cfg.dp)
    return float(eng.t.max()) if lengths.size else 0.0


# ----------------------------------------------------------------------------------- fitting


def fit_step_model(lengths: Lengths, dp: int = REF_DP, max_num_seqs: int = 256, *, small_step_ms: float = 60.0,
                   mean_step_ms: float = 137.64, peak_step_ms: float = 200.0,
                   base: StepModel | None = None) -> StepModel:
    """Fit ``t0``, ``per_seq``, ``per_kctx`` to three published figures on the default lockstep rollout.

    ``small_step_ms``: a step at the smallest bucket with a short context (``t0 + per_seq``);
    ``mean_step_ms``: mean step over the default rollout ([ref 002 §2.2]: 137.64 ms per 235B decode step);
    ``peak_step_ms``: the slowest step (upper end of the published 125-200 ms per output token before
    rebalancing). Step counts, buckets and context sums of the default lockstep rollout do not depend on
    the step model, so each fit is a 3x3 linear solve; which step is the slowest does, so the solve is
    repeated until the slowest step stops changing.
    """
    base = base or StepModel()
    cfg = SimConfig(dp=dp, max_num_seqs=max_num_seqs, policy="default", coupling="lockstep")
    seg = _lockstep_segments(lengths, cfg)
    k, bucket, csum, cpeak, pre = (seg[:, i] for i in range(5))
    steps = k.sum()
    mean_bucket = float((k * bucket).sum() / steps)
    mean_kctx = float(csum.sum() / steps / 1000.0)
    pre_ms = base.per_prefill_ktok_ms * float(pre.sum()) / 1000.0 / steps
    peak_i = int(np.argmax(bucket))
    x = np.zeros(3)
    for _ in range(20):
        A = np.array([[1.0, 1.0, 0.0],
                      [1.0, mean_bucket, mean_kctx],
                      [1.0, bucket[peak_i], cpeak[peak_i] / 1000.0]])
        x = np.linalg.solve(A, np.array([small_step_ms, mean_step_ms - pre_ms, peak_step_ms]))
        new_i = int(np.argmax(x[1] * bucket + x[2] * cpeak / 1000.0))
        if new_i == peak_i:
            break
        peak_i = new_i
    t0, per_seq, per_kctx = (float(v) for v in x)
    if min(t0, per_seq, per_kctx) < 0:
        raise SimError(f"fit gave a negative parameter: t0={t0:.3f} per_seq={per_seq:.4f} per_kctx={per_kctx:.5f}")
    return replace(base, t0_ms=t0, per_seq_ms=per_seq, per_kctx_ms=per_kctx)


def _lockstep_segments(lengths: Lengths, cfg: SimConfig) -> np.ndarray:
    """Segments of the default lockstep rollout: rows ``(steps, bucket, sum of busiest-rank context over the
    segment's steps, busiest-rank context at its last step, prefill tokens of its first step)``; the
    busiest-rank context grows within a segment, so its last step is its slowest."""
    eng = _Engine(lengths, cfg, _assignment(lengths, cfg.dp, cfg.data_rebalance), False)
    buckets = cfg.graph_buckets
    rows = []
    S = 0
    while True:
        k = eng.admit_all(S)
        if k is None:
            break
        csum, cpeak = _sum_max_lines(eng.C, eng.R, k)
        rows.append((k, bucket_for(int(eng.R.max()), buckets), csum, cpeak, float(eng.P.max())))
        S += k
        for r in range(eng.ndp):
            eng.advance(r, k)
    return np.asarray(rows, dtype=np.float64).reshape(-1, 5)


# --------------------------------------------------------------------------------------- plot


def plot_timelines(results: Sequence[SimResult], path: str | Path, max_num_seqs: int) -> bool:
    """Per-rank busy/idle over time (colour = running requests; white = idle), one panel per policy.

    Returns False (and writes nothing) if matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import cm, colors
    except ImportError:
        return False
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 + 1.6 * len(results)), squeeze=False, sharex=True)
    norm = colors.Normalize(vmin=0, vmax=max_num_seqs)
    cmap = colors.ListedColormap(["white", *cm.viridis(np.linspace(0.0, 1.0, 255))])
    t_end = max(r.makespan_s for r in results) or 1.0
    grid = np.linspace(0.0, t_end, 1201)
    mid = 0.5 * (grid[1:] + grid[:-1])
    for ax, res in zip(axes[:, 0], results, strict=True):
        assert res.timeline is not None
        img = np.zeros((len(res.timeline), mid.shape[0]))
        for r, segs in enumerate(res.timeline):
            if not segs:
                continue
            seg = np.asarray(segs, dtype=np.float64)
            j = np.searchsorted(seg[:, 1], mid, side="right")  # first segment ending after the bin centre
            ok = j < seg.shape[0]
            jj = np.minimum(j, seg.shape[0] - 1)
            ok &= seg[jj, 0] <= mid
            img[r] = np.where(ok, seg[jj, 2], 0.0)
        ax.imshow(img, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                  extent=(0.0, t_end, len(res.timeline) - 0.5, -0.5))
        ax.plot(res.rank_finish_s, range(len(res.rank_finish_s)), "r|", markersize=4)
        ax.set_ylabel("DP rank")
        lb = f", makespan/LB {res.makespan_s / res.lower_bound_s:.3f}" if res.lower_bound_s else ""
        ax.set_title(f"{res.policy} ({res.coupling}): makespan {res.makespan_s:.0f} s, "
                     f"first-rank idle {100 * res.first_idle_share:.1f} %{lb}  (white = idle)", fontsize=9)
    axes[-1, 0].set_xlabel("time (s)")
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes[:, 0].tolist(), label="running requests",
                 fraction=0.02, pad=0.01)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------- CLI


def _parse_buckets(text: str | None, max_num_seqs: int) -> tuple[int, ...]:
    if text is None or text == "vllm":
        return vllm_default_buckets(max_num_seqs)
    if text == "single":
        return (max_num_seqs,)
    if text == "eager":
        return tuple(range(1, max_num_seqs + 1))
    try:
        vals = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise SimError(f"--buckets: expected comma-separated ints, 'vllm', 'single' or 'eager', got {text!r}") from None
    if not vals or vals[0] < 1:
        raise SimError("--buckets must hold positive ints")
    return vals


def _step_args(p: argparse.ArgumentParser) -> None:
    d = StepModel()
    p.add_argument("--t0-ms", type=float, default=d.t0_ms, help="fixed cost per step (ms)")
    p.add_argument("--per-seq-ms", type=float, default=d.per_seq_ms, help="cost per padded sequence (ms)")
    p.add_argument("--per-kctx-ms", type=float, default=d.per_kctx_ms, help="cost per 1000 context tokens (ms)")
    p.add_argument("--per-prefill-ktok-ms", type=float, default=d.per_prefill_ktok_ms,
                   help="cost per 1000 prefilled prompt tokens (ms)")
    p.add_argument("--link-gb-s", default=str(d.link_gb_s),
                   help="KV transfer bandwidth per rank (GB/s); a comma list runs the rebalancing policies at each")
    p.add_argument("--kv-bytes-per-token", type=float, default=d.kv_bytes_per_token)
    p.add_argument("--round-overhead-ms", type=float, default=d.round_overhead_ms)


def _links(text: str) -> list[float]:
    """``--link-gb-s``: one bandwidth or a comma list (GB/s, each finite and > 0)."""
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SimError(f"--link-gb-s: expected numbers (GB/s), got {text!r}") from None
    if not vals or any(not (v > 0) or not math.isfinite(v) for v in vals):
        raise SimError("--link-gb-s must be > 0")
    return vals


def _step_from(ns: argparse.Namespace) -> StepModel:
    vals = dict(t0_ms=ns.t0_ms, per_seq_ms=ns.per_seq_ms, per_kctx_ms=ns.per_kctx_ms,
                per_prefill_ktok_ms=ns.per_prefill_ktok_ms, link_gb_s=_links(ns.link_gb_s)[0],
                kv_bytes_per_token=ns.kv_bytes_per_token, round_overhead_ms=ns.round_overhead_ms)
    for k, v in vals.items():
        if not (v >= 0) or not math.isfinite(v):
            raise SimError(f"--{k.replace('_', '-')} must be a finite number >= 0")
    return StepModel(**vals)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise SimError(f"{self.prog}: {message}")


#: Drafters for ``simulate rollout --drafting`` and their tokens per verification step (bonus included) by
#: sibling layout, measured by ``python -m qwen3_rl.tools.bench.drafters --group --spread 8 --exchange-every 1
#: --exchange-delay-steps 1`` on ``../shared/bench/rollouts_dev.jsonl`` (k = 3, batched lockstep replay):
#: siblings on one rank 1.856, spread over 8 ranks 1.666 (finished-response cache only), spread with the
#: sibling exchange 1.846 (one step late, as the vLLM hook runs it).
DRAFTING = ("none", "sam_group", "sam_group_exchange")
SPREAD_POLICIES = ("data-rebalance", "both")  # a prompt's samples on different ranks


@dataclass(frozen=True)
class Drafting:
    """Tokens per verification step of a drafter, by layout, and its host cost per step (ms)."""

    together: float = 1.856
    spread: float = 1.666
    exchange: float = 1.846
    drafter_ms: float = 0.4

    def tokens_per_step(self, drafting: str, policy: str) -> float:
        """Tokens a request advances per step: 1 without a drafter; spread layouts (data rebalance) lose the
        siblings unless the exchange brings them back."""
        if drafting == "none":
            return 1.0
        if drafting not in DRAFTING:
            raise SimError(f"unknown drafting {drafting!r} (choose from {', '.join(DRAFTING)} or 'all')")
        if policy not in SPREAD_POLICIES:
            return self.together
        return self.exchange if drafting == "sam_group_exchange" else self.spread


def with_drafting(lengths: Lengths, step: StepModel, tps: float, drafter_ms: float) -> tuple[Lengths, StepModel]:
    """The rollout in verification steps: a request of ``L`` tokens needs ``ceil(L / tps)`` steps.

    Lengths are counted in units of ``tps`` tokens (prompts too, so that the context term stays exact:
    ``per_kctx`` and ``per_prefill_ktok`` and the KV bytes per unit scale by ``tps``); the drafter's host
    cost is added to ``t0``. A verification step of ``1 + k`` query tokens per sequence is charged as a
    decode step (the step model has no per-query-token term). ``tps = 1``: unchanged.
    """
    if tps == 1.0:
        return lengths, step
    if not tps >= 1.0 or not math.isfinite(tps):
        raise SimError(f"tokens per step must be >= 1, got {tps}")
    rl = np.maximum(1, np.ceil(lengths.response_len / tps)).astype(np.int64)
    pl = np.maximum(1, np.round(lengths.prompt_len / tps)).astype(np.int64)
    scaled = replace(lengths, prompt_len=pl, response_len=rl)
    st = replace(step, t0_ms=step.t0_ms + drafter_ms, per_kctx_ms=step.per_kctx_ms * tps,
                 per_prefill_ktok_ms=step.per_prefill_ktok_ms * tps,
                 kv_bytes_per_token=step.kv_bytes_per_token * tps)
    return scaled, st


def _rollout_main(argv: list[str]) -> int:
    # the drafting, step-table and trainer models import this module: imported here, not at the top
    from qwen3_rl.tools.sim.drafting import (
        EPOCH_STEPS,
        VERIFY_TOKEN_MS,
        DraftModel,
        draft_model,
        placement_coverage,
        sibling_tables,
    )
    from qwen3_rl.tools.sim.fully_async import add_async_args, trainer_comparison
    from qwen3_rl.tools.sim.server import siblings_on_engine
    from qwen3_rl.tools.sim.step_table import StepTableError, load_step_table

    p = _Parser(prog="python -m qwen3_rl simulate rollout", description="Simulate one rollout batch.")
    p.add_argument("--lengths", required=True, help="JSON-lines lengths file")
    p.add_argument("--dp", type=int, required=True, help="DP ranks")
    p.add_argument("--max-num-seqs", type=int, required=True, help="max running sequences per rank")
    p.add_argument("--policy", default="default",
                   help="default|data-rebalance|rollout-rebalance|both, a comma list, or 'all'")
    p.add_argument("--coupling", default="lockstep", choices=COUPLINGS)
    p.add_argument("--buckets", default=None, help="graph batch sizes: comma list | vllm (default) | single | eager")
    p.add_argument("--rebalance-interval", type=int, default=32, help="steps between load exchanges")
    p.add_argument("--max-moves", type=int, default=128, help="requests migrated per round at most")
    p.add_argument("--max-kv-blocks", type=int, default=1 << 20, help="KV blocks migrated per round at most")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kv-blocks-per-rank", type=int, default=None)
    p.add_argument("--max-kv-bytes", type=int, default=DEFAULT_MAX_KV_BYTES,
                   help="optional byte cap: KV bytes one rank may send + receive per round (0 = none; "
                        "rollout_rebalance_max_kv_bytes)")
    p.add_argument("--max-round-s", type=float, default=DEFAULT_MAX_ROUND_S,
                   help="seconds a round may cost one rank, KV transfer + recompute (0 = no bound; "
                        "rollout_rebalance_max_round_s)")
    p.add_argument("--no-recompute", action="store_true",
                   help="always move KV (no per-request move-vs-recompute decision)")
    p.add_argument("--plot", default=None, help="write a per-rank busy/idle PNG")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--drafting", default="none",
                   help="none|sam_group|sam_group_exchange, a comma list, or 'all': SAM drafting, each request "
                        "advancing tokens-per-step per step by its layout (siblings together / spread)")
    d = Drafting()
    p.add_argument("--tps-together", type=float, default=d.together,
                   help="tokens per step with siblings on one rank (default, rollout-rebalance)")
    p.add_argument("--tps-spread", type=float, default=d.spread,
                   help="tokens per step with siblings spread (data-rebalance, both) without the exchange")
    p.add_argument("--tps-exchange", type=float, default=d.exchange,
                   help="tokens per step with siblings spread and the sibling exchange")
    p.add_argument("--drafter-ms", type=float, default=d.drafter_ms, help="drafter host cost per step (ms)")
    p.add_argument("--verify-token-ms", type=float, default=None,
                   help="BASE+... drafting: cost of one draft token in a verification step (ms; default 0.0585, "
                        "sim/drafting.py)")
    p.add_argument("--verify-model", default=None, choices=("linear", "roofline"),
                   help="BASE+... drafting: verification step = decode step + --verify-token-ms per draft token "
                        "(linear, default), or the larger of the decode step and the compute of all query tokens at "
                        "--mfu of the rank's bf16 roof (roofline; sim/drafting.py)")
    p.add_argument("--step-table", default=None,
                   help="BASE+... drafting: verification step = decode step x the measured table's step ratio at "
                        "(bucket, k, context), interpolated (verify_cost.py JSON; sim/step_table.py)")
    p.add_argument("--shape", default=None, help="--step-table: the table's model shape (its rows' 'model')")
    p.add_argument("--mfu", type=float, default=0.5, help="--verify-model roofline: utilisation of the compute roof")
    p.add_argument("--fixed-k", type=int, default=3, help="BASE+verify / BASE+history: the draft length")
    p.add_argument("--k-max", type=int, default=15, help="BASE+adaptive: the longest draft")
    p.add_argument("--draft-siblings", type=int, default=4, choices=(4, 8),
                   help="BASE+... without history: tokens-per-step tables measured with 4 (default) or 8 current "
                        "siblings per prompt (sim/drafting.py)")
    p.add_argument("--history-coverage", type=float, default=None,
                   help="BASE+history: share of the requests that start with their prompt's earlier responses "
                        "on the rank that runs them (default: what the placement gives; sim/drafting.py)")
    p.add_argument("--history-max-bytes", type=int, default=None,
                   help="BASE+history, default coverage: history store bytes per engine (SAM_HISTORY_MAX_BYTES; "
                        "default: the store holds the epoch, as the host-memory default does where the host allows)")
    p.add_argument("--rebalance-by-key", action="store_true",
                   help="data rebalance places a prompt's samples by its group key (DATA_REBALANCE_BY_KEY), not by "
                        "batch position: the default history coverage follows (sim/placement.py)")
    p.add_argument("--epoch-steps", type=float, default=EPOCH_STEPS,
                   help="BASE+history, default coverage: steps until a prompt returns (79: deepscaler at 512)")
    g = p.add_argument_group("server mode (sim/server.py)")
    g.add_argument("--placement", default="sync",
                   help="sync (verl's SPMD chunks) | spread (server mode, verl's least-assigned routing) | group "
                        "(server mode, GroupRouter), a comma list, or 'all'")
    g.add_argument("--servers", type=int, default=1,
                   help="server placements: the --dp engines form this many vLLM servers (KV moves stay inside one)")
    g.add_argument("--routing-slack", type=int, default=0, help="group placement: GroupRouter slack (requests)")
    g.add_argument("--agent-workers", type=int, default=8, help="server placements: agent-loop workers (routers)")
    _step_args(p)
    add_async_args(p)
    ns = p.parse_args(argv)
    drafts = list(DRAFTING) if ns.drafting == "all" else [x.strip() for x in ns.drafting.split(",") if x.strip()]
    for dr in drafts:
        if dr not in DRAFTING and "+" not in dr:
            raise SimError(f"unknown drafting {dr!r} (choose from {', '.join(DRAFTING)}, BASE+verify|history|"
                           "adaptive, or 'all')")
    drafting = Drafting(ns.tps_together, ns.tps_spread, ns.tps_exchange, ns.drafter_ms)
    placements = list(PLACEMENTS) if ns.placement == "all" else [x.strip() for x in ns.placement.split(",")
                                                                    if x.strip()]
    for pl in placements:
        if pl not in PLACEMENTS:
            raise SimError(f"unknown placement {pl!r} (choose from {', '.join(PLACEMENTS)} or 'all')")
    policies = list(POLICIES) if ns.policy == "all" else [x.strip() for x in ns.policy.split(",") if x.strip()]
    if ns.policy == "all" and placements != ["sync"]:
        policies += [REPREFILL]
    for pol in policies:
        if pol not in (*POLICIES, REPREFILL):
            raise SimError(f"unknown policy {pol!r} (choose from {', '.join((*POLICIES, REPREFILL))} or 'all')")
    if ns.max_moves < 0 or ns.max_kv_blocks < 0 or ns.max_kv_bytes < 0 or ns.block_size < 1:
        raise SimError("--max-moves/--max-kv-blocks/--max-kv-bytes must be >= 0 and --block-size >= 1")
    if ns.history_coverage is not None and not 0.0 <= ns.history_coverage <= 1.0:
        raise SimError(f"--history-coverage must be in [0, 1], got {ns.history_coverage}")
    if (ns.history_max_bytes is not None and ns.history_max_bytes < 0) or not ns.epoch_steps > 0:
        raise SimError("--history-max-bytes must be >= 0 and --epoch-steps > 0")
    if ns.step_table is not None and ns.verify_model is not None:
        raise SimError("--step-table prices the verification step itself: drop --verify-model")
    if (ns.step_table is None) != (ns.shape is None):
        raise SimError("--step-table and --shape go together")
    try:
        table = load_step_table(ns.step_table, ns.shape) if ns.step_table else None
    except StepTableError as e:
        raise SimError(str(e)) from None
    verify_model = "table" if table is not None else ns.verify_model or "linear"
    if not (ns.max_round_s >= 0) or not math.isfinite(ns.max_round_s):
        raise SimError("--max-round-s must be a finite number >= 0 (0 = no bound)")
    links = _links(ns.link_gb_s)
    lengths = load_lengths(ns.lengths)
    step = _step_from(ns)
    base = SimConfig(dp=ns.dp, max_num_seqs=ns.max_num_seqs, coupling=ns.coupling, rebalance_by_key=ns.rebalance_by_key,
                     buckets=_parse_buckets(ns.buckets, ns.max_num_seqs), step=step,
                     rebalance_interval=ns.rebalance_interval, max_moves=ns.max_moves,
                     max_kv_blocks=ns.max_kv_blocks, block_size=ns.block_size,
                     kv_blocks_per_rank=ns.kv_blocks_per_rank, max_kv_bytes=ns.max_kv_bytes,
                     max_round_s=ns.max_round_s, recompute=not ns.no_recompute, servers=ns.servers,
                     routing_slack=ns.routing_slack, agent_workers=ns.agent_workers)
    lb = lower_bound(lengths, base)
    results = []
    tps_of: dict[int, float] = {}
    ksteps: dict[int, dict[int, int]] = {}
    coverage_of: dict[int, float] = {}
    tok_ms = VERIFY_TOKEN_MS if ns.verify_token_ms is None else ns.verify_token_ms
    mean_resp = float(lengths.response_len.mean())

    def make_draft(dr: str, pol: str, dp: int, placement: str) -> tuple[DraftModel, float]:
        """The per-step draft model of ``dr`` (BASE+...) and its history coverage on ``placement`` over ``dp``."""
        cov = ns.history_coverage
        if cov is None:
            cov = placement_coverage(placement, dp, lengths.n, dr.split("+")[0] == "sam_group_exchange",
                                     lengths.num_prompts, mean_resp, store_bytes=math.inf if ns.history_max_bytes is None else ns.history_max_bytes,
                                     epoch_steps=ns.epoch_steps)
        dm = draft_model(dr, pol, drafting, ns.fixed_k, ns.k_max, tok_ms, verify_model, ns.mfu,
                         ns.draft_siblings, cov, table=table, spread=placement != "contiguous")
        return dm, cov

    server_tables: dict[str, dict] = {}  # server placement -> no-history tables from its sibling counts
    skipped: set[str] = set()
    for pl in placements:
        if pl != "sync":
            assign = _assignment(lengths, ns.dp, False, replace(base, placement=pl))
            server_tables[pl] = sibling_tables(siblings_on_engine(assign, lengths.n, lengths.size),
                                               lengths.response_len, drafting)
    for dr, pl, pol in ((d, x, y) for d in drafts for x in placements for y in policies):
        if pl == "sync":
            if dr.split("+")[0] == "sam_group_exchange" and pol not in SPREAD_POLICIES:
                continue  # the exchange acts only where data rebalance spreads the siblings
        elif pol not in SERVER_POLICIES:
            continue
        elif dr != "none" and (not dr.startswith("sam_group+") or "history" in dr):
            skipped.add(dr)  # server placements: sam_group+verify|adaptive only (sim/drafting.py)
            continue
        dm = None
        cov = None
        if "+" in dr and pl != "sync":
            dm = draft_model(dr, pol, drafting, ns.fixed_k, ns.k_max, tok_ms, verify_model, ns.mfu,
                             table=table, current=server_tables[pl])
            tps, lens_d, step_d = dm.bulk[2], lengths, step
        elif "+" in dr:  # verification steps with per-step k (sim/drafting.py)
            spread = "keyed" if ns.rebalance_by_key else "interleaved"
            dm, cov = make_draft(dr, pol, ns.dp, spread if pol in SPREAD_POLICIES else "contiguous")
            tps, lens_d, step_d = dm.bulk[2] * dm.layout, lengths, step
        else:
            tps = drafting.tokens_per_step(dr, pol)
            lens_d, step_d = with_drafting(lengths, step, tps, drafting.drafter_ms)
        for link in links if pol in ("rollout-rebalance", "both") else links[:1]:
            cfg = replace(base, policy=pol, placement=pl, step=replace(step_d, link_gb_s=link))
            if dm is not None:
                dm.k_steps.clear()
            res = simulate(lens_d, cfg, record_timeline=bool(ns.plot) and link == links[0] and dr == drafts[0],
                           draft=dm)
            if dm is not None:
                ksteps[id(res)] = dict(sorted(dm.k_steps.items()))
            if cov is not None and "history" in dr:
                coverage_of[id(res)] = cov
            res.lower_bound_s = lb
            res.policy = ("" if pl == "sync" else f"{pl}:") + pol + ("" if dr == "none" else f"+{dr}")
            tps_of[id(res)] = tps
            results.append(res)
    if not results:
        raise SimError(f"no row: policies {', '.join(policies)} do not apply to placements {', '.join(placements)} "
                       f"(server placements: {', '.join(SERVER_POLICIES)})")
    ref = next((r.makespan_s for r in results if r.policy == "default"), None)
    if ref is None and placements != ["sync"]:  # the gains of server rows are against the sync default
        ref = simulate(lengths, replace(base, policy="default")).makespan_s
    trainer = None
    if ns.trainer == "fully-async":
        trainer = trainer_comparison(ns, lengths, base, results, drafts, make_draft)
    if ns.plot and not plot_timelines([r for r in results if r.timeline is not None], ns.plot, ns.max_num_seqs):
        print("warning: matplotlib not installed, no plot written", file=sys.stderr)
    if ns.json:
        if len(results) == 1:
            out = results[0].to_json()
        else:
            out = {"coupling": ns.coupling, "lower_bound_s": lb, "results": {_label(r, links): r.to_json() for r in results}}
        for r in results:
            row = out["results"][_label(r, links)] if len(results) > 1 else out
            row["tokens_per_step"] = tps_of[id(r)]
            if id(r) in ksteps:
                row["engine_steps_per_k"] = ksteps[id(r)]
            if id(r) in coverage_of:
                row["history_coverage"] = coverage_of[id(r)]
            if ref:
                row["gain_vs_sync_default"] = ref / r.makespan_s
            if trainer is not None:
                row.update(trainer["sync"][id(r)])
        if trainer is not None:
            out["trainer"] = trainer["json"]
        out["config"] = {"dp": ns.dp, "max_num_seqs": ns.max_num_seqs, "samples": lengths.size, "n": lengths.n,
                         "buckets": list(base.graph_buckets), "step_model": asdict(step),
                         "rebalance_interval": ns.rebalance_interval, "max_round_s": ns.max_round_s,
                         "max_kv_bytes": ns.max_kv_bytes, "draft_siblings": ns.draft_siblings,
                         "history_coverage": "placement" if ns.history_coverage is None else ns.history_coverage,
                         "verify_model": verify_model, "step_table": ns.step_table, "shape": ns.shape,
                         "link_source": DEVICE_LINK_SOURCE if ns.link_gb_s == str(DEVICE_LINK_GB_S) else "--link-gb-s",
                         "placements": placements, "servers": ns.servers, "routing_slack": ns.routing_slack,
                         "agent_workers": ns.agent_workers, "sync_default_makespan_s": ref}
        print(json.dumps(out, indent=1))
        return 0
    print(f"{lengths.size} samples ({lengths.num_prompts} prompts x {lengths.n}), dp {ns.dp}, "
          f"max-num-seqs {ns.max_num_seqs}, coupling {ns.coupling}; lower bound {lb:.1f} s")
    link_src = DEVICE_LINK_SOURCE if ns.link_gb_s == str(DEVICE_LINK_GB_S) else "--link-gb-s"
    print(f"KV link {', '.join(f'{x:g}' for x in links)} GB/s per rank ({link_src}); round bound "
          + (f"{ns.max_round_s:g} s" if ns.max_round_s else "none")
          + (f", byte cap {ns.max_kv_bytes} B" if ns.max_kv_bytes else ", no byte cap")
          + ("" if ns.no_recompute else f", recompute at {1e6 / step.per_prefill_ktok_ms:g} tokens/s"
             if step.per_prefill_ktok_ms > 0 else ""))
    if placements != ["sync"]:
        print(f"server placements: {ns.servers} server(s) x DP {ns.dp // ns.servers}, {ns.agent_workers} agent-loop "
              f"workers, group routing slack {ns.routing_slack}; rollout-rebalance moves KV inside a server, "
              f"{REPREFILL} re-prefills on any engine")
    w = max([40] + [len(_label(r, links)) + 1 for r in results])
    tps_col = any(v != 1.0 for v in tps_of.values())
    print(f"{'policy':<{w}} {'makespan_s':>10} {'/LB':>6} {'gain':>6} " + (f"{'tok/step':>8} " if tps_col else "")
          + f"{'first_idle':>10} {'first_fin_s':>11} "
          f"{'mean_step_ms':>12} {'migrated':>8} {'recomp':>6} {'kv_GB':>7} {'xfer_s':>7}")
    for r in results:
        gain = f"{ref / r.makespan_s:>6.3f}" if ref else f"{'-':>6}"
        tcol = f"{tps_of[id(r)]:>8.3f} " if tps_col else ""
        print(f"{_label(r, links):<{w}} {r.makespan_s:>10.1f} {r.makespan_s / lb:>6.3f} {gain} {tcol}"
              f"{100 * r.first_idle_share:>9.2f}% {min(r.rank_finish_s):>11.1f} {r.mean_step_ms:>12.2f} "
              f"{r.migrations:>8d} {r.recomputed:>6d} {r.kv_gb_moved:>7.2f} {r.transfer_s:>7.1f}")
    if ref:
        print(f"gain = {'sync ' if placements != ['sync'] else ''}default makespan ({ref:.1f} s) / row makespan; "
              "xfer_s = KV transfer time on the busiest rank, summed")
    if skipped:
        print(f"server placements: no rows for {', '.join(sorted(skipped))} (modelled: sam_group+verify|adaptive)")
    if tps_col:
        print("with drafting: steps are verification steps (ceil(tokens / tok/step)), charged as decode steps "
              "plus --drafter-ms; /LB against the lower bound without drafting")
    if ksteps:
        print("BASE+...: each engine step moves a request one token and costs a verification step / tokens per "
              + {"roofline": "step, the verification step = max(decode step, compute of all query tokens at --mfu); ",
                 "table": "step, the verification step = decode step x the step table's ratio; "}.get(
                  verify_model, "step, the verification step including --verify-token-ms per draft token; ")
              + f"tables at {ns.draft_siblings} current siblings (history: 4 + 4 earlier; server placements: their "
              "sibling counts, sim/drafting.py sibling_tables), history coverage "
              + (", ".join(f"{_label(r, links)} {coverage_of[id(r)]:.3f}" for r in results if id(r) in coverage_of)
                 or "-")
              + "; tok/step column = the bulk figure at k = 3; k used (engine steps): "
              + "; ".join(f"{_label(r, links)} {ksteps[id(r)]}" for r in results if id(r) in ksteps))
    if trainer is not None:
        print(trainer["text"])
    return 0


def _label(res: SimResult, links: Sequence[float]) -> str:
    """Policy name, with ``@<link> GB/s`` for rebalancing policies when several links are simulated."""
    if len(links) > 1 and res.policy.split("+")[0].split(":")[-1] in ("rollout-rebalance", "both"):
        return f"{res.policy}@{res.link_gb_s:g}GB/s"
    return res.policy


def _gen_main(argv: list[str]) -> int:
    sg, sw = default_spreads()
    p = _Parser(prog="python -m qwen3_rl simulate gen-lengths", description="Write a reference-like lengths file.")
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=REF_NUM_PROMPTS)
    p.add_argument("--n", type=int, default=REF_N)
    p.add_argument("--mean-response", type=float, default=REF_MEAN_RESPONSE)
    p.add_argument("--max-response", type=int, default=REF_MAX_RESPONSE)
    p.add_argument("--sigma-group", type=float, default=sg)
    p.add_argument("--sigma-within", type=float, default=sw)
    p.add_argument("--mean-prompt", type=float, default=REF_MEAN_PROMPT)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(argv)
    try:
        lengths = generate_lengths(ns.num_prompts, ns.n, mean_response=ns.mean_response,
                                   max_response=ns.max_response, sigma_group=ns.sigma_group,
                                   sigma_within=ns.sigma_within, mean_prompt=ns.mean_prompt, seed=ns.seed)
    except ValueError as e:
        raise SimError(str(e)) from None
    try:
        write_lengths(lengths, ns.out)
    except OSError as e:
        raise SimError(f"cannot write {ns.out}: {e.strerror}") from None
    r = lengths.response_len
    print(f"wrote {ns.out}: {lengths.size} samples ({lengths.num_prompts} prompts x {lengths.n}), "
          f"response mean {r.mean():.1f} median {np.median(r):.0f} max {r.max()}, "
          f"at cap {100 * np.mean(r >= ns.max_response):.2f} %, sigma_group {ns.sigma_group:.4f} "
          f"sigma_within {ns.sigma_within:.4f}")
    return 0


def _fit_main(argv: list[str]) -> int:
    p = _Parser(prog="python -m qwen3_rl simulate fit-step-model",
                description="Fit t0/per_seq/per_kctx to the published step times on a lengths file.")
    p.add_argument("--lengths", required=True)
    p.add_argument("--dp", type=int, default=REF_DP)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--small-step-ms", type=float, default=60.0)
    p.add_argument("--mean-step-ms", type=float, default=137.64)
    p.add_argument("--peak-step-ms", type=float, default=200.0)
    ns = p.parse_args(argv)
    lengths = load_lengths(ns.lengths)
    sm = fit_step_model(lengths, ns.dp, ns.max_num_seqs, small_step_ms=ns.small_step_ms,
                        mean_step_ms=ns.mean_step_ms, peak_step_ms=ns.peak_step_ms)
    print(json.dumps(asdict(sm), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m qwen3_rl simulate {rollout|gen-lengths|fit-step-model|placement} ...``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: python -m qwen3_rl simulate {rollout|gen-lengths|fit-step-model|placement} [args]  "
             "(--help on each)")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    sub, rest = argv[0], argv[1:]
    from qwen3_rl.tools.sim.placement import main as _placement_main

    handlers = {"rollout": _rollout_main, "gen-lengths": _gen_main, "fit-step-model": _fit_main,
                "placement": _placement_main}
    if sub not in handlers:
        print(f"error: unknown simulate command {sub!r}; {usage}", file=sys.stderr)
        return 2
    try:
        return handlers[sub](rest)
    except (SimError, LengthsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
