"""Group routing for verl's server rollout: a prompt's samples go to one vLLM server.

verl 0.6.1's agent loop sends every sample as its own request (its own request id) through
``AsyncLLMServerManager._choose_server`` (``verl/experimental/agent_loop/agent_loop.py:78-88``): sticky per
request id, otherwise the server with the fewest requests assigned so far. A prompt's ``n`` samples therefore
spread over the servers, and the SAM drafter's group mode (siblings drafting from each other's tokens) and
its history (a prompt's earlier responses) see only the part of the group that landed on their engine.

:class:`GroupRouter` keys each request by its prompt (:func:`prompt_key`, the same digest as the SAM
drafter's ``group_key``): the first request of a key picks the server with the fewest requests in flight
(ties: the fewest sent so far), and later requests of the key (its siblings, and the prompt's next visit in a later step) follow it. It
also replays verl's own policy on the same requests (:class:`VerlLeastAssigned`, never used to route) so
one run reports both: the share of sibling pairs on one engine and the load spread over servers.

Counts (:meth:`GroupRouter.take_counts`) are plain ints keyed ``routing_*`` so they add up over agent-loop
workers and generation batches; :func:`routing_metrics` turns a step's sum into ``rollout/routing/*``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping, Sequence

PREFIX = "rollout/routing/"
#: Count-name prefix (the counts travel with the spec-decode counts, see ``qwen3_rl.trainer.seam``).
COUNT_PREFIX = "routing_"


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A prompt's group key: blake2b-128 hex of its token ids as int32 (equals ``sam.group_key``)."""
    return hashlib.blake2b(array("i", [int(t) for t in prompt_ids]).tobytes(), digest_size=16).hexdigest()


class VerlLeastAssigned:
    """verl 0.6.1's server choice, replayed: sticky per request id, else the server with the fewest requests
    assigned so far (ties: the lowest index, as its heap of ``[count, ...]`` pairs gives for equal counts
    after a shuffle; the exact tie order does not change the spread)."""

    def __init__(self, n_servers: int) -> None:
        self.assigned = [0] * n_servers
        self.by_request: dict[str, int] = {}

    def choose(self, request_id: str) -> int:
        if request_id in self.by_request:
            return self.by_request[request_id]
        i = min(range(len(self.assigned)), key=lambda s: self.assigned[s])
        self.assigned[i] += 1
        self.by_request[request_id] = i
        return i


