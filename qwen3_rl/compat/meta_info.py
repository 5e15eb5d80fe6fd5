"""Merging ``DataProto.meta_info`` values from several workers (used by ``DataProto.concat``).

verl 0.6.1 (``verl/protocol.py``, ``DataProto.concat``) asserts that every overlapping non-metric
``meta_info`` key is *exactly* equal across workers. ``meta_info['timing']`` is a dict of seconds
that each rollout worker fills after an ``all_reduce(AVG)`` of its own timers; on HCCL the
averaged floats can differ in the last bits between ranks, so concat fails with
``AssertionError: Conflicting values for meta_info key 'timing'``.

Rule: keys listed in :data:`TOLERANT_KEYS` are merged with their merge function; every other key
keeps upstream's behaviour (equal or ``AssertionError``). Besides ``timing``: the rollout's
speculative-decoding counts (``qwen3_rl.spec_decode.metrics.META_KEY``, verl 0013), one record
per engine, are summed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

from qwen3_rl.spec_decode.metrics import META_KEY as SPEC_DECODE_KEY
from qwen3_rl.spec_decode.metrics import merge_counts


def merge_timing(a: Any, b: Any) -> Any:
    """Merge two timing records (seconds) reported by different workers.

    * numbers: the larger one -- a distributed step ends when its slowest worker ends, and for the
      (normal) case of values equal up to float noise this is the same value;
    * mappings: union of keys, values merged recursively (a key only one worker reports is kept);
    * anything else: must be equal, else ``AssertionError``.

    The merge is commutative and associative, so the result does not depend on worker order.
    """
    if isinstance(a, Real) and isinstance(b, Real) and not isinstance(a, bool) and not isinstance(b, bool):
        return max(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = dict(a)
        for k, v in b.items():
            out[k] = merge_timing(out[k], v) if k in out else v
        return out
    assert a == b, f"Conflicting timing values {a!r} and {b!r}"
    return a


# meta_info key -> merge function for values that legitimately differ between workers.
TOLERANT_KEYS: dict[str, Callable[[Any, Any], Any]] = {"timing": merge_timing, SPEC_DECODE_KEY: merge_counts}


def merge_meta_value(key: str, current: Any, new: Any) -> Any:
    """Merged value of ``meta_info[key]`` when two workers both report it.

    Args:
        key: the meta_info key.
        current: value merged so far.
        new: value from the next worker.

    Returns:
        The merged value (for keys outside :data:`TOLERANT_KEYS`: ``current``, which equals ``new``).

    Raises:
        AssertionError: a non-tolerant key has different values (upstream's message).
    """
    merge = TOLERANT_KEYS.get(key)
    if merge is not None:
        return merge(current, new)
    assert current == new, f"Conflicting values for meta_info key '{key}'"
    return current
