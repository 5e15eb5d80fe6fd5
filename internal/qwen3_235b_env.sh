#!/usr/bin/env bash
# Environment for the Qwen3-235B-A22B setups (128 dies), sourced by the launcher on every node
# BEFORE `ray start`, so Ray workers inherit it. Only process-level runtime settings live here
# (HCCL, torch_npu, vLLM runtime); every training/rollout switch is a Hydra key in the train script.
# Each value can be overridden by exporting it before the launcher runs.
# shellcheck disable=SC2034  # sourced file: variables are exported for the caller

# HCCL: the 235B weight sync and 32K-token all-to-alls need more than the default timeouts (s).
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1800}
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-3600}
# HCCL communication buffer per rank (MB).
export HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-512}

# torch_npu: asynchronous task queue level 2 (fewer host-bound gaps).
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}
# PYTORCH_NPU_ALLOC_CONF is deliberately left unset: vLLM-Ascend's sleep-mode allocator refuses
# expandable_segments:True in it (vllm_ascend/device_allocator/camem.py:145-149), and every setup runs
# the rollout in sleep mode (rollout.free_cache_engine=True). Training still gets expandable segments
# against fragmentation: verl patch 0003 (verl/utils/device.py) switches them on at run time
# for training and off before the rollout wakes up. `python -m qwen3_rl preflight` refuses the export.

# vLLM: V1 engine; keep the external-launcher engine in-process (verl's sync SPMD rollout).
export VLLM_USE_V1=${VLLM_USE_V1:-1}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}

# Ray: do not dedup the per-rank logs (the DP ranks' progress lines are all useful).
export RAY_DEDUP_LOGS=${RAY_DEDUP_LOGS:-0}
# Tokenizers inside Ray workers: avoid fork warnings / oversubscription.
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
