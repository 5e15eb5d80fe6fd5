"""DAPO dynamic sampling as pure functions on verl's ``DataProto``.

A *group* is the ``n`` responses of one prompt; they share a ``uid`` (``non_tensor_batch["uid"]``).
A group whose rewards all agree (all right or all wrong) has zero GRPO advantage and teaches nothing:
DAPO drops it and keeps generating batches until ``train_batch_size`` informative groups are collected.

Everything here works on the driver (CPU) and never calls a worker: the trainer calls
``GroupAccumulator.add`` after each generated + scored batch, asks ``is_full``, and either
``check_can_continue`` (raises past ``max_num_gen_batches``) or ``pop_train_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # verl is imported lazily: this module is importable without it
    from verl import DataProto

#: metrics computed from tensors instead of read from ``non_tensor_batch``
TENSOR_METRICS = ("seq_reward", "seq_final_reward")


class DynamicSamplingError(RuntimeError):
    """Not enough informative groups within the allowed number of generation batches."""


@dataclass(frozen=True)
class FilterStats:
    """Counts of one filtering pass (groups = prompts, rows = responses)."""

    num_groups: int
    num_kept_groups: int
    num_rows: int
    num_kept_rows: int


def group_metric_values(batch: DataProto, metric: str) -> np.ndarray:
    """Per-response value that decides whether a group is informative.

    Args:
        batch: scored batch of ``N`` responses.
        metric: ``"seq_reward"`` (sum of ``token_level_scores``), ``"seq_final_reward"`` (sum of
            ``token_level_rewards``), or a key of ``non_tensor_batch`` such as ``"acc"`` / ``"score"``
            that the reward function returned.

    Returns:
        float64 array of shape ``(N,)``.
    """
    if metric == "seq_reward":
        return batch.batch["token_level_scores"].sum(dim=-1).double().cpu().numpy()
    if metric == "seq_final_reward":
        return batch.batch["token_level_rewards"].sum(dim=-1).double().cpu().numpy()
    if metric not in batch.non_tensor_batch:
        have = sorted(batch.non_tensor_batch)
        raise KeyError(f"filter_groups.metric '{metric}' is not in the batch (have: {have}; or use "
                       f"{' / '.join(TENSOR_METRICS)})")
    return np.asarray(batch.non_tensor_batch[metric], dtype=np.float64)


def informative_row_mask(uids: np.ndarray, values: np.ndarray, atol: float = 0.0) -> np.ndarray:
    """Rows whose group does not have one common value.

    A group of a single response is kept (nothing to compare; DAPO's reference behaviour).

    Args:
        uids: shape ``(N,)`` group id per response.
        values: shape ``(N,)`` metric per response.
        atol: values closer than this count as equal.

    Returns:
        bool array ``(N,)``.
    """
    uids = np.asarray(uids)
    values = np.asarray(values, dtype=np.float64)
    if uids.shape != values.shape or uids.ndim != 1:
        raise ValueError(f"uids {uids.shape} and values {values.shape} must be equal 1-D shapes")
    _, inverse, counts = np.unique(uids, return_inverse=True, return_counts=True)
    gmax = np.full(counts.shape, -np.inf)
    gmin = np.full(counts.shape, np.inf)
    np.maximum.at(gmax, inverse, values)
    np.minimum.at(gmin, inverse, values)
    keep_group = (gmax - gmin > atol) | (counts == 1)
    return keep_group[inverse]


def _ordered_unique(uids: np.ndarray) -> np.ndarray:
    """Unique uids in order of first appearance."""
    _, first = np.unique(uids, return_index=True)
    return np.asarray(uids)[np.sort(first)]


def num_groups(batch: DataProto | None) -> int:
    """Number of distinct ``uid`` in ``batch`` (0 for None)."""
    if batch is None or len(batch) == 0:
        return 0
    return len(np.unique(batch.non_tensor_batch["uid"]))


def filter_groups(batch: DataProto, metric: str, atol: float = 0.0) -> tuple[DataProto, FilterStats]:
    """Drop the groups whose ``metric`` values all agree; row order is kept."""
    uids = batch.non_tensor_batch["uid"]
    mask = informative_row_mask(uids, group_metric_values(batch, metric), atol)
    kept_idx = np.nonzero(mask)[0]
    kept = batch.select_idxs(kept_idx)
    stats = FilterStats(
        num_groups=len(np.unique(uids)),
        num_kept_groups=len(np.unique(uids[kept_idx])) if kept_idx.size else 0,
        num_rows=len(uids),
        num_kept_rows=int(kept_idx.size),
    )
    return kept, stats


def take_whole_groups(batch: DataProto, n_groups: int) -> DataProto:
    """The rows of the first ``n_groups`` groups (order of first appearance), all rows of each.

    Raises:
        ValueError: ``batch`` holds fewer than ``n_groups`` groups.
    """
    uids = batch.non_tensor_batch["uid"]
    order = _ordered_unique(uids)
    if len(order) < n_groups:
        raise ValueError(f"batch has {len(order)} groups, {n_groups} requested")
    chosen = set(order[:n_groups].tolist())
    idx = np.array([i for i, u in enumerate(uids) if u in chosen], dtype=np.int64)
    return batch.select_idxs(idx)


def _concat(parts: list[DataProto]) -> DataProto:
    from verl import DataProto

    for p in parts:  # per-generation meta_info (timing, step) is not part of the training batch
        p.meta_info = {}
    return DataProto.concat(parts) if len(parts) > 1 else parts[0]


@dataclass
class GroupAccumulator:
    """Collects informative groups across generation batches until a train batch is full.

    Attributes:
        train_batch_size: prompts (groups) per training step.
        metric: filter metric, or None to keep every group (filtering off).
        max_num_gen_batches: generation batches allowed per training step; <= 0 means no limit.
    """

    train_batch_size: int
    metric: str | None = "acc"
    max_num_gen_batches: int = 0
    batch: Any = None
    num_gen_batches: int = 0
    stats: list[FilterStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.train_batch_size <= 0:
            raise ValueError(f"train_batch_size must be > 0, got {self.train_batch_size}")

    @property
    def num_groups(self) -> int:
        """Informative groups collected so far."""
        return num_groups(self.batch)

    def add(self, scored: DataProto) -> FilterStats:
        """Filter one generated + scored batch and append what is kept."""
        self.num_gen_batches += 1
        if self.metric is None:
            uids = scored.non_tensor_batch["uid"]
            n = len(np.unique(uids))
            kept, st = scored, FilterStats(n, n, len(uids), len(uids))
        else:
            kept, st = filter_groups(scored, self.metric)
        self.stats.append(st)
        if len(kept) > 0:
            self.batch = kept if self.batch is None else _concat([self.batch, kept])
        return st

    def is_full(self) -> bool:
        """True once at least ``train_batch_size`` groups are collected."""
        return self.num_groups >= self.train_batch_size

    def check_can_continue(self) -> None:
        """Raise if another generation batch is not allowed (call when not full)."""
        if self.max_num_gen_batches > 0 and self.num_gen_batches >= self.max_num_gen_batches:
            raise DynamicSamplingError(
                f"dynamic sampling: {self.num_groups} of {self.train_batch_size} prompt groups with "
                f"differing '{self.metric}' after {self.num_gen_batches} generation batches "
                f"(algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches}); raise it, "
                f"set it to 0 for no limit, or raise data.gen_batch_size")

    def pop_train_batch(self) -> DataProto:
        """Exactly ``train_batch_size`` whole groups; resets the accumulator (surplus dropped)."""
        if not self.is_full():
            raise DynamicSamplingError(
                f"train batch not full: {self.num_groups} of {self.train_batch_size} groups")
        out = take_whole_groups(self.batch, self.train_batch_size)
        self.batch = None
        self.num_gen_batches = 0
        self.stats = []
        return out

    def metrics(self) -> dict[str, float]:
        """Metrics of the current accumulation (before ``pop_train_batch``)."""
        groups = sum(s.num_groups for s in self.stats)
        kept = sum(s.num_kept_groups for s in self.stats)
        return {
            "dapo/num_gen_batches": float(self.num_gen_batches),
            "dapo/generated_groups": float(groups),
            "dapo/kept_group_ratio": kept / groups if groups else 0.0,
        }
