#!/usr/bin/env bash
# GRPO on a tiny random-weight Qwen3-MoE on CPU: 1 node, 2 worker processes (Megatron actor TP 2 + EP 2, one
# vLLM CPU engine per process), 8 prompts x 4 samples x 64 response tokens, 2 steps, a checkpoint per step.
# The whole loop of the cluster setups (launcher, Ray, rollout, reward, update, weight sync, checkpoint)
# at a size two CPU cores run in about a minute; composed from the same internal/lib/ groups.
#
#   python -m qwen3_rl tiny-model --out workspace/tiny/qwen3_moe_tiny --moe
#   python -m qwen3_rl tiny-data --out workspace/tiny/data
#   bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu --npus-per-node 2
#
# It needs the CPU engine environment (docs/tiny_cpu_run.md); every size is an environment variable with a default
# (internal/lib/tiny_cpu_layout.sh); extra Hydra overrides may be passed as arguments.
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
EXP_NAME=${EXP_NAME:-grpo_tiny_cpu}
# actor: TP 2 and EP 2 over the 2 processes (empty stage sizes = Megatron's even split, required with PP 1)
ACTOR_TP=${ACTOR_TP:-2}
ACTOR_PP=${ACTOR_PP:-1}
ACTOR_EP=${ACTOR_EP:-2}
ACTOR_PP_FIRST_STAGE_LAYERS=${ACTOR_PP_FIRST_STAGE_LAYERS:-}
ACTOR_PP_LAST_STAGE_LAYERS=${ACTOR_PP_LAST_STAGE_LAYERS:-}

# shellcheck source=SCRIPTDIR/lib/tiny_cpu_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/tiny_cpu_layout.sh"
# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/gsm8k/train.parquet}

# Megatron's random init (verl 0.6.1 loads HF weights into a dense Megatron MLP only:
# verl/models/mcore/loader.py:441-446; MoE models need a dist checkpoint or mbridge)
train_add_base_overrides moe random
overrides+=(reward_model.reward_manager=naive)
train_add_trainer_overrides
train_add_feature_overrides
train_add_tiny_cpu_overrides
train_run verl.trainer.main_ppo ppo_megatron_trainer "$@"
