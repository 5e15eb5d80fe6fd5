"""``python -m qwen3_rl report LOG [--plot DIR] [--setup NAME] [--json]``.

Reads verl's console step lines, prints a compact per-step table of selected metrics, writes PNG
plots, and compares with the reference documents' published figures for ``--setup``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from qwen3_rl.tools.report.parse import ReportError, StepLog, finite, parse_log
from qwen3_rl.tools.report.published import PUBLISHED, Figure, resolve_setup

TABLE_KEYS = (
    "critic/score/mean",
    "critic/rewards/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "perf/throughput",
    "perf/time_per_step",
    "timing_s/gen",
    "timing_s/generate_sequences",
    "timing_s/update_actor",
    "timing_s/step",
    # speculative decoding (verl 0013; only in logs of runs with a drafter and vLLM stats on)
    "rollout/spec_decode/draft_tokens",
    "rollout/spec_decode/acceptance_rate",
)
_ABBREV = (
    ("val-core/", "val/"),
    ("critic/", ""),
    ("timing_s/", "t/"),
    ("response_length/", "resp_len/"),
    ("perf/", ""),
    ("rollout/spec_decode/", "sd/"),
)
#: verl's validation accuracy keys (``val-core/<data source>/<reward key>/mean@N``): table columns when logged
VAL_PREFIX = "val-core/"
SPEC_DRAFT_TOKENS = "rollout/spec_decode/draft_tokens"
SPEC_ACCEPTED_TOKENS = "rollout/spec_decode/accepted_tokens"


def _short(key: str) -> str:
    for prefix, repl in _ABBREV:
        if key.startswith(prefix):
            return repl + key[len(prefix) :]
    return key


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"


def format_table(log: StepLog, keys: Sequence[str]) -> str:
    """Fixed-width table: one row per step, one column per key present in the log."""
    cols = [k for k in keys if any(k in m for m in log.steps.values())]
    heads = ["step"] + [_short(k) for k in cols]
    rows = [[str(s)] + [_fmt(log.steps[s].get(k)) for k in cols] for s in sorted(log.steps)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def val_keys(log: StepLog) -> list[str]:
    """The log's validation means (``val-core/.../mean@N``), in first-seen order."""
    return [k for k in log.keys() if k.startswith(VAL_PREFIX) and "/mean@" in k]


def spec_decode_summary(log: StepLog) -> str | None:
    """One line on speculative decoding when the log carries ``rollout/spec_decode/*`` (else None):
    in how many steps the rollout drafted, and accepted / drafted tokens over the whole log."""
    steps, drafted = log.series(SPEC_DRAFT_TOKENS)
    if not steps:
        return None
    on = sum(1 for d in drafted if d > 0)
    line = f"speculative decoding: drafted in {on} of {len(steps)} steps that logged spec-decode counters"
    both = [m for m in log.steps.values() if SPEC_DRAFT_TOKENS in m and SPEC_ACCEPTED_TOKENS in m]
    total = sum(m[SPEC_DRAFT_TOKENS] for m in both)
    if total > 0 and math.isfinite(total):
        line += f", acceptance rate {sum(m[SPEC_ACCEPTED_TOKENS] for m in both) / total:.3f} over the log"
    return line


ROUTING = "rollout/routing/"


def routing_summary(log: StepLog) -> str | None:
    """One line on server-mode routing when the log carries ``rollout/routing/*`` (SERVER_ROUTING, else None): the
    mean over steps of the share of sibling pairs on one engine and of the token spread, ours against verl's routing
    replayed on the same requests."""

    def mean(key: str) -> float | None:
        vals = finite(log.series(ROUTING + key)[1])
        return statistics.fmean(vals) if vals else None

    same, verl_same = mean("sibling_same_engine"), mean("verl_sibling_same_engine")
    if same is None:
        return None
    steps = len(log.series(ROUTING + "sibling_same_engine")[0])
    line = f"server routing over {steps} steps: siblings on one engine {same:.3f} (verl's routing {_fmt(verl_same)})"
    spread, verl_spread = mean("load_spread_tokens"), mean("verl_load_spread_tokens")
    if spread is not None:
        line += f", token spread {spread:.3f} (verl's {_fmt(verl_spread)})"
    return line


