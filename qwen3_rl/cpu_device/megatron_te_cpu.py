"""CPU stand-in for ``megatron.core.extensions.transformer_engine`` (megatron-core 0.12.1): the
``TE_MODULES`` shim of ``megatron_shims.py``.

Transformer Engine's modules are CUDA kernels; on an A3 MindSpeed replaces the same classes
(``mindspeed/features_manager/megatron_basic/transformer_engine_basic.py:14-30``). The classes here keep
TE's constructor signatures, return conventions (``(output, bias)``) and parameter names
(``layer_norm_weight``, ``weight``, ``weight0..N``), so the model that verl's
``model_initializer.py`` builds with ``use_transformer_engine=True`` has the parameter names verl's weight
converter expects; the maths is plain PyTorch and megatron's own tensor-parallel layers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.utils import divide

QWEN3_RL_CPU_TE = True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like TE's kernel. x: [..., h] -> [..., h]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class TENorm(torch.nn.Module):
    """TE's ``RMSNorm`` (what ``TENorm`` builds for ``normalization="RMSNorm"``): parameter ``weight`` [h],
    marked ``sequence_parallel`` like TE's so megatron all-reduces its grads over TP. [..., h] -> [..., h]."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"CPU TE stand-in: only RMSNorm is implemented, not {config.normalization}")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class TELayerNormColumnParallelLinear(ColumnParallelLinear):
    """RMSNorm (parameter ``layer_norm_weight``) fused in front of a column-parallel linear, as TE's
    ``LayerNormLinear``. Input [s, b, h] (sequence-parallel: [s/tp, b, h]) -> ([s, b, out/tp], bias)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method: Callable, gather_output: bool,
                 bias: bool, skip_bias_add: bool, is_expert: bool = False,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name: str | None = None):
        if config.normalization != "RMSNorm":
            raise ValueError(f"CPU TE stand-in: only RMSNorm is implemented, not {config.normalization}")
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         gather_output=gather_output, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         skip_weight_param_allocation=skip_weight_param_allocation,
                         tp_comm_buffer_name=tp_comm_buffer_name)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        # replicated over TP; with sequence parallelism its grads are all-reduced over TP like TE's
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel
        self.eps = config.layernorm_epsilon

    def forward(self, x: torch.Tensor, *args, **kwargs):
        return super().forward(_rms_norm(x, self.layer_norm_weight, self.eps))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0, "bias": 0}, sharded_offsets)


class TELayerNormColumnParallelLinearGathered(TELayerNormColumnParallelLinear):
    pass


class TEColumnParallelLinear(ColumnParallelLinear):
    """TE's column-parallel linear = megatron's ``ColumnParallelLinear`` (MindSpeed maps it the same way)."""

    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                 is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None):
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         gather_output=gather_output, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         skip_weight_param_allocation=skip_weight_param_allocation,
                         tp_comm_buffer_name=tp_comm_buffer_name)

    def forward(self, x, *args, **kwargs):
        return super().forward(x)


class TERowParallelLinear(RowParallelLinear):
    """TE's row-parallel linear = megatron's ``RowParallelLinear``."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None):
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name)

    def forward(self, x, *args, **kwargs):
        return super().forward(x)


