"""HDP wiring: from a per-step ``HDPAssignment`` to what one rank feeds Megatron RoPE, ring attention and verl.

The assignment (``qwen3_rl.parallel.hdp``) says, per micro-batch, which sequences a CP group of ``C`` ranks
runs and on which aligned block of ``k`` ranks. This module turns it into the explicit per-micro-batch object
``HDPMicroBatch`` that travels with the micro-batch (verl's forward step -> ``PackedSeqParams.hdp`` ->
Megatron attention -> RoPE / MindSpeed ring attention). No module state: the object lives exactly as long as
its micro-batch's forward/backward.

Layout of one rank's packed ``thd`` input for one micro-batch (``T`` tokens):

* segments in the global order ``(block_size, block_start, seq)`` (every rank runs its ring groups in the same
  order, so the per-group collectives cannot wait on each other in a cycle: the smallest unfinished group
  always has all its members at it);
* a sequence of ``s`` valid tokens on a block of ``k`` ranks is padded to ``P`` = multiple of ``2 * k * align``
  (``k > 1``) or ``align`` (``k = 1``), ``align`` = TP size (sequence parallelism), as verl's
  ``preprocess_packed_seqs`` does for full CP; ring member ``i`` holds chunks ``i`` and ``2k - 1 - i`` of
  ``P / (2k)`` tokens (Megatron / TransformerEngine load-balanced causal split) -> ``P / k`` local tokens.

Position ids of the local tokens (for RoPE) are the chunk positions in the padded sequence: identical to what
Megatron's ``_get_thd_freqs_on_this_cp_rank(i, k, ...)`` selects for full CP with ``k`` ranks.

Sub-groups: ``HDPProcessGroups.build`` creates one process group per aligned block smaller than the CP group, for
every CP group, once, at start-up (``new_group`` is collective over the world, so all ranks create all groups in the
same order); a block spanning the whole CP group reuses the CP group itself. On HCCL a communicator (and its
``2 x HCCL_BUFFSIZE`` buffer) comes into being at the first collective on a group, so the groups that cost device
memory are the blocks of 2 .. C/2 ranks (a DP segment is a ring of one: no traffic); ``python -m qwen3_rl plan``
counts them (``qwen3_rl.tools.plan.memory.hdp_hccl_comms``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qwen3_rl.parallel.hdp import HDPAssignment

__all__ = [
    "FILLER",
    "HDPGroupSlice",
    "HDPMicroBatch",
    "HDPProcessGroups",
    "HDPSegment",
    "aligned_blocks",
    "assemble_owned_rows",
    "filler_length",
    "hdp_attention",
    "hdp_loss_scale",
    "pack_sequences",
    "padded_length",
    "plan_micro_batches",
    "rope_positions",
    "sub_cp_para",
    "sub_packed_seq_params",
    "unpack_outputs",
]


FILLER = -1  # sequence index of a filler segment


def filler_length(align: int = 1) -> int:
    """Tokens of a filler segment: the smallest multiple of ``align`` that is >= 2.

    Not 1: MindSpeed's causal-EoD ring attention (pinned v2.2.0_core_r0.12.1) cannot back-propagate a ring group
    whose local sequences all have 1 token (``get_selection_indices_for_tnd_softmax_update``,
    ``core/context_parallel/utils.py:43-55``, returns ``torch.tensor([])``, a float tensor, and
    ``ring_context_parallel.py:1086`` indexes with it: ``IndexError``), which a filler of ``align`` = 1 token is.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    return -(-2 // align) * align


def padded_length(s: int, k: int, align: int = 1) -> int:
    """Padded length of a sequence of ``s`` tokens on a block of ``k`` ranks (multiple of 2k*align or align)."""
    m = 2 * k * align if k > 1 else align
    return -(-s // m) * m


def rope_positions(padded: int, k: int, i: int) -> torch.Tensor:
    """Positions (int64, [padded // k]) that ring member ``i`` of a ``k``-rank block holds of a padded sequence.

    k = 1: ``0 .. padded-1``. k > 1: chunk ``i`` then chunk ``2k-1-i`` of ``padded // (2k)`` tokens each.
    """
    if k == 1:
        return torch.arange(padded, dtype=torch.long)
    c = padded // (2 * k)
    return torch.cat([torch.arange(i * c, (i + 1) * c), torch.arange((2 * k - 1 - i) * c, (2 * k - i) * c)])


@dataclass(frozen=True)
class HDPSegment:
    """One sequence as seen by one rank in one micro-batch.

    seq: index in the step's batch; block_start / block_size: CP-group-local ranks of its block;
    ring_index: this rank's position in the block; length: valid tokens; padded: padded full length;
    offset: first token of this segment in the rank's packed tensor; local_length = padded // block_size.
    """

    seq: int
    block_start: int
    block_size: int
    ring_index: int
    length: int
    padded: int
    offset: int

    @property
    def local_length(self) -> int:
        return self.padded // self.block_size

    @property
    def order_key(self) -> tuple[int, int, int]:
        return (self.block_size, self.block_start, self.seq)

    def positions(self) -> torch.Tensor:
        """Positions in the padded sequence of the local tokens, [local_length] int64."""
        return rope_positions(self.padded, self.block_size, self.ring_index)


@dataclass(frozen=True)
class HDPGroupSlice:
    """Consecutive segments of one block (one ring group) in a rank's packed tensor: tokens ``[lo, hi)``.

    cu_seqlens_padded: cumulative *full* padded lengths of the group's sequences (starts at 0), the unit
    MindSpeed's ring attention divides by the ring size.
    """

    block_start: int
    block_size: int
    ring_index: int
    lo: int
    hi: int
    segments: tuple[HDPSegment, ...]

    @property
    def cu_seqlens_padded(self) -> list[int]:
        out = [0]
        for s in self.segments:
            out.append(out[-1] + s.padded)
        return out

    @property
    def local_cu_seqlens(self) -> list[int]:
        out = [0]
        for s in self.segments:
            out.append(out[-1] + s.local_length)
        return out


@dataclass(frozen=True)
class HDPMicroBatch:
    """What one rank runs in one micro-batch under HDP: passed explicitly down the forward.

    rank: CP-group-local rank; cp_size: C; segments: in the global order (see module doc);
    loss_scale: factor on the micro-batch's token-mean loss (``hdp_loss_scale``); process_groups: the
    sub-groups (None in single-process use).
    """

    rank: int
    cp_size: int
    micro_batch: int
    num_micro_batches: int
    align: int
    segments: tuple[HDPSegment, ...]
    loss_scale: float = 1.0
    process_groups: HDPProcessGroups | None = field(default=None, compare=False, repr=False)

    @property
    def seq_indices(self) -> list[int]:
        return [s.seq for s in self.segments]

    @property
    def is_filler(self) -> bool:
        """True when this rank runs only filler tokens in this micro-batch (no loss, no output rows)."""
        return all(s.seq == FILLER for s in self.segments)

    @property
    def num_tokens(self) -> int:
        return sum(s.local_length for s in self.segments)

    @property
    def max_padded(self) -> int:
        return max((s.padded for s in self.segments), default=0)

    def local_cu_seqlens(self) -> list[int]:
        out = [0]
        for s in self.segments:
            out.append(out[-1] + s.local_length)
        return out

    def groups(self) -> list[HDPGroupSlice]:
        """Segments grouped by block, in the global order (DP segments are blocks of size 1)."""
        out: list[HDPGroupSlice] = []
        cur: list[HDPSegment] = []
        for s in self.segments:
            if cur and (cur[0].block_size, cur[0].block_start) != (s.block_size, s.block_start):
                out.append(_group(cur))
                cur = []
            cur.append(s)
        if cur:
            out.append(_group(cur))
        return out

    def position_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """RoPE positions of the packed local tokens, [num_tokens] int64."""
        if not self.segments:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([s.positions() for s in self.segments]).to(device)

    def rope_freqs(self, freqs: torch.Tensor) -> torch.Tensor:
        """Select the rotary table rows of the local tokens: freqs [max_s, 1, 1, d] -> [num_tokens, 1, 1, d]."""
        pos = self.position_ids(freqs.device)
        if pos.numel() and int(pos.max()) >= freqs.shape[0]:
            raise ValueError(f"rotary table has {freqs.shape[0]} positions, HDP needs {int(pos.max()) + 1}")
        return freqs.index_select(0, pos)


def _group(segs: list[HDPSegment]) -> HDPGroupSlice:
    s0 = segs[0]
    return HDPGroupSlice(s0.block_start, s0.block_size, s0.ring_index, s0.offset,
                         segs[-1].offset + segs[-1].local_length, tuple(segs))


def plan_micro_batches(assignment: HDPAssignment, rank: int, align: int | None = None,
                       process_groups: HDPProcessGroups | None = None,
                       num_micro_batches: int | None = None) -> list[HDPMicroBatch]:
    """Per micro-batch, the ``HDPMicroBatch`` of CP-group rank ``rank`` (every rank gets the same count).

    A rank with nothing to run in a micro-batch gets one filler segment (``seq == FILLER``,
    ``filler_length(align)`` tokens on its own rank) so that every rank runs the micro-batch; fillers carry no loss
    and no output.

    num_micro_batches: how many micro-batches to return (default: the assignment's); the ones past the
    assignment's are filler-only on every rank. This is how all data-parallel groups run the same count (the
    expert-parallel all-to-alls span them). align defaults to the assignment's. loss_scale is left at 1.0 (set
    with ``dataclasses.replace``).
    """
    al = assignment.align if align is None else align
    total = assignment.num_micro_batches if num_micro_batches is None else int(num_micro_batches)
    if total < assignment.num_micro_batches:
        raise ValueError(f"num_micro_batches {total} < the assignment's {assignment.num_micro_batches}")
    per_mb: list[list[tuple[tuple[int, int, int], Any]]] = [[] for _ in range(total)]
    for p in assignment.placements:
        if rank in p.ranks:
            per_mb[p.micro_batch].append(((p.block_size, p.block_start, p.seq), p))
    out = []
    for m, items in enumerate(per_mb):
        items.sort(key=lambda x: x[0])
        segs = []
        off = 0
        for _, p in items:
            seg = HDPSegment(p.seq, p.block_start, p.block_size, rank - p.block_start, p.length,
                             padded_length(p.length, p.block_size, al), off)
            segs.append(seg)
            off += seg.local_length
        if not segs:  # Megatron cannot run 0 tokens: a filler (seq -1, no loss, no output), >= 2 tokens
            n = filler_length(al)
            segs.append(HDPSegment(FILLER, rank, 1, 0, n, n, 0))
        out.append(HDPMicroBatch(rank, assignment.cp_size, m, total, al, tuple(segs), process_groups=process_groups))
    return out


def pack_sequences(rows: torch.Tensor, lengths: Sequence[int], mb: HDPMicroBatch) -> torch.Tensor:
    """Pack this rank's tokens: ``rows`` [n_seq_in_mb, L, ...] (segment order, left-aligned valid tokens,
    ``lengths[j]`` valid) -> [num_tokens, ...], padding zeros."""
    out = rows.new_zeros((mb.num_tokens, *rows.shape[2:]))
    for j, seg in enumerate(mb.segments):
        s = int(lengths[j])
        pos = seg.positions()
        valid = pos < s
        dst = torch.arange(seg.offset, seg.offset + seg.local_length)[valid]
        out[dst] = rows[j, pos[valid]]
    return out


def unpack_outputs(out: torch.Tensor, mb: HDPMicroBatch, seq_len: int,
                   all_gather: Callable[[torch.Tensor, HDPGroupSlice], list[torch.Tensor]] | None = None,
                   ) -> torch.Tensor:
    """Inverse of ``pack_sequences`` with the block's other chunks gathered: [T, ...] -> [n, seq_len, ...].

    ``all_gather(local, group)`` returns the ``group.block_size`` local tensors of the group's members (ring
    order) with this rank's own tensor kept in the autograd graph (the others detached), like verl's
    ``postprocess_packed_seqs``. Required when any segment has block_size > 1. Positions >= length stay 0.
    """
    res = out.new_zeros((len(mb.segments), seq_len, *out.shape[1:]))
    j = 0
    for g in mb.groups():
        local = out[g.lo:g.hi]
        if g.block_size == 1:
            parts = [local]
        else:
            if all_gather is None:
                raise ValueError("unpack_outputs needs all_gather for segments on blocks of > 1 rank")
            parts = all_gather(local, g)
        for seg in g.segments:
            s = seg.length
            rel = seg.offset - g.lo
            for r, part in enumerate(parts):
                pos = rope_positions(seg.padded, g.block_size, r)
                valid = pos < s
                src = part[rel:rel + seg.local_length][valid]
                res[j, pos[valid]] = src
            j += 1
    return res


def hdp_loss_scale(local_tokens: int, group_tokens: int, num_micro_batches: int) -> float:
    """Factor on a micro-batch's token-mean loss under HDP.

    Megatron's schedule multiplies each micro-batch loss by ``C / M`` and DDP averages gradients over the
    DP x CP ranks. Under plain CP every CP rank returns the same micro-batch token-mean, and the per-rank
    gradients (own chunks only) add up to the full gradient. Under HDP rank r's micro-batch m holds its own
    sequences (a k-block sequence on all k ranks, each back-propagating its chunks), so the group's summed
    gradient equals that of the token-mean over the CP group's whole mini-batch iff each micro-batch loss
    ``mean_r,m`` is scaled by ``tokens_r,m * M / tokens_group`` (tokens = loss-mask tokens, a k-block
    sequence counted on each of its ranks once). Returns that factor (0 when the rank has no tokens).
    """
    if group_tokens <= 0:
        raise ValueError("group_tokens must be > 0")
    return float(local_tokens) * num_micro_batches / float(group_tokens)


def assemble_owned_rows(rows: torch.Tensor, seq_indices: Sequence[Sequence[int]], assignment: HDPAssignment,
                        rank: int, batch_size: int,
                        all_reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Full-batch tensor [batch_size, ...] from this rank's per-sequence rows.

    rows: concatenation over micro-batches of this rank's rows (order ``seq_indices[m]``). A sequence is
    written by its block's first rank only (its owner), then ``all_reduce`` (sum over the CP group, in place)
    fills the rest; without all_reduce only the owned rows are filled.
    """
    out = rows.new_zeros((batch_size, *rows.shape[1:]))
    owner = {p.seq: p.block_start for p in assignment.placements}
    flat = [i for mb in seq_indices for i in mb]
    if len(flat) != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows for {len(flat)} sequence indices")
    for j, i in enumerate(flat):
        if i != FILLER and owner[i] == rank:
            out[i] = rows[j]
    if all_reduce is not None:
        all_reduce(out)
    return out


def aligned_blocks(cp_size: int, min_size: int = 2) -> list[tuple[int, int]]:
    """All aligned power-of-two blocks ``(start, size)`` with size >= min_size of a CP group, creation order."""
    out = []
    k = min_size
    while k <= cp_size:
        out.extend((st, k) for st in range(0, cp_size, k))
        k *= 2
    return out


@dataclass
class HDPProcessGroups:
    """Process groups of the aligned blocks of every CP group: ``groups[(global ranks)] = handle``.

    Build once with every rank of the world calling ``build`` with the same ``cp_groups`` (lists of global
    ranks, CP-local order) — ``new_group`` is collective over the world.
    """

    cp_global_ranks: tuple[int, ...]
    groups: dict[tuple[int, ...], Any]

    @classmethod
    def build(cls, cp_groups: Sequence[Sequence[int]], my_cp_global_ranks: Sequence[int],
              new_group: Callable[[list[int]], Any], cp_group: Any = None) -> HDPProcessGroups:
        """``new_group(ranks)`` for every aligned block of every CP group, in one global order.

        cp_group: this rank's existing CP process group (Megatron's); when given, the block spanning the whole CP
        group is that group (no new group, no second HCCL communicator) — every rank must then pass its own.
        None: the whole-group blocks are created like the others (single-process use, tests).
        """
        groups: dict[tuple[int, ...], Any] = {}
        sizes = {len(g) for g in cp_groups}
        if len(sizes) != 1:
            raise ValueError(f"CP groups of different sizes: {sorted(sizes)}")
        mine = tuple(my_cp_global_ranks)
        for g in sorted(tuple(x) for x in cp_groups):
            for st, k in aligned_blocks(len(g), min_size=1):  # size 1: DP segments run as a ring of one
                ranks = tuple(g[st:st + k])
                if k == len(g) and cp_group is not None:
                    if ranks == mine:
                        groups[ranks] = cp_group
                    continue
                groups[ranks] = new_group(list(ranks))
        return cls(mine, groups)

    def block_ranks(self, block_start: int, block_size: int) -> tuple[int, ...]:
        return self.cp_global_ranks[block_start:block_start + block_size]

    def group(self, block_start: int, block_size: int) -> Any:
        return self.groups[self.block_ranks(block_start, block_size)]


def sub_cp_para(base: dict[str, Any], g: HDPGroupSlice, pgs: HDPProcessGroups) -> dict[str, Any]:
    """MindSpeed ring-attention parameters for one block: ``base`` (built for the full CP group) with the
    group, size, rank and ranks of the block; windowed (double-ring) options reset to a single ring."""
    ranks = list(pgs.block_ranks(g.block_start, g.block_size))
    out = dict(base)
    out.update(
        cp_group=pgs.group(g.block_start, g.block_size),
        cp_size=g.block_size,
        rank=g.ring_index,
        cp_global_ranks=ranks,
        cp_group_for_send_recv_overlap=None,
        cp_inner_ranks=[ranks[g.ring_index]],
        cp_outer_ranks=ranks,
        cp_dkv_outer_ranks=ranks,
        cp_group_for_intra_window=None,
        cp_group_for_intra_window_send_recv_overlap=None,
    )
    return out


def sub_packed_seq_params(psp: Any, g: HDPGroupSlice) -> Any:
    """A new PackedSeqParams (same class, no ``hdp``) for one group: local cumulative lengths in
    ``cu_seqlens_q/kv``, full padded cumulative lengths in ``cu_seqlens_*_padded`` (ring attention divides
    them by the ring size), max lengths = the group's largest padded sequence. Tensors int32 on psp's device."""
    dev = psp.cu_seqlens_q.device if getattr(psp, "cu_seqlens_q", None) is not None else None
    loc = torch.tensor(g.local_cu_seqlens, dtype=torch.int32, device=dev)
    pad = torch.tensor(g.cu_seqlens_padded, dtype=torch.int32, device=dev)
    mx = max(s.padded for s in g.segments)
    return type(psp)(qkv_format=psp.qkv_format, cu_seqlens_q=loc, cu_seqlens_kv=loc, cu_seqlens_q_padded=pad,
                     cu_seqlens_kv_padded=pad, max_seqlen_q=mx, max_seqlen_kv=mx)


def hdp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mb: HDPMicroBatch,
                  ring_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, HDPGroupSlice], torch.Tensor],
                  local_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, HDPGroupSlice], torch.Tensor],
                  ) -> torch.Tensor:
    """Attention of a rank's packed tokens (q/k/v [T, ...], first dim tokens): per ring group in the global
    order, ``ring_fn`` on blocks of > 1 rank, ``local_fn`` on DP segments; outputs concatenated [T, ...]."""
    if q.shape[0] != mb.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, the HDP micro-batch {mb.num_tokens}")
    outs = []
    for g in mb.groups():
        fn = local_fn if g.block_size == 1 else ring_fn
        outs.append(fn(q[g.lo:g.hi], k[g.lo:g.hi], v[g.lo:g.hi], g))
    return torch.cat(outs, dim=0)
