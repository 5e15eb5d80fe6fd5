"""Trainer-side feature logic, built on verl's core ``RayPPOTrainer`` and called by the verl patches.

* :mod:`qwen3_rl.trainer.dapo` -- the DAPO entry (``python -m qwen3_rl.trainer.dapo``);
* :mod:`qwen3_rl.trainer.dynamic_sampling` -- DAPO's dynamic sampling (group filter, retry batches);
* :mod:`qwen3_rl.trainer.old_log_prob` -- on-policy GRPO/DAPO without the old-log-prob forward
  (through the verl seam, switch ``qwen3_rl.old_log_prob.enable``);
* :mod:`qwen3_rl.trainer.seam` -- the verl seam: the ``qwen3_rl`` group's dataclasses and the hooks verl calls.

``old_log_prob`` and ``dynamic_sampling`` import neither verl, Megatron nor torch_npu at module import time.
"""
