"""CPU stand-in for ``megatron.core.extensions.transformer_engine`` on megatron-core 0.16.1 (the current set): the
``TE_MODULES`` shim of ``megatron16_shims.py``.

The classes are the seed set's stand-ins (``megatron_te_cpu.py``: same maths, parameter names and checkpoint layout)
with megatron-core 0.16.1's constructor arguments: 0.16.1 hands every TE layer its process groups
(``tp_group=`` for the linears, e.g. ``megatron/core/transformer/attention.py:360``; ``pg_collection=`` for the
attention, ``attention.py:318-326``, and the grouped linears of ``TEGroupedMLP``, ``transformer/moe/experts.py:
546-575``). The stand-ins act on megatron's default groups (``parallel_state``), so a group argument is accepted only
when it is one of those (or None); any other group raises instead of being ignored.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from qwen3_rl.cpu_device import megatron_te_cpu as base

QWEN3_RL_CPU_TE = True


def _default_tp_group(is_expert: bool) -> torch.distributed.ProcessGroup:
    return (
        parallel_state.get_expert_tensor_parallel_group()
        if is_expert
        else parallel_state.get_tensor_model_parallel_group()
    )


def _check_tp_group(tp_group, is_expert: bool) -> None:  # noqa: ANN001 (a torch ProcessGroup or None)
    """The stand-ins use megatron's default TP (or expert TP) group: refuse another one."""
    if tp_group is not None and tp_group is not _default_tp_group(is_expert):
        raise NotImplementedError(
            "CPU TE stand-in (0.16.1): a tensor-parallel group other than parallel_state's"
        )


def _check_pg_collection(pg_collection, is_expert: bool) -> None:  # noqa: ANN001 (ProcessGroupCollection or None)
    """``pg_collection``'s TP group (``expt_tp`` for experts, ``tp`` otherwise) must be parallel_state's."""
    if pg_collection is not None:
        _check_tp_group(getattr(pg_collection, "expt_tp" if is_expert else "tp", None), is_expert)


TENorm = base.TENorm


def _set_partition_stride(layer: torch.nn.Module, stride: int) -> None:
    """TE's column-parallel layers take ``stride`` only to tag their parameters (``partition_stride``, read when
    megatron reshards them: 0.16.1's SwiGLU fc1 passes 2, ``transformer/mlp.py:104-109``); they tag them as TE does
    (``megatron/core/extensions/transformer_engine.py:848-851``). The forward is the same for any stride; the random
    initial values (stride-interleaved in TE's CPU initialisation only) are megatron's stride-1 ones."""
    layer.weight.partition_stride = stride
    if getattr(layer, "bias", None) is not None:
        layer.bias.partition_stride = stride


class TELayerNormColumnParallelLinear(base.TELayerNormColumnParallelLinear):
    """RMSNorm + column-parallel linear (seed stand-in); ``tp_group`` must be parallel_state's TP group.
    [s, b, h] -> ([s, b, out/tp], bias)."""

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, stride: int = 1, **kwargs):  # noqa: ANN001
        _check_tp_group(tp_group, kwargs.get("is_expert", False))
        super().__init__(input_size, output_size, **kwargs)
        _set_partition_stride(self, stride)


class TELayerNormColumnParallelLinearGathered(TELayerNormColumnParallelLinear):
    pass


class TEColumnParallelLinear(base.TEColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` (seed stand-in); ``tp_group`` must be parallel_state's."""

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, stride: int = 1, **kwargs):  # noqa: ANN001
        _check_tp_group(tp_group, kwargs.get("is_expert", False))
        super().__init__(input_size, output_size, **kwargs)
        _set_partition_stride(self, stride)


class TERowParallelLinear(base.TERowParallelLinear):
    """Megatron's ``RowParallelLinear`` (seed stand-in); ``tp_group`` must be parallel_state's."""

    def __init__(self, input_size: int, output_size: int, *, tp_group=None, **kwargs):  # noqa: ANN001
        _check_tp_group(tp_group, kwargs.get("is_expert", False))
        super().__init__(input_size, output_size, **kwargs)


class TEColumnParallelGroupedLinear(base.TEColumnParallelGroupedLinear):
    """One matmul per local expert, ``weight0..N`` [out, in] (seed stand-in); ``pg_collection``'s expert TP group
    must be parallel_state's. forward(x [tokens, in], m_splits) -> ([tokens, out], None)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, pg_collection=None, **kwargs):  # noqa: ANN001
        _check_pg_collection(pg_collection, kwargs.get("is_expert", False))
        super().__init__(num_gemms, input_size, output_size, **kwargs)


class TERowParallelGroupedLinear(base.TERowParallelGroupedLinear):
    """As :class:`TEColumnParallelGroupedLinear`, row-parallel."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, pg_collection=None, **kwargs):  # noqa: ANN001
        _check_pg_collection(pg_collection, kwargs.get("is_expert", False))
        super().__init__(num_gemms, input_size, output_size, **kwargs)


class TEGroupedLinear(base.TEGroupedLinear):
    pass


class TEDotProductAttention(base.TEDotProductAttention):
    """Causal GQA softmax attention (seed stand-in); ``pg_collection``'s TP group must be parallel_state's.
    thd: q [t, np, hn] -> [t, np, hn]; sbhd: q [s, b, np, hn] -> [s, b, np * hn]."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        *,  # noqa: ANN001
        pg_collection=None,
        **kwargs,
    ):  # noqa: ANN001
        _check_pg_collection(pg_collection, False)
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
