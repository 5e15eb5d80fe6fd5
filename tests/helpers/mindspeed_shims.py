"""Device shims that let MindSpeed's own Python (pinned v2.2.0_core_r0.12.1) import and run on CPU.

Used by ``tests/patches/test_patches_mindspeed.py``: MindSpeed's ring attention (``AttentionWithCp``), its causal-EoD
(TND) strategy, its output/softmax merge, its ring P2P and its RoPE entry points run unchanged; only what needs an
NPU, CANN or a module the pinned wheels do not ship is stood in, each for the reason given below (paths are in the
pinned MindSpeed tree unless a package is named):

* ``torch_npu``: imported at module level by ``core/context_parallel/dot_product_attention.py:5``,
  ``ring_context_parallel/ring_context_parallel.py:9`` and ``core/context_parallel/utils.py:4``; the real package
  needs CANN (``libhccl.so``). The stand-in has exactly the two kernels the TND ring path calls,
  ``npu_fusion_attention`` (``ring_context_parallel.py:599``) and ``npu_fusion_attention_grad``
  (``ring_context_parallel.py:636``), written here in PyTorch after the torch_npu contract (below); any other
  attribute raises, so an unexpected NPU call fails the test.
* ``torch.npu.current_device``: ``ring_context_parallel.py:441-442`` (``compute_qkv_index``) places index tensors
  on the NPU; here it names the CPU.
* ``mindspeed.op_builder``: ``op_builder/__init__.py`` imports every JIT op builder, and ``gmm_builder.py:4``
  imports ``torchair`` (the NPU graph compiler); builders compile CANN kernels against torch_npu
  (``op_builder/builder.py:7,23``). The stand-in's builders raise on ``load()``: the path under test loads none.
* ``megatron.training``: ``core/models/common/embeddings/rotary_pos_embedding.py:11`` imports ``get_args`` from
  it at module level, and the megatron-core 0.12.1 wheel (the pinned Megatron source here) ships only
  ``megatron/core``. The stand-in returns MindSpeed's own argument namespace (``mindspeed.args_utils``).
* ``mindspeed.ops.npu_ring_attention_update``: the fused merge of two ring steps' outputs, a CANN op loaded
  through the op builder, used with ``--use-fused-ring-attention-update`` (``core/context_parallel/utils.py:245``).
  The test runs both merges: MindSpeed's default unfused one in PyTorch as shipped (TND needs the bug-fix patch
  ``patches/mindspeed/0003-*``: upstream ``unflatten_softmax`` views a transposed tensor,
  ``core/context_parallel/utils.py:71-72``, ``RuntimeError: view size is not compatible``) and the fused switch with
  this PyTorch stand-in.

npu_fusion_attention contract implemented (layout ``TND`` only, ``keep_prob == 1``, no ``pse``):
q ``[T, N, D]``, k/v ``[T_kv, N_kv, D]`` (``N % N_kv == 0``; q head ``h`` reads kv head ``h // (N / N_kv)``),
``actual_seq_qlen`` / ``actual_seq_kvlen`` cumulative ends (without the leading 0) of the packed sequences; a
token attends only inside its own sequence. ``sparse_mode`` 0 without ``atten_mask`` (defaultMask): every key of
the sequence is visible, ``pre_tockens`` / ``next_tockens`` are ignored (the FlashAttentionScore contract; MindSpeed
relies on it: ``ring_context_parallel.py:605-606`` passes ``pre_tockens = T_kv`` although a sequence's queries can
sit more than ``T_kv`` rows after its first key); 3 (right-down causal): iff ``j <= i + S_kv - S_q``, with ``atten_mask``
the compressed 2048 x 2048 ``triu(1)`` mask (checked). Returns ``(out [T, N, D], softmax_max [T, N, 8],
softmax_sum [T, N, 8], softmax_out (empty), seed, offset, numel)``: ``softmax_max`` = row max of the scaled
scores, ``softmax_sum`` = sum of ``exp(scaled - max)``, both repeated 8 times and stored per sequence head-major
(``[N, S_q, 8]`` blocks in sequence order) as MindSpeed's ``flatten_softmax`` / ``unflatten_softmax``
(``core/context_parallel/utils.py:58-74``) and ``get_selection_indices_for_tnd_softmax_update`` (``:43-55``)
read them. ``npu_fusion_attention_grad`` recomputes the probabilities from the *given* ``softmax_max`` /
``softmax_sum`` and ``attention_in`` (as the kernel does: the ring backward passes the merged statistics of all
steps, ``ring_context_parallel.py:636-657``) and returns ``(dq, dk, dv, dpse)``.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Sequence

import torch

COMPRESSED_MASK = 2048  # side of the compressed causal mask sparse_mode 2/3 take (torch_npu contract)


def _segments(ends: Sequence[int] | None, total: int) -> list[tuple[int, int]]:
    """Cumulative ends -> [(start, end)] covering ``total`` tokens. A leading 0 (MindSpeed passes
    ``cu_seqlens.tolist()``, ring_context_parallel.py:943-947) is an empty first sequence, as MindSpeed's own
    bookkeeping counts it (``sub_out_seq_len`` at ring_context_parallel.py:964)."""
    ends = [int(e) for e in (ends if ends is not None else [total])]
    if not ends or ends[-1] != total or any(b < a for a, b in zip(ends, ends[1:], strict=False)):
        raise ValueError(f"actual_seq_len {ends} is not non-decreasing up to the {total} packed tokens")
    starts = [0, *ends[:-1]]
    return list(zip(starts, ends, strict=True))


def _visible(sq: int, skv: int, sparse_mode: int, atten_mask: torch.Tensor | None, pre: int, nxt: int,
             ) -> torch.Tensor:
    """Boolean [sq, skv]: key j visible to query i."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    if sparse_mode == 0:  # defaultMask without a mask: no masking, pre/next_tockens ignored (set to INT_MAX)
        if atten_mask is not None:
            raise NotImplementedError("sparse_mode 0 with an explicit atten_mask")
        return torch.ones(sq, skv, dtype=torch.bool)
    if sparse_mode == 3:
        if atten_mask is None or tuple(atten_mask.shape) != (COMPRESSED_MASK, COMPRESSED_MASK):
            raise ValueError("sparse_mode 3 needs the compressed 2048 x 2048 causal mask")
        ref = torch.triu(torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool), diagonal=1)
        if not torch.equal(atten_mask.to(torch.bool).cpu(), ref):
            raise ValueError("sparse_mode 3 mask is not triu(ones(2048, 2048), 1)")
        return j <= i + (skv - sq)
    raise NotImplementedError(f"sparse_mode {sparse_mode}")


