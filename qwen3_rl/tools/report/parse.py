"""Parse verl's console step lines into per-step metric dicts.

verl 0.6.1 prints one line per step (verl/utils/logger/aggregate_logger.py:26-32,
``concat_dict_to_str``)::

    step:12 - actor/grad_norm:0.041 - critic/rewards/mean:np.float64(-0.41) - ...

i.e. ``step:N`` then ``key:pprint.pformat(value)`` items joined by ``" - "``; only
``numbers.Number`` values are printed, so a value is a Python/numpy number repr: ``0.5``, ``3``,
``nan``, ``inf``, ``True``, ``np.float64(1.0)``, ``np.int64(3)``, ``numpy.float32(2.5)``. Ray
prefixes worker output with ``(TaskRunner pid=...)``; that prefix and timestamps are skipped.
A step record wrapped over several lines (the step line ends with ``-``; then ``key:value -``
lines and ``……`` elision lines, as [ref 004 §2.4] shows it) is also read.

Several lines of one step are one record: verl 0.9.1's fully-async trainer logs each weight version (its step) on up
to three lines of the same format, the rollouter's timing (``verl/experimental/fully_async_policy/
fully_async_trainer.py:783-786``), the validation (``:829-830``, ``:855-856``) and the trainer's aggregated metrics
(``:806-809``); their keys are merged. A line that repeats more than half of its keys already in its step's record
is the step logged again (a resumed or rerun job appending to the same log): it replaces the record
(:attr:`StepLog.repeated_steps`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

_STEP_RE = re.compile(r"(?:^|[\s)\]|])step:(\d+)(?=\s*(?:-|$))")
_NUMPY_RE = re.compile(r"^(?:np|numpy)\.(?:float|int|uint|bool_?)\w*\((.*)\)$")
_ELLIPSIS_RE = re.compile(r"^[\s.…·]*$")
_ITEM_RE = re.compile(r"^\s*([A-Za-z0-9_@./\-\[\]]+):(\S.*?)\s*$")


class ReportError(ValueError):
    """A user-facing error: one line, printed as ``error: <message>``."""


@dataclass
class StepLog:
    """Metrics of a parsed log: ``steps[n]`` maps metric key → float for step ``n``."""

    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    skipped_values: int = 0  # items whose value was not a number
    repeated_steps: list[int] = field(default_factory=list)  # steps logged again (resume / rerun): replaced
    merged_lines: int = 0  # lines whose keys joined their step's record (verl's fully-async trainer)

    def keys(self) -> list[str]:
        """All metric keys, in first-seen order."""
        seen: dict[str, None] = {}
        for metrics in self.steps.values():
            for k in metrics:
                seen.setdefault(k, None)
        return list(seen)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one key, sorted by step, only steps that logged it."""
        xs = [s for s in sorted(self.steps) if key in self.steps[s]]
        return xs, [self.steps[s][key] for s in xs]


def parse_value(text: str) -> float | None:
    """A printed number → float; ``None`` if it is not a number repr."""
    t = text.strip()
    m = _NUMPY_RE.match(t)
    if m:
        t = m.group(1).strip()
    if t in ("True", "False"):
        return 1.0 if t == "True" else 0.0
    try:
        return float(t)
    except ValueError:
        return None


def _split_items(body: str) -> list[str]:
    """``" - "``-separated items; a trailing ``-`` (line continuation) is dropped."""
    body = body.strip()
    if body.endswith(" -") or body == "-":
        body = body[:-1]
    return [p for p in (s.strip() for s in body.split(" - ")) if p]


def _add_items(items: list[str], metrics: dict[str, float], log: StepLog) -> None:
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or not key.strip():
            log.skipped_values += 1
            continue
        v = parse_value(value)
        if v is None:
            log.skipped_values += 1
            continue
        metrics[key.strip()] = v


def _add_record(log: StepLog, step: int, metrics: dict[str, float]) -> None:
    """Merge one line's ``metrics`` into step ``step``'s record, or replace the record when the line repeats more than
    half of its keys (the step logged again)."""
    old = log.steps.get(step)
    if old is None:
        log.steps[step] = metrics
    elif 2 * len(metrics.keys() & old.keys()) > len(metrics):
        log.repeated_steps.append(step)
        log.steps[step] = metrics
    else:
        old.update(metrics)
        log.merged_lines += 1


def parse_lines(lines: list[str]) -> StepLog:
    """Parse log lines (see module doc): one record per step, the lines of a step merged; a step logged again
    replaces its record."""
    log = StepLog()
    i = 0
    while i < len(lines):
        line = lines[i].rstrip("\n")
        m = _STEP_RE.search(line)
        i += 1
        if not m:
            continue
        step = int(m.group(1))
        metrics: dict[str, float] = {}
        rest = line[m.end() :].strip()
        if rest.startswith("-"):
            rest = rest[1:]
        _add_items(_split_items(rest), metrics, log)
        if line.rstrip().endswith("-"):
            # wrapped record: item lines and elision lines until anything else
            while i < len(lines):
                nxt = lines[i].rstrip("\n")
                if not nxt.strip() or _STEP_RE.search(nxt):
                    break
                if _ELLIPSIS_RE.match(nxt):
                    i += 1
                    continue
                items = _split_items(nxt)
                if not items or not all(_ITEM_RE.match(it) for it in items):
                    break
                _add_items(items, metrics, log)
                i += 1
        _add_record(log, step, metrics)
    return log


def parse_log(path: str | Path) -> StepLog:
    """Read and parse a log file; :class:`ReportError` if missing or without step lines."""
    p = Path(path)
    if not p.is_file():
        raise ReportError(f"log not found: {p}")
    try:
        text = p.read_text(errors="replace")
    except OSError as e:
        raise ReportError(f"cannot read log {p}: {e.strerror}") from None
    log = parse_lines(text.splitlines())
    if not log.steps:
        raise ReportError(f"no verl step lines ('step:N - key:value - ...') in {p}")
    return log


def finite(values: list[float]) -> list[float]:
    """Values that are neither NaN nor infinite."""
    return [v for v in values if math.isfinite(v)]
