# shellcheck shell=bash
# What the train scripts (internal/train_*.sh) share: the size and path defaults that are the same for every
# setup, and functions appending the common Hydra override groups to the array `overrides`, then
# printing or running the command. The feature switches (SAM_ENABLE, OFFLOAD, ROLLOUT_EPLB, ...) are not defined
# here: features.toml declares each one once (type, default, allowed values, the keys it sets, the setups it
# applies to, what it requires or excludes) and train_add_feature_overrides turns them into overrides.
# Sourced by a train script AFTER its own defaults (some defaults here use the script's EXP_NAME, TRAIN_BATCH_SIZE, MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH) and BEFORE the defaults that
# use the ones here (TRAIN_FILE and VAL_FILE use DATA_DIR, ROLLOUT_DP uses NPUS_PER_NODE).
#
# A script provides: QWEN3_RL_HOME, NNODES, EXP_NAME, MODEL_PATH, TRAIN_BATCH_SIZE, MAX_PROMPT_LENGTH,
# MAX_RESPONSE_LENGTH, TRAIN_FILE, VAL_FILE, ACTOR_TP/PP/CP, ROLLOUT_TP, ROLLOUT_GPU_MEMORY_UTILIZATION; the "moe" layout
# also ACTOR_EP/ETP, ACTOR_PP_FIRST/LAST_STAGE_LAYERS, ROLLOUT_DP; the weight sources "dist_ckpt",
# "hf_or_dist_ckpt" and "dist_ckpt_or_mbridge" DIST_CKPT_PATH (set -u stops on a missing one).
# Every variable below is an environment variable with a default (docs/setups.md lists them all, and the
# feature switches with their defaults per setup).
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }

# ---- cluster ----------------------------------------------------------------------------------
NPUS_PER_NODE=${NPUS_PER_NODE:-16}

# ---- paths ------------------------------------------------------------------------------------
PROJECT_NAME=${PROJECT_NAME:-qwen3_rl}
DATA_DIR=${DATA_DIR:-${QWEN3_RL_HOME}/data}
CKPT_DIR=${CKPT_DIR:-${QWEN3_RL_HOME}/ckpt/${EXP_NAME}}
REWARD_FN_PATH=${REWARD_FN_PATH:-${QWEN3_RL_HOME}/qwen3_rl/data/reward.py}

# ---- batch and lengths ------------------------------------------------------------------------
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-${TRAIN_BATCH_SIZE}}
N_SAMPLES=${N_SAMPLES:-16}
MAX_TOKEN_LEN_PER_GPU=${MAX_TOKEN_LEN_PER_GPU:-$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))}
LR=${LR:-1e-6}
# entropy bonus in the actor loss (0 = off, as in the reference recipes)
ENTROPY_COEFF=${ENTROPY_COEFF:-0}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-10}
# stop after this many steps (null = TOTAL_EPOCHS decide)
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-null}
NCCL_TIMEOUT=${NCCL_TIMEOUT:-3600}

# ---- rollout (vLLM-Ascend) --------------------------------------------------------------------
ROLLOUT_MAX_NUM_SEQS=${ROLLOUT_MAX_NUM_SEQS:-256}
ROLLOUT_MAX_NUM_BATCHED_TOKENS=${ROLLOUT_MAX_NUM_BATCHED_TOKENS:-$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))}
# verl dumps each step's prompts, responses and scores as DIR/<step>.jsonl (null = off)
ROLLOUT_DATA_DIR=${ROLLOUT_DATA_DIR:-null}

# ---- checkpoints: saved by default, resumed automatically -------------------------------------
SAVE_FREQ=${SAVE_FREQ:-5}
RESUME_MODE=${RESUME_MODE:-auto}
MAX_CKPT_TO_KEEP=${MAX_CKPT_TO_KEEP:-2}
TEST_FREQ=${TEST_FREQ:--1}
LOGGER=${LOGGER:-[console]}

export PYTHONPATH="${QWEN3_RL_HOME}${PYTHONPATH:+:${PYTHONPATH}}"

# The Hydra overrides of the final command, in order; the functions below append to it.
overrides=()

