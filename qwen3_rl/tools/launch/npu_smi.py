"""Parsers for ``npu-smi`` output (Ascend driver tool) and a thin runner.

Three outputs are read, all as plain text:

* ``npu-smi info -m``: the chip map, one row per chip: ``NPU ID  Chip ID  Chip Logic ID  Chip Name``.
  On Atlas A3 every card (NPU ID 0-7) has two compute dies (Chip ID 0/1, logic IDs 0-15) plus an
  ``Mcu`` row whose logic ID is ``-``. The logic ID is the device index torch_npu and
  ``ASCEND_RT_VISIBLE_DEVICES`` use.
* ``npu-smi info -t topo``: a link matrix ``NPU0 .. NPUn`` (rows and columns, indexed by logic ID)
  followed by a ``CPU Affinity`` column holding a Linux cpulist (``0-39`` or ``0-19,80-99``), then a
  legend.
* ``npu-smi info``: the status table; its last block is the process table with rows
  ``| NPU  Chip | Process id | Process name | Process memory(MB) |``.

The sample outputs in ``tests/data/npu_smi_*.txt`` are reconstructions from the documented format
(no NPU host was available when they were written), not captures.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass


class NpuSmiError(RuntimeError):
    """``npu-smi`` is missing, failed, or printed something we cannot read (one-line message)."""


@dataclass(frozen=True)
class Chip:
    """One compute die: card index, die index on the card, logic (device) index, name."""

    npu_id: int
    chip_id: int
    logic_id: int
    name: str


@dataclass(frozen=True)
class NpuProcess:
    """One row of the process table: the die (card, chip) a process holds, and the process."""

    npu_id: int
    chip_id: int
    pid: int
    name: str
    memory_mb: int


def parse_cpulist(text: str) -> list[int]:
    """Parse a Linux cpulist (``"0-3,8,10-11"``) into sorted unique core ids.

    Raises:
        ValueError: malformed list or a descending range.
    """
    cores: set[int] = set()
    text = text.strip()
    if not text:
        raise ValueError("empty cpulist")
    for part in text.split(","):
        part = part.strip()
        if not re.fullmatch(r"\d+(-\d+)?", part):
            raise ValueError(f"bad cpulist element {part!r} in {text!r}")
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-"))
            if hi < lo:
                raise ValueError(f"descending range {part!r} in {text!r}")
            cores.update(range(lo, hi + 1))
        else:
            cores.add(int(part))
    return sorted(cores)


def format_cpulist(cores: list[int] | set[int] | tuple[int, ...]) -> str:
    """Inverse of :func:`parse_cpulist`: ``[0,1,2,5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    ordered = sorted(set(cores))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def parse_chip_map(text: str) -> list[Chip]:
    """Read ``npu-smi info -m`` into compute chips (rows whose logic ID is ``-`` are skipped)."""
    chips: list[Chip] = []
    saw_header = False
    for line in text.splitlines():
        if "Chip Logic ID" in line:
            saw_header = True
            continue
        m = re.match(r"^\s*(\d+)\s+(\d+)\s+(\d+|-)\s+(\S.*?)\s*$", line)
        if not m or m.group(3) == "-":
            continue
        chips.append(Chip(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)))
    if not saw_header:
        raise NpuSmiError("npu-smi info -m: no 'Chip Logic ID' header in the output")
    return chips


def _is_topo_header(line: str) -> bool:
    """The column header: only ``NPU<k>`` tokens before the ``CPU``/``NUMA`` affinity titles."""
    tokens = line.split()
    lead = [t for t in tokens if t not in ("CPU", "NUMA", "Affinity")]
    return bool(lead) and all(re.fullmatch(r"NPU\d+", t) for t in lead)


def parse_topo_affinity(text: str) -> dict[int, list[int]]:
    """Read ``npu-smi info -t topo`` into ``{logic id: CPU cores}`` from its ``CPU Affinity`` column.

    Raises:
        NpuSmiError: no header with NPU columns, no ``CPU Affinity`` column, or a bad cpulist.
    """
    lines = text.splitlines()
    header_idx = next((i for i, ln in enumerate(lines) if _is_topo_header(ln)), None)
    if header_idx is None:
        raise NpuSmiError("npu-smi info -t topo: no header row with NPU columns")
    header = lines[header_idx]
    if "CPU Affinity" not in header:
        raise NpuSmiError("npu-smi info -t topo: no 'CPU Affinity' column (cannot compute CPU binding)")
    ncols = len(re.findall(r"\bNPU\d+\b", header))
    out: dict[int, list[int]] = {}
    for line in lines[header_idx + 1 :]:
        m = re.match(r"^\s*NPU(\d+)\s+(.*)$", line)
        if not m:
            if out and not line.strip():
                break
            continue
        cells = m.group(2).split()
        if len(cells) < ncols + 1:
            raise NpuSmiError(f"npu-smi info -t topo: row NPU{m.group(1)} has no CPU Affinity value")
        affinity = cells[ncols]
        try:
            out[int(m.group(1))] = parse_cpulist(affinity)
        except ValueError as exc:
            raise NpuSmiError(f"npu-smi info -t topo: row NPU{m.group(1)}: {exc}") from None
    if not out:
        raise NpuSmiError("npu-smi info -t topo: no NPU rows")
    return out


def parse_processes(text: str) -> list[NpuProcess]:
    """Read the process table of ``npu-smi info`` (other rows of the status table are ignored)."""
    procs: list[NpuProcess] = []
    in_table = False
    for line in text.splitlines():
        if "Process id" in line:
            in_table = True
            continue
        if not in_table or not line.startswith("|"):
            continue
        fields = [f.strip() for f in line.strip().strip("|").split("|")]
        if len(fields) < 3:
            continue
        ids = fields[0].split()
        if len(ids) != 2 or not all(x.isdigit() for x in ids) or not fields[1].isdigit():
            continue
        mem = fields[3] if len(fields) > 3 and fields[3].isdigit() else "0"
        procs.append(NpuProcess(int(ids[0]), int(ids[1]), int(fields[1]), fields[2], int(mem)))
    return procs


def run_npu_smi(*args: str, timeout_s: float = 30.0) -> str:
    """Run ``npu-smi ARGS`` and return stdout.

    Raises:
        NpuSmiError: not on PATH, timed out, or non-zero exit (its last stderr line).
    """
    exe = shutil.which("npu-smi")
    if exe is None:
        raise NpuSmiError("npu-smi not found on PATH (no Ascend driver visible on this node)")
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise NpuSmiError(f"npu-smi {' '.join(args)} did not answer within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["?"])[-1]
        raise NpuSmiError(f"npu-smi {' '.join(args)} failed (exit {proc.returncode}): {last}")
    return proc.stdout
