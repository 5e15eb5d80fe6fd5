"""A DAPO trainer built without verl's ``RayPPOTrainer.__init__``, for driving ``fit()`` on CPU.

``make_probe_trainer`` subclasses the DAPO trainer class with a ``_update_on_batch`` that stands in for
the PPO update (verl's worker RPCs): it hands the batch to ``on_update`` (if given), fills zero
``advantages`` / ``returns`` (and, with ``response_mask=True``, an all-ones ``response_mask``) and the
``global_token_num`` meta, and returns the batch. The trainer gets the shared test config (one epoch,
filter_groups on the ``acc`` metric with 2 generation batches, no validation / saving / critic) with
``actor_rollout_ref.rollout`` = ``{"n": n}``, the ``qwen3_rl`` group, and the given worker group, reward
function, resource pool and dataloader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf


def make_probe_trainer(cls: type, *, n: int, resp_len: int, actor_rollout_wg: Any, reward_fn: Callable,
                       resource_pool_manager: Any, train_dataloader: list, total_training_steps: int = 1,
                       qwen3_rl: dict | None = None, on_update: Callable[[Any], None] | None = None,
                       response_mask: bool = True) -> Any:
    import torch

    from qwen3_rl.trainer.dapo import DapoSettings

    class Probe(cls):
        def _update_on_batch(self, batch, metrics, timing_raw):
            if on_update is not None:
                on_update(batch)
            for k in ("advantages", "returns"):
                batch.batch[k] = torch.zeros(len(batch), resp_len)
            if response_mask:
                batch.batch["response_mask"] = torch.ones(len(batch), resp_len)
            batch.meta_info["global_token_num"] = [1] * len(batch)
            return batch

    t = Probe.__new__(Probe)
    t.config = OmegaConf.create({
        "data": {"train_batch_size": 2, "gen_batch_size": 2},
        "algorithm": {"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 2}},
        "actor_rollout_ref": {"rollout": {"n": n}},
        "qwen3_rl": qwen3_rl or {},
        "trainer": {"project_name": "p", "experiment_name": "e", "logger": ["console"], "resume_mode": "disable",
                    "val_before_train": False, "total_epochs": 1, "test_freq": -1, "save_freq": -1,
                    "esi_redundant_time": 0, "balance_batch": False, "critic_warmup": 0}})
    t.dapo = DapoSettings.from_config(t.config)
    from verl.utils.qwen3_rl_hooks import trainer_hooks

    t.qwen3_rl_hooks = trainer_hooks(t.config)  # as RayPPOTrainer.__init__ sets it (the verl seam)
    t.actor_rollout_wg, t.async_rollout_mode, t.use_rm, t.use_critic = actor_rollout_wg, False, False, False
    t.reward_fn, t.val_reward_fn = reward_fn, None
    t.total_training_steps = total_training_steps
    t.resource_pool_manager = resource_pool_manager
    t.train_dataloader = train_dataloader
    return t