# train_add_base_overrides LAYOUT WEIGHTS: algorithm and data, actor, Megatron actor and ref, rollout, in this
# order (sizes, paths and fixed settings; the feature switches come from train_add_feature_overrides).
#   LAYOUT  dense: no expert parallel | moe: Megatron EP/ETP, uneven first/last pipeline stages, vLLM DP + EP
#   WEIGHTS dist_ckpt: Megatron dist checkpoint at DIST_CKPT_PATH
#           hf_or_dist_ckpt: HF weights at MODEL_PATH unless USE_DIST_CKPT=True (docs/weights.md; the keys: features.toml)
#           random: Megatron's random init, no checkpoint read (actor/ref load_weight=False)
#           dist_ckpt_or_mbridge: Megatron dist checkpoint at DIST_CKPT_PATH unless USE_MBRIDGE=True, which reads
#                                 the HF weights at MODEL_PATH online through mbridge (docs/weights.md; features.toml)
train_add_base_overrides() {
    local layout=$1 weights=$2
    case "${layout}" in
        dense | moe) ;;
        *) echo "train_add_base_overrides: bad layout '${layout}'" >&2; exit 2 ;;
    esac
    case "${weights}" in
        dist_ckpt | hf_or_dist_ckpt | random | dist_ckpt_or_mbridge) ;;
        *) echo "train_add_base_overrides: bad weights '${weights}'" >&2; exit 2 ;;
    esac
    # read by train_add_feature_overrides (vLLM DP of the layout)
    _train_layout=${layout}
    _train_add_data_and_actor_overrides
    _train_add_megatron_overrides "${layout}" "${weights}"
    _train_add_rollout_overrides "${layout}"
}

_train_add_data_and_actor_overrides() {
    overrides+=(
        algorithm.adv_estimator=grpo
        algorithm.use_kl_in_reward=False
        "data.train_files=${TRAIN_FILE}"
        "data.val_files=${VAL_FILE}"
        data.prompt_key=prompt
        "data.train_batch_size=${TRAIN_BATCH_SIZE}"
        "data.max_prompt_length=${MAX_PROMPT_LENGTH}"
        "data.max_response_length=${MAX_RESPONSE_LENGTH}"
        data.filter_overlong_prompts=True
        data.truncation=error
        "actor_rollout_ref.model.path=${MODEL_PATH}"
        "actor_rollout_ref.nccl_timeout=${NCCL_TIMEOUT}"
        "actor_rollout_ref.actor.optim.lr=${LR}"
        "actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE}"
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
        actor_rollout_ref.actor.use_dynamic_bsz=True
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${MAX_TOKEN_LEN_PER_GPU}"
        actor_rollout_ref.actor.loss_agg_mode=token-mean
        actor_rollout_ref.actor.kl_loss_coef=0.001
        actor_rollout_ref.actor.kl_loss_type=low_var_kl
        "actor_rollout_ref.actor.entropy_coeff=${ENTROPY_COEFF}"
    )
}

# _train_add_weight_overrides ROLE WEIGHTS: where ROLE (actor|ref) reads its weights from (the weight sources
# decided by a switch, hf_or_dist_ckpt and dist_ckpt_or_mbridge, are features.toml's USE_DIST_CKPT / USE_MBRIDGE).
_train_add_weight_overrides() {
    local role=$1 weights=$2
    case "${weights}" in
        dist_ckpt)
            overrides+=(
                "actor_rollout_ref.${role}.megatron.use_dist_checkpointing=True"
                "actor_rollout_ref.${role}.megatron.dist_checkpointing_path=${DIST_CKPT_PATH}"
            )
            ;;
        random)
            # verl 0.9.1's Megatron engine always loads a dist checkpoint or the HF files (no load_weight key)
            if [[ "${PIN_SET:-seed}" == current ]]; then
                echo "error: weights random on pin set current: dropped: verl 0.9.1's Megatron engine always loads" \
                    "a dist checkpoint or HF weights (workers/engine/megatron/transformer_impl.py:499-512)" >&2
                exit 2
            fi
            # verl 0.6.1's Megatron worker keeps Megatron's init unless <role>.load_weight (docs/weights.md)
            overrides+=(
                "actor_rollout_ref.${role}.megatron.use_dist_checkpointing=False"
                "actor_rollout_ref.${role}.load_weight=False"
            )
            ;;
    esac
}

