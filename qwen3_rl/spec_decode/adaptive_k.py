"""Draft length that follows the batch: per-step k from a verification cost model and recent acceptance.

One verification step of ``n`` running sequences with ``d`` draft tokens in all and ``C`` context tokens
is modelled as (ms)::

    t(n, d, C) = base + seq * n + token * d + kctx * C / 1000

(``SamConfig.verify_*_ms``; the defaults are the rollout simulator's fitted decode-step model, ``simulate
fit-step-model``, plus a per-draft-token term: docs/sam_decoding.md states the inputs). A draft token at
position ``j`` (1-based) of request ``i`` is worth its probability of being accepted::

    g[i, j] = a_i * c_2 * ... * c_j

``a_i`` = the request's recent first-token acceptance (exponential average over its own steps, prior =
the batch's), ``c_m`` = the batch-wide conditional acceptance of position ``m`` given ``m - 1`` accepted
(decayed counts; accepted drafts come in runs, so ``c_m`` rises with ``m``). Every request advances its
bonus token. The step keeps the draft tokens that maximise the modelled throughput::

    (n + sum of kept g) / t(n, kept, C)

Since ``g`` falls with ``j``, the best set is the ``m`` largest ``g`` for some ``m``: sort, cumulative sums,
argmax; request ``i`` drafts ``k_i`` = its kept positions (never more than the drafter has, never less
than ``min(k_min, available)``). In the bulk of a rollout (large ``n``) a draft token costs ``token`` ms
against a step of ``base + seq * n``: drafts stay short. In the tail (few long requests) the step costs
about ``base`` whatever the draft length: drafts get long.

``uniform=True`` (``pad_drafts``, graph mode): one k for the whole step (the best of 1..k_max), every draft
padded to it, so the step is a uniform decode batch.
"""

from __future__ import annotations

import numpy as np

_FIRST_DECAY = 0.7  # weight of a request's past in its first-token acceptance estimate (per step)
_POS_DECAY = 0.995  # decay of the batch-wide per-position counts (per step)
_PRIOR = 2.0  # pseudo-observations of the batch prior in a request's estimate


