"""vLLM's speculative-decoding counters per rollout, as verl step metrics (verl patch 0013).

Is drafting on? vLLM 0.13 counts, per engine, the drafts it verified and the draft tokens it accepted:
Prometheus counters ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens`` and
``vllm:spec_decode_num_accepted_tokens`` (``vllm/v1/spec_decode/metrics.py:153-178``, class
``SpecDecodingProm``, one labelled child per engine). ``LLM.get_metrics()`` returns them as
``vllm.v1.metrics.reader.Counter`` objects (``name`` without ``_total``, ``labels``, ``value: int``;
``vllm/v1/metrics/reader.py:25-29, 96-114``). They exist only

* with a drafter (``SpecDecodingProm`` registers nothing without a ``speculative_config``, ``:149-151``), and
* with stat logging on: ``LLM(disable_log_stats=False)``, in verl ``actor_rollout_ref.rollout.disable_log_stats``
  (verl's default ``True``; the train scripts set ``False`` with ``SAM_ENABLE=True``). With it off
  ``LLM.get_metrics()`` asserts (``vllm/v1/engine/llm_engine.py:353-355``): this module then reports
  nothing and says so once per process in a log warning.

Flow:

1. verl's sync rollout (``vLLMRollout.generate_sequences``, verl 0013) reads the counters before and after
   its ``generate`` call (:class:`RolloutProbe`, only while ``speculative_config.method`` is set) and puts
   the difference into its output's ``meta_info[META_KEY]``: raw counts
   ``{"num_drafts", "num_draft_tokens", "num_accepted_tokens"}`` of this process's engine.
2. verl collects one output per rollout DP rank (TP rank 0 of each engine; the other TP ranks of an engine
   run the same schedule and are not collected) and joins them with ``DataProto.concat``, whose meta_info
   merge (verl 0002 -> :mod:`qwen3_rl.compat.meta_info`) **sums** these counts: the step reports all
   engines together (the 235B setups: the 32 vLLM DP engines; the 32B setups: the independent TP8 engines).
3. The trainer pops them (:func:`pop_step_metrics`; our DAPO trainer sums its generation batches first,
   :func:`add_counts`) into the step's metrics, so verl's step line carries ``rollout/spec_decode/*``.

Ratios are taken from the summed counts (not averaged per engine): ``acceptance_rate`` =
accepted / drafted tokens, ``mean_acceptance_length`` = 1 + accepted / drafts (vLLM's own definition,
bonus token included, ``vllm/v1/spec_decode/metrics.py:94``). Each is left out when its denominator is
0: a step that drafted nothing shows ``draft_tokens:0`` and no rate.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from qwen3_rl.spec_decode.requests import speculative_method

logger = logging.getLogger(__name__)

#: ``DataProto.meta_info`` key of the rollout's raw counts (summed across workers by ``DataProto.concat``).
META_KEY = "spec_decode_counts"
#: vLLM counter name -> our count name.
COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
#: Prefix of the step metrics.
PREFIX = "rollout/spec_decode/"
NUM_DRAFTS = PREFIX + "num_drafts"
DRAFT_TOKENS = PREFIX + "draft_tokens"
ACCEPTED_TOKENS = PREFIX + "accepted_tokens"
ACCEPTANCE_RATE = PREFIX + "acceptance_rate"
MEAN_ACCEPTANCE_LENGTH = PREFIX + "mean_acceptance_length"

STATS_DISABLED = (
    "speculative decoding is on but vLLM's stat logging is off (rollout.disable_log_stats=True): vLLM keeps no "
    "spec-decode counters, so no rollout/spec_decode/* metrics are logged; set "
    "actor_rollout_ref.rollout.disable_log_stats=False to see the acceptance rate"
)

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def read_counters(metrics: Iterable[Any]) -> dict[str, int]:
    """Our counts from ``LLM.get_metrics()`` items (anything with ``name`` and ``value``).

    Counters of the same name (one per engine label) are summed; a counter vLLM did not register
    counts 0, so the result always has the three keys of :data:`COUNTERS`.
    """
    out = dict.fromkeys(COUNTERS.values(), 0)
    for m in metrics:
        key = COUNTERS.get(getattr(m, "name", None))
        if key is not None:
            out[key] += int(getattr(m, "value", 0) or 0)
    return out


def counter_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """``after - before`` per count. A counter that went down was reset in between (vLLM re-registers
    its metrics when an engine is built): then everything it shows now accrued since, i.e. ``after``."""
    out = {}
    for k, a in after.items():
        b = before.get(k, 0)
        out[k] = a - b if a >= b else a
    return out


def merge_counts(a: Mapping[str, int] | None, b: Mapping[str, int] | None) -> dict[str, int]:
    """Sum of two count records (union of keys); a new dict, inputs untouched. Commutative and
    associative, so ``DataProto.concat`` gives the same total in any worker order."""
    out = dict(a or {})
    for k, v in (b or {}).items():
        out[k] = out.get(k, 0) + v
    return out


def step_metrics(counts: Mapping[str, int] | None) -> dict[str, float]:
    """The ``rollout/spec_decode/*`` metrics of one step's counts ({} for none)."""
    if not counts:
        return {}
    drafts = int(counts.get("num_drafts", 0))
    drafted = int(counts.get("num_draft_tokens", 0))
    accepted = int(counts.get("num_accepted_tokens", 0))
    out: dict[str, float] = {NUM_DRAFTS: drafts, DRAFT_TOKENS: drafted, ACCEPTED_TOKENS: accepted}
    if drafted > 0:
        out[ACCEPTANCE_RATE] = accepted / drafted
    if drafts > 0:
        out[MEAN_ACCEPTANCE_LENGTH] = 1.0 + accepted / drafts
    return out


def pop_step_metrics(meta_info: MutableMapping[str, Any]) -> dict[str, float]:
    """Remove the rollout's counts from a generation output's ``meta_info``; their step metrics ({} if
    the rollout reported none: no drafter, stats off, or the async rollout)."""
    return step_metrics(meta_info.pop(META_KEY, None))


def add_counts(into: MutableMapping[str, int], meta_info: MutableMapping[str, Any]) -> None:
    """Remove the rollout's counts from ``meta_info`` and add them to ``into`` (several generation
    batches in one step)."""
    counts = meta_info.pop(META_KEY, None)
    if counts:
        into.update(merge_counts(into, counts))


def read_llm_counters(llm: Any) -> dict[str, int] | None:
    """The counts of a ``vllm.LLM`` now; None (warned once) when its stat logging is off."""
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and getattr(engine, "log_stats", True) is False:
        _warn_once(STATS_DISABLED)
        return None
    try:
        metrics = llm.get_metrics()
    except AssertionError:  # "Stat logging disabled" (vllm/v1/engine/llm_engine.py:354)
        _warn_once(STATS_DISABLED)
        return None
    return read_counters(metrics)


class RolloutProbe:
    """The counts one rollout call accrues: build it right before ``generate``, :meth:`finish` after.

    Acts only while a drafter is on (``rollout.engine_kwargs.vllm.speculative_config.method`` set); else it
    reads nothing and :meth:`finish` returns {}.
    """

    def __init__(self, rollout_config: Any, llm: Any) -> None:
        self.llm = llm
        self.before: dict[str, int] | None = None
        if speculative_method(rollout_config) is not None:
            self.before = read_llm_counters(llm)

    def finish(self) -> dict[str, int]:
        """Counts accrued since construction ({} without a drafter or with stats off)."""
        if self.before is None:
            return {}
        after = read_llm_counters(self.llm)
        return {} if after is None else counter_delta(self.before, after)
