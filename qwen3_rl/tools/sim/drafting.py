"""Verification steps of SAM drafting in the rollout simulator: per-step k, history, token cost, sibling count.

``simulate rollout --drafting BASE+verify|BASE+history|BASE+adaptive|BASE+history+adaptive`` (BASE =
``sam_group`` or ``sam_group_exchange``) runs the lockstep engine with a :class:`DraftModel`: every engine step
still moves each running request by one token, and is charged the time of a verification step divided by the
tokens a request advances per verification step (``tau``)::

    step_ms = (t0 + per_seq * bucket(R) + per_kctx * C / 1000 + drafter_ms + token_ms * R * k) / tau(k)

``R`` = the busiest rank's running requests (lockstep pads to it), ``k`` the draft length of the step:
fixed (``--fixed-k``, 3) or, with ``+adaptive``, the k in 1..``--k-max`` that maximises ``tau(k) / step``
(the batch-level form of ``spec_decode.adaptive_k``, which chooses per request). ``tau(k)`` comes from
``TPS`` (lockstep visit replay of the drafter bench on ``rollouts_dev.jsonl``: tokens per verification step
at fixed k = 1..15, bulk = more than 8 requests running, tail = at most 8; ``+history`` = samples 0-3 of
each prompt in the history store), scaled by the layout's figure at k = 3 relative to siblings together
(``Drafting``: spread 1.666, exchange 1.846, together 1.856). ``token_ms`` (``--verify-token-ms``) = the
cost of one more query token in a verification step: 2 x 22e9 FLOP (Qwen3-235B-A22B active parameters) on
the 4 dies of one DP rank at 376 TFLOPS bf16 each and 50 % utilisation = 0.0585 ms (assumed inputs, not
measured on an NPU); the other terms are the fitted decode-step model (``simulate fit-step-model``).
Rebalance intervals stay in engine steps (tokens), not verification steps. With ``--coupling independent`` each
rank's segments are priced the same way from its own ``R`` and ``C``.

Server placements (``--placement spread|group``): the no-history tables come from the siblings each request has on
its engine (:func:`sibling_tables`); history and the exchange are not modelled there.

``--verify-model roofline``: decode on A3 is memory- and latency-bound (a 60 ms step at the smallest batch,
[ref 002 §2.2]), so the compute of the extra query tokens hides under the fitted step until the batch's tokens
reach the compute roof. A verification step then costs::

    max(t0 + per_seq * bucket + per_kctx * C / 1000,  t0 + (k + 1) * (F * bucket + A * C) / rate) + drafter_ms

``F`` = 2 x 22e9 FLOP per token (Qwen3-235B-A22B active parameters), ``A`` = 4 x 64 heads x 128 x 94 layers =
3.08e6 FLOP per query token and context token (QK and PV; Qwen3-235B-A22B config), ``rate`` = one DP rank's
4 dies (TP4) at 390 TFLOPS bf16 each (an Ascend 910C card = 2 dies, 780 TFLOPS bf16: TechPowerUp, 2025-04-21,
https://techpowerup.com/335749/) at ``--mfu`` 0.5 (assumed). Every padded row (``bucket``) verifies ``k + 1``
tokens. The compute term at k = 0 stays below the fitted step (the fitted decode step is not compute-bound),
so the fit is unchanged without drafts. Not modelled, in both forms: EP dispatch/combine bytes, which grow
with the query tokens (the fitted ``per_seq`` may hold them: then the linear form is the closer one).

``--step-table F --shape NAME`` (``sim/step_table.py``): a verification step costs the fitted decode step times
the measured table's ratio (step at k drafts / step at k = 0) at the rank's bucket, k and mean context per request,
interpolated; the drafter's host cost is added. The table keeps the A3 floor and takes the drafting cost's shape
from other hardware (e.g. the H100 30B-A3B grid): its ratio also scales the A3 floor, which need not grow with k.

Inputs that differ from the 235B GRPO run (n = 16): the dev corpus holds 8 samples per prompt, so ``TPS`` is
measured with 4 current siblings (+ 4 earlier responses for ``history``). ``--draft-siblings 8`` takes the
no-history tables measured with all 8 samples current (``TPS_SIBLINGS8``: more siblings, more to draft from; the
history tables stay at 4 + 4, the corpus has no more samples).

History coverage (``--history-coverage F``; default: what the placement gives, :func:`placement_coverage`):
``+history`` tables assume every request of the step starts with its prompt's earlier responses, which holds only
where the rank running the request kept them: the store is per engine (filled from local finishes and, with the
exchange, from the shadows of remote siblings of the prompts it runs), bounded by ``SAM_HISTORY_MAX_BYTES`` with
LRU eviction, and a run's first epoch has none (the default is the steady state after it). Example, the 235B
layout with data rebalance (DP 32, n 16): ``rebalance_permutation`` puts a prompt's 16 samples on ranks 0-15 or
16-31 by the parity of its batch position, so with shuffled epochs about half of the next visits land where the
history is; each rank keeps the responses of 256 prompts per step (about 30 MB at 4 responses of 7345 tokens), so
a 512 MiB store holds about 18 of the epoch's 79 steps: F = 0.5 x 18 / 79 = 0.11. ``simulate rollout`` assumes by
default a store that holds the epoch (the runtime's bound from host memory, ``SAM_HISTORY_MAX_BYTES=0``, where the
host allows); with ``--rebalance-by-key`` the placement is "keyed" (:func:`keyed_home_share`: 0.975 there).
With ``F`` < 1, the tables become the per-request-step mean of a batch where a share ``F`` of the requests
drafts with history: a request of ``L`` tokens spends ``L / tau`` verification steps, so tokens per request-step
are ``1 / (F / tau_history + (1 - F) / tau_current)`` at every k (harmonic mean; exact at F = 0 and F = 1). The
mean is given to every request: a long request without history is modelled faster than it runs, so the rows
are an upper bound of the history's gain at that coverage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from qwen3_rl.tools.sim.simulate import DRAFTING, SPREAD_POLICIES, Drafting, SimError, StepModel
from qwen3_rl.tools.sim.step_table import StepTable, interp_ratio

#: Tokens per verification step at fixed k = 1..15 (bonus included), ``python -m qwen3_rl.tools.bench.drafters
#: --corpus ../shared/bench/rollouts_dev.jsonl --group --history 4 --k K --skip-cost`` (``replay_visits``:
#: samples 4-7 of every prompt running together, one engine).
TPS = {
    ("current", "bulk"): (1.397, 1.577, 1.670, 1.723, 1.752, 1.775, 1.786, 1.795, 1.801, 1.804, 1.807, 1.809,
                          1.812, 1.813, 1.813),
    ("current", "tail"): (1.592, 1.920, 2.159, 2.325, 2.469, 2.550, 2.588, 2.629, 2.670, 2.715, 2.783, 2.755,
                          2.742, 2.768, 2.787),
    ("history", "bulk"): (1.497, 1.761, 1.911, 1.998, 2.059, 2.106, 2.132, 2.156, 2.167, 2.178, 2.183, 2.190,
                          2.195, 2.198, 2.202),
    ("history", "tail"): (1.582, 1.916, 2.142, 2.272, 2.371, 2.461, 2.526, 2.563, 2.651, 2.671, 2.718, 2.722,
                          2.723, 2.725, 2.756),
}
#: The same replay with all 8 samples of every prompt current and no history (``replay_visits`` with history 0 on
#: the full groups; ``--draft-siblings 8``): the no-history tables at the corpus' largest sibling count.
TPS_SIBLINGS8 = {
    ("current", "bulk"): (1.435, 1.638, 1.749, 1.807, 1.843, 1.868, 1.885, 1.898, 1.905, 1.909, 1.913, 1.917,
                          1.916, 1.920, 1.923),
    ("current", "tail"): (1.596, 1.955, 2.162, 2.253, 2.359, 2.439, 2.475, 2.505, 2.531, 2.552, 2.590, 2.600,
                          2.612, 2.599, 2.610),
}
DRAFT_SIBLINGS = (4, 8)
TAIL_MAX = 8  # running requests per rank at or below which the tail figures apply
VERIFY_TOKEN_MS = 0.0585
MODIFIERS = ("verify", "history", "adaptive")
VERIFY_MODELS = ("linear", "roofline", "table")
FLOP_PER_TOKEN = 2 * 22e9  # Qwen3-235B-A22B: 2 x active parameters per token
ATTN_FLOP_PER_CTX = 4 * 64 * 128 * 94  # QK + PV per query token and context token: heads x head_dim x layers
DIE_TFLOPS = 390.0  # Ascend 910C: 780 TFLOPS bf16 per card of 2 dies (TechPowerUp 2025-04-21)
RANK_DIES = 4  # one rollout DP rank of the 235B layout: TP4 ([ref 002]: 128 die DP32 TP4 EP128)
MFU = 0.5  # assumed utilisation of the roof
HISTORY_RESPONSES = 4  # earlier responses per prompt behind the history tables (``--history 4``)
HISTORY_MAX_BYTES = 1 << 29  # the store bound (512 MiB) placement_coverage assumes unless told
TOKEN_BYTES = 4  # the history store keeps int32 token ids (spec_decode.history)
#: steps per epoch of the 235B GRPO run: deepscaler, 40.3k prompts (the Hugging Face dataset viewer of
#: agentica-org/DeepScaleR-Preview-Dataset) at 512 prompts per step
EPOCH_STEPS = 79.0
PLACEMENTS = ("contiguous", "interleaved", "keyed", "random")


@dataclass(frozen=True)
class DraftModel:
    """Tokens per verification step and the verification step's cost, per lockstep segment."""

    bulk: tuple[float, ...]
    tail: tuple[float, ...]
    layout: float = 1.0  # tokens/step of the layout at k = 3 / siblings together at k = 3
    fixed_k: int | None = 3  # None: adaptive
    k_max: int = 15
    token_ms: float = VERIFY_TOKEN_MS
    drafter_ms: float = 0.4
    tail_max: int = TAIL_MAX
    k_steps: dict[int, int] = field(default_factory=dict, compare=False)  # engine steps run at each k
    verify_model: str = "linear"  # "linear" (token_ms per draft token), "roofline" or "table" (module docstring)
    mfu: float = MFU
    table: StepTable | None = None  # verify_model "table": measured ratios (sim/step_table.py)

    def __post_init__(self) -> None:
        if self.verify_model not in VERIFY_MODELS:
            raise SimError(f"unknown verify model {self.verify_model!r} (choose from {', '.join(VERIFY_MODELS)})")
        if (self.verify_model == "table") != (self.table is not None):
            raise SimError("the table verify model needs a step table (--step-table F --shape NAME), and only it")
        if not 0 < self.mfu <= 1:
            raise SimError(f"--mfu must be in (0, 1], got {self.mfu}")

    @property
    def rank_flop_per_ms(self) -> float:
        """FLOP one DP rank computes per ms at the assumed utilisation."""
        return RANK_DIES * DIE_TFLOPS * 1e12 * self.mfu / 1000.0

    def compute_ms(self, k: int, bucket: int, ctx_tokens: float) -> float:
        """Roofline: compute time (ms) of one verification step of ``bucket`` rows x ``k + 1`` query tokens
        over ``ctx_tokens`` context tokens (the busiest rank's sum)."""
        return (k + 1) * (FLOP_PER_TOKEN * bucket + ATTN_FLOP_PER_CTX * ctx_tokens) / self.rank_flop_per_ms

    def verify_ms(self, sm: StepModel, k: int, running: int, bucket: int, ctx_tokens: float) -> float:
        """One verification step (ms) at draft length ``k``, context ``ctx_tokens`` (busiest rank)."""
        if self.verify_model == "roofline":
            return max(sm.step_ms(bucket, ctx_tokens), sm.t0_ms + self.compute_ms(k, bucket, ctx_tokens)) \
                + self.drafter_ms
        if self.table is not None:
            return sm.step_ms(bucket, ctx_tokens) * interp_ratio(self.table, bucket, k, ctx_tokens / max(running, 1)) \
                + self.drafter_ms
        return sm.step_ms(bucket, ctx_tokens) + self.drafter_ms + self.token_ms * running * k

    def pick(self, sm: StepModel, running: int, bucket: int, ctx_tokens: float) -> tuple[int, float, float]:
        """(k, tokens per verification step, verification step ms) for a step of ``running`` requests."""
        table = self.tail if running <= self.tail_max else self.bulk
        ks = [self.fixed_k] if self.fixed_k else range(1, min(self.k_max, len(table)) + 1)
        best = (0, 1.0, 0.0)
        rate = -1.0
        for k in ks:
            tau = table[k - 1] * self.layout
            ms = self.verify_ms(sm, k, running, bucket, ctx_tokens)
            if tau / ms > rate:
                rate, best = tau / ms, (k, tau, ms)
        return best

    def segment_ms(self, sm: StepModel, nsteps: int, running: int, bucket: int, ctx_sum: float,
                   prefill_tokens: float, record: bool = True) -> float:
        """Time (ms) of ``nsteps`` engine steps (one token per request each) at ``running`` requests on the
        busiest rank (lockstep) or the rank (independent); ``ctx_sum`` = its context tokens summed over the steps;
        ``record``: count the steps in ``k_steps`` (False: a probe, as a step budget's search runs)."""
        k, tau, _ = self.pick(sm, running, bucket, ctx_sum / max(nsteps, 1))
        if record:
            self.k_steps[k] = self.k_steps.get(k, 0) + nsteps
        mem = nsteps * (sm.t0_ms + sm.per_seq_ms * bucket) + sm.per_kctx_ms * ctx_sum / 1000.0
        if self.verify_model == "roofline":  # segment sums of both sides (context grows within a segment)
            comp = nsteps * sm.t0_ms + (k + 1) * (FLOP_PER_TOKEN * bucket * nsteps + ATTN_FLOP_PER_CTX * ctx_sum) \
                / self.rank_flop_per_ms
            verify = max(mem, comp) + nsteps * self.drafter_ms
        elif self.table is not None:  # mean context per request over the segment
            ctx = ctx_sum / max(nsteps, 1) / max(running, 1)
            verify = mem * interp_ratio(self.table, bucket, k, ctx) + nsteps * self.drafter_ms
        else:
            verify = mem + nsteps * (self.drafter_ms + self.token_ms * running * k)
        return verify / tau + sm.per_prefill_ktok_ms * prefill_tokens / 1000.0


