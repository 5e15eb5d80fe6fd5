"""On-policy PPO/GRPO/DAPO update without the separate old-log-prob forward pass.

verl 0.6.1 runs, before every actor update, a full forward pass of the training engine over the batch
(``actor_rollout_wg.compute_log_prob``) to get ``old_log_probs`` -- pi_old in the PPO ratio
``exp(log_prob - old_log_prob)``. When the update is truly on-policy (one optimizer step on the whole
batch: ``ppo_epochs == 1`` and one mini-batch), pi_old *is* the current policy pi_theta at the moment of
that single step, so the training forward already computes it: ``old_log_prob = log_prob.detach()``
gives ratio = 1 in value while the gradient still flows through ``log_prob``; the clip never triggers
(ratio 1 is inside ``[1 - eps_low, 1 + eps_high]``) and the loss gradient equals the recomputed one up to
the numerical difference between the two forward passes. It saves one forward over the whole batch per
step ([ref 000 patch table]: ``recompute_old_log_prob`` patch).

This differs from verl's ``algorithm.rollout_correction.bypass_mode=True``, which uses the *rollout
engine's* log-probs (vLLM sampling kernels) as pi_old: on NPU those differ from the training engine's
numbers (different kernels, precisions, parallel layouts), so the ratio is not 1 and clipping / IS
weights act on the train-inference mismatch. See ``docs/old_log_prob.md``.

Switch: ``qwen3_rl.old_log_prob.enable`` (the verl seam's group, default false = upstream behaviour; the
actor sees the group as ``actor_rollout_ref.actor.qwen3_rl``).
It is refused (:class:`OldLogProbConfigError`) unless the update is on-policy and nothing else needs
``old_log_probs`` in the batch. The ``actor/entropy`` metric, which upstream takes from the skipped
old-log-prob pass, is computed in the training forward instead (without gradient when
``entropy_coeff == 0``) -- see :func:`training_entropy`.

The functions here are what the verl seam's hooks call (:mod:`qwen3_rl.trainer.seam`): ``TrainerHooks``
(validation in the driver, ``skip_old_log_prob`` in ``RayPPOTrainer.fit`` and our DAPO trainer) and
``ActorHooks`` (the Megatron actor's mini-batch keys, loss function and training-forward entropy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SWITCH_KEY = "qwen3_rl.old_log_prob.enable"
#: Actor strategies whose loss function the patch wires (the FSDP ``dp_actor`` still needs the key).
SUPPORTED_STRATEGIES = ("megatron",)


class OldLogProbConfigError(ValueError):
    """The switch is on but the update is not on-policy (or something else needs ``old_log_probs``)."""


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` for DictConfig, dict or dataclass configs; ``default`` when absent or None cfg."""
    if cfg is None:
        return default
    getter = getattr(cfg, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except Exception:  # noqa: BLE001 - a structured config may refuse an unknown key
            return default
    return getattr(cfg, key, default)


def switch_enabled(config: Any) -> bool:
    """The switch from a config node holding the ``qwen3_rl`` group; a non-bool value is an error.

    Args:
        config: the trainer root or the actor section ``actor_rollout_ref.actor`` (DictConfig, dict or verl
            ``ActorConfig``), whose ``qwen3_rl.old_log_prob.enable`` is read.

    Returns:
        True when ``qwen3_rl.old_log_prob.enable`` is set to true.
    """
    value = _get(_get(_get(config, "qwen3_rl"), "old_log_prob"), "enable", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OldLogProbConfigError(f"{SWITCH_KEY} must be true or false, got {value!r}")
    return value


def on_policy_problems(config: Any) -> list[str]:
    """Why the update described by the full trainer config is not a single on-policy step.

    verl multiplies both ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` (prompts) by
    ``rollout.n`` and divides the mini-batch size by the data-parallel size, and each DP rank receives
    ``train_batch_size * n / dp`` rows (``megatron_workers.py`` ``ppo_mini_batch_size *= rollout.n``,
    ``//= dp``): the rank makes exactly one mini-batch iff the two prompt counts are equal.

    Args:
        config: the whole trainer config (``data``, ``algorithm``, ``actor_rollout_ref``).

    Returns:
        One human-readable line per violated condition (empty: on-policy).
    """
    actor = config.actor_rollout_ref.actor
    algo = _get(config, "algorithm")
    problems: list[str] = []
    strategy = _get(actor, "strategy", None)
    if strategy not in SUPPORTED_STRATEGIES:
        problems.append(f"actor_rollout_ref.actor.strategy={strategy!r}: only {SUPPORTED_STRATEGIES} is wired "
                        "(verl's FSDP dp_actor already uses log_prob.detach() on-policy but still reads "
                        "old_log_probs from the batch)")
    epochs = int(_get(actor, "ppo_epochs", 1))
    if epochs != 1:
        problems.append(f"actor_rollout_ref.actor.ppo_epochs={epochs} (must be 1: a second epoch updates "
                        "from a policy that is no longer pi_old)")
    mini = int(_get(actor, "ppo_mini_batch_size"))
    train = int(config.data.train_batch_size)
    if mini != train:
        problems.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} != data.train_batch_size={train} "
                        f"({-(-train // mini)} optimizer steps per batch: every step after the first is "
                        "off-policy)")
    corr = _get(algo, "rollout_correction")
    if _get(corr, "bypass_mode", False):
        problems.append("algorithm.rollout_correction.bypass_mode=True (it sets old_log_probs to the rollout "
                        "engine's log-probs; choose one of the two)")
    for key in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold"):
        if _get(corr, key) is not None:
            problems.append(f"algorithm.rollout_correction.{key}={_get(corr, key)!r} (decoupled rollout "
                            "correction weighs by pi_old / pi_rollout and needs the recomputed old_log_probs)")
    if _get(algo, "use_kl_in_reward", False):
        problems.append("algorithm.use_kl_in_reward=True (apply_kl_penalty reads old_log_probs; use "
                        "actor.use_kl_loss instead)")
    return problems


