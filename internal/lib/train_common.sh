# shellcheck shell=bash
# What the five train scripts (internal/train_*.sh) share: the defaults that are the same for every
# setup, and functions appending the common Hydra override groups to the array `overrides`, then
# printing or running the command. Sourced by a train script AFTER its own defaults (some defaults here
# use the script's EXP_NAME, TRAIN_BATCH_SIZE, MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH) and BEFORE the defaults that
# use the ones here (TRAIN_FILE and VAL_FILE use DATA_DIR, ROLLOUT_DP uses NPUS_PER_NODE).
#
# A script provides: QWEN3_RL_HOME, NNODES, EXP_NAME, MODEL_PATH, TRAIN_BATCH_SIZE, MAX_PROMPT_LENGTH,
# MAX_RESPONSE_LENGTH, TRAIN_FILE, VAL_FILE, ACTOR_TP/PP/CP, ROLLOUT_TP, ROLLOUT_GPU_MEMORY_UTILIZATION; the "moe" layout also ACTOR_EP/ETP,
# ACTOR_PP_FIRST/LAST_STAGE_LAYERS, ROLLOUT_DP, ROLLOUT_ENABLE_EP, MOE_ALLTOALLV; the weight sources "dist_ckpt" and
# "hf_or_dist_ckpt" DIST_CKPT_PATH, "hf_or_dist_ckpt" USE_DIST_CKPT, "dist_ckpt_or_mbridge" DIST_CKPT_PATH and
# USE_MBRIDGE (set -u stops on a missing one).
# Every variable below is an environment variable with a default (docs/setups.md lists them all).
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
USE_KL_LOSS=${USE_KL_LOSS:-False}
# entropy bonus in the actor loss (0 = off, as in the reference recipes)
ENTROPY_COEFF=${ENTROPY_COEFF:-0}
# on-policy update without the old-log-prob pass (docs/old_log_prob.md); needs PPO_MINI_BATCH_SIZE == TRAIN_BATCH_SIZE
USE_CURRENT_LOG_PROB_AS_OLD=${USE_CURRENT_LOG_PROB_AS_OLD:-False}
# MoE actor only: MindSpeed all-to-all overlap with GroupedMLP (weight1/weight2) experts; verl patch 0012
# converts their weights for the rollout sync (docs/fused_experts.md). Ignored by the dense layout.
MOE_ALLTOALL_OVERLAP=${MOE_ALLTOALL_OVERLAP:-False}
# MoE actor only: MindSpeed "MoE zero memory" (seed 002 section 4.1; docs/moe_memory.md): disable | level0 | level1,
# and for level1 the number of layers per pipeline stage it applies to (empty = MindSpeed's default).
MOE_ZERO_MEMORY=${MOE_ZERO_MEMORY:-disable}
MOE_ZERO_MEMORY_NUM_LAYERS=${MOE_ZERO_MEMORY_NUM_LAYERS:-}
# MindSpeed's fused rotary embedding in the actor (seed 001: position_embedding_type=rope +
# use_fused_rotary_pos_emb=True through override_transformer_config): True | False
FUSED_ROPE=${FUSED_ROPE:-False}
# rollout load balancing (docs/rollout_balancing.md)
DATA_REBALANCE=${DATA_REBALANCE:-False}
ROLLOUT_REBALANCE=${ROLLOUT_REBALANCE:-False}
ROLLOUT_REBALANCE_INTERVAL_STEPS=${ROLLOUT_REBALANCE_INTERVAL_STEPS:-32}
ROLLOUT_REBALANCE_MAX_MOVES=${ROLLOUT_REBALANCE_MAX_MOVES:-128}
# KV bytes one vLLM DP rank may send + receive per rebalance round; more waits for the next round (0 = no cap)
ROLLOUT_REBALANCE_MAX_KV_BYTES=${ROLLOUT_REBALANCE_MAX_KV_BYTES:-4000000000}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-10}
# stop after this many steps (null = TOTAL_EPOCHS decide)
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-null}
OFFLOAD=${OFFLOAD:-True}
NCCL_TIMEOUT=${NCCL_TIMEOUT:-3600}

