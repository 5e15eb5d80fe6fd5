"""Numba kernels of the suffix-automaton drafter (flat int32 arrays, no per-token Python objects).

Storage model (all token ids are int32 >= 0, all lengths in tokens):

* An *automaton* (slot ``a``) is a generalized, online suffix automaton over up to
  ``MAX_STRINGS`` strings (one request's prompt+accepted tokens, or one cached response).
  Its states live in four int32 arrays indexed by state id (state 0 is the root):
  ``L`` (longest length), ``K`` (suffix link, -1 for root), ``P`` (packed occurrence: string
  local index << 24 | end offset) and ``F`` (first outgoing edge, -1 for none).
  Non-root transitions are singly linked edge lists in ``ET`` (token), ``EG`` (target state),
  ``EN`` (next edge). Root transitions sit in an open-addressing hash ``RK``/``RV``
  (token -> state, -1 = empty slot) because the root's out-degree is the number of distinct tokens.
* A *string* (slot ``s``) owns its token buffer ``TOK[s]`` and scalars in per-slot arrays.

Every array is a member of a numba typed list indexed by slot, grown by 1.5x inside the kernels;
``stats[0]`` counts the bytes held by these arrays (capacity, not just used length).
"""

from __future__ import annotations

import numpy as np
from numba import njit

MAX_STRINGS = 127
OFFSET_BITS = 24
OFFSET_MASK = (1 << OFFSET_BITS) - 1
MAX_STRING_LEN = 1 << OFFSET_BITS


# ----------------------------------------------------------------------------------------- growth
@njit(cache=True)
def _grow(lst, a, need, stats):
    """Make ``lst[a]`` (int32 array) hold at least ``need`` elements; 1.5x growth; -1 filled."""
    arr = lst[a]
    old = arr.shape[0]
    if old >= need:
        return
    n = max(need, old + (old >> 1) + 16)
    new = np.full(n, -1, np.int32)
    new[:old] = arr
    stats[0] += (n - old) * 4
    lst[a] = new


@njit(cache=True)
def _ensure_states(a, need, AL, AK, AP, AF, stats):
    _grow(AL, a, need, stats)
    _grow(AK, a, need, stats)
    _grow(AP, a, need, stats)
    _grow(AF, a, need, stats)


@njit(cache=True)
def _ensure_edges(a, need, AET, AEG, AEN, stats):
    _grow(AET, a, need, stats)
    _grow(AEG, a, need, stats)
    _grow(AEN, a, need, stats)


@njit(cache=True)
def _hash_slot(tok, mask):
    return ((tok * 0x9E3779B1) >> 7) & mask


@njit(cache=True)
def _root_get(RK, RV, tok):
    cap = RK.shape[0]
    if cap == 0:
        return -1
    mask = cap - 1
    i = _hash_slot(tok, mask)
    while True:
        k = RK[i]
        if k == tok:
            return RV[i]
        if k == -1:
            return -1
        i = (i + 1) & mask


@njit(cache=True)
def _root_grow(a, ARK, ARV, stats):
    """Double the root hash of automaton ``a`` (power-of-2 table, min 16 slots) and rehash."""
    RK = ARK[a]
    RV = ARV[a]
    cap = RK.shape[0]
    ncap = max(16, cap * 2)
    nk = np.full(ncap, -1, np.int32)
    nv = np.full(ncap, -1, np.int32)
    m = ncap - 1
    for j in range(cap):
        if RK[j] != -1:
            i = _hash_slot(RK[j], m)
            while nk[i] != -1:
                i = (i + 1) & m
            nk[i] = RK[j]
            nv[i] = RV[j]
    stats[0] += (ncap - cap) * 8
    ARK[a] = nk
    ARV[a] = nv


@njit(cache=True)
def _edge_find(F, ET, EN, p, tok):
    e = F[p]
    while e != -1:
        if ET[e] == tok:
            return e
        e = EN[e]
    return -1


