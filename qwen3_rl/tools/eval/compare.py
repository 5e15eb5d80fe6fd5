"""``eval compare``: accuracy before vs after training, beside [ref 004]'s published figures.

Input: two ``score.json`` files of ``eval score`` (before: the base model; after: the merged checkpoint).
Output: one row per dataset with before, after and the change, and, where [ref 004] publishes the same
measurement, its before / after / change: Qwen3-32B on AIME 2024, 16 rounds, 38.99 -> 45.33 after 100 DAPO
steps ([ref 004 §3.4], ais_bench ``aime2024_gen``, the sampling defaults of ``eval score``). Rows have the
shape of ``report``'s comparison rows (``key``, ``published``, ``measured``, ``ratio``, ``source``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CompareError(ValueError):
    """A user-facing error of ``eval compare``: one line."""


@dataclass(frozen=True)
class PublishedAccuracy:
    """A published before / after accuracy (percent)."""

    dataset: str
    model: str
    before: float
    after: float
    how: str
    source: str


PUBLISHED_ACCURACY: dict[str, PublishedAccuracy] = {
    "aime2024": PublishedAccuracy("aime2024", "Qwen3-32B", 38.99, 45.33,
                                  "100 DAPO steps, dapo-math-17k, 16 rounds", "ref 004 §3.4"),
}


def load_score(path: str | Path) -> dict[str, Any]:
    """A ``score.json`` (or the directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "score.json"
    try:
        doc = json.loads(p.read_text())
    except OSError:
        raise CompareError(f"score file {p} not found") from None
    except ValueError:
        raise CompareError(f"{p} is not JSON") from None
    for key in ("dataset", "accuracy_mean", "accuracy_std", "rounds", "num_problems"):
        if key not in doc:
            raise CompareError(f"{p} lacks '{key}' (not an `eval score` output)")
    return doc


def _dataset_key(name: str) -> str:
    low = name.lower().replace("-", "").replace("_", "")
    return "aime2024" if "aime" in low and "2024" in low else ("gsm8k" if "gsm8k" in low else name)


def compare_scores(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One comparison row: before / after / change (percentage points), and the published figures."""
    ds_b, ds_a = _dataset_key(str(before["dataset"])), _dataset_key(str(after["dataset"]))
    if ds_b != ds_a:
        raise CompareError(f"before is {before['dataset']}, after is {after['dataset']}: not the same dataset")
    if before["num_problems"] != after["num_problems"]:
        raise CompareError(f"before scored {before['num_problems']} problems, after {after['num_problems']}")
    row: dict[str, Any] = {
        "key": f"{ds_b}/accuracy",
        "dataset": ds_b,
        "num_problems": after["num_problems"],
        "before": before["accuracy_mean"], "before_std": before["accuracy_std"], "before_rounds": before["rounds"],
        "before_model": before.get("model"),
        "after": after["accuracy_mean"], "after_std": after["accuracy_std"], "after_rounds": after["rounds"],
        "after_model": after.get("model"),
        "measured": after["accuracy_mean"] - before["accuracy_mean"],
        "unit": "points",
        "published": None, "published_before": None, "published_after": None, "published_model": None,
        "source": None, "ratio": None,
    }
    pub = PUBLISHED_ACCURACY.get(ds_b)
    if pub:
        row.update(published=pub.after - pub.before, published_before=pub.before, published_after=pub.after,
                   published_model=f"{pub.model}, {pub.how}", source=pub.source)
        if row["published"]:
            row["ratio"] = row["measured"] / row["published"]
    return row


def markdown(row: dict[str, Any]) -> str:
    """The comparison as a markdown table."""
    lines = [
        "| dataset | problems | before % | after % | change (points) | published before % | published after % "
        "| published change |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def pm(mean: float, std: float, rounds: int) -> str:
        return f"{mean:.2f} ± {std:.2f} ({rounds} rounds)"

    pub = ("– | – | –" if row["published"] is None else
           f"{row['published_before']:.2f} | {row['published_after']:.2f} | {row['published']:+.2f}")
    lines.append(f"| {row['dataset']} | {row['num_problems']} | {pm(row['before'], row['before_std'], row['before_rounds'])} "
                 f"| {pm(row['after'], row['after_std'], row['after_rounds'])} | {row['measured']:+.2f} | {pub} |")
    if row["published"] is not None:
        lines.append("")
        lines.append(f"Published: {row['published_model']} ({row['source']}).")
    return "\n".join(lines)


def plot(row: dict[str, Any], out: str | Path) -> Path:
    """Bar chart: before / after of this run beside the published pair (PNG, matplotlib Agg)."""
    try:
        import matplotlib
    except ImportError:
        raise CompareError("--plot needs matplotlib (pip install matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    groups = [("this run", row["before"], row["after"], row["before_std"], row["after_std"])]
    if row["published"] is not None:
        groups.append((f"published ({row['source']})", row["published_before"], row["published_after"], 0.0, 0.0))
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    width = 0.35
    for i, (_label, b, a, sb, sa) in enumerate(groups):
        ax.bar(i - width / 2, b, width, yerr=sb or None, color="#9bb7d4", label="before" if i == 0 else None)
        ax.bar(i + width / 2, a, width, yerr=sa or None, color="#2f6ea5", label="after" if i == 0 else None)
        for x, v in ((i - width / 2, b), (i + width / 2, a)):
            ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [g[0] for g in groups])
    ax.set_ylabel(f"{row['dataset']} accuracy %")
    ax.set_title(f"{row['dataset']}: before vs after training")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: Sequence[str]) -> int:
    """``eval compare BEFORE AFTER [--plot PNG] [--json]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m qwen3_rl eval compare", description=__doc__.splitlines()[0])
    ap.add_argument("before", help="score.json (or its directory) of the model before training")
    ap.add_argument("after", help="score.json (or its directory) of the trained model")
    ap.add_argument("--plot", metavar="PNG", help="write a bar chart")
    ap.add_argument("--json", action="store_true", help="print the comparison row as JSON")
    args = ap.parse_args(list(argv))
    try:
        row = compare_scores(load_score(args.before), load_score(args.after))
        png = None
        if args.plot:
            try:
                png = plot(row, args.plot)
            except OSError as e:
                raise CompareError(f"cannot write {args.plot}: {e.strerror or e}") from None
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"comparison": [row], "plot": str(png) if png else None}, indent=2))
    else:
        print(markdown(row))
        if png:
            print(f"plot: {png}")
    return 0
