"""Rollout-side features: load balancing across DP ranks, and the rollout simulator."""