# ---- rollout (vLLM-Ascend) --------------------------------------------------------------------
ROLLOUT_MAX_NUM_SEQS=${ROLLOUT_MAX_NUM_SEQS:-256}
ROLLOUT_MAX_NUM_BATCHED_TOKENS=${ROLLOUT_MAX_NUM_BATCHED_TOKENS:-$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))}
ROLLOUT_ENFORCE_EAGER=${ROLLOUT_ENFORCE_EAGER:-False}
# vLLM sleep mode between rollouts (frees weights + KV for training; needs the device allocator, so False on CPU)
ROLLOUT_FREE_CACHE_ENGINE=${ROLLOUT_FREE_CACHE_ENGINE:-True}
# verl dumps each step's prompts, responses and scores as DIR/<step>.jsonl (null = off)
ROLLOUT_DATA_DIR=${ROLLOUT_DATA_DIR:-null}
# graph capture buckets: from the published recipe's scripts
GRAPH_CAPTURE_SIZES=${GRAPH_CAPTURE_SIZES:-[8,16,32,64,96,128,160,192,224,256]}
# qwen3_rl switches (README "Switches"): tqdm progress in the rollout, gc off during each engine step
ROLLOUT_USE_TQDM=${ROLLOUT_USE_TQDM:-False}
DISABLE_GC_IN_ENGINE_STEP=${DISABLE_GC_IN_ENGINE_STEP:-False}
# off switches of always-on fixes (README "Switches"; to bisect a first cluster run, False = upstream verl 0.6.1):
# verl 0004 expandable-segments hot swap around vLLM sleep/wake also on the NPU allocator
NPU_EXPANDABLE_SEGMENTS=${NPU_EXPANDABLE_SEGMENTS:-True}
# verl 0009 real torch.compile for the vLLM rollout (MindSpeed replaces it with a no-op in the Megatron worker)
ROLLOUT_REAL_TORCH_COMPILE=${ROLLOUT_REAL_TORCH_COMPILE:-True}
# verl 0011 GRAPH_CAPTURE_SIZES reach vLLM (upstream drops the plain list the Megatron worker holds)
ROLLOUT_PLAIN_LIST_CAPTURE_SIZES=${ROLLOUT_PLAIN_LIST_CAPTURE_SIZES:-True}
# SAM speculative decoding (docs/sam_decoding.md) and npugraph_ex; engine keys are emitted only when on.
# SAM_BS_THRESHOLD: drafting off while a vLLM step runs more requests than this (0 = never off).
SAM_ENABLE=${SAM_ENABLE:-False}
SAM_K=${SAM_K:-3}
SAM_GROUP=${SAM_GROUP:-False}
# SAM_GROUP_EXCHANGE: siblings' accepted tokens shared among the vLLM DP ranks (needs SAM_GROUP=True, vLLM DP > 1)
SAM_GROUP_EXCHANGE=${SAM_GROUP_EXCHANGE:-False}
SAM_BS_THRESHOLD=${SAM_BS_THRESHOLD:-0}
NPUGRAPH_EX=${NPUGRAPH_EX:-False}

# ---- checkpoints: saved by default, resumed automatically -------------------------------------
SAVE_FREQ=${SAVE_FREQ:-5}
RESUME_MODE=${RESUME_MODE:-auto}
MAX_CKPT_TO_KEEP=${MAX_CKPT_TO_KEEP:-2}
TEST_FREQ=${TEST_FREQ:--1}
VAL_BEFORE_TRAIN=${VAL_BEFORE_TRAIN:-False}
LOGGER=${LOGGER:-[console]}

export PYTHONPATH="${QWEN3_RL_HOME}${PYTHONPATH:+:${PYTHONPATH}}"

# The Hydra overrides of the final command, in order; the functions below append to it.
overrides=()

# train_add_base_overrides LAYOUT WEIGHTS: algorithm and data, actor, Megatron actor and ref, rollout
# (with the qwen3_rl feature switches), in this order.
#   LAYOUT  dense: no expert parallel | moe: Megatron EP/ETP, uneven first/last pipeline stages, vLLM DP + EP
#   WEIGHTS dist_ckpt: Megatron dist checkpoint at DIST_CKPT_PATH
#           hf_or_dist_ckpt: HF weights at MODEL_PATH unless USE_DIST_CKPT=True (docs/weights.md)
#           random: Megatron's random init, no checkpoint read (actor/ref load_weight=False)
#           dist_ckpt_or_mbridge: Megatron dist checkpoint at DIST_CKPT_PATH unless USE_MBRIDGE=True, which reads
#                                 the HF weights at MODEL_PATH online through mbridge (docs/weights.md)
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
        "actor_rollout_ref.actor.use_kl_loss=${USE_KL_LOSS}"
        "actor_rollout_ref.actor.use_current_log_prob_as_old=${USE_CURRENT_LOG_PROB_AS_OLD}"
        actor_rollout_ref.actor.kl_loss_coef=0.001
        actor_rollout_ref.actor.kl_loss_type=low_var_kl
        "actor_rollout_ref.actor.entropy_coeff=${ENTROPY_COEFF}"
    )
}

