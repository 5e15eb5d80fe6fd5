"""The current set's megatron-core 0.16.1 checkpoint writer, in the real 0.16.1 code.

Seed 0005 (the write-results manager dies with its training process) is not carried over: 0.16.1 starts the manager
with the spawn method (``dist_checkpointing/strategies/filesystem_async.py:51-56``), so it no longer inherits the
training process's sockets, which is what made a killed Ray worker go unnoticed (the seed set's hang); the test
below shows it on the pristine tree. The manager still outlives a SIGKILLed parent, idle (19 MiB resident when
measured); the seed set's fix, an initializer run in the manager, would make the spawned manager import megatron.core
to unpickle it (824 MiB resident and 15.7 s at the first save when measured), a cost on every healthy run.

current 0002 (seed 0006), a synchronous save writes its buckets in threads. 0.16.1 already runs a synchronous save in
the calling process (``strategies/base.py:212-215`` -> ``AsyncRequest.execute_sync``), but its bucket writer still
forks one process per bucket (``filesystem_async.py:266``), which inherits any lock another thread holds. The probe is
the seed set's (``test_patches_megatron_ckpt_save.py``): megatron's ``dist_checkpointing.save`` on gloo while another
thread holds a lock the writer takes for every item; positive control: the patched tree with this patch reversed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_patches_megatron_ckpt_save import _PROBE, HOLD_S

from conftest import PINS
from helpers.current_set import DEVICE_SHIMS, patch_named, patched_megatron, pristine_megatron


@pytest.fixture(scope="module")
def patched16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return patched_megatron(tmp_path_factory.mktemp("m16"))


# ---- seed 0005: not needed on 0.16.1 -------------------------------------------------------------------------------
_SOCKETS = textwrap.dedent("""
    import multiprocessing as mp, os, socket, sys, time
    sys.modules["qwen3_rl"] = None
    from megatron.core.dist_checkpointing.strategies.filesystem_async import _get_write_results_queue

    listener = socket.socket()  # an open socket of the training process (in a Ray worker: its raylet connection)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    queue = _get_write_results_queue()
    queue.put(1)
    assert queue.get() == 1
    (child,) = mp.active_children()
    mine = os.readlink(f"/proc/self/fd/{listener.fileno()}")
    theirs = [os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{child.pid}/fd")]
    print("INHERITED", mine in theirs, mine, flush=True)
""")


@pytest.mark.parametrize("tree", ["current-0.16.1", "seed-0.12.1"])
def test_pristine_manager_holds_parent_socket_only_on_012(tree: str, pristine_workspace: Path) -> None:
    """Why the seed set's hang is gone on 0.16.1: its spawned manager does not hold the training process's sockets.
    Positive control: megatron-core 0.12.1's forked manager (the seed set's pristine tree) does."""
    root = pristine_megatron() if tree.startswith("current") else pristine_workspace / PINS.frameworks["megatron"].dir
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _SOCKETS], capture_output=True, text=True, env=env, timeout=300)
    inherited = tree.startswith("seed")
    assert proc.returncode == 0 and f"INHERITED {inherited} socket:" in proc.stdout, proc.stdout + proc.stderr[-2000:]


# ---- current 0002: synchronous save without forked bucket writers ---------------------------------------------------
# The seed set's probe; its CPU device shims are for megatron-core 0.12.1 (they replace megatron's TE module), and
# 0.16.1's save and load need two device calls only (DEVICE_SHIMS).
_SHIMS = "import megatron_shims\nmegatron_shims.install()\n"
assert _SHIMS in _PROBE
_PROBE16 = _PROBE.replace(_SHIMS, DEVICE_SHIMS)


BOUND16_S = 300  # start-up on a loaded 2-core machine takes up to a minute (megatron.core imports torch._inductor)
STUCK_S = 5.0  # a child of the probe in a futex wait this long: the save hangs


def _wchans(pid: int) -> list[str]:
    """Wait channels of ``pid``'s forked children. Spawned ones (fork + exec of ``multiprocessing``'s spawn_main or
    resource tracker: the write-results manager, whose main thread always waits on an Event's futex) are left out."""
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if b"multiprocessing" in Path(f"/proc/{child}/cmdline").read_bytes():
                continue
            out.append(Path(f"/proc/{child}/wchan").read_text())
        except FileNotFoundError:
            pass
    return out


def _probe(megatron: Path, out: Path, stop_when_stuck: bool) -> subprocess.CompletedProcess[str] | list[str]:
    """Run the probe on ``megatron``. Returns the finished process, or the kernel wait channels of the probe's child
    processes (``/proc/<pid>/wchan``) once one has waited on a futex for ``STUCK_S`` (``stop_when_stuck``) or at
    ``BOUND16_S``; then the probe and its children are killed."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(megatron)}
    proc = subprocess.Popen([sys.executable, "-c", _PROBE16, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline, stuck_since, wchans = time.monotonic() + BOUND16_S, None, []
    while proc.poll() is None and time.monotonic() < deadline:
        wchans = _wchans(proc.pid)
        if any("futex" in w for w in wchans):
            stuck_since = stuck_since or time.monotonic()
            if stop_when_stuck and time.monotonic() - stuck_since >= STUCK_S:
                break
        else:
            stuck_since = None
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, 9)  # the probe and its forked writers
        proc.communicate()
        return wchans
    stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_megatron16_sync_save_does_not_fork_a_writer(patched16: Path, tmp_path: Path) -> None:
    proc = _probe(patched16, tmp_path / "patched", stop_when_stuck=False)
    assert isinstance(proc, subprocess.CompletedProcess), f"the patched save is still waiting after {BOUND16_S} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr[-3000:]
    saves = json.loads(lines[-1][len("RESULT "):])["saves"]
    assert all(s["equal"] for s in saves)
    # nothing is forked: the write-results manager is spawned (fork+exec, no fork handlers), the buckets are threads
    assert [s["forks"] for s in saves] == [0, 0]
    assert all(s["seconds"] >= HOLD_S * 0.9 for s in saves)  # the writer did wait for the other thread's lock
    print(f"\npatched saves: {[round(s['seconds'], 2) for s in saves]} s (lock held {HOLD_S} s)")


def test_megatron16_forked_writer_hangs_without_the_patch(tmp_path: Path) -> None:
    """Positive control: the same probe on the 0.16.1 tree with this one patch reversed does not finish."""
    tree = patched_megatron(tmp_path / "ws", without="ckpt_save_without_fork")
    text = (tree / "megatron/core/dist_checkpointing/strategies/filesystem_async.py").read_text()
    assert 'ctx = mp.get_context("fork")\n        local_results_queue' in text
    assert patch_named("megatron", "ckpt_save_without_fork").is_file()
    got = _probe(tree, tmp_path / "reversed", stop_when_stuck=True)
    assert isinstance(got, list), f"the save finished without the patch:\n{got.stdout}\n{got.stderr[-3000:]}"
    assert any("futex" in w for w in got), got  # a forked writer waits on the inherited lock's futex

