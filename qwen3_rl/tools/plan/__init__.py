"""Memory planning for the recipe's layouts (``python -m qwen3_rl plan``); see docs/memory_plan.md."""

from qwen3_rl.tools.plan.memory import (
    DeviceBudget,
    RolloutLayout,
    TrainLayout,
    kv_bytes_per_token,
    kv_heads_per_rank,
    plan_rollout,
    plan_training,
)
from qwen3_rl.tools.plan.model import ModelSpec, PlanError, load_model_config, model_spec_from_dict

__all__ = [
    "DeviceBudget",
    "ModelSpec",
    "PlanError",
    "RolloutLayout",
    "TrainLayout",
    "kv_bytes_per_token",
    "kv_heads_per_rank",
    "load_model_config",
    "model_spec_from_dict",
    "plan_rollout",
    "plan_training",
]
