"""Rollout length files for the simulator: reading, validation, and a reference-like generator.

File format: JSON lines, one object per sample, ``{"prompt_id", "sample_id", "prompt_len",
"response_len"}``, prompts in dataset order and the n samples of a prompt adjacent (the layout of
verl's ``repeat(interleave=True)``), every prompt with the same n.

Generator (``python -m qwen3_rl simulate gen-lengths``): two-level lognormal. For prompt ``g`` a
group median ``m_g = exp(mu + sigma_group * z_g)``; its samples ``m_g * exp(sigma_within * z_gs)``,
``z`` standard normal, rounded and clipped to ``[1, max_response]`` (a clipped sample is a response
truncated at the length limit).

How the spreads were chosen, once, from [ref 002 §1.3] (GBS 512, n 16, mean response
7344.97 tokens, max response 32768) — never tuned on the simulator's idle figures:

* total log-spread: the 32K limit is taken as the 99th percentile of the unclipped lengths (about
  1 % of responses truncated). For a lognormal with mean ``M``, ``ln(cap / M) = z99*s - s^2/2``, so
  ``s = z99 - sqrt(z99^2 - 2 ln(cap / M)) = 0.770`` for ``M = 7345``, ``cap = 32768``.
* split: [ref 002 §3.1] states that the samples of one prompt have correlated lengths, without a
  figure; we split the log-variance equally (intra-prompt correlation 0.5):
  ``sigma_group = sigma_within = s / sqrt(2) = 0.545``.
* ``mu`` is then solved so that the mean after clipping is 7345; prompt lengths are lognormal with
  mean 73.7 (the mean input of [ref 002 §1.3]) and log-spread 0.3 (prompt length barely matters for decode).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# the Qwen3-235B 32K GRPO run of [ref 002 §1.3] (docs/references.md)
REF_NUM_PROMPTS = 512
REF_N = 16
REF_DP = 32
REF_MAX_RESPONSE = 32768
REF_MEAN_RESPONSE = 7344.97
REF_MEAN_PROMPT = 73.7
CAP_QUANTILE = 0.99
INTRA_PROMPT_CORRELATION = 0.5
PROMPT_SIGMA = 0.3
_Z99 = 2.3263478740408408  # standard normal 99th percentile


class LengthsError(ValueError):
    """A lengths file is missing, malformed, or not in the expected layout."""


@dataclass(frozen=True)
class Lengths:
    """Per-sample lengths in dataset order: ``prompt_len``/``response_len`` shape ``(num_prompts * n,)`` int64."""

    num_prompts: int
    n: int
    prompt_len: np.ndarray
    response_len: np.ndarray

    @property
    def size(self) -> int:
        """Number of samples B = num_prompts * n."""
        return int(self.response_len.shape[0])


def total_log_sigma(mean: float = REF_MEAN_RESPONSE, cap: float = REF_MAX_RESPONSE, z: float = _Z99) -> float:
    """Log-spread ``s`` of a lognormal with the given mean whose ``z`` quantile sits at ``cap``."""
    r = math.log(cap / mean)
    disc = z * z - 2.0 * r
    if disc < 0:
        raise ValueError(f"no lognormal has mean {mean} with its z={z} quantile at {cap}")
    return z - math.sqrt(disc)


def default_spreads() -> tuple[float, float]:
    """``(sigma_group, sigma_within)`` chosen from the reference statistics (see module docstring)."""
    s = total_log_sigma()
    return s * math.sqrt(INTRA_PROMPT_CORRELATION), s * math.sqrt(1.0 - INTRA_PROMPT_CORRELATION)


def clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """``E[min(X, cap)]`` for ``ln X ~ N(mu, sigma^2)``."""
    if sigma <= 0:
        return min(math.exp(mu), cap)
    lc = math.log(cap)

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    return math.exp(mu + sigma * sigma / 2) * phi((lc - mu - sigma * sigma) / sigma) + cap * (
        1.0 - phi((lc - mu) / sigma)
    )


def solve_mu(mean: float, sigma: float, cap: float) -> float:
    """``mu`` such that the lognormal(mu, sigma) clipped at ``cap`` has the given mean (bisection)."""
    if not 0 < mean < cap:
        raise ValueError(f"mean {mean} must lie in (0, cap={cap})")
    lo, hi = math.log(mean) - 10 * sigma - 10, math.log(cap) + 10 * sigma + 10
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if clipped_lognormal_mean(mid, sigma, cap) < mean:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def generate_lengths(
    num_prompts: int = REF_NUM_PROMPTS,
    n: int = REF_N,
    *,
    mean_response: float = REF_MEAN_RESPONSE,
    max_response: int = REF_MAX_RESPONSE,
    sigma_group: float | None = None,
    sigma_within: float | None = None,
    mean_prompt: float = REF_MEAN_PROMPT,
    prompt_sigma: float = PROMPT_SIGMA,
    seed: int = 0,
) -> Lengths:
    """Draw reference-like lengths (two-level lognormal, see module docstring). Deterministic in ``seed``."""
    if num_prompts < 1 or n < 1:
        raise ValueError("num_prompts and n must be >= 1")
    if max_response < 1:
        raise ValueError("max_response must be >= 1")
    dg, dw = default_spreads()
    sg = dg if sigma_group is None else sigma_group
    sw = dw if sigma_within is None else sigma_within
    if sg < 0 or sw < 0 or prompt_sigma < 0:
        raise ValueError("spreads must be >= 0")
    mu = solve_mu(mean_response, math.hypot(sg, sw), max_response)
    rng = np.random.default_rng(seed)
    zg = rng.standard_normal(num_prompts)
    zw = rng.standard_normal((num_prompts, n))
    resp = np.exp(mu + sg * zg[:, None] + sw * zw).reshape(-1)
    resp = np.clip(np.rint(resp), 1, max_response).astype(np.int64)
    pmu = math.log(mean_prompt) - prompt_sigma**2 / 2
    plen = np.maximum(1, np.rint(np.exp(pmu + prompt_sigma * rng.standard_normal(num_prompts)))).astype(np.int64)
    return Lengths(num_prompts, n, np.repeat(plen, n), resp)


def write_lengths(lengths: Lengths, path: str | Path) -> None:
    """Write the JSON-lines file (one sample per line, dataset order)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lengths.size):
            f.write(json.dumps({
                "prompt_id": i // lengths.n,
                "sample_id": i % lengths.n,
                "prompt_len": int(lengths.prompt_len[i]),
                "response_len": int(lengths.response_len[i]),
            }) + "\n")


