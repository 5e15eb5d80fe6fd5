"""HF Qwen3-MoE per-expert weights <-> Megatron GroupedMLP ``weight1`` / ``weight2`` (MindSpeed grouped GEMM).

Layout (megatron-core 0.12.1 ``megatron/core/transformer/moe/experts.py`` GroupedMLP, and MindSpeed
v2.2.0_core_r0.12.1 ``mindspeed/core/transformer/moe/moe_layer_overlap_all2all.py:275``, which read the
parameters as ``weight1.view(E_local, hidden, -1)`` and ``weight2.view(E_local, -1, hidden)``):

* ``weight1``: shape ``[hidden, E_local * 2 * ffn / tp]``; its memory is ``E_local`` consecutive row-major
  ``[hidden, 2 * ffn / tp]`` blocks, block ``e`` = ``[gate_e^T | up_e^T]`` (the GLU takes
  ``chunk(2, -1)``: silu(first half) * second half), each half the TP rank's slice of the ffn columns
  (Megatron's sharded state dict splits gate and up separately: shards ``tp_rank`` and ``tp + tp_rank``
  of ``2 * tp``).
* ``weight2``: shape ``[E_local * ffn / tp, hidden]``; ``E_local`` consecutive ``[ffn / tp, hidden]`` blocks,
  block ``e`` = ``down_e^T`` rows of the TP slice.

HF (transformers Qwen3MoeSparseMoeBlock): ``mlp.experts.{e}.gate_proj.weight`` [ffn, hidden],
``up_proj.weight`` [ffn, hidden], ``down_proj.weight`` [hidden, ffn].
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "grouped_to_hf",
    "grouped_to_te_experts",
    "hf_layer_experts_to_grouped",
    "hf_to_grouped",
    "mcore_grouped_names_to_hf",
]


def hf_to_grouped(gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                  tp_size: int = 1, tp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert HF weights of the local experts -> (weight1 [H, E*2*F/tp], weight2 [E*F/tp, H]).

    gate[e], up[e]: [F, H]; down[e]: [H, F]. Exact copies (no arithmetic).
    """
    if not (len(gate) == len(up) == len(down) >= 1):
        raise ValueError("gate, up and down need one tensor per local expert")
    F, H = gate[0].shape
    if F % tp_size:
        raise ValueError(f"ffn {F} not divisible by tp {tp_size}")
    f = F // tp_size
    sl = slice(tp_rank * f, (tp_rank + 1) * f)
    blocks1 = [torch.cat([g[sl].t(), u[sl].t()], dim=1) for g, u in zip(gate, up, strict=True)]  # [H, 2f]
    blocks2 = [d[:, sl].t() for d in down]  # [f, H]
    w1 = torch.stack(blocks1).contiguous().view(H, -1)  # memory = E blocks of [H, 2f]
    w2 = torch.stack(blocks2).contiguous().view(-1, H)
    return w1, w2


