"""Group routing for verl's server rollout: a prompt's samples go to one vLLM engine.

verl 0.6.1's agent loop sends every sample as its own request (its own request id) through
``AsyncLLMServerManager._choose_server`` (``verl/experimental/agent_loop/agent_loop.py:78-88``): sticky per
request id, otherwise the server with the fewest requests assigned so far. A prompt's ``n`` samples therefore
spread over the servers, and inside a server with vLLM DP > 1 vLLM's DP balancer spreads them again. The SAM
drafter's group mode (siblings drafting from each other's tokens) and its history (a prompt's earlier responses)
see only the part of the group that landed on their engine.

:class:`GroupRouter` chooses a *target*, one engine: a (server, vLLM DP rank) pair, ``servers x dp`` of them. It
keys each request by its prompt (:func:`prompt_key`, the same digest as the SAM drafter's ``group_key``):

* siblings (the same key within one generation batch) follow the first sample's target;
* the first sample of a batch goes, among the targets whose requests in flight are within ``slack`` of the least
  busy one, to the target the key ranks highest (rendezvous hashing, :func:`_rank`). The same prompt in a later
  batch thus returns to the same engine (the one holding its history) whenever that engine is not overloaded,
  also when another agent-loop worker (another router, which cannot see this one's state) places it;
* verl's own policy is replayed on the same requests (:class:`VerlLeastAssigned`, never used to route), so one
  run reports both: the share of sibling pairs on one engine and the load spread over engines.

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
#: request ids verl 0.6.1's ``AsyncLLMServerManager`` remembers (its LRU's ``max_cache_size``)
VERL_MAX_CACHE_SIZE = 10_000


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A prompt's group key: blake2b-128 hex of its token ids as int32 (equals ``sam.group_key``)."""
    return hashlib.blake2b(array("i", [int(t) for t in prompt_ids]).tobytes(), digest_size=16).hexdigest()