class AdaptiveK:
    """Per-request draft lengths, one step at a time.

    Args:
        k_max: longest draft (vLLM's ``num_speculative_tokens``; vLLM-Ascend's attention takes k + 1 <= 16).
        k_min: floor of a draft that the drafter has tokens for.
        base_ms, seq_ms, token_ms, kctx_ms: the verification cost model (module docstring).
        uniform: one k per step for every request (pad_drafts).
    """

    def __init__(self, k_max: int, k_min: int = 1, base_ms: float = 59.64, seq_ms: float = 0.3614,
                 token_ms: float = 0.0585, kctx_ms: float = 0.07064, uniform: bool = False) -> None:
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_max, self.k_min, self.uniform = k_max, k_min, uniform
        self.base_ms, self.seq_ms, self.token_ms, self.kctx_ms = base_ms, seq_ms, token_ms, kctx_ms
        # batch-wide per position: drafts that reached position j (j-1 accepted) and accepted it
        self.reach = np.full(k_max, 2.0)
        self.acc = np.full(k_max, 1.0)
        # per drafter slot: first-token acceptance estimate (negative = no observation yet)
        self.first = np.full(64, -1.0)
        self.steps = 0
        self.k_hist = np.zeros(k_max + 1, np.int64)  # draft lengths chosen (counts per length)
        self.step_hist = np.zeros(k_max + 1, np.int64)  # longest draft length of each step (counts)
        self.last_k = 0  # longest draft length of the last step (uniform: the step's k)

    # ------------------------------------------------------------------ observations
    def _room(self, slots: np.ndarray) -> None:
        if slots.shape[0] and int(slots.max()) >= self.first.shape[0]:
            grown = np.full(max(2 * self.first.shape[0], int(slots.max()) + 1), -1.0)
            grown[: self.first.shape[0]] = self.first
            self.first = grown

    def reset(self, slots: np.ndarray) -> None:
        """New requests in these drafter slots: forget the previous owner's estimate."""
        slots = np.asarray(slots, np.int64)
        self._room(slots)
        self.first[slots] = -1.0

    def observe(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Verification results of the previous step: request ``slots[i]`` had ``drafted[i]`` draft tokens,
        ``accepted[i]`` of them were accepted (rows with no draft are ignored)."""
        slots = np.asarray(slots, np.int64)
        drafted = np.asarray(drafted, np.int64)
        accepted = np.minimum(np.asarray(accepted, np.int64), drafted)
        on = drafted > 0
        if not on.any():
            return
        slots, drafted, accepted = slots[on], drafted[on], accepted[on]
        self._room(slots)
        self.reach *= _POS_DECAY
        self.acc *= _POS_DECAY
        j = np.arange(self.k_max)
        # position j (0-based) was reached if j <= accepted and j < drafted; accepted if j < accepted
        self.reach += ((j[None, :] <= accepted[:, None]) & (j[None, :] < drafted[:, None])).sum(axis=0)
        self.acc += (j[None, :] < accepted[:, None]).sum(axis=0)
        hit = (accepted > 0).astype(np.float64)
        prev = self.first[slots]
        prior = self.acc[0] / self.reach[0]
        start = np.where(prev < 0, prior, prev)
        self.first[slots] = _FIRST_DECAY * start + (1.0 - _FIRST_DECAY) * hit

    # ------------------------------------------------------------------ choice
    def cond(self) -> np.ndarray:
        """Batch-wide acceptance of position j given j - 1 accepted, float[k_max]."""
        return self.acc / self.reach

    def choose(self, slots: np.ndarray, avail: np.ndarray, ctx_tokens: float, n_running: int | None = None
               ) -> np.ndarray:
        """Draft length per request for this step, int64[n] (0 <= k_i <= min(avail_i, k_max)).

        Args:
            slots: int[n] drafter slots of the requests that may draft this step.
            avail: int[n] draft tokens the drafter has for each (its proposal at k_max).
            ctx_tokens: context tokens of the step's sequences (sum), for the cost model.
            n_running: sequences in the step (default n; requests that cannot draft still run).
        """
        slots = np.asarray(slots, np.int64)
        avail = np.minimum(np.asarray(avail, np.int64), self.k_max)
        n = slots.shape[0]
        runs = n if n_running is None else max(int(n_running), n)
        self.steps += 1
        if n == 0:
            return np.zeros(0, np.int64)
        self._room(slots)
        c = self.cond()
        prior = c[0]
        a = self.first[slots]
        a = np.where(a < 0, prior, a)
        a = (a + _PRIOR * prior) / (1.0 + _PRIOR) if _PRIOR else a
        tail = np.cumprod(np.concatenate([[1.0], c[1:]]))  # P_j = c_2 ... c_j
        g = a[:, None] * tail[None, :]
        g[np.arange(self.k_max)[None, :] >= avail[:, None]] = 0.0
        base = self.base_ms + self.seq_ms * runs + self.kctx_ms * ctx_tokens / 1000.0
        floor = np.minimum(avail, self.k_min)
        if self.uniform:
            best_k, best = 0, -1.0
            for k in range(self.k_min, self.k_max + 1):
                val = (runs + g[:, :k].sum()) / (base + self.token_ms * n * k)
                if val > best:
                    best, best_k = val, k
            k_out = np.minimum(avail, best_k)
        else:
            flat = np.sort(g[g > 0.0])[::-1]
            if flat.shape[0]:
                m = np.arange(1, flat.shape[0] + 1)
                obj = (runs + np.cumsum(flat)) / (base + self.token_ms * m)
                i = int(np.argmax(obj))
                keep = i + 1 if obj[i] > runs / base else 0
                theta = flat[keep - 1] if keep else np.inf
                k_out = (g >= theta).sum(axis=1)
            else:
                k_out = np.zeros(n, np.int64)
            k_out = np.maximum(k_out, floor)
        k_out = k_out.astype(np.int64)
        self.last_k = best_k if self.uniform else int(k_out.max())
        self.k_hist += np.bincount(k_out, minlength=self.k_max + 1)[: self.k_max + 1]
        self.step_hist[self.last_k] += 1
        return k_out

    def step_ms(self, n: int, drafted: int, ctx_tokens: float) -> float:
        """The cost model: modelled verification time (ms) of one step."""
        return self.base_ms + self.seq_ms * n + self.token_ms * drafted + self.kctx_ms * ctx_tokens / 1000.0
