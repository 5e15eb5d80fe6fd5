"""Tiny random-weight Qwen3 / Qwen3-MoE checkpoints with a locally trained tokenizer (no hub access).

``python -m qwen3_rl tiny-model --out DIR [--moe]`` writes a Hugging Face directory that vLLM
(``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``), transformers and verl load like a real Qwen3:
``config.json``, ``model.safetensors``, ``tokenizer.json`` + ``tokenizer_config.json`` with a
Qwen-style chat template and the ``<|im_start|>`` / ``<|im_end|>`` / ``<|endoftext|>`` specials.
Used by the real-engine tests and the tiny CPU training run; weights are seeded, so the same
arguments give the same files.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Qwen-style chat template (system/user/assistant turns; generation prompt opens an assistant turn).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model (sizes in elements).

    Attributes:
        moe: Qwen3-MoE (``num_experts`` experts, ``top_k`` per token) instead of dense Qwen3.
        vocab_size: tokenizer vocabulary (BPE trained to this size; the model's embedding matches).
        hidden_size / num_layers / num_heads / num_kv_heads / head_dim: attention shape.
        intermediate_size: dense MLP width (dense model, and MoE's unused dense field).
        num_experts / top_k / moe_intermediate_size: MoE shape.
        max_position_embeddings: longest context (tokens).
        seed: torch seed of the random weights.
    """

    moe: bool = False
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # vLLM-CPU's attention kernels refuse 16 ("Invalid CPU attention head_dim")
    intermediate_size: int = 128
    num_experts: int = 4
    top_k: int = 2
    moe_intermediate_size: int = 32
    max_position_embeddings: int = 2048
    seed: int = 0


def _corpus() -> list[str]:
    """A small deterministic English + arithmetic corpus for the BPE trainer."""
    words = ("the answer is step first then total each apples cost dollars how many more than left "
             "she he they buys sells has gives half twice sum of and so we get final boxed number").split()
    lines = []
    for i in range(400):
        a, b = (i * 7) % 97, (i * 13) % 89
        w = " ".join(words[(i + j) % len(words)] for j in range(12))
        lines.append(f"{w} {a} + {b} = {a + b}. {a} * {b} = {a * b}. #### {a + b}")
    return lines


def train_tokenizer(out: Path, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer on the local corpus and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None,
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def make_tiny_model(out: Path, spec: TinySpec = TinySpec()) -> Path:
    """Write tokenizer + random-weight model to ``out`` (created); returns ``out``.

    The model's ``eos_token_id`` is ``<|im_end|>``; ``vocab_size`` equals the tokenizer's.
    """
    import torch
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, spec.vocab_size)
    tok = AutoTokenizer.from_pretrained(str(out))
    vocab = len(tok)
    common = dict(vocab_size=vocab, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
                  max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=False, torch_dtype="float32",
                  bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                  eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                  pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    torch.manual_seed(spec.seed)
    if spec.moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(num_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
                             moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1,
                             norm_topk_prob=True, mlp_only_layers=[], **common)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**common)
        model = Qwen3ForCausalLM(cfg)
    # Larger-than-default init so greedy decoding is not one repeated token from the first step.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = {"bos_token_id": common["bos_token_id"], "eos_token_id": common["eos_token_id"],
           "pad_token_id": common["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl tiny-model", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory (created)")
    ap.add_argument("--moe", action="store_true", help="Qwen3-MoE (4 experts, top-2) instead of dense Qwen3")
    ap.add_argument("--layers", type=int, default=TinySpec.num_layers)
    ap.add_argument("--seed", type=int, default=TinySpec.seed)
    a = ap.parse_args(argv)
    if a.layers < 1:
        ap.error("--layers must be >= 1")
    out = make_tiny_model(a.out, TinySpec(moe=a.moe, num_layers=a.layers, seed=a.seed))
    print(f"tiny-model: wrote {'Qwen3-MoE' if a.moe else 'Qwen3'} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
