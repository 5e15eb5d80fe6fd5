"""verl 0.9.1's worker group when one worker fails while another blocks: the two calls the seed set's verl 0009
changed, on a verl tree (first on ``PYTHONPATH``) in a local Ray on 127.0.0.1 with two workers.

    python tests/helpers/verl091_fail_fast_driver.py OUT.json WAIT_S

A ``RayWorkerGroup`` of two ``verl.single_controller.base.Worker`` actors (``RayResourcePool([2], use_gpu=False)``)
with one registered method ``run(block_s, fail_rank)``: the worker of rank ``fail_rank`` raises, every other sleeps
``block_s`` seconds and returns its rank. Cases, each through both changed calls (``wg.run(...)``: the decorated
method, ``func_generator``'s blocking ``ray.get``; ``wg.execute_all_sync("run", ...)``):

- ``values``: no failure, no wait: the ranks in order;
- ``raises``: rank 1 raises, rank 0 blocks for 600 s;
- ``killed``: both block for 600 s; rank 1's actor is killed after 1 s (``ray.kill``).

Each failure case has its own group, which both calls use: the four calls run at once, each in a thread (an actor
runs one task at a time, so the second call's tasks queue behind the first's; the failing rank's fail in both), and
count as ``raised`` (with the exception's class and the seconds since they started) if the thread ends within WAIT_S
of the start, else ``blocked``. Then every actor is killed (a blocked ``ray.get`` ends with the dead actor's error) and Ray shut down. OUT.json: {"values": {...}, "<case>/<call>": {"outcome", "error", "s"}}.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

BLOCK_S = 600.0


def main() -> int:
    out_path, wait_s = sys.argv[1], float(sys.argv[2])
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.single_controller.base.worker import Worker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    @ray.remote
    class BlockingWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def run(self, block_s: float, fail_rank: int) -> int:
            if self.rank == fail_rank:
                raise RuntimeError(f"worker {self.rank} failed")
            time.sleep(block_s)
            return self.rank

    # logical CPUs: each group's placement group holds one per worker (8 in all, never released while Ray runs)
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    result: dict = {}
    groups = []

    def group(tag: str) -> RayWorkerGroup:
        wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False, max_colocate_count=1),
                            RayClassWithInitArgs(cls=BlockingWorker), name_prefix=f"failfast_{tag}_{os.getpid()}")
        groups.append(wg)
        return wg

    calls = {"decorated": lambda wg, *a: wg.run(*a), "execute_all_sync": lambda wg, *a: wg.execute_all_sync("run", *a)}
    cases = [(case, name) for case in ("raises", "killed") for name in calls]
    by_case = {case: group(case) for case in ("raises", "killed")}  # 4 actors (each imports verl's worker)
    wgs = {c: by_case[c[0]] for c in cases}
    first = by_case["raises"]
    result["values"] = {name: call(first, 0.0, -1) for name, call in calls.items()}
    boxes: dict = {}
    threads = {}
    t0 = time.monotonic()
    for case, name in cases:
        box: dict = {}

        def target(wg=wgs[(case, name)], call=calls[name], fail_rank=1 if case == "raises" else -1, box=box) -> None:
            try:
                box["value"] = call(wg, BLOCK_S, fail_rank)
            except Exception as e:  # noqa: BLE001 (reported)
                box["error"] = type(e).__name__
            box["s"] = time.monotonic() - t0

        boxes[(case, name)] = box
        threads[(case, name)] = threading.Thread(target=target, daemon=True)
        threads[(case, name)].start()
    time.sleep(1.0)
    ray.kill(by_case["killed"].workers[1], no_restart=True)
    for c, t in threads.items():
        t.join(timeout=max(0.0, t0 + wait_s - time.monotonic()))
        raised = not t.is_alive() and "error" in boxes[c]
        result["/".join(c)] = {"outcome": "raised" if raised else "blocked", "error": boxes[c].get("error"),
                               "s": round(boxes[c]["s"], 2) if raised else None}
        print(f"fail-fast driver: {'/'.join(c)}: {result['/'.join(c)]}", file=sys.stderr, flush=True)
    for wg in groups:
        for w in wg.workers:
            ray.kill(w, no_restart=True)
    for t in threads.values():
        t.join(timeout=60)
    ray.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
