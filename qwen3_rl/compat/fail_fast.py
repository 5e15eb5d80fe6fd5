"""A worker-group call that fails as soon as one worker fails (verl patch 0009).

verl's single controller runs a method on every worker of a group and waits with ``ray.get(refs)``
(``verl/single_controller/ray/base.py`` ``func_generator`` and ``execute_all_sync``). ``ray.get`` on a list
returns only when every reference is ready. When one worker process dies (OOM killer, a device fault, a
node lost), its reference is ready at once with ``ActorDiedError``, but the others may never be: the
surviving ranks sit in a collective waiting for the dead one (HCCL's timeout is 30 min and more, gloo's
is ``nccl_timeout``), and the driver waits with them. :func:`get_all` waits for the references one at a
time, in the order they finish, and raises the first error it sees; the launcher then stops Ray and with
it the blocked workers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["get_all"]


def get_all(refs: Any) -> Any:
    """``ray.get(refs)`` that raises the first failure among ``refs`` without waiting for the rest.

    Args:
        refs: a list of ``ray.ObjectRef`` (one per worker), or anything else ``ray.get`` takes (passed on).

    Returns:
        The values, in the order of ``refs`` (each object fetched once).

    Raises:
        The error of the first reference that finishes with one (``ray.exceptions.RayTaskError`` wrapping
        the worker's exception, ``ray.exceptions.ActorDiedError``, ...).
    """
    import ray

    if not isinstance(refs, list) or len(refs) < 2 or not all(isinstance(r, ray.ObjectRef) for r in refs):
        return ray.get(refs)
    index: dict[ray.ObjectRef, list[int]] = {}
    for i, ref in enumerate(refs):
        index.setdefault(ref, []).append(i)
    values: list[Any] = [None] * len(refs)
    pending = list(index)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            value = ray.get(ref)  # raises this worker's error now, whatever the others are doing
            for i in index[ref]:
                values[i] = value
    return values
