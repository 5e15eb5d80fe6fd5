"""Trainer-side feature logic, built on verl's core ``RayPPOTrainer`` and called by the verl patches.

* :mod:`qwen3_rl.trainer.dapo` -- the DAPO entry (``python -m qwen3_rl.trainer.dapo``);
* :mod:`qwen3_rl.trainer.dynamic_sampling` -- DAPO's dynamic sampling (group filter, retry batches);
* :mod:`qwen3_rl.trainer.old_log_prob` -- on-policy GRPO/DAPO without the old-log-prob forward
  (verl patch 0004, switch ``actor_rollout_ref.actor.use_current_log_prob_as_old``).

``old_log_prob`` and ``dynamic_sampling`` import neither verl, Megatron nor torch_npu at module import time.
"""