# _train_add_weight_overrides ROLE WEIGHTS: where ROLE (actor|ref) reads its weights from.
_train_add_weight_overrides() {
    local role=$1 weights=$2
    case "${weights}" in
        dist_ckpt)
            overrides+=(
                "actor_rollout_ref.${role}.megatron.use_dist_checkpointing=True"
                "actor_rollout_ref.${role}.megatron.dist_checkpointing_path=${DIST_CKPT_PATH}"
            )
            ;;
        hf_or_dist_ckpt)
            # keys spelled out for the README switch table (qwen3_rl/readme.py reads `key=${VAR}`)
            if [[ "${role}" == actor ]]; then
                overrides+=("actor_rollout_ref.actor.megatron.use_dist_checkpointing=${USE_DIST_CKPT}")
            else
                overrides+=("actor_rollout_ref.ref.megatron.use_dist_checkpointing=${USE_DIST_CKPT}")
            fi
            overrides+=("actor_rollout_ref.${role}.megatron.dist_checkpointing_path=${DIST_CKPT_PATH}")
            ;;
        dist_ckpt_or_mbridge)
            # use_dist_checkpointing wins over mbridge in verl 0.6.1's worker (megatron_workers.py:334-341): mbridge
            # loads the HF weights only with it off, as seed 001 sets it
            if [[ "${USE_MBRIDGE}" == True ]]; then
                overrides+=("actor_rollout_ref.${role}.megatron.use_dist_checkpointing=False")
            else
                overrides+=(
                    "actor_rollout_ref.${role}.megatron.use_dist_checkpointing=True"
                    "actor_rollout_ref.${role}.megatron.dist_checkpointing_path=${DIST_CKPT_PATH}"
                )
            fi
            ;;
        random)
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
    if [[ "${weights}" == dist_ckpt_or_mbridge ]]; then
        case "${USE_MBRIDGE}" in
            True | False) ;;
            *) echo "USE_MBRIDGE must be True or False, got '${USE_MBRIDGE}'" >&2; exit 2 ;;
        esac
        # mbridge exports the weights itself: verl 0012 / 0013 convert only verl's own export (their patch headers)
        if [[ "${USE_MBRIDGE}" == True && ( "${MOE_ALLTOALLV}" == True || "${MOE_ALLTOALL_OVERLAP,,}" =~ ^(true|1)$ ) ]]; then
            echo "USE_MBRIDGE=True cannot be combined with MOE_ALLTOALLV=True or MOE_ALLTOALL_OVERLAP=True (verl 0012/0013 convert only verl's own weight export, not mbridge's)" >&2
            exit 2
        fi
        # ref reads use_mbridge from the actor (verl trainer/config/ref/megatron_ref.yaml:17)
        overrides+=("actor_rollout_ref.actor.megatron.use_mbridge=${USE_MBRIDGE}")
    fi
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
        case "${MOE_ALLTOALL_OVERLAP}" in
            True | true | 1)
                overrides+=("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_alltoall_overlap_comm=True") ;;
            False | false | 0) ;;
            *) echo "MOE_ALLTOALL_OVERLAP must be True or False, got '${MOE_ALLTOALL_OVERLAP}'" >&2; exit 2 ;;
        esac
        case "${MOE_ZERO_MEMORY}" in
            disable) ;;
            level0 | level1)
                overrides+=("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_zero_memory=${MOE_ZERO_MEMORY}")
                if [[ -n "${MOE_ZERO_MEMORY_NUM_LAYERS}" ]]; then
                    overrides+=("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_zero_memory_num_layers=${MOE_ZERO_MEMORY_NUM_LAYERS}")
                fi
                ;;
            *) echo "MOE_ZERO_MEMORY must be disable, level0 or level1, got '${MOE_ZERO_MEMORY}'" >&2; exit 2 ;;
        esac
        # MindSpeed acts on moe_zero_memory only together with moe_alltoall_overlap_comm
        # (mindspeed/features_manager/moe/moe_zero_memory.py:33,37): refuse it alone instead of running without it
        case "${MOE_ZERO_MEMORY}:${MOE_ALLTOALL_OVERLAP}" in
            level0:True | level0:true | level0:1 | level1:True | level1:true | level1:1 | disable:*) ;;
            *) echo "MOE_ZERO_MEMORY=${MOE_ZERO_MEMORY} needs MOE_ALLTOALL_OVERLAP=True (MindSpeed applies moe_zero_memory only with moe_alltoall_overlap_comm)" >&2
               exit 2 ;;
        esac
    fi
    overrides+=(
        actor_rollout_ref.actor.megatron.sequence_parallel=True
        "actor_rollout_ref.actor.megatron.param_offload=${OFFLOAD}"
        "actor_rollout_ref.actor.megatron.grad_offload=${OFFLOAD}"
        "actor_rollout_ref.actor.megatron.optimizer_offload=${OFFLOAD}"
    )
    _train_add_weight_overrides actor "${weights}"
    overrides+=(
        actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
        actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
        actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
    )
    case "${FUSED_ROPE}" in
        True)
            # MindSpeed reads both through repatch(override_transformer_config) (verl megatron_workers.py:190-192)
            overrides+=(
                +actor_rollout_ref.actor.megatron.override_transformer_config.position_embedding_type=rope
                +actor_rollout_ref.actor.megatron.override_transformer_config.use_fused_rotary_pos_emb=True
            )
            ;;
        False) ;;
        *) echo "FUSED_ROPE must be True or False, got '${FUSED_ROPE}'" >&2; exit 2 ;;
    esac
    overrides+=(
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
    overrides+=("actor_rollout_ref.ref.megatron.param_offload=${OFFLOAD}")
    _train_add_weight_overrides ref "${weights}"
    overrides+=(actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1)
}

