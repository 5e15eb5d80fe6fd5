"""HDP (hybrid data parallelism): per-step assignment of sequences to DP ranks or CP blocks.

One context-parallel group of ``C`` ranks (``C`` a power of two) processes a batch of sequences in one or more
micro-batches. In every micro-batch each sequence runs either on a single rank (plain data parallelism,
block size 1) or on an *aligned block* of ``k`` ranks (``k`` a power of two dividing ``C``, first rank a
multiple of ``k``) with ring attention. Power-of-two aligned blocks keep ring groups disjoint and nested
(a block of 2 is half of a block of 4), match MindSpeed's ring-attention group construction, and make the
search space small: ``C / k`` block positions per size.

Tokens per rank (``tokens_on_rank``): ``s`` on a block of 1; ``2 * ceil(s / (2k))`` on a block of ``k > 1``
(load-balanced ring attention cuts the sequence into ``2k`` equal chunks, padded, and rank ``i`` of the
block holds chunks ``i`` and ``2k - 1 - i``).

Cost model (per rank, arbitrary time units, documented in docs/hdp.md):

    cost(s, k) = a * t + b * s**2 / k + g * [k > 1] * t * (k - 1)

with ``t = tokens_on_rank(s, k)``: ``a`` = linear layers (GEMMs, MoE) per token, ``b`` = causal attention per
token pair (the ``s**2`` attention work of one sequence split evenly by load-balanced chunking), ``g`` =
exposed ring-attention traffic per received KV token (``k - 1`` chunks pass through every rank).
Defaults for Qwen3-235B-A22B: ``a = 1``, ``b = 1 / 28000`` (linear and attention FLOPs per token are equal
at s ~ 28K: 6 * 22e9 vs 3 * 94 layers * 2 * 8192 * s), ``g = 0.05``.

Objective: minimise the maximum over ranks of the summed cost of all micro-batches (the step ends at the
gradient all-reduce, so the busiest rank sets the step time), subject to the per-rank token budget ``B`` in
every micro-batch — the budget is never exceeded. A sequence longer than ``C * B`` tokens (after padding)
cannot run at all and raises ``HDPInfeasibleError``.

Algorithm: (1) each sequence starts at the smallest block that fits the budget (short ones: DP), and is
widened while its per-rank cost exceeds the balanced share ``LB`` (a single long sequence on one rank would
be the straggler); (2) the number of micro-batches starts at ``ceil(total tokens / (C * B))``; (3) greedy
placement in decreasing total-cost order, each sequence to the (micro-batch, block) that minimises the
resulting max cost over the block's ranks, among positions with budget left (a sequence that fits nowhere
is widened, else a micro-batch is added); (4) refinement: DP sequences on the busiest rank are moved or
swapped to other ranks/micro-batches while the peak drops.

The result is an explicit ``HDPAssignment`` object (no module state) meant to be passed down the forward:
``rank_view(rank)`` lists, per micro-batch, what one rank runs — for each sequence its ring group (block
ranks), its position in the ring and the token ranges (chunks) it holds, which is what Megatron's RoPE
position ids and MindSpeed's ring attention need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "CostModel",
    "HDPAssignment",
    "HDPConfig",
    "HDPInfeasibleError",
    "Placement",
    "RankSlice",
    "assign_hdp",
    "lower_bound",
    "tokens_on_rank",
]


class HDPInfeasibleError(ValueError):
    """A sequence cannot fit the per-rank token budget even on the whole CP group."""


@dataclass(frozen=True)
class CostModel:
    """Per-rank cost ``a * t + b * s**2 / k + g * [k > 1] * t * (k - 1)`` (t = tokens on the rank)."""

    a: float = 1.0
    b: float = 1.0 / 28000.0
    g: float = 0.05

    def cost(self, s: int, k: int, align: int = 1) -> float:
        t = tokens_on_rank(s, k, align)
        return self.a * t + self.b * s * s / k + (self.g * t * (k - 1) if k > 1 else 0.0)


@dataclass(frozen=True)
class HDPConfig:
    """``qwen3_rl.hdp`` (the verl seam's group, :mod:`qwen3_rl.trainer.seam`): enable (default False);
    token_budget: tokens per rank per micro-batch (None -> the actor's ppo_max_token_len_per_gpu);
    cost_a / cost_b / cost_g: the :class:`CostModel` terms."""

    enable: bool = False
    token_budget: int | None = None
    cost_a: float = 1.0
    cost_b: float = 1.0 / 28000.0
    cost_g: float = 0.05

    def __post_init__(self) -> None:
        if self.token_budget is not None and int(self.token_budget) < 1:
            raise ValueError(f"token_budget must be >= 1 or null, got {self.token_budget!r}")

    @property
    def cost_model(self) -> CostModel:
        return CostModel(self.cost_a, self.cost_b, self.cost_g)


def tokens_on_rank(s: int, k: int, align: int = 1) -> int:
    """Tokens one rank holds when a sequence of ``s`` tokens runs on a block of ``k`` ranks (padding incl.).

    ``align``: the padded sequence length is a multiple of ``align`` (k = 1) or ``2 * k * align`` (k > 1),
    as verl's packing pads for TP sequence parallelism (align = TP size); align = 1 means no TP padding.
    """
    if k == 1:
        return -(-s // align) * align
    return 2 * align * -(-s // (2 * k * align))


@dataclass(frozen=True)
class Placement:
    """One sequence in one micro-batch: ranks ``block_start .. block_start + block_size - 1`` of the group."""

    seq: int
    length: int
    micro_batch: int
    block_start: int
    block_size: int

    @property
    def ranks(self) -> range:
        return range(self.block_start, self.block_start + self.block_size)


@dataclass(frozen=True)
class RankSlice:
    """What one rank runs for one sequence: ring position and the token ranges ``[start, end)`` it holds."""

    seq: int
    micro_batch: int
    ring_ranks: tuple[int, ...]
    ring_index: int
    token_ranges: tuple[tuple[int, int], ...]


@dataclass
class HDPAssignment:
    """Per-step HDP assignment for one CP group of ``cp_size`` ranks.

    placements: one per input sequence, index = sequence index. ``rank_cost[r]`` = summed cost of rank r over
    micro-batches; ``rank_tokens[m][r]`` = tokens of rank r in micro-batch m (always <= token_budget).
    """

    cp_size: int
    token_budget: int
    cost_model: CostModel
    placements: list[Placement]
    num_micro_batches: int
    rank_cost: list[float] = field(default_factory=list)
    rank_tokens: list[list[int]] = field(default_factory=list)
    align: int = 1

    @property
    def max_cost(self) -> float:
        return max(self.rank_cost) if self.rank_cost else 0.0

    def recompute(self) -> None:
        """Recompute ``rank_cost`` and ``rank_tokens`` from the placements."""
        self.rank_cost = [0.0] * self.cp_size
        self.rank_tokens = [[0] * self.cp_size for _ in range(self.num_micro_batches)]
        for p in self.placements:
            c = self.cost_model.cost(p.length, p.block_size, self.align)
            t = tokens_on_rank(p.length, p.block_size, self.align)
            for r in p.ranks:
                self.rank_cost[r] += c
                self.rank_tokens[p.micro_batch][r] += t

    def rank_view(self, rank: int) -> list[list[RankSlice]]:
        """Per micro-batch, the slices rank ``rank`` runs (sequence order = input order)."""
        out: list[list[RankSlice]] = [[] for _ in range(self.num_micro_batches)]
        for p in self.placements:
            if rank not in p.ranks:
                continue
            k = p.block_size
            i = rank - p.block_start
            if k == 1:
                ranges: tuple[tuple[int, int], ...] = ((0, p.length),)
            else:
                chunk = -(-p.length // (2 * k))
                ranges = tuple((min(j * chunk, p.length), min((j + 1) * chunk, p.length)) for j in (i, 2 * k - 1 - i))
            out[p.micro_batch].append(RankSlice(p.seq, p.micro_batch, tuple(p.ranks), i, ranges))
        return out

    def micro_batch(self, m: int) -> list[Placement]:
        return [p for p in self.placements if p.micro_batch == m]


def _block_sizes(cp_size: int) -> list[int]:
    return [1 << i for i in range(cp_size.bit_length()) if (1 << i) <= cp_size]


def _min_block(s: int, cp_size: int, budget: int, align: int = 1) -> int:
    for k in _block_sizes(cp_size):
        if tokens_on_rank(s, k, align) <= budget:
            return k
    raise HDPInfeasibleError(
        f"a sequence of {s} tokens needs {tokens_on_rank(s, cp_size, align)} tokens per rank even on the whole CP group "
        f"of {cp_size} ranks, over the per-rank token budget {budget}"
    )


def lower_bound(seq_lens: Sequence[int], cp_size: int, token_budget: int, cost: CostModel | None = None,
                align: int = 1) -> float:
    """Lower bound on the max per-rank cost: max(total minimal work / C, largest single-sequence rank cost)."""
    cm = cost or CostModel()
    total = 0.0
    single = 0.0
    for s in seq_lens:
        kmin = _min_block(s, cp_size, token_budget, align)
        sizes = [k for k in _block_sizes(cp_size) if k >= kmin]
        total += min(k * cm.cost(s, k, align) for k in sizes)
        single = max(single, min(cm.cost(s, k, align) for k in sizes))
    return max(total / cp_size, single)


def assign_hdp(
    seq_lens: Sequence[int],
    cp_size: int,
    token_budget: int,
    cost: CostModel | None = None,
    num_micro_batches: int | None = None,
    refine_steps: int = 2000,
    align: int = 1,
) -> HDPAssignment:
    """Assign every sequence to a (micro-batch, DP rank or aligned CP block) of one CP group.

    Args:
        seq_lens: token count of each sequence (prompt + response), > 0.
        cp_size: CP group size C, a power of two.
        token_budget: max tokens per rank per micro-batch (padding included), > 0.
        cost: cost model (default ``CostModel()``).
        num_micro_batches: minimum number of micro-batches (default: ceil(total tokens / (C * budget))).
        refine_steps: cap on refinement moves.
        align: padding multiple of the packed sequences (TP size with sequence parallelism; see
            ``tokens_on_rank``); budgets and costs count the padded tokens.

    Returns:
        HDPAssignment with one Placement per sequence; never exceeds the budget.

    Raises:
        HDPInfeasibleError: a sequence does not fit even on all C ranks.
        ValueError: bad arguments.
    """
    if cp_size < 1 or cp_size & (cp_size - 1):
        raise ValueError(f"cp_size must be a power of two >= 1, got {cp_size}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    lens = [int(s) for s in seq_lens]
    if any(s <= 0 for s in lens):
        raise ValueError("sequence lengths must be > 0")
    cm = cost or CostModel()
    C, B = cp_size, token_budget
    kmin = [_min_block(s, C, B, align) for s in lens]
    lb = lower_bound(lens, C, B, cm, align)
    # (1) block sizes: widen while a sequence alone would exceed the balanced share
    ksel = []
    for s, k in zip(lens, kmin, strict=True):
        while k < C and cm.cost(s, k, align) > lb:
            k *= 2
        ksel.append(k)
    total_tokens = sum(tokens_on_rank(s, k, align) * k for s, k in zip(lens, ksel, strict=True))
    M = max(1, num_micro_batches or 0, -(-total_tokens // (C * B)))
    order = sorted(range(len(lens)), key=lambda i: -ksel[i] * cm.cost(lens[i], ksel[i], align))
    cost_r = [0.0] * C
    tok: list[list[int]] = [[0] * C for _ in range(M)]
    place: dict[int, tuple[int, int, int]] = {}  # seq -> (mb, start, k)

    def best_spot(s: int, k: int) -> tuple[float, int, int] | None:
        t = tokens_on_rank(s, k, align)
        c = cm.cost(s, k, align)
        best = None
        for m in range(len(tok)):
            row = tok[m]
            for start in range(0, C, k):
                if any(row[r] + t > B for r in range(start, start + k)):
                    continue
                peak = max(cost_r[r] for r in range(start, start + k)) + c
                key = (peak, sum(row[start:start + k]), m)
                if best is None or key < best[0]:
                    best = (key, m, start)
        return None if best is None else (best[0][0], best[1], best[2])

    for i in order:
        s, k = lens[i], ksel[i]
        while True:
            spot = best_spot(s, k)
            if spot is not None:
                break
            if k < C:
                k *= 2
                continue
            tok.append([0] * C)  # a new micro-batch always fits (s fits on all C ranks)
            k = ksel[i]
        _, m, start = spot
        t, c = tokens_on_rank(s, k, align), cm.cost(s, k, align)
        for r in range(start, start + k):
            tok[m][r] += t
            cost_r[r] += c
        place[i] = (m, start, k)

    # (4) refinement of DP (block size 1) sequences on the busiest rank
    def t1(x: int) -> int:  # tokens of a DP (block 1) sequence, padding included
        return tokens_on_rank(x, 1, align)

    for _ in range(refine_steps):
        p = max(range(C), key=cost_r.__getitem__)
        peak = cost_r[p]
        best = None  # (new_peak, action)
        dp_here = [i for i, (m, st, k) in place.items() if k == 1 and st == p]
        for i in dp_here:
            m_i = place[i][0]
            s = lens[i]
            ci = cm.cost(s, 1, align)
            for q in range(C):
                if q == p:
                    continue
                # move i to rank q in any micro-batch with room
                if cost_r[q] + ci < peak - 1e-9:
                    for m in range(len(tok)):
                        if tok[m][q] + t1(s) <= B:
                            new_peak = max(peak - ci, cost_r[q] + ci)
                            if best is None or new_peak < best[0]:
                                best = (new_peak, ("move", i, q, m))
                            break
            # swap with a cheaper DP sequence j on another rank
            for j, (m_j, st_j, k_j) in place.items():
                if k_j != 1 or st_j == p:
                    continue
                cj = cm.cost(lens[j], 1, align)
                d = ci - cj
                if d <= 1e-9:
                    continue
                q = st_j
                new_peak = max(peak - d, cost_r[q] + d)
                if new_peak >= peak - 1e-9 or (best is not None and new_peak >= best[0]):
                    continue
                if tok[m_j][q] - t1(lens[j]) + t1(s) > B or tok[m_i][p] - t1(s) + t1(lens[j]) > B:
                    continue
                best = (new_peak, ("swap", i, j, 0))
        if best is None:
            break
        kind, i, x, m = best[1]
        if kind == "move":
            m_i = place[i][0]
            tok[m_i][p] -= t1(lens[i])
            cost_r[p] -= cm.cost(lens[i], 1, align)
            tok[m][x] += t1(lens[i])
            cost_r[x] += cm.cost(lens[i], 1, align)
            place[i] = (m, x, 1)
        else:
            j = x
            m_i, m_j, q = place[i][0], place[j][0], place[j][1]
            tok[m_i][p] += t1(lens[j]) - t1(lens[i])
            tok[m_j][q] += t1(lens[i]) - t1(lens[j])
            d = cm.cost(lens[i], 1, align) - cm.cost(lens[j], 1, align)
            cost_r[p] -= d
            cost_r[q] += d
            place[i] = (m_j, q, 1)
            place[j] = (m_i, p, 1)

    # drop empty micro-batches and renumber
    used = sorted({m for m, _, _ in place.values()})
    remap = {m: n for n, m in enumerate(used)}
    placements = [
        Placement(i, lens[i], remap[place[i][0]], place[i][1], place[i][2]) for i in range(len(lens))
    ]
    out = HDPAssignment(C, B, cm, placements, len(used), align=align)
    out.recompute()
    if any(t > B for row in out.rank_tokens for t in row):  # invariant, kept as a hard check
        raise AssertionError("HDP assignment exceeded the token budget")
    return out

