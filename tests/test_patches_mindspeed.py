"""MindSpeed patch series on the real pinned MindSpeed tree.

MindSpeed is not on PyPI and CI reaches no git host, so its pinned tree comes from the archive beside the checkout:
``../shared/upstream/mindspeed-<commit>.tar.gz`` (``git archive`` of the pinned commit, see
``../shared/upstream/README.md``). The archive is verified against ``../shared/upstream/SHA256SUMS`` and its
embedded commit id (``git get-tar-commit-id``) against ``pins.toml``, unpacked into a one-commit git repo, and the
series is applied with the real scripts: it applies, re-applies as a no-op and reverts byte-identically. Without
the archive the tests skip with the reason below; the patch names and headers are checked for every series
elsewhere.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import PINS, REPO, run_script

from qwen3_rl.upstream.common import GIT_ENV

FW = PINS.frameworks["mindspeed"]
UPSTREAM = REPO.parent / "shared" / "upstream"
ARCHIVE = UPSTREAM / f"mindspeed-{FW.commit}.tar.gz"
SKIP_REASON = (
    f"MindSpeed is not on PyPI and the pinned archive ../shared/upstream/{ARCHIVE.name} is not beside this "
    "checkout; CI checks the MindSpeed patches' names and headers only"
)
# The <cstring> functions the builder patch is about (see patches/mindspeed/0001-*.patch).
CSTRING_FUNCS = ("strlen", "strcpy", "strncpy", "strcmp", "strncmp", "memcpy", "memmove", "memset")


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **GIT_ENV})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def mindspeed_ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace holding MindSpeed at the pinned commit, from the verified archive. Skips without it."""
    if not ARCHIVE.is_file():
        pytest.skip(SKIP_REASON)
    sums = dict(reversed(line.split(None, 1)) for line in (UPSTREAM / "SHA256SUMS").read_text().splitlines()
                if line.strip())
    assert sums.get(ARCHIVE.name) == _sha256(ARCHIVE), f"{ARCHIVE.name} does not match ../shared/upstream/SHA256SUMS"
    with gzip.open(ARCHIVE) as f:  # git archive's pax header names the commit
        head = f.read(1 << 16)
    proc = subprocess.run(["git", "get-tar-commit-id"], input=head, capture_output=True, timeout=60)
    assert proc.stdout.decode().strip() == FW.commit, f"{ARCHIVE.name} is not a git archive of {FW.commit}"
    ws = tmp_path_factory.mktemp("ms_ws")
    subprocess.run(["tar", "-xzf", str(ARCHIVE), "-C", str(ws)], check=True, timeout=600)
    tree = ws / FW.dir
    assert (tree / "mindspeed").is_dir(), f"the archive holds no {FW.dir}/mindspeed"
    for args in (("init", "-q"), ("add", "-A", "-f"), ("commit", "-q", "--no-verify", "-m", f"pinned {FW.commit}")):
        proc = _git(*args, cwd=tree)
        assert proc.returncode == 0, proc.stderr
    return ws


def _patched_files() -> list[str]:
    files = []
    for patch in sorted((REPO / "patches" / "mindspeed").glob("*.patch")):
        files += re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), re.M)
    return files


def test_mindspeed_series_applies_reapplies_and_reverts(mindspeed_ws: Path) -> None:
    ws = mindspeed_ws
    tree = ws / FW.dir
    files = _patched_files()
    assert files, "no mindspeed patches"
    pristine = {f: (tree / f).read_bytes() for f in files}
    common = ("--workspace", str(ws), "--only", "mindspeed")

    proc = run_script("apply_all_patches.sh", *common)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    changed = [f for f in files if (tree / f).read_bytes() != pristine[f]]
    assert changed == files
    status = run_script("apply_all_patches.sh", *common, "--status")
    assert status.returncode == 0 and "not applied" not in status.stdout, status.stdout

    again = run_script("apply_all_patches.sh", *common)
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr

    revert = run_script("apply_all_patches.sh", *common, "--revert")
    assert revert.returncode == 0, revert.stdout + revert.stderr
    assert all((tree / f).read_bytes() == pristine[f] for f in files)
    assert _git("status", "--porcelain", cwd=tree).stdout.strip() == ""


def _own_system_includes(text: str) -> list[str]:
    return re.findall(r"^\s*#\s*include\s*<([^>]+)>", text, re.M)


def test_builder_patch_makes_cstring_users_self_sufficient(mindspeed_ws: Path, tmp_path: Path) -> None:
    """Each C++ source the builder patch touches declares the <cstring> functions it calls itself.

    Pristine, these files get ``strlen`` only through torch/torch_npu headers; a translation unit
    made of each file's own system includes plus the calls it makes must compile after the patch
    and fail before it (g++ -fsyntax-only; torch, torch_npu and CANN headers are not needed).
    """
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not installed: cannot compile the include check")
    ws = mindspeed_ws
    tree = ws / FW.dir
    builder = REPO / "patches" / "mindspeed" / "0001-mindspeed-bugfix-builder.patch"
    files = re.findall(r"^diff --git a/(\S+) b/", builder.read_text(), re.M)
    common = ("--workspace", str(ws), "--only", "mindspeed")

    def compiles(rel: str) -> bool:
        text = (tree / rel).read_text()
        used = [f for f in CSTRING_FUNCS if re.search(rf"\b{f}\s*\(", text)]
        assert used, f"{rel} calls no <cstring> function"
        lines = [f"#include <{h}>" for h in _own_system_includes(text)]
        lines += [f"static const void* use_{f} = reinterpret_cast<const void*>(&{f});" for f in used]
        unit = tmp_path / (Path(rel).stem + ".cpp")
        unit.write_text("\n".join(lines) + "\n")
        return subprocess.run([gxx, "-std=c++17", "-fsyntax-only", str(unit)], capture_output=True,
                              timeout=120).returncode == 0

    assert run_script("apply_all_patches.sh", *common, "--revert").returncode == 0
    assert not any(compiles(f) for f in files), "pristine files already include what they use"
    assert run_script("apply_all_patches.sh", *common).returncode == 0
    assert all(compiles(f) for f in files)
