"""Running a test driver in a child process of the test's venv and reading its result line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_driver(driver: Path, args: list[str], tag: str, timeout_s: float, tail_lines: int = 60) -> tuple[object, str]:
    """Run ``driver`` with ``args`` (this interpreter, our checkout first on ``PYTHONPATH``, at most ``timeout_s``
    seconds); its last stdout line starting with ``tag`` + space holds JSON. Returns (that JSON, the run's stdout and
    stderr without the result lines). A failing driver raises with the last ``tail_lines`` lines of its output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(driver), *args], capture_output=True, text=True, timeout=timeout_s,
                          env=env)
    prefix = f"{tag} "
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-tail_lines:])
        raise AssertionError(f"{driver.name} failed (rc {proc.returncode}):\n{tail}")
    log = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith(prefix))
    return json.loads(lines[-1][len(prefix):]), log
