"""Sibling exchange for group-mode SAM drafting across DP ranks (``sam_config.group_exchange``).

When data rebalance deals a prompt's GRPO samples over several vLLM DP ranks, each rank's group
automaton holds only its own members. With the exchange, every rank publishes the tokens its requests
accepted since the last exchange, tagged by prompt group, and every rank appends the remote tokens of
the groups it holds to *shadow strings* of its group automata (``SamProposer.shadow_extend``), so a
request drafts from all its siblings again. Memory stays bounded: a rank keeps shadows only for groups
with a running local request, up to ``max_shadow_tokens``, and frees them with the group automaton.

Wire format (one int32 array per rank and exchange)::

    [E, entries (E x 5), tokens]
    entry = [group key low 32 bits, group key high 32 bits, sender serial, pos, count | FIN]

``group key`` = 64-bit hash of the group id (``group_key64``), ``sender serial`` = the request's number
on its rank (a shadow is keyed by (sender rank, serial)), ``pos`` = response offset of the entry's first
token, ``count`` = its tokens (bits 0-29), ``FIN`` (bit 30) = the request finished after them.
20 B per entry + 4 B per token.

Cap (``max_bytes`` per rank and exchange): when the pending tokens do not fit, the oldest tokens of the
longest pending ranges are dropped first (water filling: every entry keeps its newest ``min(n, level)``
tokens); a receiver sees the jump in ``pos`` and appends a gap marker before the next tokens.

Transport: ``GlooAllGather`` over a CPU (gloo) process group among the rollout DP ranks, one size
all-gather and one payload all-gather per exchange. The engine hook (vllm patch 0006) uses vLLM's own
gloo DP group (``get_dp_group().cpu_group``, created once by vLLM) after every engine-loop iteration, in
lockstep on every DP rank; tokens accepted in step t reach the siblings' drafts of step t + 1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qwen3_rl.spec_decode import _sam_kernels as K
from qwen3_rl.spec_decode.sam import SamProposer

ENTRY_INTS = 5
_NOMSG = np.zeros(0, np.int32)
ENTRY_BYTES = 4 * ENTRY_INTS
FIN = 1 << 30
COUNT_MASK = FIN - 1
HEADER_BYTES = 4  # the entry count
DEFAULT_MAX_BYTES = 16384


def group_key64(group_id: str) -> int:
    """64-bit wire key of a group id (blake2b-64, the same on every rank), as a signed int64."""
    return int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=8).digest(), "little", signed=True)


def water_fill(counts: np.ndarray, budget: int) -> np.ndarray:
    """Tokens each entry keeps under a total ``budget``: the longest lose tokens first.

    Args:
        counts: int[n] pending tokens per entry.
        budget: tokens that fit (>= 0).
    Returns:
        int64[n] kept per entry, ``kept <= counts``, ``sum(kept) == min(sum(counts), budget)``; every
        entry keeps ``min(count, level)`` and the leftover goes one token each to the longest entries.
    """
    c = np.asarray(counts, np.int64)
    if int(c.sum()) <= budget:
        return c.copy()
    if budget <= 0:
        return np.zeros_like(c)
    srt = np.sort(c)
    n = srt.shape[0]
    # sum(min(c, L)) for L = srt[j]: prefix of the smaller ones + L * (number >= L)
    pre = np.concatenate([[0], np.cumsum(srt)])
    level = 0
    for j in range(n):  # largest level whose fill fits
        need = pre[j] + srt[j] * (n - j)
        if need > budget:
            rest = budget - pre[j]
            level = rest // (n - j)
            break
    kept = np.minimum(c, level)
    left = budget - int(kept.sum())
    if left > 0:
        longer = np.flatnonzero(c > level)
        order = longer[np.argsort(-c[longer], kind="stable")][:left]
        kept[order] += 1
    return kept


def pack_message(keys64: np.ndarray, serials: np.ndarray, pos: np.ndarray, counts: np.ndarray, fin: np.ndarray,
                 tokens: Sequence[np.ndarray]) -> np.ndarray:
    """One rank's message: int32[1 + 5 E + sum(counts)] (see the module docstring)."""
    e = int(keys64.shape[0])
    k64 = np.asarray(keys64, np.int64)
    hdr = np.empty((e, ENTRY_INTS), np.int32)
    hdr[:, 0:2] = k64.view(np.int32).reshape(e, 2)
    hdr[:, 2] = serials
    hdr[:, 3] = pos
    hdr[:, 4] = np.asarray(counts, np.int64) | np.where(fin, FIN, 0)
    parts = [np.array([e], np.int32), hdr.ravel()] + [np.asarray(t, np.int32) for t in tokens]
    return np.concatenate(parts)


