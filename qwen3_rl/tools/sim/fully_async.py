"""Fully-async trainer model: rollout continues while the trainer trains (``simulate rollout --trainer fully-async``).

Modelled on verl 0.6.1's ``recipe/fully_async_policy`` (its README: "Supported Modes" 3-4): the Rollouter and the
Trainer run on separate dies; samples stream one prompt group (``n`` responses) at a time into a queue; the Trainer
takes ``require_batches * ppo_mini_batch_size`` prompts per local update and, after ``trigger_parameter_sync_step``
updates, syncs the weights into the Rollouter. Freshness: between two syncs the Rollouter starts at most
``(1 + staleness) * trigger * require * mini`` prompts, counting those still running or queued at the last sync
(verl's ``staleness_samples`` against ``max_required_samples``). Partial rollout: a sync pauses the running
requests for ``weight_sync_s`` and resumes them afterwards, their context prefilled again (the engine's KV of the
old weights is dropped), so the long tail carries into the next period instead of idling the dies.

Rollouter: ``rollout_dies / rank_dies`` DP ranks of ``max_num_seqs`` slots stepping in lockstep (EP across the
ranks, as in the synchronous simulator), each queued sample admitted on the least-loaded rank with a free slot and
KV room (vLLM's DP load balancing, late-bound); step time from the fitted step model, or a
:class:`~qwen3_rl.tools.sim.drafting.DraftModel` with SAM drafting. Streaming keeps the slots full of requests at
every age, so a rank holds more context than in the synchronous batch (length-biased: a running request holds
``E[L^2] / (2 E[L])`` response tokens on average) and the KV budget binds: :func:`kv_tokens_per_rank` (the
memory plan of the 235B rollout at EP = rollout dies); when a step would overflow it, the rank's latest admitted
requests are preempted to the queue's head and recomputed when readmitted (vLLM's recompute preemption). The
concurrency defaults to :func:`auto_max_num_seqs`. The stream of prompts cycles the lengths file, reshuffled each
pass (seeded).

Trainer: seconds per prompt from the published 235B GRPO run ([ref 002 §1.3] table, 128 dies, GBS 512, n 16,
read from ``qwen3_rl.tools.report.published``): training ("训练时间" = ``timing_s/update_actor``) 797.93 s and the rest
of the step (total - rollout - training = 7833.16 - 6638.49 - 797.93 = 396.74 s: reward, reference log-probs and
the other phases, not broken down by the source) per 512 prompts, both charged to the Trainer and scaled by
``128 / train_dies`` (ideal scaling, assumed). With drafting the Trainer also computes the old policy's log-probs
(``USE_ROLLOUT_LOG_PROBS=False``, the default): 797.93 x 53.92 / 113.81 = 378.04 s (old_log_prob / update_actor of
verl's fully-async README, colocated 128-GPU Qwen2.5-7B table); ``--old-log-prob-s 0`` models the rollout's own
log-probs instead (``USE_ROLLOUT_LOG_PROBS=True``, drafted since vllm 0004).

The synchronous reference at the same total dies: the rollout makespan (``simulate``) plus the same trainer
seconds at all dies. ``time_per_sample_s`` = seconds per trained response in the steady state (between the end of
sync ``warmup_syncs`` and of sync ``warmup_syncs + measure_syncs``).
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from qwen3_rl.rollout.rebalance import bucket_for
from qwen3_rl.tools.report.published import PUBLISHED
from qwen3_rl.tools.sim.lengths import REF_NUM_PROMPTS, Lengths
from qwen3_rl.tools.sim.simulate import (
    DraftModelLike,
    SimConfig,
    SimError,
    SimResult,
    StepModel,
    _sum_max_lines,
    simulate,
    vllm_default_buckets,
)

REF_DIES = 128  # the 235B GRPO run of [ref 002 §1.3]: 128 dies colocated
RANK_DIES = 4  # one rollout DP rank: TP4
#: old_log_prob / update_actor of verl's recipe/fully_async_policy README (colocated sync, 128 GPUs, Qwen2.5-7B)
OLD_LOG_PROB_PER_UPDATE = 53.92 / 113.81
#: weight sync pause (s): Qwen3-235B-A22B's bf16 weights (2 B x 235e9) received by every rollout die over one
#: 200 Gb/s port (25 GB/s, simulate.DEVICE_LINK_GB_S); assumed, not measured
WEIGHT_SYNC_S = 2 * 235e9 / 25e9
TRAINERS = ("sync", "fully-async")
#: KV budget of a rollout rank (TP4) by rollout dies (= EP), GiB per die: ``python -m qwen3_rl plan`` on the 235B
#: config, TP4, utilization 0.87, max_num_seqs 256 gives 43.85 / 40.55 / 33.94 GiB at EP 128 / 64 / 32 =
#: 47.165 - 422.9 / EP (the routed experts, 422.9 GiB, split over EP); 48,128 B of KV per token per die
KV_GIB_FIXED = 47.165
KV_GIB_EXPERTS = 422.9
KV_BYTES_PER_TOKEN_DIE = 48128


#: share of the KV budget the automatic concurrency fills on average (``auto_max_num_seqs``): the 235B Rollouter
#: alone (64 dies, reference-like lengths; 96, 120, 136, 160, 192, 256 requests per rank) ran fastest at 120 (0.82
#: of the budget); at 160 preemptions grow a hundredfold and their recomputed contexts slow every step
KV_FILL = 0.8


def auto_max_num_seqs(lengths: Lengths, kv_tokens: int, fallback: int) -> int:
    """Requests per rank that fill ``KV_FILL`` of ``kv_tokens`` in the streaming steady state, a multiple of 8:
    a running request there holds on average ``E[prompt] + E[L^2] / (2 E[L])`` tokens (the length-biased half of
    its response); ``fallback`` without a KV bound (``kv_tokens`` 0)."""
    if not kv_tokens:
        return fallback
    r = lengths.response_len.astype(np.float64)
    inflight = float(lengths.prompt_len.mean() + (r * r).mean() / (2.0 * r.mean()))
    return max(8, int(KV_FILL * kv_tokens / inflight) // 8 * 8)


def kv_tokens_per_rank(rollout_dies: int) -> int:
    """Context tokens one rollout rank's KV cache holds when the experts are spread over ``rollout_dies`` (EP)."""
    gib = KV_GIB_FIXED - KV_GIB_EXPERTS / rollout_dies
    if gib <= 0:
        raise SimError(f"the 235B rollout does not fit on {rollout_dies} dies (KV budget {gib:.1f} GiB per die)")
    return int(gib * (1 << 30) / KV_BYTES_PER_TOKEN_DIE)