_train_add_megatron_overrides() {
    local layout=$1 weights=$2
    overrides+=(
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=${ACTOR_TP}"
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=${ACTOR_PP}"
    )
    # uneven first/last pipeline stages (MoE layouts); empty = Megatron's even split (needed with PP 1, where
    # Megatron refuses them: megatron/core/transformer/transformer_config.py:780-810)
    if [[ "${layout}" == moe && -n "${ACTOR_PP_FIRST_STAGE_LAYERS}" ]]; then
        overrides+=("+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=${ACTOR_PP_FIRST_STAGE_LAYERS}")
    fi
    if [[ "${layout}" == moe && -n "${ACTOR_PP_LAST_STAGE_LAYERS}" ]]; then
        overrides+=("+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=${ACTOR_PP_LAST_STAGE_LAYERS}")
    fi
    overrides+=("actor_rollout_ref.actor.megatron.context_parallel_size=${ACTOR_CP}")
    if [[ "${layout}" == moe ]]; then
        overrides+=(
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=${ACTOR_EP}"
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=${ACTOR_ETP}"
        )
    fi
    overrides+=(actor_rollout_ref.actor.megatron.sequence_parallel=True)
    if [[ "${PIN_SET:-seed}" == current ]]; then
        # verl 0.9.1's Megatron engine builds, loads and exports through a Bridge: the pinned one, mbridge
        # (pins.toml [sets.current.runtime]; the reference reads it from the actor's key, engine/megatron.yaml:98-99)
        overrides+=(actor_rollout_ref.actor.megatron.vanilla_mbridge=True)
    fi
    _train_add_weight_overrides actor "${weights}"
    overrides+=(
        actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
        actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
        actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=${ACTOR_TP}"
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=${ACTOR_PP}"
        "actor_rollout_ref.ref.megatron.context_parallel_size=${ACTOR_CP}"
    )
    if [[ "${layout}" == moe ]]; then
        overrides+=(
            "actor_rollout_ref.ref.megatron.expert_model_parallel_size=${ACTOR_EP}"
            "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=${ACTOR_ETP}"
        )
    fi
    _train_add_weight_overrides ref "${weights}"
    overrides+=(actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1)
}

_train_add_rollout_overrides() {
    local layout=$1
    overrides+=(
        actor_rollout_ref.rollout.name=vllm
        "actor_rollout_ref.rollout.n=${N_SAMPLES}"
        actor_rollout_ref.rollout.temperature=1.0
        actor_rollout_ref.rollout.top_p=1.0
        actor_rollout_ref.rollout.top_k=-1
        "actor_rollout_ref.rollout.tensor_model_parallel_size=${ROLLOUT_TP}"
        actor_rollout_ref.rollout.data_parallel_size=1
        actor_rollout_ref.rollout.expert_parallel_size=1
    )
    if [[ "${layout}" == moe ]]; then
        # sync SPMD (docs/rollout_mode.md): verl's rollout DP stays 1; vLLM's DP (+ EP: ROLLOUT_ENABLE_EP) go to vLLM
        overrides+=("+actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size=${ROLLOUT_DP}")
    fi
    overrides+=(
        "actor_rollout_ref.rollout.gpu_memory_utilization=${ROLLOUT_GPU_MEMORY_UTILIZATION}"
        "actor_rollout_ref.rollout.max_num_seqs=${ROLLOUT_MAX_NUM_SEQS}"
        "actor_rollout_ref.rollout.max_num_batched_tokens=${ROLLOUT_MAX_NUM_BATCHED_TOKENS}"
        actor_rollout_ref.rollout.enable_chunked_prefill=True
        actor_rollout_ref.rollout.enable_prefix_caching=True
        actor_rollout_ref.rollout.load_format=dummy
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
    )
}

