"""Training-log report (``python -m qwen3_rl report``): parse verl step lines, table, plots, and the
reference documents' published figures."""

from qwen3_rl.tools.report.parse import ReportError, StepLog, parse_lines, parse_log, parse_value
from qwen3_rl.tools.report.published import PUBLISHED, Figure, resolve_setup

__all__ = [
    "PUBLISHED",
    "Figure",
    "ReportError",
    "StepLog",
    "parse_lines",
    "parse_log",
    "parse_value",
    "resolve_setup",
]
