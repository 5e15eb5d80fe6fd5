"""Pristine and patched trees of the current pin set's training engine: megatron-core 0.16.1 (PyPI wheel) and
MindSpeed core_r0.16.0 (the archive in ``../shared/upstream``), for the tests of ``patches/current/megatron`` and
``patches/current/mindspeed``.

The two entries are ``pins.toml``'s current set; the pristine megatron tree is made by the same download code as the seed set's
(``qwen3_rl.tools.upstream.download.fill_pristine``: the wheel's text files as a one-commit git repo, cached), the
MindSpeed tree by ``helpers.mindspeed_tree`` from its verified archive. A patched tree is a ``git clone --shared`` of
the pristine one with the series of ``patches/current/<key>/`` applied in order by ``git apply`` (what
``apply_all_patches.sh`` does for a series)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from qwen3_rl.tools.pins import load_pins
from qwen3_rl.tools.upstream.download import fill_pristine

from conftest import REPO, _clone

#: The current set's entries of pins.toml (``PIN_SET=current``), whatever the switch says in this process.
_CURRENT = load_pins(REPO / "pins.toml", "current").frameworks
MEGATRON = _CURRENT["megatron"]
MINDSPEED = _CURRENT["mindspeed"]
SERIES = REPO / "patches" / "current"
# Device shims (the device layer only) for megatron-core 0.16.1's dist-checkpoint save and load on a CPU host, as
# Python source for a probe: the writer's host staging waits for the GPU (filesystem_async.py:230, a no-op here)
# and the save's finalization puts its failure flag on torch.cuda.current_device() (state_dict_saver.py:252; the
# CPU here, the gloo all-reduce takes it).
DEVICE_SHIMS = (
    "import torch\n"
    "torch.cuda.synchronize = lambda device=None: None\n"
    "torch.cuda.current_device = lambda: 'cpu'\n"
)


def series(key: str) -> list[Path]:
    """The current set's patches for ``key`` (``patches/current/<key>/NNNN-*.patch``), in order."""
    found = sorted((SERIES / key).glob("[0-9][0-9][0-9][0-9]-*.patch"))
    assert found, f"no patches in {SERIES / key}"
    return found


def patch_named(key: str, name: str) -> Path:
    """The one patch of ``key``'s current series whose file name contains ``name``."""
    (hit,) = [p for p in series(key) if name in p.name]
    return hit


def patched_files(patch: Path) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), re.M)


def pristine_megatron() -> Path:
    """The pristine megatron-core 0.16.1 tree (cached, shared by the processes that ask for it)."""
    ws = fill_pristine(REPO / "pins.toml", [MEGATRON], "current")
    tree = ws / MEGATRON.dir
    assert (tree / "megatron" / "core" / "package_info.py").is_file()
    return tree


def apply(tree: Path, patches: list[Path], reverse: bool = False) -> None:
    for patch in reversed(patches) if reverse else patches:
        args = ["git", "apply", "--whitespace=nowarn", *(["-R"] if reverse else []), str(patch)]
        proc = subprocess.run(args, cwd=tree, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{patch.name} ({'reverse' if reverse else 'apply'}): {proc.stderr}"


def patched_megatron(dest: Path, without: str | None = None) -> Path:
    """A clone of the pristine 0.16.1 tree in ``dest`` with the current megatron series applied (all of it, or all
    but the patch whose name contains ``without``: the positive control). Returns the tree."""
    tree = dest / MEGATRON.dir
    _clone(pristine_megatron(), tree)
    apply(tree, [p for p in series("megatron") if without is None or without not in p.name])
    return tree
