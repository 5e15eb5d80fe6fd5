"""The weight sync's pieces: the backend choice (from the configured device, also in a Ray actor that sees no
device, as verl's ``TaskRunner`` is), the byte checksum, the bucket plan, and a real broadcast over the stateless
gloo group (two processes): what the receiver yields equals the sender's export tensor by tensor, names and order
kept, on the group's device."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest
import torch

from qwen3_rl.trainer.fully_async.weight_sync import (
    TensorSpec,
    byte_checksum,
    collective_backend,
    make_group,
    plan_buckets,
    receive,
    send,
    specs_of,
)

from conftest import REPO, free_port


def test_backend_per_device() -> None:
    assert collective_backend("cpu") == "gloo"
    assert collective_backend("npu") == "hccl"
    with pytest.raises(ValueError, match="no collective backend for device 'xpu'"):
        collective_backend("xpu")


def test_backend_from_the_trainer_workers_device_in_an_actor_without_devices(patched_imports) -> None:
    """The trainer's choice (``weight_sync_backend``, called by ``_init_weight_sync`` in verl's ``TaskRunner``, a
    ``ray.remote(num_cpus=1)`` actor) run in such an actor on a node that advertises NPUs: Ray hides the devices
    from it (``ASCEND_RT_VISIBLE_DEVICES=""``) and verl's device probe there says ``cpu`` (positive control: the
    former choice from that probe picked gloo); the choice follows the device the trainer's rank 0 worker reports
    for its weights: HCCL for npu, gloo for cpu (the CPU profile: ``trainer.device=npu``, weights on the host)."""
    import ray

    path = [p for p in sys.path if p.startswith(str(patched_imports))] + [str(REPO)]
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=2, resources={"NPU": 2}, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(path)}})
    try:
        assert ray.cluster_resources().get("NPU") == 2

        @ray.remote(num_cpus=1)
        class TaskRunnerLike:
            def choose(self, devices: list[str]) -> dict:
                from verl.utils.device import get_device_name

                from qwen3_rl.trainer.fully_async.trainer import weight_sync_backend

                return {"visible": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"), "probe": get_device_name(),
                        "backend": {d: weight_sync_backend(d) for d in devices}}

        got = ray.get(TaskRunnerLike.remote().choose.remote(["npu", "cpu"]), timeout=300)
    finally:
        ray.shutdown()
    assert got["visible"] == "" and got["probe"] == "cpu", got
    assert got["backend"] == {"npu": "hccl", "cpu": "gloo"}, got


def test_byte_checksum_is_exact_on_bytes() -> None:
    """Equal tensors give equal checksums whatever their shape, strides or storage (a transposed view, a slice of a
    larger buffer as the receiver's are); one ulp, a swap of two elements, a sign of zero change it (positive
    controls); a tensor larger than one chunk is summed chunk by chunk."""
    from qwen3_rl.trainer.fully_async import weight_sync

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.int64):
        base = torch.randn(6, 10, generator=g).mul(50)
        base = (base > 0) if dtype == torch.bool else base.to(dtype)
        ref = byte_checksum(base)
        t_view = base.t().contiguous().t()  # same values, column-major strides
        assert not t_view.is_contiguous() and byte_checksum(t_view) == ref, dtype
        buf = torch.zeros(200, dtype=dtype)
        buf[17:77] = base.reshape(-1)
        assert byte_checksum(buf[17:77].view(6, 10)) == ref == byte_checksum(base.reshape(60)), dtype
        assert byte_checksum(base.reshape(10, 6)) == ref, dtype
        swapped = base.clone().reshape(-1)
        i, j = next((i, j) for i in range(60) for j in range(i + 1, 60) if not torch.equal(swapped[i], swapped[j]))
        swapped[[i, j]] = swapped[[j, i]]
        assert byte_checksum(swapped) != ref, dtype
    x = torch.randn(1000, generator=g)
    t32, tbf = x.clone(), x.to(torch.bfloat16)
    b32, bbf = t32.clone(), tbf.clone()
    b32[437] = torch.nextafter(t32[437], torch.tensor(1e9))  # one float32 ulp up
    bbf.view(torch.int16)[437] += 1  # one bfloat16 ulp (the next representable value)
    for t, bumped in ((t32, b32), (tbf, bbf)):
        assert (bumped != t).sum() == 1 and (bumped.float() - t.float()).abs().max() < 1e-2
        assert byte_checksum(bumped) != byte_checksum(t), t.dtype
    zeros = torch.zeros(8)
    assert torch.equal(zeros, -zeros) and byte_checksum(zeros) != byte_checksum(-zeros)  # bytes, not values
    big = torch.randn(3 * weight_sync.CHECKSUM_CHUNK // 2 + 5, generator=g)  # int16 words: 3 chunks
    words = big.view(torch.int16).to(torch.int64)
    pos = torch.arange(words.numel()) % weight_sync.CHECKSUM_PERIOD + 1
    assert byte_checksum(big) == (int(words.sum()), int((words * pos).sum()))
    assert byte_checksum(torch.empty(0)) == (0, 0)


def test_buckets_group_consecutive_same_dtype_tensors_up_to_the_size() -> None:
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32"), TensorSpec("c", (2,), "bfloat16"),
             TensorSpec("d", (100,), "float32"), TensorSpec("e", (1,), "float32")]
    size = {"float32": 4, "bfloat16": 2}
    # 32 bytes: a+b fill one bucket; the dtype change starts one; d is larger than a bucket and gets its own
    assert plan_buckets(specs, size, bucket_bytes=32) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(specs, size, bucket_bytes=1 << 20) == [[0, 1], [2], [3, 4]]


def _export() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("embed.weight", torch.randn(16, 8, generator=g)), ("norm.weight", torch.randn(8, generator=g)),
            ("layer.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(16, 8, generator=g))]


def _receiver(port: int, specs, buckets, q, taken) -> None:
    group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    q.put([(n, t.clone()) for n, t in receive(group, specs, buckets)])
    assert group.device == "cpu"
    # the queue hands the tensors over as shared-memory file descriptors this process serves: stay until they are taken
    taken.wait(60)


def test_broadcast_delivers_the_export_tensor_by_tensor() -> None:
    named = _export()
    specs = specs_of(named)
    buckets = plan_buckets(specs, {"float32": 4, "bfloat16": 2}, bucket_bytes=600)
    assert len(buckets) > 1  # the split is exercised
    port = free_port()
    ctx = mp.get_context("spawn")
    q, taken = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_receiver, args=(port, specs, buckets, q, taken))
    p.start()
    try:
        group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
        sums = send(group, iter(named), specs, buckets)
        got = q.get(timeout=60)
    finally:
        taken.set()
        p.join(timeout=60)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (name, want), (_, t) in zip(named, got, strict=True):
        assert t.dtype == want.dtype and torch.equal(t, want), name
    assert group.device == "cpu"
    assert sums == [byte_checksum(t) for _, t in named] == [byte_checksum(t) for _, t in got]


def test_send_refuses_an_export_that_differs_from_the_plan() -> None:
    from qwen3_rl.trainer.fully_async import weight_sync

    named = _export()
    specs = specs_of(named)
    with pytest.raises(RuntimeError, match="export gave norm.weight"):
        send(weight_sync.SyncGroup(object(), "gloo"), iter(named[1:]), specs, [[0]])


#: the killed-worker test's buckets: one float32 tensor of 64 MiB each, far more than a loopback socket buffers
KILL_TENSOR = 16 << 20
KILL_BOUND_S = 120.0


def test_a_rollout_worker_killed_mid_sync_stops_the_wait_at_once(tmp_path) -> None:
    """A sync as the trainer runs it (``gather_sync`` over the trainer's send and the rollout workers' receives;
    real broadcasts over the stateless gloo group, on Ray actors): rollout worker 0 is stuck (stopped: as a worker
    held in a dummy forward), so the trainer's send blocks in the broadcast; worker 1 receives the first bucket and
    is killed (SIGKILL) while it loads it. The wait ends with one line naming worker 1 within KILL_BOUND_S (the
    seconds are printed); positive control: the trainer's send is still blocked after that, so waiting on it
    first (``ray.get(send)`` before the receives) would have waited for the group's timeout (30 min)."""
    import signal
    import threading
    import time

    import ray

    from qwen3_rl.trainer.fully_async.weight_sync import gather_sync

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    specs = [TensorSpec(f"w{i}", (KILL_TENSOR,), "float32") for i in range(3)]
    buckets = plan_buckets(specs, {"float32": 4}, bucket_bytes=KILL_TENSOR * 4)
    assert len(buckets) == 3

    @ray.remote(num_cpus=0)
    class Peer:
        def pid(self) -> int:
            return os.getpid()

        def join(self, port: int, rank: int, world: int) -> None:
            self.group = make_group("127.0.0.1", port, rank, world, "gloo", timeout_s=1800)

        def send(self) -> list:
            return send(self.group, ((s.name, torch.full(s.shape, 1.0 + i)) for i, s in enumerate(specs)), specs,
                        buckets)

        def receive(self, marker: str) -> list:
            sums = []
            for _name, t in receive(self.group, specs, buckets):
                sums.append(byte_checksum(t))
                open(marker, "w").close()  # the first tensor is here; loading it takes long
                time.sleep(600)
            return sums

    trainer, stuck, doomed = Peer.remote(), Peer.remote(), Peer.remote()
    pids = ray.get([stuck.pid.remote(), doomed.pid.remote()])
    port = free_port()
    ray.get([p.join.remote(port, r, 3) for r, p in enumerate((trainer, stuck, doomed))], timeout=120)
    marker = tmp_path / "first-tensor"
    try:
        os.kill(pids[0], signal.SIGSTOP)
        send_refs = [trainer.send.remote()]
        recv_refs = [stuck.receive.remote(str(tmp_path / "unused")), doomed.receive.remote(str(marker))]
        t0 = time.monotonic()
        while not marker.exists():
            assert time.monotonic() - t0 < 120, "worker 1 never received its first tensor"
            time.sleep(0.05)
        out: dict = {}

        def wait() -> None:
            try:
                gather_sync(send_refs, recv_refs)
            except RuntimeError as e:
                out["error"], out["at"] = str(e), time.monotonic()

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive(), out  # nothing has failed yet: the wait goes on
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        waiter.join(timeout=KILL_BOUND_S)
        assert not waiter.is_alive(), f"the sync still waits {KILL_BOUND_S} s after rollout worker 1 was killed"
        seconds = out["at"] - killed_at
        print(f"rollout worker killed mid-sync: the sync's wait ended {seconds:.2f} s after the kill: {out['error']}")
        assert out["error"].startswith("weight sync: rollout worker 1 died during the sync (ActorDiedError)"), out
        assert "\n" not in out["error"]
        ready, _ = ray.wait(send_refs, timeout=10)
        assert not ready, "the trainer's send finished: the stuck worker did not block it (no positive control)"
    finally:
        os.kill(pids[0], signal.SIGCONT)
        ray.shutdown()