def parse_drafting(name: str) -> tuple[str, frozenset[str]]:
    """``BASE+mod+...`` -> (BASE, modifiers); SimError for an unknown base or modifier."""
    base, *mods = name.split("+")
    if base not in DRAFTING or base == "none":
        raise SimError(f"unknown drafting {name!r}: base must be sam_group or sam_group_exchange")
    bad = [m for m in mods if m not in MODIFIERS]
    if bad or not mods:
        raise SimError(f"unknown drafting modifier(s) {bad or mods} in {name!r} (choose from {', '.join(MODIFIERS)})")
    return base, frozenset(mods)


def draft_model(name: str, policy: str, drafting: Drafting, fixed_k: int = 3, k_max: int = 15,
                token_ms: float = VERIFY_TOKEN_MS, verify_model: str = "linear", mfu: float = MFU,
                siblings: int = 4, coverage: float = 1.0, table: StepTable | None = None,
                spread: bool | None = None, current: dict[tuple[str, str], tuple[float, ...]] | None = None
                ) -> DraftModel:
    """The model of drafting ``name`` (``BASE+mods``) under ``policy`` (spread layouts: data rebalance; ``spread``
    overrides the policy's layout); ``siblings`` 8: the no-history tables measured with 8 current siblings;
    ``coverage``: share of the requests with history (module docstring); ``table``: price verification steps by
    the measured step table (verify model "table"); ``current``: the no-history tables of a server placement
    (:func:`sibling_tables`, layout already in them; sam_group without history only)."""
    base, mods = parse_drafting(name)
    hist = "history" if "history" in mods else "current"
    if current is not None:
        if hist == "history" or base != "sam_group":
            raise SimError(f"{name}: server placements model sam_group without history (no exchange, no history)")
        return DraftModel(current[("current", "bulk")], current[("current", "tail")], 1.0,
                          None if "adaptive" in mods else fixed_k, k_max, token_ms, drafting.drafter_ms,
                          verify_model="table" if table is not None else verify_model, mfu=mfu, table=table)
    if not 1 <= fixed_k <= 15 or not 1 <= k_max <= 15:
        raise SimError("--fixed-k and --k-max must be in [1, 15] (the measured tables)")
    if siblings not in DRAFT_SIBLINGS:
        raise SimError(f"--draft-siblings must be one of {DRAFT_SIBLINGS} (the measured tables), got {siblings}")
    if not 0.0 <= coverage <= 1.0:
        raise SimError(f"--history-coverage must be in [0, 1], got {coverage}")
    cur = TPS_SIBLINGS8 if siblings == 8 else TPS
    tables = cur if hist == "current" else history_tables(coverage, cur)
    layout = drafting.together
    if (policy in SPREAD_POLICIES) if spread is None else spread:
        layout = drafting.exchange if base == "sam_group_exchange" else drafting.spread
    return DraftModel(tables[(hist, "bulk")], tables[(hist, "tail")], layout / drafting.together,
                      None if "adaptive" in mods else fixed_k, k_max, token_ms, drafting.drafter_ms,
                      verify_model="table" if table is not None else verify_model, mfu=mfu, table=table)


