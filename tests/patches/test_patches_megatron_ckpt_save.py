"""megatron patch 0006: a synchronous dist-checkpoint save writes in the training process (threads), not in
forked writers, so a lock another thread holds at the moment of the save cannot be inherited held by a writer.

The probe runs megatron's own ``dist_checkpointing.save`` (torch_dist, synchronous: what verl's
``save_dist_checkpointing`` does with ``async_save=false``) on a gloo world of 1 with the CPU device shims, while
another thread holds a lock that the writer takes for every item (megatron's ``_write_item`` wrapped: the stand-in
for the allocator, loader, import or logging locks a multi-threaded training process's threads take). The other
thread lets go after ``HOLD_S``. Patched: each save finishes within the bound (waiting for the lock as any thread
would), the process forks only megatron's write-results manager, once, and the checkpoint loads back equal.
Control, the same tree with 0006 reversed: the forked writer inherits the held lock and the save is still waiting
at the bound, a child of the probe in a futex wait (the hang seen once in the tiny DAPO run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import PINS, REPO

HOLD_S = 2.0  # how long the other thread holds the lock once the save starts
BOUND_S = 90  # the patched probe (start-up, two saves of HOLD_S each, loads) must be done by then
CONTROL_BOUND_S = 30  # the control is looked at after this long
PATCH = REPO / "patches" / "megatron" / "0006-megatron-bugfix-ckpt_save_without_fork.patch"

_PROBE = textwrap.dedent("""
    import functools, json, os, sys, threading, time
    out = sys.argv[1]
    sys.modules["qwen3_rl"] = None  # the patched code must not need the recipe package
    import megatron_shims
    megatron_shims.install()
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + out + ".store", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa

    lock = threading.Lock()
    write_item = fa._write_item

    @functools.wraps(write_item)  # megatron reads its signature (_serialization_format_args)
    def locked_write_item(*args, **kwargs):
        with lock:
            return write_item(*args, **kwargs)

    fa._write_item = locked_write_item
    forks = []
    os.register_at_fork(before=lambda: forks.append(1))
    result = {"saves": []}
    for n in range(2):
        held = threading.Event()

        def hold():
            with lock:
                held.set()
                time.sleep(HOLD_S)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait()
        w = torch.arange(64, dtype=torch.float32).reshape(8, 8) + n
        state = {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0),
                 "b": ShardedTensor.from_rank_offsets("b", w[0].clone() * 2, replica_id=0)}
        t0, before = time.perf_counter(), len(forks)
        path = os.path.join(out, f"ckpt{n}")
        os.makedirs(path)
        dist_checkpointing.save(state, path)
        seconds = time.perf_counter() - t0
        holder.join()
        back = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 8), replica_id=0),
                                        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(8), replica_id=0)},
                                       path)
        result["saves"].append({"seconds": seconds, "forks": len(forks) - before,
                                "equal": torch.equal(back["w"], w) and torch.equal(back["b"], w[0] * 2)})
    print("RESULT " + json.dumps(result), flush=True)
""").replace("HOLD_S", repr(HOLD_S))


def _probe(megatron: Path, out: Path, bound: float) -> subprocess.CompletedProcess[str] | list[str]:
    """Run the probe on ``megatron``. Still running at ``bound`` s: the kernel wait channels of its child
    processes (``/proc/<pid>/wchan``), then the probe and its children are killed."""
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "qwen3_rl" / "cpu_device"), str(megatron)])}
    proc = subprocess.Popen([sys.executable, "-c", _PROBE, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        wchans = []
        for pid in children:
            try:
                wchans.append(Path(f"/proc/{pid}/wchan").read_text())
            except FileNotFoundError:
                pass
        os.killpg(proc.pid, 9)  # the probe and its forked writers
        proc.communicate()
        return wchans
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_sync_save_does_not_fork_a_writer(patched_workspace: Path, tmp_path: Path) -> None:
    megatron = patched_workspace / PINS.frameworks["megatron"].dir
    proc = _probe(megatron, tmp_path / "patched", BOUND_S)
    assert isinstance(proc, subprocess.CompletedProcess), f"the patched save is still waiting after {BOUND_S} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr[-3000:]
    saves = json.loads(lines[-1][len("RESULT "):])["saves"]
    assert all(s["equal"] for s in saves)
    assert [s["forks"] for s in saves] == [1, 0]  # the write-results manager at the first save, nothing else
    assert all(s["seconds"] >= HOLD_S * 0.9 for s in saves)  # the writer did wait for the other thread's lock
    print(f"\npatched saves: {[round(s['seconds'], 2) for s in saves]} s (lock held {HOLD_S} s)")


def test_forked_writer_hangs_on_the_inherited_lock_without_0006(patched_workspace: Path, tmp_path: Path) -> None:
    """Positive control: the same probe on the patched tree with 0006 reversed does not finish."""
    copy = tmp_path / "Megatron-LM"
    shutil.copytree(patched_workspace / PINS.frameworks["megatron"].dir, copy)
    proc = subprocess.run(["git", "apply", "-R", str(PATCH)], cwd=copy, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ctx = mp.get_context('fork')\n        local_results_queue" in (
        copy / "megatron/core/dist_checkpointing/strategies/filesystem_async.py").read_text()
    got = _probe(copy, tmp_path / "reversed", CONTROL_BOUND_S)
    assert isinstance(got, list), f"the save finished without 0006:\n{got.stdout}\n{got.stderr[-3000:]}"
    assert any("futex" in w for w in got), got  # a forked writer waits on the inherited lock's futex