def _published() -> dict[str, float]:
    return {f.key: f.value for f in PUBLISHED["235b-grpo"][1]}


@dataclass(frozen=True)
class TrainCost:
    """Trainer seconds per ``gbs_prompts`` prompts on ``ref_dies`` dies (defaults: [ref 002 §1.3], module docstring)."""

    update_s: float = field(default_factory=lambda: _published()["timing_s/update_actor"])
    other_s: float = field(default_factory=lambda: (_published()["timing_s/step"] - _published()["timing_s/gen"]
                                                    - _published()["timing_s/update_actor"]))
    old_log_prob_s: float = field(default_factory=lambda: _published()["timing_s/update_actor"]
                                  * OLD_LOG_PROB_PER_UPDATE)
    gbs_prompts: int = REF_NUM_PROMPTS
    ref_dies: int = REF_DIES

    def __post_init__(self) -> None:
        if min(self.update_s, self.other_s, self.old_log_prob_s) < 0 or self.gbs_prompts < 1 or self.ref_dies < 1:
            raise SimError("train seconds must be >= 0 and gbs / reference dies >= 1")

    def seconds(self, prompts: float, dies: int, old_log_prob: bool = False) -> float:
        """Trainer time (s) for ``prompts`` prompt groups on ``dies`` dies (linear in both)."""
        per = self.update_s + self.other_s + (self.old_log_prob_s if old_log_prob else 0.0)
        return per * prompts / self.gbs_prompts * self.ref_dies / dies