def grouped_to_hf(weight1: torch.Tensor | Sequence[torch.Tensor], weight2: torch.Tensor | Sequence[torch.Tensor],
                  num_local_experts: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Inverse of ``hf_to_grouped``: weight1/weight2 (or the list of their TP shards, rank order) ->
    (gate[e] [F, H], up[e] [F, H], down[e] [H, F]) for the local experts."""
    w1s = [weight1] if isinstance(weight1, torch.Tensor) else list(weight1)
    w2s = [weight2] if isinstance(weight2, torch.Tensor) else list(weight2)
    H = w1s[0].shape[0]
    E = num_local_experts
    gates: list[list[torch.Tensor]] = [[] for _ in range(E)]
    ups: list[list[torch.Tensor]] = [[] for _ in range(E)]
    downs: list[list[torch.Tensor]] = [[] for _ in range(E)]
    for w1, w2 in zip(w1s, w2s, strict=True):
        b1 = w1.contiguous().view(E, H, -1)
        b2 = w2.contiguous().view(E, -1, H)
        f = b1.shape[2] // 2
        for e in range(E):
            gates[e].append(b1[e, :, :f].t())
            ups[e].append(b1[e, :, f:].t())
            downs[e].append(b2[e].t())
    return ([torch.cat(x, 0).contiguous() for x in gates], [torch.cat(x, 0).contiguous() for x in ups],
            [torch.cat(x, 1).contiguous() for x in downs])


def hf_layer_experts_to_grouped(hf_state: Mapping[str, torch.Tensor], layer: int, experts: Sequence[int],
                                tp_size: int = 1, tp_rank: int = 0,
                                prefix: str = "model.layers") -> tuple[torch.Tensor, torch.Tensor]:
    """weight1/weight2 of one layer's local experts ``experts`` (global ids, in order) from an HF state dict."""
    p = f"{prefix}.{layer}.mlp.experts"
    return hf_to_grouped([hf_state[f"{p}.{e}.gate_proj.weight"] for e in experts],
                         [hf_state[f"{p}.{e}.up_proj.weight"] for e in experts],
                         [hf_state[f"{p}.{e}.down_proj.weight"] for e in experts], tp_size, tp_rank)


_GROUPED = re.compile(r"^(?:.*\.)?decoder\.layers\.(\d+)\.mlp\.experts\.weight([12])$")


def mcore_grouped_names_to_hf(name: str, tensor: torch.Tensor, num_local_experts: int, expert_offset: int = 0,
                              partner: torch.Tensor | None = None) -> tuple[list[str], list[torch.Tensor]]:
    """Weight-sync names for a GroupedMLP parameter (TP-gathered), as verl's McoreToHFWeightConverter returns:

    ``decoder.layers.L.mlp.experts.weight1`` -> ``model.layers.L.mlp.experts.{e}.gate_proj.weight`` and
    ``...up_proj.weight`` for every local expert e (global id = expert_offset + local index);
    ``...weight2`` -> ``...{e}.down_proj.weight``. ``partner`` is unused (kept for symmetric call sites).
    Raises ValueError for names that are not GroupedMLP weights.
    """
    m = _GROUPED.match(name)
    if m is None:
        raise ValueError(f"not a GroupedMLP weight name: {name}")
    layer, which = int(m.group(1)), m.group(2)
    H_or_rows = tensor.shape
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    base = f"model.layers.{layer}.mlp.experts"
    if which == "1":
        H = H_or_rows[0]
        b1 = tensor.contiguous().view(num_local_experts, H, -1)
        f = b1.shape[2] // 2
        for e in range(num_local_experts):
            g = expert_offset + e
            names += [f"{base}.{g}.gate_proj.weight", f"{base}.{g}.up_proj.weight"]
            tensors += [b1[e, :, :f].t().contiguous(), b1[e, :, f:].t().contiguous()]
    else:
        H = H_or_rows[1]
        b2 = tensor.contiguous().view(num_local_experts, -1, H)
        for e in range(num_local_experts):
            names.append(f"{base}.{expert_offset + e}.down_proj.weight")
            tensors.append(b2[e].t().contiguous())
    return names, tensors


def grouped_to_te_experts(tensor: torch.Tensor, which: int, num_local_experts: int) -> list[torch.Tensor]:
    """One rank's ``weight1`` (``which=1``) or ``weight2`` (``which=2``) -> the same rank's per-expert tensors in
    megatron-core's TEGroupedMLP form (``linear_fc1.weight{e}`` / ``linear_fc2.weight{e}``), local expert order.

    weight1 [H, E*2f] -> E tensors [2f, H] = ``[gate_e slice; up_e slice]`` (rows of this TP rank);
    weight2 [E*f, H] -> E tensors [H, f] = ``down_e[:, slice]``. Contiguous copies (one expert each).
    """
    E = num_local_experts
    if which == 1:
        H = tensor.shape[0]
        return [b.t().contiguous() for b in tensor.contiguous().view(E, H, -1)]
    if which == 2:
        H = tensor.shape[1]
        return [b.t().contiguous() for b in tensor.contiguous().view(E, -1, H)]
    raise ValueError(f"which must be 1 or 2, got {which}")