def _rank(key: str, target: int) -> int:
    """Rendezvous weight of ``target`` for ``key`` (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(f"{key}/{target}".encode(), digest_size=8).digest(), "big")


class VerlLeastAssigned:
    """verl 0.6.1's engine choice, replayed: the server sticky per request id, else the one with the fewest
    requests assigned so far (ties: the lowest index; verl breaks them by a heap over shuffled servers, which does
    not change the spread); inside a server with vLLM DP > 1, vLLM's DP balancer (the least loaded engine,
    ``vllm/v1/engine/core_client.py:1211``), replayed as the engine with the fewest requests assigned (all of a
    batch arrive before any finishes). Returns the engine index ``server * dp + dp_rank``.

    The request ids are remembered as verl's ``AsyncLLMServerManager`` remembers them: an LRU of ``max_ids``
    (verl's ``max_cache_size``, 10000), so the replay stays sticky for a request sent again under its id (a
    resumed partial rollout) and its memory stays bounded."""

    def __init__(self, n_servers: int, dp: int = 1, max_ids: int = VERL_MAX_CACHE_SIZE) -> None:
        self.dp = dp
        self.assigned = [0] * n_servers
        self.engine_assigned = [0] * (n_servers * dp)
        self.max_ids = max_ids
        self.by_request: OrderedDict[str, int] = OrderedDict()

    def choose(self, request_id: str) -> int:
        if request_id in self.by_request:
            self.by_request.move_to_end(request_id)
            return self.by_request[request_id]
        i = min(range(len(self.assigned)), key=lambda s: self.assigned[s])
        self.assigned[i] += 1
        engine = min(range(i * self.dp, (i + 1) * self.dp), key=lambda e: self.engine_assigned[e])
        self.engine_assigned[engine] += 1
        self.by_request[request_id] = engine
        while len(self.by_request) > self.max_ids:
            self.by_request.popitem(last=False)
        return engine


class GroupRouter:
    """Chooses an engine (target index ``server * dp + dp_rank``) per request so that a prompt's requests share it.

    Args:
        n_servers: servers (indices in a fixed order every router agrees on).
        dp: vLLM DP ranks per server (1: the server's engine is one).
        slack: requests in flight a prompt's preferred engine may exceed the least busy one by and still get it.
        max_keys: prompts remembered (least recently used forgotten first); a forgotten prompt is placed anew.
    """

    def __init__(self, n_servers: int, dp: int = 1, slack: int = 0, max_keys: int = 100_000) -> None:
        if n_servers < 1 or dp < 1:
            raise ValueError(f"group routing needs at least one server and DP rank, got {n_servers} x {dp}")
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.n_servers, self.dp, self.n = n_servers, dp, n_servers * dp
        self.slack, self.max_keys = slack, max_keys
        self.target_of_key: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (target, batch)
        self.in_flight = [0] * self.n
        self.batch = 0
        self.shadow = VerlLeastAssigned(n_servers, dp)
        self._placed: dict[Hashable, tuple[str, int, int]] = {}  # request id -> (key, target, verl's server)
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.requests: Counter[int] = Counter()
        self.tokens: Counter[int] = Counter()
        self.verl_requests: Counter[int] = Counter()
        self.verl_tokens: Counter[int] = Counter()
        self.groups: dict[str, tuple[Counter[int], Counter[int]]] = {}
        self.revisits = self.revisits_same = 0

    def _place(self, key: str) -> int:
        floor = min(self.in_flight) + self.slack
        return max((t for t in range(self.n) if self.in_flight[t] <= floor), key=lambda t: _rank(key, t))

    def choose(self, request_id: str, prompt_ids: Sequence[int], resumed: bool = False) -> int:
        """The target index for this request: ``server = target // dp``, ``dp_rank = target % dp``.

        ``resumed``: the request continues one aborted at a weight sync (partial rollout) and ``prompt_ids`` is
        its original prompt, not the prompt plus its response so far: it goes back to its prompt's engine (its
        siblings'), whatever the batch, and counts as no new sample (no sibling pair, no revisit)."""
        if request_id in self._placed:  # verl's stickiness per request id (multi-turn): keep it
            return self._placed[request_id][1]
        key = prompt_key(prompt_ids)
        seen = self.target_of_key.get(key)
        if resumed:
            target = seen[0] if seen is not None else self._place(key)
            self.target_of_key[key] = (target, seen[1] if seen is not None else self.batch)
            self.target_of_key.move_to_end(key)
            verl = self.shadow.choose(request_id)
            self._placed[request_id] = (key, target, verl)
            self.in_flight[target] += 1
            self.requests[target] += 1
            self.verl_requests[verl] += 1
            return target
        if seen is not None and seen[1] == self.batch:  # a sibling
            target = seen[0]
        else:
            target = self._place(key)
            if seen is not None:  # the prompt's later visit: back on the engine that served it?
                self.revisits += 1
                self.revisits_same += int(target == seen[0])
        self.target_of_key[key] = (target, self.batch)
        self.target_of_key.move_to_end(key)
        while len(self.target_of_key) > self.max_keys:
            self.target_of_key.popitem(last=False)
        verl = self.shadow.choose(request_id)
        self._placed[request_id] = (key, target, verl)
        self.in_flight[target] += 1
        self.requests[target] += 1
        self.verl_requests[verl] += 1
        ours, theirs = self.groups.setdefault(key, (Counter(), Counter()))
        ours[target] += 1
        theirs[verl] += 1
        return target

    def place(self, request_id: str, target: int) -> None:
        """A request placed on ``target`` by its caller (a later turn of a multi-turn request on its first turn's
        engine): in flight there until :meth:`done`, counted as a request but not as a new sample (no sibling pair,
        no revisit)."""
        if not 0 <= target < self.n:
            raise ValueError(f"target {target} out of range: {self.n} targets")
        if request_id in self._placed:
            return
        verl = self.shadow.choose(request_id)
        self._placed[request_id] = ("", target, verl)
        self.in_flight[target] += 1
        self.requests[target] += 1
        self.verl_requests[verl] += 1

    def verl_engine(self, request_id: str) -> int:
        """The engine verl's replayed routing gave a request that is still in flight."""
        return self._placed[request_id][2]

    def done(self, request_id: str, response_tokens: int) -> None:
        """A request finished with ``response_tokens`` generated tokens (load accounting)."""
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return
        _, target, verl = placed
        self.in_flight[target] -= 1
        self.tokens[target] += int(response_tokens)
        self.verl_tokens[verl] += int(response_tokens)

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call (then reset; the next requests are a new generation batch): requests,
        sibling pairs and those on one engine (ours; verl's on one server), a prompt's visits from an earlier batch
        and those back on their engine, and per engine (``_s<target>``, ours and ``_verl_``) the requests and
        response tokens."""
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
            "routing_revisits": self.revisits,
            "routing_revisits_same": self.revisits_same,
        }
        for t in range(self.n):
            out[f"routing_requests_s{t}"] = self.requests[t]
            out[f"routing_tokens_s{t}"] = self.tokens[t]
            out[f"routing_verl_requests_s{t}"] = self.verl_requests[t]
            out[f"routing_verl_tokens_s{t}"] = self.verl_tokens[t]
        self._reset_counts()
        self.batch += 1
        return out


def _spread(values: Sequence[int]) -> float | None:
    """max / mean of per-engine loads (1.0 = even); None when nothing was served."""
    total = sum(values)
    return None if total <= 0 else max(values) / (total / len(values))


def routing_metrics(counts: Mapping[str, int]) -> dict[str, float]:
    """``rollout/routing/*`` of one step's summed counts ({} without routing counts).

    ``sibling_same_engine``: share of sibling pairs (two samples of one prompt) served by one engine, ours;
    ``verl_sibling_same_engine``: the same for verl's routing (and vLLM's DP balancer) replayed on the same requests;
    ``history_same_engine``: share of a prompt's visits from an earlier batch that went back to its engine;
    ``load_spread_tokens`` / ``verl_load_spread_tokens``: max / mean response tokens per engine;
    ``load_spread_requests`` / ``verl_load_spread_requests``: the same for requests.
    """
    if not counts.get("routing_requests"):
        return {}
    out: dict[str, float] = {PREFIX + "requests": float(counts["routing_requests"])}
    pairs = counts.get("routing_sibling_pairs", 0)
    if pairs:
        out[PREFIX + "sibling_same_engine"] = counts.get("routing_sibling_pairs_same", 0) / pairs
        out[PREFIX + "verl_sibling_same_engine"] = counts.get("routing_verl_sibling_pairs_same", 0) / pairs
    if counts.get("routing_revisits"):
        out[PREFIX + "history_same_engine"] = counts.get("routing_revisits_same", 0) / counts["routing_revisits"]

    def indices(prefix: str) -> list[int]:
        return sorted({int(k[len(prefix):]) for k in counts if k.startswith(prefix) and k[len(prefix):].isdigit()})

    for name, prefix in (("load_spread_tokens", "routing_tokens_s"), ("load_spread_requests", "routing_requests_s"),
                         ("verl_load_spread_tokens", "routing_verl_tokens_s"),
                         ("verl_load_spread_requests", "routing_verl_requests_s")):
        spread = _spread([counts.get(f"{prefix}{s}", 0) for s in indices(prefix)])
        if spread is not None:
            out[PREFIX + name] = spread
    return out
