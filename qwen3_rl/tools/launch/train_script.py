"""Read a train script (``internal/train_*.sh``) into the final verl command without training.

Every train script ends with::

    cmd=(python3 -m <entry module> --config-name <name> "${overrides[@]}" "$@")
    if [[ "${QWEN3_RL_PRINT_COMMAND:-0}" == 1 ]]; then
        printf '%s\\0' "${#cmd[@]}" "${cmd[@]}"; env -0; exit 0
    fi
    exec "${cmd[@]}"

so running it with ``QWEN3_RL_PRINT_COMMAND=1`` makes bash resolve every default and env override
exactly as a real launch would, and print, NUL-separated: the argv length, the argv, then the
environment the command would have been exec'd with. Nothing else of the script runs differently.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

PRINT_ENV = "QWEN3_RL_PRINT_COMMAND"


class TrainScriptError(RuntimeError):
    """A train script could not be read into a command (one-line message)."""


@dataclass(frozen=True)
class TrainCommand:
    """The command a train script would exec.

    Attributes:
        script: path of the train script.
        argv: the full argv (``python3 -m <module> --config-name <name> <overrides...>``).
        entry_module: the module run with ``-m`` (``verl.trainer.main_ppo`` or ``qwen3_rl.trainer.dapo``).
        config_name: Hydra ``--config-name`` value.
        overrides: Hydra overrides in order (``key=value``, ``+key=value``, ``~key``).
        env: environment the command would run with (after the script's own exports).
    """

    script: Path
    argv: list[str]
    entry_module: str
    config_name: str
    overrides: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def override_map(self) -> dict[str, str]:
        """Overrides as ``{key: value}`` (leading ``+``/``++`` stripped; a later override wins)."""
        out: dict[str, str] = {}
        for item in self.overrides:
            if item.startswith("~") or "=" not in item:
                continue
            key, value = item.split("=", 1)
            out[key.lstrip("+")] = value
        return out

    def get(self, key: str, default: str | None = None) -> str | None:
        """Value of one override key (without ``+``), or ``default``."""
        return self.override_map().get(key, default)


def _split_argv(argv: list[str]) -> tuple[str, str, list[str]]:
    """Split ``python -m MOD [--config-name NAME | --config-name=NAME] overrides...``."""
    if len(argv) < 3 or "-m" not in argv[:3]:
        raise TrainScriptError(f"final command is not 'python -m <module> ...': {argv[:3]}")
    i = argv.index("-m")
    module = argv[i + 1]
    rest = argv[i + 2 :]
    config_name = ""
    overrides: list[str] = []
    j = 0
    while j < len(rest):
        arg = rest[j]
        if arg in ("--config-name", "-cn"):
            if j + 1 >= len(rest):
                raise TrainScriptError("--config-name without a value")
            config_name = rest[j + 1]
            j += 2
            continue
        if arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise TrainScriptError(f"unexpected option in train command: {arg}")
        else:
            overrides.append(arg)
        j += 1
    if not config_name:
        raise TrainScriptError("train command has no --config-name")
    return module, config_name, overrides


def parse_train_script(
    path: str | os.PathLike[str],
    env: dict[str, str] | None = None,
    env_file: str | os.PathLike[str] | None = None,
    extra_args: list[str] | None = None,
    timeout_s: float = 60.0,
) -> TrainCommand:
    """Run ``path`` with bash in print mode and return the command it would exec.

    Args:
        path: train script.
        env: base environment (default: a copy of ``os.environ``); the script's defaults apply on top.
        env_file: optional env script sourced (with ``set -a``) before the train script, like the launcher.
        extra_args: extra Hydra overrides passed to the script as arguments.
        timeout_s: bash must finish within this many seconds.

    Raises:
        TrainScriptError: missing script, script failure (its stderr's last line), malformed output.
    """
    script = Path(path)
    if not script.is_file():
        raise TrainScriptError(f"train script not found: {script}")
    if env_file is not None and not Path(env_file).is_file():
        raise TrainScriptError(f"env script not found: {env_file}")
    run_env = dict(os.environ if env is None else env)
    run_env[PRINT_ENV] = "1"
    run_env.setdefault("PATH", os.defpath)
    args = [str(a) for a in (extra_args or [])]
    if env_file is None:
        cmd = ["bash", str(script), *args]
    else:
        cmd = ["bash", "-c", 'set -a; source "$1"; set +a; shift; exec bash "$@"', "_",
               str(env_file), str(script), *args]
    try:
        proc = subprocess.run(cmd, env=run_env, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TrainScriptError(f"{script}: did not finish within {timeout_s:.0f} s in print mode") from exc
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else f"exit code {proc.returncode}"
        raise TrainScriptError(f"{script}: failed in print mode: {last}")
    fields = proc.stdout.split(b"\0")
    try:
        count = int(fields[0])
    except ValueError as exc:
        raise TrainScriptError(f"{script}: does not support {PRINT_ENV} (no command printed)") from exc
    if len(fields) < count + 1:
        raise TrainScriptError(f"{script}: truncated command output")
    argv = [f.decode() for f in fields[1 : count + 1]]
    env_out: dict[str, str] = {}
    for item in fields[count + 1 :]:
        if not item:
            continue
        key, _, value = item.decode(errors="replace").partition("=")
        env_out[key] = value
    env_out.pop(PRINT_ENV, None)
    module, config_name, overrides = _split_argv(argv)
    return TrainCommand(script=script, argv=argv, entry_module=module, config_name=config_name,
                        overrides=overrides, env=env_out)
