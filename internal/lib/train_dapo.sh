# shellcheck shell=bash
# DAPO defaults and overrides shared by the two DAPO train scripts (run by our entry qwen3_rl.trainer.dapo;
# keys: qwen3_rl/trainer/config/dapo_megatron_trainer.yaml). DAPO = decoupled clip (clip_ratio_low/high),
# token-mean loss, dynamic sampling (filter_groups), overlong reward shaping. Sourced after
# internal/lib/train_common.sh (GEN_BATCH_SIZE defaults to the script's TRAIN_BATCH_SIZE).
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }

CLIP_RATIO_LOW=${CLIP_RATIO_LOW:-0.2}
CLIP_RATIO_HIGH=${CLIP_RATIO_HIGH:-0.28}
GEN_BATCH_SIZE=${GEN_BATCH_SIZE:-${TRAIN_BATCH_SIZE}}
FILTER_METRIC=${FILTER_METRIC:-acc}
# [ref 000 DAPO results table]: "max retry batches (num_gen_batches) 2"; 0 = no limit.
MAX_NUM_GEN_BATCHES=${MAX_NUM_GEN_BATCHES:-2}
OVERLONG_BUFFER_LEN=${OVERLONG_BUFFER_LEN:-4096}
OVERLONG_PENALTY_FACTOR=${OVERLONG_PENALTY_FACTOR:-1.0}

# train_add_dapo_overrides: generation batch, decoupled clip, dynamic sampling, DAPO reward manager with
# overlong reward shaping (in place of GRPO's `reward_model.reward_manager=naive`). The switches FILTER_GROUPS and
# OVERLONG_BUFFER are features.toml's (train_add_feature_overrides).
train_add_dapo_overrides() {
    overrides+=(
        "data.gen_batch_size=${GEN_BATCH_SIZE}"
        "actor_rollout_ref.actor.clip_ratio_low=${CLIP_RATIO_LOW}"
        "actor_rollout_ref.actor.clip_ratio_high=${CLIP_RATIO_HIGH}"
        actor_rollout_ref.actor.clip_ratio_c=10.0
        "algorithm.filter_groups.metric=${FILTER_METRIC}"
        "algorithm.filter_groups.max_num_gen_batches=${MAX_NUM_GEN_BATCHES}"
        reward_model.reward_manager=dapo
        "reward_model.reward_kwargs.max_resp_len=${MAX_RESPONSE_LENGTH}"
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=${OVERLONG_BUFFER_LEN}"
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=${OVERLONG_PENALTY_FACTOR}"
    )
}
