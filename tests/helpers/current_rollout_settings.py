"""The rollout settings a train script gives verl 0.9.1's vLLM servers on the current pin set, read from the command
the script prints (``QWEN3_RL_PRINT_COMMAND=1``, ``PIN_SET=current``): its ``actor_rollout_ref.rollout.engine_kwargs
.vllm.*`` overrides (what ``python -m qwen3_rl features overrides`` emits from features.toml's ``current.sets``, plus
the layout's own), ``rollout.custom.*`` and ``rollout.disable_log_stats``. The engine tests start engines from these
instead of writing the settings by hand.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
ENGINE_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm."
CUSTOM_KEY = "actor_rollout_ref.rollout.custom."
LOG_STATS_KEY = "actor_rollout_ref.rollout.disable_log_stats"


def _value(text: str) -> Any:
    """An override's value as Hydra reads a primitive or a list (YAML: True -> bool, 3 -> int, [a] -> list)."""
    return yaml.safe_load(text)


def _nest(out: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        out = out.setdefault(p, {})
    out[leaf] = value


def rollout_settings(
    switches: dict[str, str], model: Path, setup: str = "train_grpo_tiny_cpu.sh"
) -> dict[str, Any]:
    """Run ``internal/<setup>`` in print mode with ``PIN_SET=current``, ``switches`` and ``MODEL_PATH=model`` (every
    other feature switch of this environment removed; ``python3`` = this interpreter). Returns ``overrides`` (the
    picked overrides as printed), ``engine_kwargs`` (``engine_kwargs.vllm`` as a nested dict), ``custom`` (nested
    dict or None) and ``disable_log_stats`` (bool; verl's default True when absent)."""
    sys.path.insert(0, str(REPO))
    from qwen3_rl.tools import features
    from qwen3_rl.tools.launch.train_script import parse_train_script

    names = features.load_registry().features
    env = {k: v for k, v in os.environ.items() if k not in names and k != "PIN_SET"}
    env.update(switches, PIN_SET="current", MODEL_PATH=str(model))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = parse_train_script(REPO / "internal" / setup, env=env)
    picked = [
        o
        for o in cmd.overrides
        if o.lstrip("+").startswith((ENGINE_KEY, CUSTOM_KEY)) or o.startswith(LOG_STATS_KEY + "=")
    ]
    engine: dict[str, Any] = {}
    custom: dict[str, Any] = {}
    log_stats_off = True
    for o in picked:
        key, _, raw = o.lstrip("+").partition("=")
        if key.startswith(ENGINE_KEY):
            _nest(engine, key.removeprefix(ENGINE_KEY), _value(raw))
        elif key.startswith(CUSTOM_KEY):
            _nest(custom, key.removeprefix(CUSTOM_KEY), _value(raw))
        else:
            log_stats_off = bool(_value(raw))
    return {
        "overrides": picked,
        "engine_kwargs": engine,
        "custom": custom or None,
        "disable_log_stats": log_stats_off,
    }
