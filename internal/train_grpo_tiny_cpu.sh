#!/usr/bin/env bash
# GRPO on a tiny Qwen3 (dense, 2 layers) on CPU: 1 node, 2 worker processes (Megatron actor TP 2, one vLLM CPU engine
# per process), 16 addition problems x 8 samples a step, 6 steps, validation before the first step and after the
# last, a checkpoint per step. The model starts from the short supervised warm-up `bash setup_cpu.sh` makes: it
# learnt the worked sums, but marks its final answer (\boxed{}, which the reward requires) in only some samples and
# not when decoding greedily; GRPO rewards the marked right answers, and validation accuracy rises.
# The whole loop of the cluster setups (launcher, Ray, rollout, reward, update, weight sync, checkpoint),
# composed from the same internal/lib/ groups.
#
#   bash setup_cpu.sh
#   bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu
#
# docs/tiny_cpu_run.md; every size is an environment variable with a default (here and in
# internal/lib/tiny_cpu_layout.sh); extra Hydra overrides may be passed as arguments.
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
EXP_NAME=${EXP_NAME:-grpo_tiny_cpu}
# actor: TP 2 over the 2 processes
ACTOR_TP=${ACTOR_TP:-2}
ACTOR_PP=${ACTOR_PP:-1}
TINY_MODEL=${TINY_MODEL:-qwen3_tiny}
TINY_DATA=${TINY_DATA:-data_sum}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-16}
N_SAMPLES=${N_SAMPLES:-8}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-32}
# tokens per micro-batch (actor update and log-probs): ~12 sequences of ~80 tokens
MAX_TOKEN_LEN_PER_GPU=${MAX_TOKEN_LEN_PER_GPU:-1024}
LR=${LR:-5e-4}
ENTROPY_COEFF=${ENTROPY_COEFF:-0}
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-6}
TEST_FREQ=${TEST_FREQ:-${TOTAL_TRAINING_STEPS}}

# a checkpoint after every step
SAVE_FREQ=${SAVE_FREQ:-1}
# sequences per vLLM engine step
ROLLOUT_MAX_NUM_SEQS=${ROLLOUT_MAX_NUM_SEQS:-32}
# shellcheck source=SCRIPTDIR/lib/tiny_cpu_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/tiny_cpu_layout.sh"
# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/gsm8k/train.parquet}

# the warmed-up HF weights, loaded into the dense Megatron model by verl (verl/models/mcore/loader.py)
train_add_base_overrides dense hf_or_dist_ckpt
overrides+=(reward_model.reward_manager=naive)
train_add_trainer_overrides
train_add_feature_overrides
train_add_tiny_cpu_overrides
train_run verl.trainer.main_ppo ppo_megatron_trainer "$@"
