"""Model shape facts read from a Hugging Face ``config.json`` (Qwen3 dense / Qwen3-MoE field names).

Only the fields the memory plan needs are read. Parameter counts are exact for the Qwen3 /
Qwen3-MoE architectures (no biases; q_norm / k_norm RMSNorm over ``head_dim``; SwiGLU MLPs with
gate, up and down projections; a bias-free router of shape ``[num_experts, hidden]``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PlanError(ValueError):
    """A user-facing error: one line, printed as ``error: <message>`` by the CLIs."""


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a Qwen3 / Qwen3-MoE decoder (all sizes are element counts, not bytes).

    ``sparse_layers`` lists the indices of MoE layers; every other layer has a dense MLP of width
    ``intermediate_size``.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    intermediate_size: int  # dense MLP width (0 if every layer is MoE and the field is absent)
    num_experts: int  # 0 for a dense model
    num_experts_per_tok: int
    moe_intermediate_size: int
    sparse_layers: tuple[int, ...]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_sparse_layers(self) -> int:
        return len(self.sparse_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.sparse_layers)

    # --- per-layer parameter counts (unsharded) -------------------------------------------
    def attention_params(self) -> int:
        """q/k/v/o projections + q_norm/k_norm weights, one layer: ``h·d·(2·Hq + 2·Hkv) + 2·d``."""
        h, d = self.hidden_size, self.head_dim
        return h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * d

    def dense_mlp_params(self) -> int:
        """Gate, up and down projections of a dense layer: ``3·h·I``."""
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """One routed expert (gate, up, down): ``3·h·I_moe``."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def router_params(self) -> int:
        """Router weight ``[E, h]`` of one MoE layer."""
        return self.num_experts * self.hidden_size

    def layer_norm_params(self) -> int:
        """input_layernorm + post_attention_layernorm of one layer."""
        return 2 * self.hidden_size

    def embedding_params(self) -> int:
        """Input embedding (one ``[V, h]`` table)."""
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """Unsharded parameter count of the whole model (embedding and LM head counted once if tied)."""
        per_layer_common = self.attention_params() + self.layer_norm_params()
        total = self.num_layers * per_layer_common
        total += self.num_dense_layers * self.dense_mlp_params()
        total += self.num_sparse_layers * (self.num_experts * self.expert_params() + self.router_params())
        total += self.embedding_params() * (1 if self.tie_word_embeddings else 2)
        total += self.hidden_size  # final norm
        return total


def _need(cfg: Mapping[str, Any], key: str, source: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise PlanError(f"{source}: model config lacks '{key}' (needed by plan)")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{source}: '{key}' must be a positive integer, got {value!r}")
    return value


def model_spec_from_dict(cfg: Mapping[str, Any], source: str = "config") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed HF config dict.

    Required: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``vocab_size``; dense models also ``intermediate_size``; MoE models
    (``num_experts`` > 0) ``num_experts_per_tok`` and ``moe_intermediate_size``. ``head_dim``
    defaults to ``hidden_size // num_attention_heads`` as vLLM does; MoE layer selection follows
    HF Qwen3-MoE (``decoder_sparse_step``, ``mlp_only_layers``).
    """
    if not isinstance(cfg, Mapping):
        raise PlanError(f"{source}: model config is not a JSON object")
    hidden = _need(cfg, "hidden_size", source)
    layers = _need(cfg, "num_hidden_layers", source)
    heads = _need(cfg, "num_attention_heads", source)
    kv_heads = _need(cfg, "num_key_value_heads", source)
    vocab = _need(cfg, "vocab_size", source)
    head_dim = cfg.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise PlanError(f"{source}: 'head_dim' must be a positive integer, got {head_dim!r}")
    if heads % kv_heads:
        raise PlanError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    num_experts = int(cfg.get("num_experts") or 0)
    sparse: tuple[int, ...] = ()
    topk = moe_inter = 0
    if num_experts > 0:
        topk = _need(cfg, "num_experts_per_tok", source)
        moe_inter = _need(cfg, "moe_intermediate_size", source)
        step = int(cfg.get("decoder_sparse_step") or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
    if len(sparse) < layers:
        inter = _need(cfg, "intermediate_size", source)
    else:
        inter = int(cfg.get("intermediate_size") or 0)
    name = str(cfg.get("_name_or_path") or cfg.get("model_type") or source)
    return ModelSpec(
        name=name,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        intermediate_size=inter,
        num_experts=num_experts,
        num_experts_per_tok=topk,
        moe_intermediate_size=moe_inter,
        sparse_layers=sparse,
    )


def load_model_config(path: str | Path) -> ModelSpec:
    """Read ``config.json`` (or a model directory holding one) into a :class:`ModelSpec`."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanError(f"model config not found: {p}")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read model config {p}: {str(e).splitlines()[0]}") from None
    return model_spec_from_dict(cfg, source=str(p))
