"""Packing-aware expert-parallel load balancer (EPLB) for MoE rollout.

Problem (one MoE layer): ``E`` logical experts with loads ``w[e]`` (tokens routed to expert ``e`` over a
window) are served by ``P = E + X`` physical expert slots spread over ``R`` ranks, ``S = P / R`` slots per
rank. Expert ``e`` gets ``c[e] >= 1`` replicas that share its tokens evenly (``w[e] / c[e]`` each, as in
vLLM's and vLLM-Ascend's replica routing). A rank's load is the sum of the shares of the replicas it
holds; each layer's all-to-all waits for its busiest rank, so we minimise the maximum rank load.
*Balancedness* of a layer = mean rank load / max rank load (1.0 is perfect).

Why not "replicate then pack" (DeepSeek EPLB / vLLM ``DefaultEplbPolicy``): it first gives each new
replica to the expert with the largest ``w/c`` and only then packs. When a few experts are hot this
produces replica shares that cannot be packed evenly (16 equally hot experts of 128, 128 ranks, 128
redundant slots: 9 replicas each = 144 shares of ``W/9`` on 128 ranks, so 16 ranks carry ``2W/9``:
balancedness 0.56, while 14 experts x 8 replicas + 2 experts x 16 replicas reaches 1.0).

Ours (per layer, compiled with numba):

1. *Candidate replica counts.* (a) the greedy ``max w/c`` counts; (b) for target loads ``T`` on a
   geometric grid between the lower bound ``W/R`` and the makespan found by (a): the fewest replicas
   with shares ``<= T`` (``c = ceil(w/T)``); the slots left over go either (b1) greedily by ``max w/c``
   or (b2) to the coldest experts (their near-zero shares fill slots without disturbing the packing).
2. *Packing.* Shares in decreasing order, each to the least-loaded rank with a free slot (and, with
   ``EplbOptions.distinct``, not already holding that expert): longest-processing-time with slot cardinality.
3. *Refinement.* Pairwise-swap local search: repeatedly take the busiest rank and apply the swap of one
   of its replicas with a lighter replica on another rank that lowers the larger of the two loads
   most; stops when no swap lowers the peak (or after ``max_swaps``).
4. Keep the best candidate (lowest peak load).

Migration-aware mode (``rebalance_experts_migration_aware``): given the previous placement, the
candidates are (i) the previous placement unchanged (0 moves), (ii) the previous placement refined by
swaps that pay for their moves, and (iii) the fresh placement with its ranks relabelled to overlap most
with the previous placement (ranks are interchangeable) and with experts that stay on a rank kept in
their old slot. Objective ``J = max_load / mean_load + migration_weight * moved_slots``: moving one
expert weight must buy at least ``migration_weight`` of peak-to-mean ratio. A slot counts as moved when
its logical expert differs from the previous one (that slot's weights must be transferred).

One global problem is solved per layer. vLLM's hierarchical mode (``num_groups % num_nodes == 0`` and
``num_nodes > 1``: every replica of a group's experts on the group's node) is not implemented and raises
``ValueError``: nothing here requests it (the vLLM-Ascend policy, ``eplb_ascend_policy.py``, passes one
group and one node; Qwen3-MoE has no expert groups).

Public API (torch tensors, CPU; same contract as vLLM 0.13
``vllm/distributed/eplb/policy/abstract.py:AbstractEplbPolicy.rebalance_experts``):

* ``rebalance_experts(weight[L, E], num_replicas, num_groups, num_nodes, num_ranks)
  -> (phy2log[L, P], log2phy[L, E, X + 1], logcnt[L, E])`` (int64; ``log2phy`` padded with -1; physical
  slot ``p`` lives on rank ``p // S``).
* ``rebalance_experts_migration_aware(..., prev_phy2log[L, P], migration_weight)`` returns those three
  plus ``moved[L]`` (slots whose expert changed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

__all__ = [
    "EplbOptions",
    "balancedness",
    "identity_placement",
    "log2phy_from_phy2log",
    "moved_slots",
    "rank_loads",
    "rebalance_experts",
    "rebalance_experts_migration_aware",
]

_EPS = 1e-9


@dataclass(frozen=True)
class EplbOptions:
    """Tuning knobs of the packing-aware policy.

    num_targets: number of target loads ``T`` tried per layer (each gives two count candidates).
    max_swaps: cap on refinement swaps per candidate (each swap lowers the peak or the search stops).
    distinct: never put two replicas of one expert on one rank (vLLM-Ascend rejects such tables; vLLM
        accepts them, and a same-rank pair simply carries two shares, so the vLLM signature allows it).
    """

    num_targets: int = 6
    max_swaps: int = 256
    distinct: bool = False


# ----------------------------------------------------------------------------------------------------
# numba kernels (one layer; arrays are float64 loads and int64 expert ids)
# ----------------------------------------------------------------------------------------------------


@numba.njit(cache=True)
def _less(key: np.ndarray, a: int, b: int) -> bool:
    return key[a] < key[b] or (key[a] == key[b] and a < b)


@numba.njit(cache=True)
def _heap_push(heap: np.ndarray, size: int, loads: np.ndarray, r: int) -> int:
    i = size
    heap[i] = r
    while i > 0:
        parent = (i - 1) // 2
        if _less(loads, heap[i], heap[parent]):
            tmp = heap[i]
            heap[i] = heap[parent]
            heap[parent] = tmp
            i = parent
        else:
            break
    return size + 1


@numba.njit(cache=True)
def _heap_pop(heap: np.ndarray, size: int, loads: np.ndarray) -> int:
    """Remove heap[0]; returns the new size."""
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        left = 2 * i + 1
        if left >= size:
            break
        c = left
        if left + 1 < size and _less(loads, heap[left + 1], heap[left]):
            c = left + 1
        if _less(loads, heap[c], heap[i]):
            tmp = heap[i]
            heap[i] = heap[c]
            heap[c] = tmp
            i = c
        else:
            break
    return size


@numba.njit(cache=True)
def _greedy_fill(w: np.ndarray, cnt: np.ndarray, extra: int, cap: int) -> None:
    """Give ``extra`` more replicas, each to the expert with the largest share ``w/c`` (``c < cap``)."""
    n = w.shape[0]
    key = np.empty(n, dtype=np.float64)  # min-heap on -share
    heap = np.empty(n, dtype=np.int64)
    size = 0
    for e in range(n):
        if cnt[e] < cap:
            key[e] = -w[e] / cnt[e]
            size = _heap_push(heap, size, key, e)
    for _ in range(extra):
        if size == 0:
            break
        e = heap[0]
        size = _heap_pop(heap, size, key)
        cnt[e] += 1
        if cnt[e] < cap:
            key[e] = -w[e] / cnt[e]
            size = _heap_push(heap, size, key, e)


@numba.njit(cache=True)
def _cold_fill(w: np.ndarray, cnt: np.ndarray, extra: int, cap: int) -> None:
    """Give ``extra`` more replicas to the coldest experts, one each in increasing load order, cycling."""
    order = np.argsort(w, kind="mergesort")
    n = w.shape[0]
    i = 0
    guard = 0
    while extra > 0 and guard < n * (cap + 1):
        e = order[i % n]
        if cnt[e] < cap:
            cnt[e] += 1
            extra -= 1
        i += 1
        guard += 1
    if extra > 0:
        _greedy_fill(w, cnt, extra, cap)


@numba.njit(cache=True)
def _target_counts(w: np.ndarray, total: int, cap: int, target: float, cold: bool) -> np.ndarray:
    """Fewest replicas with shares ``<= target``; leftovers by greedy or to cold experts. Empty if infeasible."""
    n = w.shape[0]
    cnt = np.ones(n, dtype=np.int64)
    s = 0
    for e in range(n):
        c = int(np.ceil(w[e] / target - 1e-9)) if target > 0 else 1
        if c < 1:
            c = 1
        if c > cap:
            c = cap
        cnt[e] = c
        s += c
    if s > total:
        return np.zeros(0, dtype=np.int64)
    if cold:
        _cold_fill(w, cnt, total - s, cap)
    else:
        _greedy_fill(w, cnt, total - s, cap)
    return cnt


@numba.njit(cache=True)
def _pack(w: np.ndarray, cnt: np.ndarray, num_ranks: int, slots: int, distinct: bool):
    """LPT packing of replica shares into ranks of ``slots`` slots, no two replicas of one expert per rank.

    Returns (slot_expert[R*S], slot_share[R*S], loads[R]). Falls back to a duplicate only when no rank with
    a free slot lacks the expert (cannot happen when ``cnt <= R`` and shares are placed largest first with
    ties broken by larger count; kept as a safe fallback).
    """
    n = w.shape[0]
    total = num_ranks * slots
    share = np.empty(n, dtype=np.float64)
    neg_cnt = np.empty(n, dtype=np.float64)
    for e in range(n):
        share[e] = -(w[e] / cnt[e])
        neg_cnt[e] = -float(cnt[e])
    # experts by share desc, ties by count desc (two stable sorts = lexsort)
    o1 = np.argsort(neg_cnt, kind="mergesort")
    o2 = np.argsort(share[o1], kind="mergesort")
    share_e = np.empty(total, dtype=np.int64)
    share_v = np.empty(total, dtype=np.float64)
    k = 0
    for t in range(n):
        e = o1[o2[t]]
        for _ in range(cnt[e]):
            share_e[k] = e
            share_v[k] = -share[e]
            k += 1
    loads = np.zeros(num_ranks, dtype=np.float64)
    fill = np.zeros(num_ranks, dtype=np.int64)
    slot_e = np.full(total, -1, dtype=np.int64)
    slot_v = np.zeros(total, dtype=np.float64)
    holds = np.zeros((num_ranks, n), dtype=np.bool_)
    # binary min-heap of open ranks keyed by (load, rank)
    heap = np.arange(num_ranks)
    size = num_ranks
    aside = np.empty(num_ranks, dtype=np.int64)
    for it in range(total):
        e = share_e[it]
        n_aside = 0
        r = -1
        while size > 0:
            top = heap[0]
            size = _heap_pop(heap, size, loads)
            if not distinct or not holds[top, e]:
                r = top
                break
            aside[n_aside] = top
            n_aside += 1
        if r < 0:  # every open rank holds e: duplicate fallback on the least loaded one
            r = aside[0]
            for k in range(1, n_aside):
                aside[k - 1] = aside[k]
            n_aside -= 1
        p = r * slots + fill[r]
        slot_e[p] = e
        slot_v[p] = share_v[it]
        holds[r, e] = True
        fill[r] += 1
        loads[r] += share_v[it]
        if fill[r] < slots:
            size = _heap_push(heap, size, loads, r)
        for k in range(n_aside):
            size = _heap_push(heap, size, loads, aside[k])
    return slot_e, slot_v, loads


@numba.njit(cache=True)
def _rank_has(slot_e: np.ndarray, r: int, slots: int, e: int, skip: int) -> bool:
    for q in range(slots):
        p = r * slots + q
        if p != skip and slot_e[p] == e:
            return True
    return False


@numba.njit(cache=True)
def _swap_search(
    slot_e: np.ndarray,
    slot_v: np.ndarray,
    loads: np.ndarray,
    slots: int,
    max_swaps: int,
    home: np.ndarray,
    move_cost: float,
    distinct: bool,
) -> int:
    """Pairwise-swap refinement of the busiest rank, in place. Returns the number of swaps applied.

    ``home`` (optional, length R*S or 0): previous expert per slot; with ``move_cost > 0`` a swap must lower
    the peak by more than ``move_cost`` times the change in moved slots (peak measured in absolute load).
    """
    num_ranks = loads.shape[0]
    track = home.shape[0] > 0
    done = 0
    while done < max_swaps:
        p = 0
        for r in range(1, num_ranks):
            if loads[r] > loads[p]:
                p = r
        lp = loads[p]
        best_gain = _EPS * (1.0 + lp)
        bi = -1
        bj = -1
        for a in range(slots):
            i = p * slots + a
            ei = slot_e[i]
            vi = slot_v[i]
            for q in range(num_ranks):
                if q == p:
                    continue
                lq = loads[q]
                if lq + _EPS >= lp:
                    continue
                for b in range(slots):
                    j = q * slots + b
                    d = vi - slot_v[j]
                    if d <= 0.0:
                        continue
                    ej = slot_e[j]
                    if ej == ei:
                        continue
                    new_peak = max(lp - d, lq + d)
                    gain = lp - new_peak
                    if track and move_cost > 0.0:
                        before = (1 if ei != home[i] else 0) + (1 if ej != home[j] else 0)
                        after = (1 if ej != home[i] else 0) + (1 if ei != home[j] else 0)
                        gain -= move_cost * (after - before)
                    if gain <= best_gain:
                        continue
                    if distinct and (_rank_has(slot_e, q, slots, ei, j) or _rank_has(slot_e, p, slots, ej, i)):
                        continue
                    best_gain = gain
                    bi = i
                    bj = j
        if bi < 0:
            break
        q = bj // slots
        d = slot_v[bi] - slot_v[bj]
        ei = slot_e[bi]
        slot_e[bi] = slot_e[bj]
        slot_e[bj] = ei
        vi = slot_v[bi]
        slot_v[bi] = slot_v[bj]
        slot_v[bj] = vi
        loads[p] -= d
        loads[q] += d
        done += 1
    return done


@numba.njit(cache=True)
def _repair_duplicates(slot_e: np.ndarray, slot_v: np.ndarray, loads: np.ndarray, slots: int) -> None:
    """Swap away two replicas of one expert on one rank (rare packing fallback) with the cheapest swap."""
    num_ranks = loads.shape[0]
    for p in range(num_ranks):
        for a in range(slots):
            i = p * slots + a
            if not _rank_has(slot_e, p, slots, slot_e[i], i):
                continue
            best = -1
            best_peak = np.inf
            for j in range(num_ranks * slots):
                q = j // slots
                if q == p:
                    continue
                if _rank_has(slot_e, q, slots, slot_e[i], j) or _rank_has(slot_e, p, slots, slot_e[j], i):
                    continue
                d = slot_v[i] - slot_v[j]
                peak = max(loads[p] - d, loads[q] + d)
                if peak < best_peak:
                    best_peak = peak
                    best = j
            if best >= 0:
                q = best // slots
                d = slot_v[i] - slot_v[best]
                e = slot_e[i]
                slot_e[i] = slot_e[best]
                slot_e[best] = e
                v = slot_v[i]
                slot_v[i] = slot_v[best]
                slot_v[best] = v
                loads[p] -= d
                loads[q] += d


@numba.njit(cache=True)
def _solve_layer(
    w: np.ndarray, num_ranks: int, slots: int, num_targets: int, max_swaps: int, distinct: bool
) -> np.ndarray:
    """Best placement (slot -> logical expert, length R*S) for one layer's loads ``w[E]``."""
    n = w.shape[0]
    total = num_ranks * slots
    cap = num_ranks if num_ranks < total - n + 1 else total - n + 1
    none = np.zeros(0, dtype=np.int64)
    cnt = np.ones(n, dtype=np.int64)
    _greedy_fill(w, cnt, total - n, cap)
    se, sv, ld = _pack(w, cnt, num_ranks, slots, distinct)
    if distinct:
        _repair_duplicates(se, sv, ld, slots)
    _swap_search(se, sv, ld, slots, max_swaps, none, 0.0, distinct)
    best_e = se
    best_peak = ld.max()
    wsum = w.sum()
    lb = wsum / num_ranks
    if lb <= 0.0 or best_peak <= lb * (1.0 + 1e-9) or total == n:
        return best_e
    hi = best_peak
    for k in range(num_targets):
        # geometric grid from the lower bound towards the greedy makespan (excluded)
        frac = k / num_targets
        target = lb * (hi / lb) ** frac
        for variant in range(2):
            c2 = _target_counts(w, total, cap, target, variant == 1)
            if c2.shape[0] == 0:
                continue
            se2, sv2, ld2 = _pack(w, c2, num_ranks, slots, distinct)
            if distinct:
                _repair_duplicates(se2, sv2, ld2, slots)
            _swap_search(se2, sv2, ld2, slots, max_swaps, none, 0.0, distinct)
            peak = ld2.max()
            if peak < best_peak * (1.0 - 1e-12):
                best_peak = peak
                best_e = se2
        if best_peak <= lb * (1.0 + 1e-9):
            break
    return best_e