def _check(input_layout: str, keep_prob: float, pse: object, n: int, query: torch.Tensor,
           key: torch.Tensor) -> int:
    if input_layout != "TND":
        raise NotImplementedError(f"layout {input_layout}: the HDP path runs TND only")
    if keep_prob != 1.0 or pse is not None:
        raise NotImplementedError("dropout / pse")
    if query.shape[1] != n or n % key.shape[1]:
        raise ValueError(f"head_num {n}, q heads {query.shape[1]}, kv heads {key.shape[1]}")
    return n // key.shape[1]


def _to_head_major(x: torch.Tensor, segs: list[tuple[int, int]]) -> torch.Tensor:
    """[T, N] token-major -> [T, N, 8] in the kernel's per-sequence head-major memory order."""
    n = x.shape[1]
    flat = torch.cat([x[a:b].transpose(0, 1).reshape(-1) for a, b in segs])
    return flat[:, None].expand(-1, 8).reshape(-1, n, 8).contiguous()


def _from_head_major(x: torch.Tensor, segs: list[tuple[int, int]]) -> torch.Tensor:
    """Inverse of ``_to_head_major`` (column 0 of the 8): [T, N, 8] -> [T, N]."""
    n = x.shape[1]
    flat = x.reshape(-1, 8)[:, 0]
    out, off = [], 0
    for a, b in segs:
        out.append(flat[off:off + n * (b - a)].view(n, b - a).transpose(0, 1))
        off += n * (b - a)
    return torch.cat(out)


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """PyTorch stand-in of ``torch_npu.npu_fusion_attention`` (contract in the module docstring)."""
    rep = _check(input_layout, keep_prob, pse, head_num, query, key)
    qs, ks = _segments(actual_seq_qlen, query.shape[0]), _segments(actual_seq_kvlen, key.shape[0])
    if len(qs) != len(ks):
        raise ValueError("actual_seq_qlen and actual_seq_kvlen name different numbers of sequences")
    out = torch.empty_like(query)
    mx = query.new_empty(query.shape[:2])
    sm = query.new_empty(query.shape[:2])
    for (qa, qb), (ka, kb) in zip(qs, ks, strict=True):
        if qb == qa:
            continue
        if kb == ka:
            raise ValueError("queries with no keys")
        q = query[qa:qb].transpose(0, 1)  # [N, sq, D]
        k = key[ka:kb].transpose(0, 1).repeat_interleave(rep, 0)
        v = value[ka:kb].transpose(0, 1).repeat_interleave(rep, 0)
        s = (q @ k.transpose(1, 2)) * scale
        s = s.masked_fill(~_visible(qb - qa, kb - ka, sparse_mode, atten_mask, pre_tockens, next_tockens), -torch.inf)
        m = s.amax(-1, keepdim=True)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe)
        den = p.sum(-1, keepdim=True)
        out[qa:qb] = (p @ v / den.clamp_min(torch.finfo(den.dtype).tiny)).transpose(0, 1)
        mx[qa:qb] = m[..., 0].transpose(0, 1)
        sm[qa:qb] = den[..., 0].transpose(0, 1)
    return (out, _to_head_major(mx, qs), _to_head_major(sm, qs), query.new_empty(0), 0, 0, 0)


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False):
    """PyTorch stand-in of ``torch_npu.npu_fusion_attention_grad``: flash-attention backward from the given
    softmax statistics and forward output. Returns (dq [T, N, D], dk, dv [T_kv, N_kv, D], dpse (empty))."""
    rep = _check(input_layout, keep_prob, pse, head_num, query, key)
    qs, ks = _segments(actual_seq_qlen, query.shape[0]), _segments(actual_seq_kvlen, key.shape[0])
    mx, sm = _from_head_major(softmax_max, qs), _from_head_major(softmax_sum, qs)  # [T, N]
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    nkv = key.shape[1]
    for (qa, qb), (ka, kb) in zip(qs, ks, strict=True):
        if qb == qa:
            continue
        q = query[qa:qb].transpose(0, 1)
        k = key[ka:kb].transpose(0, 1).repeat_interleave(rep, 0)
        v = value[ka:kb].transpose(0, 1).repeat_interleave(rep, 0)
        do = dy[qa:qb].transpose(0, 1)
        o = attention_in[qa:qb].transpose(0, 1)
        s = (q @ k.transpose(1, 2)) * scale_value
        vis = _visible(qb - qa, kb - ka, sparse_mode, atten_mask, pre_tockens, next_tockens)
        m = mx[qa:qb].transpose(0, 1)[..., None]
        den = sm[qa:qb].transpose(0, 1)[..., None]
        p = torch.where(vis, torch.exp(s - m) / den, torch.zeros_like(s))  # [N, sq, skv]
        dp = do @ v.transpose(1, 2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq[qa:qb] = (ds @ k * scale_value).transpose(0, 1)
        dk_h = (ds.transpose(1, 2) @ q * scale_value).view(nkv, rep, kb - ka, -1).sum(1)
        dv_h = (p.transpose(1, 2) @ do).view(nkv, rep, kb - ka, -1).sum(1)
        dk[ka:kb] = dk_h.transpose(0, 1)
        dv[ka:kb] = dv_h.transpose(0, 1)
    return dq, dk, dv, query.new_empty(0)


def npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                              cur_softmax_sum, actual_seq_qlen=None, layout="SBH"):
    """PyTorch stand-in of MindSpeed's fused ``npu_ring_attention_update`` (a CANN op, ``ops/npu_ring_attention_update.py``)
    for ``TND``: the op's documented equivalent computation (``docs/ops/npu_ring_attention_update.md:14-48``) on
    statistics in the kernel's per-sequence head-major layout; ``actual_seq_qlen`` int64 cumulative lengths with
    the leading 0 MindSpeed prepends (``core/context_parallel/utils.py:247-253``).
    Returns (attn_out [T, N, D], softmax_max [T, N, 8], softmax_sum [T, N, 8])."""
    if layout != "TND":
        raise NotImplementedError(f"layout {layout}: the HDP path runs TND only")
    segs = _segments(actual_seq_qlen.tolist(), prev_attn_out.shape[0])
    pm, ps = _from_head_major(prev_softmax_max, segs), _from_head_major(prev_softmax_sum, segs)
    cm, cs = _from_head_major(cur_softmax_max, segs), _from_head_major(cur_softmax_sum, segs)
    m = torch.maximum(pm, cm)
    ps, cs = ps * torch.exp(pm - m), cs * torch.exp(cm - m)
    total = ps + cs
    out = prev_attn_out * (ps / total)[..., None] + cur_attn_out * (cs / total)[..., None]
    return out.to(prev_attn_out.dtype), _to_head_major(m, segs), _to_head_major(total, segs)


