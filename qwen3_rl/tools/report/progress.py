"""``python -m qwen3_rl report LOG --follow PID``: one progress line per training step while a run writes LOG.

Prints ``[ray_start_npu] progress: step N of M: T s (gen a s, update b s, ...)`` for every new step record (verl's
console line, ``timing_s/*``; M from verl's ``Total training steps: M`` line), the drafted / accepted tokens when the
step carries ``rollout/spec_decode/*`` and the validation accuracy when it carries ``val-core`` metrics; returns once
process PID has exited and the log has been read a last time. Used by the CPU profile of ``ray_start_npu.sh``.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from qwen3_rl.tools.launch.cpu_binding import pid_alive
from qwen3_rl.tools.report.parse import parse_lines

_TOTAL_RE = re.compile(r"Total training steps: (\d+)")
#: stages shown after the step time (verl's timer names; the step total covers them)
STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor")


def step_line(step: int, total: int | None, metrics: dict[str, float]) -> str:
    """The progress line of one step record."""
    of = f" of {total}" if total else ""
    if "timing_s/step" in metrics:
        parts = ", ".join(f"{s} {metrics[f'timing_s/{s}']:.1f} s" for s in STAGES if f"timing_s/{s}" in metrics)
        line = f"[ray_start_npu] progress: step {step}{of}: {metrics['timing_s/step']:.1f} s ({parts})"
    else:
        line = f"[ray_start_npu] progress: validation before step 1{of}"
    drafted, accepted = metrics.get("rollout/spec_decode/draft_tokens"), metrics.get("rollout/spec_decode/accepted_tokens")
    if drafted is not None and accepted is not None:
        line += f"; drafted {drafted:.0f}, accepted {accepted:.0f} tokens"
    val = {k: v for k, v in metrics.items() if k.startswith("val-core/") and "/mean@" in k}
    if val:
        line += "; " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(val.items()))
    return line


def follow(log: Path, pid: int, poll_s: float = 2.0, out=sys.stdout, start: int = 0) -> int:
    """Print a line per new step until ``pid`` exits; returns the number of steps printed.

    ``start``: byte offset where this run's output begins (the launcher appends every run to the same log, so
    earlier runs' steps and step totals are not this run's)."""
    seen: set[int] = set()
    total: int | None = None
    while True:
        alive = pid_alive(pid)
        text = _read_from(log, start)
        if total is None and (m := _TOTAL_RE.search(text)):
            total = int(m.group(1))
        parsed = parse_lines(text.splitlines())
        for step in sorted(parsed.steps):
            if step not in seen:
                seen.add(step)
                print(step_line(step, total, parsed.steps[step]), file=out, flush=True)
        if not alive:
            return len(seen)
        time.sleep(poll_s)


def _read_from(log: Path, start: int) -> str:
    """The text of ``log`` from byte ``start`` ("" while it does not exist)."""
    if not log.is_file():
        return ""
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")
