"""Data rebalance: lay the n samples of each prompt out across DP ranks instead of next to each other.

verl repeats each prompt n times with ``DataProto.repeat(n, interleave=True)``, so a generation
batch of ``B = num_prompts * n`` rows holds the samples of prompt ``p`` at rows ``p*n .. p*n+n-1``.
When that batch is cut into ``dp`` contiguous chunks (``DataProto.chunk(dp)``, one per DP rank),
each rank receives whole prompt groups; since the response lengths of one prompt's samples are
correlated, the ranks that drew the "long" prompts finish far later than the others.

The rebalance permutation deals the rows out like cards: row ``i`` (dataset order) goes to rank
``i mod dp``. Consequences, for ``B % dp == 0``:

* every rank receives exactly ``B / dp`` rows (the layout still chunks evenly);
* the n samples of a prompt are n consecutive rows, so they land on ``min(n, dp)`` distinct ranks,
  and each rank holds either ``floor(n/dp)`` or ``ceil(n/dp)`` of them (the best possible spread);
* inside a rank, rows keep their dataset order.

Convention: ``perm`` is a gather index, ``new_batch[j] = old_batch[perm[j]]``; its inverse ``inv``
satisfies ``old_batch[i] = new_batch[inv[i]]``, i.e. ``new_batch.select_idxs(inv)`` restores the
original order.

``B % dp != 0``: by default :func:`rebalance_permutation` raises :class:`DataRebalanceError`. With
``uneven="array_split"`` it returns the same dealing, whose rank sizes are then those of
``numpy.array_split(B, dp)`` (the first ``B % dp`` ranks get one extra row); the caller must then
split with those sizes (:func:`rank_sizes`) — verl's ``DataProto.chunk`` refuses uneven sizes unless
auto-padding is on, and its padded chunking uses ``ceil`` sizes, which differ.

verl is imported lazily inside the ``DataProto`` helpers, so this module imports without verl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from verl import DataProto

UnevenMode = Literal["error", "array_split"]

#: ``non_tensor_batch`` key under which :func:`permute_dataproto` may record each row's original index.
ORIG_INDEX_KEY = "data_rebalance_orig_index"


class DataRebalanceError(ValueError):
    """The batch cannot be rebalanced as asked (bad sizes, batch not a multiple of DP, ...)."""


def _check_sizes(batch_size: int, n: int, dp: int) -> None:
    for name, val in (("batch_size", batch_size), ("n", n), ("dp", dp)):
        if not isinstance(val, int | np.integer) or isinstance(val, bool):
            raise DataRebalanceError(f"{name} must be an int, got {type(val).__name__}")
    if batch_size < 0:
        raise DataRebalanceError(f"batch_size must be >= 0, got {batch_size}")
    if n < 1:
        raise DataRebalanceError(f"n (samples per prompt) must be >= 1, got {n}")
    if dp < 1:
        raise DataRebalanceError(f"dp (data-parallel size) must be >= 1, got {dp}")
    if batch_size % n:
        raise DataRebalanceError(
            f"batch size {batch_size} is not a multiple of n={n}: rows are not whole prompt groups"
        )


def rank_sizes(batch_size: int, dp: int) -> np.ndarray:
    """Rows per DP rank under the rebalanced layout: ``numpy.array_split`` sizes, shape ``(dp,)`` int64."""
    if dp < 1:
        raise DataRebalanceError(f"dp (data-parallel size) must be >= 1, got {dp}")
    base, extra = divmod(batch_size, dp)
    return np.array([base + (1 if r < extra else 0) for r in range(dp)], dtype=np.int64)


def rebalance_permutation(batch_size: int, n: int, dp: int, *, uneven: UnevenMode = "error") -> np.ndarray:
    """Gather index that deals the rows of a prompt-grouped batch round-robin over DP ranks.

    Args:
        batch_size: B = num_prompts * n rows, samples of a prompt adjacent (verl ``repeat(interleave=True)``).
        n: samples per prompt (``rollout.n``).
        dp: number of DP ranks the batch is cut into (contiguous chunks).
        uneven: what to do when ``B % dp != 0``: ``"error"`` (default) raises
            :class:`DataRebalanceError`; ``"array_split"`` deals anyway, rank sizes as :func:`rank_sizes`.

    Returns:
        ``perm``, shape ``(B,)`` int64, a permutation of ``0..B-1``: ``new[j] = old[perm[j]]``.
        Rank ``r`` holds ``new[offsets[r]:offsets[r+1]]`` with offsets from :func:`rank_sizes`, i.e.
        the old rows ``r, r+dp, r+2dp, ...``.
    """
    _check_sizes(batch_size, n, dp)
    if batch_size % dp:
        if uneven == "error":
            raise DataRebalanceError(
                f"batch size {batch_size} is not a multiple of the DP size {dp}: cannot give every DP "
                "rank the same number of rows (use a batch size that is a multiple of DP, or "
                "uneven='array_split' and split with rank_sizes())"
            )
        if uneven != "array_split":
            raise DataRebalanceError(f"unknown uneven mode {uneven!r} (expected 'error' or 'array_split')")
    idx = np.arange(batch_size, dtype=np.int64)
    return np.concatenate([idx[r::dp] for r in range(dp)]) if batch_size else idx


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """Inverse of a gather permutation: ``inv[perm[j]] = j``. Shape ``(B,)`` int64.

    Raises :class:`DataRebalanceError` if ``perm`` is not a permutation of ``0..B-1``.
    """
    perm = np.asarray(perm)
    size = perm.shape[0] if perm.ndim == 1 else -1
    if perm.ndim != 1 or not np.issubdtype(perm.dtype, np.integer):
        raise DataRebalanceError(f"perm must be a 1-D integer array, got shape {perm.shape} dtype {perm.dtype}")
    if size and (perm.min() < 0 or perm.max() >= size or np.unique(perm).shape[0] != size):
        raise DataRebalanceError("perm is not a permutation of 0..B-1")
    inv = np.empty(size, dtype=np.int64)
    inv[perm] = np.arange(size, dtype=np.int64)
    return inv


def rank_of_rows(batch_size: int, dp: int) -> np.ndarray:
    """DP rank each original row goes to under the rebalanced layout: ``row i -> i mod dp``. Shape ``(B,)``."""
    return np.arange(batch_size, dtype=np.int64) % dp


def contiguous_rank_of_rows(batch_size: int, dp: int) -> np.ndarray:
    """DP rank of each row under the default (contiguous chunk) layout, ``array_split`` sizes. Shape ``(B,)``."""
    return np.repeat(np.arange(dp, dtype=np.int64), rank_sizes(batch_size, dp))


def permute_dataproto(
    data: DataProto, n: int, dp: int, *, uneven: UnevenMode = "error", record_index: bool = False
) -> tuple[DataProto, np.ndarray]:
    """Rebalance a verl ``DataProto`` of ``num_prompts * n`` rows for ``dp`` DP ranks.

    Args:
        data: the repeated generation batch (samples of a prompt adjacent); not modified.
        n: samples per prompt.
        dp: DP ranks the batch will be chunked into.
        uneven: see :func:`rebalance_permutation`.
        record_index: also store each row's original index (int64) in
            ``non_tensor_batch[ORIG_INDEX_KEY]`` so :func:`restore_dataproto_by_index` can undo the
            permutation on a batch whose rows were later filtered.

    Returns:
        ``(permuted, perm)``: a new ``DataProto`` (``data.select_idxs(perm)``; ``meta_info`` shared)
        and the gather permutation (shape ``(B,)``) to pass to :func:`restore_dataproto`.
    """
    perm = rebalance_permutation(len(data), n, dp, uneven=uneven)
    out = data.select_idxs(perm)
    if record_index:
        out.non_tensor_batch[ORIG_INDEX_KEY] = perm.copy()
    return out, perm


def restore_dataproto(data: DataProto, perm: np.ndarray) -> DataProto:
    """Undo :func:`permute_dataproto`: rows of ``data`` (in permuted order) back to dataset order.

    ``data`` may be the permuted input or any batch produced row-for-row from it (e.g. the
    generation output). Returns a new ``DataProto``; ``ORIG_INDEX_KEY`` is dropped if present.
    """
    perm = np.asarray(perm)
    if len(data) != perm.shape[0]:
        raise DataRebalanceError(
            f"cannot restore order: batch has {len(data)} rows but the permutation has {perm.shape[0]}"
        )
    out = data.select_idxs(inverse_permutation(perm))
    out.non_tensor_batch.pop(ORIG_INDEX_KEY, None)
    return out


def restore_dataproto_by_index(data: DataProto) -> DataProto:
    """Put rows back in dataset order using the recorded ``ORIG_INDEX_KEY`` column (rows may be missing).

    Works on any subset of a batch made by ``permute_dataproto(..., record_index=True)``: rows are
    sorted by their original index. Raises :class:`DataRebalanceError` if the column is absent or holds
    duplicates.
    """
    if ORIG_INDEX_KEY not in data.non_tensor_batch:
        raise DataRebalanceError(f"batch has no '{ORIG_INDEX_KEY}' column (permute with record_index=True)")
    orig = np.asarray(data.non_tensor_batch[ORIG_INDEX_KEY]).astype(np.int64)
    if np.unique(orig).shape[0] != orig.shape[0]:
        raise DataRebalanceError(f"'{ORIG_INDEX_KEY}' holds duplicate indices")
    out = data.select_idxs(np.argsort(orig, kind="stable"))
    out.non_tensor_batch.pop(ORIG_INDEX_KEY, None)
    return out
