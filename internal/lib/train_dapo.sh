# shellcheck shell=bash
# DAPO defaults and overrides shared by the DAPO train scripts (seed set: run by our entry qwen3_rl.trainer.dapo, keys:
# qwen3_rl/trainer/config/dapo_megatron_trainer.yaml; current set: verl 0.9.1's main_ppo, train_run_dapo below).
# DAPO = decoupled clip (clip_ratio_low/high),
# token-mean loss, dynamic sampling (filter_groups), overlong reward shaping. Sourced after
# internal/lib/train_common.sh (GEN_BATCH_SIZE defaults to the script's TRAIN_BATCH_SIZE).
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }

CLIP_RATIO_LOW=${CLIP_RATIO_LOW:-0.2}
CLIP_RATIO_HIGH=${CLIP_RATIO_HIGH:-0.28}
GEN_BATCH_SIZE=${GEN_BATCH_SIZE:-${TRAIN_BATCH_SIZE}}
FILTER_METRIC=${FILTER_METRIC:-acc}
# [ref 000 DAPO results table]: "max retry batches (num_gen_batches) 2"; 0 = no limit. Seed set only: verl 0.9.1's V1
# replay buffer refills filtered groups with no such cap (it ignores the key, trainer/ppo/v1/trainer_base.py:205-211),
# so one asked for there stops train_add_dapo_overrides
_dapo_max_num_gen_batches_asked=${MAX_NUM_GEN_BATCHES:-}
MAX_NUM_GEN_BATCHES=${MAX_NUM_GEN_BATCHES:-2}
OVERLONG_BUFFER_LEN=${OVERLONG_BUFFER_LEN:-4096}
OVERLONG_PENALTY_FACTOR=${OVERLONG_PENALTY_FACTOR:-1.0}

# train_add_dapo_overrides: generation batch, decoupled clip, dynamic sampling, DAPO reward manager with
# overlong reward shaping (in place of GRPO's `reward_model.reward_manager=naive`). The switches FILTER_GROUPS and
# OVERLONG_BUFFER are features.toml's (train_add_feature_overrides). On the current pin set (verl 0.9.1, V1 trainer
# run by verl.trainer.main_ppo) the same settings under verl 0.9.1's own keys: the reward group `reward.*`
# (trainer/config/reward/reward.yaml; the V1 trainer does not migrate the legacy reward_model.* /
# custom_reward_function.* keys: only the fully-async main does, reward_loop.py:39-89), the DAPO reward manager's
# reward_kwargs (experimental/reward_loop/reward_manager/dapo.py:33-35), and no max_num_gen_batches (V1's replay
# buffer refills filtered groups and ignores it, trainer/ppo/v1/trainer_base.py:205-211).
train_add_dapo_overrides() {
    overrides+=(
        "data.gen_batch_size=${GEN_BATCH_SIZE}"
        "actor_rollout_ref.actor.clip_ratio_low=${CLIP_RATIO_LOW}"
        "actor_rollout_ref.actor.clip_ratio_high=${CLIP_RATIO_HIGH}"
        actor_rollout_ref.actor.clip_ratio_c=10.0
        "algorithm.filter_groups.metric=${FILTER_METRIC}"
    )
    if [[ "${PIN_SET:-seed}" == current ]]; then
        if [[ -n "${_dapo_max_num_gen_batches_asked}" ]]; then
            echo "error: MAX_NUM_GEN_BATCHES=${MAX_NUM_GEN_BATCHES} on pin set current: dropped: verl 0.9.1's V1" \
                "replay buffer refills filtered groups and ignores max_num_gen_batches" \
                "(trainer/ppo/v1/trainer_base.py:205-211)" >&2
            exit 2
        fi
        overrides+=(
            reward.reward_manager.name=dapo
            "+reward.reward_kwargs.max_resp_len=${MAX_RESPONSE_LENGTH}"
            "+reward.reward_kwargs.overlong_buffer_cfg.len=${OVERLONG_BUFFER_LEN}"
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=${OVERLONG_PENALTY_FACTOR}"
            +reward.reward_kwargs.overlong_buffer_cfg.log=False
            # the seed set's DAPO config gives wrong answers -1 (qwen3_rl/trainer/config/dapo_megatron_trainer.yaml)
            +reward.custom_reward_function.reward_kwargs.incorrect_score=-1.0
        )
        return
    fi
    overrides+=(
        "algorithm.filter_groups.max_num_gen_batches=${MAX_NUM_GEN_BATCHES}"
        reward_model.reward_manager=dapo
        "reward_model.reward_kwargs.max_resp_len=${MAX_RESPONSE_LENGTH}"
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=${OVERLONG_BUFFER_LEN}"
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=${OVERLONG_PENALTY_FACTOR}"
    )
}

# train_run_dapo [EXTRA_OVERRIDE...]: the DAPO entry of the pin set: our qwen3_rl.trainer.dapo (seed), verl 0.9.1's
# own main_ppo with its ppo_megatron_trainer.yaml (current: DAPO is verl's V1 trainer with the switches above)
train_run_dapo() {
    if [[ "${PIN_SET:-seed}" == current ]]; then
        train_run verl.trainer.main_ppo ppo_megatron_trainer "$@"
    else
        train_run qwen3_rl.trainer.dapo dapo_megatron_trainer "$@"
    fi
}