@njit(cache=True)
def _get(p, tok, F, ET, EG, EN, RK, RV):
    """Transition of state ``p`` by ``tok`` (-1 if absent), on local arrays."""
    if p == 0:
        return _root_get(RK, RV, tok)
    e = _edge_find(F, ET, EN, p, tok)
    if e == -1:
        return -1
    return EG[e]


@njit(cache=True)
def _add_edge(a, p, tok, val, F, ET, EG, EN, a_ne):
    """Prepend edge ``p --tok--> val`` (capacity ensured by the caller)."""
    e = a_ne[a]
    ET[e] = tok
    EG[e] = val
    EN[e] = F[p]
    F[p] = e
    a_ne[a] = e + 1


@njit(cache=True)
def _root_put_local(a, tok, val, RK, RV, a_rn):
    """Insert or overwrite root transition (room ensured: load stays <= 0.5)."""
    mask = RK.shape[0] - 1
    i = _hash_slot(tok, mask)
    while True:
        k = RK[i]
        if k == tok:
            RV[i] = val
            return
        if k == -1:
            RK[i] = tok
            RV[i] = val
            a_rn[a] += 1
            return
        i = (i + 1) & mask


@njit(cache=True)
def _set_existing(p, tok, val, F, ET, EG, EN, RK, RV):
    """Overwrite an existing transition of ``p`` by ``tok``."""
    if p == 0:
        mask = RK.shape[0] - 1
        i = _hash_slot(tok, mask)
        while RK[i] != tok:
            i = (i + 1) & mask
        RV[i] = val
        return
    EG[_edge_find(F, ET, EN, p, tok)] = val


@njit(cache=True)
def _new_state(a, length, link, pos, L, K, P, F, a_nst):
    """Append a state (capacity ensured by the caller)."""
    v = a_nst[a]
    L[v] = length
    K[v] = link
    P[v] = pos
    F[v] = -1
    a_nst[a] = v + 1
    return v


@njit(cache=True)
def _degree(F, EN, q):
    d = 0
    e = F[q]
    while e != -1:
        d += 1
        e = EN[e]
    return d


@njit(cache=True)
def _clone(a, q, length, L, K, P, F, ET, EG, EN, a_nst, a_ne):
    """Clone state ``q`` with a new length: copies link, position and all outgoing edges (room ensured)."""
    c = _new_state(a, length, K[q], P[q], L, K, P, F, a_nst)
    e = F[q]
    while e != -1:
        _add_edge(a, c, ET[e], EG[e], F, ET, EG, EN, a_ne)
        e = EN[e]
    return c


