"""Suffix-automaton (SAM) drafter for speculative decoding, per request or group-aware.

Each running request owns a string (prompt + accepted tokens; rejected draft tokens never enter)
inside an online generalized suffix automaton. After every appended token the automaton yields the
longest suffix of the request's text that also ends at an earlier place, and ``propose`` returns up
to ``k`` tokens that followed that earlier occurrence. Occurrence rule (measured, see
docs/sam_decoding.md): the most recent one (``rule="recent"``) with a bounded update walk, or the
earliest one (``rule="earliest"``).

Group-aware mode (``group_mode=True``): requests with the same ``group_id`` (GRPO samples of one
prompt) share one automaton, so a request also drafts from its running siblings; finished responses
enter one bounded cache automaton that every request matches against (one match pointer each).

All per-token state lives in numpy int32 record arrays owned here and reached by the numba kernels
through an address table (see ``_sam_kernels``); a decode step for a whole batch is one kernel call
(``step_arrays``), or one ``extend_arrays`` plus one ``propose_arrays`` call (what the runner does).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from qwen3_rl.spec_decode import _sam_kernels as K
from qwen3_rl.spec_decode.history import HistoryStore, resolve_max_bytes


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
    """The SAM drafter's one configuration (all counts in tokens unless said otherwise).

    Engine form: ``speculative_config={"method": "sam", "num_speculative_tokens": k, "sam_config": {...}}``;
    the keys of ``sam_config`` are this class's fields except ``num_speculative_tokens``
    (``config.SAM_OPTIONS``, parsed by ``config.parse_sam_options``). All fields are optional.

    Attributes:
        num_speculative_tokens: k, the default draft length of ``propose``.
        rule: "recent" (most recent earlier occurrence) or "earliest" as the continuation.
        recent_budget: suffix-link ancestors re-pointed to the newest occurrence per appended token
            (bounds the update cost; only used by rule "recent").
        min_match: shortest suffix match (tokens) that may produce a draft.
        group_mode: GRPO samples of one prompt (same ``group_id``: the prompt token ids) share one
            automaton, and finished responses enter a bounded cache (docs/sam_decoding.md).
        cache_max_responses: responses kept after a cache rebuild; the cache holds at most
            ``min(2 * cache_max_responses, 127)`` (0 disables the cache; <= 127).
        cache_max_tokens: tokens kept after a cache rebuild; the cache holds at most twice this.
        resync: tokens re-fed to a request's cache pointer after the cache was rebuilt.
        pad_drafts: (runner) pad every draft to exactly k tokens (repeating its last token) so that each
            pure-decode step has query length 1 + k, the only shape a FULL_DECODE_ONLY graph (needed by
            npugraph_ex) replays; padded tokens are verified like any draft token.
        group_exchange: (runner) share the siblings' accepted tokens among the vLLM DP ranks (group mode
            across ranks when data rebalance spreads a prompt's samples; needs group_mode and vLLM DP > 1;
            ``sibling_exchange.py``).
        exchange_every: engine steps between two exchanges (>= 1).
        exchange_max_bytes: cap of one rank's message per exchange (bytes, >= 24; the oldest tokens of the
            longest pending ranges are dropped first).
        exchange_max_siblings: remote siblings kept per group automaton (shadow strings; 0 = all). Each
            kept sibling costs its whole text in host memory and its new tokens in every merge; 7 = the
            measured configuration (8 samples per prompt, docs/sam_decoding.md).
        exchange_max_shadow_tokens: bound of the tokens held in shadow strings (beyond it, remote tokens
            are skipped).
        history_responses: group mode: finished responses kept per prompt across rollout steps (0 = no
            history); a new group of the prompt starts with them in its automaton (``history.py``).
        history_prompt_tokens: tokens kept per prompt in the history.
        history_max_bytes: bound of the whole history store (bytes; least recently used prompts leave); 0 = from
            the host's memory and the drafters on it (``history.resolve_max_bytes``).
        history_drafters: drafter processes on this host sharing that default bound (the launcher passes the
            rollout's processes per node).
        adaptive_k: (runner) choose each request's draft length per step, <= ``num_speculative_tokens``
            (then k_max), from a verification cost model and the recent acceptance (``adaptive_k.py``).
        adaptive_k_min: floor of an adaptive draft length (1 <= it <= k_max).
        verify_base_ms, verify_seq_ms, verify_token_ms, verify_kctx_ms: the cost model of one verification
            step (ms): base + per running sequence + per draft token + per 1000 context tokens.
        cost_table: measured verification step times that price the step instead of that model (adaptive k):
            ``FILE`` or ``FILE@SHAPE`` (``cost_table.py``); "" = the linear model.
    """

    num_speculative_tokens: int = 3
    rule: str = "recent"
    recent_budget: int = 1
    min_match: int = 1
    group_mode: bool = False
    cache_max_responses: int = 64
    cache_max_tokens: int = 131072
    resync: int = 32
    pad_drafts: bool = False
    group_exchange: bool = False
    exchange_every: int = 1
    exchange_max_bytes: int = 16384
    exchange_max_siblings: int = 7
    exchange_max_shadow_tokens: int = 1 << 25
    history_responses: int = 0
    history_prompt_tokens: int = 1 << 17
    history_max_bytes: int = 0
    history_drafters: int = 1
    adaptive_k: bool = False
    adaptive_k_min: int = 1
    verify_base_ms: float = 59.64
    verify_seq_ms: float = 0.3614
    verify_token_ms: float = 0.0585
    verify_kctx_ms: float = 0.07064
    cost_table: str = ""

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
        if self.group_exchange and not self.group_mode:
            raise ValueError("group_exchange=True needs group_mode=True (the exchange feeds the siblings' tokens "
                             "into the group automata)")
        if self.exchange_every < 1:
            raise ValueError(f"exchange_every must be >= 1, got {self.exchange_every}")
        if self.exchange_max_siblings < 0 or self.exchange_max_shadow_tokens < 0:
            raise ValueError("exchange_max_siblings and exchange_max_shadow_tokens must be >= 0")
        if self.exchange_max_bytes < 24:
            raise ValueError(f"exchange_max_bytes must be >= 24, got {self.exchange_max_bytes}")
        if self.history_responses < 0 or self.history_prompt_tokens < 1 or self.history_max_bytes < 0:
            raise ValueError("history_responses >= 0, history_prompt_tokens >= 1 and history_max_bytes >= 0 "
                             "are required")
        if self.history_drafters < 1:
            raise ValueError(f"history_drafters must be >= 1, got {self.history_drafters}")
        if self.history_responses and not self.group_mode:
            raise ValueError("history_responses > 0 needs group_mode=True (the history feeds the group automata)")
        if not 1 <= self.adaptive_k_min <= self.num_speculative_tokens:
            raise ValueError(f"adaptive_k_min must be in [1, num_speculative_tokens={self.num_speculative_tokens}]"
                             f", got {self.adaptive_k_min}")
        if self.cost_table and not self.adaptive_k:
            raise ValueError("cost_table prices the adaptive draft length: it needs adaptive_k=True")
        costs = (self.verify_base_ms, self.verify_seq_ms, self.verify_token_ms, self.verify_kctx_ms)
        if not all(c >= 0 for c in costs) or self.verify_base_ms + self.verify_token_ms <= 0:
            raise ValueError("verify_*_ms must be >= 0 (and base + token > 0)")

    @property
    def budget(self) -> int:
        """Occurrence-update walk per appended token (0 = rule "earliest")."""
        return 0 if self.rule == "earliest" else self.recent_budget


@dataclass
class _Tuning:
    """Speed knobs and test hooks of one ``SamProposer`` (private: none changes a draft).

    Attributes:
        hub_degree: a lookup walking this many edges of a state indexes its transitions in the hub hash
            (one probe instead of a list walk; 0 = never).
        warm_lanes: interleaved read-only warm-up walks before a batch update (0 = off).
        warm_hops: suffix links the warm-up walks follow after each token.
        exact_growth: tests: grow arrays to exactly the size asked for (no slack) and skip the batch room
            precheck, so that the kernels' token-by-token room checks stop mid-batch.
        cache_fix_each: tests: fix cache pointers up before every token (the reference walk).
    """

    hub_degree: int = K.HUB_DEGREE
    warm_lanes: int = K.WARM_LANES
    warm_hops: int = K.WARM_HOPS
    exact_growth: bool = False
    cache_fix_each: bool = False

    def knobs(self, out: np.ndarray) -> np.ndarray:
        """The kernels' knob array (int64[``K.KNOB_COLS``], ``K.KN_*`` columns), written into ``out``."""
        out[K.KN_PRECHECK] = 0 if self.exact_growth else 1
        out[K.KN_WARM_LANES] = self.warm_lanes
        out[K.KN_WARM_HOPS] = self.warm_hops
        out[K.KN_CACHE_FIX_EACH] = int(self.cache_fix_each)
        return out


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
    prompt_len: int = 0  # group automata: tokens of the group's prompt (every string starts with it)
    group: str = ""  # group automata: the group id
    shadows: list[int] = field(default_factory=list)  # rows of its open shadow strings (shadow table)
    shadow_tokens: int = 0  # tokens of its closed (finished) shadow strings
    n_shadows: int = 0  # shadow strings ever opened in it


#: Gap marker inside shadow strings (never a vocabulary id); drafts are cut before it.
SEP = (1 << 31) - 1


_EMPTY = np.zeros(0, np.int32)
_REC = {K.G_STATES: K.SREC, K.G_EDGES: K.EREC, K.G_ROOT: K.RREC, K.G_HUB: K.HREC}
_COLS = {K.G_STATES: (K.A_S, K.A_SCAP, K.A_NST), K.G_EDGES: (K.A_E, K.A_ECAP, K.A_NE),
         K.G_ROOT: (K.A_R, K.A_RCAP, K.A_RN), K.G_HUB: (K.A_H, K.A_HCAP, K.A_HN)}
_HASHED = {K.G_ROOT: K.root_rehash, K.G_HUB: K.hub_rehash}


def drafts_to_lists(out: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """Rows of ``out`` (int32[n, k]) cut to ``counts`` (int32[n]) as Python lists (vLLM's draft format)."""
    return [row[:c] for row, c in zip(out.tolist(), counts.tolist(), strict=False)]


class SamProposer:
    """Suffix-automaton drafter over many requests (vLLM ``NgramProposer``-like, batch oriented).

    Lifecycle: ``add_request`` -> ``extend`` (accepted tokens, any number per step) / ``propose``
    -> optional ``preempt`` / ``resume`` -> ``finish`` or ``abort``. Memory of a request is freed
    at finish (group mode: when the last member of its group finishes); ``nbytes()`` counts the
    bytes of all arrays held (capacity).

    Fast path for a runner: keep ``slot_of(req_id)`` per batch row and call ``step_arrays`` (flat
    accepted tokens) once per decode step, or ``extend_arrays`` then ``propose_arrays``.
    """

    def __init__(self, config: SamConfig | None = None, **overrides: object) -> None:
        cfg = config or SamConfig()
        if overrides:
            cfg = SamConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        self._nbytes = 0
        self._AM = np.zeros((0, K.AM_COLS), np.int64)  # automaton meta rows (addresses, capacities, counts)
        self._auto_str = np.full((0, K.MAX_STRINGS + 1), -1, np.int64)  # automaton x local -> string slot
        self._SM = np.zeros((0, K.SM_COLS), np.int64)  # string meta rows
        self._arrS: list[np.ndarray] = []  # per automaton: state records int32[4 cap]
        self._arrE: list[np.ndarray] = []  # per automaton: edge records int32[3 cap]
        self._arrR: list[np.ndarray] = []  # per automaton: root hash int32[2 cap]
        self._arrH: list[np.ndarray] = []  # per automaton: hub-state transition index int32[4 cap]
        self._arrT: list[np.ndarray] = []  # per string: tokens int32[cap]
        self._free_autos: list[int] = []
        self._free_strings: list[int] = []
        self._grow_autos(8)
        self._grow_strings(16)
        self._autos: dict[int, _Auto] = {}
        self._reqs: dict[str, _Req] = {}
        self._groups: dict[str, int] = {}
        self._cache = -1  # the finished-response cache automaton (-1 = none)
        self._cache_stamp = 0  # changes whenever ``_cache`` is replaced (requests' pointers then re-feed)
        self._next_stamp = 1
        self._grow = np.zeros((1024, 3), np.int64)
        self._tuning = _Tuning()  # speed knobs and test hooks (never change a draft)
        self._knobs = np.zeros(K.KNOB_COLS, np.int64)
        self._prog = np.zeros(2, np.int64)
        self._rows = np.zeros(16, np.int64)
        self._out = np.zeros((16, cfg.num_speculative_tokens), np.int32)
        self._out_n = np.zeros(16, np.int32)
        # shadow table (sibling exchange): one row per open shadow string; key -> row in ``_key2sh``
        self._sh = np.zeros((0, 5), np.int64)  # rows: key, slot, next response offset, tokens, automaton
        self._sh_free: list[int] = []
        self._key2sh: dict[int, int] = {}
        self._sh_keys = np.zeros(0, np.int64)  # sorted keys of the open shadows ...
        self._sh_rows = np.zeros(0, np.int64)  # ... and their rows (rebuilt when ``_sh_dirty``)
        self._sh_dirty = False
        self._shadow_tokens = 0
        self.max_shadow_tokens = cfg.exchange_max_shadow_tokens  # bound of tokens held in shadow strings
        self._has_sep = False  # a SEP was appended somewhere: drafts are cut at SEP
        self.max_shadows_per_group = cfg.exchange_max_siblings  # remote siblings kept per group (0 = all)
        self.groups_version = 0  # changes whenever a group automaton is opened or freed
        # finished responses per prompt across rollout steps (group mode, history_responses > 0)
        self.history: HistoryStore | None = (
            HistoryStore(cfg.history_responses, cfg.history_prompt_tokens, resolve_max_bytes(cfg.history_max_bytes, drafters=cfg.history_drafters)[0])
            if cfg.group_mode and cfg.history_responses else None)
        self.history_strings = 0  # history responses instantiated into group automata (counter)

    # ------------------------------------------------------------------ slot tables (metadata)
    def _grow_autos(self, n: int) -> None:
        old = self._AM.shape[0]
        if n <= old:
            return
        am = np.zeros((n, K.AM_COLS), np.int64)
        am[:old] = self._AM
        st = np.full((n, K.MAX_STRINGS + 1), -1, np.int64)
        st[:old] = self._auto_str
        self._AM, self._auto_str = am, st
        for lst in (self._arrS, self._arrE, self._arrR, self._arrH):
            lst.extend([_EMPTY] * (n - old))
        self._free_autos.extend(range(n - 1, old - 1, -1))

    def _grow_strings(self, n: int) -> None:
        old = self._SM.shape[0]
        if n <= old:
            return
        sm = np.zeros((n, K.SM_COLS), np.int64)
        sm[:old] = self._SM
        sm[old:, K.M_AUTO] = -1
        self._SM = sm
        self._arrT.extend([_EMPTY] * (n - old))
        self._free_strings.extend(range(n - 1, old - 1, -1))

    def _set_array(self, lst: list[np.ndarray], i: int, arr: np.ndarray, addr_col: tuple[np.ndarray, int, int]
                   ) -> None:
        """Install ``arr`` as array ``i`` of ``lst`` and record its address and capacity."""
        meta, row, col = addr_col
        self._nbytes += arr.nbytes - lst[i].nbytes
        lst[i] = arr
        meta[row, col] = arr.ctypes.data if arr.size else 0

    def _new_auto(self) -> int:
        if not self._free_autos:
            self._grow_autos(max(8, 2 * self._AM.shape[0]))
        a = self._free_autos.pop()
        self._AM[a] = 0
        root = np.array([0, -1, -1, -1], np.int32)  # L, K, P, F
        self._set_array(self._arrS, a, root, (self._AM, a, K.A_S))
        self._AM[a, K.A_SCAP] = 1
        self._AM[a, K.A_NST] = 1
        self._AM[a, K.A_HUBDEG] = self._tuning.hub_degree
        self._auto_str[a, :] = -1
        self._autos[a] = _Auto()
        return a

    def _new_string(self, a: int) -> int:
        auto = self._autos[a]
        if len(auto.strings) >= K.MAX_STRINGS:
            raise RuntimeError("automaton full")
        if not self._free_strings:
            self._grow_strings(max(16, 2 * self._SM.shape[0]))
        s = self._free_strings.pop()
        local = len(auto.strings)
        auto.strings.append(s)
        self._auto_str[a, local] = s
        row = self._SM[s]
        row[:] = 0
        row[K.M_AUTO] = a
        row[K.M_LOCAL] = local
        row[K.M_CPOS] = -1
        row[K.M_CSTAMP] = -1
        return s

    def _free_auto(self, a: int) -> None:
        auto = self._autos.pop(a)
        for row in auto.shadows:
            self._drop_shadow_row(row)
            self._shadow_tokens -= int(self._sh[row, 3])
        self._shadow_tokens -= auto.shadow_tokens
        for lst, col in ((self._arrS, K.A_S), (self._arrE, K.A_E), (self._arrR, K.A_R), (self._arrH, K.A_H)):
            self._set_array(lst, a, _EMPTY, (self._AM, a, col))
        self._AM[a] = 0
        for s in auto.strings:
            self._set_array(self._arrT, s, _EMPTY, (self._SM, s, K.M_T))
            self._SM[s] = 0
            self._SM[s, K.M_AUTO] = -1
            self._free_strings.append(s)
        self._auto_str[a, :] = -1
        self._free_autos.append(a)

    def _grow_hashed(self, kind: int, a: int, need: int) -> None:
        """Root hash (``G_ROOT``) or hub index (``G_HUB``) of automaton ``a`` with room for ``need`` entries
        (power-of-2 slots, load <= 0.5; rehashed); nothing to do if it has the room."""
        addr_col, cap_col, _ = _COLS[kind]
        lst = self._arrR if kind == K.G_ROOT else self._arrH
        cap = int(self._AM[a, cap_col])
        if 2 * need <= cap:
            return
        ncap = max(16, 2 * cap)
        while ncap < 2 * need:
            ncap *= 2
        new = np.full(ncap * _REC[kind], -1, np.int32)
        _HASHED[kind](lst[a], new)
        self._set_array(lst, a, new, (self._AM, a, addr_col))
        self._AM[a, cap_col] = ncap

    def _apply_growth(self, ng: int) -> None:
        """Grow the arrays the kernel asked for (kind, slot, elements needed); 1.5x policy."""
        for kind, i, need in self._grow[:ng].tolist():
            if kind == K.G_TOK:
                old = self._arrT[i]
                if old.shape[0] >= need:
                    continue
                # headroom of need/16 + 64 tokens: a new prompt does not regrow at its first decode step
                new = np.empty(need if self._tuning.exact_growth else
                               max(need + (need >> 4) + 64, old.shape[0] + (old.shape[0] >> 1) + 16), np.int32)
                ln = int(self._SM[i, K.M_LEN])
                new[:ln] = old[:ln]
                self._set_array(self._arrT, i, new, (self._SM, i, K.M_T))
                self._SM[i, K.M_TCAP] = new.shape[0]
                continue
            if kind in _HASHED:
                self._grow_hashed(kind, i, need)
                continue
            rec = _REC[kind]
            addr_col, cap_col, used_col = _COLS[kind]
            lst = self._arrS if kind == K.G_STATES else self._arrE
            cap = int(self._AM[i, cap_col])
            if cap >= need:
                continue
            ncap = need if self._tuning.exact_growth else max(need, cap + (cap >> 1) + 16)
            new = np.empty(ncap * rec, np.int32)
            used = int(self._AM[i, used_col]) * rec
            new[:used] = lst[i][:used]
            self._set_array(lst, i, new, (self._AM, i, addr_col))
            self._AM[i, cap_col] = ncap
            if kind == K.G_STATES and self._tuning.hub_degree and 8 * self._AM[i, K.A_HCAP] < ncap:
                # hub index sized with the states (capacity >= states / 8, 2 B per state): later hub
                # conversions rarely need a growth round trip of their own
                self._grow_hashed(K.G_HUB, i, ncap // 16)

    # --------------------------------------------------------------------------- kernels
    def _cache_for_kernel(self) -> int:
        cfg = self.config
        return self._cache if cfg.group_mode and cfg.cache_max_responses > 0 else -1

    def _run(self, slots: np.ndarray, buf: np.ndarray, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
             complete: bool = False, k: int = 0, cache: int | None = None) -> None:
        """Extend (and with ``k`` > 0 propose into ``self._out``) in kernel calls, growing arrays between."""
        cfg = self.config
        ca = self._cache_for_kernel() if cache is None else cache
        prog = self._prog
        prog[0] = 0
        prog[1] = -1
        knobs = self._tuning.knobs(self._knobs)
        while True:
            if k:
                ng = K.step_batch(slots, buf, rows, starts, ends, prog, cfg.budget, cfg.resync, self._AM, self._SM,
                                  self._auto_str, ca, self._cache_stamp, self._grow, knobs, k, cfg.min_match,
                                  self._out, self._out_n)
            else:
                ng = K.extend_batch(slots, buf, rows, starts, ends, prog, cfg.budget, cfg.resync, complete,
                                    self._AM, self._SM, self._auto_str, ca, self._cache_stamp, self._grow, knobs)
            if ng == 0:
                break
            if ng == K.BAD_RANGE:
                raise ValueError("token ranges must not end before they start (offs decreasing, or num_tokens "
                                 "shorter than the drafter's text)")
            if ng == K.TOO_LONG:
                raise ValueError(f"string longer than {K.MAX_STRING_LEN} tokens")
            self._apply_growth(ng)
        want = self._AM[:, K.A_HWANT]
        if want.any():  # lookups that would have made a state a hub found the index full: grow it (4x room)
            for a in np.flatnonzero(want).tolist():
                self._grow_hashed(K.G_HUB, a, 2 * int(want[a]))
                want[a] = 0

    def _drafts(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` rows of the draft buffers; drafts cut before a gap marker (``SEP``) if any exists."""
        out, cnt = self._out[:n], self._out_n[:n]
        if self._has_sep and n:
            hit = out == SEP
            if hit.any():
                first = np.where(hit.any(axis=1), hit.argmax(axis=1), out.shape[1]).astype(np.int32)
                np.minimum(cnt, first, out=cnt)
        return out, cnt

    def _out_buffers(self, n: int, k: int) -> None:
        if self._out.shape[0] < n or self._out.shape[1] != k:
            self._out = np.zeros((max(n, 16), k), np.int32)
            self._out_n = np.zeros(max(n, 16), np.int32)

    def _zero_rows(self, n: int) -> np.ndarray:
        if self._rows.shape[0] < n:
            self._rows = np.zeros(max(n, 2 * self._rows.shape[0]), np.int64)
        return self._rows[:n]

    def _flat(self, slots: np.ndarray, toks: np.ndarray, offs: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        slots = np.asarray(slots, np.int64)
        toks = np.asarray(toks, np.int32).reshape(1, -1)
        offs = np.asarray(offs, np.int64)
        n = slots.shape[0]
        if offs.shape[0] != n + 1:
            raise ValueError(f"offs must have n + 1 = {n + 1} entries, got {offs.shape[0]}")
        return slots, toks, self._zero_rows(n), offs[:-1], offs[1:]

    def _append_string(self, s: int, toks: np.ndarray, complete: bool = False) -> None:
        toks = np.ascontiguousarray(toks, np.int32)
        self._run(np.array([s], np.int64), toks.reshape(1, -1), self._zero_rows(1), np.zeros(1, np.int64),
                  np.array([toks.shape[0]], np.int64), complete,
                  cache=-1 if complete else None)

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
                self.groups_version += 1
                self._autos[a].prompt_len = int(prompt.shape[0])
                self._autos[a].group = g
                if self.history is not None:
                    self._seed_history(a, g, prompt)
        else:
            g = ""
            a = self._new_auto()
        s = self._new_string(a)
        self._autos[a].live += 1
        self._reqs[req_id] = _Req(slot=s, auto=a, group=g, prompt_len=int(prompt.shape[0]))
        self._append_string(s, prompt)

    def _seed_history(self, a: int, group: str, prompt: np.ndarray) -> None:
        """A new group automaton starts with the prompt's kept responses: one complete string each
        (prompt + response), appended before any running request's text (so the running siblings, being
        more recent, win ties under the "recent" rule)."""
        kept = self.history.get(group)  # type: ignore[union-attr]
        for resp in kept[-(K.MAX_STRINGS // 2):]:  # the other half stays for requests and shadows
            s = self._new_string(a)
            self._append_string(s, np.concatenate([prompt, resp]), complete=True)
            self._has_sep = self._has_sep or bool((resp == SEP).any())  # a remote response with a gap
            self.history_strings += 1

    def history_add(self, group_id: str, response_ids: Sequence[int] | np.ndarray) -> None:
        """Keep a finished response of ``group_id`` for the prompt's next group (what ``finish`` does for
        a local request; benchmarks and tests use it directly). No-op without history."""
        if self.history is not None:
            self.history.add(group_id, np.asarray(response_ids, np.int32))

    def history_score(self, group_id: str, responses: Sequence[Sequence[int] | np.ndarray],
                      scores: Sequence[float]) -> int:
        """Score the kept responses of ``group_id`` (matched by content; used when ``history.weighted`` is set,
        a measured option that is not wired to the trainer: docs/sam_decoding.md); returns how many."""
        return self.history.score(group_id, responses, scores) if self.history is not None else 0

    def extend(self, req_id: str, accepted_ids: Sequence[int] | np.ndarray) -> None:
        """Append the accepted tokens (incl. the bonus token) of one request: shape [n_accepted]."""
        self.extend_batch([req_id], [accepted_ids])

    def _lists_to_arrays(self, req_ids: Sequence[str], accepted: Sequence[Sequence[int] | np.ndarray]
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(req_ids)
        reqs = self._reqs
        slots = np.fromiter((reqs[r].slot for r in req_ids), np.int64, n)
        lens = np.zeros(n + 1, np.int64)
        lens[1:] = np.fromiter((len(a) for a in accepted), np.int64, n)
        offs = np.cumsum(lens)
        total = int(offs[-1])
        toks = np.fromiter((t for seq in accepted for t in seq), np.int32, total) if total else _EMPTY
        return slots, toks, offs

    def extend_batch(self, req_ids: Sequence[str], accepted: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Append accepted tokens of many requests in one numba call (one decode step)."""
        self.extend_arrays(*self._lists_to_arrays(req_ids, accepted))

    def extend_arrays(self, slots: np.ndarray, toks: np.ndarray, offs: np.ndarray) -> None:
        """Array form of ``extend_batch``: slots int[n] (``slot_of``), toks int32[total], offs int64[n+1]."""
        self._run(*self._flat(slots, toks, offs))

    def slot_of(self, req_id: str) -> int:
        """Kernel slot of a request (stable from ``add_request`` to ``finish``/``abort``)."""
        return self._reqs[req_id].slot

    def slots_of(self, req_ids: Sequence[str]) -> np.ndarray:
        """``slot_of`` for many requests: int64[n]."""
        return np.fromiter((self._reqs[r].slot for r in req_ids), np.int64, len(req_ids))

    def propose_arrays(self, slots: np.ndarray, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for string slots int[n]: returns (tokens int32[n, k], counts int32[n]) (views, reused)."""
        k = k or self.config.num_speculative_tokens
        slots = np.asarray(slots, np.int64)
        n = slots.shape[0]
        self._out_buffers(n, k)
        K.propose_batch(slots, k, self.config.min_match, self._AM, self._SM, self._auto_str, self._cache_for_kernel(),
                        self._cache_stamp, self._out, self._out_n)
        return self._drafts(n)

    def match_lengths(self, slots: np.ndarray) -> np.ndarray:
        """Tokens of each string's suffix matched in its own automaton (its text and, in group mode, its running
        siblings'), int64[n]: the match a draft continues (a longer match from the cache is not counted)."""
        return self._SM[np.asarray(slots, np.int64), K.M_CLEN].astype(np.int64)

    def step_arrays(self, slots: np.ndarray, toks: np.ndarray, offs: np.ndarray, k: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """One decode step in one kernel call: ``extend_arrays`` then ``propose_arrays`` (same shapes)."""
        k = k or self.config.num_speculative_tokens
        slots, buf, rows, starts, ends = self._flat(slots, toks, offs)
        n = slots.shape[0]
        self._out_buffers(n, k)
        self._run(slots, buf, rows, starts, ends, k=k)
        return self._drafts(n)

    def propose(self, req_ids: Sequence[str], k: int | None = None) -> list[list[int]]:
        """Up to ``k`` draft tokens per request (empty list = no draft)."""
        out, cnt = self.propose_arrays(self.slots_of(req_ids), k)
        return drafts_to_lists(out, cnt)

    def step(self, req_ids: Sequence[str], accepted: Sequence[Sequence[int]], k: int | None = None
             ) -> list[list[int]]:
        """One decode step: ``extend_batch`` then ``propose`` (one kernel call)."""
        out, cnt = self.step_arrays(*self._lists_to_arrays(req_ids, accepted), k)
        return drafts_to_lists(out, cnt)

    # ------------------------------------------------------------------ shadow strings (sibling exchange)
    def group_ids(self) -> list[str]:
        """Ids of the group automata held (group mode)."""
        return list(self._groups)

    def has_group(self, group_id: str) -> bool:
        """Group mode: a running request of ``group_id`` is held (its automaton exists)."""
        return group_id in self._groups

    def num_groups(self) -> int:
        return len(self._groups)

    def num_shadow_tokens(self) -> int:
        """Tokens held in shadow strings (remote siblings' texts, prompt copies included)."""
        return self._shadow_tokens

    def num_shadows(self) -> int:
        """Open shadow rows (strings, and ignored remote siblings beyond ``max_shadows_per_group``)."""
        return len(self._key2sh)

    def shadow_keys(self) -> list[int]:
        return sorted(self._key2sh)

    def _drop_shadow_row(self, row: int) -> None:
        del self._key2sh[int(self._sh[row, 0])]
        self._sh_free.append(row)
        self._sh_dirty = True

    def _open_shadow(self, key: int, a: int, ignored: bool = False) -> int:
        """A new shadow string in automaton ``a``: its row in the shadow table (``ignored``: a row without a
        string, slot -1, whose entries are skipped: a remote sibling beyond ``max_shadows_per_group``)."""
        s = -1 if ignored else self._new_string(a)
        if not ignored:
            self._autos[a].n_shadows += 1
        if not self._sh_free:
            old = self._sh.shape[0]
            sh = np.zeros((max(64, 2 * old), 5), np.int64)
            sh[:old] = self._sh
            self._sh = sh
            self._sh_free.extend(range(sh.shape[0] - 1, old - 1, -1))
        row = self._sh_free.pop()
        self._sh[row] = (key, s, 0, 0, a)
        self._key2sh[int(key)] = row
        self._autos[a].shadows.append(row)
        self._sh_dirty = True
        return row

    def open_shadow(self, key: int, group_id: str, text: np.ndarray, next_pos: int) -> None:
        """Open a shadow string holding ``text`` (int32[n], a remote sibling's whole text so far) whose next
        response token will have offset ``next_pos`` (benchmarks: a steady state without replaying history)."""
        a = self._groups[group_id]
        row = self._open_shadow(key, a)
        text = np.ascontiguousarray(text, np.int32)
        self._run(np.array([self._sh[row, 1]], np.int64), text.reshape(1, -1), self._zero_rows(1),
                  np.zeros(1, np.int64), np.array([text.shape[0]], np.int64), cache=-1)
        self._sh[row, 2] = int(next_pos)
        self._sh[row, 3] = int(text.shape[0])
        self._shadow_tokens += int(text.shape[0])

    def _shadow_rows(self, keys: np.ndarray) -> np.ndarray:
        """Row of every key's open shadow, -1 where there is none (vectorized lookup)."""
        if self._sh_dirty:
            rows = np.fromiter(self._key2sh.values(), np.int64, len(self._key2sh))
            order = np.argsort(self._sh[rows, 0], kind="stable")
            self._sh_rows = rows[order]
            self._sh_keys = self._sh[self._sh_rows, 0]
            self._sh_dirty = False
        if not self._sh_keys.shape[0] or not keys.shape[0]:
            return np.full(keys.shape[0], -1, np.int64)
        j = np.minimum(np.searchsorted(self._sh_keys, keys), self._sh_keys.shape[0] - 1)
        return np.where(self._sh_keys[j] == keys, self._sh_rows[j], -1)

    def shadow_extend(self, keys: np.ndarray, group_of: Callable[[int], str | None], pos: np.ndarray,
                      counts: np.ndarray, buf: np.ndarray, starts: np.ndarray, finished: np.ndarray) -> int:
        """Append remote siblings' tokens to shadow strings of the local group automata (one kernel call).

        Entry i names a remote request ``keys[i]`` whose response tokens ``[pos[i], pos[i] + counts[i])``
        are ``buf[starts[i]: starts[i] + counts[i]]``. A shadow is a string of the group automaton (prompt
        copy + response), made at the first entry of its key (group ``group_of(i)``); it keeps the group
        automaton alive until it finishes. A token range that does not continue the shadow (tokens
        dropped by a sender's cap, or an entry skipped here) is appended after one ``SEP`` (drafts never
        cross it). Skipped: a new key whose group has no automaton here (``group_of(i)`` None or unknown:
        nothing to draft for), tokens that would take the shadow tokens past ``max_shadow_tokens``, a new
        shadow in a full automaton. A shadow whose ``finished[i]`` is set enters the finished-response
        cache like a local ``finish`` and is closed (its string stays until the automaton is freed).
        Tokens are appended entry after entry, in order.

        Args:
            keys: int64[n] key per entry (the exchange uses sender rank << 32 | sender serial).
            group_of: entry index -> group id (called only for keys without an open shadow).
            pos, counts: int[n] response offset of the first token and token count per entry.
            buf: int32[m] tokens; starts: int[n] where entry i's tokens begin in ``buf``.
            finished: bool[n] the remote request finished after these tokens.
        Returns:
            tokens appended (gap markers and prompt copies included).
        """
        if not self.config.group_mode:
            raise RuntimeError("shadow strings need group_mode=True")
        keys = np.asarray(keys, np.int64)
        pos = np.asarray(pos, np.int64)
        counts = np.asarray(counts, np.int64)
        starts = np.asarray(starts, np.int64)
        finished = np.asarray(finished, bool)
        n = keys.shape[0]
        self._shadow_rows(keys[:0])  # sorted shadow index up to date
        room = self.max_shadow_tokens - self._shadow_tokens
        e_slot = np.zeros(n, np.int64)
        e_row = np.zeros(n, np.int64)
        e_start = np.zeros(n, np.int64)
        e_end = np.zeros(n, np.int64)
        fast = np.zeros(n, np.bool_)
        room -= K.shadow_fast(keys, pos, counts, starts, self._sh_keys, self._sh_rows, self._sh, room, e_slot,
                              e_start, e_end, fast)
        sh = self._sh
        e_on = fast & (counts > 0)
        closing = finished & fast
        extra: list[np.ndarray] = []
        x_len = 0
        sep = np.array([SEP], np.int32)
        for i in np.flatnonzero(~fast & (counts > 0)).tolist():
            c, p0 = int(counts[i]), int(pos[i])
            seg = buf[starts[i]: starts[i] + c]
            row = self._key2sh.get(int(keys[i]), -1)
            if row < 0:
                g = group_of(i)
                a = self._groups.get(g, -1) if g is not None else -1
                if a < 0:
                    continue
                auto = self._autos[a]
                if self.max_shadows_per_group and auto.n_shadows >= self.max_shadows_per_group:
                    self._open_shadow(int(keys[i]), a, ignored=True)  # later entries skip it in the fast path
                    continue
                plen = auto.prompt_len
                need = plen + c + (1 if p0 else 0)
                if need > room or len(auto.strings) >= K.MAX_STRINGS:
                    continue
                first = auto.strings[0]  # a local request's string: it starts with the group's prompt
                row = self._open_shadow(int(keys[i]), a)
                sh = self._sh
                pieces = [self._arrT[first][:plen]] + ([sep] if p0 else []) + [seg]
            else:
                gap = int(sh[row, 2]) != p0
                need = c + (1 if gap else 0)
                if need > room:
                    continue
                pieces = [sep, seg] if gap else [seg]
            self._has_sep = self._has_sep or bool(p0)
            room -= need
            sh[row, 2] = p0 + c
            sh[row, 3] += need
            e_on[i] = True
            e_slot[i] = sh[row, 1]
            e_row[i] = 1
            e_start[i] = x_len
            x_len += need
            e_end[i] = x_len
            extra.extend(pieces)
            closing[i] = finished[i]
        total = self.max_shadow_tokens - self._shadow_tokens - room
        self._shadow_tokens += total
        if e_on.any():
            b = np.asarray(buf, np.int32)
            if extra:
                kb = np.zeros((2, max(b.shape[0], x_len)), np.int32)
                kb[0, : b.shape[0]] = b
                kb[1, :x_len] = np.concatenate(extra)
            else:
                kb = b.reshape(1, -1)
            self._run(e_slot[e_on], kb, e_row[e_on], e_start[e_on], e_end[e_on], cache=-1)
        # FIN of an open shadow without new tokens (all sent before)
        for i in np.flatnonzero(finished & ~closing & (counts == 0)).tolist():
            if int(keys[i]) in self._key2sh:
                closing[i] = True
        for i in np.flatnonzero(closing).tolist():
            self._close_shadow(self._key2sh[int(keys[i])], cache=True)
        return total

    def _close_shadow(self, row: int, cache: bool) -> None:
        a = int(self._sh[row, 4])
        auto = self._autos[a]
        auto.shadows.remove(row)
        auto.shadow_tokens += int(self._sh[row, 3])  # closed shadows: counted here until the automaton is freed
        self._drop_shadow_row(row)
        slot = int(self._sh[row, 1])
        if cache and slot >= 0 and (self.config.cache_max_responses > 0 or self.history is not None):
            resp = self._arrT[slot][auto.prompt_len: self._SM[slot, K.M_LEN]]
            if resp.shape[0]:
                if self.config.cache_max_responses > 0:
                    self._cache_insert(resp.copy())
                if self.history is not None:  # a remote sibling's response serves this rank's next visit
                    self.history.add(auto.group, resp)
        self._maybe_free_group(a, auto.group)

    def close_shadows(self) -> None:
        """Close every open shadow string (no cache insertion); automata no running request needs are freed."""
        for row in list(self._key2sh.values()):
            self._close_shadow(row, cache=False)

    def tokens(self, req_id: str) -> np.ndarray:
        """Copy of the request's text (prompt + accepted tokens), shape [len]."""
        s = self._reqs[req_id].slot
        return self._arrT[s][: self._SM[s, K.M_LEN]].copy()

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
        if cfg.group_mode and (cfg.cache_max_responses > 0 or self.history is not None):
            resp = self.tokens(req_id)[req.prompt_len:]
            if resp.shape[0]:
                if cfg.cache_max_responses > 0:
                    self._cache_insert(resp)
                if self.history is not None:
                    self.history.add(req.group, resp)
        self._release(req_id)

    def abort(self, req_id: str) -> None:
        """Drop a request without caching its response."""
        self._release(req_id)

    def _release(self, req_id: str) -> None:
        req = self._reqs.pop(req_id)
        auto = self._autos[req.auto]
        auto.live -= 1
        self._maybe_free_group(req.auto, req.group)

    def _maybe_free_group(self, a: int, group: str) -> None:
        """Free automaton ``a`` once no running request and no open shadow string needs it."""
        auto = self._autos[a]
        if auto.live == 0 and not auto.shadows:
            if self._groups.get(group, -1) == a:
                del self._groups[group]
                self.groups_version += 1
            self._free_auto(a)

    def _cache_insert(self, resp: np.ndarray) -> None:
        """Add a finished response to the cache: ONE generalized automaton (one matching pointer per request).

        It holds at most ``2 * cache_max_tokens`` tokens and ``min(2 * cache_max_responses, MAX_STRINGS)``
        responses. When the next response would exceed either, the automaton is rebuilt from its newest
        responses that fit ``cache_max_responses`` and ``cache_max_tokens`` (the older half is dropped), then
        the response is added; requests re-feed their pointer (``resync`` tokens) at their next step.
        """
        cfg = self.config
        resp = resp[-cfg.cache_max_tokens:]
        cur = self._cache
        max_strings = min(2 * cfg.cache_max_responses, K.MAX_STRINGS)
        if cur >= 0:
            auto = self._autos[cur]
            if len(auto.strings) + 1 > max_strings or auto.tokens + resp.shape[0] > 2 * cfg.cache_max_tokens:
                self._cache_compact(min(cfg.cache_max_responses, K.MAX_STRINGS - 1), cfg.cache_max_tokens)
        self._cache_add(resp)

    def _cache_add(self, toks: np.ndarray) -> None:
        """Append one response to the cache automaton, opening a new one (new stamp) if there is none."""
        if self._cache < 0:
            self._cache = self._new_auto()
            self._cache_stamp = self._next_stamp
            self._next_stamp += 1
        s = self._new_string(self._cache)
        self._autos[self._cache].tokens += int(toks.shape[0])
        # cache strings do not follow the cache (appended with the cache switched off)
        self._append_string(s, toks, complete=True)

    def _cache_compact(self, keep_responses: int, keep_tokens: int) -> None:
        """Rebuild the cache automaton from its newest responses (<= ``keep_responses``, <= ``keep_tokens``
        tokens) under a new stamp (none is left if nothing is kept). Bytes of the old one are freed."""
        kept: list[np.ndarray] = []
        total = 0
        for s in reversed(self._autos[self._cache].strings):
            n = int(self._SM[s, K.M_LEN])
            if len(kept) >= keep_responses or total + n > keep_tokens:
                break
            kept.append(self._arrT[s][:n].copy())
            total += n
        self.clear_cache()
        for toks in reversed(kept):
            self._cache_add(toks)

    def clear_cache(self) -> None:
        """Drop the finished-response cache."""
        if self._cache >= 0:
            self._free_auto(self._cache)
        self._cache = -1
        self._cache_stamp = 0

    def nbytes(self) -> int:
        """Bytes held by the per-token arrays (tokens, states, edges, root hashes, hub indexes; capacity)
        and the history store (its counted bytes)."""
        return self._nbytes + (self.history.nbytes() if self.history is not None else 0)

    def num_tokens(self) -> int:
        """Tokens held: running requests' texts, finished group members kept for siblings, history strings,
        cache, and the history store's responses."""
        live = self._SM[:, K.M_AUTO] >= 0
        return int(self._SM[live, K.M_LEN].sum()) + (self.history.num_tokens() if self.history is not None else 0)

    def clear_history(self) -> None:
        """Drop the history store (group automata already seeded keep their strings)."""
        if self.history is not None:
            self.history.clear()

    def cache_bound_tokens(self) -> int:
        """Upper bound of tokens held by the finished-response cache (2 x ``cache_max_tokens``)."""
        return 2 * self.config.cache_max_tokens if self.config.group_mode and self.config.cache_max_responses else 0
