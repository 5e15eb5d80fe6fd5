"""The ``async_training`` config group and the two pools' sizes, read once from the Hydra config and validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class AsyncSettingsError(ValueError):
    """A bad ``async_training`` / ``rollout`` pool setting (one line naming the key)."""


def behaviour_log_prob_problems(temperature: float, top_p: float, top_k: int | None) -> list[str]:
    """The rollout sampling settings under which the rollout's log-probs are not the behaviour policy's: vLLM 0.13
    returns the raw log-probs (``logprobs_mode`` ``raw_logprobs``: of the model's logits, before temperature, top-p
    and top-k), while the tokens were sampled from the processed distribution. One ``key=value`` text each."""
    out = []
    if float(temperature) != 1.0:
        out.append(f"rollout.temperature={temperature:g}")
    if float(top_p) < 1.0:
        out.append(f"rollout.top_p={top_p:g}")
    if top_k is not None and int(top_k) > 0:
        out.append(f"rollout.top_k={int(top_k)}")
    return out


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
    #: verl's rollout correction (``algorithm.rollout_correction.rollout_is``: ``token`` / ``sequence``; None =
    #: off): the policy loss weighted by pi_old / pi_rollout truncated at ``rollout_is_threshold`` (TIS), with the
    #: old log-probs recomputed by the trainer and the rollout's as pi_rollout
    rollout_is: str | None
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
            rollout_is=_rollout_is(config),
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
        megatron = config.actor_rollout_ref.actor.get("megatron") or {}
        offload = [k for k in ("param_offload", "grad_offload", "optimizer_offload") if megatron.get(k, False)]
        if offload:  # verl 0.6.1 reads them only for an actor that also rolls out (megatron_workers.py:272-283)
            raise AsyncSettingsError(f"actor_rollout_ref.actor.megatron.{offload[0]}=True (OFFLOAD=True): the "
                                     "fully-async trainer pool does not offload (verl offloads an actor only when it "
                                     "shares its devices with the rollout); set OFFLOAD=False")
        if self.rollout_is is not None:
            if not bool(rollout.calculate_log_probs):
                raise AsyncSettingsError(f"algorithm.rollout_correction.rollout_is={self.rollout_is} needs "
                                         "actor_rollout_ref.rollout.calculate_log_probs=True (pi_rollout)")
            if self.use_rollout_log_probs:
                raise AsyncSettingsError(
                    f"algorithm.rollout_correction.rollout_is={self.rollout_is} with async_training."
                    "use_rollout_log_probs=True: the weights pi_old / pi_rollout are 1 when the old log-probs are "
                    "the rollout's (ROLLOUT_CORRECTION=off with USE_ROLLOUT_LOG_PROBS=True)")
        if self.use_rollout_log_probs or self.rollout_is is not None:
            bad = behaviour_log_prob_problems(rollout.get("temperature", 1.0), rollout.get("top_p", 1.0),
                                             rollout.get("top_k", -1))
            if bad:
                raise AsyncSettingsError(
                    f"{', '.join(bad)}: the rollout's log-probs (taken before temperature / top-p / top-k) are not "
                    "the sampling policy's; use_rollout_log_probs and rollout_correction need temperature 1, top_p "
                    "1, top_k -1")
        world = int(rollout.tensor_model_parallel_size) * int(rollout.data_parallel_size) * int(
            rollout.pipeline_model_parallel_size)
        pool = self.rollout_procs * self.rollout_nnodes
        if pool % world:
            raise AsyncSettingsError(f"rollout pool {pool} processes is not a multiple of one server's "
                                     f"TP x DP x PP = {world}")


def _rollout_is(config: Any) -> str | None:
    """``algorithm.rollout_correction.rollout_is`` (None when absent or null)."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, "algorithm.rollout_correction.rollout_is", default=None)
    if value is None:
        return None
    if str(value) not in ("token", "sequence"):
        raise AsyncSettingsError(f"algorithm.rollout_correction.rollout_is={value}: must be token, sequence or null")
    return str(value)
