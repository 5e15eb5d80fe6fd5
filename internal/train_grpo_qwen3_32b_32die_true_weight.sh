#!/usr/bin/env bash
# GRPO, Qwen3-32B (dense), real weights, 2 nodes x 16 dies (Atlas A3 16 cards = 32 dies), deepscaler.
#
# Seed facts (recipe README): 2 nodes, GBS 128, n=16, prompt 2048, response 34816, rollout TP8.
# NOT in the seeds, taken from the published recipe's scripts: actor TP8 PP2 CP2 and the
# multi-bucket graph capture sizes.
#
# Rollout mode: sync SPMD (see docs/rollout_mode.md): 4 independent TP8 vLLM engines (dense model,
# no expert parallel), each given a quarter of the batch by verl's rollout mesh.
#
# Every path and size is an environment variable with a default; extra Hydra overrides may be passed
# as arguments. QWEN3_RL_PRINT_COMMAND=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail

QWEN3_RL_HOME=${QWEN3_RL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

# ---- cluster ----------------------------------------------------------------------------------
NNODES=${NNODES:-2}
NPUS_PER_NODE=${NPUS_PER_NODE:-16}

# ---- paths ------------------------------------------------------------------------------------
EXP_NAME=${EXP_NAME:-grpo_qwen3_32b_32die_true_weight}
PROJECT_NAME=${PROJECT_NAME:-qwen3_rl}
MODEL_PATH=${MODEL_PATH:-${QWEN3_RL_HOME}/Qwen3-32B}
# The seed loads the HF weights directly (only the source rank reads them); USE_DIST_CKPT=True
# loads a converted Megatron checkpoint instead (docs/weights.md).
USE_DIST_CKPT=${USE_DIST_CKPT:-False}
DIST_CKPT_PATH=${DIST_CKPT_PATH:-${QWEN3_RL_HOME}/Qwen3-32B-mcore}
DATA_DIR=${DATA_DIR:-${QWEN3_RL_HOME}/data}
TRAIN_FILE=${TRAIN_FILE:-${DATA_DIR}/deepscaler/train.parquet}
VAL_FILE=${VAL_FILE:-${DATA_DIR}/aime2024/test.parquet}
CKPT_DIR=${CKPT_DIR:-${QWEN3_RL_HOME}/ckpt/${EXP_NAME}}
REWARD_FN_PATH=${REWARD_FN_PATH:-${QWEN3_RL_HOME}/qwen3_rl/data/reward.py}

# ---- batch and lengths ------------------------------------------------------------------------
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-${TRAIN_BATCH_SIZE}}
N_SAMPLES=${N_SAMPLES:-16}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-2048}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-34816}
MAX_TOKEN_LEN_PER_GPU=${MAX_TOKEN_LEN_PER_GPU:-$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))}
LR=${LR:-1e-6}
USE_KL_LOSS=${USE_KL_LOSS:-False}
# on-policy update without the old-log-prob pass (docs/old_log_prob.md); needs PPO_MINI_BATCH_SIZE == TRAIN_BATCH_SIZE
USE_CURRENT_LOG_PROB_AS_OLD=${USE_CURRENT_LOG_PROB_AS_OLD:-False}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-10}

# ---- actor (Megatron) parallelism: from the published recipe's scripts ------------------------
ACTOR_TP=${ACTOR_TP:-8}
ACTOR_PP=${ACTOR_PP:-2}
ACTOR_CP=${ACTOR_CP:-2}
OFFLOAD=${OFFLOAD:-True}

# ---- rollout (vLLM-Ascend) --------------------------------------------------------------------
ROLLOUT_TP=${ROLLOUT_TP:-8}
ROLLOUT_GPU_MEMORY_UTILIZATION=${ROLLOUT_GPU_MEMORY_UTILIZATION:-0.85}
ROLLOUT_MAX_NUM_SEQS=${ROLLOUT_MAX_NUM_SEQS:-256}
ROLLOUT_MAX_NUM_BATCHED_TOKENS=${ROLLOUT_MAX_NUM_BATCHED_TOKENS:-$((MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH))}
ROLLOUT_ENFORCE_EAGER=${ROLLOUT_ENFORCE_EAGER:-False}
# qwen3_rl switches (README "Switches"): tqdm progress in the rollout, gc off during each engine step
ROLLOUT_USE_TQDM=${ROLLOUT_USE_TQDM:-False}
DISABLE_GC_IN_ENGINE_STEP=${DISABLE_GC_IN_ENGINE_STEP:-False}
# SAM speculative decoding (docs/sam_decoding.md) and npugraph_ex; engine keys are emitted only when on.
# SAM_BS_THRESHOLD: drafting off while a vLLM step runs more requests than this (0 = never off).
SAM_ENABLE=${SAM_ENABLE:-False}
SAM_K=${SAM_K:-3}
SAM_GROUP=${SAM_GROUP:-False}
SAM_BS_THRESHOLD=${SAM_BS_THRESHOLD:-0}
NPUGRAPH_EX=${NPUGRAPH_EX:-False}
DATA_REBALANCE=${DATA_REBALANCE:-False}
ROLLOUT_REBALANCE=${ROLLOUT_REBALANCE:-False}
ROLLOUT_REBALANCE_INTERVAL_STEPS=${ROLLOUT_REBALANCE_INTERVAL_STEPS:-32}
ROLLOUT_REBALANCE_MAX_MOVES=${ROLLOUT_REBALANCE_MAX_MOVES:-128}
GRAPH_CAPTURE_SIZES=${GRAPH_CAPTURE_SIZES:-[8,16,32,64,96,128,160,192,224,256]}

