#!/usr/bin/env bash
# GRPO, Qwen3-30B-A3B (MoE: 48 layers, 128 experts top-8), real weights, 2 nodes x 16 dies (Atlas A3, 32 dies), gsm8k.
#
# Reference facts ([ref 001], the 30B-A3B verl example): 2 x A3 = 32 dies (A2 may run out of memory), gsm8k train and
# val files, prompt 1024 / response 2048, weights converted HF -> Megatron dist checkpoint
# (verl's scripts/converter_hf_to_mcore.py), or read online through mbridge (USE_MBRIDGE=True), MindSpeed's fused
# RoPE as an option (FUSED_ROPE=True). NOT in [ref 001]: batch, n and the parallelism. Batch 128 x n 16 as the
# 32B setups; actor TP2 PP2 EP8 and rollout TP2 / vLLM DP16 / EP32 from `python -m qwen3_rl plan`
# (internal/lib/qwen3_30b_a3b_layout.sh, docs/setups.md).
#
# Rollout mode: sync SPMD (docs/rollout_mode.md), vLLM's DP + EP through rollout.engine_kwargs.vllm as the
# 235B setups do.
#
# Every path and size is an environment variable with a default (this setup's below, the shared ones in
# internal/lib/; all in docs/setups.md); extra Hydra overrides may be passed as arguments.
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

NNODES=${NNODES:-2}
EXP_NAME=${EXP_NAME:-grpo_qwen3_30b_a3b_32die}
MODEL_PATH=${MODEL_PATH:-${QWEN3_RL_HOME}/Qwen3-30B-A3B}
DIST_CKPT_PATH=${DIST_CKPT_PATH:-${QWEN3_RL_HOME}/Qwen3-30B-A3B-mcore}
# HF weights read online through mbridge instead of the converted dist checkpoint ([ref 001]; needs the mbridge
# package, pinned in pins.toml [runtime]): the switch USE_MBRIDGE=True | False (features.toml)
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-2048}

# ---- model layout (actor / rollout parallelism) ----------------------------------------------------
# shellcheck source=SCRIPTDIR/lib/qwen3_30b_a3b_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/qwen3_30b_a3b_layout.sh"

# shared defaults and override groups; the defaults after it use its DATA_DIR and NPUS_PER_NODE
# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/gsm8k/train.parquet}
VAL_FILE=${VAL_FILE:-${DATA_DIR}/gsm8k/test.parquet}
ROLLOUT_DP=${ROLLOUT_DP:-$((NNODES * NPUS_PER_NODE / ROLLOUT_TP))}

train_add_base_overrides moe dist_ckpt_or_mbridge
overrides+=(reward_model.reward_manager=naive)
train_add_trainer_overrides
train_add_feature_overrides
train_run verl.trainer.main_ppo ppo_megatron_trainer "$@"