@dataclass(frozen=True)
class AsyncConfig:
    """Resources and verl's ``async_training`` knobs; defaults: the fully-async runs of verl's README (4 local
    updates of 4 x 32 prompts per weight sync = 512 prompts, the 235B run's batch)."""

    rollout_dies: int
    train_dies: int
    max_num_seqs: int = 0  # per rank; 0: auto_max_num_seqs (256 without a KV bound)
    staleness: float = 0.5  # verl's README experiments: staleness 0.5, trigger 4, require 4, mini 32 (partial on)
    trigger_sync_steps: int = 4
    require_batches: int = 4
    mini_batch_prompts: int = 32  # 0: the lengths file's prompts
    weight_sync_s: float = WEIGHT_SYNC_S
    kv_tokens: int | None = None  # context tokens per rank (None: kv_tokens_per_rank(rollout_dies); 0: no bound)
    recompute_on_resume: bool = True
    rank_dies: int = RANK_DIES
    buckets: tuple[int, ...] = ()
    warmup_syncs: int = 2
    measure_syncs: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rollout_dies < self.rank_dies or self.rollout_dies % self.rank_dies:
            raise SimError(f"--rollout-dies must be a positive multiple of {self.rank_dies} (one DP rank), "
                           f"got {self.rollout_dies}")
        if self.train_dies < 1:
            raise SimError(f"--train-dies must be >= 1, got {self.train_dies}")
        if not (0 <= self.staleness < 16) or not math.isfinite(self.staleness):
            raise SimError(f"--staleness must be in [0, 16), got {self.staleness}")
        if min(self.trigger_sync_steps, self.require_batches, self.measure_syncs) < 1 \
                or min(self.mini_batch_prompts, self.warmup_syncs, self.max_num_seqs) < 0:
            raise SimError("--trigger-sync-steps, --require-batches, --async-syncs must be >= 1, "
                           "--mini-batch-prompts, --async-warmup and --async-max-num-seqs >= 0")
        if not (self.weight_sync_s >= 0) or not math.isfinite(self.weight_sync_s):
            raise SimError("--weight-sync-s must be a finite number >= 0")
        if self.kv_tokens is not None and self.kv_tokens < 0:
            raise SimError("--kv-tokens-per-rank must be >= 0 (0 = no bound)")

    @property
    def dp(self) -> int:
        """Rollouter DP ranks."""
        return self.rollout_dies // self.rank_dies


@dataclass
class AsyncResult:
    """Steady-state figures of one fully-async run (times in s, shares in [0, 1])."""

    rollout_dies: int
    train_dies: int
    staleness: float
    time_per_sample_s: float
    period_s: float  # mean time between two weight syncs
    samples_per_sync: int
    rollouter_idle_share: float  # no request running (gate closed or weight sync)
    trainer_idle_share: float
    stale_share: float  # trained prompts started under an older policy than the one training on them
    partial_share: float  # trained prompts with a response interrupted by a weight sync
    max_version_span: int
    mean_step_ms: float
    max_num_seqs: int  # Rollouter requests per rank
    preemptions: int  # KV preemptions over the run
    engine_steps: int
    generated_tokens: int
    trainer_s_per_update: float
    syncs: int

    def to_json(self) -> dict:
        """JSON-ready dict."""
        return dict(self.__dict__)


