"""Keeping megatron-core's extra attributes of a distributed checkpoint's ``.metadata`` (megatron patch 0004).

megatron-core 0.12.1 adds attributes to torch's ``torch.distributed.checkpoint.metadata.Metadata`` dataclass
while it plans a save: ``mcore_data`` (per tensor, the original global shape of N-D tensors saved flattened,
read back by ``get_reformulation_metadata`` on every load of a distributed optimizer) and ``all_local_plans``
(read to reuse a cached save plan). torch 2.8's ``FileSystemWriter.finish`` pickles that object as it is;
torch 2.9 first rebuilds it with ``dataclasses.replace`` (pytorch issue #162948), which keeps declared fields
only, so the checkpoint saves fine and every resume then fails with
``AttributeError: 'Metadata' object has no attribute 'mcore_data'`` (Megatron-LM issue #2345).

:func:`restore_extra_attributes` runs after ``finish``: when the file lacks any of the attributes the object
had, it sets them and rewrites the file (write to a temporary name, then rename). The pickled class stays
torch's ``Metadata``, so the file is what torch 2.8 writes and pristine megatron-core reads it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

__all__ = ["extra_attributes", "metadata_file", "restore_extra_attributes"]


def extra_attributes(metadata: Any) -> dict[str, Any]:
    """The instance attributes of a dataclass object that are not its declared fields (``{}`` for none)."""
    declared = {f.name for f in dataclasses.fields(metadata)}
    return {k: v for k, v in vars(metadata).items() if k not in declared}


def metadata_file(writer: Any) -> Path:
    """The ``.metadata`` file ``writer.finish`` writes: torch 2.9's ``_get_metadata_path`` (per rank when the
    writer does not use collectives), else torch 2.8's ``metadata_path``."""
    get = getattr(writer, "_get_metadata_path", None)
    if get is None:
        return Path(writer.metadata_path)
    per_rank = not getattr(writer, "use_collectives", True) and getattr(writer, "rank", None) is not None
    return Path(get(writer.rank) if per_rank else get())


def restore_extra_attributes(path: str | os.PathLike, extras: dict[str, Any]) -> list[str]:
    """Put ``extras`` back on the ``Metadata`` pickled at ``path`` where they are missing; rewrite atomically.

    Args:
        path: the checkpoint's ``.metadata`` file, as ``FileSystemWriter.finish`` left it.
        extras: :func:`extra_attributes` of the object given to ``finish``.

    Returns:
        The names restored, sorted (``[]``: the file already had them all, nothing written).
    """
    path = Path(path)
    if not extras:
        return []
    with open(path, "rb") as f:
        saved = pickle.load(f)  # noqa: S301 (the file this process has just written)
    missing = sorted(k for k in extras if not hasattr(saved, k))
    if not missing:
        return []
    for k in missing:
        setattr(saved, k, extras[k])
    tmp = path.with_name(path.name + ".extra.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(saved, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return missing
