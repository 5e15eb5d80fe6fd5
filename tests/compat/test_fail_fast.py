"""qwen3_rl.compat.fail_fast.get_all (verl patch 0009) on real Ray actors (a local Ray on 127.0.0.1): a killed
worker's error is raised while another worker still blocks, a worker's own exception too, and without failures
the values come back in the order of the references."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

from qwen3_rl.compat.fail_fast import get_all

BLOCK_S = 600.0  # the blocked worker's wait: far longer than the test may take


@pytest.fixture(scope="module")
def local_ray():
    # a local ray.init() of Ray 2.60 turns token auth on and writes ~/.ray/auth_token unless the mode is set
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
        yield
        ray.shutdown()


@ray.remote(num_cpus=1)
class Worker:
    def run(self, value: int, block_s: float = 0.0, fail: bool = False) -> int:
        if fail:
            raise RuntimeError(f"worker {value} failed")
        time.sleep(block_s)
        return value

    def pid(self) -> int:

        return os.getpid()


def _call_in_thread(refs):
    out: dict = {}

    def target():
        try:
            out["value"] = get_all(refs)
        except Exception as e:  # noqa: BLE001 (the test inspects it)
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def test_values_in_order(local_ray) -> None:
    workers = [Worker.remote() for _ in range(3)]
    refs = [w.run.remote(i, block_s=0.3 * (3 - i)) for i, w in enumerate(workers)]  # finish in reverse order
    assert get_all(refs) == [0, 1, 2]
    assert get_all(refs + refs[:1]) == [0, 1, 2, 0]  # a reference twice
    assert get_all(refs[0]) == 0  # a single reference: plain ray.get
    for w in workers:
        ray.kill(w)


def test_killed_worker_raises_while_another_blocks(local_ray) -> None:
    blocked, doomed = Worker.remote(), Worker.remote()
    ray.get([blocked.pid.remote(), doomed.pid.remote()])
    refs = [blocked.run.remote(0, block_s=BLOCK_S), doomed.run.remote(1, block_s=BLOCK_S)]
    t, out = _call_in_thread(refs)
    time.sleep(1.0)
    assert t.is_alive(), "get_all returned while both workers were running"
    ray.kill(doomed, no_restart=True)
    t.join(timeout=60)
    assert not t.is_alive(), "get_all still waits 60 s after a worker was killed"
    assert isinstance(out.get("error"), ray.exceptions.RayActorError), out
    ray.kill(blocked)


def test_worker_exception_raises_while_another_blocks(local_ray) -> None:
    blocked, failing = Worker.remote(), Worker.remote()
    refs = [blocked.run.remote(0, block_s=BLOCK_S), failing.run.remote(1, fail=True)]
    t, out = _call_in_thread(refs)
    t.join(timeout=60)
    assert not t.is_alive(), "get_all still waits 60 s after a worker raised"
    err = out.get("error")
    assert isinstance(err, ray.exceptions.RayTaskError) and "worker 1 failed" in str(err), out
    ray.kill(blocked)
