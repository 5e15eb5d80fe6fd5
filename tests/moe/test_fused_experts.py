"""Fused-expert (GroupedMLP weight1/weight2) conversion on a tiny random Qwen3-MoE: HF -> grouped -> HF is
exact for every expert tensor, the grouped GEMM semantics reproduce HF's expert MLP, and weight-sync names
and shapes match the HF model's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qwen3_rl.moe.fused_experts import (
    grouped_to_hf,
    hf_layer_experts_to_grouped,
    mcore_grouped_names_to_hf,
)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3MoeForCausalLM(cfg).to(torch.float64).eval()


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_roundtrip_exact_and_shapes(hf_model, tp: int, ep: int) -> None:
    sd = hf_model.state_dict()
    cfg = hf_model.config
    H, Fm, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    El = E // ep
    checked = 0
    for layer in range(cfg.num_hidden_layers):
        for r in range(ep):
            experts = list(range(r * El, (r + 1) * El))
            shards = [hf_layer_experts_to_grouped(sd, layer, experts, tp, t) for t in range(tp)]
            for w1, w2 in shards:  # the parameter shapes megatron's GroupedMLP allocates per rank
                assert w1.shape == (H, El * 2 * Fm // tp) and w2.shape == (El * Fm // tp, H)
            gates, ups, downs = grouped_to_hf([s[0] for s in shards], [s[1] for s in shards], El)
            for j, e in enumerate(experts):
                p = f"model.layers.{layer}.mlp.experts.{e}"
                assert torch.equal(gates[j], sd[f"{p}.gate_proj.weight"])
                assert torch.equal(ups[j], sd[f"{p}.up_proj.weight"])
                assert torch.equal(downs[j], sd[f"{p}.down_proj.weight"])
                checked += 3
    assert checked == cfg.num_hidden_layers * E * 3


def test_grouped_gemm_semantics_match_hf_experts(hf_model) -> None:
    """megatron GroupedMLP: w1 = weight1.view(E, H, -1); fc1 = x @ w1[e]; glu = silu(chunk0) * chunk1;
    out = glu @ weight2.view(E, -1, H)[e] — equals the HF expert module on the same tokens."""
    sd = hf_model.state_dict()
    E, H = hf_model.config.num_experts, hf_model.config.hidden_size
    w1, w2 = hf_layer_experts_to_grouped(sd, 1, range(E))
    x = torch.randn(5, H, dtype=torch.float64)
    b1, b2 = w1.view(E, H, -1), w2.view(E, -1, H)
    for e in range(E):
        a, b = torch.chunk(x @ b1[e], 2, dim=-1)
        ours = (F.silu(a) * b) @ b2[e]
        ref = hf_model.model.layers[1].mlp.experts[e](x)
        assert torch.allclose(ours, ref, atol=1e-12)


def test_weight_sync_names_match_hf(hf_model) -> None:
    sd = hf_model.state_dict()
    E = hf_model.config.num_experts
    El = E // 2
    seen = set()
    for r in range(2):  # EP 2: rank r holds experts r*El ..
        w1, w2 = hf_layer_experts_to_grouped(sd, 0, range(r * El, (r + 1) * El))
        for name, t in (("decoder.layers.0.mlp.experts.weight1", w1), ("decoder.layers.0.mlp.experts.weight2", w2)):
            names, tensors = mcore_grouped_names_to_hf(name, t, El, expert_offset=r * El)
            for n, x in zip(names, tensors, strict=True):
                assert n in sd and x.shape == sd[n].shape and torch.equal(x, sd[n]), n
                seen.add(n)
    assert seen == {k for k in sd if k.startswith("model.layers.0.mlp.experts.")}
    with pytest.raises(ValueError, match="not a GroupedMLP"):
        mcore_grouped_names_to_hf("decoder.layers.0.mlp.linear_fc1.weight", w1, El)