def compare(log: StepLog, figures: Sequence[Figure]) -> list[dict[str, Any]]:
    """One row per published figure: the log's value at the figure's step (or the mean over the run
    when the figure is a run average), the best value, and measured / published."""
    out = []
    for f in figures:
        steps, values = log.series(f.key)
        vals = finite(values)
        row: dict[str, Any] = {
            "key": f.key,
            "published": f.value,
            "unit": f.unit,
            "published_step": f.step,
            "source": f.source,
            "measured": None,
            "measured_how": None,
            "best": None,
            "ratio": None,
            "meets": None,
        }
        if vals:
            if f.step is not None and f.step in steps:
                row["measured"], row["measured_how"] = log.steps[f.step][f.key], f"step {f.step}"
            elif f.step is not None:
                row["measured"], row["measured_how"] = (
                    values[0],
                    f"step {steps[0]} (step {f.step} not logged)",
                )
            else:
                row["measured"], row["measured_how"] = statistics.fmean(vals), f"mean of {len(vals)} steps"
            row["best"] = min(vals) if f.better == "lower" else max(vals)
            m = row["measured"]
            if math.isfinite(m) and f.value:
                row["ratio"] = m / f.value
                if f.better == "higher":
                    row["meets"] = m >= f.value
                elif f.better == "lower":
                    row["meets"] = m <= f.value
        out.append(row)
    return out


def format_comparison(setup: str, rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"published figures for {setup}: {PUBLISHED[setup][0]}"]
    for r in rows:
        if r["measured"] is None:
            lines.append(f"  {r['key']}: published {r['published']:g} {r['unit']} — not in this log")
            continue
        verdict = "" if r["meets"] is None else ("  meets" if r["meets"] else "  short of it")
        lines.append(
            f"  {r['key']}: published {r['published']:g} {r['unit']} ({r['source']}), "
            f"this log {_fmt(r['measured'])} [{r['measured_how']}], ratio {r['ratio']:.3f}{verdict}"
        )
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qwen3_rl report", description=__doc__.splitlines()[0])
    p.add_argument("log", help="verl console log (stdout of the trainer)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--setup", help=f"compare with published figures: {', '.join(sorted(PUBLISHED))}")
    p.add_argument("--keys", help="comma-separated metric keys for the table (default: a fixed selection)")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    p.add_argument(
        "--follow",
        metavar="PID",
        type=int,
        help="print one progress line per new step while process PID runs, then exit",
    )
    p.add_argument(
        "--from-byte",
        metavar="N",
        type=int,
        default=0,
        help="with --follow: read LOG from byte N on (the size it had when this run started)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 on success, 1 on a report error (one line on stderr), 2 on usage errors."""
    args = _build_parser().parse_args(argv)
    if args.follow is not None:
        from pathlib import Path

        from qwen3_rl.tools.report.progress import follow

        follow(Path(args.log), args.follow, start=args.from_byte)
        return 0
    try:
        setup = None
        if args.setup:
            try:
                setup = resolve_setup(args.setup)
            except KeyError as e:
                raise ReportError(e.args[0]) from None
        log = parse_log(args.log)
        keys = (
            [k.strip() for k in args.keys.split(",") if k.strip()]
            if args.keys
            else [*TABLE_KEYS, *val_keys(log)]
        )
        figures = PUBLISHED[setup][1] if setup else ()
        rows = compare(log, figures) if setup else []
        plots: dict[str, str] = {}
        if args.plot:
            from qwen3_rl.tools.report.plots import write_plots

            try:
                plots = {k: str(v) for k, v in write_plots(log, args.plot, figures).items()}
            except OSError as e:
                raise ReportError(f"cannot write plots to {args.plot}: {e.strerror or e}") from None
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        doc = {
            "log": args.log,
            "num_steps": len(log.steps),
            "keys": log.keys(),
            "steps": {str(s): log.steps[s] for s in sorted(log.steps)},
            "setup": setup,
            "comparison": rows,
            "plots": plots,
            "repeated_steps": log.repeated_steps,
            "merged_lines": log.merged_lines,
            "skipped_values": log.skipped_values,
        }
        print(json.dumps(doc, indent=2, allow_nan=True))
        return 0
    print(f"{len(log.steps)} steps, {len(log.keys())} metrics in {args.log}")
    print(format_table(log, keys))
    for summary in (spec_decode_summary(log), routing_summary(log)):
        if summary:
            print(summary)
    if log.repeated_steps:
        print(
            f"note: steps logged again (a resumed or rerun job; the last kept): {sorted(set(log.repeated_steps))}"
        )
    if setup:
        print(format_comparison(setup, rows))
    for name, path in plots.items():
        print(f"plot {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