@njit(cache=True)
def sam_extend(a, last, tok, posval, L, K, P, F, ET, EG, EN, RK, RV, AET, AEG, AEN, ARK, ARV, a_nst, a_ne,
               a_rn, stats):
    """Append ``tok`` to the string whose current state is ``last`` (generalized online SAM).

    State arrays must have room for 2 more states; edge arrays and the root hash are grown here
    through the typed lists when needed. Returns (new_last, chain_start, grown): ``chain_start`` is
    the state of the longest suffix of the extended string that also ends somewhere else in the
    automaton (0 = only the empty suffix); ``grown`` tells the caller to re-fetch edge/root arrays.
    """
    grown = False
    q = _get(last, tok, F, ET, EG, EN, RK, RV)
    if q != -1:
        # The extended string already occurs in the automaton (another string, or a shared prompt).
        if L[q] == L[last] + 1:
            return q, q, grown
        need = a_ne[a] + _degree(F, EN, q)
        if need > ET.shape[0]:
            _ensure_edges(a, need, AET, AEG, AEN, stats)
            ET = AET[a]
            EG = AEG[a]
            EN = AEN[a]
            grown = True
        cl = _clone(a, q, L[last] + 1, L, K, P, F, ET, EG, EN, a_nst, a_ne)
        p = last
        while p != -1 and _get(p, tok, F, ET, EG, EN, RK, RV) == q:
            _set_existing(p, tok, cl, F, ET, EG, EN, RK, RV)
            p = K[p]
        K[q] = cl
        return cl, cl, grown
    # room for the new transitions: one per chain state lacking ``tok`` (root via the hash)
    cnt = 0
    root_new = 0
    p = last
    while p != -1 and _get(p, tok, F, ET, EG, EN, RK, RV) == -1:
        if p == 0:
            root_new = 1
        else:
            cnt += 1
        p = K[p]
    if a_ne[a] + cnt > ET.shape[0]:
        _ensure_edges(a, a_ne[a] + cnt, AET, AEG, AEN, stats)
        ET = AET[a]
        EG = AEG[a]
        EN = AEN[a]
        grown = True
    if root_new and (a_rn[a] + 1) * 2 > RK.shape[0]:
        _root_grow(a, ARK, ARV, stats)
        RK = ARK[a]
        RV = ARV[a]
        grown = True
    cur = _new_state(a, L[last] + 1, 0, posval, L, K, P, F, a_nst)
    p = last
    while p != -1:
        if p == 0:
            if _root_get(RK, RV, tok) != -1:
                break
            _root_put_local(a, tok, cur, RK, RV, a_rn)
        else:
            if _edge_find(F, ET, EN, p, tok) != -1:
                break
            _add_edge(a, p, tok, cur, F, ET, EG, EN, a_ne)
        p = K[p]
    if p == -1:
        K[cur] = 0
        return cur, 0, grown
    q = _get(p, tok, F, ET, EG, EN, RK, RV)
    if L[p] + 1 == L[q]:
        K[cur] = q
        return cur, q, grown
    need = a_ne[a] + _degree(F, EN, q)
    if need > ET.shape[0]:
        _ensure_edges(a, need, AET, AEG, AEN, stats)
        ET = AET[a]
        EG = AEG[a]
        EN = AEN[a]
        grown = True
    cl = _clone(a, q, L[p] + 1, L, K, P, F, ET, EG, EN, a_nst, a_ne)
    while p != -1 and _get(p, tok, F, ET, EG, EN, RK, RV) == q:
        _set_existing(p, tok, cl, F, ET, EG, EN, RK, RV)
        p = K[p]
    K[q] = cl
    K[cur] = cl
    return cur, cl, grown


@njit(cache=True)
def _has_cont(a, pos, auto_str, s_len):
    """True if the occurrence ``pos`` (packed) is followed by at least one token in its string."""
    g = auto_str[a, pos >> OFFSET_BITS]
    return (pos & OFFSET_MASK) + 1 < s_len[g]


