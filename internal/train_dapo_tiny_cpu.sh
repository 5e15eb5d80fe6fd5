#!/usr/bin/env bash
# DAPO on a tiny random-weight Qwen3-MoE on CPU: 1 node, 2 worker processes (Megatron actor PP 2 by default, one
# vLLM CPU engine per process), dynamic sampling and the overlong buffer on, 2 steps, a checkpoint per step.
# Run by our entry qwen3_rl.trainer.dapo like the cluster DAPO setups, from the same internal/lib/ groups.
#
#   bash setup_cpu.sh
#   bash ray_start_npu.sh internal/train_dapo_tiny_cpu.sh --device cpu
#
# A random model never answers right, so "acc" and "score" are the same in every group and dynamic sampling would
# keep none: the tiny run filters on "seq_reward" (the score plus the overlong penalty, which varies with the
# response length).
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
EXP_NAME=${EXP_NAME:-dapo_tiny_cpu}
# actor: PP 2 over the 2 processes, one layer per stage (Megatron's even split: with PP 2, first and last stage
# sizes would leave no middle stage, which megatron-core 0.12.1 divides by: transformer_config.py:780-810)
ACTOR_TP=${ACTOR_TP:-1}
ACTOR_PP=${ACTOR_PP:-2}
ACTOR_EP=${ACTOR_EP:-1}
ACTOR_PP_FIRST_STAGE_LAYERS=${ACTOR_PP_FIRST_STAGE_LAYERS:-}
ACTOR_PP_LAST_STAGE_LAYERS=${ACTOR_PP_LAST_STAGE_LAYERS:-}
TINY_MODEL=${TINY_MODEL:-qwen3_moe_tiny}
TINY_DATA=${TINY_DATA:-data}
# 8 prompts x 4 samples, 64 response tokens
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-8}
N_SAMPLES=${N_SAMPLES:-4}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-64}
LR=${LR:-1e-3}
# a random model never answers right: every group scores the same and its advantages are 0; the entropy bonus keeps
# the update (and so the weight sync the run checks) non-trivial
ENTROPY_COEFF=${ENTROPY_COEFF:-0.01}
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-2}
GEN_BATCH_SIZE=${GEN_BATCH_SIZE:-16}
FILTER_METRIC=${FILTER_METRIC:-seq_reward}
MAX_NUM_GEN_BATCHES=${MAX_NUM_GEN_BATCHES:-4}
OVERLONG_BUFFER_LEN=${OVERLONG_BUFFER_LEN:-16}

# a checkpoint after every step
SAVE_FREQ=${SAVE_FREQ:-1}
# sequences per vLLM engine step
ROLLOUT_MAX_NUM_SEQS=${ROLLOUT_MAX_NUM_SEQS:-32}
# shellcheck source=SCRIPTDIR/lib/tiny_cpu_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/tiny_cpu_layout.sh"
# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/gsm8k/train.parquet}
# shellcheck source=SCRIPTDIR/lib/train_dapo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_dapo.sh"

# Megatron's random init (verl 0.6.1 loads HF weights into a dense Megatron MLP only:
# verl/models/mcore/loader.py:441-446; MoE models need a dist checkpoint or mbridge)
train_add_base_overrides moe random
train_add_dapo_overrides
train_add_trainer_overrides
train_add_feature_overrides
train_add_tiny_cpu_overrides
train_run_dapo "$@"
