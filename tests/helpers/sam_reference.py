"""Test-only references and checks of the SAM drafter (``qwen3_rl/spec_decode``): a brute-force drafter,
the hub-index consistency kernel and the proposer's storage invariants."""

from __future__ import annotations

import numpy as np
from numba import njit

from qwen3_rl.spec_decode import _sam_kernels as K
from qwen3_rl.spec_decode.sam import SamProposer


@njit(cache=True)
def brute_force_propose(text, k, rule):
    """Reference: longest suffix of ``text`` that also ends earlier, by scanning every end position.

    rule 0 = earliest occurrence, 1 = most recent. Returns (match_len, end_pos, draft int32[<=k]).
    O(len(text) * match length).
    """
    t = text.shape[0]
    best = 0
    best_e = -1
    for e in range(t - 1):
        m = 0
        while m <= e and text[e - m] == text[t - 1 - m]:
            m += 1
        if m > best or (m == best and m > 0 and rule == 1):
            best = m
            best_e = e
    if best == 0:
        return 0, -1, np.empty(0, np.int32)
    n = min(k, t - best_e - 1)
    return best, best_e, text[best_e + 1:best_e + 1 + n].copy()


@njit(cache=True)
def hub_check(S, E, H, hcap, nst):
    """Consistency of the hub index: returns (hubs, indexed edges), or (-1 - state, -1) for a hub edge the
    index does not find or whose target differs."""
    hubs = 0
    edges = 0
    for p in range(1, nst):
        if S[K.SREC * p + K.S_FIRST] >= -1:
            continue
        hubs += 1
        e = K._head(S, p)
        while e != -1:
            i = K._hub_find(H, hcap, p, E[K.EREC * e + K.E_TOK])
            if i < 0 or H[K.HREC * i + K.H_EDGE] != e or H[K.HREC * i + K.H_TGT] != E[K.EREC * e + K.E_TGT]:
                return -1 - p, -1
            edges += 1
            e = E[K.EREC * e + K.E_NEXT]
    return hubs, edges


def check_invariants(p: SamProposer) -> None:
    """Assert that every count of ``p`` fits its array, that the hub index matches the edge lists and that
    the byte count is exact (O(slots))."""
    for a in p._autos:
        am = p._AM[a]
        assert am[K.A_NST] <= am[K.A_SCAP] and K.SREC * am[K.A_SCAP] == p._arrS[a].shape[0], a
        assert am[K.A_NE] <= am[K.A_ECAP] and K.EREC * am[K.A_ECAP] == p._arrE[a].shape[0], a
        assert 2 * am[K.A_RN] <= am[K.A_RCAP] and K.RREC * am[K.A_RCAP] == p._arrR[a].shape[0], a
        assert 2 * am[K.A_HN] <= am[K.A_HCAP] and K.HREC * am[K.A_HCAP] == p._arrH[a].shape[0], a
        hubs, indexed = hub_check(p._arrS[a], p._arrE[a], p._arrH[a], am[K.A_HCAP], am[K.A_NST])
        assert hubs >= 0 and indexed == am[K.A_HN], (a, hubs, indexed, am[K.A_HN])
        for s in p._autos[a].strings:
            assert p._SM[s, K.M_LEN] <= p._SM[s, K.M_TCAP] == p._arrT[s].shape[0], s
    held = sum(x.nbytes for lst in (p._arrS, p._arrE, p._arrR, p._arrH, p._arrT) for x in lst)
    assert held == p._nbytes, (held, p._nbytes)


def num_hubs(p: SamProposer) -> int:
    """States of ``p`` whose transitions are indexed by the hub hash."""
    return sum(int(hub_check(p._arrS[a], p._arrE[a], p._arrH[a], p._AM[a, K.A_HCAP], p._AM[a, K.A_NST])[0])
               for a in p._autos)


def step_from_buffer(p: SamProposer, slots: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
                     rows: np.ndarray | None = None, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One decode step of ``p`` in one kernel call reading a runner-like token buffer (int32[rows, max_len]):
    request i's new tokens are ``token_ids[rows[i], len_i:num_tokens[i]]`` (``len_i`` = the tokens ``p``
    holds; rows default 0..n-1), passed to the kernel as ranges (its own range checks apply). Returns the
    (drafts int32[n, k], counts int32[n]) buffers of ``p`` (reused by its next call)."""
    k = k or p.config.num_speculative_tokens
    slots = np.asarray(slots, np.int64)
    n = slots.shape[0]
    rows = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    buf = np.asarray(token_ids, np.int32)
    starts = p._SM[slots, K.M_LEN]
    ends = np.asarray(num_tokens, np.int64)[:n]
    p._out_buffers(n, k)
    p._run(slots, buf, rows, starts, ends, k=k)
    return p._drafts(n)
