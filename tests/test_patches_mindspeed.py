"""MindSpeed patch series on a real MindSpeed tree, when one is available.

MindSpeed is not on PyPI, so CI has no pristine tree for it. When a git source of the pinned
commit is at hand (``QWEN3_RL_MINDSPEED_TREE`` = a git checkout of it, or the developer mirror
``/work/.mirror/Ascend+MindSpeed/repo``), the series is applied with the real scripts in git mode
(pins override pointing ``git_url`` at that source): download verifies the pinned commit, the
series applies, re-applies as a no-op and reverts byte-identically. Otherwise the test skips
with the reason below; the patch names and headers are checked for every series elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import PINS, REPO, run_script

FW = PINS.frameworks["mindspeed"]
MIRROR = Path("/work/.mirror/Ascend+MindSpeed/repo")
SKIP_REASON = (
    f"MindSpeed is not on PyPI: its patches were applied and compiled against {FW.commit} "
    "in a developer session (see README); CI checks their names and headers only"
)
# The <cstring> functions the builder patch is about (see patches/mindspeed/0001-*.patch).
CSTRING_FUNCS = ("strlen", "strcpy", "strncpy", "strcmp", "strncmp", "memcpy", "memmove", "memset")


def _source() -> Path | None:
    env = os.environ.get("QWEN3_RL_MINDSPEED_TREE")
    if env:
        return Path(env)
    return MIRROR if MIRROR.is_dir() else None


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def mindspeed_ws(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(workspace holding MindSpeed at the pinned commit, pins override). Skips without a source."""
    src = _source()
    if src is None:
        pytest.skip(SKIP_REASON)
    ws = tmp_path_factory.mktemp("ms_ws")
    tree = ws / FW.dir
    # The developer mirror is a partial clone (a full clone fails on a missing old blob), so
    # take the tag shallowly; a plain checkout falls back to a shared clone of the commit.
    proc = _git("clone", "-q", "--depth", "1", "--branch", FW.git_ref, f"file://{src}", str(tree))
    if proc.returncode != 0:
        shutil.rmtree(tree, ignore_errors=True)
        proc = _git("clone", "-q", "--shared", str(src), str(tree))
        assert proc.returncode == 0, proc.stderr
        proc = _git("checkout", "-q", "--detach", FW.commit, cwd=tree)
        assert proc.returncode == 0, proc.stderr
    pins = ws / "pins_ms.toml"
    text = (REPO / "pins.toml").read_text()
    assert text.count(f'"{FW.git_url}"') == 1
    pins.write_text(text.replace(f'"{FW.git_url}"', f'"file://{src}"'))
    # our downloader (git mode) verifies the tree: exact pinned commit, clean
    proc = run_script("download_frameworks_source_code.sh", "--pins", str(pins), "--only", "mindspeed",
                      "--dest", str(ws))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"verified at {FW.git_ref}" in proc.stdout + proc.stderr
    return ws, pins


def _patched_files() -> list[str]:
    files = []
    for patch in sorted((REPO / "patches" / "mindspeed").glob("*.patch")):
        files += re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), re.M)
    return files


def test_mindspeed_series_applies_reapplies_and_reverts(mindspeed_ws: tuple[Path, Path]) -> None:
    ws, pins = mindspeed_ws
    tree = ws / FW.dir
    files = _patched_files()
    assert files, "no mindspeed patches"
    pristine = {f: (tree / f).read_bytes() for f in files}
    common = ("--pins", str(pins), "--workspace", str(ws), "--only", "mindspeed")

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


def test_builder_patch_makes_cstring_users_self_sufficient(mindspeed_ws: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    """Each C++ source the builder patch touches declares the <cstring> functions it calls itself.

    Pristine, these files get ``strlen`` only through torch/torch_npu headers; a translation unit
    made of each file's own system includes plus the calls it makes must compile after the patch
    and fail before it (g++ -fsyntax-only; torch, torch_npu and CANN headers are not needed).
    """
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not installed: cannot compile the include check")
    ws, pins = mindspeed_ws
    tree = ws / FW.dir
    builder = REPO / "patches" / "mindspeed" / "0001-mindspeed-bugfix-builder.patch"
    files = re.findall(r"^diff --git a/(\S+) b/", builder.read_text(), re.M)
    common = ("--pins", str(pins), "--workspace", str(ws), "--only", "mindspeed")

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
