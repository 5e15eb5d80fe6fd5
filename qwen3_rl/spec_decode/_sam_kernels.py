"""Numba kernels of the suffix-automaton drafter (flat int32 records, no per-token Python objects).

Storage model (all token ids are int32 >= 0, all lengths in tokens):

* An *automaton* (slot ``a``) is a generalized, online suffix automaton over up to
  ``MAX_STRINGS`` strings (one request's prompt+accepted tokens, or one cached response).
  Its arrays (int32, owned by Python, reached here through their addresses in ``AM[a]``):

  - ``S``: state records of 4 int32 ``[L, K, P, F]`` (longest length, suffix link (-1 for the root),
    packed occurrence = string local index << 24 | end offset, first outgoing edge (-1 = none)).
    One 16-byte record = one cache line touched per state visit.
  - ``E``: non-root transitions, records of 3 int32 ``[token, target, next]`` (singly linked list
    per state, kept in move-to-front order: a found edge moves to the head of its list).
  - ``R``: root transitions, open-addressing hash of ``[token, state]`` pairs (power-of-2 slots,
    token -1 = empty, load <= 0.5), because the root's out-degree is the number of distinct tokens.
  - ``H``: transition index of *hub* states (out-degree >= ``HUB_DEGREE``), open-addressing hash of
    ``[state, token, target, edge]`` records (power-of-2 slots, state -1 = empty, load <= 0.5; one
    16-byte record, so a hit costs one line like a list head). A hub keeps its edge list (enumeration
    for clones and degrees; targets kept equal in both) and is marked by ``F = -(head + 2)``; its
    lookups probe ``H`` instead of walking the list. A state becomes a hub when a lookup walks
    ``HUB_DEGREE`` or more of its edges and ``H`` has room (else the automaton records the room it
    wants in ``AM[a, A_HWANT]`` and the caller grows ``H`` after the call): the index is a cache of the
    lists, so making a hub never changes what a lookup returns.

* A *string* (slot ``s``) owns a token buffer ``T`` (int32, address in ``SM[s]``) and its scalars
  in the row ``SM[s]`` (one 128-byte record: length, last state, automaton, ...).

Invariants the kernels rely on (kept by every kernel that mutates; ``tests/helpers/sam_reference.py``
``check_invariants`` asserts the storage ones after every step of the tests):

* State 0 is the root: ``L = 0``, link -1, its transitions only in ``R``. For every other state
  ``L[link[p]] < L[p]``, so suffix-link walks end at the root; a transition ``p --tok--> q`` implies
  ``L[q] >= L[p] + 1`` ("solid" when equal: no clone needed when ``q`` is reached again).
* ``P`` of a state is an end position (string local index, offset) of one of its strings, in a string of
  the same automaton (a clone inherits its original's); a candidate is drafted from only if the token
  after it exists (``_has_cont``). With rule "recent" the first ``budget`` suffix-link ancestors of a new
  end are re-pointed to it, so ``P`` is never older than a real occurrence.
* A string's ``M_LAST`` state has ``L == M_LEN`` (its whole text), and ``T[0:M_LEN]`` is that text.
* Counts never exceed capacities (``A_NST <= A_SCAP``, ``A_NE <= A_ECAP``); the hashes ``R`` and ``H``
  keep load <= 0.5 (``2 * A_RN <= A_RCAP``, ``2 * A_HN <= A_HCAP``, power-of-2 capacities), so every
  probe meets an empty slot and ends.
* A state is a hub iff its ``F < -1``; then every edge of its list is in ``H`` with the same target, and
  ``A_HN`` counts exactly those indexed edges.
* A string's cache pointer (``M_CST``, ``M_CLN``) is exact for the cache automaton of stamp ``M_CSTAMP``
  when that automaton had ``M_CVER`` states; after growth ``_match_fix`` restores it.

Arrays are allocated and grown by the Python side (``sam.py``); a kernel that finds an array too
small stops *before* mutating anything for the token at hand, records the request of growth in
``grow`` and its progress in ``prog`` and returns, and the caller grows and calls again. One decode
step for a whole batch is therefore a single kernel call (plus rare growth round trips).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic


def _cache_probe() -> int:
    return 0


def _cache_usable() -> bool:
    """Whether the kernels use numba's disk cache (``cache=True``).

    Off under ``NUMBA_BOUNDSCHECK=1``: numba's cache key does not include the bounds-check switch, so a
    checked run could load unchecked machine code (and a later unchecked run checked code). Off as well
    when numba finds no writable cache location for this file (``__pycache__``, ``NUMBA_CACHE_DIR`` or the
    user-wide cache): numba would raise at import; the kernels then compile in every process (the
    drafter's load-time warm-up still keeps that out of the first decode step).
    """
    if numba_config.BOUNDSCHECK:
        return False
    try:
        njit(cache=True)(_cache_probe)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return False
    return True


#: ``cache=`` of every kernel of this module (see ``_cache_usable``).
CACHE = _cache_usable()

MAX_STRINGS = 127
OFFSET_BITS = 24
OFFSET_MASK = (1 << OFFSET_BITS) - 1
MAX_STRING_LEN = 1 << OFFSET_BITS

I32 = 4  # bytes per int32 (address arithmetic: record i of a table at address b starts at b + I32 * REC * i)
SREC = 4  # state record: L, K, P, F
S_LEN, S_LINK, S_POS, S_FIRST = range(SREC)  # longest length, suffix link, packed occurrence, first edge
EREC = 3  # edge record: token, target, next
E_TOK, E_TGT, E_NEXT = range(EREC)
RREC = 2  # root hash slot: token, state
R_TOK, R_STATE = range(RREC)
HREC = 4  # hub index slot: state, token, target, edge
H_STATE, H_TOK, H_TGT, H_EDGE = range(HREC)
HUB_DEGREE = 8  # default of AM[a, A_HUBDEG]: a lookup walking this many edges makes a state a hub (0 = never)

# automaton meta row AM[a, :] (int64)
A_S, A_SCAP, A_NST, A_E, A_ECAP, A_NE, A_R, A_RCAP, A_RN, A_NEED_S, A_NEED_E, A_NEED_R, A_H, A_HCAP, A_HN, \
    A_HWANT, A_HUBDEG = range(17)
AM_COLS = 24
# string meta row SM[s, :] (int64). The cache pointer: state and match length in the cache automaton, the
# stamp of the cache it was made for (another stamp = re-feed) and that cache's state count when the pointer was
# last exact (the same count = the cache has not grown since: no fix-up needed)
M_T, M_TCAP, M_LEN, M_LAST, M_AUTO, M_LOCAL, M_CLEN, M_CPOS, M_CST, M_CLN, M_CSTAMP, M_CVER = range(12)
SM_COLS = 16
# growth request kinds (grow[i] = kind, slot, elements needed)
G_TOK, G_STATES, G_EDGES, G_ROOT, G_HUB = range(5)
BAD_RANGE, TOO_LONG = -1, -2  # extend_batch / step_batch return codes for bad input (nothing changed)
WARM_MAX_TOKENS = 8  # tokens per request the read-only warm-up pass walks ahead
WARM_LANES = 16  # default of knob KN_WARM_LANES: interleaved warm-up walks (0 = no warm-up pass)
WARM_HOPS = 2  # default of knob KN_WARM_HOPS: suffix links a warm-up walk follows after each token
# Phases of one warm-up lane (``warm_batch``): the next dependent load the lane makes.
WP_STATE = 0  # read the record of the current state (then one of the probes below)
WP_EDGE = 1  # compare the current edge of the state's list
WP_ROOT = 2  # probe the root hash
WP_HOPS = 3  # follow the reached state's suffix links (occurrence update walk), then the next token
WP_HUB = 4  # probe the hub index
WP_CLONE = 5  # walk the edge list a clone of the reached state will copy
WP_LINK_HEAD = 6  # the first lookup line of the found state's suffix link (the first redirect)
# knobs of extend_batch / step_batch (int64[KNOB_COLS]; speed and test switches, never change a draft)
KN_PRECHECK, KN_WARM_LANES, KN_WARM_HOPS, KN_CACHE_FIX_EACH = range(4)
KNOB_COLS = 4


# ------------------------------------------------------------------------------------ raw views
@intrinsic
def _i32_ptr(typingctx, addr):
    """int64 address -> int32* (the Python side keeps the owning numpy array alive)."""
    if not isinstance(addr, types.Integer):
        return None
    ptr_t = types.CPointer(types.int32)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_t))

    return ptr_t(addr), codegen


@intrinsic
def _prefetch(typingctx, addr):
    """Hint the CPU to load the cache line at ``addr`` (int64 address; never faults)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(addr), codegen


@njit(cache=CACHE)
def _view(addr, n):
    """int32[n] view of the buffer at ``addr`` (n elements)."""
    return carray(_i32_ptr(addr), n)


@njit(cache=CACHE)
def _auto_views(AM, a):
    S = _view(AM[a, A_S], AM[a, A_SCAP] * SREC)
    E = _view(AM[a, A_E], AM[a, A_ECAP] * EREC)
    R = _view(AM[a, A_R], AM[a, A_RCAP] * RREC)
    H = _view(AM[a, A_H], AM[a, A_HCAP] * HREC)
    return S, E, R, H


# ----------------------------------------------------------------------------- transitions
@njit(cache=CACHE, inline="always")
def _hash_slot(tok, mask):
    return ((tok * 0x9E3779B1) >> 7) & mask


@njit(cache=CACHE, inline="always")
def _root_find(R, rcap, tok):
    """Slot of ``tok`` in the root hash, -1 if absent."""
    if rcap == 0:
        return -1
    mask = rcap - 1
    i = _hash_slot(tok, mask)
    while True:
        k = R[RREC * i + R_TOK]
        if k == tok:
            return i
        if k == -1:
            return -1
        i = (i + 1) & mask


@njit(cache=CACHE, inline="always")
def _head(S, p):
    """First edge of state ``p`` (-1 = none), hub mark removed."""
    f = S[SREC * p + S_FIRST]
    return f if f >= -1 else -f - 2


@njit(cache=CACHE, inline="always")
def _set_head(S, p, e):
    """Make edge ``e`` the first edge of ``p``, keeping the hub mark."""
    S[SREC * p + S_FIRST] = e if S[SREC * p + S_FIRST] >= -1 else -e - 2


@njit(cache=CACHE, inline="always")
def _hub_slot(p, tok, mask):
    x = (p & 0xFFFFFF) * 0x9E3779B1 ^ (tok & 0x7FFFFFFF) * 0x85EBCA6B
    x ^= x >> 29
    return (x >> 7) & mask


@njit(cache=CACHE, inline="always")
def _hub_find(H, hcap, p, tok):
    """Index slot of hub ``p``'s transition by ``tok`` (-1 if absent)."""
    mask = hcap - 1
    i = _hub_slot(p, tok, mask)
    while True:
        st = H[HREC * i + H_STATE]
        if st == -1:
            return -1
        if st == p and H[HREC * i + H_TOK] == tok:
            return i
        i = (i + 1) & mask


@njit(cache=CACHE, inline="always")
def _hub_put(H, hcap, p, tok, val, e):
    """Index edge ``e`` = ``p --tok--> val`` (absent before; room ensured)."""
    mask = hcap - 1
    i = _hub_slot(p, tok, mask)
    while H[HREC * i + H_STATE] != -1:
        i = (i + 1) & mask
    H[HREC * i + H_STATE] = p
    H[HREC * i + H_TOK] = tok
    H[HREC * i + H_TGT] = val
    H[HREC * i + H_EDGE] = e


@njit(cache=CACHE)
def _make_hub(AM, a, S, E, H, p):
    """Index every edge of ``p`` in ``H`` if it has room, else record the room wanted. Semantics unchanged."""
    d = _degree(S, E, p)
    hn = AM[a, A_HN]
    if (hn + d + 1) * 2 > AM[a, A_HCAP]:
        AM[a, A_HWANT] = max(AM[a, A_HWANT], hn + d + 1)
        return
    hcap = AM[a, A_HCAP]
    e = _head(S, p)
    while e != -1:
        _hub_put(H, hcap, p, E[EREC * e + E_TOK], E[EREC * e + E_TGT], e)
        e = E[EREC * e + E_NEXT]
    S[SREC * p + S_FIRST] = -S[SREC * p + S_FIRST] - 2
    AM[a, A_HN] = hn + d


@njit(cache=CACHE, inline="always")
def _edge_find(AM, a, S, E, H, p, tok):
    """Edge of non-root state ``p`` labelled ``tok`` (-1 if absent).

    Hubs: one probe of ``H``. Others: list walk, a found edge moves to the front; a walk of
    ``HUB_DEGREE`` or more edges makes ``p`` a hub.
    """
    f = S[SREC * p + S_FIRST]
    if f < -1:
        i = _hub_find(H, AM[a, A_HCAP], p, tok)
        return -1 if i < 0 else H[HREC * i + H_EDGE]
    e = f
    prev = -1
    steps = 0
    while e != -1:
        if E[EREC * e + E_TOK] == tok:
            if prev != -1:
                E[EREC * prev + E_NEXT] = E[EREC * e + E_NEXT]
                E[EREC * e + E_NEXT] = S[SREC * p + S_FIRST]
                S[SREC * p + S_FIRST] = e
            if steps >= AM[a, A_HUBDEG] > 0:
                _make_hub(AM, a, S, E, H, p)
            return e
        prev = e
        e = E[EREC * e + E_NEXT]
        steps += 1
    if steps >= AM[a, A_HUBDEG] > 0:
        _make_hub(AM, a, S, E, H, p)
    return -1


@njit(cache=CACHE, inline="always")
def _get(AM, a, S, E, R, H, p, tok):
    """Transition of state ``p`` by ``tok`` (-1 if absent)."""
    if p == 0:
        i = _root_find(R, AM[a, A_RCAP], tok)
        return -1 if i < 0 else R[RREC * i + R_STATE]
    if S[SREC * p + S_FIRST] < -1:
        i = _hub_find(H, AM[a, A_HCAP], p, tok)
        return -1 if i < 0 else H[HREC * i + H_TGT]
    e = _edge_find(AM, a, S, E, H, p, tok)
    return -1 if e < 0 else E[EREC * e + E_TGT]


@njit(cache=CACHE, inline="always")
def _redirect(AM, a, S, E, R, H, p, tok, q, val):
    """If ``p --tok--> q``, point it to ``val`` and return True."""
    if p == 0:
        i = _root_find(R, AM[a, A_RCAP], tok)
        if i >= 0 and R[RREC * i + R_STATE] == q:
            R[RREC * i + R_STATE] = val
            return True
        return False
    if S[SREC * p + S_FIRST] < -1:
        i = _hub_find(H, AM[a, A_HCAP], p, tok)
        if i >= 0 and H[HREC * i + H_TGT] == q:
            H[HREC * i + H_TGT] = val
            E[EREC * H[HREC * i + H_EDGE] + 1] = val
            return True
        return False
    e = _edge_find(AM, a, S, E, H, p, tok)
    if e >= 0 and E[EREC * e + E_TGT] == q:
        E[EREC * e + E_TGT] = val
        if S[SREC * p + S_FIRST] < -1:  # the lookup just made p a hub: its index holds the old target
            H[HREC * _hub_find(H, AM[a, A_HCAP], p, tok) + H_TGT] = val
        return True
    return False


@njit(cache=CACHE, inline="always")
def _add_edge(AM, a, S, E, H, ne, p, tok, val):
    """Prepend edge ``p --tok--> val`` at edge index ``ne`` (room ensured, hub index too); returns ne + 1."""
    E[EREC * ne + E_TOK] = tok
    E[EREC * ne + E_TGT] = val
    E[EREC * ne + E_NEXT] = _head(S, p)
    _set_head(S, p, ne)
    if S[SREC * p + S_FIRST] < -1:
        _hub_put(H, AM[a, A_HCAP], p, tok, val, ne)
        AM[a, A_HN] += 1
    return ne + 1


@njit(cache=CACHE, inline="always")
def _root_put(R, rcap, tok, val):
    """Insert a new root transition (absent before; room ensured). Returns 1."""
    mask = rcap - 1
    i = _hash_slot(tok, mask)
    while R[RREC * i + R_TOK] != -1:
        i = (i + 1) & mask
    R[RREC * i + R_TOK] = tok
    R[RREC * i + R_STATE] = val
    return 1


@njit(cache=CACHE, inline="always")
def _degree(S, E, q):
    d = 0
    e = _head(S, q)
    while e != -1:
        d += 1
        e = E[EREC * e + E_NEXT]
    return d


@njit(cache=CACHE)
def root_rehash(old, new):
    """Insert every pair of root hash ``old`` into the empty (-1 filled) power-of-2 hash ``new``."""
    ncap = new.shape[0] // RREC
    m = ncap - 1
    for j in range(old.shape[0] // RREC):
        t = old[RREC * j + R_TOK]
        if t != -1:
            i = _hash_slot(t, m)
            while new[RREC * i + R_TOK] != -1:
                i = (i + 1) & m
            new[RREC * i + R_TOK] = t
            new[RREC * i + R_STATE] = old[RREC * j + R_STATE]


@njit(cache=CACHE)
def hub_rehash(old, new):
    """Insert every record of hub index ``old`` into the empty (-1 filled) power-of-2 index ``new``."""
    ncap = new.shape[0] // HREC
    for j in range(old.shape[0] // HREC):
        p = old[HREC * j + H_STATE]
        if p != -1:
            _hub_put(new, ncap, p, old[HREC * j + H_TOK], old[HREC * j + H_TGT], old[HREC * j + H_EDGE])


# ------------------------------------------------------------------------------- extension
@njit(cache=CACHE)
def sam_extend(AM, a, S, E, R, H, last, tok, posval):
    """Append ``tok`` to the string whose current state is ``last`` (generalized online SAM).

    Checks room first and mutates nothing if an array is too small. Returns
    ``(new_last, chain_start, grow_kind, grow_need)``: ``chain_start`` is the state of the longest
    suffix of the extended string that also ends somewhere else in the automaton (0 = only the
    empty suffix); ``grow_kind`` >= 0 (with ``new_last`` = -1) asks for growth of that array to
    ``grow_need`` elements.
    """
    rcap = AM[a, A_RCAP]
    nst = AM[a, A_NST]
    ne = AM[a, A_NE]
    if nst + 2 > AM[a, A_SCAP]:
        return -1, 0, G_STATES, nst + 2
    ecap = AM[a, A_ECAP]
    Llast = S[SREC * last + S_LEN]
    q = _get(AM, a, S, E, R, H, last, tok)
    if q != -1:
        # The extended string already occurs in the automaton (another string, or a shared prompt).
        if S[SREC * q + S_LEN] == Llast + 1:
            return q, q, -1, 0
        d = _degree(S, E, q)
        if ne + d > ecap:
            return -1, 0, G_EDGES, ne + d
        cl = nst
        ne = _clone(AM, a, S, E, H, ne, q, cl, Llast + 1)
        p = last
        while p != -1 and _redirect(AM, a, S, E, R, H, p, tok, q, cl):
            p = S[SREC * p + S_LINK]
        S[SREC * q + S_LINK] = cl
        AM[a, A_NST] = nst + 1
        AM[a, A_NE] = ne
        return cl, cl, -1, 0
    # plan: states lacking ``tok`` on the suffix-link chain get a new transition
    cnt = 0
    hubs = 0
    root_new = 0
    p = last
    q = -1
    while p != -1:
        q = _get(AM, a, S, E, R, H, p, tok)
        if q != -1:
            break
        if p == 0:
            root_new = 1
        else:
            cnt += 1
            if S[SREC * p + S_FIRST] < -1:
                hubs += 1
        p = S[SREC * p + S_LINK]
    need_e = ne + cnt
    clone = False
    if p != -1 and S[SREC * p + S_LEN] + 1 != S[SREC * q + S_LEN]:
        clone = True
        # q may itself lie on the chain below p and gain the new edge before being cloned
        need_e += _degree(S, E, q) + 1
    if need_e > ecap:
        return -1, 0, G_EDGES, need_e
    if root_new and (AM[a, A_RN] + 1) * 2 > rcap:
        return -1, 0, G_ROOT, AM[a, A_RN] + 1
    if hubs and (AM[a, A_HN] + hubs) * 2 > AM[a, A_HCAP]:
        return -1, 0, G_HUB, AM[a, A_HN] + hubs
    # mutate
    cur = nst
    S[SREC * cur + S_LEN] = Llast + 1
    S[SREC * cur + S_LINK] = 0
    S[SREC * cur + S_POS] = posval
    S[SREC * cur + S_FIRST] = -1
    nst += 1
    x = last
    while x != p:
        if x == 0:
            AM[a, A_RN] += _root_put(R, rcap, tok, cur)
        else:
            ne = _add_edge(AM, a, S, E, H, ne, x, tok, cur)
        x = S[SREC * x + S_LINK]
    chain = 0
    if p != -1:
        if not clone:
            S[SREC * cur + S_LINK] = q
            chain = q
        else:
            cl = nst
            nst += 1
            ne = _clone(AM, a, S, E, H, ne, q, cl, S[SREC * p + S_LEN] + 1)
            while p != -1 and _redirect(AM, a, S, E, R, H, p, tok, q, cl):
                p = S[SREC * p + S_LINK]
            S[SREC * q + S_LINK] = cl
            S[SREC * cur + S_LINK] = cl
            chain = cl
    AM[a, A_NST] = nst
    AM[a, A_NE] = ne
    return cur, chain, -1, 0


@njit(cache=CACHE)
def _clone(AM, a, S, E, H, ne, q, c, length):
    """Make state ``c`` a clone of ``q`` with length ``length`` (link, occurrence and all edges; not a hub)."""
    S[SREC * c + S_LEN] = length
    S[SREC * c + S_LINK] = S[SREC * q + S_LINK]
    S[SREC * c + S_POS] = S[SREC * q + S_POS]
    S[SREC * c + S_FIRST] = -1
    e = _head(S, q)
    while e != -1:
        ne = _add_edge(AM, a, S, E, H, ne, c, E[EREC * e + E_TOK], E[EREC * e + E_TGT])
        e = E[EREC * e + E_NEXT]
    return ne


@njit(cache=CACHE, inline="always")
def _has_cont(SM, auto_str, a, pos):
    """True if the occurrence ``pos`` (packed) is followed by at least one token in its string."""
    g = auto_str[a, pos >> OFFSET_BITS]
    return (pos & OFFSET_MASK) + 1 < SM[g, M_LEN]


@njit(cache=CACHE)
def _append_tokens(AM, SM, auto_str, s, buf, row, j0, j1, budget, complete, prog, grow):
    """Append ``buf[row, j0:j1]`` to string ``s`` and its automaton; record the draft candidate.

    ``budget`` bounds the suffix-link ancestors whose occurrence is moved to the new end
    (0 = earliest-occurrence rule, large = exact most-recent rule). ``complete``: the string ends
    with this call (a cached response), so its last token, which has no continuation, is not made
    anyone's most recent occurrence. Returns the number of growth requests written (0 = done);
    on a shortage ``prog[1]`` is the first token not appended.
    """
    a = SM[s, M_AUTO]
    ln = SM[s, M_LEN]
    if ln + (j1 - j0) > SM[s, M_TCAP]:
        grow[0, 0] = G_TOK
        grow[0, 1] = s
        grow[0, 2] = ln + (j1 - j0)
        prog[1] = j0
        return 1
    T = _view(SM[s, M_T], SM[s, M_TCAP])
    S, E, R, H = _auto_views(AM, a)
    local = SM[s, M_LOCAL] << OFFSET_BITS
    last = SM[s, M_LAST]
    cand_len = SM[s, M_CLEN]
    cand_pos = SM[s, M_CPOS]
    for j in range(j0, j1):
        tok = buf[row, j]
        posval = local | ln
        nl, x, kind, need = sam_extend(AM, a, S, E, R, H, last, tok, posval)
        if kind >= 0:
            grow[0, 0] = kind
            grow[0, 1] = a
            grow[0, 2] = need
            prog[1] = j
            SM[s, M_LAST] = last
            SM[s, M_CLEN] = cand_len
            SM[s, M_CPOS] = cand_pos
            return 1
        last = nl
        T[ln] = tok
        ln += 1
        SM[s, M_LEN] = ln
        # Walk the suffix-link chain of the new end: the first state whose stored occurrence has a
        # continuation is the draft candidate; the first ``budget`` states get the new end as
        # their most recent occurrence (after being read).
        cand_len = 0
        cand_pos = -1
        steps = 0
        bud = 0 if complete and j == j1 - 1 else budget
        while x > 0 and (steps < bud or cand_pos == -1) and steps < bud + 8:
            old = S[SREC * x + S_POS]
            if cand_pos == -1 and _has_cont(SM, auto_str, a, old):
                cand_pos = old
                cand_len = S[SREC * x + S_LEN]
            if steps < bud:
                S[SREC * x + S_POS] = posval
            x = S[SREC * x + S_LINK]
            steps += 1
    SM[s, M_LAST] = last
    SM[s, M_CLEN] = cand_len
    SM[s, M_CPOS] = cand_pos
    return 0


@njit(cache=CACHE, inline="always")
def _match_fix(S, st, ln):
    """Move a match pointer (state ``st``, length ``ln``) made before the automaton grew (states split)
    to the state that now holds the strings of length ``ln``."""
    while st != 0 and S[SREC * S[SREC * st + S_LINK] + S_LEN] >= ln:
        st = S[SREC * st + S_LINK]
    return st


@njit(cache=CACHE, inline="always")
def _match_step(AM, a, S, E, R, H, st, ln, tok):
    """Matching statistics: extend the match (state ``st`` holding length ``ln``) by ``tok``.

    Requires ``st`` to hold ``ln`` (``_match_fix`` after growth); the result holds it again.
    """
    while True:
        t = _get(AM, a, S, E, R, H, st, tok)
        if t != -1:
            return t, ln + 1
        if st == 0:
            return 0, 0
        st = S[SREC * st + S_LINK]
        ln = S[SREC * st + S_LEN]


@njit(cache=CACHE)
def _prefetch_lookup(AM, a, st, tok):
    """Request the line that looking up ``tok`` at state ``st`` of automaton ``a`` reads after the state's
    record (root slot, hub slot or list head); the record itself is read here."""
    if st == 0:
        if AM[a, A_RCAP]:
            _prefetch(AM[a, A_R] + I32 * RREC * _hash_slot(tok, AM[a, A_RCAP] - 1))
        return
    f = _view(AM[a, A_S] + I32 * SREC * st, SREC)[S_FIRST]
    if f < -1:
        _prefetch(AM[a, A_H] + I32 * HREC * _hub_slot(st, tok, AM[a, A_HCAP] - 1))
    elif f >= 0:
        _prefetch(AM[a, A_E] + I32 * EREC * f)


@njit(cache=CACHE, inline="always")
def _cache_pointer(S, SM, s, nst):
    """String ``s``'s (current) cache pointer (state, length), fixed up if the cache automaton (state
    records ``S``, ``nst`` states now) grew since the pointer was last exact."""
    st = SM[s, M_CST]
    ln = SM[s, M_CLN]
    if SM[s, M_CVER] != nst:
        st = _match_fix(S, st, ln)
    return st, ln


@njit(cache=CACHE)
def _cache_resync(AM, ca, SM, s, n_new, stamp, S, E, R, H, resync):
    """Make string ``s``'s pointer for cache automaton ``ca`` (stamp ``stamp``) from scratch: match the
    ``resync`` tokens before its ``n_new`` newest ones (a pointer made for a cache that is gone)."""
    st = 0
    ln = 0
    T = _view(SM[s, M_T], SM[s, M_TCAP])
    end = SM[s, M_LEN] - n_new
    for i in range(max(0, end - resync), end):
        st, ln = _match_step(AM, ca, S, E, R, H, st, ln, T[i])
    SM[s, M_CST] = st
    SM[s, M_CLN] = ln
    SM[s, M_CSTAMP] = stamp
    SM[s, M_CVER] = AM[ca, A_NST]


@njit(cache=CACHE)
def _cache_follow(AM, ca, SM, s, buf, row, j0, j1, S, E, R, H, fix_each=False):
    """Advance string ``s``'s (current, see ``_cache_resync``) pointer into cache automaton ``ca`` by
    ``buf[row, j0:j1]``.

    If the cache grew since the pointer was last advanced, it is fixed up once (``_match_fix``); within
    a call the automaton does not change and every step keeps the pointer exact (``fix_each``: fix up
    before every token, the reference the tests compare with).
    """
    st, ln = _cache_pointer(S, SM, s, AM[ca, A_NST])
    for i in range(j0, j1):
        if fix_each:
            st = _match_fix(S, st, ln)
        st, ln = _match_step(AM, ca, S, E, R, H, st, ln, buf[row, i])
    SM[s, M_CST] = st
    SM[s, M_CLN] = ln
    SM[s, M_CVER] = AM[ca, A_NST]


@njit(cache=CACHE)
def extend_batch(slots, buf, rows, starts, ends, prog, budget, resync, complete, AM, SM, auto_str, ca, stamp,
                 grow, knobs):
    """Append ``buf[rows[i], starts[i]:ends[i]]`` to string ``slots[i]`` for every i (one decode step).

    ``prog`` int64[2] = (request index, token column) to resume from (0, -1 at the first call).
    Returns the number of growth requests written to ``grow`` (int64[m, 3]: kind, slot, elements);
    0 = done. ``knobs``: int64[KNOB_COLS] (``KN_*``). Phase 1 (``KN_PRECHECK``) checks the room of every request first (hot meta rows only) so
    that decode steps rarely stop in the middle; phase 2 appends, checking room token by token;
    phase 3 advances the pointers into the cache automaton ``ca`` (stamp ``stamp``; -1 = no cache;
    ``KN_CACHE_FIX_EACH``: reference walk, see ``_cache_follow``); before phase 2 the read-only warm-up
    pass (``warm_batch``, ``KN_WARM_LANES`` lanes, ``KN_WARM_HOPS`` hops) runs when phase 1 did.
    ``complete``: the strings end here (cache insertion), see ``_append_tokens``.
    Bad input, checked before anything changes: returns ``BAD_RANGE`` if some ``ends[i] < starts[i]``,
    ``TOO_LONG`` if a string would reach ``MAX_STRING_LEN`` tokens.
    """
    n = slots.shape[0]
    precheck = knobs[KN_PRECHECK] != 0
    i0 = prog[0]
    if i0 == 0 and prog[1] < 0:
        for i in range(n):
            if ends[i] < starts[i]:
                return BAD_RANGE
            if SM[slots[i], M_LEN] + ends[i] - starts[i] >= MAX_STRING_LEN:
                return TOO_LONG
    # phase 1: room for tokens, states (2 per token), edges (margin) and root entries
    ng = 0
    for i in range(i0, n if precheck else 0):
        a = SM[slots[i], M_AUTO]
        AM[a, A_NEED_S] = 0
    for i in range(i0, n if precheck else 0):
        s = slots[i]
        j0 = starts[i] if i != i0 or prog[1] < 0 else prog[1]
        m = min(ends[i] - j0, 64)
        if m <= 0:
            continue
        if SM[s, M_LEN] + m > SM[s, M_TCAP] and ng < grow.shape[0]:
            grow[ng, 0] = G_TOK
            grow[ng, 1] = s
            grow[ng, 2] = SM[s, M_LEN] + m
            ng += 1
        AM[SM[s, M_AUTO], A_NEED_S] += m
    for i in range(i0, n if precheck else 0):
        a = SM[slots[i], M_AUTO]
        m = AM[a, A_NEED_S]
        if m <= 0:
            continue
        AM[a, A_NEED_S] = 0  # visit each automaton once
        if ng + 3 > grow.shape[0]:
            break
        if AM[a, A_NST] + 2 * m > AM[a, A_SCAP]:
            grow[ng, 0] = G_STATES
            grow[ng, 1] = a
            grow[ng, 2] = AM[a, A_NST] + 2 * m
            ng += 1
        if AM[a, A_NE] + 3 * m + 8 > AM[a, A_ECAP]:
            grow[ng, 0] = G_EDGES
            grow[ng, 1] = a
            grow[ng, 2] = AM[a, A_NE] + 3 * m + 8
            ng += 1
        if (AM[a, A_RN] + m) * 2 > AM[a, A_RCAP]:
            grow[ng, 0] = G_ROOT
            grow[ng, 1] = a
            grow[ng, 2] = AM[a, A_RN] + m
            ng += 1
    if ng:
        return ng
    if precheck and knobs[KN_WARM_LANES] > 0:
        warm_batch(slots, buf, rows, starts, ends, i0, prog[1], AM, SM, knobs[KN_WARM_LANES],
                   min(budget, knobs[KN_WARM_HOPS]))
    # phase 2: append
    for i in range(i0, n):
        j0 = starts[i] if i != i0 or prog[1] < 0 else prog[1]
        if ends[i] <= j0:
            continue
        if _append_tokens(AM, SM, auto_str, slots[i], buf, rows[i], j0, ends[i], budget, complete, prog, grow):
            prog[0] = i
            return 1
    prog[0] = n
    prog[1] = -1
    # phase 3: the cache automaton does not change during a batch
    if ca < 0:
        return 0
    S, E, R, H = _auto_views(AM, ca)
    if knobs[KN_CACHE_FIX_EACH] != 0:  # the reference walk: request after request, fixed up before every token
        for i in range(n):
            if ends[i] <= starts[i]:
                continue
            if SM[slots[i], M_CSTAMP] != stamp:  # made for a cache that is gone (rare): re-fed
                _cache_resync(AM, ca, SM, slots[i], ends[i] - starts[i], stamp, S, E, R, H, resync)
            _cache_follow(AM, ca, SM, slots[i], buf, rows[i], starts[i], ends[i], S, E, R, H, True)
        return 0
    _cache_walk(AM, ca, SM, slots, buf, rows, starts, ends, stamp, S, E, R, H, resync)
    return 0


@njit(cache=CACHE)
def _cache_walk(AM, ca, SM, slots, buf, rows, starts, ends, stamp, S, E, R, H, resync):
    """Advance every string's pointer into the cache automaton ``ca`` by its new tokens, token column by token
    column: column ``j`` first requests, for every request, the line its lookup of token ``j`` reads (list
    head, hub slot or root slot; its state line was requested one column earlier), then makes the steps and
    requests each reached state's line. The misses of different requests overlap instead of being paid one
    after another. Same pointers as ``_cache_follow`` request after request: the cache automaton gains no
    state during a batch (lookups only reorder edge lists and index hubs, which never change a lookup), and a
    pointer is fixed up once before its first token (``_cache_pointer``)."""
    n = slots.shape[0]
    nst = AM[ca, A_NST]
    longest = 0
    for i in range(n):
        m = ends[i] - starts[i]
        if m <= 0:
            continue
        s = slots[i]
        if SM[s, M_CSTAMP] != stamp:  # made for a cache that is gone (rare): re-fed
            _cache_resync(AM, ca, SM, s, m, stamp, S, E, R, H, resync)
        else:
            st, ln = _cache_pointer(S, SM, s, nst)
            SM[s, M_CST] = st
            SM[s, M_CLN] = ln
            SM[s, M_CVER] = nst
        _prefetch(AM[ca, A_S] + I32 * SREC * SM[s, M_CST])
        longest = max(longest, m)
    for j in range(longest):
        for i in range(n):
            if starts[i] + j < ends[i]:
                _prefetch_lookup(AM, ca, SM[slots[i], M_CST], buf[rows[i], starts[i] + j])
        for i in range(n):
            if starts[i] + j < ends[i]:
                s = slots[i]
                st, ln = _match_step(AM, ca, S, E, R, H, SM[s, M_CST], SM[s, M_CLN], buf[rows[i], starts[i] + j])
                SM[s, M_CST] = st
                SM[s, M_CLN] = ln
                _prefetch(AM[ca, A_S] + I32 * SREC * st)


# ------------------------------------------------------------------------------- warm-up pass
@njit(cache=CACHE)
def _lane_start(AM, SM, slots, buf, rows, starts, ends, i, j, lane, Li, Lj, Lst, Lph, Lend, La, Ltok):
    """Put request ``i`` (first token column ``j``) on a lane: prefetch its tail lines and ``last``.

    The lane walks at most ``WARM_MAX_TOKENS`` tokens of the request (a decode step appends <= k + 1;
    a long append, e.g. a new prompt, gains nothing from a read-ahead walk over all of it). ``La`` and
    ``Ltok`` keep the lane's automaton and current token at hand.
    """
    s = slots[i]
    a = SM[s, M_AUTO]
    _prefetch(SM[s, M_T] + I32 * SM[s, M_LEN])
    _prefetch(AM[a, A_S] + I32 * SREC * AM[a, A_NST])
    _prefetch(AM[a, A_E] + I32 * EREC * AM[a, A_NE])
    st = SM[s, M_LAST]
    _prefetch(AM[a, A_S] + I32 * SREC * st)
    Li[lane] = i
    Lj[lane] = j
    Lst[lane] = st
    Lph[lane] = WP_STATE
    Lend[lane] = min(ends[i], j + WARM_MAX_TOKENS)
    La[lane] = a
    Ltok[lane] = buf[rows[i], j]


@njit(cache=CACHE)
def _lane_to_link(S, st, lane, Lst, Lph):
    """A lane's token has no transition at ``st`` (address ``S`` of the state records): continue at the
    suffix link, reading its record next (``WP_STATE``). Returns the link."""
    st = _view(S + I32 * SREC * st, SREC)[S_LINK]
    Lst[lane] = st
    Lph[lane] = WP_STATE
    _prefetch(S + I32 * SREC * st)
    return st


@njit(cache=CACHE)
def warm_batch(slots, buf, rows, starts, ends, i0, j0, AM, SM, lanes, hops):
    """Read-only pass that brings into cache what ``extend_batch`` will touch (no semantic effect).

    Every request walks its new tokens through its automaton as matching statistics do (scan the
    edge list of the current state, follow suffix links on a miss, then ``hops`` suffix links of
    the reached state for the occurrence update). The walks of ``lanes`` requests are interleaved
    (one dependent load per lane per turn, the next line prefetched), so the cache misses of
    different requests overlap instead of being paid one after another.
    """
    n = slots.shape[0]
    Li = np.full(lanes, -1, np.int64)
    Lj = np.zeros(lanes, np.int64)
    Lst = np.zeros(lanes, np.int64)
    Le = np.zeros(lanes, np.int64)
    Lph = np.zeros(lanes, np.int64)
    Lh = np.zeros(lanes, np.int64)
    Lend = np.zeros(lanes, np.int64)
    Lp = np.full(lanes, -1, np.int64)  # state whose transition was found (-1: fell to the root)
    Lpl = np.zeros(lanes, np.int64)  # its length
    Lx = np.zeros(lanes, np.int64)  # edge cursor of the clone walk
    La = np.zeros(lanes, np.int64)
    Ltok = np.zeros(lanes, np.int64)
    nxt = i0
    active = 0
    for lane in range(lanes):
        while nxt < n:
            j = starts[nxt] if nxt != i0 or j0 < 0 else j0
            nxt += 1
            if j < ends[nxt - 1]:
                _lane_start(AM, SM, slots, buf, rows, starts, ends, nxt - 1, j, lane, Li, Lj, Lst, Lph, Lend, La,
                            Ltok)
                active += 1
                break
    while active:
        for lane in range(lanes):
            i = Li[lane]
            if i < 0:
                continue
            a = La[lane]
            S = AM[a, A_S]
            tok = Ltok[lane]
            ph = Lph[lane]
            st = Lst[lane]
            done = False
            found = False
            if ph == WP_STATE:  # at state st: read its record
                Lpl[lane] = 0
                if st == 0:
                    rcap = AM[a, A_RCAP]
                    if rcap == 0:
                        st = 0
                        done = True
                    else:
                        h = _hash_slot(tok, rcap - 1)
                        Lh[lane] = h
                        Lph[lane] = WP_ROOT
                        _prefetch(AM[a, A_R] + I32 * RREC * h)
                else:
                    rec = _view(S + I32 * SREC * st, SREC)
                    Lpl[lane] = rec[S_LEN]
                    e = rec[S_FIRST]
                    if e < -1:  # hub: probe the index
                        h = _hub_slot(st, tok, AM[a, A_HCAP] - 1)
                        Lh[lane] = h
                        Lph[lane] = WP_HUB
                        _prefetch(AM[a, A_H] + I32 * HREC * h)
                    elif e == -1:
                        st = rec[S_LINK]
                        Lst[lane] = st
                        _prefetch(S + I32 * SREC * st)
                    else:
                        Le[lane] = e
                        Lph[lane] = WP_EDGE
                        _prefetch(AM[a, A_E] + I32 * EREC * e)
            elif ph == WP_EDGE:  # at edge e of st
                e = Le[lane]
                er = _view(AM[a, A_E] + I32 * EREC * e, EREC)
                if er[E_TOK] == tok:
                    st = er[E_TGT]
                    done = found = True
                elif er[E_NEXT] == -1:
                    st = _lane_to_link(S, st, lane, Lst, Lph)
                else:
                    Le[lane] = er[E_NEXT]
                    _prefetch(AM[a, A_E] + I32 * EREC * er[E_NEXT])
            elif ph == WP_HUB:  # hub index probe
                h = Lh[lane]
                hr = _view(AM[a, A_H] + I32 * HREC * h, HREC)
                if hr[H_STATE] == st and hr[H_TOK] == tok:
                    st = hr[H_TGT]
                    done = found = True
                elif hr[H_STATE] == -1:
                    st = _lane_to_link(S, st, lane, Lst, Lph)
                else:
                    h = (h + 1) & (AM[a, A_HCAP] - 1)
                    Lh[lane] = h
                    _prefetch(AM[a, A_H] + I32 * HREC * h)
            elif ph == WP_ROOT:  # root hash probe
                h = Lh[lane]
                kv = _view(AM[a, A_R] + I32 * RREC * h, RREC)
                if kv[R_TOK] == tok:
                    st = kv[R_STATE]
                    done = found = True
                elif kv[R_TOK] == -1:
                    st = 0
                    done = True
                else:
                    h = (h + 1) & (AM[a, A_RCAP] - 1)
                    Lh[lane] = h
                    _prefetch(AM[a, A_R] + I32 * RREC * h)
            elif ph == WP_CLONE:  # clone ahead: the edge list of the reached state (the clone copies it)
                nx = _view(AM[a, A_E] + I32 * EREC * Lx[lane], EREC)[E_NEXT]
                if nx != -1:
                    Lx[lane] = nx
                    _prefetch(AM[a, A_E] + I32 * EREC * nx)
                else:  # then the first redirect: the suffix link of the state whose transition was found
                    p2 = _view(S + I32 * SREC * Lp[lane], SREC)[S_LINK]  # (-1 for the root)
                    Lp[lane] = -1
                    Lph[lane] = WP_HOPS
                    if p2 > 0:
                        Lx[lane] = p2
                        Lph[lane] = WP_LINK_HEAD
                        _prefetch(S + I32 * SREC * p2)
            elif ph == WP_LINK_HEAD:  # its first edge (or its hub slot for the token)
                _prefetch_lookup(AM, a, Lx[lane], tok)
                Lph[lane] = WP_HOPS
            else:  # WP_HOPS: suffix-link hops of the reached state (occurrence update walk)
                if st > 0 and Lh[lane] > 0:
                    rec = _view(S + I32 * SREC * st, SREC)
                    if Lp[lane] >= 0 and Lpl[lane] + 1 != rec[S_LEN]:
                        # the extension will clone this state: walk what the clone reads first
                        hd = rec[S_FIRST] if rec[S_FIRST] >= -1 else -rec[S_FIRST] - 2
                        if hd >= 0:
                            Lx[lane] = hd
                            Lph[lane] = WP_CLONE
                            _prefetch(AM[a, A_E] + I32 * EREC * hd)
                            continue
                    Lp[lane] = -1
                    st = rec[S_LINK]
                    Lst[lane] = st
                    Lh[lane] -= 1
                    _prefetch(S + I32 * SREC * st)
                else:
                    st = Le[lane]  # the state reached by the token
                    j = Lj[lane] + 1
                    if j < Lend[lane]:
                        Lj[lane] = j
                        Ltok[lane] = buf[rows[i], j]
                        Lst[lane] = st
                        Lph[lane] = WP_STATE
                        _prefetch(S + I32 * SREC * st)
                    else:
                        Li[lane] = -1
                        active -= 1
                        while nxt < n:
                            jj = starts[nxt] if nxt != i0 or j0 < 0 else j0
                            nxt += 1
                            if jj < ends[nxt - 1]:
                                _lane_start(AM, SM, slots, buf, rows, starts, ends, nxt - 1, jj, lane, Li, Lj, Lst,
                                            Lph, Lend, La, Ltok)
                                active += 1
                                break
            if done:  # token matched (or fell to the root): walk the occurrence hops next
                Lp[lane] = Lst[lane] if found else -1
                Le[lane] = st
                Lst[lane] = st
                Lh[lane] = hops
                Lph[lane] = WP_HOPS
                if st > 0:
                    _prefetch(S + I32 * SREC * st)


# ---------------------------------------------------------------------------------- propose
@njit(cache=CACHE)
def propose_batch(slots, k, min_match, AM, SM, auto_str, ca, stamp, out, out_n):
    """Drafts for strings ``slots``: up to ``k`` tokens after the chosen occurrence of the longest match.

    Candidates: the string's own automaton (own text and, in group mode, running siblings) and the
    cache automaton ``ca`` (stamp ``stamp``; -1 = none). Longest match wins; ties go to the own
    automaton. ``out``: int32[n, k]; ``out_n``: int32[n] number of valid tokens per row.
    """
    n = slots.shape[0]
    best_len = np.empty(n, np.int64)
    best_pos = np.empty(n, np.int64)
    best_a = np.empty(n, np.int64)
    for i in range(n):
        s = slots[i]
        best_len[i] = SM[s, M_CLEN]
        best_pos[i] = SM[s, M_CPOS]
        best_a[i] = SM[s, M_AUTO]
    if ca >= 0:
        S = _view(AM[ca, A_S], AM[ca, A_SCAP] * SREC)
        nst = AM[ca, A_NST]
        for i in range(n):
            s = slots[i]
            if SM[s, M_CSTAMP] != stamp:
                continue
            st, ln = _cache_pointer(S, SM, s, nst)
            tries = 0
            while st > 0 and tries < 4 and ln > best_len[i]:
                pos = S[SREC * st + S_POS]
                if _has_cont(SM, auto_str, ca, pos):
                    best_len[i] = ln
                    best_pos[i] = pos
                    best_a[i] = ca
                    break
                st = S[SREC * st + S_LINK]
                ln = S[SREC * st + S_LEN]
                tries += 1
    for i in range(n):  # the drafts' token lines, all requested before the first is read
        if best_len[i] >= min_match and best_pos[i] >= 0:
            pos = best_pos[i]
            _prefetch(SM[auto_str[best_a[i], pos >> OFFSET_BITS], M_T] + I32 * ((pos & OFFSET_MASK) + 1))
    for i in range(n):
        if best_len[i] < min_match or best_pos[i] < 0:
            out_n[i] = 0
            continue
        pos = best_pos[i]
        g = auto_str[best_a[i], pos >> OFFSET_BITS]
        off = (pos & OFFSET_MASK) + 1
        c = min(k, SM[g, M_LEN] - off)
        T = _view(SM[g, M_T], SM[g, M_TCAP])
        for j in range(c):
            out[i, j] = T[off + j]
        out_n[i] = max(c, 0)


@njit(cache=CACHE)
def step_batch(slots, buf, rows, starts, ends, prog, budget, resync, AM, SM, auto_str, ca, stamp, grow, knobs, k,
               min_match, out, out_n):
    """One decode step in one call: ``extend_batch`` then, once it is done, ``propose_batch``."""
    ng = extend_batch(slots, buf, rows, starts, ends, prog, budget, resync, False, AM, SM, auto_str, ca, stamp, grow,
                      knobs)
    if ng == 0:
        propose_batch(slots, k, min_match, AM, SM, auto_str, ca, stamp, out, out_n)
    return ng


# ---------------------------------------------------------------------------------- exchange
@njit(cache=CACHE)
def gather_tails(SM, slots, starts, ends, out):
    """Copy ``T[s][starts[i]:ends[i]]`` of string ``slots[i]`` for every i into ``out`` (back to back);
    returns the tokens written (sibling exchange: a rank's pending tokens, read from its own strings)."""
    o = 0
    for i in range(slots.shape[0]):
        n = ends[i] - starts[i]
        if n <= 0:
            continue
        T = _view(SM[slots[i], M_T], SM[slots[i], M_TCAP])
        out[o: o + n] = T[starts[i]: ends[i]]
        o += n
    return o


@njit(cache=CACHE)
def parse_messages(flat, starts, ranks, skip, keys, k64, pos, counts, fin, tok_at, known):
    """Parse sibling-exchange messages laid back to back in ``flat`` (message m at ``starts[m]``, sent by
    rank ``ranks[m]``; messages of rank ``skip`` are ignored) into per-entry arrays (capacity >= entries):
    key = rank << 32 | serial, 64-bit group key, pos, count, FIN flag, and where the entry's tokens start
    in ``flat``. Entries whose group key is not in ``known`` (sorted int64: the groups held here) are
    dropped. Returns the number of entries kept, or -1 if a message is malformed (counts do not add up)."""
    nk = known.shape[0]
    e = 0
    for m in range(starts.shape[0] - 1):
        if ranks[m] == skip:
            continue
        b = starts[m]
        end = starts[m + 1]
        if end <= b:
            continue
        ne = flat[b]
        h = b + 1
        t = h + 5 * ne
        if ne < 0 or t > end:
            return -1
        for i in range(ne):
            r = h + 5 * i
            lo = np.int64(flat[r]) & 0xFFFFFFFF
            hi = np.int64(flat[r + 1])
            g = (hi << 32) | lo
            c = np.int64(flat[r + 4]) & 0x3FFFFFFF
            a = 0
            b = nk
            while a < b:
                mid = (a + b) >> 1
                if known[mid] < g:
                    a = mid + 1
                else:
                    b = mid
            if a < nk and known[a] == g:
                k64[e] = g
                keys[e] = (np.int64(ranks[m]) << 32) | (np.int64(flat[r + 2]) & 0xFFFFFFFF)
                pos[e] = flat[r + 3]
                counts[e] = c
                fin[e] = (flat[r + 4] & 0x40000000) != 0
                tok_at[e] = t
                e += 1
            t += c
        if t != end:
            return -1
    return e


@njit(cache=CACHE)
def pack_pending(SM, slot, k64, ser, sent, plen, used, n_rows, max_ints, out):
    """Sibling-exchange message of every used row's pending tokens (``T[slot][sent:len]``) into ``out``
    (int32, room >= ``max_ints``): ``[E, E x (key lo, key hi, serial, pos, count), tokens]``; marks them sent.
    Returns the message length in int32, or -1 (nothing written, nothing marked) if it would exceed
    ``max_ints`` (the caller then applies the cap)."""
    e = 0
    t = 0
    for i in range(n_rows):
        if used[i]:
            c = SM[slot[i], M_LEN] - sent[i]
            if c > 0:
                e += 1
                t += c
    total = 1 + 5 * e + t
    if total > max_ints:
        return -1
    out[0] = e
    h = 1
    o = 1 + 5 * e
    for i in range(n_rows):
        if not used[i]:
            continue
        s = slot[i]
        ln = SM[s, M_LEN]
        c = ln - sent[i]
        if c <= 0:
            continue
        out[h] = np.int32(k64[i] & 0xFFFFFFFF)
        out[h + 1] = np.int32(k64[i] >> 32)
        out[h + 2] = np.int32(ser[i])
        out[h + 3] = np.int32(sent[i] - plen[i])
        out[h + 4] = np.int32(c)
        h += 5
        T = _view(SM[s, M_T], SM[s, M_TCAP])
        out[o: o + c] = T[sent[i]: ln]
        o += c
        sent[i] = ln
    return total


@njit(cache=CACHE)
def shadow_fast(keys, pos, counts, tok_at, sh_keys, sh_rows, sh, room, e_slot, e_start, e_end, fast):
    """Entries that continue an open shadow string: look their shadow up (``sh_keys`` sorted, ``sh_rows``
    the rows of table ``sh`` = [key, slot, next pos, tokens, automaton]), advance it and fill the append
    ranges; ``fast[i]`` = handled here. Stops taking tokens once ``room`` is used up (those entries are
    left to the caller). Returns the tokens taken."""
    n = keys.shape[0]
    m = sh_keys.shape[0]
    taken = 0
    for i in range(n):
        fast[i] = False
        if m == 0:
            continue
        lo = 0
        hi = m
        k = keys[i]
        while lo < hi:
            mid = (lo + hi) >> 1
            if sh_keys[mid] < k:
                lo = mid + 1
            else:
                hi = mid
        if lo == m or sh_keys[lo] != k:
            continue
        r = sh_rows[lo]
        if sh[r, 1] < 0:  # an ignored remote sibling: nothing to append
            fast[i] = True
            e_start[i] = 0
            e_end[i] = 0
            continue
        if sh[r, 2] != pos[i] or taken + counts[i] > room:
            continue
        c = counts[i]
        sh[r, 2] += c
        sh[r, 3] += c
        taken += c
        e_slot[i] = sh[r, 1]
        e_start[i] = tok_at[i]
        e_end[i] = tok_at[i] + c
        fast[i] = True
    return taken
