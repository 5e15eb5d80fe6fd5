"""Server-mode placements for the rollout simulator (``simulate rollout --placement spread|group``).

In server mode (``ROLLOUT_MODE=async``) verl's agent loop sends every sample as its own request, and the batch is
placed on *engines* ((server, vLLM DP rank) pairs, ``--servers`` servers of ``dp / servers`` ranks) by a router
instead of verl's contiguous SPMD chunks. As the product does (and ``qwen3_rl.tools.bench.routing``): the batch is
cut into ``agent_workers`` contiguous pieces, each placed by its own router (no shared state), every request of
the step sent before any finishes, with the product's classes from :mod:`qwen3_rl.rollout.server_routing`:

* ``spread``: :class:`~qwen3_rl.rollout.server_routing.VerlLeastAssigned` (verl 0.6.1: the server with the fewest
  requests assigned, then vLLM's DP balancer inside it): a prompt's samples land on up to ``n`` engines;
* ``group``: :class:`~qwen3_rl.rollout.server_routing.GroupRouter` with ``slack``: a prompt's samples on one engine.

An engine's queue holds its requests in send order, the workers interleaved (position in the piece, then worker).
:func:`siblings_on_engine` gives, per request, the samples of its prompt on its engine (itself included), which the
drafting model reads (``sim/drafting.py``: :func:`~qwen3_rl.tools.sim.drafting.sibling_tables`).
"""

from __future__ import annotations

import numpy as np

from qwen3_rl.rollout.server_routing import GroupRouter, VerlLeastAssigned

SERVER_PLACEMENTS = ("spread", "group")
#: verl's rollout.agent.num_workers default (ROLLOUT_AGENT_WORKERS)
AGENT_WORKERS = 8


def server_assignment(num_prompts: int, n: int, engines: int, servers: int, placement: str, slack: int = 0,
                      agent_workers: int = AGENT_WORKERS) -> list[np.ndarray]:
    """Request ids (rows ``prompt * n + sample``, dataset order) per engine ``server * dp + dp_rank``, in queue order.

    Raises ValueError for an unknown placement, ``engines`` not a multiple of ``servers``, or a batch that does not
    split evenly over the agent-loop workers (verl's ``chunk`` needs it)."""
    if placement not in SERVER_PLACEMENTS:
        raise ValueError(f"unknown server placement {placement!r} (choose from {', '.join(SERVER_PLACEMENTS)})")
    if servers < 1 or engines < servers or engines % servers:
        raise ValueError(f"--dp {engines} must be a positive multiple of --servers {servers}")
    size = num_prompts * n
    if agent_workers < 1 or size % agent_workers:
        raise ValueError(f"the batch ({size} samples) must split evenly over {agent_workers} agent-loop workers")
    dp = engines // servers
    piece = size // agent_workers
    queued: list[list[tuple[int, int, int]]] = [[] for _ in range(engines)]  # (position, worker, row)
    for w in range(agent_workers):
        if placement == "group":
            router = GroupRouter(servers, dp=dp, slack=slack)
            for j in range(piece):
                row = w * piece + j
                queued[router.choose(str(row), (row // n,))].append((j, w, row))
        else:
            verl = VerlLeastAssigned(servers, dp)
            for j in range(piece):
                row = w * piece + j
                queued[verl.choose(str(row))].append((j, w, row))
    return [np.array([row for _, _, row in sorted(q)], dtype=np.int64) for q in queued]


def siblings_on_engine(assignment: list[np.ndarray], n: int, size: int) -> np.ndarray:
    """Per request (shape ``(size,)``), the samples of its prompt on its engine, itself included (1..n)."""
    out = np.zeros(size, dtype=np.int64)
    for rows in assignment:
        prompts = rows // n
        _, inv, counts = np.unique(prompts, return_inverse=True, return_counts=True)
        out[rows] = counts[inv]
    if (out == 0).any():
        raise ValueError("the assignment does not place every request")
    return out
