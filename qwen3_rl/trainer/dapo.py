"""Our DAPO trainer on verl 0.6.1's core ``RayPPOTrainer`` (verl's own DAPO lives in its git
``recipe/`` folder, which the PyPI wheel does not ship).

DAPO = GRPO advantages plus
* decoupled clip: ``actor_rollout_ref.actor.clip_ratio_low`` / ``clip_ratio_high`` (verl core actor
  config, ``verl/workers/config/actor.py``; the core policy loss reads them);
* token-mean loss: ``actor_rollout_ref.actor.loss_agg_mode=token-mean`` (core);
* overlong reward shaping: verl core's ``dapo`` reward manager with ``reward_model.reward_kwargs``;
* dynamic sampling (this module): ``algorithm.filter_groups.{enable,metric,max_num_gen_batches}``
  (verl core ``FilterGroupsConfig``) and ``data.gen_batch_size`` prompts per generation batch.

Run: ``python -m qwen3_rl.trainer.dapo --config-name dapo_megatron_trainer key=value ...``; the
config (``qwen3_rl/trainer/config/dapo_megatron_trainer.yaml``) is verl's ``ppo_megatron_trainer``
plus the DAPO section.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass
from pprint import pprint
from typing import Any

import hydra
import numpy as np

from qwen3_rl.trainer.dynamic_sampling import GroupAccumulator

CONFIG_NAME = "dapo_megatron_trainer"
VALID_FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


@dataclass(frozen=True)
class DapoSettings:
    """The DAPO switches read from the Hydra config (validated once)."""

    train_batch_size: int
    gen_batch_size: int
    filter_enable: bool
    filter_metric: str | None
    max_num_gen_batches: int

    @classmethod
    def from_config(cls, config: Any) -> DapoSettings:
        """Read ``data.*`` and ``algorithm.filter_groups.*``; raises ValueError with the bad key."""
        train_bs = int(config.data.train_batch_size)
        gen_bs = int(config.data.get("gen_batch_size", None) or train_bs)
        fg = config.algorithm.get("filter_groups", None) or {}
        enable = bool(fg.get("enable", False))
        metric = fg.get("metric", None)
        max_gen = int(fg.get("max_num_gen_batches", 0) or 0)
        if train_bs <= 0 or gen_bs <= 0:
            raise ValueError(f"data.train_batch_size ({train_bs}) and data.gen_batch_size ({gen_bs}) must be > 0")
        if enable and metric is None:
            raise ValueError("algorithm.filter_groups.enable=True needs algorithm.filter_groups.metric")
        if not enable and gen_bs != train_bs:
            raise ValueError(f"data.gen_batch_size ({gen_bs}) != data.train_batch_size ({train_bs}) only makes "
                             "sense with algorithm.filter_groups.enable=True")
        return cls(train_bs, gen_bs, enable, metric if enable else None, max_gen)


def _ray_trainer_base():  # imported lazily so the pure parts import without verl
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    return RayPPOTrainer


def attach_rewards(batch: Any, reward_fn: Any) -> Any:
    """Score ``batch`` (a verl ``DataProto`` of B responses) with verl's reward manager: ``response_mask`` (B x T) if
    missing, ``token_level_scores`` = ``token_level_rewards`` (B x T) and the manager's extras (B,) as non-tensor
    columns; returns ``batch``."""
    from verl.trainer.ppo.ray_trainer import compute_response_mask
    from verl.trainer.ppo.reward import compute_reward

    if "response_mask" not in batch.batch.keys():
        batch.batch["response_mask"] = compute_response_mask(batch)
    reward, extra = compute_reward(batch, reward_fn)
    batch.batch["token_level_scores"] = reward
    batch.batch["token_level_rewards"] = reward
    if extra:
        batch.non_tensor_batch.update({k: np.array(v) for k, v in extra.items()})
    return batch


def make_dapo_trainer_class():
    """Build ``DapoRayTrainer(RayPPOTrainer)`` (verl imported at call time)."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.trainer.ppo.metric_utils import (
        compute_data_metrics,
        compute_throughout_metrics,
        compute_timing_metrics,
    )
    from verl.trainer.ppo.ray_trainer import (
        Role,
        apply_kl_penalty,
        compute_advantage,
        compute_response_mask,
    )
    from verl.utils.checkpoint.checkpoint_manager import should_save_ckpt_esi
    from verl.utils.debug import marked_timer
    from verl.utils.metric import reduce_metrics

    base = _ray_trainer_base()

    class DapoRayTrainer(base):  # type: ignore[misc, valid-type]
        """RayPPOTrainer whose ``fit`` adds DAPO dynamic sampling; the update itself is verl's."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.dapo = DapoSettings.from_config(self.config)

        # ---- one generation batch: generate, score -----------------------------------------
        def _generate_and_score(self, new_batch: DataProto, timing_raw: dict[str, float],
                                spec_decode_counts: dict[str, int] | None = None) -> DataProto:
            n = self.config.actor_rollout_ref.rollout.n
            new_batch.non_tensor_batch["uid"] = np.array(
                [str(uuid.uuid4()) for _ in range(len(new_batch.batch))], dtype=object)
            gen_batch = self._get_gen_batch(new_batch)
            gen_batch.meta_info["global_steps"] = self.global_steps
            gen_batch = gen_batch.repeat(repeat_times=n, interleave=True)
            # the verl seam's hooks, as RayPPOTrainer.fit calls them (qwen3_rl.trainer.seam.TrainerHooks):
            # e.g. data rebalance deals each generation batch over the rollout DP ranks and puts it back in
            # order right after generation, so scoring and group filtering see dataset order
            hooks = getattr(self, "qwen3_rl_hooks", None)
            if hooks is not None:
                gen_batch, hook_state = hooks.before_generate(self, gen_batch, n=n)
            with marked_timer("gen", timing_raw, color="red"):
                if not self.async_rollout_mode:
                    out = self.actor_rollout_wg.generate_sequences(gen_batch)
                else:
                    out = self.async_rollout_manager.generate_sequences(gen_batch)
                timing_raw.update(out.meta_info.get("timing", {}))
                out.meta_info.pop("timing", None)
                if hooks is not None:  # spec-decode counts summed over the step's generation batches
                    out = hooks.after_generate(self, out, hook_state,
                                               {} if spec_decode_counts is None else spec_decode_counts)
            new_batch = new_batch.repeat(repeat_times=n, interleave=True)
            new_batch = new_batch.union(out)
            if "response_mask" not in new_batch.batch.keys():
                new_batch.batch["response_mask"] = compute_response_mask(new_batch)
            with marked_timer("reward", timing_raw, color="yellow"):
                if self.use_rm and "rm_scores" not in new_batch.batch.keys():
                    new_batch = new_batch.union(self.rm_wg.compute_rm_score(new_batch))
                attach_rewards(new_batch, self.reward_fn)
            return new_batch

        # ---- the PPO update on a full batch (verl's steps, reward already attached) -------
        def _compute_old_log_prob(self, batch: DataProto, metrics: dict, timing_raw: dict) -> DataProto:
            # the verl seam's hook, as RayPPOTrainer.fit calls it: old_log_prob on -> the actor uses its current
            # log-prob as pi_old (actor/entropy comes from update_actor) and the pass is skipped
            hooks = getattr(self, "qwen3_rl_hooks", None)
            if hooks is not None and hooks.skip_old_log_prob(batch):
                return batch
            with marked_timer("old_log_prob", timing_raw, color="blue"):
                old = self.actor_rollout_wg.compute_log_prob(batch)
                entropys = old.batch.pop("entropys")
                ent = agg_loss(loss_mat=entropys, loss_mask=batch.batch["response_mask"],
                               loss_agg_mode=self.config.actor_rollout_ref.actor.loss_agg_mode)
                metrics["actor/entropy"] = ent.detach().item()
                return batch.union(old)

        def _rollout_correction(self, batch: DataProto, metrics: dict) -> DataProto:
            """verl's rollout correction where ``RayPPOTrainer.fit`` applies it (its decoupled mode, before the
            advantages): with ``algorithm.rollout_correction`` and the rollout's log-probs in the batch, the
            per-token weights pi_old / pi_rollout (truncated at ``rollout_is_threshold``; ``rollout_is``: token or
            sequence, null = metrics only) go into the batch as ``rollout_is_weights`` (the actor's policy loss
            multiplies by them) and ``rollout_corr/*`` into ``metrics``. Skipped without recomputed old
            log-probs (the actor's current log-prob as the old one, USE_CURRENT_LOG_PROB_AS_OLD)."""
            cfg = self.config.algorithm.get("rollout_correction", None)
            if cfg is None or "rollout_log_probs" not in batch.batch.keys() or "old_log_probs" not in batch.batch.keys():
                return batch
            from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

            batch, corr = compute_rollout_correction_and_add_to_batch(batch, cfg)
            metrics.update(corr)
            return batch

        def _update_on_batch(self, batch: DataProto, metrics: dict, timing_raw: dict) -> DataProto:
            if self.config.trainer.balance_batch:
                self._balance_batch(batch, metrics=metrics)
            batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(dim=-1).tolist()
            batch = self._compute_old_log_prob(batch, metrics, timing_raw)
            if self.use_reference_policy:
                with marked_timer(str(Role.RefPolicy), timing_raw, color="olive"):
                    wg = self.actor_rollout_wg if self.ref_in_actor else self.ref_policy_wg
                    batch = batch.union(wg.compute_ref_log_prob(batch))
            if self.use_critic:
                with marked_timer("values", timing_raw, color="cyan"):
                    batch = batch.union(self.critic_wg.compute_values(batch))
            with marked_timer("adv", timing_raw, color="brown"):
                if self.config.algorithm.use_kl_in_reward:
                    batch, kl_metrics = apply_kl_penalty(batch, kl_ctrl=self.kl_ctrl_in_reward,
                                                         kl_penalty=self.config.algorithm.kl_penalty)
                    metrics.update(kl_metrics)
                else:
                    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
                batch = self._rollout_correction(batch, metrics)
                batch = compute_advantage(
                    batch,
                    adv_estimator=self.config.algorithm.adv_estimator,
                    gamma=self.config.algorithm.gamma,
                    lam=self.config.algorithm.lam,
                    num_repeat=self.config.actor_rollout_ref.rollout.n,
                    norm_adv_by_std_in_grpo=self.config.algorithm.get("norm_adv_by_std_in_grpo", True),
                    config=self.config.algorithm,
                )
            if self.use_critic:
                with marked_timer("update_critic", timing_raw, color="pink"):
                    out = self.critic_wg.update_critic(batch)
                metrics.update(reduce_metrics(out.meta_info["metrics"]))
            if self.config.trainer.critic_warmup <= self.global_steps:
                with marked_timer("update_actor", timing_raw, color="red"):
                    batch.meta_info["multi_turn"] = self.config.actor_rollout_ref.rollout.multi_turn.enable
                    out = self.actor_rollout_wg.update_actor(batch)
                metrics.update(reduce_metrics(out.meta_info["metrics"]))
            return batch

        def fit(self) -> None:  # noqa: C901 - the loop mirrors verl's fit, step by step
            from omegaconf import OmegaConf
            from tqdm import tqdm
            from verl.utils.tracking import Tracking

            logger = Tracking(project_name=self.config.trainer.project_name,
                              experiment_name=self.config.trainer.experiment_name,
                              default_backend=self.config.trainer.logger,
                              config=OmegaConf.to_container(self.config, resolve=True))
            self.global_steps = 0
            self._load_checkpoint()
            if self.val_reward_fn is not None and self.config.trainer.get("val_before_train", True):
                val_metrics = self._validate()
                pprint(f"Initial validation metrics: {val_metrics}")
                logger.log(data=val_metrics, step=self.global_steps)
                if self.config.trainer.get("val_only", False):
                    return
            progress = tqdm(total=self.total_training_steps, initial=self.global_steps, desc="Training Progress")
            self.global_steps += 1
            self.max_steps_duration = 0.0
            acc = GroupAccumulator(train_batch_size=self.dapo.train_batch_size, metric=self.dapo.filter_metric,
                                   max_num_gen_batches=self.dapo.max_num_gen_batches)
            metrics: dict[str, Any] = {}
            timing_raw: dict[str, float] = defaultdict(float)
            spec_decode_counts: dict[str, int] = {}
            last_val_metrics = None
            for epoch in range(self.config.trainer.total_epochs):
                for batch_dict in self.train_dataloader:
                    is_last_step = self.global_steps >= self.total_training_steps
                    with marked_timer("step", timing_raw):
                        scored = self._generate_and_score(DataProto.from_single_dict(batch_dict), timing_raw,
                                                          spec_decode_counts)
                        acc.add(scored)
                        if not acc.is_full():
                            acc.check_can_continue()
                            print(f"dapo: {acc.num_groups}/{self.dapo.train_batch_size} groups after "
                                  f"{acc.num_gen_batches} generation batches, generating another")
                            continue
                        metrics.update(acc.metrics())
                        hooks = getattr(self, "qwen3_rl_hooks", None)
                        if hooks is not None:
                            metrics.update(hooks.step_metrics(spec_decode_counts))
                        batch = self._update_on_batch(acc.pop_train_batch(), metrics, timing_raw)
                    if (self.val_reward_fn is not None and self.config.trainer.test_freq > 0
                            and (is_last_step or self.global_steps % self.config.trainer.test_freq == 0)):
                        with marked_timer("testing", timing_raw, color="green"):
                            val_metrics = self._validate()
                        last_val_metrics = val_metrics if is_last_step else last_val_metrics
                        metrics.update(val_metrics)
                    esi = should_save_ckpt_esi(max_steps_duration=self.max_steps_duration,
                                               redundant_time=self.config.trainer.esi_redundant_time)
                    if self.config.trainer.save_freq > 0 and (
                            is_last_step or self.global_steps % self.config.trainer.save_freq == 0 or esi):
                        with marked_timer("save_checkpoint", timing_raw, color="green"):
                            self._save_checkpoint()
                    self.max_steps_duration = max(self.max_steps_duration, timing_raw["step"])
                    metrics.update({"training/global_step": self.global_steps, "training/epoch": epoch})
                    metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))
                    metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing_raw))
                    n_gpus = self.resource_pool_manager.get_n_gpus()
                    metrics.update(compute_throughout_metrics(batch=batch, timing_raw=timing_raw, n_gpus=n_gpus))
                    logger.log(data=metrics, step=self.global_steps)
                    progress.update(1)
                    self.global_steps += 1
                    metrics, timing_raw, spec_decode_counts = {}, defaultdict(float), {}
                    if is_last_step:
                        pprint(f"Final validation metrics: {last_val_metrics}")
                        progress.close()
                        return
            progress.close()

    return DapoRayTrainer


class _TaskRunnerMixin:
    """verl's ``TaskRunner`` with our trainer class in place of ``RayPPOTrainer``.

    ``verl.trainer.main_ppo.TaskRunner.run`` builds ``RayPPOTrainer`` by its module-global name; in the
    Ray actor that runs it we bind that name to ``DapoRayTrainer`` before delegating, so datasets,
    workers, reward managers and validation are built exactly as verl builds them.
    """

    def run(self, config: Any) -> None:
        import verl.trainer.main_ppo as main_ppo

        DapoSettings.from_config(config)
        main_ppo.RayPPOTrainer = make_dapo_trainer_class()
        return super().run(config)  # type: ignore[misc]


def make_task_runner_class():
    """``DapoTaskRunner(_TaskRunnerMixin, verl TaskRunner)`` (verl imported at call time)."""
    from verl.trainer.main_ppo import TaskRunner

    return type("DapoTaskRunner", (_TaskRunnerMixin, TaskRunner), {})


def run_dapo(config: Any) -> None:
    """Validate the DAPO section, then run verl's ``run_ppo`` with our task runner."""
    import ray
    from verl.trainer.main_ppo import run_ppo

    DapoSettings.from_config(config)
    run_ppo(config, task_runner_class=ray.remote(num_cpus=1)(make_task_runner_class()))


@hydra.main(config_path="config", config_name=CONFIG_NAME, version_base=None)
def main(config: Any) -> None:
    """Hydra entry: ``python -m qwen3_rl.trainer.dapo --config-name dapo_megatron_trainer ...``."""
    run_dapo(config)


if __name__ == "__main__":
    main()
