"""The weight sync's pieces: the backend choice, the bucket plan, and a real broadcast over the stateless gloo group
(two processes): what the receiver yields equals the sender's export tensor by tensor, names and order kept."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from qwen3_rl.trainer.fully_async.weight_sync import (
    TensorSpec,
    collective_backend,
    make_group,
    plan_buckets,
    receive,
    send,
    specs_of,
)


def test_backend_per_device() -> None:
    assert collective_backend("cpu") == "gloo"
    assert collective_backend("npu") == "hccl"
    with pytest.raises(ValueError, match="no collective backend for device 'xpu'"):
        collective_backend("xpu")


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


def _receiver(port: int, specs, buckets, q) -> None:
    group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    q.put([(n, t.clone()) for n, t in receive(group, specs, buckets)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broadcast_delivers_the_export_tensor_by_tensor() -> None:
    named = _export()
    specs = specs_of(named)
    buckets = plan_buckets(specs, {"float32": 4, "bfloat16": 2}, bucket_bytes=600)
    assert len(buckets) > 1  # the split is exercised
    port = _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(port, specs, buckets, q))
    p.start()
    try:
        group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
        sums = send(group, iter(named), specs, buckets)
        got = q.get(timeout=60)
    finally:
        p.join(timeout=60)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (name, want), (_, t) in zip(named, got, strict=True):
        assert t.dtype == want.dtype and torch.equal(t, want), name
    assert sums == [float(t.double().sum()) for _, t in named]


def test_send_refuses_an_export_that_differs_from_the_plan() -> None:
    named = _export()
    specs = specs_of(named)
    with pytest.raises(RuntimeError, match="export gave norm.weight"):
        send(object(), iter(named[1:]), specs, [[0]])
