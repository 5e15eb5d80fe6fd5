"""Parse ``ray status`` (Ray 2.x autoscaler summary) and wait until the cluster has assembled.

The text looks like (Ray 2.60, captured from a real ``ray start --head`` in tests/tools/launch/test_launch.py)::

    ======== Autoscaler status: 2026-11-21 22:20:18.934640 ========
    Node status
    ---------------------------------------------------------------
    Active:
     1 node_ee5bfab9d854b912edb360dad45e77e935dc767b803055ea0755f27f
    Pending:
     (no pending nodes)
    ...
    Resources
    ---------------------------------------------------------------
    Total Usage:
     0.0/1.0 CPU
     0.0/16.0 NPU
     0B/15.20GiB memory

Older 2.x releases title the usage block ``Usage:`` instead of ``Total Usage:``; both are read.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class ClusterError(RuntimeError):
    """The cluster did not assemble, or its status cannot be read (one-line message)."""


@dataclass(frozen=True)
class ClusterStatus:
    """Active node count and resource totals (``{"NPU": 16.0, "CPU": 1.0, ...}``; byte sizes skipped)."""

    active_nodes: int
    pending_nodes: int
    totals: dict[str, float] = field(default_factory=dict)


def parse_ray_status(text: str) -> ClusterStatus:
    """Read ``ray status`` output.

    Raises:
        ClusterError: no ``Active:`` section (not a ``ray status`` answer).
    """
    section = ""
    active = pending = 0
    totals: dict[str, float] = {}
    saw_active = False
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if stripped in ("Active:", "Pending:", "Recent failures:", "Usage:", "Total Usage:", "Demands:",
                        "Pending Demands:", "From request_resources:", "Idle:"):
            section = stripped
            saw_active = saw_active or stripped == "Active:"
            continue
        if not stripped or stripped.startswith(("---", "===")) or stripped.startswith("("):
            continue
        if not raw.startswith(" "):
            section = ""  # a block title ("Node status", "Resources", ...) ends the previous list
            continue
        if section in ("Active:", "Pending:", "Idle:"):
            m = re.match(r"^(\d+)\s+\S+", stripped)
            if m and section == "Active:":
                active += int(m.group(1))
            elif m and section == "Pending:":
                pending += int(m.group(1))
        elif section in ("Usage:", "Total Usage:"):
            m = re.match(r"^([0-9.]+)/([0-9.]+)\s+(\S+)$", stripped)
            if m:
                totals[m.group(3)] = totals.get(m.group(3), 0.0) + float(m.group(2))
    if not saw_active:
        raise ClusterError("unexpected 'ray status' output (no 'Active:' section)")
    return ClusterStatus(active, pending, totals)


def query_status(ray_bin: str, address: str, timeout_s: float = 30.0) -> ClusterStatus:
    """Run ``ray status --address ADDRESS`` and parse it."""
    try:
        proc = subprocess.run([ray_bin, "status", "--address", address], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"'ray status --address {address}' did not answer within {timeout_s:.0f} s") from None
    except FileNotFoundError:
        raise ClusterError(f"ray executable not found: {ray_bin}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["?"])[-1]
        raise ClusterError(f"'ray status --address {address}' failed: {last}")
    return parse_ray_status(proc.stdout)


def wait_for_cluster(query: Callable[[], ClusterStatus], nnodes: int, npus_per_node: int, timeout_s: float,
                     interval_s: float = 2.0, alive: Callable[[], bool] = lambda: True,
                     log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> ClusterStatus:
    """Poll until ``nnodes`` nodes and ``nnodes × npus_per_node`` NPUs are registered.

    Raises:
        ClusterError: timeout (with what was registered), or ``alive()`` turned False (local Ray died).
    """
    deadline = clock() + timeout_s
    want_npu = float(nnodes * npus_per_node)
    last: ClusterStatus | None = None
    last_err = ""
    shown = None
    while True:
        if not alive():
            raise ClusterError("the local 'ray start' exited while waiting for the cluster (see its log)")
        try:
            last = query()
            last_err = ""
            now = (last.active_nodes, last.totals.get("NPU", 0.0))
            if now != shown:
                log(f"cluster: {now[0]}/{nnodes} nodes, {now[1]:g}/{want_npu:g} NPU registered")
                shown = now
            if last.active_nodes >= nnodes and last.totals.get("NPU", 0.0) >= want_npu:
                return last
        except ClusterError as exc:
            last_err = str(exc)
        if clock() >= deadline:
            got = (f"{last.active_nodes}/{nnodes} nodes, {last.totals.get('NPU', 0.0):g}/{want_npu:g} NPU"
                   if last else "no status")
            why = f"; last error: {last_err}" if last_err else ""
            raise ClusterError(f"cluster did not assemble within {timeout_s:g} s: {got} registered{why}")
        sleep(interval_s)
