"""megatron patch 0005: the write-results manager process of megatron-core's checkpoint writer
(``filesystem_async._get_write_results_queue`` of the patched tree) dies with the training process that forked
it. An orphan would keep the Ray worker's raylet connection open, so Ray would never report the killed worker and
the run would hang (tests/engine/test_e2e_training.py kills a worker for real). The pristine tree is the control:
its manager stays behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qwen3_rl.tools.pins import load_pins

REPO = Path(__file__).resolve().parents[2]
PINS = load_pins(REPO / "pins.toml")

_FORKER = textwrap.dedent("""
    import multiprocessing as mp
    import sys
    import time

    sys.modules["qwen3_rl"] = None  # importing the recipe package fails: the patched code must not need it
    from megatron.core.dist_checkpointing.strategies.filesystem_async import _get_write_results_queue

    queue = _get_write_results_queue()
    queue.put(1)
    assert queue.get() == 1
    (child,) = mp.active_children()
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _orphan_after_parent_killed(pythonpath: str) -> bool:
    """Start a process that forks megatron's write-results manager (megatron from ``pythonpath``), SIGKILL it, and
    say whether the manager is still alive 10 s later (killing it then)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": pythonpath}
    proc = subprocess.Popen([sys.executable, "-c", _FORKER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"no manager pid: {line!r} {proc.stderr.read() if proc.poll() else ''}"
        manager = int(line)
        assert _alive(manager)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(manager) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphan = _alive(manager)
        if orphan:
            os.kill(manager, signal.SIGKILL)
        return orphan
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("tree", ["patched", "pristine"])
def test_megatron_results_queue_manager(tree: str, patched_workspace: Path, pristine_workspace: Path) -> None:
    """megatron-core 0.12.1's checkpoint writer: its manager dies with the process when patched, stays when not."""
    ws = patched_workspace if tree == "patched" else pristine_workspace
    assert _orphan_after_parent_killed(str(ws / PINS.frameworks["megatron"].dir)) == (tree == "pristine")
