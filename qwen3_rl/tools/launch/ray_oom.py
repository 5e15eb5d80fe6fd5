"""Ray memory-monitor kills on this node, read from the raylet's log (``<session dir>/logs/raylet.out``).

When the node's memory use passes ``RAY_memory_usage_threshold`` (default 0.95), Ray 2.52's raylet kills the most
recently scheduled worker and logs three records (``memory_monitor.cc:88`` "Node memory usage above threshold,
used: B, threshold_bytes: B, total bytes: B, threshold fraction: F"; ``node_manager.cc`` "Killing worker with task
Type=..., function_descriptor={..., module_name=M, class_name=C, function_name=F, ...}, ..., task_name=N, ..."
followed by a "Memory on the node ... (..., name=N, pid=P, memory used=XGB) was running was U GB / T GB (f), which
exceeds the memory usage threshold of F." paragraph; then "Worker evicted and process killed to reclaim memory.
worker pid: P"). verl 0.9.1 does not notice when this kills one of its actors (e.g. ``AgentLoopWorkerTQ``): its
trainer waits forever for rollouts. :class:`OomParser` turns those lines into :class:`OomKill` records (pure);
:func:`follow_kills` follows the log with bounded polling; ``python -m qwen3_rl launch watch-oom`` (cli.py) prints
one line per kill (``warning:`` when nothing is lost: an idle worker, a task Ray retries, an actor it restarts; else
``error:``) and, on the head, exits 1 at the first loss so that ``ray_start_npu.sh`` stops the training. The
kills on other nodes reach the head through the GCS actor table (ray_actors.py, :func:`oom_kill_from_message`).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qwen3_rl.tools.launch.ray_actors import ActorLoss

_ABOVE = re.compile(
    r"Node memory usage above threshold, used: (\d+), threshold_bytes: \d+, total bytes: (\d+), "
    r"threshold fraction: (\d+(?:\.\d+)?)"
)
_KILLING = re.compile(r"Killing worker with task (.*)")
_MODULE = re.compile(r"module_name=([^,}]*)")
_CLASS = re.compile(r"class_name=([^,}]*)")
_FUNCTION = re.compile(r"function_name=([^,}]*)")
_TASK_NAME = re.compile(r"task_name=([^,}]*)")
_RETRIES = re.compile(r"(max_retries|max_restarts)=(-?\d+)")  # normal task / actor: -1 = unlimited, 0 = none
_ON_NODE = re.compile(
    r"name=([^,]*), pid=(\d+), memory used=[0-9.]+GB\) was running was (\d+(?:\.\d+)?)GB / (\d+(?:\.\d+)?)GB "
    r"\([0-9.]+\), which exceeds the memory usage threshold of (\d+(?:\.\d+)?)"
)
_EVICTED = re.compile(r"Worker evicted and process killed to reclaim memory\. worker pid: (\d+)")
_GB = 1e9  # Ray prints GB = 1e9 bytes (its memory_monitor formats bytes / 1e9)


@dataclass(frozen=True)
class OomKill:
    """One worker the raylet killed to reclaim memory.

    Attributes:
        pid: the killed worker's process id.
        name: what Ray logs for the task: ``task_name`` (``agent_loop_worker_0_94ffa9f7:AgentLoopWorkerTQ.__init__``)
            else ``module.Class.function`` from the function descriptor; ``"?"`` when no description was logged.
        used_gb / total_gb: node memory in use / in total at the kill, GB (1e9 bytes); ``None`` if not logged.
        threshold: the kill threshold as a fraction of the node's memory (``RAY_memory_usage_threshold``).
        retried: Ray runs the task again / restarts the actor (its logged ``max_retries`` / ``max_restarts`` is not
            0), so the job can go on; verl's actors have ``max_restarts=0``.
        idle: the worker ran no task (``EmptyFunctionDescriptor``, empty ``task_name``; Ray 2.52 also kills idle
            pooled workers): nothing was lost.
        node: the node's address when known from the GCS (a kill on another node); ``None`` for this node's log.
    """

    pid: int
    name: str
    used_gb: float | None = None
    total_gb: float | None = None
    threshold: float | None = None
    retried: bool = False
    idle: bool = False
    node: str | None = None

    @property
    def lost(self) -> bool:
        """A task or actor is gone for good: the job waits for it (verl does, forever)."""
        return not (self.retried or self.idle)

    def message(self, head: bool) -> str:
        """The one-line report (without the ``error:`` prefix)."""
        mem = (
            f"node memory {self.used_gb:.2f}/{self.total_gb:.2f} GB"
            if self.used_gb is not None and self.total_gb is not None
            else "node memory"
        )
        thr = (
            f" above Ray's threshold {self.threshold:g}"
            if self.threshold is not None
            else " above Ray's threshold"
        )
        if self.idle:
            tail = "it ran no task, nothing lost"
        elif self.retried:
            tail = "Ray retries it"
        elif head:
            tail = "verl does not recover from this: stopping the training"
        else:
            tail = "verl does not recover from this: the head's watcher stops the training"
        where = f" on node {self.node}" if self.node else ""
        return f"Ray killed {self.name} (pid {self.pid}){where} to reclaim memory: {mem}{thr}; {tail}"


def _descriptor_name(spec: str) -> str:
    task = _TASK_NAME.search(spec)
    if task and task.group(1).strip():
        return task.group(1).strip()
    parts = [
        m.group(1).strip() for m in (_MODULE.search(spec), _CLASS.search(spec), _FUNCTION.search(spec)) if m
    ]
    parts = [p for p in parts if p]
    return ".".join(parts) if parts else "?"


class OomParser:
    """Incremental parser of raylet.out lines: :meth:`feed` one line (without newline), get the finished kill.

    A kill is finished at its "Worker evicted ... worker pid: P" line; the description and memory figures are
    taken from the lines before it (the last "Killing worker" / "Memory on the node" / "above threshold" seen).
    """

    def __init__(self) -> None:
        self._name = "?"
        self._name_pid: int | None = None
        self._retried = self._idle = False
        self._mem: tuple[float, float, float] | None = None  # used GB, total GB, threshold fraction

    def feed(self, line: str) -> OomKill | None:
        m = _ABOVE.search(line)
        if m:
            self._mem = (int(m.group(1)) / _GB, int(m.group(2)) / _GB, float(m.group(3)))
            return None
        m = _KILLING.search(line)
        if m:
            self._name, self._name_pid = _descriptor_name(m.group(1)), None
            retries = _RETRIES.search(m.group(1))
            self._retried = retries is not None and retries.group(2) != "0"
            task = _TASK_NAME.search(m.group(1))
            self._idle = "EmptyFunctionDescriptor" in m.group(1) and not (task and task.group(1).strip())
            return None
        m = _ON_NODE.search(line)
        if m:
            if self._name == "?" and m.group(1).strip():
                self._name = m.group(1).strip()
            self._name_pid = int(m.group(2))
            self._mem = (float(m.group(3)), float(m.group(4)), float(m.group(5)))
            return None
        m = _EVICTED.search(line)
        if not m:
            return None
        pid = int(m.group(1))
        ours = self._name_pid in (None, pid)
        name, retried, idle = (self._name, self._retried, self._idle) if ours else ("?", False, False)
        if idle:
            name = "an idle worker"
        used, total, thr = self._mem if self._mem else (None, None, None)
        self._name, self._name_pid, self._retried, self._idle = "?", None, False, False
        return OomKill(
            pid=pid, name=name, used_gb=used, total_gb=total, threshold=thr, retried=retried, idle=idle
        )


def oom_kill_from_message(message: str, pid: int, node: str | None, fallback_name: str) -> OomKill:
    """The kill a GCS ``oom_context`` error message describes (it holds the "Memory on the node" paragraph of
    raylet.out); ``fallback_name`` (the actor's class) if the paragraph names no task."""
    m = _ON_NODE.search(" ".join(message.split()))
    if not m:
        return OomKill(pid=pid, name=fallback_name, node=node)
    return OomKill(
        pid=pid,
        name=m.group(1).strip() or fallback_name,
        used_gb=float(m.group(3)),
        total_gb=float(m.group(4)),
        threshold=float(m.group(5)),
        node=node,
    )


def parse_kills(lines: Iterable[str]) -> list[OomKill]:
    """Every memory-monitor kill in ``lines`` (raylet.out), in log order."""
    parser = OomParser()
    return [k for k in (parser.feed(ln.rstrip("\n")) for ln in lines) if k is not None]


def raylet_session_dir(pgid: int, proc_root: str = "/proc") -> Path | None:
    """The session dir of the raylet in process group ``pgid`` (the launcher's ``setsid ray start --block``):
    the raylet's ``--session_dir=`` argument (Ray 2.52 ``_private/services.py`` start_raylet). ``None`` if no
    raylet of that group is running."""
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # field 5 of /proc/PID/stat (after the parenthesised comm) is the process group
        if int(stat.rsplit(")", 1)[1].split()[2]) != pgid or not argv or not argv[0].endswith(b"raylet"):
            continue
        for arg in argv:
            if arg.startswith(b"--session_dir="):
                return Path(arg.split(b"=", 1)[1].decode())
    return None


def follow_kills(
    path: Path,
    alive: Callable[[], bool],
    interval_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
    also: Callable[[], Iterable[OomKill | ActorLoss]] | None = None,
) -> Iterator[OomKill | ActorLoss]:
    """Yield each kill logged in ``path`` from its start, polling every ``interval_s`` s; stops once ``alive()``
    is false (after one last read). A file that does not exist yet is waited for the same way. ``also`` is called
    after each read of the log but the last; what it returns (the GCS's losses on the head) is yielded too."""
    parser = OomParser()
    pos, rest = 0, b""
    while True:
        running = alive()
        try:
            with path.open("rb") as f:
                f.seek(pos)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        pos += len(chunk)
        *full, rest = (rest + chunk).split(b"\n")
        for raw in full:
            kill = parser.feed(raw.decode(errors="replace"))
            if kill is not None:
                yield kill
        if also is not None and running:  # once the job is over, a loss no longer holds it up
            yield from also()
        if not running:
            return
        sleep(interval_s)
