"""Rollout-side runtime features: load balancing across DP ranks (the simulator is in :mod:`qwen3_rl.tools.sim`)."""