# ------------------------------------------------------------------------------ per-string update
@njit(cache=True)
def _append_tokens(s, toks, n0, n1, budget, AL, AK, AP, AF, AET, AEG, AEN, ARK, ARV, a_nst, a_ne, a_rn,
                   ATOK, s_len, s_last, s_auto, s_local, s_cand, auto_str, stats, complete=False):
    """Append ``toks[n0:n1]`` to string ``s`` and its automaton; record the draft candidate.

    ``budget`` bounds the suffix-link ancestors whose occurrence is moved to the new end
    (0 = earliest-occurrence rule, large = exact most-recent rule). ``complete``: the string ends
    with this call (a cached response), so its last token, which has no continuation, is not made
    anyone's most recent occurrence.
    """
    a = s_auto[s]
    if n1 <= n0:
        return
    ln = s_len[s]
    _grow(ATOK, s, ln + (n1 - n0), stats)
    _ensure_states(a, a_nst[a] + 2 * (n1 - n0), AL, AK, AP, AF, stats)
    T = ATOK[s]
    L = AL[a]
    K = AK[a]
    P = AP[a]
    F = AF[a]
    ET = AET[a]
    EG = AEG[a]
    EN = AEN[a]
    RK = ARK[a]
    RV = ARV[a]
    local = s_local[s] << OFFSET_BITS
    last = s_last[s]
    cand_len = 0
    cand_pos = -1
    for i in range(n0, n1):
        tok = toks[i]
        T[ln] = tok
        ln += 1
        s_len[s] = ln
        posval = local | (ln - 1)
        last, x, grown = sam_extend(a, last, tok, posval, L, K, P, F, ET, EG, EN, RK, RV, AET, AEG, AEN, ARK, ARV,
                                    a_nst, a_ne, a_rn, stats)
        if grown:
            ET = AET[a]
            EG = AEG[a]
            EN = AEN[a]
            RK = ARK[a]
            RV = ARV[a]
        # Walk the suffix-link chain of the new end: the first state whose stored occurrence has a
        # continuation is the draft candidate; the first ``budget`` states get the new end as
        # their most recent occurrence (after being read).
        cand_len = 0
        cand_pos = -1
        steps = 0
        bud = 0 if complete and i == n1 - 1 else budget
        while x > 0 and (steps < bud or cand_pos == -1) and steps < bud + 8:
            old = P[x]
            if cand_pos == -1 and _has_cont(a, old, auto_str, s_len):
                cand_pos = old
                cand_len = L[x]
            if steps < bud:
                P[x] = posval
            x = K[x]
            steps += 1
    s_last[s] = last
    s_cand[s, 0] = cand_len
    s_cand[s, 1] = cand_pos


@njit(cache=True)
def _match_step(st, ln, tok, L, K, F, ET, EG, EN, RK, RV):
    """Matching statistics: extend the match (state ``st``, length ``ln``) by ``tok``.

    The automaton may have grown (states split) since the pointer was made: first move the pointer
    to the state that now holds strings of length ``ln``.
    """
    while st != 0 and L[K[st]] >= ln:
        st = K[st]
    while True:
        t = _get(st, tok, F, ET, EG, EN, RK, RV)
        if t != -1:
            return t, ln + 1
        if st == 0:
            return 0, 0
        st = K[st]
        ln = L[st]


@njit(cache=True)
def _cache_follow(s, toks, n0, n1, g, stamp, L, K, F, ET, EG, EN, RK, RV, cache_stamp, cp, cp_stamp, ATOK, s_len,
                  resync):
    """Advance string ``s``'s match pointer into cache automaton ``g`` (stamp ``stamp``) by ``toks[n0:n1]``.

    A pointer made for a cache generation that is gone is reset and re-fed with the last
    ``resync`` tokens of the string.
    """
    j = -1
    for jj in range(2):
        if cp_stamp[s, jj] == stamp:
            j = jj
    if j == -1:
        for jj in range(2):
            if cp_stamp[s, jj] != cache_stamp[0] and cp_stamp[s, jj] != cache_stamp[1]:
                j = jj
        cp_stamp[s, j] = stamp
        st = 0
        ln = 0
        T = ATOK[s]
        end = s_len[s] - (n1 - n0)
        for i in range(max(0, end - resync), end):
            st, ln = _match_step(st, ln, T[i], L, K, F, ET, EG, EN, RK, RV)
    else:
        st = cp[s, j, 0]
        ln = cp[s, j, 1]
    for i in range(n0, n1):
        st, ln = _match_step(st, ln, toks[i], L, K, F, ET, EG, EN, RK, RV)
    cp[s, j, 0] = st
    cp[s, j, 1] = ln