@dataclass
class Message:
    """A parsed rank message: arrays of its E entries and the tokens."""

    keys64: np.ndarray  # int64[E]
    serials: np.ndarray  # int32[E]
    pos: np.ndarray  # int64[E]
    counts: np.ndarray  # int64[E]
    fin: np.ndarray  # bool[E]
    tokens: np.ndarray  # int32[sum(counts)]


def unpack_message(msg: np.ndarray) -> Message:
    """Inverse of ``pack_message``; raises ``ValueError`` on a malformed message."""
    msg = np.asarray(msg, np.int32)
    if msg.shape[0] < 1:
        raise ValueError("empty sibling-exchange message")
    e = int(msg[0])
    end = 1 + ENTRY_INTS * e
    if e < 0 or msg.shape[0] < end:
        raise ValueError(f"sibling-exchange message of {msg.shape[0]} ints cannot hold {e} entries")
    hdr = msg[1:end].reshape(e, ENTRY_INTS)
    keys = np.ascontiguousarray(hdr[:, 0:2]).view(np.int64).reshape(e)
    raw = hdr[:, 4].astype(np.int64)
    counts = raw & COUNT_MASK
    toks = msg[end:]
    if int(counts.sum()) != toks.shape[0]:
        raise ValueError(f"sibling-exchange message: entries count {int(counts.sum())} tokens, {toks.shape[0]} sent")
    return Message(keys, hdr[:, 2].copy(), hdr[:, 3].astype(np.int64), counts, (raw & FIN) != 0, toks)


@dataclass
class ExchangeStats:
    """Counters of one rank (bytes are message bytes this rank sent)."""

    exchanges: int = 0
    bytes_sent: int = 0
    entries_sent: int = 0
    tokens_sent: int = 0
    tokens_dropped: int = 0  # by the byte cap
    tokens_merged: int = 0  # appended to shadows here (markers and prompt copies included)
    history: list[int] = field(default_factory=list)  # bytes per exchange (the first 4096)