# ---- checkpoints: saved by default, resumed automatically -------------------------------------
SAVE_FREQ=${SAVE_FREQ:-5}
RESUME_MODE=${RESUME_MODE:-auto}
MAX_CKPT_TO_KEEP=${MAX_CKPT_TO_KEEP:-2}
TEST_FREQ=${TEST_FREQ:--1}
VAL_BEFORE_TRAIN=${VAL_BEFORE_TRAIN:-False}
LOGGER=${LOGGER:-[console]}
NCCL_TIMEOUT=${NCCL_TIMEOUT:-3600}

export PYTHONPATH="${QWEN3_RL_HOME}${PYTHONPATH:+:${PYTHONPATH}}"

overrides=(
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
    actor_rollout_ref.actor.entropy_coeff=0
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=${ACTOR_TP}"
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=${ACTOR_PP}"
    "actor_rollout_ref.actor.megatron.context_parallel_size=${ACTOR_CP}"
    actor_rollout_ref.actor.megatron.sequence_parallel=True
    "actor_rollout_ref.actor.megatron.param_offload=${OFFLOAD}"
    "actor_rollout_ref.actor.megatron.grad_offload=${OFFLOAD}"
    "actor_rollout_ref.actor.megatron.optimizer_offload=${OFFLOAD}"
    "actor_rollout_ref.actor.megatron.use_dist_checkpointing=${USE_DIST_CKPT}"
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path=${DIST_CKPT_PATH}"
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=${ACTOR_TP}"
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=${ACTOR_PP}"
    "actor_rollout_ref.ref.megatron.context_parallel_size=${ACTOR_CP}"
    "actor_rollout_ref.ref.megatron.param_offload=${OFFLOAD}"
    "actor_rollout_ref.ref.megatron.use_dist_checkpointing=${USE_DIST_CKPT}"
    "actor_rollout_ref.ref.megatron.dist_checkpointing_path=${DIST_CKPT_PATH}"
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.mode=sync
    "actor_rollout_ref.rollout.n=${N_SAMPLES}"
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    "actor_rollout_ref.rollout.tensor_model_parallel_size=${ROLLOUT_TP}"
    actor_rollout_ref.rollout.data_parallel_size=1
    actor_rollout_ref.rollout.expert_parallel_size=1
    "actor_rollout_ref.rollout.gpu_memory_utilization=${ROLLOUT_GPU_MEMORY_UTILIZATION}"
    "actor_rollout_ref.rollout.max_num_seqs=${ROLLOUT_MAX_NUM_SEQS}"
    "actor_rollout_ref.rollout.max_num_batched_tokens=${ROLLOUT_MAX_NUM_BATCHED_TOKENS}"
    "actor_rollout_ref.rollout.enforce_eager=${ROLLOUT_ENFORCE_EAGER}"
    "actor_rollout_ref.rollout.use_tqdm=${ROLLOUT_USE_TQDM}"
    "actor_rollout_ref.rollout.disable_gc_in_engine_step=${DISABLE_GC_IN_ENGINE_STEP}"
    "actor_rollout_ref.rollout.data_rebalance=${DATA_REBALANCE}"
    "actor_rollout_ref.rollout.rollout_rebalance=${ROLLOUT_REBALANCE}"
    "actor_rollout_ref.rollout.rollout_rebalance_interval_steps=${ROLLOUT_REBALANCE_INTERVAL_STEPS}"
    "actor_rollout_ref.rollout.rollout_rebalance_max_moves=${ROLLOUT_REBALANCE_MAX_MOVES}"
    actor_rollout_ref.rollout.enable_chunked_prefill=True
    actor_rollout_ref.rollout.enable_prefix_caching=True
    actor_rollout_ref.rollout.free_cache_engine=True
    actor_rollout_ref.rollout.load_format=dummy
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
    reward_model.reward_manager=naive
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
    "trainer.save_freq=${SAVE_FREQ}"
    "trainer.resume_mode=${RESUME_MODE}"
    "trainer.default_local_dir=${CKPT_DIR}"
    "trainer.max_actor_ckpt_to_keep=${MAX_CKPT_TO_KEEP}"
    "trainer.test_freq=${TEST_FREQ}"
    "trainer.val_before_train=${VAL_BEFORE_TRAIN}"
)

for _flag in SAM_ENABLE SAM_GROUP NPUGRAPH_EX; do
    [[ "${!_flag}" == True || "${!_flag}" == False ]] || { echo "${_flag} must be True or False" >&2; exit 2; }
done
_vllm_kw=actor_rollout_ref.rollout.engine_kwargs.vllm
if [[ "${SAM_ENABLE}" == True ]]; then
    overrides+=(
        "+${_vllm_kw}.speculative_config.method=sam"
        "+${_vllm_kw}.speculative_config.num_speculative_tokens=${SAM_K}"
        "+${_vllm_kw}.speculative_config.sam_config.group_mode=${SAM_GROUP}"
        "+${_vllm_kw}.speculative_config.sam_config.pad_drafts=${NPUGRAPH_EX}"
    )
    if [[ "${SAM_BS_THRESHOLD}" != 0 ]]; then
        overrides+=("+${_vllm_kw}.speculative_config.disable_by_batch_size=${SAM_BS_THRESHOLD}")
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

cmd=(python3 -m verl.trainer.main_ppo --config-name ppo_megatron_trainer "${overrides[@]}" "$@")
if [[ "${QWEN3_RL_PRINT_COMMAND:-0}" == 1 ]]; then
    printf '%s\0' "${#cmd[@]}" "${cmd[@]}"
    env -0
    exit 0
fi
exec "${cmd[@]}"