# train_add_trainer_overrides: reward function, Ray runtime env (PYTHONPATH for every worker), trainer
# (logging, layout, epochs, checkpoint save/resume, validation).
train_add_trainer_overrides() {
    # the reward function: on the current pin set under verl 0.9.1's reward group (trainer/config/reward/reward.yaml:
    # 8-13, read by trainer/ppo/reward.py:70): its V1 main_ppo leaves the legacy custom_reward_function.* unread
    # (only the fully-async main migrates them, experimental/reward_loop/reward_loop.py:57-60)
    local reward_group=""
    [[ "${PIN_SET:-seed}" != current ]] || reward_group=reward.
    overrides+=(
        "${reward_group}custom_reward_function.path=${REWARD_FN_PATH}"
        "${reward_group}custom_reward_function.name=compute_score"
        "+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH='${PYTHONPATH}'"
        trainer.device=npu
        "trainer.logger=${LOGGER}"
        "trainer.project_name=${PROJECT_NAME}"
        "trainer.experiment_name=${EXP_NAME}"
        "trainer.nnodes=${NNODES}"
        "trainer.n_gpus_per_node=${NPUS_PER_NODE}"
        "trainer.total_epochs=${TOTAL_EPOCHS}"
        "trainer.total_training_steps=${TOTAL_TRAINING_STEPS}"
        "trainer.rollout_data_dir=${ROLLOUT_DATA_DIR}"
        "trainer.save_freq=${SAVE_FREQ}"
        "trainer.resume_mode=${RESUME_MODE}"
        "trainer.default_local_dir=${CKPT_DIR}"
        "trainer.max_actor_ckpt_to_keep=${MAX_CKPT_TO_KEEP}"
        "trainer.test_freq=${TEST_FREQ}"
    )
}

# train_add_feature_overrides [SETUP]: the feature switches of this setup (features.toml; README "Switches"): each env var
# (unset or empty = the registry default for this setup) is validated, the requires / excludes rules are checked,
# and the keys each switch sets are appended. A bad value or a broken rule stops the script with one line, e.g.
#   error: SAM_ENABLE='yes': expected one of True, False
# SETUP (default: the train script's file name) names the setup in features.toml whose switches and defaults apply;
# a copy of a train script under another name passes the one it is based on. The sizes the rules and defaults need
# are passed as context. Call it after train_add_base_overrides.
train_add_feature_overrides() {
    local setup=${1:-} vllm_dp=1 got=()
    [[ -n "${setup}" ]] || setup=$(basename "${BASH_SOURCE[-1]}")
    if [[ "${_train_layout:?train_add_base_overrides first}" == moe ]]; then
        vllm_dp=${ROLLOUT_DP}
    fi
    # NUL-separated output, then "ok" when the command succeeded (a process substitution's exit status is lost)
    mapfile -d '' -t got < <(
        python3 -m qwen3_rl features overrides --setup "${setup}" \
            --context "VLLM_DP=${vllm_dp}" --context "ROLLOUT_TP=${ROLLOUT_TP}" \
            --context "TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE}" --context "PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE}" \
            --context "DIST_CKPT_PATH=${DIST_CKPT_PATH:-}" --context "RECIPE_DIR=${QWEN3_RL_HOME}" \
            --context "ROLLOUT_PROCS_PER_NODE=${_rollout_procs_per_node:-${NPUS_PER_NODE}}" && printf 'ok\0'
    )
    if ((${#got[@]} == 0)) || [[ "${got[${#got[@]} - 1]}" != ok ]]; then
        exit 2
    fi
    overrides+=("${got[@]:0:${#got[@]} - 1}")
}

# train_run MODULE CONFIG_NAME [EXTRA_OVERRIDE...]: exec `python3 -m MODULE --config-name CONFIG_NAME
# <overrides> <extra>`; with QWEN3_RL_PRINT_COMMAND=1 print it instead, NUL-separated (argv length, argv,
# then the environment: qwen3_rl/tools/launch/train_script.py reads it) and exit 0.
train_run() {
    local module=$1 config_name=$2
    shift 2
    local cmd=(python3 -m "${module}" --config-name "${config_name}" "${overrides[@]}" "$@")
    if [[ "${QWEN3_RL_PRINT_COMMAND:-0}" == 1 ]]; then
        printf '%s\0' "${#cmd[@]}" "${cmd[@]}"
        env -0
        exit 0
    fi
    exec "${cmd[@]}"
}
