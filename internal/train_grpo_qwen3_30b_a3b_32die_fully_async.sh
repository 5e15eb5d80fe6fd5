#!/usr/bin/env bash
# Fully-async GRPO, Qwen3-30B-A3B (MoE: 48 layers, 128 experts top-8), real weights, 2 nodes x 16 dies (Atlas A3,
# 32 dies), gsm8k, with our fully-async trainer (qwen3_rl.trainer.fully_async, docs/fully_async.md): per node 8 dies
# train (Megatron actor + MindSpeed) and 8 dies roll out (standalone vLLM-Ascend servers).
#
# The split, from `python -m qwen3_rl plan --model-config tests/data/qwen3_30b_a3b_config.json --max-prompt-length
# 1024 --max-response-length 2048 --rollout-tp 2 --rollout-dp 8 --rollout-ep 16 --train-dies 16 --actor-tp 2
# --actor-pp 2 --actor-ep 8 --actor-etp 1 --gpu-memory-utilization 0.85` (model figures, not measured on an NPU):
#   trainer 16 dies: actor TP2 PP2 EP8 (DP 4), 33.6 GiB static per die (the 32-die sync setup's layout: 23.0);
#   rollout 16 dies: one vLLM server of TP2 x DP8 with EP16, 308 sequences of 3072 tokens per engine.
# Updates of 32 prompts x 16 samples, a weight sync every 4 updates (128 prompts per version, the sync setup's
# batch), staleness 0.5 (samples at most 1 version old), partial rollout; the trainer recomputes the old log-probs
# and weighs the loss by pi_old / pi_rollout truncated at 2 (ROLLOUT_CORRECTION=token; SAM can draft).
#
# Every path and size is an environment variable with a default; extra Hydra overrides may be passed as arguments.
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

NNODES=${NNODES:-2}
EXP_NAME=${EXP_NAME:-grpo_qwen3_30b_a3b_32die_fully_async}
MODEL_PATH=${MODEL_PATH:-${QWEN3_RL_HOME}/Qwen3-30B-A3B}
DIST_CKPT_PATH=${DIST_CKPT_PATH:-${QWEN3_RL_HOME}/Qwen3-30B-A3B-mcore}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-2048}
# the split per node: TRAIN_PROCS + ROLLOUT_PROCS = the node's dies
TRAIN_PROCS=${TRAIN_PROCS:-8}
ROLLOUT_PROCS=${ROLLOUT_PROCS:-8}
NPUS_PER_NODE=${NPUS_PER_NODE:-$((TRAIN_PROCS + ROLLOUT_PROCS))}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32}
REQUIRE_BATCHES=${REQUIRE_BATCHES:-1}
TRAIN_BATCH_SIZE=$((PPO_MINI_BATCH_SIZE * REQUIRE_BATCHES))
TRIGGER_SYNC_STEPS=${TRIGGER_SYNC_STEPS:-4}
STALENESS_THRESHOLD=${STALENESS_THRESHOLD:-0.5}
# weight syncs of the run (null: TOTAL_EPOCHS decide)
SYNCS=${SYNCS:-null}

# ---- model layout: the 32-die setup's actor and rollout parallelism on half the dies each --------------
# shellcheck source=SCRIPTDIR/lib/qwen3_30b_a3b_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/qwen3_30b_a3b_layout.sh"

# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
# shellcheck source=SCRIPTDIR/lib/fully_async.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/fully_async.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/gsm8k/train.parquet}
VAL_FILE=${VAL_FILE:-${DATA_DIR}/gsm8k/test.parquet}
# vLLM DP over the rollout's dies
ROLLOUT_DP=${ROLLOUT_DP:-$((NNODES * ROLLOUT_PROCS / ROLLOUT_TP))}

train_add_base_overrides moe dist_ckpt_or_mbridge
overrides+=(reward_model.reward_manager=naive)
train_add_trainer_overrides
train_add_feature_overrides
train_add_fully_async_overrides
train_run_fully_async "$@"
