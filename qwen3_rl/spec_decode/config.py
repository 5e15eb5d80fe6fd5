"""Validation of ``speculative_config={"method": "sam", ...}`` for vLLM 0.13 (the "sam" entry of vLLM's drafter
registry, ``vllm.plugins.extensions``, registered by :mod:`qwen3_rl.vllm_plugin`).

User-facing form (``LLM(speculative_config=...)``, verl ``rollout.engine_kwargs.vllm.speculative_config``)::

    {"method": "sam",
     "num_speculative_tokens": 3,              # k, 1 <= k <= 128 (vLLM's rejection-sampler limit)
     "disable_by_batch_size": 64,              # optional: drafting off while running requests > 64
     "sam_config": {"group_mode": True, ...}}  # optional: SAM drafter options, keys of SAM_OPTIONS

The drafter's configuration is one ``sam.SamConfig`` (k + the ``sam_config`` options).

Everything here is pure Python (no vLLM import) so it can be unit-tested alone. vLLM's seam moves
``sam_config`` into ``SpeculativeConfig.drafter_config`` (the registry entry's ``options_key``) and refuses it
with another method, then calls ``check_sam_keys`` from its ``mode="before"`` validator (pydantic drops unknown
keyword arguments of ``SpeculativeConfig`` silently, so a misspelled option would otherwise vanish) and
``validate_sam_speculative_config`` from ``SpeculativeConfig.__post_init__``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from qwen3_rl.spec_decode.cost_table import CostTable, CostTableError, load_cost_table
from qwen3_rl.spec_decode.sam import SamConfig

METHOD = "sam"
#: vLLM 0.13 ``vllm/v1/sample/rejection_sampler.py:26`` (``MAX_SPEC_LEN = 128``).
MAX_SPECULATIVE_TOKENS = 128

#: ``SpeculativeConfig`` keys used by ``method="sam"``; any other field must keep its default.
SAM_TOP_LEVEL_KEYS = frozenset({
    "method", "num_speculative_tokens", "drafter_config", "disable_by_batch_size", "enforce_eager",
    # filled in by vLLM itself (EngineArgs.create_speculative_config, __post_init__)
    "target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config", "model",
})


#: Keys of ``speculative_config["sam_config"]``: the fields of ``SamConfig`` but k (a top-level key).
SAM_OPTIONS = tuple(f.name for f in fields(SamConfig) if f.name != "num_speculative_tokens")
_BOOL_OPTIONS = frozenset({"group_mode", "pad_drafts", "group_exchange", "adaptive_k"})
_FLOAT_OPTIONS = frozenset({"verify_base_ms", "verify_seq_ms", "verify_token_ms", "verify_kctx_ms"})
_STR_OPTIONS = frozenset({"rule", "cost_table"})
#: ``sam_config`` key of the batch-size threshold on the current set, whose ``SpeculativeConfig`` (vLLM 0.23) has no
#: ``disable_by_batch_size``; read by the runner's gate (``bs_threshold.BatchSizeGate``), not by the drafter
GATE_OPTION = "disable_by_batch_size"


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


def split_gate_option(raw: Any) -> tuple[Any, Any]:
    """``raw`` (a ``sam_config``) without :data:`GATE_OPTION`, and that option's value (None when absent).

    Anything but a mapping comes back as it is (``parse_sam_options`` refuses it).
    """
    if not isinstance(raw, Mapping) or GATE_OPTION not in raw:
        return raw, None
    return {k: v for k, v in raw.items() if k != GATE_OPTION}, raw[GATE_OPTION]


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


def parse_sam_options(raw: Mapping[str, Any] | None, k: int = SamConfig.num_speculative_tokens) -> SamConfig:
    """The drafter's config from ``sam_config`` (None = defaults) and ``k`` speculative tokens.

    Unknown keys, wrong types and out-of-range values raise ``ValueError`` naming the key.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"speculative_config.sam_config must be a mapping, got {type(raw).__name__}")
    bad = _unknown(raw, SAM_OPTIONS)
    if bad:
        raise ValueError(f"speculative_config.sam_config: unknown option(s) {bad}; accepted: {list(SAM_OPTIONS)}")
    for key, val in raw.items():
        want = bool if key in _BOOL_OPTIONS else str if key in _STR_OPTIONS else float if key in _FLOAT_OPTIONS else int
        ok = (isinstance(val, (int, float)) and not isinstance(val, bool)) if want is float else (
            isinstance(val, want) and (want is bool or not isinstance(val, bool)))
        if not ok:
            raise ValueError(f"speculative_config.sam_config.{key} must be {want.__name__}, got {val!r}")
    try:
        cfg = SamConfig(num_speculative_tokens=k, **dict(raw))
    except ValueError as exc:  # SamConfig's range checks
        raise ValueError(f"speculative_config.sam_config: {exc}") from None
    if cfg.cost_table:
        table_for(cfg)  # the file must exist, parse and reach k_max
    return cfg


def table_for(cfg: SamConfig) -> CostTable | None:
    """The measured cost table ``cfg.cost_table`` names (None when empty); ``ValueError`` (one line) when the file
    is missing or malformed, names no single shape, or measures no draft as long as k_max."""
    if not cfg.cost_table:
        return None
    try:
        table = load_cost_table(cfg.cost_table)
    except CostTableError as exc:
        raise ValueError(f"speculative_config.sam_config.cost_table: {exc}") from None
    if table.k_max < cfg.num_speculative_tokens:
        raise ValueError(f"speculative_config.sam_config.cost_table: {cfg.cost_table} measures k <= {table.k_max}, "
                         f"below num_speculative_tokens = {cfg.num_speculative_tokens} (the longest draft)")
    return table


def validate_sam_speculative_config(spec: Any) -> SamConfig:
    """Validate a vLLM ``SpeculativeConfig`` whose ``method`` is "sam"; returns the drafter's config.

    Checks k (``num_speculative_tokens``), ``sam_config`` and that no draft model is given.
    Raises ``ValueError`` with a message naming the bad key.
    """
    if getattr(spec, "method", None) != METHOD:
        raise ValueError(f"not a SAM speculative config: method={getattr(spec, 'method', None)!r}")
    k = check_num_speculative_tokens(getattr(spec, "num_speculative_tokens", None))
    model = getattr(spec, "model", None)
    if model not in (None, METHOD):
        raise ValueError(f"method='sam' is model-free: drop model={model!r}")
    try:
        return parse_sam_options(getattr(spec, "drafter_config", None), k)
    except ValueError as exc:
        raise ValueError(str(exc)) from None


def config_from_vllm_config(vllm_config: Any) -> SamConfig:
    """The drafter's config (k included) from a ``VllmConfig`` whose speculative method is "sam".

    ``speculative_config.disable_by_batch_size`` is not part of it: the runner's ``BatchSizeGate`` reads it
    (``bs_threshold.BatchSizeGate.from_vllm_config``).
    """
    return validate_sam_speculative_config(vllm_config.speculative_config)
