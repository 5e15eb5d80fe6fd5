"""Ray actors that died for good anywhere in the cluster, read from the GCS actor table on the head.

verl 0.9.1 hangs silently when one of its actors dies (its trainer waits, e.g. ``ReplayBuffer._wait_for_next_poll``
with "running: 64, finished: 0"): its actors have ``max_restarts=0``, and a dead actor's pending calls are never
collected. The raylet log (ray_oom.py) shows only the kills of its own node, so the head's watcher also polls the
GCS actor table (the cluster-wide record; Ray 2.52 ``gcs.proto`` ``ActorTableData``: ``state``, ``class_name``,
``name``, ``pid``, ``address.ip_address``, ``death_cause``) for actors in state ``DEAD``. :func:`classify` (pure)
tells a loss from an intended end, by Ray's death cause as a real Ray 2.52 reports it (test_ray_actors.py):

* lost: ``oom_context`` (memory monitor, any node); ``actor_died_error_context`` with reason ``WORKER_DIED`` and a
  worker exit type other than ``INTENDED_*`` (SIGKILL, segfault, ``os._exit``: ``SYSTEM_ERROR``), or ``NODE_DIED``.
* not lost: ``RAY_KILL`` (``ray.kill``), ``OUT_OF_SCOPE`` / ``REF_DELETED`` (handle dropped), ``OWNER_DIED`` (its
  owner ended; if the owner died, that owner's own record is the loss), ``WORKER_DIED`` with ``INTENDED_USER_EXIT``
  (``ray.actor.exit_actor``) or ``INTENDED_SYSTEM_EXIT``; ``creation_task_failure_context`` /
  ``runtime_env_failed_context`` / ``actor_unschedulable_context`` (raised to the caller, not silent).

The GCS is read through Ray's own client (``ray._raylet.GlobalStateAccessor``, what ``ray.util.state`` /
``ray._private.state`` use), with the token of the run (``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN_PATH``): no new endpoint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from qwen3_rl.tools.launch.netinfo import tcp_reachable
from qwen3_rl.tools.launch.ray_oom import OomKill, oom_kill_from_message

_EXIT_TYPE = re.compile(r"Worker exit type: (\w+)")
_DETAIL = re.compile(r"Worker exit detail: (.*?)(?: Some common causes|$)")
_LOST_REASONS = ("WORKER_DIED", "NODE_DIED")
_MAX_DETAIL = 240  # characters of Ray's error message kept in the one-line report


@dataclass(frozen=True)
class DeadActor:
    """One ``DEAD`` row of the GCS actor table, as plain values.

    Attributes:
        actor_id: hex actor id (the row's key).
        class_name: the actor's class (``AgentLoopWorkerTQ``).
        name: the actor's name (``""`` if unnamed).
        pid: the actor's worker process id (0 if it never started).
        node_ip: the address of the node it ran on (``""`` if never placed).
        context: which death cause Ray recorded: ``oom_context``, ``actor_died_error_context``,
            ``creation_task_failure_context``, ... (``""`` if none).
        reason: ``actor_died_error_context.reason`` (``WORKER_DIED``, ``RAY_KILL``, ...; ``""`` otherwise).
        message: Ray's error message of that cause (may span lines).
    """

    actor_id: str
    class_name: str
    name: str
    pid: int
    node_ip: str
    context: str
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class ActorLoss:
    """An actor the run needed that died for good (not restarted, not ended on purpose)."""

    actor: DeadActor
    # one line: Ray's death cause, e.g. "WORKER_DIED (SYSTEM_ERROR: Worker unexpectedly exits ...)"
    cause: str
    lost: bool = True  # as OomKill.lost: the run waits for this actor

    @property
    def pid(self) -> int:
        """The dead actor's worker process id."""
        return self.actor.pid

    def message(self, head: bool = True) -> str:
        """The one-line report (without the ``error:`` prefix); read on the head only (``head`` is ignored)."""
        a = self.actor
        label = f"{a.class_name} '{a.name}'" if a.name else a.class_name
        return (
            f"Ray actor {label} (pid {a.pid}) on node {a.node_ip or '?'} died: {self.cause}; "
            "verl does not recover from this: stopping the training"
        )


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _MAX_DETAIL else flat[: _MAX_DETAIL - 3] + "..."


def classify(actor: DeadActor) -> ActorLoss | OomKill | None:
    """The loss this dead actor is (an :class:`OomKill` for a memory-monitor kill), or ``None`` if it ended as
    intended or its failure reaches the caller anyway (see the module docstring)."""
    if actor.context == "oom_context":
        return oom_kill_from_message(
            actor.message, pid=actor.pid, node=actor.node_ip or None, fallback_name=actor.class_name
        )
    if actor.context != "actor_died_error_context" or actor.reason not in _LOST_REASONS:
        return None
    exit_type = _EXIT_TYPE.search(actor.message)
    if exit_type and exit_type.group(1).startswith("INTENDED"):
        return None
    if actor.reason == "WORKER_DIED":
        detail = _DETAIL.search(" ".join(actor.message.split()))
        what = exit_type.group(1) if exit_type else "?"
        cause = f"WORKER_DIED ({what}: {_one_line(detail.group(1)) if detail else _one_line(actor.message)})"
    else:
        cause = f"{actor.reason} ({_one_line(actor.message)})"
    return ActorLoss(actor, cause)


def gcs_dead_actors(gcs_address: str) -> Callable[[], list[DeadActor]]:
    """A reader of the cluster's ``DEAD`` actors from the GCS at ``gcs_address`` (``host:port``).

    Each call returns every dead actor the GCS still holds. Connecting is retried on the next call when the GCS
    does not answer: a closed port fails within 2 s, before Ray's client (which gives up only after ~10 s) is
    tried. Raises ``ImportError`` here if ``ray`` is not importable, ``ConnectionError`` from a call.
    """
    # not Ray's info lines ("Loaded authentication token from file") on the launcher's output
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "warning")
    from ray._raylet import GcsClientOptions, GlobalStateAccessor
    from ray.core.generated import gcs_pb2

    state: dict[str, GlobalStateAccessor] = {}

    def read() -> list[DeadActor]:
        if "acc" not in state:
            host, _, port = gcs_address.rpartition(":")
            if not tcp_reachable(host.strip("[]"), int(port), timeout_s=2.0):
                raise ConnectionError(f"nothing answers at {gcs_address}")
            opts = GcsClientOptions.create(
                gcs_address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False
            )
            acc = GlobalStateAccessor(opts)
            if not acc.connect():
                raise ConnectionError(f"the GCS at {gcs_address} does not answer")
            state["acc"] = acc
        rows = []
        for raw in state["acc"].get_actor_table(None, "DEAD"):
            row = gcs_pb2.ActorTableData.FromString(raw)
            cause = row.death_cause
            context = cause.WhichOneof("context") or ""
            reason = message = ""
            if context == "actor_died_error_context":
                ctx = cause.actor_died_error_context
                reason, message = ctx.Reason.Name(ctx.reason), ctx.error_message
            elif context:
                message = getattr(getattr(cause, context), "error_message", "")
            rows.append(
                DeadActor(
                    actor_id=row.actor_id.hex(),
                    class_name=row.class_name,
                    name=row.name,
                    pid=row.pid,
                    node_ip=row.address.ip_address,
                    context=context,
                    reason=reason,
                    message=message,
                )
            )
        return rows

    return read