@njit(cache=True)
def extend_batch(slots, toks, offs, budget, resync, AL, AK, AP, AF, AET, AEG, AEN, ARK, ARV, a_nst, a_ne, a_rn,
                 ATOK, s_len, s_last, s_auto, s_local, s_cand, auto_str, cache_auto, cache_stamp, cp, cp_stamp,
                 stats, complete):
    """Append ``toks[offs[i]:offs[i+1]]`` to string ``slots[i]`` for every i (one decode step).

    ``complete``: the strings end here (cache insertion), see ``_append_tokens``.
    """
    for i in range(slots.shape[0]):
        s = slots[i]
        n0 = offs[i]
        n1 = offs[i + 1]
        if n1 <= n0:
            continue
        _append_tokens(s, toks, n0, n1, budget, AL, AK, AP, AF, AET, AEG, AEN, ARK, ARV, a_nst, a_ne, a_rn,
                       ATOK, s_len, s_last, s_auto, s_local, s_cand, auto_str, stats, complete)
    # cache automata do not change during a batch: fetch their arrays once per generation
    for g in range(2):
        ca = cache_auto[g]
        if ca < 0:
            continue
        L = AL[ca]
        K = AK[ca]
        F = AF[ca]
        ET = AET[ca]
        EG = AEG[ca]
        EN = AEN[ca]
        RK = ARK[ca]
        RV = ARV[ca]
        for i in range(slots.shape[0]):
            n0 = offs[i]
            n1 = offs[i + 1]
            if n1 <= n0:
                continue
            _cache_follow(slots[i], toks, n0, n1, g, cache_stamp[g], L, K, F, ET, EG, EN, RK, RV, cache_stamp, cp,
                          cp_stamp, ATOK, s_len, resync)


@njit(cache=True)
def _emit(a, pos, k, auto_str, s_len, ATOK, out, row):
    g = auto_str[a, pos >> OFFSET_BITS]
    off = (pos & OFFSET_MASK) + 1
    n = min(k, s_len[g] - off)
    T = ATOK[g]
    for j in range(n):
        out[row, j] = T[off + j]
    return max(n, 0)


@njit(cache=True)
def propose_batch(slots, k, min_match, use_cache, AL, AK, AP, s_auto, s_cand, auto_str, s_len, ATOK,
                  cache_auto, cache_stamp, cp, cp_stamp, out, out_n):
    """Drafts for strings ``slots``: up to ``k`` tokens after the chosen occurrence of the longest match.

    Candidates: the string's own automaton (own text and, in group mode, running siblings) and the
    two cache generations. Longest match wins; ties go to the own automaton. ``out``: int32[n, k];
    ``out_n``: int32[n] number of valid tokens per row.
    """
    n = slots.shape[0]
    best_len = np.empty(n, np.int64)
    best_pos = np.empty(n, np.int64)
    best_a = np.empty(n, np.int64)
    for i in range(n):
        s = slots[i]
        best_len[i] = s_cand[s, 0]
        best_pos[i] = s_cand[s, 1]
        best_a[i] = s_auto[s]
    if use_cache:
        for g in range(2):
            ca = cache_auto[g]
            if ca < 0:
                continue
            L = AL[ca]
            K = AK[ca]
            P = AP[ca]
            for i in range(n):
                s = slots[i]
                for j in range(2):
                    if cp_stamp[s, j] != cache_stamp[g]:
                        continue
                    st = cp[s, j, 0]
                    ln = cp[s, j, 1]
                    while st != 0 and L[K[st]] >= ln:
                        st = K[st]
                    tries = 0
                    while st > 0 and tries < 4 and ln > best_len[i]:
                        if _has_cont(ca, P[st], auto_str, s_len):
                            best_len[i] = ln
                            best_pos[i] = P[st]
                            best_a[i] = ca
                            break
                        st = K[st]
                        ln = L[st]
                        tries += 1
    for i in range(n):
        if best_len[i] < min_match or best_pos[i] < 0:
            out_n[i] = 0
            continue
        out_n[i] = _emit(best_a[i], best_pos[i], k, auto_str, s_len, ATOK, out, i)


@njit(cache=True)
def brute_force_propose(text, k, rule):
    """Reference: longest suffix of ``text`` that also ends earlier, by scanning every end position.

    rule 0 = earliest occurrence, 1 = most recent. Returns (match_len, end_pos, draft int32[<=k]).
    O(len(text) * match length); used by tests only.
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
