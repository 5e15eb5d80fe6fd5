# shellcheck shell=bash
# Qwen3-30B-A3B on 2 nodes x 16 dies: the layout of its setup (sourced by its train script before
# lib/train_common.sh). [ref 001] gives the hardware (2 x A3, 32 dies) and the lengths (prompt 1024, response
# 2048), not the parallelism: the values below come from `python -m qwen3_rl plan` for this model at those
# lengths (docs/setups.md shows the plan output). Every value is an env var with a default (docs/setups.md).
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }

# ---- actor (Megatron) parallelism: TP2 PP2 EP8, 24 + 24 layers -----------------------------------
# 22.96 GiB static per die (bf16 params 4.10, fp32 grads 8.20, distributed Adam 10.67): the smallest TP
# (> 1, for sequence parallel) with an even PP split and EP dividing the 128 experts.
ACTOR_TP=${ACTOR_TP:-2}
ACTOR_PP=${ACTOR_PP:-2}
# 48 layers split evenly over PP2: first/last stage sizes null (Megatron's even split, 24 + 24)
ACTOR_PP_FIRST_STAGE_LAYERS=${ACTOR_PP_FIRST_STAGE_LAYERS:-null}
ACTOR_PP_LAST_STAGE_LAYERS=${ACTOR_PP_LAST_STAGE_LAYERS:-null}
ACTOR_CP=${ACTOR_CP:-1}
ACTOR_EP=${ACTOR_EP:-8}
ACTOR_ETP=${ACTOR_ETP:-1}

# ---- rollout (vLLM-Ascend): TP2, vLLM DP16, EP32 ------------------------------------------------------
# 3.14 GiB weights per die, 331 sequences of 3072 tokens fit each engine's KV cache; an engine gets 128 x 16 /
# 16 = 128 sequences per step: one wave.
ROLLOUT_TP=${ROLLOUT_TP:-2}
ROLLOUT_GPU_MEMORY_UTILIZATION=${ROLLOUT_GPU_MEMORY_UTILIZATION:-0.85}
# the rollout switches (ROLLOUT_ENABLE_EP, MOE_ALLTOALLV, MOE_PREFILL_CHUNK_SIZE, ROLLOUT_EPLB*, ...): features.toml
