#!/usr/bin/env bash
# DAPO, Qwen3-235B-A22B, real weights, 8 nodes x 16 dies (Atlas A3, 128 dies), dapo-math-17k
# (validation: AIME 2024). [ref 000]: GBS 128, n=16, prompt 2048, response 34816, max 2 generation batches.
# DAPO = decoupled clip (clip_ratio_low/high), token-mean loss, dynamic sampling (filter_groups),
# overlong reward shaping; run by our entry qwen3_rl.trainer.dapo on verl's core RayPPOTrainer (seed set), by verl
# 0.9.1's own main_ppo (V1 trainer) under its keys on the current set (PIN_SET=current: lib/train_dapo.sh).
#
# Reference facts ([ref 000 launch table], [ref 002 §1.3 / §2.1]): 128 dies, rollout TP4 / DP32 /
# EP128 (experts spread over all DP ranks).
# NOT in the references, taken from the published recipe's scripts: actor TP4 PP4 CP4 EP32
# (the slides' "128die TP4PP4 CP4EP32" agrees) and the multi-bucket graph capture sizes.
#
# Rollout mode: sync SPMD (see docs/rollout_mode.md). verl's own rollout.data_parallel_size stays 1
# (verl would fold it into the TP mesh and hand every DP rank the whole batch); vLLM's DP32 + expert
# parallel are given to vLLM through rollout.engine_kwargs.vllm, where vLLM's external launcher
# derives each engine's DP rank from RANK // TP, the same index verl's rollout mesh dispatches by.
#
# Every path and size is an environment variable with a default (this setup's below, the shared ones in
# internal/lib/; all in docs/setups.md); extra Hydra overrides may be passed as arguments.
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

NNODES=${NNODES:-8}
EXP_NAME=${EXP_NAME:-dapo_qwen3_235b_128die_true_weight}
MODEL_PATH=${MODEL_PATH:-${QWEN3_RL_HOME}/Qwen3-235B-A22B-hf}
DIST_CKPT_PATH=${DIST_CKPT_PATH:-${QWEN3_RL_HOME}/Qwen3-235B-A22B-mcore}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2048}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-34816}

# ---- model layout shared by the 235B setups (actor / rollout parallelism) ---------------------
# shellcheck source=SCRIPTDIR/lib/qwen3_235b_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/qwen3_235b_layout.sh"

# shared defaults and override groups; the defaults after it use its DATA_DIR and NPUS_PER_NODE
# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/dapo_math/train.parquet}
VAL_FILE=${VAL_FILE:-${DATA_DIR}/aime2024/test.parquet}
ROLLOUT_DP=${ROLLOUT_DP:-$((NNODES * NPUS_PER_NODE / ROLLOUT_TP))}
# shellcheck source=SCRIPTDIR/lib/train_dapo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_dapo.sh"

train_add_base_overrides moe dist_ckpt
train_add_dapo_overrides
train_add_trainer_overrides
train_add_feature_overrides
train_run_dapo "$@"
