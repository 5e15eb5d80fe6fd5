"""MoE features: expert-parallel load balancing (EPLB) for rollout."""
