"""Generated gsm8k-style word problems for the tiny CPU training run (no hub access).

``python -m qwen3_rl tiny-data --out DIR [--train N] [--test N]`` writes ``DIR/raw/{train,test}.jsonl`` in
gsm8k's own shape (``{"question", "answer"}``, the answer ending in ``#### <number>``) and converts them
with ``python -m qwen3_rl data prepare --dataset gsm8k`` into ``DIR/gsm8k/{train,test}.parquet``, the files
``internal/train_*_tiny_cpu.sh`` read. Problems are seeded, so the same arguments give the same files.

Two kinds: ``two-step`` (add, then subtract; numbers up to 35) and ``sum`` (one addition of two numbers from 1 to
9): the learning run's problems, which a 2-layer model with a 64-wide residual stream can learn on 2 CPU cores.
The worked answer of a ``sum`` problem is also the warm-up's target (``python -m qwen3_rl tiny-sft``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Tom", "Ana", "Li", "Sam", "Mia", "Raj", "Eva", "Ken")
ITEMS = ("apples", "books", "coins", "pens", "cards", "shells")


def problem(rng: random.Random) -> dict[str, str]:
    """One two-step addition/subtraction word problem with its gsm8k-style worked answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(1, 15)
    c = rng.randint(1, a + b)
    total = a + b - c
    question = (f"{name} has {a} {item}. {name} buys {b} more {item} and gives away {c}. "
                f"How many {item} does {name} have now?")
    answer = f"{name} has {a} + {b} = {a + b} {item}.\nThen {a + b} - {c} = {total}.\n#### {total}"
    return {"question": question, "answer": answer}


def sum_problem(rng: random.Random) -> dict[str, str]:
    """One addition of two numbers from 1 to 9; the worked answer is ``a + b = s. \\boxed{s}`` then ``#### s``."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    question = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have?"
    return {"question": question, "answer": f"{a} + {b} = {a + b}. \\boxed{{{a + b}}}\n#### {a + b}"}


KINDS = {"two-step": problem, "sum": sum_problem}


def write_raw(out: Path, split: str, n: int, seed: int, kind: str = "two-step") -> Path:
    """Write ``n`` problems of ``kind`` to ``out/raw/<split>.jsonl``; returns the path."""
    rng = random.Random(f"{seed}-{split}")
    path = out / "raw" / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(KINDS[kind](rng)) + "\n" for _ in range(n)))
    return path


def make_tiny_data(out: Path, n_train: int = 48, n_test: int = 16, seed: int = 0,
                   kind: str = "two-step") -> dict[str, Path]:
    """Raw jsonl + verl parquet for both splits; returns ``{"train": parquet, "test": parquet}``."""
    from qwen3_rl.tools.data.prepare import prepare

    if n_train < 1 or n_test < 1:
        raise ValueError(f"need at least one problem per split, got train={n_train} test={n_test}")
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
    return {split: prepare("gsm8k", write_raw(out, split, n, seed, kind), out / "gsm8k", split)
            for split, n in (("train", n_train), ("test", n_test))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl tiny-data", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory (created)")
    ap.add_argument("--train", type=int, default=48, help="training problems")
    ap.add_argument("--test", type=int, default=16, help="validation problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", choices=sorted(KINDS), default="two-step", help="problem kind (see the module doc)")
    a = ap.parse_args(argv)
    try:
        paths = make_tiny_data(a.out, a.train, a.test, a.seed, a.kind)
    except ValueError as exc:
        ap.error(str(exc))
    for split, p in paths.items():
        print(f"{split}: {p}")
    return 0