class SiblingExchange:
    """Per-rank state of the sibling exchange around a group-mode ``SamProposer``.

    Usage per rank: ``track`` after ``add_request``, ``before_finish`` just before ``finish``/``abort``,
    ``pack`` at an exchange (returns this rank's message), ``merge`` with every rank's message.
    No token is copied before ``pack``: a request's pending range is the tail of its own string
    (local requests live in a row table: slot, key, serial, tokens published, prompt length).

    Args:
        proposer: the rank's drafter (``group_mode=True``).
        rank: this rank's index in the exchange group.
        max_bytes: cap of one message (bytes, >= 4 + 20).
    """

    def __init__(self, proposer: SamProposer, rank: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if not proposer.config.group_mode:
            raise ValueError("the sibling exchange needs a group-mode SamProposer (sam_config.group_mode=True)")
        if max_bytes < HEADER_BYTES + ENTRY_BYTES:
            raise ValueError(f"max_bytes must be >= {HEADER_BYTES + ENTRY_BYTES}, got {max_bytes}")
        self.p = proposer
        self.rank = int(rank)
        self.max_bytes = int(max_bytes)
        self._row: dict[str, int] = {}
        self._free: list[int] = []
        cap = 64
        self._slot = np.zeros(cap, np.int64)
        self._k64 = np.zeros(cap, np.int64)
        self._ser = np.zeros(cap, np.int64)
        self._sent = np.zeros(cap, np.int64)
        self._plen = np.zeros(cap, np.int64)
        self._used = np.zeros(cap, bool)
        self._n = 0  # rows ever used (high-water mark)
        self._finished: list[tuple[int, int, int, np.ndarray]] = []  # key64, serial, pos, tail since last pack
        self._serial = 0
        self._key_group: dict[int, str] = {}  # 64-bit wire key -> group id, for the groups held here
        self._k64_of: dict[str, int] = {}
        self._known = np.zeros(0, np.int64)  # sorted wire keys of the groups held here
        self._known_version = -1
        self._buf = np.zeros(1024, np.int32)
        self.stats = ExchangeStats()

    # ------------------------------------------------------------------ local lifecycle
    def _new_row(self) -> int:
        if self._free:
            return self._free.pop()
        if self._n == self._slot.shape[0]:
            for name in ("_slot", "_k64", "_ser", "_sent", "_plen", "_used"):
                old = getattr(self, name)
                new = np.zeros(2 * old.shape[0], old.dtype)
                new[: old.shape[0]] = old
                setattr(self, name, new)
        self._n += 1
        return self._n - 1

    def track(self, req_id: str, group_id: str, prompt_len: int) -> None:
        """A local request was added to the proposer (its text = prompt of ``prompt_len`` tokens so far)."""
        if req_id in self._row:
            raise KeyError(f"request {req_id!r} already tracked")
        k64 = group_key64(group_id)
        self._serial = (self._serial + 1) & 0x7FFFFFFF
        i = self._new_row()
        self._row[req_id] = i
        self._slot[i] = self.p.slot_of(req_id)
        self._k64[i] = k64
        self._ser[i] = self._serial
        self._sent[i] = self._plen[i] = int(prompt_len)
        self._used[i] = True
        self._key_group[k64] = group_id
        self._k64_of[group_id] = k64

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._row

    def before_finish(self, req_id: str, send: bool = True) -> None:
        """Call before ``finish``/``abort`` of a tracked request: keeps its unsent tail and FIN for ``pack``."""
        i = self._row.pop(req_id, None)
        if i is None:
            return
        if send:
            slot = int(self._slot[i])
            n = int(self.p._SM[slot, K.M_LEN])
            sent = int(self._sent[i])
            self._finished.append((int(self._k64[i]), int(self._ser[i]), sent - int(self._plen[i]),
                                   self.p._arrT[slot][sent:n].copy()))
        self._used[i] = False
        self._free.append(i)

    def resync(self, req_id: str) -> None:
        """The request's text was rebuilt (its slot may change): publish from its new end on."""
        i = self._row.get(req_id)
        if i is not None:
            self._slot[i] = self.p.slot_of(req_id)
            self._sent[i] = int(self.p._SM[self._slot[i], K.M_LEN])

    # ------------------------------------------------------------------ exchange
    def pack(self) -> np.ndarray:
        """This rank's message with every pending range (cap applied); marks them sent (or dropped)."""
        if not self._finished:  # the common case, one kernel call: no FIN to send and everything fits
            cap = self.max_bytes // 4
            if self._buf.shape[0] < cap:
                self._buf = np.empty(cap, np.int32)
            m = K.pack_pending(self.p._SM, self._slot, self._k64, self._ser, self._sent, self._plen, self._used,
                               self._n, cap, self._buf)
            if m >= 0:
                msg = self._buf[:m].copy()
                e = int(msg[0])
                self._count(msg, e, m - 1 - ENTRY_INTS * e, 0)
                return msg
        return self._pack_capped()

    def _count(self, msg: np.ndarray, entries: int, sent: int, dropped: int) -> None:
        st = self.stats
        st.exchanges += 1
        st.bytes_sent += 4 * msg.shape[0]
        st.entries_sent += entries
        st.tokens_sent += sent
        st.tokens_dropped += dropped
        if len(st.history) < 4096:
            st.history.append(4 * msg.shape[0])

    def _pack_capped(self) -> np.ndarray:
        rows = np.flatnonzero(self._used[: self._n])
        slots = self._slot[rows]
        lens = self.p._SM[slots, K.M_LEN]
        pend = lens - self._sent[rows]
        live = pend > 0
        rows, slots, lens, pend = rows[live], slots[live], lens[live], pend[live]
        fins = self._finished
        self._finished = []
        nl, nf = rows.shape[0], len(fins)
        n_e = nl + nf
        counts = np.empty(n_e, np.int64)
        counts[:nl] = pend
        counts[nl:] = [t.shape[0] for *_, t in fins]
        budget = self.max_bytes - HEADER_BYTES
        keep_e = min(n_e, budget // ENTRY_BYTES)  # headers alone may not fit: FIN entries first, then in order
        if keep_e == n_e:
            kept = water_fill(counts, (budget - ENTRY_BYTES * n_e) // 4)
        else:
            order = np.concatenate([np.arange(nl, n_e), np.arange(nl)])[:keep_e]
            kept = np.zeros(n_e, np.int64)
            kept[order] = water_fill(counts[order], (budget - ENTRY_BYTES * keep_e) // 4)
        keys = np.empty(n_e, np.int64)
        ser = np.empty(n_e, np.int64)
        pos = np.empty(n_e, np.int64)
        fin = np.zeros(n_e, bool)
        keys[:nl] = self._k64[rows]
        ser[:nl] = self._ser[rows]
        pos[:nl] = lens - kept[:nl] - self._plen[rows]
        self._sent[rows] = lens
        for j, (k64, sr, p0, tail) in enumerate(fins):
            keys[nl + j], ser[nl + j], pos[nl + j] = k64, sr, p0 + tail.shape[0] - kept[nl + j]
            fin[nl + j] = True
        if keep_e < n_e:
            fin[np.setdiff1d(np.arange(n_e), order)] = False  # headers that did not fit: not sent
        m = (kept > 0) | fin
        idx = np.flatnonzero(m)
        e = idx.shape[0]
        ntok = int(kept.sum())
        hdr_end = 1 + ENTRY_INTS * e
        msg = np.empty(hdr_end + ntok, np.int32)
        msg[0] = e
        hdr = msg[1:hdr_end].reshape(e, ENTRY_INTS)
        hdr[:, 0:2] = keys[idx].view(np.int32).reshape(e, 2)
        hdr[:, 2] = ser[idx]
        hdr[:, 3] = pos[idx]
        hdr[:, 4] = kept[idx] | np.where(fin[idx], FIN, 0)
        kl = kept[:nl]
        o = K.gather_tails(self.p._SM, slots, lens - kl, lens, msg[hdr_end:]) if nl else 0
        for j, (*_, tail) in enumerate(fins):
            kj = int(kept[nl + j])
            if kj:
                msg[hdr_end + o: hdr_end + o + kj] = tail[tail.shape[0] - kj:]
                o += kj
        self._count(msg, e, ntok, int(counts.sum()) - ntok)
        return msg

    def merge(self, messages: Sequence[np.ndarray | None]) -> int:
        """Append the other ranks' tokens (``messages[r]`` = rank r's message) to shadow strings.

        Entries of groups without an automaton here are skipped. Returns tokens appended.
        """
        kg = self._key_group
        if self._known_version != self.p.groups_version:  # the groups held here changed: rebuild the filter
            self._known_version = self.p.groups_version
            for k in [k for k, g in kg.items() if not self.p.has_group(g)]:
                del kg[k]
            for g in self.p.group_ids():
                if g not in self._k64_of:
                    self._k64_of[g] = group_key64(g)
                kg[self._k64_of[g]] = g
            if len(self._k64_of) > 4 * len(kg) + 1024:
                self._k64_of = {g: k for k, g in kg.items()}
            self._known = np.sort(np.fromiter(kg.keys(), np.int64, len(kg)))
        parts = [np.asarray(m, np.int32) if m is not None else _NOMSG for m in messages]
        lens = np.fromiter((x.shape[0] for x in parts), np.int64, len(parts))
        starts = np.zeros(len(parts) + 1, np.int64)
        np.cumsum(lens, out=starts[1:])
        flat = np.concatenate(parts) if parts else _NOMSG
        cap = max(1, int(lens.sum()) // ENTRY_INTS + 1)
        keys, k64, pos, counts, tok_at = (np.empty(cap, np.int64) for _ in range(5))
        fin = np.empty(cap, np.bool_)
        ranks = np.arange(len(parts), dtype=np.int64)
        e = K.parse_messages(flat, starts, ranks, self.rank, keys, k64, pos, counts, fin, tok_at, self._known)
        if e < 0:
            raise ValueError("malformed sibling-exchange message (entry counts do not match the tokens)")
        if e == 0:
            return 0
        added = self.p.shadow_extend(keys[:e], lambda i: kg.get(int(k64[i])), pos[:e], counts[:e], flat,
                                     tok_at[:e], fin[:e])
        self.stats.tokens_merged += added
        return added


class GlooAllGather:
    """All-gather of int32 messages of any length over a CPU (gloo) ``torch.distributed`` group.

    Two collectives per call: the lengths (int64[world]), then the messages padded to the longest.
    Every rank of ``group`` must call ``__call__`` the same number of times, in the same order as its
    other collectives on that group.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(self, msg: np.ndarray) -> list[np.ndarray]:
        import torch

        dist = self.dist
        n = torch.tensor([int(msg.shape[0])], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=self.group)
        lens = [int(s.item()) for s in sizes]
        width = max(lens)
        buf = torch.zeros(width, dtype=torch.int32)
        buf[: msg.shape[0]] = torch.from_numpy(np.ascontiguousarray(msg, np.int32))
        outs = [torch.empty(width, dtype=torch.int32) for _ in range(self.world)]
        dist.all_gather(outs, buf, group=self.group)
        return [o.numpy()[:ln] for o, ln in zip(outs, lens, strict=True)]


__all__ = ("SiblingExchange", "GlooAllGather", "water_fill", "pack_message", "unpack_message", "group_key64",
           "Message", "ExchangeStats", "DEFAULT_MAX_BYTES")
