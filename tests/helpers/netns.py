"""Two test "nodes" on this host: network namespaces joined by one veth pair, made and deleted by the fixture.

Used by tests/tools/launch/test_launch_multinode.py (the launcher on two nodes) and tests/engine/test_slurm.py (Slurm on two
nodes). Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN for ``ip netns``); without it the fixture skips with the failing
``ip`` command and its error.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def ip_cmd(*args: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=False)


def ns_pids(ns: str) -> list[int]:
    p = ip_cmd("netns", "pids", ns)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def describe(pids: list[int]) -> str:
    """``pid: cmdline`` lines, for failure messages."""
    lines = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "(gone)"
        lines.append(f"{pid}: {cmd[:300]}")
    return "\n".join(lines)


def pids_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (the test's own directory)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def kill_mentioning(text: str) -> None:
    """SIGKILL every process whose command line contains ``text`` (a test's own directory): what a launcher left."""
    for pid in pids_mentioning(text):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class TwoNodes:
    """Two network namespaces joined by a veth pair (``head_ip`` in ``head_ns``, ``worker_ip`` in ``worker_ns``)."""

    head_ns: str
    worker_ns: str
    head_if: str
    worker_if: str
    head_ip: str
    worker_ip: str


@pytest.fixture
def two_nodes() -> Iterator[TwoNodes]:
    if shutil.which("ip") is None:
        pytest.skip("'ip' (iproute2) not found: the two-node test needs 'ip netns'")
    sfx = secrets.token_hex(3)
    octet = int(sfx[:2], 16)
    net = TwoNodes(head_ns=f"q3rl-h-{sfx}", worker_ns=f"q3rl-w-{sfx}", head_if=f"q3h{sfx}", worker_if=f"q3w{sfx}",
                   head_ip=f"10.213.{octet}.1", worker_ip=f"10.213.{octet}.2")
    made: list[str] = []

    def teardown() -> None:
        for ns in made:  # only what this fixture created; stray processes in them are ours by construction
            for pid in ns_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in made:
            ip_cmd("netns", "del", ns)  # deleting a namespace deletes the veth end inside it (and its peer)

    first = ["netns", "add", net.head_ns]
    p = ip_cmd(*first)
    if p.returncode != 0:
        pytest.skip(f"cannot create a network namespace: `ip {' '.join(first)}` failed: {p.stderr.strip()} "
                    "(needs root / CAP_NET_ADMIN + CAP_SYS_ADMIN)")
    made.append(net.head_ns)
    try:
        steps = [
            ["netns", "add", net.worker_ns],
            # the veth pair is created inside the head namespace, its peer goes straight into the worker's:
            # neither end ever exists in the host's namespace
            ["-n", net.head_ns, "link", "add", net.head_if, "type", "veth", "peer", "name", net.worker_if,
             "netns", net.worker_ns],
            ["-n", net.head_ns, "addr", "add", f"{net.head_ip}/30", "dev", net.head_if],
            ["-n", net.worker_ns, "addr", "add", f"{net.worker_ip}/30", "dev", net.worker_if],
            ["-n", net.head_ns, "link", "set", "lo", "up"],
            ["-n", net.worker_ns, "link", "set", "lo", "up"],
            ["-n", net.head_ns, "link", "set", net.head_if, "up"],
            ["-n", net.worker_ns, "link", "set", net.worker_if, "up"],
            ["netns", "exec", net.head_ns, "true"],  # entering a namespace needs CAP_SYS_ADMIN as well
        ]
        for step in steps:
            p = ip_cmd(*step)
            if p.returncode != 0:
                pytest.skip(f"cannot set up the two-node network: `ip {' '.join(step)}` failed: {p.stderr.strip()}")
            if step[:2] == ["netns", "add"]:
                made.append(step[2])
        yield net
    finally:
        teardown()
        left = ip_cmd("netns", "list").stdout
        links = ip_cmd("-o", "link", "show").stdout
        assert net.head_ns not in left and net.worker_ns not in left, f"namespaces not deleted: {left}"
        assert net.head_if not in links and net.worker_if not in links, "veth left in the host namespace"
