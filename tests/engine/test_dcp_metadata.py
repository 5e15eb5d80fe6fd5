"""Megatron patch 0004 under torch 2.9.1 (the engine venv): megatron-core's own ``FileSystemWriterAsync.finish``
writes a checkpoint ``.metadata`` that keeps ``mcore_data``, which megatron reads back on every resume of a
distributed optimizer; the pristine writer loses it (torch 2.9 rebuilds the object, pytorch issue #162948)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_FINISH = textwrap.dedent("""
    import sys
    sys.modules["qwen3_rl"] = None  # importing the recipe package fails: the patched writer must not need it
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    assert torch.__version__.startswith("2.9"), torch.__version__
    writer = FileSystemWriterAsync(sys.argv[1])
    writer.set_up_storage_writer(True)
    md = Metadata(state_dict_metadata={})
    md.mcore_data = {"w": {"nd_reformulated_orig_global_shape": (8, 4)}}
    writer.finish(md, [])
    back = FileSystemReader(sys.argv[1]).read_metadata()
    print("mcore_data" if getattr(back, "mcore_data", None) == md.mcore_data else "lost")
""")


@pytest.mark.parametrize("tree", ["patched", "pristine"])
def test_finish_keeps_mcore_data(tree: str, engine_ws: Path, pristine_workspace: Path, tmp_path: Path) -> None:
    ws = engine_ws if tree == "patched" else pristine_workspace
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ws / "Megatron-LM")
    proc = subprocess.run([sys.executable, "-c", _FINISH, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == ("mcore_data" if tree == "patched" else "lost")
