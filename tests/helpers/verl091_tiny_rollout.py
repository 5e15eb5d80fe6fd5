"""verl 0.9.1's rollout config for the tiny CPU servers the current set's drivers launch through verl
(``verl091_dp_rank_driver.py``, ``verl091_vllm_server_driver.py``): one node, TP 1, float32, eager (no graph
capture on CPU), no sleep mode (it needs a device allocator), 256-token context, seed 0."""

from __future__ import annotations

from typing import Any

TINY = {
    "name": "vllm", "tensor_model_parallel_size": 1, "data_parallel_size": 1, "n_gpus_per_node": 1, "nnodes": 1,
    "dtype": "float32", "load_format": "auto", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 8,
    "prompt_length": 64, "enable_sleep_mode": False, "free_cache_engine": False, "seed": 0,
    "skip_tokenizer_init": False,
}


def tiny_rollout_config(**fields: Any):
    """verl's ``RolloutConfig`` of :data:`TINY` with ``fields`` over it (e.g. ``data_parallel_size``,
    ``gpu_memory_utilization``, ``response_length``, ``engine_kwargs``, ``custom``)."""
    from verl.workers.config import RolloutConfig

    return RolloutConfig(**{**TINY, **fields})