def check_on_policy(config: Any) -> bool:
    """Validate the switch against the trainer config; returns whether it is on.

    Raises:
        OldLogProbConfigError: the switch is on and :func:`on_policy_problems` found a violation
            (every violation is listed).
    """
    if not switch_enabled(config):
        return False
    problems = on_policy_problems(config)
    if problems:
        raise OldLogProbConfigError(
            f"{SWITCH_KEY}=True needs a single on-policy update per batch; fix:\n  - " + "\n  - ".join(problems))
    return True


def prepare_batch_without_old_log_prob(meta_info: dict, config: Any) -> None:
    """What the trainer does instead of ``compute_log_prob``: record the sampling temperature.

    Upstream, ``compute_log_prob``'s output carries ``meta_info["temperature"]`` into the batch and the
    Megatron actor's training forward divides the logits by it (``megatron_actor.py``
    ``forward_backward_batch``); without the pass the trainer sets it from ``rollout.temperature``.

    Args:
        meta_info: the batch's ``DataProto.meta_info`` (modified in place).
        config: the whole trainer config.
    """
    meta_info["temperature"] = config.actor_rollout_ref.rollout.temperature


def check_single_update(num_rows: int, ppo_mini_batch_size: int, ppo_epochs: int) -> None:
    """Actor-side guard (per data-parallel rank, after verl's normalisation of the mini-batch size).

    Args:
        num_rows: rows of this rank's batch (responses).
        ppo_mini_batch_size: the actor's mini-batch size in rows (already ``* n // dp``).
        ppo_epochs: the actor's epochs.

    Raises:
        OldLogProbConfigError: the rank would make more than one optimizer step on the batch.
    """
    if ppo_epochs != 1 or num_rows != ppo_mini_batch_size:
        raise OldLogProbConfigError(
            f"{SWITCH_KEY}=True but this rank's update is not a single step: {num_rows} rows, mini-batch "
            f"{ppo_mini_batch_size} rows, {ppo_epochs} epochs (needs rows == mini-batch and 1 epoch)")


def old_log_prob_for_loss(log_prob: Any, micro_batch: Any, enabled: bool) -> Any:
    """pi_old for the policy loss of one micro-batch.

    Args:
        log_prob: [batch, response_len] current log-probs (nats) from the training forward, with grad.
        micro_batch: the micro-batch (TensorDict / mapping) holding ``old_log_probs`` when not enabled.
        enabled: the switch.

    Returns:
        [batch, response_len] ``log_prob.detach()`` when enabled (ratio 1, gradient through
        ``log_prob`` only), else ``micro_batch["old_log_probs"]``.
    """
    if enabled:
        return log_prob.detach()
    return micro_batch["old_log_probs"]


@dataclass(frozen=True)
class TrainingEntropy:
    """What the training forward does with the token entropy.

    Attributes:
        calculate: compute entropy in the training forward at all.
        in_loss: ``entropy_coeff != 0``: the bonus ``- coeff * entropy`` is part of the loss (needs grad).
        report: emit ``actor/entropy`` from the training forward (the switch skipped the pass that
            reports it upstream).
    """

    calculate: bool
    in_loss: bool
    report: bool

    @property
    def detached(self) -> bool:
        """Entropy is computed only for the metric: compute it without autograd (no saved softmax)."""
        return self.calculate and not self.in_loss


def training_entropy(entropy_coeff: float, enabled: bool) -> TrainingEntropy:
    """Entropy plan of the training forward (upstream: computed iff ``entropy_coeff != 0``)."""
    in_loss = float(entropy_coeff) != 0.0
    return TrainingEntropy(calculate=in_loss or enabled, in_loss=in_loss, report=enabled)


def policy_loss_with_entropy(pg_loss: Any, entropy_loss: Any, entropy_coeff: float, plan: TrainingEntropy,
                             stats: dict[str, Any]) -> Any:
    """Loss of one micro-batch once the aggregated entropy is known; records the metric.

    Args:
        pg_loss: scalar policy-gradient loss.
        entropy_loss: scalar aggregated entropy (nats per token, ``agg_loss`` with the actor's mode).
        entropy_coeff: ``actor.entropy_coeff``.
        plan: :func:`training_entropy`.
        stats: metrics dict of the micro-batch (``actor/entropy`` added when ``plan.report``).

    Returns:
        ``pg_loss - entropy_coeff * entropy_loss`` when the bonus is in the loss, else ``pg_loss``.
    """
    if plan.report:
        stats["actor/entropy"] = float(entropy_loss.detach().item())
    if plan.in_loss:
        return pg_loss - entropy_coeff * entropy_loss
    return pg_loss
