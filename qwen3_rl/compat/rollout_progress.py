"""Progress bar switch for the vLLM rollout's ``LLM.generate`` (config ``rollout.use_tqdm``).

verl 0.6.1 hard-codes ``use_tqdm=False``. With the switch on, one bar per inference replica is
shown: only tensor-parallel rank 0 of each replica draws it, because all TP ranks of a replica run
the same requests (their bars would be identical copies interleaved in the Ray log), while
different data-parallel replicas run different prompts and finish at different times.
"""

from __future__ import annotations

from typing import Any


def _global_rank() -> int:
    """This process's rank in the default torch.distributed group, 0 if none is initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is always present where verl runs
        return 0
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def rollout_use_tqdm(enabled: Any, tensor_parallel_size: int, rank: int | None = None) -> bool:
    """Whether this rank passes ``use_tqdm=True`` to ``LLM.generate``.

    Args:
        enabled: the config switch ``actor_rollout_ref.rollout.use_tqdm`` (falsy -> never).
        tensor_parallel_size: rollout TP size (ranks of one replica are contiguous in verl's
            ``["dp", "infer_tp"]`` mesh, so TP rank = global rank mod TP size).
        rank: global rank; default: torch.distributed rank, or 0 outside a process group.

    Returns:
        True only when the switch is on and this rank is TP rank 0 of its replica.
    """
    if not enabled:
        return False
    tp = max(int(tensor_parallel_size or 1), 1)
    r = _global_rank() if rank is None else int(rank)
    return r % tp == 0
