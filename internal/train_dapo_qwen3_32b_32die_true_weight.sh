#!/usr/bin/env bash
# DAPO, Qwen3-32B (dense), real weights, 2 nodes x 16 dies (32 dies), dapo-math-17k (validation: AIME 2024).
# DAPO = decoupled clip (clip_ratio_low/high), token-mean loss, dynamic sampling (filter_groups),
# overlong reward shaping; run by our entry qwen3_rl.trainer.dapo on verl's core RayPPOTrainer (seed set), by verl
# 0.9.1's own main_ppo (V1 trainer) under its keys on the current set (PIN_SET=current: lib/train_dapo.sh).
#
# Reference facts ([ref 000]): 2 nodes, GBS 128, n=16, prompt 2048, response 34816, rollout TP8.
# NOT in the references, taken from the published recipe's scripts: actor TP8 PP2 CP2 and the
# multi-bucket graph capture sizes.
#
# Rollout mode: sync SPMD (see docs/rollout_mode.md): 4 independent TP8 vLLM engines (dense model,
# no expert parallel), each given a quarter of the batch by verl's rollout mesh.
#
# Every path and size is an environment variable with a default (this setup's below, the shared ones in
# internal/lib/; all in docs/setups.md); extra Hydra overrides may be passed as arguments.
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

NNODES=${NNODES:-2}
EXP_NAME=${EXP_NAME:-dapo_qwen3_32b_32die_true_weight}
MODEL_PATH=${MODEL_PATH:-${QWEN3_RL_HOME}/Qwen3-32B}
# [ref 000] loads the HF weights directly (only the source rank reads them); USE_DIST_CKPT=True
# loads a converted Megatron checkpoint instead (docs/weights.md; the switch is in features.toml).
DIST_CKPT_PATH=${DIST_CKPT_PATH:-${QWEN3_RL_HOME}/Qwen3-32B-mcore}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2048}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-34816}

# ---- model layout shared by the 32B setups (actor / rollout parallelism) ---------------------
# shellcheck source=SCRIPTDIR/lib/qwen3_32b_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/qwen3_32b_layout.sh"

# shared defaults and override groups; the default after it uses its DATA_DIR
# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/dapo_math/train.parquet}
VAL_FILE=${VAL_FILE:-${DATA_DIR}/aime2024/test.parquet}
# shellcheck source=SCRIPTDIR/lib/train_dapo.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_dapo.sh"

train_add_base_overrides dense hf_or_dist_ckpt
train_add_dapo_overrides
train_add_trainer_overrides
train_add_feature_overrides
train_run_dapo "$@"
