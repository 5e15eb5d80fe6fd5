"""Verification steps of SAM drafting in the lockstep rollout simulator: per-step k, history, token cost.

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
Rebalance intervals stay in engine steps (tokens), not verification steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwen3_rl.sim.simulate import DRAFTING, SPREAD_POLICIES, Drafting, SimError, StepModel

#: Tokens per verification step at fixed k = 1..15 (bonus included), ``python -m qwen3_rl.bench.drafters
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
TAIL_MAX = 8  # running requests per rank at or below which the tail figures apply
VERIFY_TOKEN_MS = 0.0585
MODIFIERS = ("verify", "history", "adaptive")


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

    def pick(self, sm: StepModel, running: int, bucket: int, ctx_tokens: float) -> tuple[int, float, float]:
        """(k, tokens per verification step, verification step ms) for a step of ``running`` requests."""
        table = self.tail if running <= self.tail_max else self.bulk
        ks = [self.fixed_k] if self.fixed_k else range(1, min(self.k_max, len(table)) + 1)
        best = (0, 1.0, 0.0)
        rate = -1.0
        for k in ks:
            tau = table[k - 1] * self.layout
            ms = sm.step_ms(bucket, ctx_tokens) + self.drafter_ms + self.token_ms * running * k
            if tau / ms > rate:
                rate, best = tau / ms, (k, tau, ms)
        return best

    def segment_ms(self, sm: StepModel, nsteps: int, running: int, bucket: int, ctx_sum: float,
                   prefill_tokens: float) -> float:
        """Time (ms) of ``nsteps`` engine steps (one token per request each) at ``running`` requests on the
        busiest rank; ``ctx_sum`` = its context tokens summed over the steps."""
        k, tau, _ = self.pick(sm, running, bucket, ctx_sum / max(nsteps, 1))
        self.k_steps[k] = self.k_steps.get(k, 0) + nsteps
        verify = nsteps * (sm.t0_ms + sm.per_seq_ms * bucket + self.drafter_ms + self.token_ms * running * k) \
            + sm.per_kctx_ms * ctx_sum / 1000.0
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
                token_ms: float = VERIFY_TOKEN_MS) -> DraftModel:
    """The model of drafting ``name`` (``BASE+mods``) under ``policy`` (spread layouts: data rebalance)."""
    base, mods = parse_drafting(name)
    hist = "history" if "history" in mods else "current"
    if not 1 <= fixed_k <= 15 or not 1 <= k_max <= 15:
        raise SimError("--fixed-k and --k-max must be in [1, 15] (the measured tables)")
    layout = drafting.together
    if policy in SPREAD_POLICIES:
        layout = drafting.exchange if base == "sam_group_exchange" else drafting.spread
    return DraftModel(TPS[(hist, "bulk")], TPS[(hist, "tail")], layout / drafting.together,
                      None if "adaptive" in mods else fixed_k, k_max, token_ms, drafting.drafter_ms)
