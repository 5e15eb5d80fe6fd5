"""The reference documents' published figures (docs/references.md), by setup, for comparison with a training log.

Sources: [ref 000] (recipe README, performance tables: step 1 of each run) and [ref 002 §1.3]
(Qwen3-235B 32K GRPO: averages of one run; the mapping of its "推理时间 / 训练时间 / 总时间" columns
onto verl's ``timing_s/gen`` / ``timing_s/update_actor`` / ``timing_s/step`` is ours).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    """One published number: ``key`` is the verl metric, ``step`` the step it was read at
    (None = a run average), ``better`` is "higher", "lower" or "none" (no direction)."""

    key: str
    value: float
    unit: str
    step: int | None
    better: str
    source: str


_README = "ref 000 performance table"
_SLIDES = "ref 002 §1.3 table"

PUBLISHED: dict[str, tuple[str, tuple[Figure, ...]]] = {
    "235b-grpo": (
        "Qwen3-235B-A22B GRPO, real weights, deepscaler, 2K/32K, GBS 512, n 16, 128 dies",
        (
            Figure("perf/throughput", 120.0, "tokens/s/die", 1, "higher", _README),
            Figure("timing_s/gen", 6638.49, "s", None, "lower", _SLIDES),
            Figure("timing_s/update_actor", 797.93, "s", None, "lower", _SLIDES),
            Figure("timing_s/step", 7833.16, "s", None, "lower", _SLIDES),
            Figure("response_length/mean", 7344.97, "tokens", None, "none", _SLIDES),
        ),
    ),
    "235b-dapo": (
        "Qwen3-235B-A22B DAPO, real weights, dapo-math-17k, 2K/34K, GBS 128, n 16, num_gen_batches 2",
        (Figure("perf/time_per_step", 6620.0, "s", 1, "lower", _README),),
    ),
    "32b-grpo": (
        "Qwen3-32B GRPO, deepscaler, 2K/34K, GBS 128, n 16, SAM off, npugraph_ex off",
        (Figure("timing_s/generate_sequences", 2444.0, "s", 1, "lower", _README),),
    ),
    "32b-grpo-sam": (
        "Qwen3-32B GRPO, SAM speculative decoding on, npugraph_ex off",
        (Figure("timing_s/generate_sequences", 2106.0, "s", 1, "lower", _README),),
    ),
    "32b-grpo-sam-npugraph": (
        "Qwen3-32B GRPO, SAM on, npugraph_ex on",
        (Figure("timing_s/generate_sequences", 1621.0, "s", 1, "lower", _README),),
    ),
    "32b-dapo": (
        "Qwen3-32B DAPO, dapo-math-17k, 2K/34K, GBS 128, n 16, SAM off, npugraph_ex off",
        (Figure("timing_s/generate_sequences", 4562.0, "s", 1, "lower", _README),),
    ),
    "32b-dapo-sam": (
        "Qwen3-32B DAPO, SAM on, npugraph_ex off",
        (Figure("timing_s/generate_sequences", 4109.0, "s", 1, "lower", _README),),
    ),
    "32b-dapo-sam-npugraph": (
        "Qwen3-32B DAPO, SAM on, npugraph_ex on",
        (Figure("timing_s/generate_sequences", 3261.0, "s", 1, "lower", _README),),
    ),
}

ALIASES: dict[str, str] = {
    # the train scripts of [ref 000 launch table] (real-weight runs; random init has no published figure)
    "train_grpo_qwen3_235b_128die_true_weight": "235b-grpo",
    "train_dapo_qwen3_235b_128die_true_weight": "235b-dapo",
    "train_grpo_qwen3_32b_32die_true_weight": "32b-grpo",
    "train_dapo_qwen3_32b_32die_true_weight": "32b-dapo",
}


def resolve_setup(name: str) -> str:
    """Setup name or train-script name/path (``.sh`` and directories dropped) → setup key.

    Raises ``KeyError`` with the known names if unknown.
    """
    key = name.strip().rsplit("/", 1)[-1].removesuffix(".sh").lower()
    if key in PUBLISHED:
        return key
    if key in ALIASES:
        return ALIASES[key]
    raise KeyError(f"unknown setup '{name}' (known: {', '.join(sorted(PUBLISHED))})")