def placement_coverage(placement: str, dp: int, n: int, exchange: bool, prompts_per_step: float,
                       mean_response: float, *, responses: int = HISTORY_RESPONSES,
                       store_bytes: float = HISTORY_MAX_BYTES, epoch_steps: float = EPOCH_STEPS) -> float:
    """Share of requests whose rank holds their prompt's earlier responses at the prompt's next visit (one epoch
    later, shuffled), in [0, 1], weighted by how many of the table's ``responses`` it holds.

    ``placement`` of a prompt's ``n`` samples over ``dp`` ranks: "contiguous" (verl's chunks: one rank; default and
    rollout-rebalance policies), "interleaved" (data rebalance: row i on rank i mod dp, a prompt on min(n, dp)
    ranks), "keyed" (data rebalance by group key: a prompt on the same min(n, dp) ranks at every visit, unless its
    home was full) or "random" (fully-async dispatch by load: each sample on any rank). A request finds its history
    with the probability that its rank ran the prompt last time (1/dp, min(n, dp)/dp, :func:`keyed_home_share`,
    1 - (1 - 1/dp)^n); that rank
    holds all n responses with the exchange (or contiguous), else its own samples'. The store (``store_bytes`` per
    engine, ``TOKEN_BYTES`` per token, LRU) keeps ``store_bytes / bytes per step`` steps of the ``epoch_steps``
    after which the prompt returns. Product of the three, capped at 1."""
    if placement not in PLACEMENTS:
        raise SimError(f"unknown placement {placement!r} (choose from {', '.join(PLACEMENTS)})")
    if dp < 1 or n < 1 or prompts_per_step <= 0 or mean_response <= 0 or epoch_steps <= 0 or store_bytes < 0:
        raise SimError("placement_coverage: dp, n, prompts per step, mean response and epoch steps must be > 0")
    if placement == "contiguous":
        land, held, touched = 1.0 / dp, float(n), 1.0
    elif placement in ("interleaved", "keyed"):
        m = min(n, dp)
        land = m / dp if placement == "interleaved" else keyed_home_share(int(round(prompts_per_step)), n, dp)
        held, touched = float(n) if exchange else float(math.ceil(n / dp)), float(m)
    else:
        land = 1.0 - (1.0 - 1.0 / dp) ** n
        held, touched = (float(n) if exchange else (n / dp) / land), dp * land
    kept = min(held, float(responses))
    step_bytes = prompts_per_step * touched / dp * kept * mean_response * TOKEN_BYTES
    stored = min(1.0, store_bytes / step_bytes / epoch_steps)
    return min(1.0, land * kept / responses * stored)


