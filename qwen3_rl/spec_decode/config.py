"""Validation of ``speculative_config={"method": "sam", ...}`` for vLLM 0.13 (called by vllm patch 0003).

User-facing form (``LLM(speculative_config=...)``, verl ``rollout.engine_kwargs.vllm.speculative_config``)::

    {"method": "sam",
     "num_speculative_tokens": 3,              # k, 1 <= k <= 128 (vLLM's rejection-sampler limit)
     "disable_by_batch_size": 64,              # optional: drafting off while running requests > 64
     "sam_config": {"group_mode": True, ...}}  # optional: SAM drafter options, keys of SAM_OPTIONS

Everything here is pure Python (no vLLM import) so it can be unit-tested alone. The vLLM patch calls
``check_sam_keys`` from a ``mode="before"`` validator (pydantic drops unknown keyword arguments of
``SpeculativeConfig`` silently, so a misspelled option would otherwise vanish) and
``validate_sam_speculative_config`` from ``SpeculativeConfig.__post_init__``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from qwen3_rl.spec_decode.sam import SamConfig

METHOD = "sam"
#: vLLM 0.13 ``vllm/v1/sample/rejection_sampler.py:26`` (``MAX_SPEC_LEN = 128``).
MAX_SPECULATIVE_TOKENS = 128

#: ``SpeculativeConfig`` keys used by ``method="sam"``; any other field must keep its default.
SAM_TOP_LEVEL_KEYS = frozenset({
    "method", "num_speculative_tokens", "sam_config", "disable_by_batch_size", "enforce_eager",
    # filled in by vLLM itself (EngineArgs.create_speculative_config, __post_init__)
    "target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config", "model",
})


@dataclass(frozen=True)
class SamOptions:
    """Options of ``speculative_config["sam_config"]`` (all optional; defaults = ``SamConfig``'s).

    Attributes:
        group_mode: GRPO samples of one prompt (same prompt token ids) share one automaton, and
            finished responses enter a bounded cache (docs/sam_decoding.md).
        rule: "recent" or "earliest" occurrence as the continuation.
        recent_budget: suffix-link ancestors re-pointed per appended token (rule "recent").
        min_match: shortest suffix match (tokens) that may draft.
        cache_max_responses: responses kept when the cache is rebuilt; it holds at most
            min(2 x this, 127) (0..127, 0 = no cache).
        cache_max_tokens: tokens kept when the cache is rebuilt; it holds at most 2 x this.
        resync: tokens re-fed to a request's cache pointer after the cache was rebuilt.
        pad_drafts: pad every draft to exactly k tokens (repeating its last token) so that each
            pure-decode step has query length 1 + k, the only shape a FULL_DECODE_ONLY graph
            (needed by npugraph_ex) replays; padded tokens are verified like any draft token.
        group_exchange: share the siblings' accepted tokens among the vLLM DP ranks (group mode
            across ranks when data rebalance spreads a prompt's samples; needs group_mode and vLLM DP > 1;
            qwen3_rl/spec_decode/sibling_exchange.py).
        exchange_every: engine steps between two exchanges (>= 1).
        exchange_max_bytes: cap of one rank's message per exchange (bytes, >= 24; the oldest tokens of the
            longest pending ranges are dropped first).
        exchange_max_siblings: remote siblings a rank keeps per group (shadow strings; 0 = all). Each kept
            sibling costs its whole text in host memory and its new tokens in every merge; 7 = the measured
            configuration (8 samples per prompt, docs/sam_decoding.md).
        exchange_max_shadow_tokens: bound of the tokens a rank holds in shadow strings (beyond it, remote
            tokens are skipped).
    """

    group_mode: bool = False
    rule: str = "recent"
    recent_budget: int = 1
    min_match: int = 1
    cache_max_responses: int = 64
    cache_max_tokens: int = 131072
    resync: int = 32
    pad_drafts: bool = False
    group_exchange: bool = False
    exchange_every: int = 1
    exchange_max_bytes: int = 16384
    exchange_max_siblings: int = 7
    exchange_max_shadow_tokens: int = 1 << 25

    def sam_config(self, k: int) -> SamConfig:
        """The drafter's config for ``k`` speculative tokens."""
        return SamConfig(num_speculative_tokens=k, rule=self.rule, recent_budget=self.recent_budget,
                         min_match=self.min_match, group_mode=self.group_mode,
                         cache_max_responses=self.cache_max_responses,
                         cache_max_tokens=self.cache_max_tokens, resync=self.resync)


SAM_OPTIONS = tuple(f.name for f in fields(SamOptions))
_BOOL_OPTIONS = frozenset({"group_mode", "pad_drafts", "group_exchange"})


def _unknown(keys: Iterable[str], known: Iterable[str]) -> list[str]:
    known = set(known)
    return sorted(k for k in keys if k not in known)


def _field_defaults(cls: type) -> dict[str, Any]:
    """Field name -> default of a (pydantic) dataclass; ``_MISSING`` where there is none."""
    pyd = getattr(cls, "__pydantic_fields__", None)
    if pyd is not None:
        return {name: info.default for name, info in pyd.items()}
    return {f.name: f.default for f in fields(cls)}


