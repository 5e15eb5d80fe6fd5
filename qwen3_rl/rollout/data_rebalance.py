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

Placement by group key (``qwen3_rl.data_rebalance.by_key``, switch ``DATA_REBALANCE_BY_KEY``;
:func:`keyed_permutation`): the dealing above puts a prompt on ranks chosen by its batch position, which changes
every epoch, so the SAM history a rank keeps for a prompt (``SAM_HISTORY``) is found at the prompt's next visit
only when the position lands it on the same ranks (about ``min(n, dp) / dp`` of the visits). With ``by_key`` each
prompt has a home: the ``m = min(n, dp)`` consecutive ranks starting at ``m * (key mod (dp / m))`` (any start
``key mod dp`` when ``m`` does not divide ``dp``), its key a hash of its prompt token ids (the SAM group key), and
sample ``s`` goes to rank ``(home + s) mod dp``. Every rank still receives exactly ``B / dp`` rows: prompts are
placed in key order, a sample whose home rank is full goes to the rank with the most free rows (the lowest of
equals). A prompt's samples keep the spread of the dealing (one per rank of its home while ``n <= dp``), so the
load per rank has the same make-up; ``docs/rollout_balancing.md`` gives the measured imbalance and coverage.

verl is imported lazily inside the ``DataProto`` helpers, so this module imports without verl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

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


