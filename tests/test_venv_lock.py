"""tests/venv_lock.py: the full locks of the test venvs (.ci/lock-*.txt) hold every distribution pip can constrain
from an index, leave out (naming why) the editable install, file installs and stand-ins, and the check names every
distribution that differs; and this venv equals its committed lock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import venv_lock

from conftest import REPO, _in_current_engine_env, _in_engine_env, _in_verl091_engine_env


def _dist(site: Path, name: str, version: str, installer: str | None = "pip", direct: dict | None = None) -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if installer is not None:
        (d / "INSTALLER").write_text(installer + "\n")
    if direct is not None:
        (d / "direct_url.json").write_text(json.dumps(direct))


def test_lock_holds_what_pip_can_constrain_and_names_what_it_leaves_out(tmp_path: Path):
    site = tmp_path / "site"
    _dist(site, "Some_Pkg", "1.0")
    _dist(site, "torch", "2.13.0+cpu")
    _dist(site, "qwen3_rl", "0.1.0", direct={"url": "file:///x/checkout", "dir_info": {"editable": True}})
    _dist(site, "vllm", "0.23.0+empty", direct={"url": "file:///c/sdists/vllm-0.23.0.tar.gz", "archive_info": {}})
    _dist(site, "alias", "0.23.0+cpu", installer="qwen3_rl-alias")
    _dist(site, "bare", "0.0.0", installer=None)
    locked, left_out = venv_lock.scan([str(site)])
    assert locked == {"some-pkg": "1.0", "torch": "2.13.0+cpu"}
    assert left_out == {"qwen3-rl": "editable install",
                        "vllm": "installed from vllm-0.23.0.tar.gz, not from an index",
                        "alias": "written by qwen3_rl-alias (a stand-in), not installed by pip",
                        "bare": "written by no installer (a stand-in), not installed by pip"}
    lock = tmp_path / "lock-x.txt"
    lock.write_text(venv_lock.render(locked, left_out, ".ci/lock-x.txt"))
    text = lock.read_text()
    assert "some-pkg==1.0\ntorch==2.13.0+cpu\n" in text and "#   vllm: installed from vllm-0.23.0.tar.gz" in text
    assert venv_lock.read(lock) == locked
    assert venv_lock.differences(locked, venv_lock.read(lock)) == []
    moved = {"some-pkg": "1.1", "torch": "2.13.0+cpu", "extra": "3.0"}
    assert venv_lock.differences(moved, locked) == [
        "extra 3.0 (not in the lock)", "some-pkg 1.1 (lock 1.0)"]
    assert venv_lock.differences({"torch": "2.13.0+cpu"}, locked) == ["some-pkg (lock 1.0, not installed)"]


def test_check_of_this_interpreter_passes_on_its_own_lock_and_names_a_moved_package(tmp_path: Path):
    lock = tmp_path / "lock-here.txt"
    tool = str(REPO / "tests/venv_lock.py")
    w = subprocess.run([sys.executable, tool, "write", str(lock)], capture_output=True, text=True, timeout=120)
    assert w.returncode == 0, w.stderr
    ok = subprocess.run([sys.executable, tool, "check", str(lock)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "equals lock-here.txt" in ok.stdout, ok.stderr
    lines = lock.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("pytest=="))
    have = lines[i].split("==")[1]
    lines[i] = "pytest==0.0.1"
    lock.write_text("\n".join(lines + ["not-installed-here==1.0"]) + "\n")
    bad = subprocess.run([sys.executable, tool, "check", str(lock)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1  # one line
    assert (f"differs from lock-here.txt in 2: not-installed-here (lock 1.0, not installed); "
            f"pytest {have} (lock 0.0.1)") in bad.stderr


def test_this_venv_equals_its_committed_lock():
    """The venv the suite runs in was built under its lock (tests/setup_env.sh and the engine set-ups end with the
    same check): a failure names the distributions that moved; rebuild the venv, or rewrite the lock on purpose."""
    name = ("verl091-engine" if _in_verl091_engine_env() else "current-engine" if _in_current_engine_env()
            else "engine" if _in_engine_env() else "test")
    lock = REPO / ".ci" / f"lock-{name}.txt"
    locked, _ = venv_lock.scan()
    assert venv_lock.differences(locked, venv_lock.read(lock)) == [], f"this venv differs from {lock.name}"


def test_default_scan_reads_the_install_folders_not_a_grown_sys_path(tmp_path: Path, monkeypatch):
    """A folder a running program put first on sys.path (``import ray`` adds ``ray/thirdparty_files`` with its own
    psutil and colorama) is not the venv: the default scan reads the install folders only. Control: scanning sys.path
    itself sees the planted distributions."""
    planted = tmp_path / "thirdparty_files"
    _dist(planted, "planted_only", "1.0")
    _dist(planted, "pip", "0.0.1")
    monkeypatch.syspath_prepend(str(planted))
    locked, _ = venv_lock.scan()
    assert "planted-only" not in locked and locked["pip"] != "0.0.1"
    grown, _ = venv_lock.scan(sys.path)
    assert grown["planted-only"] == "1.0" and grown["pip"] == "0.0.1"


def _plant(site: Path, name: str, installer: str) -> Path:
    """An installed distribution ``name`` 1.0 with one module and a RECORD (what pip uninstall reads); its module."""
    mod = site / f"{name}.py"
    mod.write_text("X = 1\n")
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "INSTALLER").write_text(installer + "\n")
    (info / "RECORD").write_text("".join(f"{p},,\n" for p in (
        mod.name, f"{info.name}/METADATA", f"{info.name}/INSTALLER", f"{info.name}/RECORD")))
    return mod


def test_sync_uninstalls_what_the_lock_lacks_and_keeps_stand_ins(tmp_path: Path):
    """A venv updated under a lock that dropped a distribution keeps it (pip never removes): ``sync`` uninstalls it
    with pip, so the check passes; a stand-in (not installed by pip, never in a lock) stays. Control: ``check``
    alone fails on the same venv."""
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin/python")
    tool = str(REPO / "tests/venv_lock.py")
    lock = tmp_path / "lock-v.txt"
    assert subprocess.run([py, tool, "write", str(lock)], capture_output=True, timeout=120).returncode == 0
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=120).stdout.strip())
    stray = _plant(site, "stray_pkg", "pip")
    alias = _plant(site, "alias_pkg", "qwen3_rl-alias")
    bad = subprocess.run([py, tool, "check", str(lock)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "in 1: stray-pkg 1.0 (not in the lock)" in bad.stderr, bad.stderr
    assert stray.is_file()
    ok = subprocess.run([py, tool, "sync", str(lock)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "uninstalling 1 not in lock-v.txt: stray-pkg" in ok.stdout and "equals lock-v.txt" in ok.stdout
    assert not stray.exists() and not (site / "stray_pkg-1.0.dist-info").exists()
    assert alias.is_file() and (site / "alias_pkg-1.0.dist-info").is_dir()
    assert venv_lock.not_in_lock({"a": "1", "b": "2"}, {"b": "2", "c": "3"}) == ["a"]
