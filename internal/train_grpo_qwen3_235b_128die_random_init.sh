#!/usr/bin/env bash
# GRPO, Qwen3-235B-A22B, RANDOM weights (no checkpoint is read), 8 nodes x 16 dies, deepscaler.
#
# Random init path (docs/weights.md): MODEL_PATH only needs the HF config and tokenizer files;
# actor.load_weight / ref.load_weight = False make verl 0.6.1's Megatron worker keep Megatron's
# own random initialisation (megatron_workers.py: `if self.config.actor.load_weight:`), and the
# rollout starts from load_format=dummy and receives the actor's weights at the first sync.
#
# Reference facts ([ref 000 launch table], [ref 002 §1.3 / §2.1]): 128 dies, GBS 512, n=16,
# prompt 2048, response 32768, rollout TP4 / DP32 / EP128 (experts spread over all DP ranks).
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
EXP_NAME=${EXP_NAME:-grpo_qwen3_235b_128die_random_init}
MODEL_PATH=${MODEL_PATH:-${QWEN3_RL_HOME}/Qwen3-235B-A22B-hf}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-512}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2048}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-32768}

# ---- model layout shared by the 235B setups (actor / rollout parallelism) ---------------------
# shellcheck source=SCRIPTDIR/lib/qwen3_235b_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/qwen3_235b_layout.sh"

# shared defaults and override groups; the defaults after it use its DATA_DIR and NPUS_PER_NODE
# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/deepscaler/train.parquet}
VAL_FILE=${VAL_FILE:-${DATA_DIR}/aime2024/test.parquet}
ROLLOUT_DP=${ROLLOUT_DP:-$((NNODES * NPUS_PER_NODE / ROLLOUT_TP))}

train_add_base_overrides moe random
overrides+=(reward_model.reward_manager=naive)
train_add_trainer_overrides
train_add_feature_overrides
train_run verl.trainer.main_ppo ppo_megatron_trainer "$@"
