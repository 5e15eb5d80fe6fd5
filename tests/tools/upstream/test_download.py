"""download_frameworks_source_code.sh in pypi mode (real pinned wheels) and git mode (file:// repos)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import PINS, run_script

REPO = Path(__file__).resolve().parents[3]


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], text=True, capture_output=True,
                          check=True).stdout.strip()


def test_pypi_mode_end_to_end(tmp_path, pristine_workspace):
    dest = tmp_path / "ws"
    proc = run_script("download_frameworks_source_code.sh", "--source", "pypi", "--dest", str(dest))
    assert proc.returncode == 0, proc.stderr
    assert "mindspeed: skipped: not published on PyPI, needs --source git" in proc.stdout
    for fw in PINS.frameworks.values():
        if not fw.on_pypi:
            assert not (dest / fw.dir).exists()
            continue
        tree = dest / fw.dir
        for pkg in fw.packages:
            assert (tree / pkg).is_dir(), f"{fw.key}: {pkg}/ missing"
        assert git(tree, "log", "--format=%s") == fw.pristine_message  # exactly one commit
        assert git(tree, "status", "--porcelain") == ""
        assert not list(tree.rglob("*.so")), f"{fw.key}: binaries unpacked"
        # deterministic: same commit hash as the cached pristine tree made elsewhere
        assert git(tree, "rev-parse", "HEAD") == git(pristine_workspace / fw.dir, "rev-parse", "HEAD")
    assert (dest / "verl" / "scripts" / "converter_hf_to_mcore.py").is_file()
    assert (dest / "vllm" / "vllm" / "entrypoints" / "llm.py").is_file()
    # the vllm wheel is >1 GB unpacked; the text tree stays small
    size = sum(f.stat().st_size for f in (dest / "vllm").rglob("*") if f.is_file() and ".git" not in f.parts)
    assert size < 100 * 2**20

    again = run_script("download_frameworks_source_code.sh", "--source", "pypi", "--dest", str(dest))
    assert again.returncode == 0 and again.stdout.count("nothing to do") == 4, again.stdout


def test_pypi_mode_dirty_tree_and_force(tmp_path):
    dest = tmp_path / "ws"
    assert run_script("download_frameworks_source_code.sh", "--source", "pypi", "--dest", str(dest),
                      "--only", "verl").returncode == 0
    target = dest / "verl" / "verl" / "protocol.py"
    pristine = target.read_bytes()
    target.write_bytes(pristine + b"# local edit\n")
    proc = run_script("download_frameworks_source_code.sh", "--source", "pypi", "--dest", str(dest), "--only", "verl")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "local changes" in proc.stderr and "--force" in proc.stderr
    assert target.read_bytes() != pristine  # nothing touched without --force
    proc = run_script("download_frameworks_source_code.sh", "--source", "pypi", "--dest", str(dest),
                      "--only", "verl", "--force")
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == pristine


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--source", "pypi", "--only", "mindspeed"], "mindspeed is not published on PyPI: it needs --source git"),
        (["--source", "pypi", "--only", "verl,bogus"], "unknown framework bogus"),
        (["--source", "svn"], "invalid choice"),
    ],
)
def test_download_bad_inputs(tmp_path, args, needle):
    proc = run_script("download_frameworks_source_code.sh", *args, "--dest", str(tmp_path / "ws"))
    assert proc.returncode != 0 and needle in proc.stderr


def test_pypi_mode_refuses_a_git_checkout(tmp_path):
    tree = tmp_path / "ws" / "verl"
    tree.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    (tree / "x").write_text("x")
    subprocess.run(["git", "-C", str(tree), "add", "x"], check=True)
    subprocess.run(["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   check=True)
    proc = run_script("download_frameworks_source_code.sh", "--source", "pypi", "--dest", str(tmp_path / "ws"),
                      "--only", "verl")
    assert proc.returncode == 1 and "found a git checkout" in proc.stderr


# ---------------------------------------------------------------- git mode, file:// repositories
GIT_ENV = {
    "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "protocol.file.allow", "GIT_CONFIG_VALUE_0": "always",
}


def _commit(repo: Path, msg: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", **GIT_ENV)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", msg], check=True, env=env)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def origin(tmp_path):
    """An upstream repo with a submodule, a tagged release commit, and a later commit."""
    sub = tmp_path / "sub"
    sub.mkdir()
    subprocess.run(["git", "init", "-q", str(sub)], check=True)
    (sub / "lib.c").write_text("int x;\n")
    _commit(sub, "sub")
    up = tmp_path / "upstream"
    (up / "pkg").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(up)], check=True)
    (up / "pkg" / "__init__.py").write_text("V = 1\n")
    subprocess.run(["git", "-C", str(up), "submodule", "add", "-q", f"file://{sub}", "third_party/sub"],
                   check=True, env=dict(os.environ, **GIT_ENV), capture_output=True)
    release = _commit(up, "release")
    subprocess.run(["git", "-C", str(up), "tag", "v1.0"], check=True)
    (up / "pkg" / "__init__.py").write_text("V = 2\n")
    later = _commit(up, "later")
    pins = tmp_path / "pins.toml"
    pins.write_text(f"""schema = 1