def keyed_home_share(prompts: int, n: int, dp: int, trials: int = 4, seed: int = 0) -> float:
    """Share of rows data rebalance by group key puts on their home rank (``keyed_rank_of_rows``) for a step of
    ``prompts`` prompts of ``n`` samples over ``dp`` ranks, random keys, mean of ``trials`` draws; a prompt's next
    visit lands where its history is about this often (``sim/placement.py`` replays it: within 0.015)."""
    from qwen3_rl.rollout.data_rebalance import keyed_rank_of_rows

    if (prompts * n) % dp:  # the keyed layout needs whole ranks: the nearest batch that has them
        prompts = max(dp // math.gcd(n, dp), prompts - prompts % (dp // math.gcd(n, dp)))
    rng = np.random.default_rng(seed)
    shares = [keyed_rank_of_rows(rng.integers(0, np.iinfo(np.int64).max, prompts).astype(np.uint64), n, dp)[1].mean()
              for _ in range(trials)]
    return float(np.mean(shares))


def history_tables(coverage: float, current: dict[tuple[str, str], tuple[float, ...]] = TPS
                   ) -> dict[tuple[str, str], tuple[float, ...]]:
    """Tokens per request-step (k = 1..15, bulk and tail) when a share ``coverage`` of the requests drafts with
    history (``TPS`` history tables) and the rest without (``current``'s): the harmonic mean
    ``1 / (F / tau_history + (1 - F) / tau_current)`` per k (module docstring). ``coverage`` 1: ``TPS``'s."""
    if coverage == 1.0:
        return {part: TPS[part] for part in TPS if part[0] == "history"}
    out = {}
    for seg in ("bulk", "tail"):
        h, c = TPS[("history", seg)], current[("current", seg)]
        out[("history", seg)] = tuple(1.0 / (coverage / a + (1.0 - coverage) / b) for a, b in zip(h, c, strict=True))
    return out


def sibling_tables(siblings: np.ndarray, weights: np.ndarray, drafting: Drafting
                   ) -> dict[tuple[str, str], tuple[float, ...]]:
    """No-history tables (k = 1..15, bulk and tail) of a batch whose request ``i`` runs beside ``siblings[i]``
    samples of its prompt (itself included) on its engine, weighted by its tokens ``weights[i]``.

    Per sibling count ``s``, the measured tables: ``s`` = 4 ``TPS``, ``s`` = 8 ``TPS_SIBLINGS8``, ``s`` = 1 the
    8-sibling tables times ``Drafting.spread / together`` (the drafter bench's ratio of one sibling per engine to
    eight on one); linear in ``s`` between them, the 8-sibling tables above 8 (the corpus has no more). The batch's
    table is the token-weighted harmonic mean (a request of ``L`` tokens spends ``L / tau`` steps)."""
    s = np.asarray(siblings, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if s.shape != w.shape or s.size == 0 or (s < 1).any() or (w < 0).any() or w.sum() <= 0:
        raise SimError("sibling_tables: one sibling count >= 1 and one weight >= 0 per request, weights not all 0")
    ratio = drafting.spread / drafting.together
    out = {}
    for seg in ("bulk", "tail"):
        four = np.asarray(TPS[("current", seg)])
        eight = np.asarray(TPS_SIBLINGS8[("current", seg)])
        one = eight * ratio
        x = np.minimum(s, 8.0)[:, None]
        tau = np.where(x <= 4, one + (four - one) * (x - 1) / 3, four + (eight - four) * (x - 4) / 4)
        out[("current", seg)] = tuple(float(v) for v in w.sum() / (w[:, None] / tau).sum(axis=0))
    return out
