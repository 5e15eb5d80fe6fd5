"""Group routing as a verl 0.9.1 router plugin (current pin set): a prompt's samples go to one rollout server.

verl 0.9.1 routes every request of every agent-loop worker through one load-balancer Ray actor
(``verl/workers/rollout/router.py``: ``get_router_handle``); ``rollout.router_config_path`` names a YAML whose
``router_class`` replaces the default sticky + least-in-flight balancer, built as ``router_class(servers, yaml)``
(``_create_plugin_extension``). The clients pass it only the ``generate()`` fields it declares
(``require_acquire_fields``, ``llm_server.py:70-81``). This plugin declares ``prompt_ids`` and places requests with
:class:`~qwen3_rl.rollout.server_routing.GroupRouter`, one target per server and vLLM DP rank: with more than one
rank the handle it returns is a :class:`~qwen3_rl.rollout.verl_dp_rank.RankedServerHandle`, which the recipe's
server passes on to vLLM (``qwen3_rl.rollout.verl_dp_rank``). Being the one balancer of
the run, it sees every sibling: a prompt's ``n`` samples land on one server whichever agent-loop worker sends
them, where the seed set's per-worker routers agree only through rendezvous hashing.

The router YAML (keys besides ``router_class`` optional)::

    router_class: qwen3_rl.rollout.verl_router.GroupRoutingBalancer
    slack: 0             # requests in flight a prompt's server may exceed the least busy one by and still get it
    max_prompts: 100000  # prompts remembered (LRU)
    data_parallel_size: 2  # vLLM DP ranks per server; absent: the servers' rollout.data_parallel_size

Generation batches: siblings are "the same prompt in one batch". verl's colocated trainer tells the balancer
nothing between batches, so a batch ends when no request is in flight any more, or at ``clear_sticky_cache``
(verl's phase switch and fully-async rebalance). The same prompt in a later batch is placed anew (preferring the
server that served it, within ``slack``).

Multi-turn: a request id keeps its server across turns (LRU of ``max_cache_size`` ids, as verl's default balancer).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from qwen3_rl.rollout.server_routing import VERL_MAX_CACHE_SIZE, GroupRouter
from qwen3_rl.rollout.verl_dp_rank import RankedServerHandle

__all__ = ["GroupRoutingBalancer", "parse_router_config"]

_KEYS = {
    "router_class": str,
    "slack": int,
    "max_prompts": int,
    "max_cache_size": int,
    "data_parallel_size": int,
}
_INT_KEYS = ("slack", "max_prompts", "max_cache_size", "data_parallel_size")


def parse_router_config(config: Mapping[str, Any]) -> dict[str, int]:
    """The plugin's settings from verl's router YAML (as loaded, a dict): ``slack``, ``max_prompts``,
    ``max_cache_size``, ``data_parallel_size`` (0: not given). An unknown key or a bad value raises ``ValueError``
    with one line naming it."""
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(f"router config: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
    out = {"slack": 0, "max_prompts": 100_000, "max_cache_size": VERL_MAX_CACHE_SIZE, "data_parallel_size": 0}
    for key in _INT_KEYS:
        if key in config:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"router config: {key} must be an integer, got {value!r}")
            out[key] = value
    if (
        out["slack"] < 0
        or out["max_prompts"] < 1
        or out["max_cache_size"] < 1
        or out["data_parallel_size"] < 0
    ):
        raise ValueError(
            f"router config: slack >= 0, max_prompts >= 1, max_cache_size >= 1, data_parallel_size >= 1; got {out}"
        )
    return out


class GroupRoutingBalancer:
    """verl 0.9.1's ``RequestLoadBalancer`` protocol (``router.py:32-130``) with group placement.

    Args:
        servers: ``{server_id: actor_handle}`` (verl's server addresses); may be empty, filled by ``add_servers``.
        config: the router YAML as a dict (see the module docstring).
    """

    def __init__(self, servers: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> None:
        cfg = parse_router_config(config or {})
        self.slack, self.max_prompts, self.max_cache_size = (
            cfg["slack"],
            cfg["max_prompts"],
            cfg["max_cache_size"],
        )
        self._dp = cfg["data_parallel_size"]  # 0: asked of the servers (_dp_size)
        self._servers: dict[str, Any] = dict(servers)
        self._sticky: OrderedDict[str, tuple[str, int]] = OrderedDict()  # request id -> (server id, DP rank)
        self._in_flight: dict[str, str] = {}  # request id -> server id, while acquired
        self._counts: Counter[str] = Counter()
        self._rebuild()

    # -- placement --

    def _rebuild(self) -> None:
        """A new router over the current servers (sorted ids: one order whatever the dict's)."""
        if self._servers and getattr(self, "router", None) is not None:
            self._take_counts()
        self._order = sorted(self._servers)
        self.router = (
            GroupRouter(len(self._order), dp=self._dp_size(), slack=self.slack, max_keys=self.max_prompts)
            if self._order
            else None
        )

    def _dp_size(self) -> int:
        """vLLM DP ranks per server: the YAML's ``data_parallel_size``, else asked once of a server
        (``get_rollout_config``, ``vllm_async_server.py:234-241``: ``rollout.data_parallel_size``), else 1 for a
        server without that method."""
        if not self._dp:
            method = getattr(self._servers[self._order[0]], "get_rollout_config", None)
            if method is None:
                return 1
            import ray

            self._dp = int(ray.get(method.remote(), timeout=120).data_parallel_size)
        return self._dp

    def _take_counts(self) -> None:
        if self.router is not None:
            self._counts.update(self.router.take_counts())

    def acquire_server(self, request_id: str, prompt_ids: Sequence[int] | None = None) -> tuple[str, Any]:
        """The server for one request: its earlier turn's server, else its prompt's (group placement); raises
        ``RuntimeError`` with no server, ``ValueError`` without ``prompt_ids`` on a new request."""
        if self.router is None:
            raise RuntimeError("No available servers in load balancer")
        dp = self.router.dp
        server_id, rank = self._sticky.get(request_id, ("", 0))
        if server_id in self._servers and rank < dp:
            self._sticky.move_to_end(request_id)
            self.router.place(request_id, self._order.index(server_id) * dp + rank)
        else:
            if prompt_ids is None:
                raise ValueError(f"group routing needs prompt_ids for request {request_id!r}")
            server, rank = divmod(self.router.choose(request_id, prompt_ids), dp)
            server_id = self._order[server]
            self._sticky[request_id] = (server_id, rank)
            while len(self._sticky) > self.max_cache_size:
                self._sticky.popitem(last=False)
        self._in_flight[request_id] = server_id
        handle = self._servers[server_id]
        return server_id, (RankedServerHandle(handle, rank) if dp > 1 else handle)

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        """A request is done; when none is in flight any more, the generation batch ends."""
        if request_id is None or self._in_flight.pop(request_id, None) is None:
            return
        if self.router is not None:
            self.router.done(request_id, 0)
            if not self._in_flight:
                self._take_counts()

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    # -- pool --

    def add_servers(self, servers: Mapping[str, Any]) -> None:
        """New servers join; placements start anew over the whole pool (requests in flight keep theirs)."""
        self._servers.update(servers)
        self._rebuild()

    def remove_servers(self, server_ids: list[str]) -> None:
        for sid in server_ids:
            self._servers.pop(sid, None)
        self._rebuild()

    def get_all_servers(self) -> list[str]:
        return list(self._order)

    def get_total_inflight(self) -> int:
        return len(self._in_flight)

    def get_status(self) -> dict:
        loads = Counter(self._in_flight.values())
        return {
            "servers": {sid: loads[sid] for sid in self._order},
            "total_inflight": len(self._in_flight),
            "active_servers": len(self._order),
            "routing": dict(self._counts),
        }

    def clear_sticky_cache(self) -> dict:
        """verl's phase switch: request stickiness dropped, and a new generation batch begins."""
        cleared = len(self._sticky)
        self._sticky.clear()
        self._take_counts()
        loads = Counter(self._in_flight.values())
        return {"cleared_entries": cleared, "server_loads": {sid: loads[sid] for sid in self._order}}

    def take_routing_counts(self) -> dict[str, int]:
        """The routing counts (``routing_*``: requests, sibling pairs, pairs on one server and verl's replayed
        policy's) of the batches ended since the last call; for :func:`~qwen3_rl.rollout.server_routing.routing_metrics`."""
        out, self._counts = dict(self._counts), Counter()
        return out