def _stream(lengths: Lengths, prompts: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lengths ``(prompts,)`` and response lengths ``(prompts, n)`` of the first ``prompts`` prompts of the
    stream: the file's prompts, each pass in a new seeded order."""
    n = lengths.n
    plen = lengths.prompt_len.reshape(-1, n)[:, 0]
    rlen = lengths.response_len.reshape(-1, n)
    rng = np.random.default_rng(seed)
    passes = -(-prompts // lengths.num_prompts)
    order = np.concatenate([rng.permutation(lengths.num_prompts) for _ in range(passes)])[:prompts]
    return plen[order].astype(np.int64), rlen[order].astype(np.int64)


def _busy(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Length of the union-free ``intervals`` inside ``[t0, t1]``."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)


def simulate_fully_async(lengths: Lengths, cfg: AsyncConfig, step: StepModel, cost: TrainCost,
                         draft: DraftModelLike | None = None) -> AsyncResult:
    """Run the Rollouter and the Trainer together until ``warmup_syncs + measure_syncs`` weight syncs are done
    (module docstring); the Trainer computes old log-probs when ``draft`` is given."""
    n = lengths.n
    dp = cfg.dp
    kv = cfg.kv_tokens if cfg.kv_tokens is not None else kv_tokens_per_rank(cfg.rollout_dies)
    cap = cfg.max_num_seqs or auto_max_num_seqs(lengths, kv, 256)
    kv = kv or np.iinfo(np.int64).max // 4
    mini = cfg.mini_batch_prompts or lengths.num_prompts
    chunk = cfg.require_batches * mini
    per_sync = cfg.trigger_sync_steps * chunk
    max_required = int(per_sync * (1 + cfg.staleness))
    nsyncs = cfg.warmup_syncs + cfg.measure_syncs
    plen, rlen2 = _stream(lengths, (nsyncs + 2) * max_required + per_sync, cfg.seed)
    rlen = rlen2.reshape(-1)  # sample s = response s % n of prompt s // n
    nsamples = rlen.shape[0]
    buckets = cfg.buckets or vllm_default_buckets(cap)
    train_s = cost.seconds(chunk, cfg.train_dies, old_log_prob=draft is not None)
    sm = step
    k_steps: dict[int, int] | None = getattr(draft, "k_steps", None)

    # Rollouter, lockstep: global step S; per rank running R, context C, prefill P; per sample its rank (-1 not
    # running, -2 done), base step (finish = base + length), tokens kept from before a preemption, epoch (a heap
    # or admission-order entry is live only at the sample's epoch)
    R = np.zeros(dp, dtype=np.int64)
    C = np.zeros(dp, dtype=np.int64)
    P = np.zeros(dp, dtype=np.int64)
    rank_of = np.full(nsamples, -1, dtype=np.int64)
    base = np.zeros(nsamples, dtype=np.int64)
    kept = np.zeros(nsamples, dtype=np.int64)
    epoch = np.zeros(nsamples, dtype=np.int64)
    heap: list[tuple[int, int, int]] = []  # (finish step, sample, epoch)
    admitted: list[list[tuple[int, int]]] = [[] for _ in range(dp)]  # (sample, epoch) in admission order
    queue: deque[int] = deque()  # samples started, waiting for a slot (preempted ones first)
    S = 0
    t = 0.0
    fed = 0  # prompts started (stream position)
    done = np.zeros(plen.shape[0], dtype=np.int64)  # finished responses per prompt
    fed_version = np.zeros(plen.shape[0], dtype=np.int64)
    partial = np.zeros(plen.shape[0], dtype=bool)
    complete: deque[int] = deque()  # prompts with all n responses, in completion order
    staleness_count = 0  # verl's staleness_samples
    version = 0
    preempted = 0
    # Trainer
    trainer_free = 0.0
    updates = 0
    sync_at: float | None = None
    consumed = 0
    updates_iv: list[tuple[float, float]] = []
    update_stats: list[tuple[int, int, int]] = []  # per update: stale prompts, partial prompts, largest span
    idle_iv: list[tuple[float, float]] = []
    sync_end: list[float] = []
    st_steps = tokens = 0
    st_ms = 0.0

    def trainer_advance() -> None:
        """Start every local update whose prompts are complete; the last of ``trigger`` schedules the sync."""
        nonlocal trainer_free, updates, sync_at, consumed
        while sync_at is None and len(complete) >= chunk:
            start = max(trainer_free, t)
            ps = np.array([complete.popleft() for _ in range(chunk)], dtype=np.int64)
            consumed += chunk
            update_stats.append((int((fed_version[ps] < version).sum()), int(partial[ps].sum()),
                                 int(version - fed_version[ps].min())))
            trainer_free = start + train_s
            updates_iv.append((start, trainer_free))
            updates += 1
            if updates == cfg.trigger_sync_steps:
                updates = 0
                sync_at = trainer_free

    def preempt(r: int) -> None:
        """vLLM's KV preemption: the rank's latest admitted requests go back to the queue's head (their tokens
        kept, their context recomputed on readmission) until one more step fits the KV budget."""
        nonlocal preempted
        while C[r] + R[r] > kv and R[r] > 1:
            s, e = admitted[r].pop()
            if rank_of[s] != r or epoch[s] != e:
                continue
            kept[s] = S - base[s]
            R[r] -= 1
            C[r] -= plen[s // n] + kept[s]
            rank_of[s] = -1
            epoch[s] += 1
            queue.appendleft(s)
            preempted += 1

    def seg_ms(k: int) -> float:
        """Time (ms) of the next ``k`` lockstep steps (``draft``: verification steps)."""
        maxR = int(R.max())
        bucket = bucket_for(maxR, buckets)
        csum, _ = _sum_max_lines(C, R, k)
        pre = float(P.max())
        if draft is not None:
            return draft.segment_ms(sm, k, maxR, bucket, csum, pre)
        return k * (sm.t0_ms + sm.per_seq_ms * bucket) + sm.per_kctx_ms * csum / 1000.0 \
            + sm.per_prefill_ktok_ms * pre / 1000.0

    while len(sync_end) < nsyncs:
        trainer_advance()
        while staleness_count < max_required and fed < plen.shape[0]:  # freshness gate
            fed_version[fed] = version
            queue.extend(range(fed * n, fed * n + n))
            fed += 1
            staleness_count += 1
        while queue:  # the least-loaded rank with a free slot and KV room takes the next sample
            s = queue[0]
            ctx = int(plen[s // n] + kept[s])
            room = (R < cap) & (C + ctx + R + 1 <= kv)
            if not room.any():
                break
            r = int(np.argmin(np.where(room, R, cap + 1)))
            queue.popleft()
            rank_of[s] = r
            base[s] = S - kept[s]
            heapq.heappush(heap, (int(base[s] + rlen[s]), s, int(epoch[s])))
            admitted[r].append((s, int(epoch[s])))
            R[r] += 1
            C[r] += ctx
            P[r] += ctx
        if sync_at is not None and t >= sync_at - 1e-9:  # weight sync: pause, then resume the running requests
            t_end = t + cfg.weight_sync_s
            idle_iv.append((t, t_end))
            partial[np.flatnonzero(rank_of >= 0) // n] = True  # running, or preempted mid-response
            partial[np.fromiter((s // n for s in queue if kept[s]), dtype=np.int64)] = True
            if cfg.recompute_on_resume:
                P[:] = C
            version += 1
            staleness_count = fed - consumed
            t = trainer_free = t_end
            sync_at = None
            sync_end.append(t)
            continue
        if not R.any():  # nothing runs: the Rollouter waits for the sync
            if queue:
                raise SimError(f"a prompt does not fit in the KV budget of a rank ({kv} tokens)")
            if sync_at is None:
                raise SimError("fully-async model stalled: the freshness gate is closed and the trainer waits "
                               "(needs trigger * require * mini <= prompts allowed per sync)")
            idle_iv.append((t, sync_at))
            t = sync_at
            continue
        while heap and (epoch[heap[0][1]] != heap[0][2] or rank_of[heap[0][1]] < 0):
            heapq.heappop(heap)  # preempted entries
        k = heap[0][0] - S
        many = R > 1  # a rank with one request cannot preempt: it runs past the budget
        if many.any():
            room = int(((kv - C[many]) // R[many]).min())  # steps until the first rank runs out of KV
            if room < 1:
                for r in np.flatnonzero(many & (C + R > kv)):
                    preempt(int(r))
                continue
            k = min(k, room)
        if sync_at is not None:  # stop at the sync: the longest k whose segment ends by then (at least one step)
            saved = dict(k_steps) if k_steps is not None else None
            budget = (sync_at - t) * 1000.0
            if seg_ms(k) > budget:
                lo, hi = 1, k
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if seg_ms(mid) <= budget:
                        lo = mid
                    else:
                        hi = mid - 1
                k = lo
            if k_steps is not None and saved is not None:  # the search's segments were not run
                k_steps.clear()
                k_steps.update(saved)
        ms = seg_ms(k)
        t += ms / 1000.0
        S += k
        st_steps += k
        st_ms += ms
        tokens += k * int(R.sum())
        C += k * R
        P[:] = 0
        while heap and heap[0][0] <= S:
            _, s, e = heapq.heappop(heap)
            r = int(rank_of[s])
            if e != epoch[s] or r < 0:
                continue
            p = s // n
            R[r] -= 1
            C[r] -= plen[p] + rlen[s]
            rank_of[s] = -2
            done[p] += 1
            if done[p] == n:
                complete.append(p)
    w0, w1 = sync_end[cfg.warmup_syncs - 1] if cfg.warmup_syncs else 0.0, sync_end[-1]
    span = w1 - w0
    samples = cfg.measure_syncs * per_sync * n
    win = [u for (a, _), u in zip(updates_iv, update_stats, strict=True) if a >= w0 - 1e-9][:cfg.measure_syncs
                                                                                            * cfg.trigger_sync_steps]
    trained = max(len(win) * chunk, 1)
    return AsyncResult(
        rollout_dies=cfg.rollout_dies, train_dies=cfg.train_dies, staleness=cfg.staleness,
        time_per_sample_s=span / samples, period_s=span / cfg.measure_syncs, samples_per_sync=per_sync * n,
        rollouter_idle_share=_busy(idle_iv, w0, w1) / span, trainer_idle_share=1.0 - _busy(updates_iv, w0, w1) / span,
        stale_share=sum(u[0] for u in win) / trained, partial_share=sum(u[1] for u in win) / trained,
        max_version_span=max((u[2] for u in win), default=0), mean_step_ms=st_ms / max(st_steps, 1),
        max_num_seqs=cap, preemptions=preempted, engine_steps=st_steps,
        generated_tokens=tokens, trainer_s_per_update=train_s, syncs=len(sync_end),
    )


# ---------------------------------------------------------------------------------------------- CLI


def add_async_args(p: argparse.ArgumentParser) -> None:
    """``simulate rollout`` flags of the trainer model."""
    c = TrainCost()
    d = AsyncConfig(RANK_DIES, 1)
    g = p.add_argument_group("trainer (--trainer fully-async; sim/fully_async.py)")
    g.add_argument("--trainer", default="sync", choices=TRAINERS,
                   help="fully-async: also model verl's fully-async trainer and price every row per trained sample")
    g.add_argument("--staleness", type=float, default=d.staleness, help="async_training.staleness_threshold")
    g.add_argument("--rollout-dies", type=int, default=None, help="Rollouter dies (default: half of --dp x 4)")
    g.add_argument("--train-dies", type=int, default=None, help="Trainer dies (default: the rest of --dp x 4)")
    g.add_argument("--trigger-sync-steps", type=int, default=d.trigger_sync_steps,
                   help="async_training.trigger_parameter_sync_step (default: verl's README experiments)")
    g.add_argument("--require-batches", type=int, default=d.require_batches, help="async_training.require_batches")
    g.add_argument("--mini-batch-prompts", type=int, default=d.mini_batch_prompts,
                   help="ppo_mini_batch_size in prompts (0: the lengths file's prompts)")
    g.add_argument("--weight-sync-s", type=float, default=WEIGHT_SYNC_S,
                   help=f"Rollouter pause per weight sync (s; default {WEIGHT_SYNC_S:.1f}: 470 GB at 25 GB/s, assumed)")
    g.add_argument("--kv-tokens-per-rank", type=int, default=None,
                   help="Rollouter KV budget per rank in context tokens (default: the 235B plan at the rollout EP; "
                        "0 = no bound)")
    g.add_argument("--train-update-s", type=float, default=c.update_s,
                   help="training seconds per 512 prompts at 128 dies ([ref 002 §1.3] 797.93)")
    g.add_argument("--train-other-s", type=float, default=c.other_s,
                   help="rest of the step per 512 prompts at 128 dies, on the Trainer ([ref 002 §1.3]: 396.74)")
    g.add_argument("--old-log-prob-s", type=float, default=c.old_log_prob_s,
                   help="fully-async with drafting: old log-probs on the Trainer per 512 prompts at 128 dies "
                        "(0: the rollout's log-probs, USE_ROLLOUT_LOG_PROBS=True)")
    g.add_argument("--async-max-num-seqs", type=int, default=0,
                   help=f"Rollouter requests per rank (0: fill {KV_FILL:g} of the KV budget on average)")
    g.add_argument("--split-sweep", default=None,
                   help="comma list of Rollouter dies (the rest train), or 'auto' (every 16 dies): print each split")
    g.add_argument("--async-warmup", type=int, default=2, help="weight syncs before the measured window")
    g.add_argument("--async-syncs", type=int, default=4, help="weight syncs in the measured window")


def _async_config(ns: argparse.Namespace, base: SimConfig, rollout_dies: int, train_dies: int) -> AsyncConfig:
    return AsyncConfig(rollout_dies=rollout_dies, train_dies=train_dies, max_num_seqs=ns.async_max_num_seqs,
                       staleness=ns.staleness, trigger_sync_steps=ns.trigger_sync_steps,
                       require_batches=ns.require_batches, mini_batch_prompts=ns.mini_batch_prompts,
                       weight_sync_s=ns.weight_sync_s, kv_tokens=ns.kv_tokens_per_rank, buckets=base.graph_buckets,
                       warmup_syncs=ns.async_warmup, measure_syncs=ns.async_syncs)


def _sweep_dies(text: str, total: int) -> list[int]:
    if text == "auto":
        return list(range(16, total - 15, 16))
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SimError(f"--split-sweep: expected comma-separated dies or 'auto', got {text!r}") from None
    if not vals or any(not 0 < v < total for v in vals):
        raise SimError(f"--split-sweep: Rollouter dies must lie in (0, {total})")
    return vals


def trainer_comparison(ns: argparse.Namespace, lengths: Lengths, base: SimConfig, results: list[SimResult],
                       drafts: list[str], make_draft: Callable[[str, str, int, str], tuple[object, float]]) -> dict:
    """Price the synchronous ``results`` per trained sample and run the fully-async trainer for each drafting
    (``none`` and ``BASE+...``); returns ``{"sync": {id(result): keys}, "json": {...}, "text": table}``."""
    total = base.dp * RANK_DIES
    rd = ns.rollout_dies if ns.rollout_dies is not None else total // 2 // RANK_DIES * RANK_DIES
    td = ns.train_dies if ns.train_dies is not None else total - rd
    if rd + td != total:
        raise SimError(f"--rollout-dies + --train-dies must equal the synchronous layout's {total} dies "
                       f"(--dp {base.dp} x {RANK_DIES}) to compare at the same total dies")
    cost = TrainCost(ns.train_update_s, ns.train_other_s, ns.old_log_prob_s)
    ref_res = next((r for r in results if r.policy == "default"), None)
    ref_ms = ref_res.makespan_s if ref_res else simulate(lengths, replace(base, policy="default")).makespan_s
    train_sync = cost.seconds(lengths.num_prompts, total)
    ref_tps = (ref_ms + train_sync) / lengths.size
    sync = {}
    w = max([len(r.policy) + 16 for r in results] + [len(d) + 13 for d in drafts] + [20])
    lines = [f"per trained sample, {total} dies: synchronous = rollout makespan + {train_sync:.1f} s trainer "
             f"(colocated); fully-async staleness {ns.staleness:g}, trigger {ns.trigger_sync_steps}, require "
             f"{ns.require_batches}, weight sync {ns.weight_sync_s:.1f} s",
             f"{'trainer / row':<{w}} {'dies R/T':>9} {'step_s':>8} {'s/sample':>9} {'gain':>6} {'roll_idle':>9} "
             f"{'train_idle':>10} {'stale':>6} {'partial':>7}"]
    for r in results:
        step_s = r.makespan_s + train_sync
        row = {"trainer": "sync", "step_s": step_s, "time_per_sample_s": step_s / lengths.size,
               "gain_vs_sync_default": ref_tps * lengths.size / step_s}
        sync[id(r)] = row
        label = r.policy + (f"@{r.link_gb_s:g}GB/s" if r.link_gb_s and len(results) > 1 and
                             sum(x.policy == r.policy for x in results) > 1 else "")
        lines.append(f"{'sync ' + label:<{w}} {total:>4} col. {step_s:>8.1f} {row['time_per_sample_s']:>9.4f} "
                     f"{row['gain_vs_sync_default']:>6.3f}")

    def run(dr: str, rdies: int) -> tuple[AsyncResult, dict]:
        acfg = _async_config(ns, base, rdies, total - rdies)
        dm, cov = (None, None) if dr == "none" else make_draft(dr, "fully-async", acfg.dp, "random")
        res = simulate_fully_async(lengths, acfg, base.step, cost, draft=dm)  # type: ignore[arg-type]
        extra = {"drafting": dr, "gain_vs_sync_default": ref_tps / res.time_per_sample_s}
        if cov is not None and "history" in dr:
            extra["history_coverage"] = cov
        if dm is not None:
            extra["engine_steps_per_k"] = dict(sorted(dm.k_steps.items()))  # type: ignore[attr-defined]
        return res, extra

    runnable = [d for d in drafts if d == "none" or "+" in d]
    rows = {}
    for dr in runnable:
        res, extra = run(dr, rd)
        rows[f"fully-async+{dr}" if dr != "none" else "fully-async"] = {**res.to_json(), **extra}
        lines.append(f"{'fully-async' + ('' if dr == 'none' else '+' + dr):<{w}} {rd:>4}/{td:<4} {res.period_s:>8.1f} "
                     f"{res.time_per_sample_s:>9.4f} {extra['gain_vs_sync_default']:>6.3f} "
                     f"{100 * res.rollouter_idle_share:>8.1f}% {100 * res.trainer_idle_share:>9.1f}% "
                     f"{100 * res.stale_share:>5.1f}% {100 * res.partial_share:>6.1f}%")
    lines.append("gain = synchronous default s/sample / row s/sample; fully-async step_s = time between weight syncs; "
                 "stale = trained prompts started under an older policy; partial = with a response paused by a sync")
    if rows:
        first = next(iter(rows.values()))
        lines.append(f"Rollouter: {first['max_num_seqs']} requests per rank (KV budget "
                     + (f"{ns.kv_tokens_per_rank} tokens" if ns.kv_tokens_per_rank is not None else
                        f"{kv_tokens_per_rank(rd)} tokens, 235B plan at EP {rd}")
                     + f"); {ns.mini_batch_prompts or lengths.num_prompts} x {ns.require_batches} prompts per update, "
                     f"{ns.trigger_sync_steps} updates per sync; preemptions "
                     + ", ".join(f"{k} {v['preemptions']}" for k, v in rows.items()))
    if len(runnable) < len(drafts):
        lines.append("plain sam_group / sam_group_exchange: synchronous rows only (the fully-async model drafts with "
                     "BASE+verify|history|adaptive)")
    out = {"total_dies": total, "rollout_dies": rd, "train_dies": td, "staleness": ns.staleness,
           "sync_default_time_per_sample_s": ref_tps, "train_cost": asdict(cost), "fully_async": rows}
    if ns.split_sweep:
        sweep: dict[str, list[dict]] = {}
        for dr in runnable:
            sweep[dr] = []
            for rdies in _sweep_dies(ns.split_sweep, total):
                res, extra = run(dr, rdies)
                sweep[dr].append({"rollout_dies": rdies, "train_dies": total - rdies,
                                  "time_per_sample_s": res.time_per_sample_s,
                                  "gain_vs_sync_default": extra["gain_vs_sync_default"]})
            best = min(sweep[dr], key=lambda x: x["time_per_sample_s"])
            lines.append(f"split sweep {dr}: " + ", ".join(
                f"{x['rollout_dies']}/{x['train_dies']} {x['gain_vs_sync_default']:.3f}" for x in sweep[dr])
                + f"; best {best['rollout_dies']}/{best['train_dies']}")
        out["split_sweep"] = sweep
    return {"sync": sync, "json": out, "text": "\n".join(lines)}