def test_sync_wait_names_the_dead_worker_behind_a_collective_error() -> None:
    """A rollout worker's death often reaches the trainer first as its broadcast's error ("Connection closed by
    peer"): ``gather_sync`` then names the worker Ray reports dead within DEATH_GRACE_S; with no death (control)
    the trainer's own error is the line."""
    import signal
    import threading

    import ray

    from qwen3_rl.trainer.fully_async.weight_sync import gather_sync

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        @ray.remote(num_cpus=0)
        class Side:
            def pid(self) -> int:
                return os.getpid()

            def fail(self) -> None:
                raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")

            def hang(self) -> None:
                import time

                time.sleep(600)

        trainer, worker = Side.remote(), Side.remote()
        pid = ray.get(worker.pid.remote())
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(RuntimeError) as err:
            gather_sync([trainer.fail.remote()], [worker.hang.remote()])
        assert str(err.value).startswith("weight sync: rollout worker 0 died during the sync"), err.value
        trainer, alive = Side.remote(), Side.remote()
        with pytest.raises(RuntimeError) as err:
            gather_sync([trainer.fail.remote()], [alive.hang.remote()])
        assert str(err.value) == ("weight sync: trainer rank 0 failed: RuntimeError: [gloo] Connection closed by peer "
                                  "[127.0.0.1]:4242"), err.value
    finally:
        ray.shutdown()