class GroupRouter:
    """Chooses a server index per request so that requests of one prompt share a server.

    Args:
        n_servers: servers to choose from (indices 0..n-1, in a fixed order every router agrees on).
        max_keys: prompts remembered (least recently used forgotten first); a forgotten prompt picks anew.
    """

    def __init__(self, n_servers: int, max_keys: int = 100_000) -> None:
        if n_servers < 1:
            raise ValueError(f"group routing needs at least one server, got {n_servers}")
        self.n = n_servers
        self.max_keys = max_keys
        self.server_of_key: OrderedDict[str, int] = OrderedDict()
        self.in_flight = [0] * n_servers
        self.assigned = [0] * n_servers  # requests ever sent (tie-break among equally busy servers)
        self.shadow = VerlLeastAssigned(n_servers)
        self._placed: dict[Hashable, tuple[str, int, int]] = {}  # request id -> (key, ours, verl's)
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.requests: Counter[int] = Counter()
        self.tokens: Counter[int] = Counter()
        self.verl_requests: Counter[int] = Counter()
        self.verl_tokens: Counter[int] = Counter()
        self.groups: dict[str, tuple[Counter[int], Counter[int]]] = {}

    def choose(self, request_id: str, prompt_ids: Sequence[int]) -> int:
        """The server index for this request (siblings of an earlier request follow it)."""
        if request_id in self._placed:  # verl's stickiness per request id (multi-turn): keep it
            return self._placed[request_id][1]
        key = prompt_key(prompt_ids)
        server = self.server_of_key.get(key)
        if server is None:
            server = min(range(self.n), key=lambda s: (self.in_flight[s], self.assigned[s]))
            self.server_of_key[key] = server
            while len(self.server_of_key) > self.max_keys:
                self.server_of_key.popitem(last=False)
        else:
            self.server_of_key.move_to_end(key)
        verl = self.shadow.choose(request_id)
        self._placed[request_id] = (key, server, verl)
        self.in_flight[server] += 1
        self.assigned[server] += 1
        self.requests[server] += 1
        self.verl_requests[verl] += 1
        ours, theirs = self.groups.setdefault(key, (Counter(), Counter()))
        ours[server] += 1
        theirs[verl] += 1
        return server

    def done(self, request_id: str, response_tokens: int) -> None:
        """A request finished with ``response_tokens`` generated tokens (load accounting)."""
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return
        _, server, verl = placed
        self.in_flight[server] -= 1
        self.tokens[server] += int(response_tokens)
        self.verl_tokens[verl] += int(response_tokens)

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call (then reset): requests, sibling pairs and those on one server
        (ours and verl's), and per server index the requests and response tokens (ours and verl's)."""
        pairs = same = verl_same = 0
        for ours, theirs in self.groups.values():
            k = sum(ours.values())
            pairs += k * (k - 1) // 2
            same += sum(c * (c - 1) // 2 for c in ours.values())
            verl_same += sum(c * (c - 1) // 2 for c in theirs.values())
        out = {
            "routing_requests": sum(self.requests.values()),
            "routing_sibling_pairs": pairs,
            "routing_sibling_pairs_same": same,
            "routing_verl_sibling_pairs_same": verl_same,
        }
        for s in range(self.n):
            out[f"routing_requests_s{s}"] = self.requests[s]
            out[f"routing_tokens_s{s}"] = self.tokens[s]
            out[f"routing_verl_requests_s{s}"] = self.verl_requests[s]
            out[f"routing_verl_tokens_s{s}"] = self.verl_tokens[s]
        self._reset_counts()
        return out


def _spread(values: Sequence[int]) -> float | None:
    """max / mean of per-server loads (1.0 = even); None when nothing was served."""
    total = sum(values)
    return None if total <= 0 else max(values) / (total / len(values))


def routing_metrics(counts: Mapping[str, int]) -> dict[str, float]:
    """``rollout/routing/*`` of one step's summed counts ({} without routing counts).

    ``sibling_same_engine``: share of sibling pairs (two samples of one prompt) served by one server, ours;
    ``verl_sibling_same_engine``: the same for verl's least-assigned routing replayed on the same requests;
    ``load_spread_tokens`` / ``verl_load_spread_tokens``: max / mean response tokens per server;
    ``load_spread_requests`` / ``verl_load_spread_requests``: the same for requests.
    """
    if not counts.get("routing_requests"):
        return {}
    out: dict[str, float] = {PREFIX + "requests": float(counts["routing_requests"])}
    pairs = counts.get("routing_sibling_pairs", 0)
    if pairs:
        out[PREFIX + "sibling_same_engine"] = counts.get("routing_sibling_pairs_same", 0) / pairs
        out[PREFIX + "verl_sibling_same_engine"] = counts.get("routing_verl_sibling_pairs_same", 0) / pairs
    servers = sorted({int(k.rsplit("_s", 1)[1]) for k in counts if k.startswith("routing_requests_s")})
    for name, prefix in (("load_spread_tokens", "routing_tokens_s"), ("load_spread_requests", "routing_requests_s"),
                         ("verl_load_spread_tokens", "routing_verl_tokens_s"),
                         ("verl_load_spread_requests", "routing_verl_requests_s")):
        spread = _spread([counts.get(f"{prefix}{s}", 0) for s in servers])
        if spread is not None:
            out[PREFIX + name] = spread
    return out
