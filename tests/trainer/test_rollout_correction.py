"""Off-policy correction in our trainers' update step (``DapoRayTrainer._update_on_batch``, which the fully-async
trainer reuses): verl 0.6.1's rollout correction (``verl/trainer/ppo/rollout_corr_helper.py``, executed here on the
patched verl tree) weights each token's policy loss by pi_old / pi_rollout truncated at ``rollout_is_threshold``
(TIS). Driven with a fake worker group that returns known old log-probs and records what ``update_actor`` gets; the
expected weights are computed by hand from the log-probs (the arithmetic, token and sequence level)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

RESP_LEN = 4
#: log pi_rollout and log pi_old per token (2 samples of one prompt); the last token of sample 1 is padding
ROLLOUT_LP = [[-1.0, -2.0, -0.5, -1.5], [-1.0, -1.0, -1.0, -3.0]]
OLD_LP = [[-1.0 + math.log(0.5), -2.0, -0.5 + math.log(1.5), -1.5 + math.log(3.0)],
          [-1.0 + math.log(1.2), -1.0 + math.log(1.1), -1.0, -3.0 + math.log(5.0)]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


class _WG:
    def __init__(self) -> None:
        self.updates: list = []

    def compute_log_prob(self, batch):
        from verl import DataProto

        return DataProto.from_dict(tensors={"old_log_probs": torch.tensor(OLD_LP),
                                            "entropys": torch.full((len(batch), RESP_LEN), 0.5)},
                                   meta_info={"temperature": 1.0})

    def update_actor(self, batch):
        from verl import DataProto

        self.updates.append(batch)
        return DataProto(meta_info={"metrics": {"actor/pg_loss": [0.1]}})


def _config(rollout_is: str | None):
    import verl

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
    over = {"algorithm": {"adv_estimator": "grpo", "rollout_correction": {"rollout_is": rollout_is,
                                                                           "rollout_is_threshold": 2.0}},
            "actor_rollout_ref": {"rollout": {"n": 2}},
            "trainer": {"balance_batch": False, "critic_warmup": 0}}
    return OmegaConf.merge(cfg, OmegaConf.create(over))


def _update(rollout_is: str | None, with_rollout_log_probs: bool = True):
    from verl import DataProto

    from qwen3_rl.trainer.dapo import make_dapo_trainer_class

    cls = make_dapo_trainer_class()
    t = cls.__new__(cls)
    t.config = _config(rollout_is)
    t.actor_rollout_wg = _WG()
    t.use_reference_policy = t.use_critic = False
    t.global_steps = 1
    mask = torch.tensor(MASK)
    scores = torch.zeros(2, RESP_LEN)
    scores[0, -1] = 1.0
    tensors = {"responses": torch.ones(2, RESP_LEN, dtype=torch.long),
               "attention_mask": torch.cat([torch.ones(2, 2, dtype=torch.long), mask], -1),
               "response_mask": mask, "token_level_scores": scores}
    if with_rollout_log_probs:
        tensors["rollout_log_probs"] = torch.tensor(ROLLOUT_LP)
    batch = DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(["p", "p"], dtype=object)})
    metrics: dict = {}
    t._update_on_batch(batch, metrics, {})
    return t.actor_rollout_wg.updates[0], metrics


def test_token_level_weights_are_truncated_ratios(patched_imports) -> None:
    sent, metrics = _update("token")
    expected = torch.tensor([[0.5, 1.0, 1.5, 2.0],   # 3.0 truncated at 2
                             [1.2, 1.1, 1.0, 0.0]])  # padding: 0 (its ratio 5 plays no part)
    assert torch.allclose(sent.batch["rollout_is_weights"], expected, atol=1e-6), sent.batch["rollout_is_weights"]
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(3.0, rel=1e-5)  # before truncation
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 7)


def test_sequence_level_weight_is_the_truncated_product(patched_imports) -> None:
    sent, _ = _update("sequence")
    w = sent.batch["rollout_is_weights"]
    # sample 0: 0.5 x 1 x 1.5 x 3 = 2.25 -> 2; sample 1: 1.2 x 1.1 x 1 = 1.32 (padding left out), 0 on padding
    assert torch.allclose(w, torch.tensor([[2.0] * 4, [1.32, 1.32, 1.32, 0.0]]), atol=1e-5), w


def test_off_logs_the_mismatch_only_and_needs_the_rollout_log_probs(patched_imports) -> None:
    sent, metrics = _update(None)
    assert "rollout_is_weights" not in sent.batch.keys()
    assert "rollout_corr/kl" in metrics  # verl's off-policy metrics still logged
    sent, metrics = _update("token", with_rollout_log_probs=False)  # nothing to weigh by: verl's fit skips too
    assert "rollout_is_weights" not in sent.batch.keys() and not any(k.startswith("rollout_corr/") for k in metrics)