def check_sam_keys(cls: type, data: Any) -> Any:
    """Reject, for ``method == "sam"``, keys that are no field of ``cls`` (pydantic drops them
    silently, so a misspelled option would vanish) and options of other methods set to a value
    other than their default (they would be ignored).

    Args:
        cls: vLLM's ``SpeculativeConfig``.
        data: its raw input (a mapping, or pydantic's ``ArgsKwargs`` with ``.kwargs``).
    Returns:
        ``data`` unchanged.
    Raises:
        ValueError: naming the offending keys and the accepted ones.
    """
    kwargs = data if isinstance(data, Mapping) else getattr(data, "kwargs", None)
    if not isinstance(kwargs, Mapping) or kwargs.get("method") != METHOD:
        return data
    defaults = _field_defaults(cls)
    accepted = sorted(SAM_TOP_LEVEL_KEYS - {"target_model_config", "target_parallel_config", "draft_model_config",
                                            "draft_parallel_config", "model"})
    unknown = _unknown(kwargs, defaults)
    if unknown:
        raise ValueError(f"speculative_config for method='sam': unknown option(s) {unknown}; accepted: {accepted}"
                         f" and inside 'sam_config': {list(SAM_OPTIONS)}")
    foreign = sorted(k for k, v in kwargs.items() if k not in SAM_TOP_LEVEL_KEYS and v != defaults[k])
    if foreign:
        raise ValueError(f"speculative_config option(s) {foreign} are not used by method='sam'; accepted: {accepted}"
                         f" and inside 'sam_config': {list(SAM_OPTIONS)}")
    return data


def check_num_speculative_tokens(k: Any) -> int:
    """``k`` must be an int in [1, MAX_SPECULATIVE_TOKENS]; returns it."""
    if k is None:
        raise ValueError("speculative_config method='sam' needs num_speculative_tokens (an int >= 1)")
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"num_speculative_tokens must be an int, got {k!r}")
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] for method='sam', "
                         f"got {k}")
    return k


def parse_sam_options(raw: Mapping[str, Any] | None) -> SamOptions:
    """Validate ``sam_config`` (None = defaults); unknown keys and wrong types raise ``ValueError``."""
    if raw is None:
        return SamOptions()
    if not isinstance(raw, Mapping):
        raise ValueError(f"speculative_config.sam_config must be a mapping, got {type(raw).__name__}")
    bad = _unknown(raw, SAM_OPTIONS)
    if bad:
        raise ValueError(f"speculative_config.sam_config: unknown option(s) {bad}; accepted: {list(SAM_OPTIONS)}")
    for key, val in raw.items():
        want = bool if key in _BOOL_OPTIONS else str if key == "rule" else int
        ok = isinstance(val, want) and (want is bool or not isinstance(val, bool))
        if not ok:
            raise ValueError(f"speculative_config.sam_config.{key} must be {want.__name__}, got {val!r}")
    opts = SamOptions(**dict(raw))
    opts.sam_config(1)  # SamConfig's own range checks (rule, budgets, cache sizes)
    if opts.group_exchange and not opts.group_mode:
        raise ValueError("speculative_config.sam_config.group_exchange=True needs group_mode=True (the exchange "
                         "feeds the siblings' tokens into the group automata)")
    if opts.exchange_every < 1:
        raise ValueError(f"speculative_config.sam_config.exchange_every must be >= 1, got {opts.exchange_every}")
    if opts.exchange_max_siblings < 0 or opts.exchange_max_shadow_tokens < 0:
        raise ValueError("speculative_config.sam_config.exchange_max_siblings and exchange_max_shadow_tokens must "
                         "be >= 0")
    if opts.exchange_max_bytes < 24:
        raise ValueError(f"speculative_config.sam_config.exchange_max_bytes must be >= 24, got "
                         f"{opts.exchange_max_bytes}")
    return opts


def validate_sam_speculative_config(spec: Any) -> SamOptions:
    """Validate a vLLM ``SpeculativeConfig`` whose ``method`` is "sam"; returns the parsed options.

    Checks k (``num_speculative_tokens``), ``sam_config`` and that no draft model is given.
    Raises ``ValueError`` with a message naming the bad key.
    """
    if getattr(spec, "method", None) != METHOD:
        raise ValueError(f"not a SAM speculative config: method={getattr(spec, 'method', None)!r}")
    check_num_speculative_tokens(getattr(spec, "num_speculative_tokens", None))
    model = getattr(spec, "model", None)
    if model not in (None, METHOD):
        raise ValueError(f"method='sam' is model-free: drop model={model!r}")
    try:
        return parse_sam_options(getattr(spec, "sam_config", None))
    except ValueError as exc:
        raise ValueError(str(exc)) from None


def reject_sam_config_for_other_methods(spec: Any) -> None:
    """``sam_config`` given with another method is a mistake (it would be ignored): raise."""
    if getattr(spec, "sam_config", None) is not None and getattr(spec, "method", None) != METHOD:
        raise ValueError(f"speculative_config.sam_config is only used with method='sam' "
                         f"(method={getattr(spec, 'method', None)!r})")


def options_from_vllm_config(vllm_config: Any) -> tuple[int, SamOptions, int | None]:
    """(k, SAM options, batch-size threshold or None) from a ``VllmConfig`` with method "sam"."""
    spec = vllm_config.speculative_config
    opts = validate_sam_speculative_config(spec)
    return int(spec.num_speculative_tokens), opts, getattr(spec, "disable_by_batch_size", None)
