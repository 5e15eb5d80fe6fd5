"""The weight-sync group's store port (issue 42, finding 8): the trainer's rank 0 binds it in the process that
serves the store and holds it until the store listens (``bound_socket`` -> ``make_group(listen_fd=...)``, what
``TrainerWorker.qwen3_rl_sync_address`` / ``qwen3_rl_join_group`` call). Before, the port was found free, released,
and bound again later by the store: another process could take it in between.

Real TCP stores and a real gloo group on loopback (two processes); the race is made to happen, not simulated: a
third socket binds the port in the window."""

from __future__ import annotations

import errno
import multiprocessing as mp
import socket

import pytest
import torch

from qwen3_rl.trainer.fully_async.weight_sync import bound_socket, make_group


def _pg(group):  # noqa: ANN001, ANN202 - the torch process group (make_group's own or inside its result)
    return getattr(group, "pg", group)


def _member(port: int, q) -> None:
    group = make_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    t = torch.zeros(3)
    _pg(group).broadcast(t, 0).wait()
    q.put(t.tolist())


def test_the_store_serves_on_the_port_held_since_it_was_chosen() -> None:
    fd, port = bound_socket()
    intruder = socket.socket()
    with pytest.raises(OSError) as err:  # the window is closed: nobody else can bind the port now
        intruder.bind(("127.0.0.1", port))
    intruder.close()
    assert err.value.errno == errno.EADDRINUSE
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_member, args=(port, q))
    p.start()
    try:
        group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60, listen_fd=fd)
        _pg(group).broadcast(torch.tensor([1.0, 2.0, 3.0]), 0).wait()
        assert q.get(timeout=60) == [1.0, 2.0, 3.0]
    finally:
        p.join(timeout=60)
    assert p.exitcode == 0


def test_control_a_released_port_can_be_taken_before_the_store_binds_it() -> None:
    """The old way (bind port 0, close, hand the number on): a process that binds the port in the window makes
    the store's own bind fail."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    intruder = socket.socket()
    intruder.bind(("", port))
    intruder.listen()
    try:
        with pytest.raises(Exception, match=r"(?i)address already in use|EADDRINUSE|errno: 98"):
            make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=5)
    finally:
        intruder.close()
