"""Batch-size threshold for model-free speculative decoding (the SAM drafter's own gate; for ngram/suffix on
vLLM-Ascend the ``spec_decode_gate`` factory of the vLLM-Ascend seam, registered by :mod:`qwen3_rl.vllm_plugin`).

At large batches a decode step is compute-bound and verifying k draft tokens per request costs more
than the accepted tokens save. The gate turns drafting off while the number of running requests in
the step (``input_batch.num_reqs``) is above the threshold and back on at or below it.

Switch: vLLM's ``speculative_config.disable_by_batch_size`` (documented by vLLM as "disable
speculative decoding ... when the number of enqueued requests is larger than this value"; declared
and validated (>= 2) by vLLM 0.13 but read nowhere in its v1 engine nor in vLLM-Ascend 0.13). Unset
(default) = drafting always on. Applies to the model-free methods ngram, suffix and sam.

While off, the runner gets empty drafts: the scheduler then schedules no draft tokens and the next
step is a plain decode step. The gate changes no runner state. Drafters that keep per-request
state (our SAM adapter) expose ``observe(valid_sampled_token_ids, scheduler_output)`` and are still
fed every step, so when drafting resumes their automata hold every token generated while off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Methods the gate may switch off (drafters without model state; eagle/mtp keep KV caches in step).
GATED_METHODS = ("ngram", "suffix", "sam")


@dataclass
class BatchSizeGate:
    """Drafting on/off by running batch size.

    Attributes:
        threshold: drafting is off while ``num_running > threshold``; None = never off.
        steps_on / steps_off: counters (steps); switches: number of on<->off transitions.
    """

    threshold: int | None = None
    steps_on: int = 0
    steps_off: int = 0
    switches: int = 0
    _on: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        if self.threshold is not None and (isinstance(self.threshold, bool) or not isinstance(self.threshold, int)
                                           or self.threshold < 1):
            raise ValueError(f"batch-size threshold must be an int >= 1 or None, got {self.threshold!r}")

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> BatchSizeGate:
        """Gate from ``vllm_config.speculative_config.disable_by_batch_size`` (None if no spec config).

        Raises ``ValueError`` if a threshold is set for a method the gate cannot switch (eagle, mtp, ...).
        """
        spec = getattr(vllm_config, "speculative_config", None)
        threshold = getattr(spec, "disable_by_batch_size", None) if spec is not None else None
        if threshold is not None and spec.method not in GATED_METHODS:
            raise ValueError(f"speculative_config.disable_by_batch_size is supported for {GATED_METHODS} on "
                             f"vLLM-Ascend (qwen3_rl), not for method={spec.method!r}")
        return cls(threshold=threshold)

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    def drafting_on(self, num_running: int) -> bool:
        """Decide this step: True = draft. ``num_running`` = requests in the step's batch."""
        on = self.threshold is None or num_running <= self.threshold
        if on != self._on:
            self.switches += 1
            self._on = on
        if on:
            self.steps_on += 1
        else:
            self.steps_off += 1
        return on


def gate_factory(vllm_config: Any) -> BatchSizeGate | None:
    """Factory of vLLM-Ascend's ``spec_decode_gate`` extension point: the gate when
    ``speculative_config.disable_by_batch_size`` is set, else None (drafting always on)."""
    gate = BatchSizeGate.from_vllm_config(vllm_config)
    return gate if gate.enabled else None


def propose_or_skip(gate: BatchSizeGate, drafter: Any, num_running: int, valid_sampled_token_ids: list[list[int]],
                    scheduler_output: Any, generate: Any) -> list[list[int]]:
    """One step of a gated model-free drafter.

    Args:
        gate: the runner's gate.
        drafter: the runner's drafter; if it has ``observe`` it is fed while drafting is off.
        num_running: requests in this step's batch.
        valid_sampled_token_ids: per batch row, the tokens accepted this step (list of lists).
        scheduler_output: this step's ``SchedulerOutput``.
        generate: zero-argument callable running the drafter (``drafter.generate_token_ids(...)``).
    Returns:
        drafts per batch row (empty lists while off).
    """
    if gate.drafting_on(num_running):
        return generate()
    observe = getattr(drafter, "observe", None)
    if observe is not None:
        observe(valid_sampled_token_ids, scheduler_output)
    return [[] for _ in valid_sampled_token_ids]
