"""Slurm glue for ``launch_slurm.sbatch``: the cluster facts come from Slurm, ``ray_start_npu.sh`` runs under it.

``python -m qwen3_rl launch slurm-plan`` (in the batch step, on the job's first node) prints NUL-separated
``KEY=value`` records for the batch script:

- ``HEAD_NODE`` / ``HEAD_ADDR``: the job's first node (``scontrol show hostnames $SLURM_JOB_NODELIST``) and its
  Slurm ``NodeAddr`` (``scontrol show node``): the Ray head and ``--master-addr`` of every node;
- ``NNODES``: ``$SLURM_JOB_NUM_NODES``;
- ``NPUS``: NPUs per node from the job's GRES (``TresPerNode=gres:npu:16`` / ``gres/npu:16`` in
  ``scontrol show job``; Slurm 22.05 sets no environment variable for a GRES other than ``gpu``), or ``""``
  when the job asked for none (then ``--npus-per-node`` / ``NPUS_PER_NODE`` decide).

``python -m qwen3_rl launch slurm-task -- LAUNCHER_ARGS`` (one task per node, under ``srun``) sets
``SOCKET_IFNAME`` (HCCL/GLOO sockets) to the interface holding this node's Slurm ``NodeAddr``, unless the user
gave ``--ifname`` / ``SOCKET_IFNAME``, and then replaces itself (``exec``, same PID: Slurm's signals reach the
launcher directly) with ``bash ray_start_npu.sh LAUNCHER_ARGS``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from qwen3_rl.tools.launch.netinfo import NetError, _ip, parse_addr_show

REPO = Path(__file__).resolve().parents[3]
NPU_GRES = "npu"


class SlurmError(RuntimeError):
    """Slurm facts cannot be read (one-line message)."""


def _scontrol(*args: str) -> str:
    exe = shutil.which("scontrol")
    if exe is None:
        raise SlurmError("'scontrol' not found on PATH: run this inside a Slurm job")
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, check=False)
    if p.returncode != 0:
        raise SlurmError(f"`scontrol {' '.join(args)}` failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return p.stdout


def parse_npus_per_node(job_text: str, name: str = NPU_GRES) -> int | None:
    """NPUs per node from ``scontrol show job -o`` text: ``TresPerNode=gres:npu:16`` (22.05), ``gres/npu:16``
    or ``gres/npu=16`` (later releases), optionally typed (``gres:npu:910c:16``); ``None`` without such GRES."""
    m = re.search(r"(?:^|\s)TresPerNode=(\S+)", job_text)
    if not m:
        return None
    for item in m.group(1).split(","):
        parts = re.split(r"[:/=]", item)
        if len(parts) >= 3 and parts[0] == "gres" and parts[1] == name and parts[-1].isdigit():
            return int(parts[-1])
    return None


def parse_node_addr(node_text: str) -> str:
    """``NodeAddr`` from ``scontrol show node NAME -o``."""
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", node_text)
    if not m:
        raise SlurmError("no NodeAddr in `scontrol show node` output")
    return m.group(1)


def slurm_plan(env: Mapping[str, str]) -> dict[str, str]:
    """The batch step's view of the job (see the module doc)."""
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES"):
        if not env.get(var):
            raise SlurmError(f"${var} is not set: submit launch_slurm.sbatch with sbatch")
    hosts = _scontrol("show", "hostnames", env["SLURM_JOB_NODELIST"]).split()
    if not hosts:
        raise SlurmError(f"no host in SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r}")
    addr = parse_node_addr(_scontrol("show", "node", hosts[0], "-o"))
    npus = parse_npus_per_node(_scontrol("show", "job", env["SLURM_JOB_ID"], "-o"))
    return {"HEAD_NODE": hosts[0], "HEAD_ADDR": addr, "NNODES": env["SLURM_JOB_NUM_NODES"],
            "NPUS": "" if npus is None else str(npus)}


def interface_of(addr: str, addr_show: str) -> str:
    """The interface that holds ``addr`` in ``ip -o addr show`` text."""
    for dev, ips in parse_addr_show(addr_show).items():
        if addr in ips:
            return dev
    raise SlurmError(f"no interface of this node holds its Slurm NodeAddr {addr}")


def cmd_slurm_plan(argv: list[str]) -> int:
    if argv:
        print("usage: python -m qwen3_rl launch slurm-plan (inside a Slurm batch step)", file=sys.stderr)
        return 2
    try:
        plan = slurm_plan(os.environ)
    except SlurmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("".join(f"{k}={v}\0" for k, v in plan.items()))
    return 0


def cmd_slurm_task(argv: list[str]) -> int:
    args = argv[1:] if argv[:1] == ["--"] else argv
    given = any(a == "--ifname" or a.startswith("--ifname=") for a in args) or os.environ.get("SOCKET_IFNAME")
    if not given:
        node = os.environ.get("SLURMD_NODENAME", "")
        if not node:
            print("error: $SLURMD_NODENAME is not set: slurm-task runs under srun", file=sys.stderr)
            return 1
        try:
            addr = parse_node_addr(_scontrol("show", "node", node, "-o"))
            os.environ["SOCKET_IFNAME"] = interface_of(addr, _ip("-o", "addr", "show"))
        except (SlurmError, NetError) as exc:
            print(f"error: node {node}: {exc}", file=sys.stderr)
            return 1
        print(f"[slurm] node {node}: NodeAddr {addr} on {os.environ['SOCKET_IFNAME']} (SOCKET_IFNAME)", flush=True)
    script = str(REPO / "ray_start_npu.sh")
    os.execvp("bash", ["bash", script, *args])
    return 0  # not reached
