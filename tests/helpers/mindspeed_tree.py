"""The pinned MindSpeed tree from the archive beside the checkout (MindSpeed is not on PyPI and CI reaches no git
host): ``../shared/upstream/mindspeed-<commit>.tar.gz``, ``git archive`` of the pinned commit (see
``../shared/upstream/README.md``), verified against ``../shared/upstream/SHA256SUMS`` and its embedded commit id
(``git get-tar-commit-id``) against ``pins.toml``. A missing archive fails the caller (no skip)."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from qwen3_rl.tools.pins import Framework
from qwen3_rl.tools.upstream.common import GIT_ENV

from conftest import PINS, REPO, run_script

FW = PINS.frameworks["mindspeed"]
UPSTREAM = REPO.parent / "shared" / "upstream"
ARCHIVE = UPSTREAM / f"mindspeed-{FW.commit}.tar.gz"
MISSING = (
    f"MindSpeed is not on PyPI: the pinned archive ../shared/upstream/{ARCHIVE.name} must be beside this "
    "checkout (../shared/upstream/README.md says what it is and how it is made)"
)


def git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **GIT_ENV})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pinned_mindspeed_workspace(ws: Path, fw: Framework = FW) -> Path:
    """Unpack the verified archive of ``fw`` (default: the seed set's pinned MindSpeed) into workspace ``ws`` as a
    one-commit git repo; returns ``ws``."""
    archive = UPSTREAM / f"mindspeed-{fw.commit}.tar.gz"
    if not archive.is_file():
        pytest.fail(MISSING.replace(ARCHIVE.name, archive.name))
    sums = dict(reversed(line.split(None, 1)) for line in (UPSTREAM / "SHA256SUMS").read_text().splitlines()
                if line.strip())
    assert sums.get(archive.name) == _sha256(archive), f"{archive.name} does not match ../shared/upstream/SHA256SUMS"
    with gzip.open(archive) as f:  # git archive's pax header names the commit
        head = f.read(1 << 16)
    proc = subprocess.run(["git", "get-tar-commit-id"], input=head, capture_output=True, timeout=60)
    assert proc.stdout.decode().strip() == fw.commit, f"{archive.name} is not a git archive of {fw.commit}"
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(ws)], check=True, timeout=600)
    tree = ws / fw.dir
    assert (tree / "mindspeed").is_dir(), f"the archive holds no {fw.dir}/mindspeed"
    for args in (("init", "-q"), ("add", "-A", "-f"), ("commit", "-q", "--no-verify", "-m", f"pinned {fw.commit}")):
        proc = git(*args, cwd=tree)
        assert proc.returncode == 0, proc.stderr
    return ws


def apply_series(ws: Path) -> Path:
    """The MindSpeed tree of ``ws`` with the series applied (a no-op when it already is). Returns the tree."""
    proc = run_script("apply_all_patches.sh", "--workspace", str(ws), "--only", "mindspeed")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws / FW.dir


def patched_mindspeed_tree(ws: Path) -> Path:
    """The pinned MindSpeed tree with the repo's series applied, unpacked into the empty folder ``ws``."""
    return apply_series(pinned_mindspeed_workspace(ws))
