# shellcheck shell=bash
# The fully-async setups (internal/train_*_fully_async.sh): our trainer qwen3_rl.trainer.fully_async (the trainer's
# pool and the rollout's pool on separate processes / dies, docs/fully_async.md). Sourced by such a train script
# after lib/train_common.sh; train_add_fully_async_overrides comes after the other override groups (it replaces the
# trainer's process count and sets the async_training group).
#
# A script provides: NNODES, TRAIN_PROCS, ROLLOUT_PROCS, PPO_MINI_BATCH_SIZE, REQUIRE_BATCHES, TRIGGER_SYNC_STEPS,
# STALENESS_THRESHOLD, SYNCS (null: TOTAL_EPOCHS decide; on the current set the updates are then counted from
# TRAIN_FILE's rows: _fa_updates_of_the_data). The switches (features.toml group fully_async):
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
# On the current pin set verl 0.9.1's own fully-async trainer (verl/experimental/fully_async_policy, config
# fully_async_ppo_megatron_trainer.yaml: the same pools and async_training keys, :12-23, :55-58) with what its
# rollouter asserts (fully_async_rollouter.py:350-356): no hybrid engine, data.train_batch_size 0 and prompts one at a
# time (data.gen_batch_size 1, yaml :68; an update takes require_batches x ppo_mini_batch_size prompts, :424); the
# length of the run in prompts, rollout.total_rollout_steps (null: the epochs decide; the yaml's 100 would cap it,
# fully_async_rollouter.py:404-407; trainer updates = prompts / (prompts per update x TRIGGER_SYNC_STEPS), :498-501).
train_add_fully_async_overrides() {
    _fa_set trainer.nnodes "${NNODES}"
    _fa_set trainer.n_gpus_per_node "${TRAIN_PROCS}"
    if [[ "${PIN_SET:-seed}" == current ]]; then
        _fa_set data.train_batch_size 0
        _fa_set data.gen_batch_size 1
        _fa_set actor_rollout_ref.hybrid_engine False
        if [[ -n "${SYNCS}" && "${SYNCS}" != null ]]; then
            _fa_set rollout.total_rollout_steps "$((SYNCS * TRIGGER_SYNC_STEPS * REQUIRE_BATCHES * PPO_MINI_BATCH_SIZE))"
            # the trainer builds the Megatron optimizer before the rollouter tells it the updates of the run
            # (fully_async_main.py:78-92): its LR scheduler needs them > 0 then (optimizer_param_scheduler.py:156,
            # the yaml's -1 fails; verl/utils/megatron/optimizer.py:241-242)
            _fa_set actor_rollout_ref.actor.optim.total_training_steps "$((SYNCS * TRIGGER_SYNC_STEPS))"
        else  # the epochs decide the run's prompts; the updates counted here the way verl counts them
            _fa_set rollout.total_rollout_steps null
            local updates
            updates=$(_fa_updates_of_the_data) || exit $?
            _fa_set actor_rollout_ref.actor.optim.total_training_steps "${updates}"
        fi
    elif [[ -n "${SYNCS}" && "${SYNCS}" != null ]]; then  # else the epochs decide (TOTAL_EPOCHS)
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

# _fa_updates_of_the_data: the trainer's updates of a run the epochs decide, on the current set (SYNCS null), printed.
# verl 0.9.1's rollouter takes TRAIN_FILE's rows x TOTAL_EPOCHS prompts, one a step (fully_async_rollouter.py:405-407;
# its dataloader's batch is data.gen_batch_size 1, trainer/ppo/ray_trainer.py:407) and the trainer updates on every
# REQUIRE_BATCHES x PPO_MINI_BATCH_SIZE of them (fully_async_rollouter.py:424), one LR-scheduler step each
# (workers/engine_workers.py:372-376). The count reaches the Megatron
# LR scheduler only through actor.optim.total_training_steps: the trainer's own count comes after its workers are
# built (fully_async_main.py:78-92, fully_async_trainer.py:356-367). Prompts that data.filter_overlong_prompts drops
# are counted (the tokenizer is not read here): the schedule may be a little longer than the run (lr_decay_style
# constant, verl's default, makes it no matter). Stops on one line when TRAIN_FILE cannot be read or the run has no
# update.
_fa_updates_of_the_data() {
    local rows per_update=$((REQUIRE_BATCHES * PPO_MINI_BATCH_SIZE))
    if ! rows=$(python3 -c 'import sys, pyarrow.parquet as pq; print(pq.ParquetFile(sys.argv[1]).metadata.num_rows)' \
        "${TRAIN_FILE}" 2>/dev/null); then
        echo "error: SYNCS=null on pin set current: verl 0.9.1's fully-async trainer needs the run's updates before it" \
            "starts (its Megatron LR scheduler: fully_async_main.py:78-92), counted from TRAIN_FILE's rows, but" \
            "TRAIN_FILE=${TRAIN_FILE} is no readable parquet file: set SYNCS (weight syncs of the run) or TRAIN_FILE" >&2
        exit 2
    fi
    if ((rows * TOTAL_EPOCHS < per_update)); then
        echo "error: SYNCS=null on pin set current: TRAIN_FILE=${TRAIN_FILE} has ${rows} prompts x TOTAL_EPOCHS" \
            "${TOTAL_EPOCHS}, fewer than one update takes (REQUIRE_BATCHES x PPO_MINI_BATCH_SIZE = ${per_update})" >&2
        exit 2
    fi
    echo $((rows * TOTAL_EPOCHS / per_update))
}

# train_run_fully_async [EXTRA_OVERRIDE...]: the fully-async entry of the pin set: our qwen3_rl.trainer.fully_async
# (seed); verl 0.9.1's own fully_async_main (current), whose config finds ppo_megatron_trainer.yaml through a search
# path relative to the working directory (file://verl/trainer/config, fully_async_ppo_megatron_trainer.yaml:1-3):
# given here as the installed package's instead
train_run_fully_async() {
    if [[ "${PIN_SET:-seed}" == current ]]; then
        train_run verl.experimental.fully_async_policy.fully_async_main fully_async_ppo_megatron_trainer \
            "hydra.searchpath=[pkg://verl.trainer.config]" "$@"
    else
        train_run qwen3_rl.trainer.fully_async fully_async_megatron_trainer "$@"
    fi
}
