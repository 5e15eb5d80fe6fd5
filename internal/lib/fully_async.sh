# shellcheck shell=bash
# The fully-async setups (internal/train_*_fully_async.sh): our trainer qwen3_rl.trainer.fully_async (the trainer's
# pool and the rollout's pool on separate processes / dies, docs/fully_async.md). Sourced by such a train script
# after lib/train_common.sh; train_add_fully_async_overrides comes after the other override groups (it replaces the
# trainer's process count and sets the async_training group).
#
# A script provides: NNODES, TRAIN_PROCS, ROLLOUT_PROCS, PPO_MINI_BATCH_SIZE, REQUIRE_BATCHES, TRIGGER_SYNC_STEPS,
# STALENESS_THRESHOLD, SYNCS (null: TOTAL_EPOCHS decide). The switches (features.toml group fully_async):
# PARTIAL_ROLLOUT, USE_ROLLOUT_LOG_PROBS, ROLLOUT_CORRECTION (token by default for these setups) and ROLLOUT_MODE
# (async by default for these setups).
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }
# the rollout's processes per node (train_add_feature_overrides passes it as context ROLLOUT_PROCS_PER_NODE)
_rollout_procs_per_node=${ROLLOUT_PROCS:?the fully-async script sets ROLLOUT_PROCS before sourcing lib/fully_async.sh}

# _fa_set KEY VALUE: KEY=VALUE in place of any KEY=... already in `overrides` (Hydra refuses a key given twice)
_fa_set() {
    local key=$1 value=$2 kept=() o
    for o in "${overrides[@]}"; do
        [[ "${o}" == "${key}="* ]] || kept+=("${o}")
    done
    overrides=("${kept[@]}" "${key}=${value}")
}

# train_add_fully_async_overrides: the two pools (trainer.* = the trainer's, rollout.* = the rollout's), the
# async_training group's sizes, the updates of the run (SYNCS weight syncs x TRIGGER_SYNC_STEPS updates each).
train_add_fully_async_overrides() {
    _fa_set trainer.nnodes "${NNODES}"
    _fa_set trainer.n_gpus_per_node "${TRAIN_PROCS}"
    if [[ -n "${SYNCS}" && "${SYNCS}" != null ]]; then  # else the epochs decide (TOTAL_EPOCHS)
        _fa_set trainer.total_training_steps "$((SYNCS * TRIGGER_SYNC_STEPS))"
    fi
    overrides+=(
        "rollout.nnodes=${NNODES}"
        "rollout.n_gpus_per_node=${ROLLOUT_PROCS}"
        "async_training.staleness_threshold=${STALENESS_THRESHOLD}"
        "async_training.trigger_parameter_sync_step=${TRIGGER_SYNC_STEPS}"
        "async_training.require_batches=${REQUIRE_BATCHES}"
    )
}
