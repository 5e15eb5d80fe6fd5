"""qwen3_rl.compat.dcp_metadata (megatron patch 0004), with the main venv's torch (2.8, the A3 image's):
extra attributes of a checkpoint's Metadata are found, restored into a file that lost them, and a file that
kept them is left alone. The torch 2.9 case, through megatron's own writer: tests/engine/test_dcp_metadata.py."""

from __future__ import annotations

import pickle
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from qwen3_rl.compat.dcp_metadata import extra_attributes, metadata_file, restore_extra_attributes

MCORE = {"optimizer.state.exp_avg.weight": {"nd_reformulated_orig_global_shape": (8, 4)}}


def _metadata(**extra: object) -> Metadata:
    md = Metadata(state_dict_metadata={})
    for k, v in extra.items():
        setattr(md, k, v)
    return md


def test_extra_attributes_are_the_undeclared_ones() -> None:
    assert extra_attributes(_metadata()) == {}
    md = _metadata(mcore_data=MCORE, all_local_plans=[1, 2])
    md.storage_data = {"x": 1}  # a declared field set later is not extra
    assert extra_attributes(md) == {"mcore_data": MCORE, "all_local_plans": [1, 2]}


def test_restores_what_the_file_lost(tmp_path: Path) -> None:
    f = tmp_path / ".metadata"
    f.write_bytes(pickle.dumps(_metadata(all_local_plans=[3])))  # as torch 2.9 would leave it, minus mcore_data
    assert restore_extra_attributes(f, {"mcore_data": MCORE, "all_local_plans": [9]}) == ["mcore_data"]
    back = pickle.loads(f.read_bytes())
    assert type(back) is Metadata, "the pickled class must stay torch's Metadata"
    assert back.mcore_data == MCORE and back.all_local_plans == [3], "present attributes are not overwritten"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata"], "temporary file left behind"


def test_file_that_kept_them_is_not_rewritten(tmp_path: Path) -> None:
    f = tmp_path / ".metadata"
    f.write_bytes(pickle.dumps(_metadata(mcore_data=MCORE)))
    before = f.stat()
    assert restore_extra_attributes(f, {"mcore_data": MCORE}) == []
    assert restore_extra_attributes(f, {}) == []
    after = f.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_torch_writer_round_trip(tmp_path: Path) -> None:
    """torch's own FileSystemWriter.finish, then the restore: the reader sees mcore_data (this torch keeps it
    already, so nothing is rewritten)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    writer = FileSystemWriter(str(tmp_path))
    writer.set_up_storage_writer(True)
    md = _metadata(mcore_data=MCORE)
    extras = extra_attributes(md)
    writer.finish(md, [])
    assert metadata_file(writer) == tmp_path / ".metadata"
    restore_extra_attributes(metadata_file(writer), extras)
    assert FileSystemReader(str(tmp_path)).read_metadata().mcore_data == MCORE
