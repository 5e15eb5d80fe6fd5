"""Draft length that follows the batch: per-step k from a verification cost model and recent acceptance.

One verification step of ``n`` running sequences with ``d`` draft tokens in all and ``C`` context tokens
is modelled as (ms)::

    t(n, d, C) = base + seq * n + token * d + kctx * C / 1000

(``SamConfig.verify_*_ms``; the defaults are the rollout simulator's fitted decode-step model, ``simulate
fit-step-model``, plus a per-draft-token term: docs/sam_decoding.md states the inputs). A draft token at
position ``j`` (1-based) of request ``i`` is worth its probability of being accepted::

    g[i, j] = a_i * (r_i c_2) * ... * (r_i c_j)

``c_m`` = the conditional acceptance of position ``m`` given ``m - 1`` accepted in the request's
match-length bucket (``match_bucket``: the drafter's matched suffix, 0, 1, 2-3, 4-7, ... 64+ tokens; on the dev
rollouts a 1-token match has its first draft token accepted 31 % of the time and 0.8 tokens accepted on average,
a 16-31-token one 84 % and 5.5): decayed counts per bucket, shrunk to the batch-wide estimate, which is itself
shrunk to position ``m - 1``'s (a position no draft has reached yet takes the one before it, so the policy tries
longer drafts when the deepest reached position accepts well; accepted drafts come in runs, so ``c_m`` rises with
``m``). ``a_i`` = the request's recent first-token acceptance (exponential average over its own steps) shrunk to
its bucket's ``c_1``. Learnt per request online as well: ``r_i`` scales the bucket's ``c_2 .. c_j`` (``g[i, j] = a_i
* r_i c_2 * ... * r_i c_j``), the request's accepted positions beyond the first over what its buckets predicted for
the positions its drafts reached (decayed per draft, shrunk to 1, at most 1): a request whose drafts break off
earlier than its bucket's drafts do drafts shorter; one that accepts further keeps the bucket's estimate. The
constants were chosen on half of the dev corpus (``drafters --half a``) and reported on
the other half (docs/sam_decoding.md). Every request advances its bonus token. The step keeps the draft tokens that
maximise the modelled throughput::

    (n + sum of kept g) / t(n, kept, C)

Since ``g`` falls with ``j``, the best set is every ``g`` above a threshold ``token * rate`` where ``rate`` is the
best throughput itself: found by Dinkelbach's iteration (rate <- throughput of the set above ``token * rate``,
a few passes over ``n x k_max`` values in one numba kernel); request ``i`` drafts ``k_i`` = its kept positions
(never more than the drafter has, never less than ``min(k_min, available)``). In the bulk of a rollout (large ``n``) a draft token costs ``token`` ms
against a step of ``base + seq * n``: drafts stay short. In the tail (few long requests) the step costs
about ``base`` whatever the draft length: drafts get long.

``uniform=True`` (``pad_drafts``, graph mode): one k for the whole step (the best of 1..k_max), every draft
padded to it, so the step is a uniform decode batch.

With a measured cost table (``table``, ``cost_table.py``; ``sam_config.cost_table``) the step time comes from the
table instead of the linear model: ``t = table(B, B + drafted, C / B)`` with ``B`` the running sequences and ``C / B``
their mean context. The gains are the same; the kept set is still every ``g`` above a threshold, but the step time is
no longer linear in the drafted tokens, so the threshold is found by a sweep: one pass files the gains in
``_BINS`` bins of width ``1 / _BINS`` (count and sum per bin), then the modelled throughput is evaluated for every
threshold at a bin edge (top bin down); the gains of the best edge's bin and of the next non-empty bin below it are
then tried one by one (sorted), and the best threshold is kept (``_choose_table``). ``uniform=True`` prices each k of
1..k_max at ``table(B, B + n * k, C / B)``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from qwen3_rl.spec_decode._sam_kernels import CACHE
from qwen3_rl.spec_decode.cost_table import CostTable, curve_into, price

_FIRST_DECAY = 0.7  # weight of a request's past in its first-token acceptance estimate (per step)
_POS_DECAY = 0.995  # decay of the per-bucket, per-position counts (per step)
_PRIOR = 2.0  # pseudo-observations of the bucket's prior in a request's first-token estimate
_BINS = 512  # gain bins of the table-priced threshold sweep (gains are probabilities in [0, 1])
_POS_PRIOR = 2.0  # pseudo-observations of position j - 1's conditional acceptance in position j's estimate
_MATCH_BUCKETS = 8  # match-length buckets: 0, 1, 2-3, 4-7, ..., >= 64 tokens (bit length, capped)
_BUCKET_PRIOR = 4.0  # pseudo-observations of the batch-wide estimate in a bucket's per-position estimate
_REQ_DECAY = 0.8  # weight of a request's past in its continuation counts (per verified draft)
_REQ_PRIOR = 2.0  # pseudo-continuations (observed = expected) in a request's continuation factor


def match_bucket(match_len: np.ndarray) -> np.ndarray:
    """Bucket of each match length, int64[n]: its bit length (0, 1, 2-3, 4-7, ...) capped at _MATCH_BUCKETS - 1."""
    m = np.maximum(np.asarray(match_len, np.int64), 0)
    return np.minimum(np.where(m > 0, np.floor(np.log2(np.maximum(m, 1))).astype(np.int64) + 1, 0),
                      _MATCH_BUCKETS - 1)


@njit(cache=CACHE)
def _observe(slots, drafted, accepted, bucket, reach, acc, first, cond, cobs, cexp, pos_decay, first_decay,
             req_decay):  # pragma: no cover
    """Decay the per-bucket, per-position counts (``reach``/``acc``: float[buckets, k_max]) once, add each row's
    reached / accepted positions to its draft's bucket (``bucket[slot]``), update the rows' first-token estimates
    (a negative estimate starts from the batch's) and their continuation counts: ``cobs[slot]`` (accepted positions
    beyond the first) and ``cexp[slot]`` (their expectation: the conditional acceptance ``cond[bucket, j]``,
    float[buckets, k_max] as priced, summed over the reached positions j >= 2), both decayed by ``req_decay`` per
    verified draft."""
    nb, km = reach.shape
    for i in range(slots.shape[0]):
        d = min(drafted[i], km)
        if d <= 0:
            continue
        a = min(accepted[i], d)
        s = slots[i]
        b = bucket[s]
        o = 0.0
        e = 0.0
        for j in range(1, min(a + 1, d)):
            e += cond[b, j]
            if j < a:
                o += 1.0
        cobs[s] = req_decay * cobs[s] + o
        cexp[s] = req_decay * cexp[s] + e
    for b in range(nb):
        for j in range(km):
            reach[b, j] *= pos_decay
            acc[b, j] *= pos_decay
    r0 = 0.0
    a0 = 0.0
    for i in range(slots.shape[0]):
        d = min(drafted[i], km)
        a = min(accepted[i], d)
        b = bucket[slots[i]]
        for j in range(min(a + 1, d)):
            reach[b, j] += 1.0
        for j in range(a):
            acc[b, j] += 1.0
    for b in range(nb):
        r0 += reach[b, 0]
        a0 += acc[b, 0]
    prior0 = a0 / r0 if r0 > 0 else 0.5
    for i in range(slots.shape[0]):
        d = min(drafted[i], km)
        if d <= 0:
            continue
        a = min(accepted[i], d)
        s = slots[i]
        prev = first[s] if first[s] >= 0 else prior0
        first[s] = first_decay * prev + (1.0 - first_decay) * (1.0 if a > 0 else 0.0)


@njit(cache=CACHE)
def _gains(slots, bucket, first, cobs, cexp, cb, prior_w, req_prior, out):  # pragma: no cover - numba
    """Gains into ``out`` (float64[n, k_max]): ``out[i, 0] = a_i`` (the slot's first-token estimate, the bucket's
    ``cb[b, 0]`` when negative, shrunk to it with ``prior_w`` pseudo-observations), ``out[i, j] = out[i, j - 1] *
    r_i * cb[b, j]`` with ``r_i = min(1, (cobs + req_prior) / (cexp + req_prior))`` of the slot."""
    km = out.shape[1]
    for i in range(slots.shape[0]):
        s = slots[i]
        b = bucket[s]
        prior = cb[b, 0]
        a = first[s] if first[s] >= 0 else prior
        g = (a + prior_w * prior) / (1.0 + prior_w)
        r = min(1.0, (cobs[s] + req_prior) / (cexp[s] + req_prior))
        out[i, 0] = g
        for j in range(1, km):
            g *= r * cb[b, j]
            out[i, j] = g


@njit(cache=CACHE)
def _choose(G, avail, runs, base, tok, kmin, uniform, out):  # pragma: no cover - numba
    """Draft lengths into ``out`` (int64[n]) for gains ``g[i, j] = G[i, j]`` (j < avail[i]; falling in j); returns the
    uniform k (uniform mode) or the longest length."""
    n = G.shape[0]
    km = G.shape[1]
    if uniform:
        best_k = kmin
        best = -1.0
        gain = 0.0
        for k in range(1, km + 1):
            for i in range(n):
                if k <= avail[i]:
                    gain += G[i, k - 1]
            if k >= kmin:
                val = (runs + gain) / (base + tok * n * k)
                if val > best:
                    best = val
                    best_k = k
        for i in range(n):
            out[i] = min(avail[i], best_k)
        return best_k
    rate = runs / base
    for _ in range(32):  # Dinkelbach: the rate of the set above tok * rate, until it stops growing
        thr = tok * rate
        gsum = 0.0
        cnt = 0
        for i in range(n):
            for j in range(min(avail[i], km)):
                g = G[i, j]
                if g <= thr:
                    break
                gsum += g
                cnt += 1
        new = (runs + gsum) / (base + tok * cnt)
        if new <= rate * (1.0 + 1e-12):
            break
        rate = new
    thr = tok * rate
    longest = 0
    for i in range(n):
        k = 0
        for j in range(min(avail[i], km)):
            if G[i, j] <= thr:
                break
            k += 1
        k = max(k, min(avail[i], kmin))
        out[i] = k
        longest = max(longest, k)
    return longest


@njit(cache=CACHE)
def _choose_table(G, avail, runs, q_grid, curve, kmin, uniform, cnt, gsum, out):  # pragma: no cover - numba
    """Draft lengths into ``out`` (int64[n]) for gains ``g[i, j] = G[i, j]`` (j < avail[i]; falling in j) with the step
    priced on a table curve (``cost_table.curve_into`` over ``q_grid`` = 1 + k, at the step's B and context):
    drafted tokens ``m`` cost ``price(q_grid, curve, 1 + m / runs)``. ``cnt`` / ``gsum``: float64[_BINS] scratch.
    Returns the uniform k (uniform mode) or the longest length."""
    n = G.shape[0]
    km = G.shape[1]
    if uniform:
        best_k = kmin
        best = -1.0
        gain = 0.0
        for k in range(1, km + 1):
            for i in range(n):
                if k <= avail[i]:
                    gain += G[i, k - 1]
            if k >= kmin:
                val = (runs + gain) / price(q_grid, curve, 1.0 + n * k / runs)
                if val > best:
                    best = val
                    best_k = k
        for i in range(n):
            out[i] = min(avail[i], best_k)
        return best_k
    nb = cnt.shape[0]
    for b in range(nb):
        cnt[b] = 0.0
        gsum[b] = 0.0
    gain = runs  # every running request advances its bonus token
    m = 0.0
    for i in range(n):  # the floor's tokens are always kept; the rest go to the bins
        top = min(avail[i], km)
        floor = min(top, kmin)
        for j in range(top):
            g = G[i, j]
            if j < floor:
                gain += g
                m += 1.0
            else:
                b = min(int(g * nb), nb - 1)
                cnt[b] += 1.0
                gsum[b] += g
    floor_gain, floor_m = gain, m
    best = gain / price(q_grid, curve, 1.0 + m / runs)
    cut = nb  # keep the gains of bins >= cut
    for b in range(nb - 1, -1, -1):
        if cnt[b] == 0.0:
            continue
        m += cnt[b]
        gain += gsum[b]
        val = gain / price(q_grid, curve, 1.0 + m / runs)
        if val > best:
            best = val
            cut = b
    # refine at the boundary: the cut bin and the next non-empty bin below it, gain by gain (a bin may hold gains
    # on both sides of the best threshold when the curve bends inside it)
    hi = cut if cut < nb else -1
    lo = min(cut, nb) - 1
    while lo >= 0 and cnt[lo] == 0.0:
        lo -= 1
    top_b = hi if hi >= 0 else lo
    if top_b < 0:  # nothing beyond the floor
        thr = 2.0
    else:
        gain, m = floor_gain, floor_m
        for b in range(top_b + 1, nb):
            gain += gsum[b]
            m += cnt[b]
        size = int(cnt[top_b]) + (int(cnt[lo]) if lo >= 0 and lo != top_b else 0)
        region = np.empty(size)
        r = 0
        for i in range(n):
            top = min(avail[i], km)
            for j in range(min(top, kmin), top):
                g = G[i, j]
                b = min(int(g * nb), nb - 1)
                if b == top_b or b == lo:
                    region[r] = g
                    r += 1
        region = -np.sort(-region)
        thr = (top_b + 1.0) / nb  # none of the region
        best = gain / price(q_grid, curve, 1.0 + m / runs)
        for t in range(size):
            gain += region[t]
            m += 1.0
            val = gain / price(q_grid, curve, 1.0 + m / runs)
            if val > best:
                best = val
                thr = region[t]
    longest = 0
    for i in range(n):
        top = min(avail[i], km)
        k = min(top, kmin)
        while k < top and G[i, k] >= thr:
            k += 1
        out[i] = k
        longest = max(longest, k)
    return longest


class AdaptiveK:
    """Per-request draft lengths, one step at a time.

    Args:
        k_max: longest draft (vLLM's ``num_speculative_tokens``; vLLM-Ascend's attention takes k + 1 <= 16).
        k_min: floor of a draft that the drafter has tokens for.
        base_ms, seq_ms, token_ms, kctx_ms: the linear verification cost model (module docstring); unused with
            ``table``.
        uniform: one k per step for every request (pad_drafts).
        table: measured step times (``cost_table.CostTable``) that price the step instead of the linear model;
            its grid must reach k_max.
    """

    def __init__(self, k_max: int, k_min: int = 1, base_ms: float = 59.64, seq_ms: float = 0.3614,
                 token_ms: float = 0.0585, kctx_ms: float = 0.07064, uniform: bool = False,
                 table: CostTable | None = None) -> None:
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        if table is not None and table.k_max < k_max:
            raise ValueError(f"cost table {table.source or table.shape} measures k <= {table.k_max}, below the "
                             f"longest draft k_max = {k_max}")
        self.k_max, self.k_min, self.uniform = k_max, k_min, uniform
        self.base_ms, self.seq_ms, self.token_ms, self.kctx_ms = base_ms, seq_ms, token_ms, kctx_ms
        self.table = table
        # benches: (B, context tokens per request) that price every step instead of the step's own (``pin``)
        self.cell: tuple[float, float] | None = None
        if table is not None:
            self._q = table.q
            self._curve = np.empty(table.k.shape[0])
            self._cnt = np.empty(_BINS)
            self._gsum = np.empty(_BINS)
        # per match-length bucket (row _MATCH_BUCKETS: drafts of unknown match length) and position: decayed
        # counts of the drafts that reached position j (j - 1 accepted) and accepted it
        self.reach = np.zeros((_MATCH_BUCKETS + 1, k_max))
        self.acc = np.zeros((_MATCH_BUCKETS + 1, k_max))
        self.reach[_MATCH_BUCKETS, 0], self.acc[_MATCH_BUCKETS, 0] = 2.0, 1.0  # prior of the first position: 1 of 2
        # per drafter slot: the match-length bucket of its last draft (what its next observation is filed under)
        self.bucket = np.full(64, _MATCH_BUCKETS, np.int64)
        # per drafter slot: first-token acceptance estimate (negative = no observation yet)
        self.first = np.full(64, -1.0)
        # per drafter slot: decayed continuation counts (positions beyond the first: accepted, and expected under
        # the bucket's conditional acceptance as priced), the request's own factor on that acceptance
        self.cobs = np.zeros(64)
        self.cexp = np.zeros(64)
        self._cb: np.ndarray | None = None  # per-bucket conditional acceptance of the last choice (``gains``)
        self.steps = 0
        self.k_hist = np.zeros(k_max + 1, np.int64)  # draft lengths chosen (counts per length)
        self.step_hist = np.zeros(k_max + 1, np.int64)  # longest draft length of each step (counts)
        self.last_k = 0  # longest draft length of the last step (uniform: the step's k)

    # ------------------------------------------------------------------ observations
    def _room(self, slots: np.ndarray) -> None:
        if slots.shape[0] and int(slots.max()) >= self.first.shape[0]:
            size = max(2 * self.first.shape[0], int(slots.max()) + 1)
            for name, fill in (("first", -1.0), ("bucket", _MATCH_BUCKETS), ("cobs", 0.0), ("cexp", 0.0)):
                old = getattr(self, name)
                grown = np.full(size, fill, old.dtype)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)

    def reset(self, slots: np.ndarray) -> None:
        """New requests in these drafter slots: forget the previous owner's estimate."""
        slots = np.asarray(slots, np.int64)
        self._room(slots)
        self.first[slots] = -1.0
        self.bucket[slots] = _MATCH_BUCKETS
        self.cobs[slots] = 0.0
        self.cexp[slots] = 0.0

    def observe(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Verification results of the previous step: request ``slots[i]`` had ``drafted[i]`` draft tokens,
        ``accepted[i]`` of them were accepted (rows with no draft are ignored)."""
        slots = np.ascontiguousarray(slots, np.int64)
        if not slots.shape[0]:
            return
        self._room(slots)
        _observe(slots, np.ascontiguousarray(drafted, np.int64), np.ascontiguousarray(accepted, np.int64),
                 self.bucket, self.reach, self.acc, self.first,
                 self._cb if self._cb is not None else self.cond_buckets(), self.cobs, self.cexp,
                 _POS_DECAY, _FIRST_DECAY, _REQ_DECAY)  # the kernel clips both

    def pin(self, n: float, ctx: float) -> None:
        """Benches: price every step as a step of ``n`` running requests with ``ctx`` context tokens each (one cell
        of the table), whatever the step's own batch; needs ``table``."""
        if self.table is None:
            raise ValueError("pin needs a cost table")
        self.cell = (float(n), float(ctx))

    # ------------------------------------------------------------------ choice
    def cond(self) -> np.ndarray:
        """Batch-wide acceptance of position j given j - 1 accepted, float[k_max]: position j's decayed counts (all
        buckets) with ``_POS_PRIOR`` pseudo-observations of position j - 1's estimate (a position no draft has
        reached yet takes the one before it, so longer drafts are tried when the deepest reached position accepts
        well)."""
        reach, acc = self.reach.sum(axis=0), self.acc.sum(axis=0)
        c = np.empty(self.k_max)
        c[0] = acc[0] / reach[0]
        for j in range(1, self.k_max):
            c[j] = (acc[j] + _POS_PRIOR * c[j - 1]) / (reach[j] + _POS_PRIOR)
        return c

    def cond_buckets(self) -> np.ndarray:
        """Acceptance of position j given j - 1 accepted per match-length bucket, float[buckets + 1, k_max]: the
        bucket's counts with ``_BUCKET_PRIOR`` pseudo-observations of the batch-wide estimate (``cond``)."""
        c = self.cond()
        return (self.acc + _BUCKET_PRIOR * c) / (self.reach + _BUCKET_PRIOR)

    def factor(self, slots: np.ndarray) -> np.ndarray:
        """Each request's own factor on its bucket's conditional acceptance beyond the first position, float[n] in
        (0, 1]: its decayed accepted continuations over their expectation, each with ``_REQ_PRIOR``
        pseudo-continuations (1 before any). Capped at 1: a request accepting more than its bucket predicts keeps
        the bucket's figure (on half a of the dev corpus a factor allowed above 1 lost 0.6-0.8 % of the mean
        throughput over the H100 cells)."""
        return np.minimum((self.cobs[slots] + _REQ_PRIOR) / (self.cexp[slots] + _REQ_PRIOR), 1.0)

    def gains(self, slots: np.ndarray) -> np.ndarray:
        """What a draft token is worth, float64[n, k_max] (C-contiguous): ``g[i, j] = a_i * (r_i c_2) ... (r_i c_j)``,
        the probability that position j + 1 of request ``slots[i]``'s draft is accepted, with the conditional
        acceptances ``c`` of the request's match-length bucket (as of the last ``choose``), ``r_i`` the request's
        own factor on them (``factor``) and ``a_i`` its first-token estimate shrunk to that bucket's; falls with j."""
        slots = np.ascontiguousarray(slots, np.int64)
        self._cb = self.cond_buckets()
        out = np.empty((slots.shape[0], self.k_max))
        _gains(slots, self.bucket, self.first, self.cobs, self.cexp, self._cb, _PRIOR, _REQ_PRIOR, out)
        return out

    def choose(self, slots: np.ndarray, avail: np.ndarray, ctx_tokens: float, n_running: int | None = None,
               match_len: np.ndarray | None = None) -> np.ndarray:
        """Draft length per request for this step, int64[n] (0 <= k_i <= min(avail_i, k_max)).

        Args:
            slots: int[n] drafter slots of the requests that may draft this step.
            avail: int[n] draft tokens the drafter has for each (its proposal at k_max).
            ctx_tokens: context tokens of the step's sequences (sum), for the cost model.
            n_running: sequences in the step (default n; requests that cannot draft still run).
            match_len: int[n] tokens of each request's suffix that the drafter matched (SAM: the match its draft
                continues); longer matches are accepted further, so each request is priced with its bucket's
                acceptance (``match_bucket``). None: one batch-wide estimate.
        """
        slots = np.asarray(slots, np.int64)
        avail = np.ascontiguousarray(np.minimum(np.asarray(avail, np.int64), self.k_max))
        n = slots.shape[0]
        runs = n if n_running is None else max(int(n_running), n)
        self.steps += 1
        if n == 0:
            return np.zeros(0, np.int64)
        self._room(slots)
        self.bucket[slots] = _MATCH_BUCKETS if match_len is None else match_bucket(match_len)
        G = self.gains(slots)
        k_out = np.empty(n, np.int64)
        if self.table is None:
            base = self.base_ms + self.seq_ms * runs + self.kctx_ms * ctx_tokens / 1000.0
            self.last_k = int(_choose(G, avail, float(runs), base, self.token_ms, self.k_min, self.uniform,
                                      k_out))
        else:
            t = self.table
            b, c = self.cell if self.cell is not None else (float(runs), ctx_tokens / runs)
            curve_into(t.b, t.ctx, t.ms, b, c, self._curve)
            self.last_k = int(_choose_table(G, avail, float(runs), self._q, self._curve, self.k_min,
                                            self.uniform, self._cnt, self._gsum, k_out))
        self.k_hist += np.bincount(k_out, minlength=self.k_max + 1)[: self.k_max + 1]
        self.step_hist[self.last_k] += 1
        return k_out

    def step_ms(self, n: int, drafted: int, ctx_tokens: float) -> float:
        """The cost model: modelled verification time (ms) of one step of ``n`` sequences with ``drafted`` draft
        tokens in all and ``ctx_tokens`` context tokens in all (the table at ``pin``'s cell when pinned)."""
        if self.table is not None:
            if n <= 0:
                return 0.0
            b, c = self.cell if self.cell is not None else (float(n), ctx_tokens / n)
            return self.table.step_ms(b, b * (1.0 + drafted / n), c)
        return self.base_ms + self.seq_ms * n + self.token_ms * drafted + self.kctx_ms * ctx_tokens / 1000.0
