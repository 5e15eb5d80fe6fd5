#!/usr/bin/env bash
# Fully-async GRPO, Qwen3-235B-A22B (MoE: 94 layers, 128 experts top-8), real weights, 8 nodes x 16 dies (Atlas A3,
# 128 dies), deepscaler, with our fully-async trainer (qwen3_rl.trainer.fully_async, docs/fully_async.md): per node
# 12 dies train (Megatron actor + MindSpeed) and 4 dies roll out (standalone vLLM-Ascend servers).
#
# The split, from `python -m qwen3_rl plan --model-config tests/data/qwen3_235b_a22b_config.json --train-script
# internal/train_grpo_qwen3_235b_128die_fully_async.sh --hccl-buffsize-mb 512` (model figures, not measured on an NPU):
#   trainer 96 dies: actor TP4 PP3 (31 + 32 + 31 layers) CP4 EP32 (DP 2, expert DP 1), 44.3 GiB static per die.
#     64 train dies do not fit: TP4 PP4 CP4 EP16 needs 64.4 GiB of the 60.96 visible, and OFFLOAD does not lower
#     that peak (verl loads parameters, gradients and optimizer back onto the die for every update); PP4 on 96
#     dies leaves no expert DP 1 layout (24 dies per stage; EP8 expert DP 3: 70.8 GiB).
#   rollout 32 dies: one vLLM server of TP4 x DP8 with EP32, 17.0 GiB weights and 19 sequences of 34816 tokens per
#     engine (the sync setups' TP4 DP32 EP128: 7.1 GiB, 28).
# Updates of 96 prompts x 16 samples (verl's balance_batch splits them evenly over the 96 trainer dies; 128 would
# not), a weight sync every 4 updates (384 prompts per version; the sync setup's batch: 512), staleness 0.5,
# partial rollout (samples at most 1 version old); the trainer recomputes the old log-probs and weighs the loss by
# pi_old / pi_rollout truncated at 2 (ROLLOUT_CORRECTION=token; SAM can draft).
#
# Every path and size is an environment variable with a default; extra Hydra overrides may be passed as arguments.
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

NNODES=${NNODES:-8}
EXP_NAME=${EXP_NAME:-grpo_qwen3_235b_128die_fully_async}
MODEL_PATH=${MODEL_PATH:-${QWEN3_RL_HOME}/Qwen3-235B-A22B-hf}
DIST_CKPT_PATH=${DIST_CKPT_PATH:-${QWEN3_RL_HOME}/Qwen3-235B-A22B-mcore}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2048}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-32768}
# the split per node: TRAIN_PROCS + ROLLOUT_PROCS = the node's dies
TRAIN_PROCS=${TRAIN_PROCS:-12}
ROLLOUT_PROCS=${ROLLOUT_PROCS:-4}
NPUS_PER_NODE=${NPUS_PER_NODE:-$((TRAIN_PROCS + ROLLOUT_PROCS))}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-96}
REQUIRE_BATCHES=${REQUIRE_BATCHES:-1}
TRAIN_BATCH_SIZE=$((PPO_MINI_BATCH_SIZE * REQUIRE_BATCHES))
TRIGGER_SYNC_STEPS=${TRIGGER_SYNC_STEPS:-4}
STALENESS_THRESHOLD=${STALENESS_THRESHOLD:-0.5}
# weight syncs of the run (null: TOTAL_EPOCHS decide)
SYNCS=${SYNCS:-null}

# ---- actor (Megatron) on the 96 train dies: lib/qwen3_235b_layout.sh's TP4 CP4 EP32 ETP1 with PP3 -------------
ACTOR_TP=${ACTOR_TP:-4}
ACTOR_PP=${ACTOR_PP:-3}
# 94 decoder layers over PP3: 31 + 32 + 31 (megatron-core 0.12.1 needs the first / last stage sizes for an uneven
# split). Set both to "null" with a PP that divides 94.
ACTOR_PP_FIRST_STAGE_LAYERS=${ACTOR_PP_FIRST_STAGE_LAYERS:-31}
ACTOR_PP_LAST_STAGE_LAYERS=${ACTOR_PP_LAST_STAGE_LAYERS:-31}
ACTOR_CP=${ACTOR_CP:-4}
ACTOR_EP=${ACTOR_EP:-32}
ACTOR_ETP=${ACTOR_ETP:-1}

# ---- rollout (vLLM-Ascend) on the 32 rollout dies: the 235B setups' TP4 and memory utilization ------------------
ROLLOUT_TP=${ROLLOUT_TP:-4}
ROLLOUT_GPU_MEMORY_UTILIZATION=${ROLLOUT_GPU_MEMORY_UTILIZATION:-0.87}

# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
# shellcheck source=SCRIPTDIR/lib/fully_async.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/fully_async.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/deepscaler/train.parquet}
VAL_FILE=${VAL_FILE:-${DATA_DIR}/aime2024/test.parquet}
# vLLM DP over the rollout's dies
ROLLOUT_DP=${ROLLOUT_DP:-$((NNODES * ROLLOUT_PROCS / ROLLOUT_TP))}

train_add_base_overrides moe dist_ckpt
overrides+=(reward_model.reward_manager=naive)
train_add_trainer_overrides
train_add_feature_overrides
train_add_fully_async_overrides
train_run_fully_async "$@"