class _GroupedLinear(torch.nn.Module):
    """TE's ``GroupedLinear`` for the MoE experts: ``num_gemms`` weights ``weight{i}`` of [out, in] (TE's
    layout), one matmul per local expert on its contiguous slice of tokens. Expert tensor parallelism
    comes in through the sizes only (the token dispatcher does the communication, as with TE:
    ``explicit_expert_comm``). forward(x [tokens, in], m_splits [num_gemms]) -> ([tokens, out], None)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, parallel_mode: str | None, config,
                 init_method: Callable, bias: bool, skip_bias_add: bool, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None):
        super().__init__()
        if bias:
            raise ValueError("CPU TE stand-in: grouped linear without bias only (as TEGroupedMLP requires)")
        self.config = config
        self.num_gemms = num_gemms
        self.parallel_mode = parallel_mode
        tp = (parallel_state.get_expert_tensor_parallel_world_size() if is_expert
              else parallel_state.get_tensor_model_parallel_world_size())
        self.expert_parallel = config.expert_model_parallel_size > 1
        if is_expert and (tp > 1 or self.expert_parallel):  # TE's explicit_expert_comm: TE sees no TP
            if parallel_mode == "column":
                output_size = divide(output_size, tp)
            elif parallel_mode == "row":
                input_size = divide(input_size, tp)
            parallel_mode = None
        elif tp > 1:
            raise NotImplementedError("CPU TE stand-in: grouped linear with TE-side tensor parallelism")
        tracker = get_cuda_rng_tracker()
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            if config.perform_initialization:
                with (tracker.fork(get_expert_parallel_rng_tracker_name())
                      if is_expert and tracker.is_initialized() else contextlib.nullcontext()):
                    init_method(w.data)
            # as TE's GroupedLinear.reset_parameters: every weight is marked tensor-parallel, split on dim 1 for
            # "row" and 0 otherwise (verl's per_tensor_generator and megatron's grad norm read these marks)
            set_tensor_model_parallel_attributes(w, is_parallel=True, dim=1 if parallel_mode == "row" else 0,
                                                 stride=1)
            # expert weights are not all-reduced over the (non-expert) data-parallel group
            w.allreduce = not (is_expert and self.expert_parallel)
            self.register_parameter(f"weight{i}", w)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """TE's grouped-linear checkpoint layout (``megatron/core/extensions/transformer_engine.py:1061-1112``
        with the column/row axis maps of ``:1152-1157,1192-1200``): this EP rank's gemm ``g`` is global expert
        ``ep_rank * num_gemms + g`` on a leading expert axis; column weights split on axis 0, row weights on axis 1
        (the caller, ``TEGroupedMLP.sharded_state_dict``, swaps in the expert TP group); replicas over expert DP."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"column": 0, "row": 1}.get(self.parallel_mode)
        n_global = parallel_state.get_expert_model_parallel_world_size() * self.num_gemms
        first = parallel_state.get_expert_model_parallel_rank() * self.num_gemms
        ep_axis = len(sharded_offsets)
        out = {}
        for g in range(self.num_gemms):
            key = f"{g}.weight"
            sub = make_sharded_tensors_for_checkpoint({key: getattr(self, f"weight{g}")}, "",
                                                      {key: axis} if axis is not None else {},
                                                      (*sharded_offsets, (ep_axis, first + g, n_global)))
            replace_prefix_for_sharding(sub, f"{g}.", prefix)
            out[f"{prefix}weight{g}"] = sub[key]
        for sh in out.values():
            sh.replica_id = (*sh.replica_id[:2], parallel_state.get_expert_data_parallel_rank())
        return out

    def forward(self, x: torch.Tensor, m_splits):
        m_splits = [int(m) for m in (m_splits.tolist() if torch.is_tensor(m_splits) else m_splits)]
        outs = [chunk @ getattr(self, f"weight{i}").t()
                for i, chunk in enumerate(torch.split(x, m_splits))]
        return torch.cat(outs) if outs else x.new_zeros(0, self.weight0.shape[0]), None


class TEGroupedLinear(_GroupedLinear):
    pass


class TEColumnParallelGroupedLinear(_GroupedLinear):
    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name)


class TERowParallelGroupedLinear(_GroupedLinear):
    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name)


class TEDotProductAttention(torch.nn.Module):
    """TE's fused (flash) attention: causal softmax attention with grouped KV heads, per packed sequence.

    ``thd`` (packed): q [t, np, hn], k/v [t, ng, hn], sequence i at rows [cu_padded[i], cu_padded[i] + len_i)
    -> [t, np, hn] (padding rows 0). ``sbhd``: q [s, b, np, hn] -> [s, b, np * hn].
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str = "p2p"):
        super().__init__()
        if config.context_parallel_size > 1:
            raise NotImplementedError("CPU TE stand-in: context parallel attention is not implemented")
        self.config = config
        self.attn_mask_type = attn_mask_type
        kv = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    @staticmethod
    def _attend(q, k, v, scale, p):
        """q [n, np, hn], k/v [n, ng, hn] -> [n, np, hn], causal."""
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, dropout_p=p)
        return o.transpose(0, 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if attention_bias is not None:
            raise NotImplementedError("CPU TE stand-in: attention bias")
        p = self.dropout if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q.tolist()
            cu_pad = (packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None
                      else packed_seq_params.cu_seqlens_q).tolist()
            out = torch.zeros_like(query)
            for i in range(len(cu) - 1):
                s, n = cu_pad[i], cu[i + 1] - cu[i]
                if n > 0:
                    out[s:s + n] = self._attend(query[s:s + n], key[s:s + n], value[s:s + n], self.softmax_scale, p)
            return out
        # sbhd: [s, b, np, hn]
        outs = [self._attend(query[:, b], key[:, b], value[:, b], self.softmax_scale, p)
                for b in range(query.shape[1])]
        o = torch.stack(outs, dim=1)
        return o.reshape(o.shape[0], o.shape[1], -1)
