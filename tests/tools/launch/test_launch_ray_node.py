"""What a launch leaves on a node besides processes (qwen3_rl/tools/launch/ray_node.py) and the auth mode it picks.

The real-Ray runs are in tests/tools/launch/test_launch.py (address file removed, fresh ``ray.init`` afterwards) and
tests/tools/launch/test_launch_multinode.py (a client without the token is refused).
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from qwen3_rl.tools.launch.options import LaunchError, parse_options
from qwen3_rl.tools.launch.ray_node import (
    make_token,
    ray_temp_root,
    restore_address_file,
    save_address_file,
    wait_token,
)

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "internal" / "train_grpo_tiny_cpu.sh")


def test_address_file_absent_before_is_removed(tmp_path: Path):
    f, state = tmp_path / "ray" / "ray_current_cluster", tmp_path / "state.json"
    save_address_file(f, state)
    f.parent.mkdir()
    f.write_text("10.0.0.1:6379")  # what `ray start` writes
    assert restore_address_file(state, 6379).startswith(f"removed {f}")
    assert not f.exists()


def test_address_file_present_before_is_restored(tmp_path: Path):
    f, state = tmp_path / "ray_current_cluster", tmp_path / "state.json"
    f.write_text("10.0.0.9:7000")  # another cluster the user runs on this node
    save_address_file(f, state)
    f.write_text("10.0.0.1:6379")
    assert restore_address_file(state, 6379) == f"restored {f} to '10.0.0.9:7000'"
    assert f.read_text() == "10.0.0.9:7000"


def test_address_file_of_another_cluster_is_left(tmp_path: Path):
    f, state = tmp_path / "ray_current_cluster", tmp_path / "state.json"
    save_address_file(f, state)
    f.write_text("10.0.0.5:6400")  # someone else's `ray start` meanwhile: not ours
    assert "not this launch's port 6379" in restore_address_file(state, 6379)
    assert f.read_text() == "10.0.0.5:6400"
    f.unlink()
    save_address_file(f, state)
    assert restore_address_file(state, 6379) == f"left {f} as found"


def test_ray_temp_root_follows_ray():
    assert ray_temp_root("/x/y", {"TMPDIR": "/t"}) == Path("/x/y")
    assert ray_temp_root(None, {"RAY_TMPDIR": "/r", "TMPDIR": "/t"}) == Path("/r/ray")
    assert ray_temp_root(None, {"TMPDIR": "/t"}) == Path("/t/ray")
    assert ray_temp_root(None, {}) == Path("/tmp/ray")


def test_token_file_private_and_new_per_cluster(tmp_path: Path):
    f = tmp_path / "d" / "token"
    make_token(f)
    first = f.read_text()
    assert len(first) == 64 and int(first, 16) >= 0
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    make_token(f)
    assert f.read_text() != first
    assert wait_token(f, 0.0)
    assert not wait_token(tmp_path / "none", 0.0)


def _plan(tmp_path: Path, env: dict[str, str], *args: str):
    base = {"PATH": "/usr/bin:/bin", "LOG_DIR": str(tmp_path / "logs")}
    return parse_options([TINY, "--dry-run", *args], {**base, **env})


def test_auth_mode_by_run(tmp_path: Path):
    cpu = _plan(tmp_path, {}, "--device", "cpu")
    assert (cpu.auth_mode, cpu.auth_token_file) == ("disabled", "")  # the loopback CPU run only
    npu = _plan(tmp_path, {})
    assert npu.auth_mode == "token" and npu.auth_token_make
    assert npu.auth_token_file == str(tmp_path / "logs" / ".ray_auth_token_6379")
    given = _plan(tmp_path, {"RAY_AUTH_TOKEN": "ab" * 32})
    assert (given.auth_mode, given.auth_token_file, given.auth_token_make) == ("token", "", False)
    own = _plan(tmp_path, {}, "--auth-token-file", str(tmp_path / "shared" / "tok"))
    assert own.auth_token_file == str(tmp_path / "shared" / "tok")
    with pytest.raises(LaunchError, match="RAY_AUTH_MODE='off' must be token or disabled"):
        _plan(tmp_path, {"RAY_AUTH_MODE": "off"})
    assert _plan(tmp_path, {"RAY_AUTH_MODE": "disabled"}).auth_mode == "disabled"  # loopback master: allowed


def test_auth_disabled_refused_for_a_cluster(tmp_path: Path):
    # a non-loopback master (this host's own route target): disabled is refused before anything starts
    from qwen3_rl.tools.launch.netinfo import NetError, node_net

    try:
        net = node_net("192.0.2.1")
    except NetError:
        pytest.fail("no route on this host to build a non-loopback plan")
    with pytest.raises(LaunchError, match="RAY_AUTH_MODE=disabled with master 192.0.2.1"):
        _plan(tmp_path, {"RAY_AUTH_MODE": "disabled"}, "--nnodes", "2", "--master-addr", "192.0.2.1",
              "--ifname", net.ifname)
