"""Fixtures of the current set's tiny CPU runs (tests/engine_verl091): the workspace they train in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_rl.tools.engine_workspace import host_env

REPO = Path(__file__).resolve().parents[2]
SETUP_TIMEOUT_S = 900

#: every engine child of these tests inherits the small host's settings and the set's vLLM cache
#: (engine_workspace.host_env)
os.environ.update(host_env("current"))


@pytest.fixture(scope="session")  # one set-up (and warm-up) for the GRPO and the fully-async run
def current_ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace made by ``python -m qwen3_rl cpu-setup --pin-set current`` in this venv (the current set's patched
    trees, the tiny model after its supervised warm-up, the generated data)."""
    ws = tmp_path_factory.mktemp("ws-current")
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "cpu-setup", "--pin-set", "current", "--workspace",
                           str(ws)], cwd=REPO, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout.strip().splitlines()[-1])
    return ws
