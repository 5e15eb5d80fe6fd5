"""The ``async_training`` config group and the two pools' sizes, read once from the Hydra config and validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class AsyncSettingsError(ValueError):
    """A bad ``async_training`` / ``rollout`` pool setting (one line naming the key)."""


@dataclass(frozen=True)
class AsyncSettings:
    """What the fully-async driver reads from the config.

    Sizes are in prompts (each prompt is one group of ``n`` samples)."""

    #: extra versions' worth of prompts the rollout may start under one weight version, counted from the prompts
    #: not yet trained at its sync (verl's count, :class:`.stream.PromptStream`); a trained sample is at most
    #: ``ceil(staleness_threshold)`` versions old (0 = on-policy batches: the rollout waits for each sync)
    staleness_threshold: float
    #: actor updates between two weight syncs
    trigger_parameter_sync_step: int
    #: mini-batches per update (the trainer waits for this many x ``ppo_mini_batch_size`` prompts)
    require_batches: int
    #: abort running requests at a sync and resume them after it (False: wait for them to finish first)
    partial_rollout: bool
    #: the rollout's log-probs as the old log-probs (False: the trainer recomputes them); with a drafter too
    #: (vllm 0004: vLLM drafts for requests with log-probs and returns the raw ones)
    use_rollout_log_probs: bool
    #: prompts per actor update
    prompts_per_update: int
    #: the trainer's pool and the rollout's pool (processes per node, nodes)
    trainer_procs: int
    trainer_nnodes: int
    rollout_procs: int
    rollout_nnodes: int

    @property
    def prompts_per_version(self) -> int:
        """Prompts trained per weight version."""
        return self.prompts_per_update * self.trigger_parameter_sync_step

    @classmethod
    def from_config(cls, config: Any) -> AsyncSettings:
        """Read ``async_training.*``, ``rollout.{nnodes,n_gpus_per_node}``, ``trainer.{nnodes,n_gpus_per_node}``
        and ``actor_rollout_ref.actor.ppo_mini_batch_size``; raises :class:`AsyncSettingsError`."""
        at = config.async_training
        s = cls(
            staleness_threshold=float(at.staleness_threshold),
            trigger_parameter_sync_step=int(at.trigger_parameter_sync_step),
            require_batches=int(at.require_batches),
            partial_rollout=bool(at.partial_rollout),
            use_rollout_log_probs=bool(at.use_rollout_log_probs),
            prompts_per_update=int(at.require_batches) * int(config.actor_rollout_ref.actor.ppo_mini_batch_size),
            trainer_procs=int(config.trainer.n_gpus_per_node),
            trainer_nnodes=int(config.trainer.nnodes),
            rollout_procs=int(config.rollout.n_gpus_per_node),
            rollout_nnodes=int(config.rollout.nnodes),
        )
        s.check(config)
        return s

    def check(self, config: Any) -> None:
        """The rules a run needs before any worker starts."""
        if self.staleness_threshold < 0:
            raise AsyncSettingsError(f"async_training.staleness_threshold={self.staleness_threshold}: must be >= 0")
        for key in ("trigger_parameter_sync_step", "require_batches", "trainer_procs", "trainer_nnodes",
                    "rollout_procs", "rollout_nnodes"):
            if getattr(self, key) < 1:
                raise AsyncSettingsError(f"{key}={getattr(self, key)}: must be >= 1")
        train_bs = int(config.data.train_batch_size)
        if train_bs != self.prompts_per_update:
            raise AsyncSettingsError(
                f"data.train_batch_size={train_bs}: must equal async_training.require_batches x "
                f"actor.ppo_mini_batch_size = {self.prompts_per_update} (one dataloader batch per update)")
        rollout = config.actor_rollout_ref.rollout
        if rollout.mode != "async":
            raise AsyncSettingsError(f"actor_rollout_ref.rollout.mode={rollout.mode}: the fully-async trainer "
                                     "runs on the server rollout (async)")
        if self.use_rollout_log_probs and not bool(rollout.calculate_log_probs):
            raise AsyncSettingsError("async_training.use_rollout_log_probs=True needs "
                                     "actor_rollout_ref.rollout.calculate_log_probs=True")
        world = int(rollout.tensor_model_parallel_size) * int(rollout.data_parallel_size) * int(
            rollout.pipeline_model_parallel_size)
        pool = self.rollout_procs * self.rollout_nnodes
        if pool % world:
            raise AsyncSettingsError(f"rollout pool {pool} processes is not a multiple of one server's "
                                     f"TP x DP x PP = {world}")
