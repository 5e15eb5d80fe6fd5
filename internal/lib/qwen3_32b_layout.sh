# shellcheck shell=bash
# Qwen3-32B on 2 nodes x 16 dies: the layout every 32B setup shares (sourced by its train scripts before
# lib/train_common.sh). Actor parallelism and the multi-bucket graph sizes are NOT in the references: they
# come from the published recipe's scripts. Every value is an env var with a default (docs/setups.md).
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }

# ---- actor (Megatron) parallelism: from the published recipe's scripts ------------------------
ACTOR_TP=${ACTOR_TP:-8}
ACTOR_PP=${ACTOR_PP:-2}
ACTOR_CP=${ACTOR_CP:-2}

# ---- rollout (vLLM-Ascend) --------------------------------------------------------------------
ROLLOUT_TP=${ROLLOUT_TP:-8}
ROLLOUT_GPU_MEMORY_UTILIZATION=${ROLLOUT_GPU_MEMORY_UTILIZATION:-0.85}
