# shellcheck shell=bash
# Qwen3-235B-A22B on 8 nodes x 16 dies: the layout every 235B setup shares (sourced by its train scripts before
# lib/train_common.sh). Actor parallelism and the multi-bucket graph sizes are NOT in the references: they
# come from the published recipe's scripts (the slides' "128die TP4PP4 CP4EP32" agrees). Every value is an env var with a default (docs/setups.md).
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }

# ---- actor (Megatron) parallelism: from the published recipe's scripts ------------------------
ACTOR_TP=${ACTOR_TP:-4}
ACTOR_PP=${ACTOR_PP:-4}
# 94 decoder layers do not divide by PP4 (megatron-core 0.12.1 asserts num_layers % PP == 0 unless the
# first/last stage sizes are given): 23 + 24 + 24 + 23. Set both to "null" for an even split.
ACTOR_PP_FIRST_STAGE_LAYERS=${ACTOR_PP_FIRST_STAGE_LAYERS:-23}
ACTOR_PP_LAST_STAGE_LAYERS=${ACTOR_PP_LAST_STAGE_LAYERS:-23}
ACTOR_CP=${ACTOR_CP:-4}
ACTOR_EP=${ACTOR_EP:-32}
ACTOR_ETP=${ACTOR_ETP:-1}

# ---- rollout (vLLM-Ascend) --------------------------------------------------------------------
ROLLOUT_TP=${ROLLOUT_TP:-4}
ROLLOUT_GPU_MEMORY_UTILIZATION=${ROLLOUT_GPU_MEMORY_UTILIZATION:-0.87}
# the rollout switches (ROLLOUT_ENABLE_EP, MOE_ALLTOALLV, MOE_PREFILL_CHUNK_SIZE, ROLLOUT_EPLB*, ...): features.toml