def load_lengths(path: str | Path) -> Lengths:
    """Read and validate a lengths file. Raises :class:`LengthsError` with a one-line message."""
    p = Path(path)
    if not p.is_file():
        raise LengthsError(f"lengths file not found: {p}")
    pids: list[int] = []
    sids: list[int] = []
    plens: list[int] = []
    rlens: list[int] = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                vals = [d["prompt_id"], d["sample_id"], d["prompt_len"], d["response_len"]]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise LengthsError(f"{p}:{lineno}: not a lengths record ({type(e).__name__}: {e})") from None
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
                raise LengthsError(f"{p}:{lineno}: fields must be integers")
            if vals[2] < 0 or vals[3] < 1:
                raise LengthsError(f"{p}:{lineno}: need prompt_len >= 0 and response_len >= 1")
            pids.append(vals[0])
            sids.append(vals[1])
            plens.append(vals[2])
            rlens.append(vals[3])
    if not rlens:
        raise LengthsError(f"{p}: no records")
    pid = np.asarray(pids)
    starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]])
    sizes = np.diff(np.r_[starts, pid.shape[0]])
    n = int(sizes[0])
    if np.any(sizes != n):
        raise LengthsError(f"{p}: prompts must have the same number of adjacent samples (found {sorted(set(sizes.tolist()))})")
    if np.unique(pid[starts]).shape[0] != starts.shape[0]:
        raise LengthsError(f"{p}: the samples of a prompt must be adjacent (a prompt_id reappears)")
    sid = np.asarray(sids).reshape(-1, n)
    if np.any(np.sort(sid, axis=1) != np.arange(n)):
        raise LengthsError(f"{p}: sample_id must run 0..n-1 within each prompt")
    return Lengths(int(starts.shape[0]), n, np.asarray(plens, dtype=np.int64), np.asarray(rlens, dtype=np.int64))