class _NpuOpBuilder:
    """Stand-in of a MindSpeed op builder: constructing it is fine, loading (JIT-building a CANN kernel) raises."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def load(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{type(self).__name__}.load(): NPU op builders need CANN and torch_npu")


def _module(name: str, attrs: dict[str, object], what: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)

    def missing(attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"{name}.{attr} is not stood in ({what}): the code under test reached it")

    mod.__getattr__ = missing  # type: ignore[method-assign]
    return mod


def install() -> None:
    """Put the stand-ins in ``sys.modules`` / on ``torch`` before any MindSpeed import."""
    sys.modules["torch_npu"] = _module("torch_npu", {
        "npu_fusion_attention": npu_fusion_attention,
        "npu_fusion_attention_grad": npu_fusion_attention_grad,
    }, "PyTorch stand-ins of two torch_npu kernels")
    torch.npu = _module("torch.npu", {"current_device": lambda: "cpu"}, "device shim")  # type: ignore[attr-defined]

    def builder(attr: str) -> type:
        if not attr.endswith("Builder"):
            raise AttributeError(attr)
        return type(attr, (_NpuOpBuilder,), {})

    ob = types.ModuleType("mindspeed.op_builder")
    ob.__getattr__ = builder  # type: ignore[method-assign]
    sys.modules["mindspeed.op_builder"] = ob
    sys.modules["mindspeed.ops.npu_ring_attention_update"] = _module(
        "mindspeed.ops.npu_ring_attention_update", {"npu_ring_attention_update": npu_ring_attention_update},
        "PyTorch stand-in of a CANN op")

    def get_args() -> argparse.Namespace:
        from mindspeed.args_utils import get_full_args

        return get_full_args()

    sys.modules["megatron.training"] = _module("megatron.training", {"get_args": get_args},
                                               "not in the megatron-core wheel")
