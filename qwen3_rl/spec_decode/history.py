"""Per-prompt history of finished responses for group-mode SAM drafting across rollout steps.

GRPO/DAPO revisit every prompt once per epoch (DAPO-Math-17K at 512 prompts a step: every 33 steps).
The group automaton of a prompt is freed when its last sample finishes; ``HistoryStore`` keeps the
prompt's finished responses (token ids only, 4 B per token), keyed by the group id (``group_key`` of
the prompt ids), so that the prompt's next group starts with them in its automaton
(``SamProposer.add_request``).

Bounds: at most ``per_prompt_responses`` responses and ``per_prompt_tokens`` tokens per prompt (the
oldest, or with reward weighting the lowest scored, leave first) and ``max_bytes`` in total over all
prompts (least recently used prompt evicted first; a prompt is "used" when its group is instantiated
or a response of it is added).

Default bound (``history_max_bytes = 0``, ``SAM_HISTORY_MAX_BYTES=0``): :data:`HOST_SHARE` of the host's physical
memory shared by the drafters on the host (:func:`resolve_max_bytes`): every rollout worker process holds its own
store; the launcher passes the rollout's processes per node as ``sam_config.history_drafters`` (features.toml
context ``ROLLOUT_PROCS_PER_NODE``). The store lives in host memory only (numpy arrays): it never
competes with the KV cache. An epoch of the 235B run needs about 2.4 GB per engine (4 responses of 7345 tokens of
the 256 prompt-samples a rank runs per step, 79 steps).

Reward weighting (optional, ``weighted``): ``score`` marks responses by content hash with a reward;
kept responses are ordered by score (highest last: the automaton's "most recent occurrence" rule then
prefers them) and the lowest-scored leave first.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def response_hash(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Content hash of a response (int32 token ids), 16 bytes."""
    arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int32))
    return hashlib.blake2b(arr.tobytes(), digest_size=16).digest()


@dataclass
class _Entry:
    tokens: np.ndarray  # int32[n]
    digest: bytes
    score: float = 0.0
    serial: int = 0  # insertion order


#: share of the host's physical memory the SAM history stores of all drafters on the host may hold together
HOST_SHARE = 0.25


def host_memory_bytes() -> int:
    """Physical memory of this host (bytes)."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def resolve_max_bytes(configured: int, host_bytes: int | None = None, drafters: int = 1) -> tuple[int, str]:
    """The store bound (bytes) and a line saying where it comes from: ``configured`` when > 0, else
    ``HOST_SHARE * host_bytes / drafters`` (``host_bytes`` default: this host's memory; ``drafters``: the drafter
    processes on the host, ``sam_config.history_drafters``)."""
    if configured > 0:
        return configured, f"SAM history: store bound {configured / 2**30:.2f} GiB (history_max_bytes)"
    host = host_memory_bytes() if host_bytes is None else host_bytes
    n = max(1, drafters)
    bound = max(1, int(host * HOST_SHARE) // n)
    return bound, (f"SAM history: store bound {bound / 2**30:.2f} GiB of host memory per drafter "
                   f"({HOST_SHARE:.0%} of {host / 2**30:.1f} GiB over {n} drafter(s) on this host)")


ENTRY_OVERHEAD = 64  # bytes counted per kept response (digest, score, bookkeeping) besides its tokens


class HistoryStore:
    """Finished responses per prompt, bounded per prompt and in total bytes, LRU over prompts.

    Args:
        per_prompt_responses: responses kept per prompt (>= 1).
        per_prompt_tokens: tokens kept per prompt (a longer response keeps its last tokens).
        max_bytes: bound of the whole store (token bytes + ``ENTRY_OVERHEAD`` per response).
        weighted: order and evict by reward score (``score``) instead of age.
    """

    def __init__(self, per_prompt_responses: int, per_prompt_tokens: int, max_bytes: int,
                 weighted: bool = False) -> None:
        if per_prompt_responses < 1 or per_prompt_tokens < 1 or max_bytes < 1:
            raise ValueError("history bounds must be >= 1")
        self.per_prompt_responses = per_prompt_responses
        self.per_prompt_tokens = per_prompt_tokens
        self.max_bytes = max_bytes
        self.weighted = weighted
        self._d: OrderedDict[str, list[_Entry]] = OrderedDict()
        self._bytes = 0
        self._tokens = 0
        self._serial = 0
        self.evicted_prompts = 0

    @staticmethod
    def _entry_bytes(e: _Entry) -> int:
        return int(e.tokens.nbytes) + ENTRY_OVERHEAD

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, group: str) -> bool:
        return group in self._d

    def nbytes(self) -> int:
        """Bytes counted against ``max_bytes`` (tokens + per-response overhead)."""
        return self._bytes

    def num_tokens(self) -> int:
        return self._tokens

    def num_responses(self, group: str | None = None) -> int:
        if group is not None:
            return len(self._d.get(group, ()))
        return sum(len(v) for v in self._d.values())

    def _drop(self, group: str, i: int) -> None:
        e = self._d[group].pop(i)
        self._bytes -= self._entry_bytes(e)
        self._tokens -= int(e.tokens.shape[0])

    def _victim(self, lst: list[_Entry]) -> int:
        """Index of the response to drop first within a prompt: oldest, or lowest score then oldest."""
        if not self.weighted:
            return 0
        return min(range(len(lst)), key=lambda i: (lst[i].score, lst[i].serial))

    def add(self, group: str, tokens: np.ndarray) -> None:
        """Keep a finished response (int32[n], response tokens only) of prompt ``group``."""
        toks = np.array(tokens[-self.per_prompt_tokens:], dtype=np.int32)  # a copy the store owns
        if not toks.shape[0]:
            return
        self._serial += 1
        e = _Entry(toks, response_hash(tokens), 0.0, self._serial)
        lst = self._d.setdefault(group, [])
        self._d.move_to_end(group)
        lst.append(e)
        self._bytes += self._entry_bytes(e)
        self._tokens += int(toks.shape[0])
        while len(lst) > self.per_prompt_responses or sum(x.tokens.shape[0] for x in lst) > self.per_prompt_tokens:
            self._drop(group, self._victim(lst))
        while self._bytes > self.max_bytes and self._d:
            old, olst = next(iter(self._d.items()))
            while olst:
                self._drop(old, len(olst) - 1)
            del self._d[old]
            self.evicted_prompts += 1

    def get(self, group: str) -> list[np.ndarray]:
        """The prompt's kept responses in drafting order (oldest, or lowest score, first); marks it used."""
        lst = self._d.get(group)
        if not lst:
            return []
        self._d.move_to_end(group)
        order = sorted(lst, key=lambda e: (e.score, e.serial)) if self.weighted else lst
        return [e.tokens for e in order]

    def score(self, group: str, responses: Sequence[Sequence[int] | np.ndarray], scores: Sequence[float]) -> int:
        """Reward hook: mark the kept responses of ``group`` equal to ``responses[i]`` with ``scores[i]``.

        Returns the number of kept responses marked (responses not held are ignored).
        """
        lst = self._d.get(group)
        if not lst:
            return 0
        by_hash = {response_hash(r): float(s) for r, s in zip(responses, scores, strict=True)}
        n = 0
        for e in lst:
            s = by_hash.get(e.digest)
            if s is not None:
                e.score = s
                n += 1
        return n

    def clear(self) -> None:
        self._d.clear()
        self._bytes = 0
        self._tokens = 0