@numba.njit(cache=True)
def _loads_of(w: np.ndarray, slot_e: np.ndarray, num_ranks: int, slots: int):
    """Per-slot shares and per-rank loads of a placement (replica count from the placement itself)."""
    n = w.shape[0]
    cnt = np.zeros(n, dtype=np.int64)
    for p in range(slot_e.shape[0]):
        cnt[slot_e[p]] += 1
    sv = np.zeros(slot_e.shape[0], dtype=np.float64)
    ld = np.zeros(num_ranks, dtype=np.float64)
    for p in range(slot_e.shape[0]):
        e = slot_e[p]
        sv[p] = w[e] / cnt[e]
        ld[p // slots] += sv[p]
    return sv, ld


@numba.njit(cache=True)
def _align_to_previous(new_e: np.ndarray, prev_e: np.ndarray, num_ranks: int, slots: int) -> np.ndarray:
    """Relabel the ranks of ``new_e`` to overlap most with ``prev_e`` and keep retained experts in place.

    Greedy maximum-overlap matching of new bins to old ranks, then per rank: an expert present in the old
    rank keeps its old slot; the others fill the freed slots in order. Returns the aligned placement.
    """
    n_exp = 0
    for p in range(new_e.shape[0]):
        n_exp = max(n_exp, new_e[p] + 1, prev_e[p] + 1)
    # membership of old ranks
    old_has = np.zeros((num_ranks, n_exp), dtype=np.int64)
    for p in range(prev_e.shape[0]):
        old_has[p // slots, prev_e[p]] = 1
    overlap = np.zeros((num_ranks, num_ranks), dtype=np.int64)  # [new bin, old rank]
    for b in range(num_ranks):
        for q in range(slots):
            e = new_e[b * slots + q]
            for r in range(num_ranks):
                overlap[b, r] += old_has[r, e]
    bin_to_rank = np.full(num_ranks, -1, dtype=np.int64)
    rank_used = np.zeros(num_ranks, dtype=np.int64)
    # greedy in order of decreasing overlap, ties by (bin, rank): overlaps are integers in [0, slots], so a
    # scan per value replaces sorting the R x R matrix (same result as a stable argsort of -overlap)
    for v in range(slots, -1, -1):
        for b in range(num_ranks):
            if bin_to_rank[b] >= 0:
                continue
            for r in range(num_ranks):
                if rank_used[r] == 0 and overlap[b, r] == v:
                    bin_to_rank[b] = r
                    rank_used[r] = 1
                    break
    return _keep_slots(new_e, prev_e, bin_to_rank, slots)


@numba.njit(cache=True)
def _keep_slots(new_e: np.ndarray, prev_e: np.ndarray, bin_to_rank: np.ndarray, slots: int) -> np.ndarray:
    """Put bin b of ``new_e`` on rank ``bin_to_rank[b]``; experts already on that rank keep their old slot."""
    num_ranks = bin_to_rank.shape[0]
    out = np.full(new_e.shape[0], -1, dtype=np.int64)
    for b in range(num_ranks):
        r = bin_to_rank[b]
        placed = np.zeros(slots, dtype=np.int64)
        taken = np.zeros(slots, dtype=np.int64)
        for q in range(slots):
            e = new_e[b * slots + q]
            for s in range(slots):
                if taken[s] == 0 and prev_e[r * slots + s] == e:
                    out[r * slots + s] = e
                    taken[s] = 1
                    placed[q] = 1
                    break
        s = 0
        for q in range(slots):
            if placed[q] == 1:
                continue
            while taken[s] == 1:
                s += 1
            out[r * slots + s] = new_e[b * slots + q]
            taken[s] = 1
    return out


@numba.njit(cache=True)
def _count_moved(a: np.ndarray, b: np.ndarray) -> int:
    m = 0
    for p in range(a.shape[0]):
        if a[p] != b[p]:
            m += 1
    return m


@numba.njit(cache=True)
def _solve_layer_migration(
    w: np.ndarray,
    prev_e: np.ndarray,
    num_ranks: int,
    slots: int,
    migration_weight: float,
    num_targets: int,
    max_swaps: int,
    distinct: bool,
) -> np.ndarray:
    """Migration-aware placement for one layer: minimises ``peak/mean + migration_weight * moved``."""
    mean = w.sum() / num_ranks
    if mean <= 0.0:
        return prev_e.copy()
    # (i) unchanged
    sv0, ld0 = _loads_of(w, prev_e, num_ranks, slots)
    best = prev_e.copy()
    best_j = ld0.max() / mean
    # (ii) previous placement + swaps that pay for their moves (move_cost in absolute load units)
    se1 = prev_e.copy()
    _swap_search(se1, sv0, ld0, slots, max_swaps, prev_e, migration_weight * mean, distinct)
    se1 = _keep_slots(se1, prev_e, np.arange(num_ranks), slots)
    j1 = ld0.max() / mean + migration_weight * _count_moved(se1, prev_e)
    if j1 < best_j - 1e-12:
        best_j = j1
        best = se1
    # (iii) fresh placement aligned to the previous one
    fresh = _solve_layer(w, num_ranks, slots, num_targets, max_swaps, distinct)
    al = _align_to_previous(fresh, prev_e, num_ranks, slots)
    sv2, ld2 = _loads_of(w, al, num_ranks, slots)
    j2 = ld2.max() / mean + migration_weight * _count_moved(al, prev_e)
    if j2 < best_j - 1e-12:
        best_j = j2
        best = al
    return best


# ----------------------------------------------------------------------------------------------------
# torch-facing API
# ----------------------------------------------------------------------------------------------------


def _check_shapes(weight: torch.Tensor, num_replicas: int, num_ranks: int, num_nodes: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {tuple(weight.shape)}")
    num_log = weight.shape[1]
    if num_replicas < num_log:
        raise ValueError(f"num_replicas={num_replicas} < number of logical experts {num_log}")
    if num_ranks <= 0 or num_replicas % num_ranks != 0:
        raise ValueError(f"num_replicas={num_replicas} must be a positive multiple of num_ranks={num_ranks}")
    if num_nodes <= 0 or num_ranks % num_nodes != 0:
        raise ValueError(f"num_ranks={num_ranks} must be a multiple of num_nodes={num_nodes}")
    if torch.any(weight < 0):
        raise ValueError("expert loads must be non-negative")


def _hierarchical(num_log: int, num_groups: int, num_nodes: int) -> bool:
    """vLLM's hierarchical contract applies to these sizes (``DefaultEplbPolicy`` honours it; we raise)."""
    return num_nodes > 1 and num_groups > 0 and num_groups % num_nodes == 0 and num_log % num_groups == 0


def _solve_all(
    w: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    opts: EplbOptions,
    prev: np.ndarray | None,
    migration_weight: float,
) -> np.ndarray:
    """Placement for every layer: int64 ``[L, P]`` logical expert per physical slot."""
    num_layers, num_log = w.shape
    slots = num_replicas // num_ranks
    out = np.empty((num_layers, num_replicas), dtype=np.int64)
    if _hierarchical(num_log, num_groups, num_nodes):
        raise ValueError(f"hierarchical placement (num_groups={num_groups} on num_nodes={num_nodes}: each group's "
                         "replicas on one node) is not implemented; pass num_groups=1 for a global placement")
    for layer in range(num_layers):
        wl = np.ascontiguousarray(w[layer])
        if prev is None:
            out[layer] = _solve_layer(wl, num_ranks, slots, opts.num_targets, opts.max_swaps, opts.distinct)
        else:
            out[layer] = _solve_layer_migration(
                wl, np.ascontiguousarray(prev[layer]), num_ranks, slots, migration_weight,
                opts.num_targets, opts.max_swaps, opts.distinct,
            )
    return out


def log2phy_from_phy2log(phy2log: torch.Tensor, num_logical: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log2phy[L, E, width]`` (physical slots of each expert in increasing order, -1 padded) and ``logcnt[L, E]``."""
    num_layers, num_phy = phy2log.shape
    logcnt = torch.zeros(num_layers, num_logical, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if int(logcnt.max()) > width:
        raise ValueError(f"an expert has {int(logcnt.max())} replicas > log2phy width {width}")
    # replica rank of each slot = number of earlier slots with the same expert
    order = torch.argsort(phy2log * num_phy + torch.arange(num_phy), dim=1)
    sorted_e = phy2log.gather(1, order)
    first = torch.searchsorted(sorted_e.contiguous(), sorted_e.contiguous(), right=False)
    rank_sorted = torch.arange(num_phy).expand(num_layers, -1) - first
    log2phy = torch.full((num_layers, num_logical, width), -1, dtype=torch.int64)
    log2phy.view(num_layers, -1).scatter_(1, sorted_e * width + rank_sorted, order)
    return log2phy, logcnt


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    options: EplbOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packing-aware placement with vLLM 0.13's policy contract.

    Args:
        weight: [layers, num_logical_experts] load statistics (tokens, any non-negative dtype).
        num_replicas: physical experts P, a multiple of ``num_ranks`` and >= num_logical_experts.
        num_groups: expert groups; a count that would select vLLM's hierarchical mode (divisible by
            ``num_nodes``, nodes > 1) raises ``ValueError`` (not implemented; pass 1).
        num_nodes: server nodes; ``num_ranks`` must be a multiple of it.
        num_ranks: EP ranks.
        options: tuning knobs (default ``EplbOptions()``).

    Returns:
        phy2log [layers, P] int64: logical expert of each physical slot (slot p on rank p // (P/R)).
        log2phy [layers, E, P - E + 1] int64: physical slots of each expert, -1 padded.
        logcnt [layers, E] int64: replicas per expert (>= 1).
    """
    _check_shapes(weight, num_replicas, num_ranks, num_nodes)
    opts = options or EplbOptions()
    w = weight.detach().to(torch.float64).cpu().numpy()
    phy = torch.from_numpy(_solve_all(w, num_replicas, num_groups, num_nodes, num_ranks, opts, None, 0.0))
    log2phy, logcnt = log2phy_from_phy2log(phy, weight.shape[1], num_replicas - weight.shape[1] + 1)
    return phy.to(weight.device), log2phy.to(weight.device), logcnt.to(weight.device)


def rebalance_experts_migration_aware(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    prev_phy2log: torch.Tensor,
    migration_weight: float = 0.002,
    options: EplbOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like ``rebalance_experts`` but keeps experts in place unless moving them pays.

    Args:
        prev_phy2log: [layers, P] the current placement (same P and rank layout).
        migration_weight: peak-to-mean ratio one moved slot must buy (0 = ignore migration cost, still
            aligning the fresh placement to the previous one).

    Returns:
        phy2log, log2phy, logcnt as in ``rebalance_experts`` and moved [layers] int64 (slots whose
        logical expert changed versus ``prev_phy2log``).
    """
    _check_shapes(weight, num_replicas, num_ranks, num_nodes)
    if tuple(prev_phy2log.shape) != (weight.shape[0], num_replicas):
        raise ValueError(f"prev_phy2log shape {tuple(prev_phy2log.shape)} != {(weight.shape[0], num_replicas)}")
    if migration_weight < 0:
        raise ValueError("migration_weight must be >= 0")
    prev = prev_phy2log.detach().to(torch.int64).cpu().numpy()
    num_log = weight.shape[1]
    for layer in range(prev.shape[0]):
        if prev[layer].min() < 0 or prev[layer].max() >= num_log or np.unique(prev[layer]).shape[0] != num_log:
            raise ValueError(f"prev_phy2log layer {layer} does not hold every logical expert exactly >= once")
    opts = options or EplbOptions()
    w = weight.detach().to(torch.float64).cpu().numpy()
    new = _solve_all(w, num_replicas, num_groups, num_nodes, num_ranks, opts, prev, float(migration_weight))
    phy = torch.from_numpy(new)
    log2phy, logcnt = log2phy_from_phy2log(phy, num_log, num_replicas - num_log + 1)
    moved = torch.from_numpy((new != prev).sum(axis=1).astype(np.int64))
    dev = weight.device
    return phy.to(dev), log2phy.to(dev), logcnt.to(dev), moved


# ----------------------------------------------------------------------------------------------------
# evaluation helpers (used by tests and the benchmark)
# ----------------------------------------------------------------------------------------------------


def rank_loads(weight: torch.Tensor | np.ndarray, phy2log: torch.Tensor | np.ndarray, num_ranks: int) -> np.ndarray:
    """Per-rank load ``[L, R]`` of a placement: each replica carries ``w[e] / count[e]`` tokens."""
    w = np.asarray(weight, dtype=np.float64)
    p = np.asarray(phy2log, dtype=np.int64)
    num_layers, num_phy = p.shape
    cnt = np.zeros_like(w)
    np.add.at(cnt, (np.repeat(np.arange(num_layers), num_phy), p.ravel()), 1.0)
    share = np.take_along_axis(w, p, axis=1) / np.take_along_axis(cnt, p, axis=1)
    return share.reshape(num_layers, num_ranks, num_phy // num_ranks).sum(-1)


def balancedness(weight: torch.Tensor | np.ndarray, phy2log: torch.Tensor | np.ndarray, num_ranks: int) -> np.ndarray:
    """Per-layer balancedness ``mean / max`` of rank loads ``[L]`` (1.0 when a layer has no load)."""
    loads = rank_loads(weight, phy2log, num_ranks)
    mx = loads.max(axis=1)
    return np.where(mx > 0, loads.mean(axis=1) / np.where(mx > 0, mx, 1.0), 1.0)


def identity_placement(num_layers: int, num_logical: int) -> torch.Tensor:
    """No EPLB: no redundant experts, expert e in slot e (contiguous blocks per rank). ``[L, E]`` int64."""
    return torch.arange(num_logical, dtype=torch.int64).expand(num_layers, -1).clone()


def moved_slots(old: torch.Tensor | np.ndarray, new: torch.Tensor | np.ndarray) -> np.ndarray:
    """Slots whose logical expert changed, per layer ``[L]``."""
    return (np.asarray(old) != np.asarray(new)).sum(axis=1)
