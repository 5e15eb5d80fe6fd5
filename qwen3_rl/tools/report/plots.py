"""PNG plots of a parsed verl log (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qwen3_rl.tools.report.parse import StepLog
from qwen3_rl.tools.report.published import Figure

REWARD_KEYS = ("critic/rewards/mean", "critic/score/mean")
#: verl's validation metrics (``val-core/<data source>/<reward key>/mean@N``; step 0 = before training)
VAL_PREFIX = "val-core/"
SPEC_KEYS = ("rollout/spec_decode/acceptance_rate",)
LENGTH_KEYS = ("response_length/mean", "response_length/max", "response_length/min", "prompt_length/mean")
THROUGHPUT_KEYS = ("perf/throughput",)
# Phases timed directly inside verl's "step" timer (verl/trainer/ppo/ray_trainer.py:1055-1254); keys such
# as timing_s/generate_sequences are nested inside "gen" and are not stacked. The weight sync runs inside "gen"
# (sync rollout mode: the worker's rollout_mode before generating).
TOP_LEVEL_PHASES = (
    "gen",
    "gen_max",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
)
# Timed after verl's "step" timer has stopped (ray_trainer.py:1262, :1285): not part of timing_s/step.
AFTER_STEP_PHASES = ("testing", "save_checkpoint")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_steps(ax) -> None:  # noqa: ANN001 (matplotlib Axes)
    """Steps are integers: ticks only on whole steps."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _line_plot(
    log: StepLog, keys: Sequence[str], title: str, ylabel: str, out: Path, published: Sequence[Figure],
    ylim: tuple[float, float] | None = None,
) -> Path | None:
    present = [k for k in keys if log.series(k)[0]]
    if not present:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, k in enumerate(present):
        xs, ys = log.series(k)
        ax.plot(xs, ys, marker="o", markersize=3, linestyle=("-", "--", ":", "-.")[i % 4], label=k)
    for f in published:
        if f.key in present:
            ax.axhline(f.value, linestyle="--", color="grey", label=f"published {f.key} = {f.value:g}")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    _integer_steps(ax)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _timing_plot(log: StepLog, out: Path) -> Path | None:
    """Stacked bars per step: the phases inside verl's step timer, "other" (the rest of ``timing_s/step``), the
    ``timing_s/step`` mark, then, hatched above the mark, what verl times after the step (validation, checkpoint)."""
    steps = sorted(s for s in log.steps if "timing_s/step" in log.steps[s]
                   or any(f"timing_s/{p}" in log.steps[s] for p in TOP_LEVEL_PHASES))
    phases = [p for p in TOP_LEVEL_PHASES if any(f"timing_s/{p}" in log.steps[s] for s in steps)]
    after = [p for p in AFTER_STEP_PHASES if any(f"timing_s/{p}" in log.steps[s] for s in steps)]
    has_total = any("timing_s/step" in log.steps[s] for s in steps)
    if not phases and not has_total:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    bottom = [0.0] * len(steps)
    for p in phases:
        vals = [log.steps[s].get(f"timing_s/{p}", 0.0) for s in steps]
        ax.bar(steps, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if has_total:
        totals = [log.steps[s].get("timing_s/step", float("nan")) for s in steps]
        other = [max(0.0, t - b) if t == t else 0.0 for t, b in zip(totals, bottom, strict=True)]
        if any(o > 0 for o in other):
            ax.bar(steps, other, bottom=bottom, label="other", color="lightgrey")
        ax.plot(steps, totals, color="black", marker="_", markersize=14, linestyle="none",
                label="step total (timing_s/step)")
        bottom = [t if t == t else b for t, b in zip(totals, bottom, strict=True)]
    for p in after:
        vals = [log.steps[s].get(f"timing_s/{p}", 0.0) for s in steps]
        ax.bar(steps, vals, bottom=bottom, label=f"{p} (after the step: not in its total)", hatch="//", alpha=0.5)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_title("time per step by phase (timing_s/*); the step total covers generation (with the weight sync)\n"
                 "to the actor update; validation and checkpoint follow it", fontsize=9)
    _integer_steps(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def write_plots(log: StepLog, out_dir: str | Path, published: Sequence[Figure] = ()) -> dict[str, Path]:
    """Write reward / response length / throughput / timing / validation / SAM acceptance PNGs that the log has
    data for.

    Returns {plot name: path}; plots without any logged key are skipped.
    """
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    made = {
        "reward": _line_plot(log, REWARD_KEYS, "reward", "mean reward / score", d / "reward.png", published),
        "response_length": _line_plot(
            log, LENGTH_KEYS, "sequence length", "tokens", d / "response_length.png", published
        ),
        "throughput": _line_plot(
            log, THROUGHPUT_KEYS, "end-to-end throughput", "tokens / s / die", d / "throughput.png", published
        ),
        "timing": _timing_plot(log, d / "timing.png"),
        "val_accuracy": _line_plot(log, sorted({k for m in log.steps.values() for k in m if k.startswith(VAL_PREFIX)
                                                and "/mean@" in k}),
                                   "validation (verl val-core; step 0 = before training)", "mean over the test split",
                                   d / "val_accuracy.png", published, ylim=(-0.02, 1.02)),
        "sam_acceptance": _line_plot(log, SPEC_KEYS, "SAM speculative decoding: accepted / drafted tokens",
                                     "acceptance rate", d / "sam_acceptance.png", published, ylim=(-0.02, 1.02)),
    }
    return {k: v for k, v in made.items() if v is not None}