[framework.demo]
dir = "demo"
git_url = "file://{up}"
git_ref = "v1.0"
commit = "{release}"
pypi = ""
version = "1.0"
packages = ["pkg"]
submodules = true
""")
    return {"pins": pins, "release": release, "later": later, "up": up}


def _dl(origin, dest, *extra):
    return run_script("download_frameworks_source_code.sh", "--pins", str(origin["pins"]), "--dest", str(dest),
                      *extra, env=GIT_ENV)


def test_git_mode_clone_verify_and_idempotent(tmp_path, origin):
    dest = tmp_path / "ws"
    proc = _dl(origin, dest)
    assert proc.returncode == 0, proc.stderr
    tree = dest / "demo"
    assert git(tree, "rev-parse", "HEAD") == origin["release"]
    assert (tree / "pkg" / "__init__.py").read_text() == "V = 1\n"
    assert (tree / "third_party" / "sub" / "lib.c").is_file()  # submodule checked out
    again = _dl(origin, dest)
    assert again.returncode == 0 and "verified" in again.stdout


def test_git_mode_wrong_commit_then_force(tmp_path, origin):
    dest = tmp_path / "ws"
    assert _dl(origin, dest).returncode == 0
    tree = dest / "demo"
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", origin["later"]], check=True)
    proc = _dl(origin, dest)
    assert proc.returncode == 1
    assert f"expected commit {origin['release']}" in proc.stderr and f"found {origin['later']}" in proc.stderr
    assert "--force" in proc.stderr
    fixed = _dl(origin, dest, "--force")
    assert fixed.returncode == 0, fixed.stderr
    assert git(tree, "rev-parse", "HEAD") == origin["release"]


def test_git_mode_dirty_tree(tmp_path, origin):
    dest = tmp_path / "ws"
    assert _dl(origin, dest).returncode == 0
    (dest / "demo" / "pkg" / "__init__.py").write_text("V = 99\n")
    proc = _dl(origin, dest)
    assert proc.returncode == 1 and "local changes (pkg/__init__.py)" in proc.stderr
    assert _dl(origin, dest, "--force").returncode == 0
    assert (dest / "demo" / "pkg" / "__init__.py").read_text() == "V = 1\n"


def test_git_mode_pinned_commit_missing_upstream(tmp_path, origin):
    text = origin["pins"].read_text().replace(origin["release"], "f" * 40)
    origin["pins"].write_text(text)
    proc = _dl(origin, tmp_path / "ws")
    assert proc.returncode == 1 and f"commit {'f' * 40} (v1.0) not found" in proc.stderr
    assert not (tmp_path / "ws" / "demo").exists()  # no half-made tree under the final name


def test_git_mode_refuses_a_plain_folder(tmp_path, origin):
    (tmp_path / "ws" / "demo").mkdir(parents=True)
    proc = _dl(origin, tmp_path / "ws")
    assert proc.returncode == 1 and "is not a git repository" in proc.stderr
