#!/usr/bin/env bash
# Fully-async GRPO on the tiny Qwen3 (dense, 2 layers) on CPU with our trainer (qwen3_rl.trainer.fully_async):
# the trainer (1 Megatron actor process, TP 1) and the rollout (1 standalone vLLM CPU server) on separate
# processes, prompts streamed to the agent loop one group at a time, stale samples allowed (STALENESS_THRESHOLD),
# running requests aborted at each weight sync and resumed after it with their tokens so far (PARTIAL_ROLLOUT),
# the weights broadcast over a gloo group. Same model, data and reward as train_grpo_tiny_cpu.sh; validation
# (greedy, the 64 test problems) before the first update and after the last.
#
#   bash setup_cpu.sh
#   bash ray_start_npu.sh internal/train_grpo_tiny_cpu_fully_async.sh --device cpu
#
# docs/fully_async.md; every size is an environment variable with a default; extra Hydra overrides may be
# passed as arguments. The feature switches: features.toml (groups tiny, tiny_learning, fully_async);
# the trainer needs the server rollout: ROLLOUT_MODE defaults to async for the fully_async group.
# QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
EXP_NAME=${EXP_NAME:-grpo_tiny_cpu_fully_async}
# the two pools: the trainer's processes (Megatron actor, TP ACTOR_TP) and the rollout's (one vLLM server each)
TRAIN_PROCS=${TRAIN_PROCS:-1}
ROLLOUT_PROCS=${ROLLOUT_PROCS:-1}
ACTOR_TP=${ACTOR_TP:-1}
ACTOR_PP=${ACTOR_PP:-1}
TINY_MODEL=${TINY_MODEL:-qwen3_tiny}
TINY_DATA=${TINY_DATA:-data_sum}
# prompts per actor update = REQUIRE_BATCHES x PPO_MINI_BATCH_SIZE (one dataloader batch); 16 prompts x 8 samples,
# generated one sequence at a time, keep the CPU rollout (with SAM) the slower side, as a long tail would
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-16}
REQUIRE_BATCHES=${REQUIRE_BATCHES:-1}
TRAIN_BATCH_SIZE=$((PPO_MINI_BATCH_SIZE * REQUIRE_BATCHES))
# actor updates between two weight syncs (one weight version = TRIGGER_SYNC_STEPS updates)
TRIGGER_SYNC_STEPS=${TRIGGER_SYNC_STEPS:-1}
# per weight version, the prompts untrained at its sync + those started under it < (1 + STALENESS_THRESHOLD) x
# the prompts it trains: samples at most ceil(STALENESS_THRESHOLD) versions old, 0 = on-policy
STALENESS_THRESHOLD=${STALENESS_THRESHOLD:-1}
# weight syncs of the run: updates = SYNCS x TRIGGER_SYNC_STEPS
SYNCS=${SYNCS:-6}
# the rollout's vLLM batch: one sequence at a time (a CPU stand-in for a long-tailed rollout), so that generation is the slower side and requests are
# still running at a weight sync (the partial rollout aborts and resumes them)
ROLLOUT_MAX_NUM_SEQS=${ROLLOUT_MAX_NUM_SEQS:-1}
N_SAMPLES=${N_SAMPLES:-8}
# responses up to 128 tokens: the samples that ramble make the long tail that is still running at a weight sync
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-128}
MAX_TOKEN_LEN_PER_GPU=${MAX_TOKEN_LEN_PER_GPU:-1024}
LR=${LR:-5e-4}
ENTROPY_COEFF=${ENTROPY_COEFF:-0}
# validation after every TEST_FREQ updates (and after the last)
TEST_FREQ=${TEST_FREQ:-$((SYNCS * TRIGGER_SYNC_STEPS))}
# no checkpoints by default (SAVE_FREQ=N: after every N updates and the last; RESUME_MODE=auto resumes from CKPT_DIR)
SAVE_FREQ=${SAVE_FREQ:--1}

# shellcheck source=SCRIPTDIR/lib/tiny_cpu_layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/tiny_cpu_layout.sh"
# shellcheck source=SCRIPTDIR/lib/train_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/train_common.sh"
# shellcheck source=SCRIPTDIR/lib/fully_async.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/fully_async.sh"
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/gsm8k/train.parquet}

train_add_base_overrides dense hf_or_dist_ckpt
overrides+=(reward_model.reward_manager=naive)
train_add_trainer_overrides
train_add_feature_overrides
train_add_tiny_cpu_overrides
train_add_fully_async_overrides
train_run_fully_async "$@"
