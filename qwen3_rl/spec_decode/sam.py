"""Suffix-automaton (SAM) drafter for speculative decoding, per request or group-aware.

Each running request owns a string (prompt + accepted tokens; rejected draft tokens never enter)
inside an online generalized suffix automaton. After every appended token the automaton yields the
longest suffix of the request's text that also ends at an earlier place, and ``propose`` returns up
to ``k`` tokens that followed that earlier occurrence. Occurrence rule (measured, see
docs/sam_decoding.md): the most recent one (``rule="recent"``) with a bounded update walk, or the
earliest one (``rule="earliest"``).

Group-aware mode (``group_mode=True``): requests with the same ``group_id`` (GRPO samples of one
prompt) share one automaton, so a request also drafts from its running siblings; finished responses
enter a bounded two-generation cache automaton that every request matches against.

All per-token state lives in numpy int32 arrays inside numba typed lists (see ``_sam_kernels``); a
decode step for a whole batch is one ``extend`` call plus one ``propose`` call into numba.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import types
from numba.typed import List

from qwen3_rl.spec_decode import _sam_kernels as K

_I32 = types.int32[::1]


def group_key(prompt_ids: Sequence[int] | np.ndarray) -> str:
    """Group id of a request from its prompt token ids (GRPO samples of a prompt share it).

    Args:
        prompt_ids: prompt token ids, shape [prompt_len].
    Returns:
        hex digest (32 chars) of the int32 token bytes.
    """
    arr = np.ascontiguousarray(np.asarray(prompt_ids, dtype=np.int32))
    return hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class SamConfig:
    """Switches and sizes of the SAM drafter (all counts in tokens unless said otherwise).

    Attributes:
        num_speculative_tokens: default k for ``propose``.
        rule: "recent" (most recent earlier occurrence) or "earliest".
        recent_budget: suffix-link ancestors re-pointed to the newest occurrence per appended token
            (bounds the update cost; only used by rule "recent").
        min_match: shortest suffix match (tokens) that may produce a draft.
        group_mode: share one automaton among requests of the same group and use the cache.
        cache_max_responses: responses per cache generation (0 disables the cache; <= 127).
        cache_max_tokens: tokens per cache generation; two generations are kept at most.
        resync: tokens re-fed to a request's cache pointer when a new cache generation starts.
    """

    num_speculative_tokens: int = 3
    rule: str = "recent"
    recent_budget: int = 32
    min_match: int = 1
    group_mode: bool = False
    cache_max_responses: int = 64
    cache_max_tokens: int = 131072
    resync: int = 32

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.rule not in ("recent", "earliest"):
            raise ValueError(f"rule must be 'recent' or 'earliest', got {self.rule!r}")
        if self.recent_budget < 0 or self.min_match < 1 or self.resync < 0:
            raise ValueError("recent_budget >= 0, min_match >= 1 and resync >= 0 are required")
        if not 0 <= self.cache_max_responses <= K.MAX_STRINGS:
            raise ValueError(f"cache_max_responses must be in [0, {K.MAX_STRINGS}]")
        if self.cache_max_tokens < 1:
            raise ValueError("cache_max_tokens must be >= 1")

    @property
    def budget(self) -> int:
        return 0 if self.rule == "earliest" else self.recent_budget


@dataclass
class _Req:
    slot: int
    auto: int
    group: str
    prompt_len: int
    paused: bool = False


@dataclass
class _Auto:
    strings: list[int] = field(default_factory=list)
    live: int = 0  # running requests in it
    tokens: int = 0  # tokens of cached responses (cache automata)


class SamProposer:
    """Suffix-automaton drafter over many requests (vLLM ``NgramProposer``-like, batch oriented).

    Lifecycle: ``add_request`` -> ``extend`` (accepted tokens, any number per step) / ``propose``
    -> optional ``preempt`` / ``resume`` -> ``finish`` or ``abort``. Memory of a request is freed
    at finish (group mode: when the last member of its group finishes); ``nbytes()`` counts the
    bytes of all arrays held.
    """

    def __init__(self, config: SamConfig | None = None, **overrides: object) -> None:
        cfg = config or SamConfig()
        if overrides:
            cfg = SamConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        self._stats = np.zeros(1, np.int64)
        self._A = [List.empty_list(_I32) for _ in range(9)]  # AL AK AP AF AET AEG AEN ARK ARV
        self._ATOK = List.empty_list(_I32)
        self._acap = 0
        self._scap = 0
        self._grow_autos(8)
        self._grow_strings(16)
        self._free_autos: list[int] = []
        self._free_strings: list[int] = []
        self._autos: dict[int, _Auto] = {}
        self._reqs: dict[str, _Req] = {}
        self._groups: dict[str, int] = {}
        self._cache_auto = np.full(2, -1, np.int32)  # [old, current]
        self._cache_stamp = np.zeros(2, np.int64)
        self._next_stamp = 1
        self._out = np.zeros((0, cfg.num_speculative_tokens), np.int32)
        self._out_n = np.zeros(0, np.int32)
        self._empty_i32 = np.zeros(0, np.int32)

    # ------------------------------------------------------------------ slot tables (metadata)
    def _grow_autos(self, n: int) -> None:
        old = self._acap
        if n <= old:
            return
        for lst in self._A:
            for _ in range(n - old):
                lst.append(np.zeros(0, np.int32))

        def ext(arr: np.ndarray | None, shape: tuple[int, ...], dtype: type, fill: int) -> np.ndarray:
            new = np.full(shape, fill, dtype)
            if arr is not None:
                new[: arr.shape[0]] = arr
            return new

        self._a_nst = ext(getattr(self, "_a_nst", None), (n,), np.int64, 0)
        self._a_ne = ext(getattr(self, "_a_ne", None), (n,), np.int64, 0)
        self._a_rn = ext(getattr(self, "_a_rn", None), (n,), np.int64, 0)
        self._auto_str = ext(getattr(self, "_auto_str", None), (n, K.MAX_STRINGS + 1), np.int32, -1)
        self._acap = n

    def _grow_strings(self, n: int) -> None:
        old = self._scap
        if n <= old:
            return
        for _ in range(n - old):
            self._ATOK.append(np.zeros(0, np.int32))

        def ext(arr: np.ndarray | None, shape: tuple[int, ...], dtype: type, fill: int) -> np.ndarray:
            new = np.full(shape, fill, dtype)
            if arr is not None:
                new[: arr.shape[0]] = arr
            return new

        self._s_len = ext(getattr(self, "_s_len", None), (n,), np.int64, 0)
        self._s_last = ext(getattr(self, "_s_last", None), (n,), np.int32, 0)
        self._s_auto = ext(getattr(self, "_s_auto", None), (n,), np.int32, -1)
        self._s_local = ext(getattr(self, "_s_local", None), (n,), np.int32, 0)
        self._s_cand = ext(getattr(self, "_s_cand", None), (n, 2), np.int32, -1)
        self._cp = ext(getattr(self, "_cp", None), (n, 2, 2), np.int32, 0)
        self._cp_stamp = ext(getattr(self, "_cp_stamp", None), (n, 2), np.int64, -1)
        self._scap = n

    def _new_auto(self) -> int:
        if not self._free_autos:
            old = self._acap
            self._grow_autos(max(8, old * 2))
            self._free_autos.extend(range(self._acap - 1, old - 1, -1))
        a = self._free_autos.pop()
        AL, AK, AP, AF = self._A[:4]
        AL[a] = np.zeros(1, np.int32)
        AK[a] = np.full(1, -1, np.int32)
        AP[a] = np.full(1, -1, np.int32)
        AF[a] = np.full(1, -1, np.int32)
        self._stats[0] += 16
        self._a_nst[a] = 1
        self._a_ne[a] = 0
        self._a_rn[a] = 0
        self._auto_str[a, :] = -1
        self._autos[a] = _Auto()
        return a

    def _new_string(self, a: int) -> int:
        auto = self._autos[a]
        if len(auto.strings) >= K.MAX_STRINGS:
            raise RuntimeError("automaton full")
        if not self._free_strings:
            old = self._scap
            self._grow_strings(max(16, old * 2))
            self._free_strings.extend(range(self._scap - 1, old - 1, -1))
        s = self._free_strings.pop()
        local = len(auto.strings)
        auto.strings.append(s)
        self._auto_str[a, local] = s
        self._s_len[s] = 0
        self._s_last[s] = 0
        self._s_auto[s] = a
        self._s_local[s] = local
        self._s_cand[s] = (0, -1)
        self._cp[s] = 0
        self._cp_stamp[s] = -1
        return s

    def _free_auto(self, a: int) -> None:
        auto = self._autos.pop(a)
        freed = 0
        for lst in self._A:
            freed += lst[a].nbytes
            lst[a] = self._empty_i32
        for s in auto.strings:
            freed += self._ATOK[s].nbytes
            self._ATOK[s] = self._empty_i32
            self._s_len[s] = 0
            self._s_auto[s] = -1
            self._free_strings.append(s)
        self._stats[0] -= freed
        self._a_nst[a] = 0
        self._a_ne[a] = 0
        self._a_rn[a] = 0
        self._auto_str[a, :] = -1
        self._free_autos.append(a)

    # --------------------------------------------------------------------------- kernels
    def _kernel_extend(self, slots: np.ndarray, toks: np.ndarray, offs: np.ndarray, complete: bool = False
                       ) -> None:
        cfg = self.config
        use_cache = cfg.group_mode and cfg.cache_max_responses > 0
        cache_auto = self._cache_auto if use_cache else np.full(2, -1, np.int32)
        K.extend_batch(slots, toks, offs, cfg.budget, cfg.resync, *self._A, self._a_nst, self._a_ne, self._a_rn,
                       self._ATOK, self._s_len, self._s_last, self._s_auto, self._s_local, self._s_cand,
                       self._auto_str, cache_auto, self._cache_stamp, self._cp, self._cp_stamp, self._stats,
                       complete)

    def _append_string(self, s: int, toks: np.ndarray, complete: bool = False) -> None:
        offs = np.array([0, toks.shape[0]], np.int64)
        if toks.shape[0] + self._s_len[s] >= K.MAX_STRING_LEN:
            raise ValueError(f"string longer than {K.MAX_STRING_LEN} tokens")
        self._kernel_extend(np.array([s], np.int32), toks, offs, complete)

    # --------------------------------------------------------------------------- public API
    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._reqs

    def add_request(self, req_id: str, prompt_ids: Sequence[int] | np.ndarray, group_id: str | None = None) -> None:
        """Start drafting for a request from its prompt (shape [prompt_len] token ids).

        In group mode, requests with the same ``group_id`` (default: ``group_key(prompt_ids)``) share
        an automaton; otherwise ``group_id`` is ignored.
        """
        if req_id in self._reqs:
            raise KeyError(f"request {req_id!r} already added")
        prompt = np.ascontiguousarray(np.asarray(prompt_ids, dtype=np.int32))
        if prompt.size and int(prompt.min()) < 0:
            raise ValueError("token ids must be >= 0")
        if self.config.group_mode:
            g = group_id if group_id is not None else group_key(prompt)
            a = self._groups.get(g, -1)
            if a < 0 or len(self._autos[a].strings) >= K.MAX_STRINGS:
                a = self._new_auto()
                self._groups[g] = a
        else:
            g = ""
            a = self._new_auto()
        s = self._new_string(a)
        self._autos[a].live += 1
        self._reqs[req_id] = _Req(slot=s, auto=a, group=g, prompt_len=int(prompt.shape[0]))
        self._append_string(s, prompt)

    def extend(self, req_id: str, accepted_ids: Sequence[int] | np.ndarray) -> None:
        """Append the accepted tokens (incl. the bonus token) of one request: shape [n_accepted]."""
        self.extend_batch([req_id], [accepted_ids])

    def extend_batch(self, req_ids: Sequence[str], accepted: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Append accepted tokens of many requests in one numba call (one decode step)."""
        n = len(req_ids)
        slots = np.empty(n, np.int32)
        lens = np.zeros(n + 1, np.int64)
        reqs = self._reqs
        for i, r in enumerate(req_ids):
            slots[i] = reqs[r].slot
            lens[i + 1] = len(accepted[i])
        offs = np.cumsum(lens)
        if n and int((self._s_len[slots] + lens[1:]).max()) >= K.MAX_STRING_LEN:
            raise ValueError(f"string longer than {K.MAX_STRING_LEN} tokens")
        toks = np.fromiter((t for seq in accepted for t in seq), np.int32, int(offs[-1])) if offs[-1] else \
            self._empty_i32
        self._kernel_extend(slots, toks, offs)

    def extend_arrays(self, slots: np.ndarray, toks: np.ndarray, offs: np.ndarray) -> None:
        """Array form of ``extend_batch``: slots int32[n] (``slot_of``), toks int32[total], offs int64[n+1]."""
        self._kernel_extend(slots, toks, offs)

    def slot_of(self, req_id: str) -> int:
        return self._reqs[req_id].slot

    def propose_arrays(self, slots: np.ndarray, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for string slots int32[n]: returns (tokens int32[n, k], counts int32[n]) (views, reused)."""
        k = k or self.config.num_speculative_tokens
        n = slots.shape[0]
        if self._out.shape[0] < n or self._out.shape[1] != k:
            self._out = np.zeros((max(n, 16), k), np.int32)
            self._out_n = np.zeros(max(n, 16), np.int32)
        cfg = self.config
        use_cache = cfg.group_mode and cfg.cache_max_responses > 0
        AL, AK, AP = self._A[:3]
        K.propose_batch(slots, k, cfg.min_match, use_cache, AL, AK, AP, self._s_auto, self._s_cand,
                        self._auto_str, self._s_len, self._ATOK, self._cache_auto, self._cache_stamp, self._cp,
                        self._cp_stamp, self._out, self._out_n)
        return self._out[:n], self._out_n[:n]

    def propose(self, req_ids: Sequence[str], k: int | None = None) -> list[list[int]]:
        """Up to ``k`` draft tokens per request (empty list = no draft)."""
        slots = np.fromiter((self._reqs[r].slot for r in req_ids), np.int32, len(req_ids))
        out, cnt = self.propose_arrays(slots, k)
        return [out[i, : cnt[i]].tolist() for i in range(len(req_ids))]

    def step(self, req_ids: Sequence[str], accepted: Sequence[Sequence[int]], k: int | None = None
             ) -> list[list[int]]:
        """One decode step: ``extend_batch`` then ``propose``."""
        self.extend_batch(req_ids, accepted)
        return self.propose(req_ids, k)

    def tokens(self, req_id: str) -> np.ndarray:
        """Copy of the request's text (prompt + accepted tokens), shape [len]."""
        s = self._reqs[req_id].slot
        return np.array(self._ATOK[s][: self._s_len[s]])

    def preempt(self, req_id: str) -> None:
        """Mark a request preempted; its automaton is kept so ``resume`` costs nothing."""
        self._reqs[req_id].paused = True

    def resume(self, req_id: str, token_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Resume a preempted request; ``token_ids`` = its full text (prompt + outputs) if known.

        Tokens beyond the stored text are appended; if the stored text is not a prefix of
        ``token_ids`` the request is rebuilt from them.
        """
        req = self._reqs[req_id]
        req.paused = False
        if token_ids is None:
            return
        full = np.asarray(token_ids, dtype=np.int32)
        have = self.tokens(req_id)
        if full.shape[0] >= have.shape[0] and np.array_equal(full[: have.shape[0]], have):
            if full.shape[0] > have.shape[0]:
                self.extend(req_id, full[have.shape[0]:])
            return
        group = req.group if self.config.group_mode else None
        plen = min(req.prompt_len, full.shape[0])
        self.abort(req_id)
        self.add_request(req_id, full[:plen], group_id=group)
        if full.shape[0] > plen:
            self.extend(req_id, full[plen:])

    def finish(self, req_id: str) -> None:
        """Request done: its response enters the cache (group mode) and its memory is released."""
        req = self._reqs[req_id]
        cfg = self.config
        if cfg.group_mode and cfg.cache_max_responses > 0:
            resp = self.tokens(req_id)[req.prompt_len:]
            if resp.shape[0]:
                self._cache_insert(resp)
        self._release(req_id)

    def abort(self, req_id: str) -> None:
        """Drop a request without caching its response."""
        self._release(req_id)

    def _release(self, req_id: str) -> None:
        req = self._reqs.pop(req_id)
        auto = self._autos[req.auto]
        auto.live -= 1
        if auto.live == 0:
            if self._groups.get(req.group, -1) == req.auto:
                del self._groups[req.group]
            self._free_auto(req.auto)

    def _cache_insert(self, resp: np.ndarray) -> None:
        cfg = self.config
        resp = resp[-cfg.cache_max_tokens:]
        cur = int(self._cache_auto[1])
        if cur >= 0:
            auto = self._autos[cur]
            if len(auto.strings) >= cfg.cache_max_responses or auto.tokens + resp.shape[0] > cfg.cache_max_tokens:
                cur = -1
        if cur < 0:
            old = int(self._cache_auto[0])
            if old >= 0:
                self._free_auto(old)
            self._cache_auto[0] = self._cache_auto[1]
            self._cache_stamp[0] = self._cache_stamp[1]
            cur = self._new_auto()
            self._cache_auto[1] = cur
            self._cache_stamp[1] = self._next_stamp
            self._next_stamp += 1
        s = self._new_string(cur)
        self._autos[cur].tokens += int(resp.shape[0])
        # cache strings do not follow the cache: append with the cache switched off for this call
        saved = self._cache_auto.copy()
        self._cache_auto[:] = -1
        try:
            self._append_string(s, resp, complete=True)
        finally:
            self._cache_auto[:] = saved

    def clear_cache(self) -> None:
        """Drop both cache generations."""
        for g in range(2):
            a = int(self._cache_auto[g])
            if a >= 0:
                self._free_auto(a)
            self._cache_auto[g] = -1
            self._cache_stamp[g] = 0

    def nbytes(self) -> int:
        """Bytes held by the per-token arrays (token buffers, states, edges, root hashes; capacity)."""
        return int(self._stats[0])

    def num_tokens(self) -> int:
        """Tokens held: running requests' texts, finished group members kept for siblings, cache."""
        live = self._s_auto[: self._scap] >= 0
        return int(self._s_len[: self._scap][live].sum())

    def cache_bound_tokens(self) -> int:
        """Upper bound of tokens held by the finished-response cache (two generations)."""
        return 2 * self.config.cache_max_tokens if self.config.group_mode and self.config.cache_max_responses else 0