def home_ranks(keys: np.ndarray, n: int, dp: int) -> np.ndarray:
    """First home rank of each prompt (``keys``: uint64[P] group keys): int64[P] (module docstring)."""
    keys = np.asarray(keys, np.uint64)
    m = min(n, dp)
    if dp % m == 0:
        return (keys % np.uint64(dp // m)).astype(np.int64) * m
    return (keys % np.uint64(dp)).astype(np.int64)


def keyed_rank_of_rows(keys: np.ndarray, n: int, dp: int) -> tuple[np.ndarray, np.ndarray]:
    """DP rank of every row when a prompt's samples follow its group key, and whether each row is on its home.

    Args:
        keys: uint64[P] one group key per prompt, in batch order (row ``p * n + s`` is sample ``s`` of prompt ``p``).
        n: samples per prompt.
        dp: DP ranks; ``P * n`` must be a multiple of ``dp``.
    Returns:
        ``(rank, home)``: int64[P * n] rank of each row (every rank gets ``P * n / dp`` rows) and bool[P * n] True
        where the row is on its home rank ``(home_ranks + s) mod dp``.
    """
    keys = np.asarray(keys, np.uint64)
    p = keys.shape[0]
    _check_sizes(p * n, n, dp)
    if (p * n) % dp:
        raise DataRebalanceError(f"batch size {p * n} is not a multiple of the DP size {dp}")
    cap = p * n // dp
    want = (home_ranks(keys, n, dp)[:, None] + np.arange(n)[None, :]) % dp  # [P, n]
    rank = np.full((p, n), -1, np.int64)
    load = np.zeros(dp, np.int64)
    order = np.lexsort((np.arange(p), keys))  # key order (batch order among equal keys): no position bias
    for q in order:
        for s in range(n):
            r = want[q, s]
            if load[r] < cap:
                rank[q, s] = r
                load[r] += 1
    for q in order:  # the samples whose home was full: the rank with the most free rows
        for s in range(n):
            if rank[q, s] < 0:
                r = int(np.argmin(load))
                rank[q, s] = r
                load[r] += 1
    return rank.reshape(-1), (rank == want).reshape(-1)


def keyed_permutation(keys: np.ndarray, n: int, dp: int) -> np.ndarray:
    """Gather index placing each prompt's samples by its group key (:func:`keyed_rank_of_rows`); rank ``r`` holds
    ``new[r * B / dp:(r + 1) * B / dp]``, rows in dataset order inside a rank. Shape ``(B,)`` int64."""
    rank, _ = keyed_rank_of_rows(keys, n, dp)
    return np.argsort(rank, kind="stable").astype(np.int64)


def prompt_key(token_ids: np.ndarray) -> int:
    """The group key of a prompt (its token ids, any int dtype): a 64-bit hash of the ids as int64."""
    import hashlib

    ids = np.ascontiguousarray(np.asarray(token_ids).astype(np.int64))
    return int.from_bytes(hashlib.blake2b(ids.tobytes(), digest_size=8).digest(), "little")


def group_keys(data: DataProto, n: int) -> np.ndarray:
    """uint64[P] group keys of a generation batch (``P * n`` rows, samples of a prompt adjacent): the hash of
    prompt ``p``'s token ids (``input_ids`` where ``attention_mask`` is 1, row ``p * n``)."""
    ids = data.batch["input_ids"]
    mask = data.batch["attention_mask"]
    return np.asarray([prompt_key(ids[i][mask[i].bool()].cpu().numpy()) for i in range(0, len(data), n)],
                      np.uint64)


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


# ---- trainer wiring (called by verl patch 0013 and qwen3_rl.trainer.dapo) -------------------------

#: verl dispatch mesh of ``generate_sequences`` in the sync rollout (``megatron_workers.py`` registers it).
ROLLOUT_MESH = "rollout"


def rollout_dp_size_from_config(config: Any) -> int:
    """Number of contiguous pieces verl's sync rollout cuts a generation batch into, from the config.

    Mirrors ``verl/workers/megatron_workers.py:408-416``: ``dp = world / (infer_tp * infer_pp)`` with
    ``infer_tp = rollout.tensor_model_parallel_size * rollout.data_parallel_size``, ``infer_pp =
    rollout.pipeline_model_parallel_size`` and ``world = trainer.n_gpus_per_node * trainer.nnodes``
    (the colocated actor/rollout pool). With vLLM's own DP in ``engine_kwargs.vllm.data_parallel_size``
    (235B: TP4 x DP32 over 128 dies) this is ``128 / 4 = 32``: piece ``k`` is served by vLLM DP rank ``k``.
    """
    r = config.actor_rollout_ref.rollout
    world = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    infer = int(r.tensor_model_parallel_size) * int(r.get("data_parallel_size", 1) or 1) * int(
        r.get("pipeline_model_parallel_size", 1) or 1)
    if infer < 1 or world % infer:
        raise DataRebalanceError(f"rollout world size {world} is not divisible by TP*DP*PP = {infer}")
    return world // infer


def rollout_dp_size(worker_group: Any, config: Any) -> int:
    """Number of pieces ``generate_sequences`` is dispatched as, read exactly as verl dispatches it.

    verl's ``dispatch_lazy_compute_data_proto`` (``verl/single_controller/base/decorator.py:279-290``)
    asks every worker its ``"rollout"`` mesh DP rank once (``_query_dispatch_info``), caches the list in
    ``worker_group._dispatch_info`` and chunks the batch into ``max(ranks) + 1`` pieces. We fill the
    same cache the same way (so verl does not ask again) and return that count. A worker group without
    that machinery (not a verl ``WorkerGroup``) falls back to :func:`rollout_dp_size_from_config`.
    """
    cache = getattr(worker_group, "_dispatch_info", None)
    query = getattr(worker_group, "_query_dispatch_info", None)
    if isinstance(cache, dict) and callable(query):
        if ROLLOUT_MESH not in cache:
            cache[ROLLOUT_MESH] = query(ROLLOUT_MESH)
        mapping = list(cache[ROLLOUT_MESH])
        if not mapping:
            raise DataRebalanceError("the rollout worker group reported no dispatch ranks")
        return int(max(mapping)) + 1
    return rollout_dp_size_from_config(config)


def permute_for_rollout_on(
    config: Any, worker_group: Any, batch: DataProto, *, n: int = 1, async_mode: bool = False, by_key: bool = False
) -> tuple[DataProto, np.ndarray]:
    """:func:`permute_for_rollout` with the switch on (the seam's trainer hook has checked it); ``by_key``: place
    each prompt's samples by its group key (:func:`keyed_permutation`) instead of by batch position."""
    if async_mode:
        raise DataRebalanceError(
            "qwen3_rl.data_rebalance.enable=True needs the sync rollout (rollout.mode=sync): in "
            "async mode the agent loop sends each request to a server/DP rank by load, so the batch order "
            "does not decide the DP rank (docs/rollout_balancing.md)")
    dp = rollout_dp_size(worker_group, config)
    if len(batch) % dp:
        raise DataRebalanceError(
            f"data_rebalance: generation batch of {len(batch)} rows is not a multiple of the rollout DP "
            f"size {dp} (verl cuts it into {dp} equal contiguous pieces): use a batch size (prompts x n) "
            "that is a multiple of the rollout DP size, or switch qwen3_rl.data_rebalance.enable off")
    if by_key:
        perm = keyed_permutation(group_keys(batch, n), n, dp)
        return batch.select_idxs(perm), perm
    permuted, perm = permute_dataproto(batch, n, dp)
    return permuted, perm


def restore_after_rollout(output: DataProto, perm: np.ndarray | None) -> DataProto:
    """After ``generate_sequences``: put the output rows back in dataset order (no-op when ``perm`` is None).

    ``meta_info`` of the output is kept (``select_idxs`` shares it).
    """
    if perm is None:
        return output
    return restore_dataproto(output, perm)
