"""CPU stand-in of the ``grouped_gemm`` package (fanshiqing/grouped_gemm, a CUDA kernel) that megatron-core 0.12.1's
``GroupedMLP`` requires (``megatron/core/transformer/moe/grouped_gemm_util.py``; the availability check in
``GroupedMLP.__init__``, ``gg.ops.gmm`` in ``GroupedMLP.forward``, ``megatron/core/transformer/moe/experts.py``).
On an A3 MindSpeed replaces the same call with its NPU grouped matmul. Put the folder above this package on
``sys.path`` of the process that builds the model; only ``ops.gmm`` exists."""

from __future__ import annotations

import torch


class ops:  # noqa: N801 (grouped_gemm's name)
    @staticmethod
    def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
        """Grouped matmul: rows of ``a`` [sum(batch_sizes), k] in expert order, ``b`` [E, k, n] (``trans_b``:
        [E, n, k]); expert e multiplies its ``batch_sizes[e]`` rows. Returns [sum(batch_sizes), n]."""
        outs, start = [], 0
        for e, n in enumerate(batch_sizes.tolist()):
            w = b[e].t() if trans_b else b[e]
            outs.append(a[start:start + int(n)] @ w)
            start += int(n)
        if start != a.shape[0]:
            raise ValueError(f"batch_sizes sum to {start}, a has {a.shape[0]} rows")
        return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-2] if trans_b else b.shape[-1])
