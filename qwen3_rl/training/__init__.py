"""Training-side feature logic that the verl patches call (Megatron actor, PPO trainer).

* :mod:`qwen3_rl.training.old_log_prob` -- on-policy GRPO/DAPO without the old-log-prob forward
  (verl patch 0008, switch ``actor_rollout_ref.actor.use_current_log_prob_as_old``).

Nothing here imports verl, Megatron or torch_npu at module import time.
"""
