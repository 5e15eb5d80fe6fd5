"""The on-policy old-log-prob skip on the current pin set (verl 0.9.1), without a verl patch.

verl 0.9.1's V1 trainer runs, every step, a forward pass of the actor over the batch for ``old_log_probs``
(``trainer/ppo/v1/trainer_base.py:584-586`` -> ``_compute_old_log_prob``, ``:1634-1693``, the worker's
``compute_log_prob``). Its only way around it is ``algorithm.rollout_correction.bypass_mode`` (``:1641-1647``), which
takes the *rollout engine's* log-probs as pi_old: the PPO ratio is then pi_theta / pi_rollout, not 1 (an off-policy
correction, not the same update). verl 0.9.1 has no on-policy shortcut of its own (no ``log_prob.detach()`` path in
``workers/utils/losses.py``'s ``ppo_loss``, which always reads ``old_log_probs`` from the batch, ``:86-105``).

With one optimizer step on the whole batch (``qwen3_rl.trainer.old_log_prob.on_policy_problems``), pi_old is the
policy being differentiated, so this module, through verl's extension points only:

* :func:`on_policy_ppo_loss` -- verl's ``ppo_loss`` with ``old_log_probs`` = the training forward's own log-probs,
  detached ([b, R], nats); handed to the actor workers by ``set_loss_fn`` (``engine_workers.py:529-531``);
* :class:`OnPolicyOldLogProbMixin` -- a trainer mixin (for the recipe's trainer mode ``qwen3_rl_sync``,
  ``qwen3_rl.trainer.verl091_spec_metrics``) whose ``_compute_old_log_prob`` returns the batch untouched (no
  ``compute_log_prob`` call) when the switch is on, and which refuses a config that is not on-policy.

Switch: ``qwen3_rl.old_log_prob.enable`` (features.toml ``USE_CURRENT_LOG_PROB_AS_OLD``, ``current.sets``).
``actor/entropy``, which upstream takes from the skipped pass (``trainer_base.py:1675-1686``: ``agg_loss`` of the
pass's entropy over the batch), comes from the training forward instead: the mixin sets verl's
``actor.calculate_entropy`` (read by ``_update_actor``, ``:1831-1833``), so ``ppo_loss`` logs ``actor/entropy_loss``
(the same ``agg_loss`` over the mini-batch = the batch, with the same pre-update weights; ``losses.py:122-129``;
``entropy_coeff`` 0 leaves the loss unchanged), and :meth:`OnPolicyOldLogProbMixin._update_actor` logs it as
``actor/entropy``. Its cost in the training forward: verl's Megatron engine clones the logits for it
(``transformer_impl.py:1214-1229``, [tokens, vocab / TP]) and computes the vocab-wide entropy (no backward through it
with ``entropy_coeff`` 0: :func:`on_policy_ppo_loss` detaches it); not measured on an NPU.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from qwen3_rl.trainer.old_log_prob import (
    SWITCH_KEY,
    OldLogProbConfigError,
    on_policy_problems,
    switch_enabled,
)


def current_set_problems(config: Any) -> list[str]:
    """:func:`on_policy_problems` plus what needs ``old_log_probs`` in verl 0.9.1's V1 trainer besides the loss.

    ``_compute_advantage`` computes the rollout-correction metrics from ``old_log_probs`` whenever the batch has
    ``rollout_log_probs`` (``trainer_base.py:1765-1772``: ``rollout.calculate_log_probs``, default true in
    ``rollout.yaml:237``); distillation replaces ``ppo_loss`` by its own loss (``engine_workers.py:638-643``).

    Args:
        config: the whole trainer config (verl 0.9.1's ``ppo_megatron_trainer`` DictConfig).

    Returns:
        One line per violated condition (empty: the skip is exact).
    """
    problems = on_policy_problems(config)
    if config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
        problems.append(
            "actor_rollout_ref.rollout.calculate_log_probs=True (verl 0.9.1's rollout-correction "
            "metrics read old_log_probs; set it False)"
        )
    distillation = config.get("distillation", None)
    if distillation is not None and distillation.get("enabled", False):
        problems.append("distillation.enabled=True (its loss replaces ppo_loss)")
    return problems


def check(config: Any) -> bool:
    """Whether the switch is on; raises :class:`OldLogProbConfigError` listing every problem when it is on and the
    update is not a single on-policy step (:func:`current_set_problems`)."""
    if not switch_enabled(config):
        return False
    problems = current_set_problems(config)
    if problems:
        raise OldLogProbConfigError(
            f"{SWITCH_KEY}=True needs a single on-policy update per batch; fix:\n  - "
            + "\n  - ".join(problems)
        )
    return True


def on_policy_ppo_loss(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> tuple[Any, dict]:
    """verl 0.9.1's ``ppo_loss`` with pi_old = this forward's log-probs, detached.

    With ``entropy_coeff`` 0 the ``entropy`` (computed for the ``actor/entropy`` metric only, :func:`keep_entropy_metric`)
    is passed on detached: its term in the loss is 0 either way, and no backward runs through the vocab-wide entropy.

    Args:
        config: the actor's ``ActorConfig`` (bound by ``functools.partial``, as verl binds ``ppo_loss``).
        model_output: the engine's output; ``log_probs`` (and ``entropy`` if computed) nested over the packed
            sequences (prompt + response tokens).
        data: the micro-batch TensorDict (verl's no-padding layout); its ``old_log_probs`` is set here, [b, R] nats.
        dp_group: passed on.

    Returns:
        ``ppo_loss``'s (loss scalar, metrics).
    """
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    data["old_log_probs"] = no_padding_2_padding(model_output["log_probs"], data).detach()
    if config.entropy_coeff == 0 and model_output.get("entropy") is not None:
        model_output = {**model_output, "entropy": model_output["entropy"].detach()}
    return ppo_loss(config, model_output, data, dp_group=dp_group)


def actor_loss_fn(config: Any) -> partial:
    """:func:`on_policy_ppo_loss` bound to the actor's ``ActorConfig`` built from ``config`` as the worker builds
    it (``omega_conf_to_dataclass(actor)``, ``engine_workers.py:593``); what the trainer passes to ``set_loss_fn``."""
    from verl.utils.config import omega_conf_to_dataclass

    return partial(on_policy_ppo_loss, config=omega_conf_to_dataclass(config.actor_rollout_ref.actor))


def keep_entropy_metric(config: Any) -> None:
    """Sets verl's ``actor_rollout_ref.actor.calculate_entropy`` in ``config`` (in place): the training forward then
    computes the per-token entropy [b, R] (nats) and ``ppo_loss`` logs its ``agg_loss`` as ``actor/entropy_loss``
    whatever ``entropy_coeff`` (0: the loss and its gradients are unchanged)."""
    from omegaconf import open_dict

    with open_dict(config):
        config.actor_rollout_ref.actor.calculate_entropy = True


def prepare(config: Any) -> bool:
    """What the trainer does before its workers start: :func:`check`, and with the switch on
    :func:`keep_entropy_metric`. Returns whether the switch is on."""
    on = check(config)
    if on:
        keep_entropy_metric(config)
    return on


def entropy_metric(metrics: dict) -> None:
    """``metrics["actor/entropy"]`` (nats per token, aggregated as ``loss_agg_mode``) from the update's
    ``actor/entropy_loss``, in place; the key upstream's skipped pass would have written. A missing
    ``actor/entropy_loss`` (the forward computed no entropy) is an error, not a silent gap."""
    if "actor/entropy_loss" not in metrics:
        raise KeyError("actor/entropy_loss not in the update's metrics: actor.calculate_entropy was not set")
    metrics["actor/entropy"] = metrics["actor/entropy_loss"]


class OnPolicyOldLogProbMixin:
    """For a subclass of verl 0.9.1's V1 ``PPOTrainer``: with the switch on, no old-log-prob pass (module docstring).

    ``init`` checks the config before the workers start, sets ``actor.calculate_entropy`` and, after the workers
    start, gives the actor workers :func:`on_policy_ppo_loss`; ``_compute_old_log_prob`` then skips
    ``compute_log_prob`` and ``_update_actor`` logs the training forward's entropy as ``actor/entropy``.
    """

    config: Any
    actor_rollout_wg: Any

    def init(self) -> None:
        self._qwen3_rl_skip_old_log_prob = prepare(self.config)
        super().init()  # type: ignore[misc]
        if self._qwen3_rl_skip_old_log_prob:
            self.actor_rollout_wg.set_loss_fn(actor_loss_fn(self.config))

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        if getattr(self, "_qwen3_rl_skip_old_log_prob", False):
            return batch
        return super()._compute_old_log_prob(batch, metrics)  # type: ignore[misc]

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        batch = super()._update_actor(batch, metrics)  # type: ignore[misc]
        if getattr(self, "_qwen3_rl_skip_old_log_prob", False):
            entropy_metric(metrics)
        return batch
