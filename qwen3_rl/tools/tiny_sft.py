"""A short, seeded supervised warm-up of the tiny model on CPU: it teaches the answer format before GRPO.

``python -m qwen3_rl tiny-sft --model DIR --data DIR --out DIR [--steps N] [--seed S]`` trains the HF model in
``--model`` on the worked answers of ``DIR/raw/train.jsonl`` (``a + b = s. \\boxed{s}``; the ``#### s`` line is
dropped) behind the exact prompts verl sends (``DIR/gsm8k/train.parquet``'s chat messages through the tokenizer's
chat template), loss on the answer tokens and the closing ``<|im_end|>`` only; writes the model (and the tokenizer)
to ``--out``. A random model scores 0 on every problem, so every GRPO advantage would be 0: the warm-up is kept
short (``--steps``) so that the format is learnt and the arithmetic is not, which leaves room for GRPO to improve
(greedy accuracy on the test split is printed before and after). Seeded: same arguments, same weights.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def _examples(data: Path, split: str) -> list[tuple[list[dict], str, str]]:
    """(chat messages, worked answer without the ``####`` line, ground truth) per problem of ``split``."""
    import pandas as pd

    df = pd.read_parquet(data / "gsm8k" / f"{split}.parquet")
    raw = [json.loads(line) for line in (data / "raw" / f"{split}.jsonl").read_text().splitlines() if line.strip()]
    if len(raw) != len(df):
        raise SystemExit(f"error: {data}: {len(raw)} raw problems but {len(df)} parquet rows ({split})")
    out = []
    for (_, row), r in zip(df.iterrows(), raw, strict=True):
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in list(row["prompt"])]
        out.append((msgs, r["answer"].rsplit("####", 1)[0].strip(), str(row["reward_model"]["ground_truth"])))
    return out


def greedy_accuracy(model, tok, examples: list[tuple[list[dict], str, str]], max_new_tokens: int = 24) -> float:
    """Share of ``examples`` whose greedy answer the recipe's reward (``qwen3_rl/data/reward.py``) scores 1."""
    import torch

    from qwen3_rl.data.reward import compute_score

    tok.padding_side = "left"
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _, _ in examples]
    right = 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(prompts), 32):
            enc = tok(prompts[i:i + 32], return_tensors="pt", padding=True, add_special_tokens=False,
                      return_token_type_ids=False)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            for j, seq in enumerate(gen[:, enc["input_ids"].shape[1]:]):
                text = tok.decode(seq, skip_special_tokens=True)
                right += float(compute_score("gsm8k", text, examples[i + j][2])["score"] > 0)
    return right / max(len(prompts), 1)


def unmarked(answer: str) -> str:
    """The worked answer without its final marked answer: ``a + b = s. \\boxed{s}`` -> ``a + b = s.``."""
    i = answer.rfind("\\boxed{")
    return answer[:i].rstrip() if i > 0 else answer


def warm_up(model_dir: Path, data: Path, out: Path, steps: int = 60, lr: float = 3e-3, batch: int = 32,
            seed: int = 0, marked: float = 1.0, log=print) -> dict[str, float]:
    """Train and save; returns ``{"acc_before", "acc_after", "loss_first", "loss_last", "seconds"}``.

    Args:
        steps: optimizer steps (AdamW, ``lr``, batches of ``batch`` problems drawn with ``seed``).
        marked: share of the training problems whose target keeps the marked final answer (``\\boxed{s}``); the
            others end after the worked sum, which the reward scores 0 (no marked answer). Chosen per problem
            with ``seed``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    train, test = _examples(data, "train"), _examples(data, "test")
    acc_before = greedy_accuracy(model, tok, test)
    seqs = []
    pick = random.Random(f"{seed}-marked")
    for msgs, answer, _ in train:
        if pick.random() >= marked:
            answer = unmarked(answer)
        p = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        pi = tok(p, add_special_tokens=False)["input_ids"]
        ai = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append((pi, ai))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        chunk = [seqs[rng.randrange(len(seqs))] for _ in range(batch)]
        width = max(len(p) + len(a) for p, a in chunk)
        ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (p, a) in enumerate(chunk):
            n = len(p) + len(a)
            ids[i, :n] = torch.tensor(p + a)
            labels[i, len(p):n] = torch.tensor(a)
            mask[i, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    acc_after = greedy_accuracy(model, tok, test)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        (out / "generation_config.json").write_text(gen.read_text())
    res = {"acc_before": acc_before, "acc_after": acc_after, "loss_first": losses[0] if losses else 0.0,
           "loss_last": losses[-1] if losses else 0.0, "seconds": time.perf_counter() - t0}
    (out / "warm_up.json").write_text(json.dumps({**res, "steps": steps, "lr": lr, "batch": batch, "seed": seed,
                                                  "marked": marked}, indent=1) + "\n")
    log(f"tiny-sft: {steps} steps in {res['seconds']:.0f} s, loss {res['loss_first']:.2f} -> {res['loss_last']:.2f}, "
        f"greedy test accuracy {acc_before:.2f} -> {acc_after:.2f}; wrote {out}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl tiny-sft", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="HF model directory to start from")
    ap.add_argument("--data", required=True, type=Path, help="tiny-data output directory (raw/ and gsm8k/)")
    ap.add_argument("--out", required=True, type=Path, help="output directory (created)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--marked", type=float, default=1.0,
                    help="share of targets that keep the marked final answer (default 1)")
    a = ap.parse_args(argv)
    if a.steps < 0:
        ap.error("--steps must be >= 0")
    for d in (a.model, a.data):
        if not d.is_dir():
            ap.error(f"no such directory: {d}")
    warm_up(a.model, a.data, a.out, steps=a.steps, lr=a.lr, seed=a.seed, marked=a.marked)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
