"""The SAM spec-decode counters of verl 0.9.1's vLLM servers in each training step's metrics (the current pin set).

verl 0.9.1 collects per-request speculative-decoding stats for MTP only (``vllm_async_server.py:737-751``,
``trainer/ppo/v1/trainer_base.py:1902-1917``), from a field vLLM 0.23 does not fill for other drafters. The recipe's
servers (``qwen3_rl.rollout.verl_server_auth``'s ``KeyedvLLMHttpServer``) answer ``spec_decode_counts()``: vLLM's
cumulative counters of the engines in that server's process. :class:`SpecDecodeMetricsTrainer` is verl's own sync V1
trainer (``trainer_sync.py:24``) that reads them from every policy server at the start and at the end of a step's
sampling-to-update span and puts the difference, as ``rollout/spec_decode/*`` (:func:`qwen3_rl.spec_decode.metrics.
step_metrics`: drafts, draft tokens, accepted tokens, acceptance rate, mean acceptance length), into the step's
metrics through verl's ``_pending_sync_metrics`` (merged at ``trainer_base.py:488``, logged at ``:514``).
Validation runs after the step's metrics are taken, so its drafts are not counted. The same trainer mode carries the
on-policy old-log-prob skip (:class:`qwen3_rl.trainer.verl091_old_log_prob.OnPolicyOldLogProbMixin`, off by default).

Selected with ``trainer.v1.trainer_mode=qwen3_rl_sync`` (``main_ppo.py:139-141``; features.toml: SAM_ENABLE on the
current set); registered under that name by :func:`register` (verl's ``register_trainer``,
``trainer_base.py:1999-2014``), which ``qwen3_rl.rollout.verl_server_auth.register`` calls in every Ray process.
"""

from __future__ import annotations

import functools
from typing import Any

from qwen3_rl.spec_decode.metrics import counter_delta, merge_counts, step_metrics

TRAINER_MODE = "qwen3_rl_sync"
COUNTS_TIMEOUT_S = 120.0


def server_counts(servers: list[Any]) -> dict[str, int]:
    """The summed ``spec_decode_counts()`` of ``servers`` (Ray actor handles of the policy's vLLM servers); {} when
    none answers it (verl's own server class: no drafter counters are read)."""
    import ray

    handles = [s for s in servers if hasattr(s, "spec_decode_counts")]
    total: dict[str, int] = {}
    for counts in ray.get([s.spec_decode_counts.remote() for s in handles], timeout=COUNTS_TIMEOUT_S):
        total = merge_counts(total, counts)
    return total


@functools.cache
def trainer_class() -> type:
    """:class:`SpecDecodeMetricsTrainer`, registered in verl 0.9.1's trainer registry as :data:`TRAINER_MODE`."""
    from verl.trainer.ppo.v1.trainer_base import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from qwen3_rl.trainer.verl091_old_log_prob import OnPolicyOldLogProbMixin

    class SpecDecodeMetricsTrainer(OnPolicyOldLogProbMixin, PPOTrainerSync):
        """verl's sync V1 trainer plus the servers' spec-decode counters per step (module docstring) and, with
        ``qwen3_rl.old_log_prob.enable``, no old-log-prob pass (``qwen3_rl.trainer.verl091_old_log_prob``)."""

        def _policy_servers(self) -> list[Any]:
            return [srv for rep in self.llm_server_manager.get_replicas() for srv in rep.servers]

        def on_step_begin(self) -> None:
            super().on_step_begin()
            self._qwen3_rl_spec_counts = server_counts(self._policy_servers())

        def on_step_end(self) -> None:
            super().on_step_end()
            before = getattr(self, "_qwen3_rl_spec_counts", None) or {}
            delta = counter_delta(before, server_counts(self._policy_servers()))
            pending = getattr(self, "_pending_sync_metrics", None) or {}
            pending.update(step_metrics(delta))
            self._pending_sync_metrics = pending

    return register_trainer(TRAINER_MODE)(SpecDecodeMetricsTrainer)


def register() -> None:
    """Put :func:`trainer_class` in verl 0.9.1's trainer registry (in the process that runs the trainer)."""
    trainer_class()