_train_add_rollout_overrides() {
    local layout=$1 vllm_dp=1
    if [[ "${layout}" == moe ]]; then
        vllm_dp=${ROLLOUT_DP}
    fi
    # rollout rebalance moves requests between vLLM DP ranks (docs/rollout_balancing.md); with vLLM DP 1 (the dense
    # setups: independent TP engines) the engine hook refuses at start-up, so refuse here, before anything loads
    if [[ "${ROLLOUT_REBALANCE,,}" == true ]] && ! { [[ "${vllm_dp}" =~ ^[0-9]{1,9}$ ]] && ((10#${vllm_dp} > 1)); }; then
        echo "ROLLOUT_REBALANCE=True needs vLLM data parallelism > 1 (this setup runs vLLM DP ${vllm_dp}: nothing to move requests between)" >&2
        exit 2
    fi
    [[ "${ROLLOUT_REBALANCE_MAX_KV_BYTES}" =~ ^[0-9]{1,15}$ ]] || {
        echo "ROLLOUT_REBALANCE_MAX_KV_BYTES must be a non-negative integer (bytes per rank and round, 0 = no cap), got '${ROLLOUT_REBALANCE_MAX_KV_BYTES}'" >&2
        exit 2
    }
    overrides+=(
        actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.mode=sync
        "actor_rollout_ref.rollout.n=${N_SAMPLES}"
        actor_rollout_ref.rollout.temperature=1.0
        actor_rollout_ref.rollout.top_p=1.0
        actor_rollout_ref.rollout.top_k=-1
        "actor_rollout_ref.rollout.tensor_model_parallel_size=${ROLLOUT_TP}"
        actor_rollout_ref.rollout.data_parallel_size=1
        actor_rollout_ref.rollout.expert_parallel_size=1
    )
    if [[ "${layout}" == moe ]]; then
        # sync SPMD (docs/rollout_mode.md): verl's rollout DP stays 1; vLLM's DP + EP go to vLLM itself
        overrides+=(
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size=${ROLLOUT_DP}"
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel=${ROLLOUT_ENABLE_EP}"
        )
        # expert weights to the vLLM EP ranks by all-to-allv (verl 0013)
        case "${MOE_ALLTOALLV}" in
            True | False) ;;
            *) echo "MOE_ALLTOALLV must be True or False, got '${MOE_ALLTOALLV}'" >&2; exit 2 ;;
        esac
        # verl 0013 sends each rank the experts of vLLM's default (linear) EP placement: refuse here, before any
        # model loads, what it would refuse at the first weight sync
        case "${MOE_ALLTOALLV}:${ROLLOUT_ENABLE_EP}" in
            True:True | False:*) ;;
            *) echo "MOE_ALLTOALLV=True needs ROLLOUT_ENABLE_EP=True (vLLM expert parallel), got '${ROLLOUT_ENABLE_EP}'" >&2
               exit 2 ;;
        esac
        case "${MOE_ALLTOALLV}:${ROLLOUT_EPLB:-False}" in
            True:True | True:true | True:1)
                echo "MOE_ALLTOALLV=True cannot be combined with ROLLOUT_EPLB=True (EPLB moves experts off vLLM's default placement)" >&2
                exit 2 ;;
        esac
        overrides+=("actor_rollout_ref.actor.moe_alltoallv=${MOE_ALLTOALLV}")
    fi
    local _flag
    for _flag in NPU_EXPANDABLE_SEGMENTS ROLLOUT_REAL_TORCH_COMPILE ROLLOUT_PLAIN_LIST_CAPTURE_SIZES ROLLOUT_FREE_CACHE_ENGINE; do
        case "${!_flag}" in
            True | False) ;;
            *) echo "${_flag} must be True or False, got '${!_flag}'" >&2; exit 2 ;;
        esac
    done
    overrides+=(
        "actor_rollout_ref.rollout.gpu_memory_utilization=${ROLLOUT_GPU_MEMORY_UTILIZATION}"
        "actor_rollout_ref.rollout.max_num_seqs=${ROLLOUT_MAX_NUM_SEQS}"
        "actor_rollout_ref.rollout.max_num_batched_tokens=${ROLLOUT_MAX_NUM_BATCHED_TOKENS}"
        "actor_rollout_ref.rollout.enforce_eager=${ROLLOUT_ENFORCE_EAGER}"
        "actor_rollout_ref.rollout.use_tqdm=${ROLLOUT_USE_TQDM}"
        "actor_rollout_ref.rollout.disable_gc_in_engine_step=${DISABLE_GC_IN_ENGINE_STEP}"
        "actor_rollout_ref.rollout.npu_expandable_segments=${NPU_EXPANDABLE_SEGMENTS}"
        "actor_rollout_ref.rollout.real_torch_compile=${ROLLOUT_REAL_TORCH_COMPILE}"
        "actor_rollout_ref.rollout.plain_list_capture_sizes=${ROLLOUT_PLAIN_LIST_CAPTURE_SIZES}"
        "actor_rollout_ref.rollout.data_rebalance=${DATA_REBALANCE}"
        "actor_rollout_ref.rollout.rollout_rebalance=${ROLLOUT_REBALANCE}"
        "actor_rollout_ref.rollout.rollout_rebalance_interval_steps=${ROLLOUT_REBALANCE_INTERVAL_STEPS}"
        "actor_rollout_ref.rollout.rollout_rebalance_max_moves=${ROLLOUT_REBALANCE_MAX_MOVES}"
        "actor_rollout_ref.rollout.rollout_rebalance_max_kv_bytes=${ROLLOUT_REBALANCE_MAX_KV_BYTES}"
        actor_rollout_ref.rollout.enable_chunked_prefill=True
        actor_rollout_ref.rollout.enable_prefix_caching=True
        "actor_rollout_ref.rollout.free_cache_engine=${ROLLOUT_FREE_CACHE_ENGINE}"
        actor_rollout_ref.rollout.load_format=dummy
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
    )
    if [[ "${layout}" == moe ]]; then
        # chunked MoE in prefill (vllm_ascend patch 0005): the vLLM-Ascend additional_config key only when > 0
        [[ "${MOE_PREFILL_CHUNK_SIZE}" =~ ^[0-9]{1,9}$ ]] || {
            echo "MOE_PREFILL_CHUNK_SIZE must be a non-negative integer (tokens per chunk, 0 = off), got '${MOE_PREFILL_CHUNK_SIZE}'" >&2
            exit 2
        }
        if ((10#${MOE_PREFILL_CHUNK_SIZE} > 0)); then
            overrides+=("+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.moe_prefill_chunk_size=$((10#${MOE_PREFILL_CHUNK_SIZE}))")
        fi
    fi
}

# train_add_trainer_overrides: reward function, Ray runtime env (PYTHONPATH for every worker), trainer
# (logging, layout, epochs, checkpoint save/resume, validation).
train_add_trainer_overrides() {
    overrides+=(
        "custom_reward_function.path=${REWARD_FN_PATH}"
        custom_reward_function.name=compute_score
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
        "trainer.val_before_train=${VAL_BEFORE_TRAIN}"
    )
}

# train_add_sam_npugraph_ex_overrides: SAM speculative decoding and npugraph_ex engine keys, only when
# on; any value other than True/False for SAM_ENABLE, SAM_GROUP, SAM_GROUP_EXCHANGE, NPUGRAPH_EX stops the script;
# SAM_GROUP_EXCHANGE=True without SAM_ENABLE=True SAM_GROUP=True or with vLLM DP 1 stops it too.
train_add_sam_npugraph_ex_overrides() {
    local _flag _vllm_kw=actor_rollout_ref.rollout.engine_kwargs.vllm
    for _flag in SAM_ENABLE SAM_GROUP SAM_GROUP_EXCHANGE NPUGRAPH_EX; do
        [[ "${!_flag}" == True || "${!_flag}" == False ]] || { echo "${_flag} must be True or False" >&2; exit 2; }
    done
    if [[ "${SAM_GROUP_EXCHANGE}" == True ]]; then
        # the exchange feeds the group automata of the SAM drafter across vLLM DP ranks (docs/sam_decoding.md)
        local _o _vllm_dp=1
        for _o in "${overrides[@]}"; do
            [[ "${_o}" == "+${_vllm_kw}.data_parallel_size="* ]] && _vllm_dp=${_o#*=}
        done
        if [[ "${SAM_ENABLE}" != True || "${SAM_GROUP}" != True ]]; then
            echo "SAM_GROUP_EXCHANGE=True needs SAM_ENABLE=True and SAM_GROUP=True (got SAM_ENABLE=${SAM_ENABLE}, SAM_GROUP=${SAM_GROUP})" >&2
            exit 2
        fi
        if ! { [[ "${_vllm_dp}" =~ ^[0-9]{1,9}$ ]] && ((10#${_vllm_dp} > 1)); }; then
            echo "SAM_GROUP_EXCHANGE=True needs vLLM data parallelism > 1 (this setup runs vLLM DP ${_vllm_dp}: every engine already holds all the siblings it serves)" >&2
            exit 2
        fi
    fi
    if [[ "${SAM_ENABLE}" == True ]]; then
        overrides+=(
            "+${_vllm_kw}.speculative_config.method=sam"
            "+${_vllm_kw}.speculative_config.num_speculative_tokens=${SAM_K}"
            "+${_vllm_kw}.speculative_config.sam_config.group_mode=${SAM_GROUP}"
            "+${_vllm_kw}.speculative_config.sam_config.pad_drafts=${NPUGRAPH_EX}"
            # vLLM's stats on: its spec-decode counters become the rollout/spec_decode/* step metrics (verl 0016)
            actor_rollout_ref.rollout.disable_log_stats=False
        )
        if [[ "${SAM_BS_THRESHOLD}" != 0 ]]; then
            overrides+=("+${_vllm_kw}.speculative_config.disable_by_batch_size=${SAM_BS_THRESHOLD}")
        fi
        if [[ "${SAM_GROUP_EXCHANGE}" == True ]]; then
            overrides+=("+${_vllm_kw}.speculative_config.sam_config.group_exchange=True")
        fi
    fi
    if [[ "${NPUGRAPH_EX}" == True ]]; then
        # npugraph_ex needs FULL_DECODE_ONLY graphs (vLLM-Ascend turns it off under PIECEWISE); verl 0.6.1
        # builds compilation_config only from cudagraph_capture_sizes, so sizes and mode go to vLLM directly.
        overrides+=(
            actor_rollout_ref.rollout.cudagraph_capture_sizes=null
            "+${_vllm_kw}.compilation_config.cudagraph_mode=FULL_DECODE_ONLY"
            "+${_vllm_kw}.compilation_config.cudagraph_capture_sizes=${GRAPH_CAPTURE_SIZES}"
            "+${_vllm_kw}.additional_config.enable_npugraph_ex=True"
        )
    else
        overrides+=("actor_rollout_ref.rollout.cudagraph_capture_sizes=${GRAPH_CAPTURE_SIZES}")
    fi
}

# train_run MODULE CONFIG_NAME [EXTRA_OVERRIDE...]: exec `python3 -m MODULE --config-name CONFIG_NAME
# <overrides> <extra>`; with QWEN3_RL_PRINT_COMMAND=1 print it instead, NUL-separated (argv length, argv,
# then the environment: qwen3_rl/launch/train_script.py reads it) and exit 0.
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
