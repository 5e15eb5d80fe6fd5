"""megatron patch 0004: ``FileSystemWriterAsync.finish`` of the patched tree keeps the attributes megatron
adds to a checkpoint's ``Metadata`` (``mcore_data``), with the main venv's torch (2.8, the A3 image's).

torch 2.8's ``FileSystemWriter.finish`` keeps them: the patched finish must then leave the file alone. torch
2.9's drops them (it pickles ``dataclasses.replace(metadata, ...)``, pytorch issue #162948); here that one
behaviour of torch's parent method is reproduced (named in the probe) and the patched finish must restore them.
The real torch 2.9.1 case, with the pristine writer losing the attributes as the control:
tests/engine/test_dcp_metadata.py. The probe runs in a fresh interpreter whose path holds only the Megatron
tree, with ``qwen3_rl`` made unimportable (the patch must not need the recipe package)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import run_python

_PROBE = """
import dataclasses, os, pickle, sys
sys.modules["qwen3_rl"] = None  # importing the recipe package fails: the patched code must not need it
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync


def finish(out):
    # the writer's finish on a Metadata carrying megatron's attributes; what the file holds after it
    os.mkdir(out)
    rewrites = []
    _replace = os.replace
    os.replace = lambda src, dst: (rewrites.append(str(dst)), _replace(src, dst))[1]
    try:
        writer = FileSystemWriterAsync(out)
        writer.set_up_storage_writer(True)
        md = Metadata(state_dict_metadata={})
        md.mcore_data = {"optimizer.state.exp_avg.weight": {"nd_reformulated_orig_global_shape": (8, 4)}}
        md.all_local_plans = [3]
        writer.finish(md, [])
    finally:
        os.replace = _replace
    back = FileSystemReader(out).read_metadata()
    return {"class": type(back).__module__ + "." + type(back).__qualname__,
            "mcore_data": getattr(back, "mcore_data", None) == md.mcore_data,
            "all_local_plans": getattr(back, "all_local_plans", None) == [3],
            "rewrites": len(rewrites), "files": sorted(os.listdir(out))}


print("torch28", finish(os.path.join(sys.argv[1], "torch28")))
# torch 2.9's FileSystemWriter.finish, as far as this bug goes: it pickles dataclasses.replace(metadata),
# which keeps the declared fields only (pytorch issue #162948)
def finish_like_torch_29(self, metadata, results):
    with open(self.metadata_path, "wb") as f:
        pickle.dump(dataclasses.replace(metadata), f)


FileSystemWriter.finish = finish_like_torch_29
print("torch29", finish(os.path.join(sys.argv[1], "torch29")))
"""


def _finish(tree: Path, out: Path) -> dict[str, dict]:
    """Run the probe with ``tree``'s Megatron; {"torch28": result, "torch29": result}."""
    proc = run_python(_PROBE, str(out), path=(tree / "Megatron-LM",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {k: ast.literal_eval(v) for k, v in (line.split(" ", 1) for line in proc.stdout.strip().splitlines())}


KEPT = {"class": "torch.distributed.checkpoint.metadata.Metadata", "mcore_data": True, "all_local_plans": True,
        "files": [".metadata"]}


def test_patched_finish_keeps_megatron_attributes(patched_workspace: Path, tmp_path: Path) -> None:
    """With torch 2.9's finish the patched writer restores the attributes (one rewrite, no temporary file left,
    still torch's Metadata class); with this torch's own finish it rewrites nothing."""
    got = _finish(patched_workspace, tmp_path)
    assert got["torch29"] == KEPT | {"rewrites": 1}
    assert got["torch28"] == KEPT | {"rewrites": 0}
