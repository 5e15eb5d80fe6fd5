# shellcheck shell=bash
# The tiny CPU setups (internal/train_*_tiny_cpu.sh): one node, 2 worker processes, a tiny model and generated
# gsm8k-style data from `bash setup_cpu.sh` (workspace/tiny/: TINY_MODEL and TINY_DATA name the folders).
# Same override groups as the cluster setups; this file holds the layout and the settings a CPU needs.
# Launched with `bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu` (docs/tiny_cpu_run.md).
# Sourced by the tiny train scripts before lib/train_common.sh.
[[ "${BASH_SOURCE[0]}" != "$0" ]] || { echo "${BASH_SOURCE[0]}: source it from a train script" >&2; exit 2; }

TINY_HOME=${TINY_HOME:-${QWEN3_RL_WORKSPACE:-${QWEN3_RL_HOME}/workspace}/tiny}
MODEL_PATH=${MODEL_PATH:-${TINY_HOME}/${TINY_MODEL}}
DATA_DIR=${DATA_DIR:-${TINY_HOME}/${TINY_DATA}}
VAL_FILE=${VAL_FILE:-${DATA_DIR}/gsm8k/test.parquet}
NNODES=${NNODES:-1}
NPUS_PER_NODE=${NPUS_PER_NODE:-2}

# ---- batch, lengths, steps: each tiny script sets TRAIN_BATCH_SIZE, N_SAMPLES, MAX_RESPONSE_LENGTH, LR,
# ENTROPY_COEFF, TOTAL_TRAINING_STEPS, SAVE_FREQ
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-128}
TOTAL_EPOCHS=${TOTAL_EPOCHS:-4}

# ---- actor (Megatron) over the 2 processes: TP / PP / EP and the stage sizes are each script's own ----------
ACTOR_CP=${ACTOR_CP:-1}
ACTOR_ETP=${ACTOR_ETP:-1}

# ---- rollout: one vLLM engine per process (TP 1, vLLM DP 1, no EP) -----------------------------
# the switches whose tiny default differs (features.toml default_for.tiny): OFFLOAD=False, ROLLOUT_ENABLE_EP=False,
# ROLLOUT_ENFORCE_EAGER=True, ROLLOUT_FREE_CACHE_ENGINE=False (sleep mode needs the device allocator),
# GRAPH_CAPTURE_SIZES=[8,16,32]
ROLLOUT_TP=${ROLLOUT_TP:-1}
ROLLOUT_DP=${ROLLOUT_DP:-1}
ROLLOUT_GPU_MEMORY_UTILIZATION=${ROLLOUT_GPU_MEMORY_UTILIZATION:-0.5}

# train_add_tiny_cpu_overrides: what a CPU needs that an A3 does not. vLLM-CPU runs float32 with its native
# PyTorch ops (its rms_norm custom op is wrong for the non-contiguous q/k-norm input: ../shared/README.md); the
# dataloader reads in the trainer's process (verl's default, 8 worker processes, costs GBs of host memory here).
# On the current pin set (verl 0.9.1) also: no vLLM sleep mode (vLLM refuses it off CUDA), one reward worker and one
# TransferQueue storage unit (8 of each by default: processes for 2 shared cores), vLLM without graph capture.
train_add_tiny_cpu_overrides() {
    overrides+=(
        actor_rollout_ref.rollout.dtype=float32
        data.dataloader_num_workers=0
        '+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.custom_ops=["none"]'
    )
    if [[ "${PIN_SET:-seed}" == current ]]; then
        overrides+=(
            +actor_rollout_ref.rollout.enable_sleep_mode=False
            +actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode=NONE
            reward.num_workers=1
            transfer_queue.backend.SimpleStorage.num_data_storage_units=1
        )
        # fully async (lib/fully_async.sh sourced): the weight sync between the trainer's and the rollout's processes
        # over a host gloo group (CPU_CKPT_ENGINE_GLOO, qwen3_rl/cpu_device/verl091_gloo_ckpt.py): the yaml's
        # "nccl" engine needs cupy's NCCL (HCCL's on an NPU)
        if declare -F train_run_fully_async >/dev/null; then
            overrides+=(
                actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_gloo
                actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=qwen3_rl.cpu_device.verl091_gloo_ckpt
            )
        fi
    fi
}
