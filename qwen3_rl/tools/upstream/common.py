"""Shared helpers for the upstream commands: errors, logging, subprocess, workspace."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from qwen3_rl.tools.pins import REPO_ROOT, Pins

WORKSPACE_ENV = "QWEN3_RL_WORKSPACE"
CACHE_ENV = "QWEN3_RL_CACHE"

# Fixed identity and date: a pypi-mode pristine commit gets the same hash on every machine.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "qwen3_rl",
    "GIT_AUTHOR_EMAIL": "qwen3_rl@localhost",
    "GIT_COMMITTER_NAME": "qwen3_rl",
    "GIT_COMMITTER_EMAIL": "qwen3_rl@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
# Build and bytecode products that must not make a tree look dirty.
LOCAL_EXCLUDES = ("__pycache__/", "*.pyc", "*.egg-info/", "build/", ".eggs/", "*.so")


class UpstreamError(RuntimeError):
    """A one-line, user-facing reason; commands print it and exit non-zero."""


def default_workspace(pins: Pins | None = None) -> Path:
    """``$QWEN3_RL_WORKSPACE`` or the pin set's workspace in the checkout (``workspace``; ``workspace-current``)."""
    env = os.environ.get(WORKSPACE_ENV)
    return Path(env) if env else REPO_ROOT / (pins.workspace_dir if pins else "workspace")


def default_cache() -> Path:
    """``$QWEN3_RL_CACHE`` or ``~/.cache/qwen3_rl``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "qwen3_rl"


def log(msg: str) -> None:
    print(msg, flush=True)


def run(
    cmd: list[str],
    cwd: Path | None = None,
    check: bool = True,
    env: dict[str, str] | None = None,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing text output; on failure raise UpstreamError with its stderr."""
    full_env = dict(os.environ)
    full_env.update(GIT_ENV)
    full_env.setdefault("GIT_TERMINAL_PROMPT", "0")
    if env:
        full_env.update(env)
    proc = subprocess.run(
        cmd, cwd=cwd, env=full_env, text=True, capture_output=True, input=input_text
    )
    if check and proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        last = tail[-1] if tail else f"exit {proc.returncode}"
        raise UpstreamError(f"`{' '.join(cmd)}` failed: {last}")
    return proc


def git(tree: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["git", "-C", str(tree), *args], check=check)


def is_git_repo(path: Path) -> bool:
    return (path / ".git").exists()


def add_local_excludes(tree: Path) -> None:
    """List build/bytecode products in ``.git/info/exclude`` (local only, never committed)."""
    exclude = tree / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    have = exclude.read_text().splitlines() if exclude.exists() else []
    missing = [p for p in LOCAL_EXCLUDES if p not in have]
    if missing:
        with exclude.open("a") as f:
            f.write("\n# qwen3_rl: build products\n" + "\n".join(missing) + "\n")


def dirty_files(tree: Path) -> list[str]:
    out = git(tree, "status", "--porcelain", "--ignore-submodules=none").stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def die(msg: str, code: int = 1) -> int:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return code


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line usage error (``error: ... (see --help)``), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)
