"""Rollout requests that speculative decoding can serve (preflight's checks).

vLLM 0.13 drafts nothing for a request whose sampling needs per-token extras: any penalty, ``min_p``
or (before patch vllm 0004) ``logprobs is not None`` (``vllm/v1/spec_decode/utils.py:9-17``; such requests go into
``InputBatch.spec_decode_unsupported_reqs``, ``vllm/v1/worker/gpu_input_batch.py:352-354``, which
vLLM-Ascend's ``NPUInputBatch`` inherits, and every model-free drafter skips them). verl 0.6.1's sync
rollout asks every request for ``logprobs=0`` (``vllm_rollout_spmd.py:265``) although it reads them
only when ``rollout.calculate_log_probs`` is on (``vllm_rollout_spmd.py:409-421``): with a drafter
on, nothing is drafted and speculative decoding is silently off.

Choice (verl 0007): with a drafter on, requests ask for no log-probs (``logprobs=None``) unless
``calculate_log_probs`` reads them; otherwise upstream's ``logprobs=0``. With both on, vLLM drafts the
log-prob requests only with patch vllm 0004 (stock vLLM 0.13: none), as the server rollout does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: vLLM 0.13 ``_SAMPLING_EPS`` (``vllm/v1/spec_decode/utils.py:6``).
SAMPLING_EPS = 1e-5


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    getter = getattr(obj, "get", None)
    if callable(getter):
        return getter(key, default)
    return getattr(obj, key, default)


def speculative_method(rollout_config: Any) -> str | None:
    """The drafter method in ``rollout.engine_kwargs.vllm.speculative_config`` (None = no drafter)."""
    spec = _get(_get(_get(rollout_config, "engine_kwargs"), "vllm"), "speculative_config")
    method = _get(spec, "method")
    return None if method is None else str(method)


def unsupported_reasons(sampling: Mapping[str, Any]) -> list[str]:
    """Why vLLM 0.13 with our patches would draft nothing for requests with these sampling settings (empty =
    supported; log-probs are drafted since vllm 0004).

    ``sampling``: SamplingParams-style keys (``repetition_penalty``, ``frequency_penalty``,
    ``presence_penalty``, ``min_p``); missing keys take vLLM's defaults.
    """
    out = []
    for key, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
        v = sampling.get(key)
        if v is not None and float(v) != neutral:
            out.append(f"{key}={v} (must be {neutral})")
    min_p = sampling.get("min_p")
    if min_p is not None and float(min_p) > SAMPLING_EPS:
        out.append(f"min_p={min_p} (must be 0)")
    return out
