"""The suite's own rules (tests/conftest.py): a skip fails, and the engine tests need the engine venv."""

from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest

from conftest import REPO, run_python, skip_as_failure


def _report(outcome: str, longrepr=None) -> pytest.TestReport:
    return pytest.TestReport("t.py::test_x", ("t.py", 1, "test_x"), {}, outcome, longrepr, "call")


def test_skip_becomes_failure_with_its_reason(monkeypatch):
    monkeypatch.delenv("QWEN3_RL_UPDATE_GOLDEN", raising=False)
    rep = _report("skipped", ("t.py", 3, "Skipped: corpus missing"))
    skip_as_failure(rep)
    assert rep.failed and "corpus missing" in str(rep.longrepr)


def test_pass_and_fail_are_left_alone(monkeypatch):
    """Positive control: reports that are not skips keep their outcome."""
    monkeypatch.delenv("QWEN3_RL_UPDATE_GOLDEN", raising=False)
    ok, bad = _report("passed"), _report("failed", "boom")
    skip_as_failure(ok)
    skip_as_failure(bad)
    assert ok.passed and bad.failed and bad.longrepr == "boom"


def test_golden_rewrite_mode_keeps_its_skip(monkeypatch):
    monkeypatch.setenv("QWEN3_RL_UPDATE_GOLDEN", "1")
    rep = _report("skipped", ("t.py", 3, "Skipped: rewrote golden"))
    skip_as_failure(rep)
    assert rep.skipped


def test_engine_tests_refused_outside_the_engine_venv():
    """In the main venv, naming tests/engine is a usage error (exit 4), not an empty run (exit 5)."""
    proc = run_python("import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/engine']))",
                      cwd=REPO, timeout=120)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "needs the engine venv" in proc.stdout + proc.stderr
    proc = run_python("import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
                      "'tests/engine_current']))", cwd=REPO, timeout=120)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "needs the current-set engine venv" in proc.stdout + proc.stderr


def _bash_array(text: str, name: str) -> list[str]:
    m = re.search(rf"^{name}=\(([^)]*)\)", text, re.M)
    assert m, f"no {name}=(...) in tests/run_tests.sh"
    return m.group(1).split()


def test_boundscheck_leaves_out_only_named_tests_and_keeps_kernel_tests_in_every_file():
    """Every test the bounds-checked rerun leaves out exists in its files (no stale name), and every file keeps
    tests of its own in the rerun."""
    text = (REPO / "tests" / "run_tests.sh").read_text()
    files = _bash_array(text, "SAM_BOUNDSCHECK_TESTS")
    left_out = set(_bash_array(text, "BOUNDSCHECK_NOT_KERNELS"))
    defined: dict[str, set[str]] = {}
    for f in files:
        tree = ast.parse((REPO / f).read_text())
        defined[f] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    assert left_out <= set().union(*defined.values()), sorted(left_out - set().union(*defined.values()))
    assert all(names - left_out for names in defined.values()), {f: sorted(n) for f, n in defined.items()}


def test_engine_launcher_tests_are_every_engine_file_that_starts_a_training_run():
    """tests/run_tests.sh runs ENGINE_LAUNCHER_TESTS in a pytest process (the early lane) apart from the other engine
    tests: every listed file exists, and every engine test file that starts a whole run (the ``cpu_ws`` workspace, the
    launcher, a Ray cluster) is listed, so two Ray clusters never start at once."""
    text = (REPO / "tests" / "run_tests.sh").read_text()
    files = _bash_array(text, "ENGINE_LAUNCHER_TESTS")
    assert files and all((REPO / f).is_file() for f in files), files
    starts_runs = {
        str(f.relative_to(REPO)) for f in sorted((REPO / "tests" / "engine").glob("test_*.py"))
        if re.search(r"\bcpu_ws\b|ray_start_npu\.sh|ray\.init\(", f.read_text())}
    assert starts_runs == set(files), (sorted(starts_runs - set(files)), sorted(set(files) - starts_runs))
    extra = _bash_array(text, "ENGINE_EARLY_EXTRA")  # the early lane's other files: they exist and start no run
    assert extra and all((REPO / f).is_file() for f in extra) and not starts_runs & set(extra), extra
    second = _bash_array(text, "ENGINE_LATE_SECOND")  # the late lane's second part: late-lane files that exist
    assert second and all((REPO / f).is_file() for f in second) and not (starts_runs | set(extra)) & set(second)


def test_free_port_is_outside_the_ephemeral_range_and_skips_taken_ports(monkeypatch) -> None:
    """The tests' ports come from below the kernel's ephemeral range (outgoing connections cannot take them between
    the choice and the listen) and a port something listens on is never handed out; control: the same port once
    free is."""
    import socket
    from pathlib import Path

    from helpers import ports

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    got = {ports.free_port() for _ in range(20)}
    assert all(ports.FREE_PORTS[0] <= p < ports.FREE_PORTS[1] < low for p in got), (got, low)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "FREE_PORTS", (busy, busy + 1))  # the range is the listening port alone
        with pytest.raises(RuntimeError, match="no free port"):
            ports.free_port()
    assert ports.free_port() == busy  # closed: handed out


def test_all_tier_entries_exist_and_leave_every_part_tests_in_the_gate():
    """Every ALL_ONLY node id names a test file (and its test function) that exists, so the gate never deselects a
    stale name; the gate keeps tests in the early lane and in the verl 0.9.1 engine part (no part runs empty)."""
    text = (REPO / "tests" / "run_tests.sh").read_text()
    all_only = _bash_array(text, "ALL_ONLY")
    assert all_only
    for node in all_only:
        path, _, name = node.partition("::")
        assert (REPO / path).is_file(), node
        assert not name or re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), node
    early = _bash_array(text, "ENGINE_LAUNCHER_TESTS") + _bash_array(text, "ENGINE_EARLY_EXTRA")
    assert set(early) - set(all_only), "the gate's early lane would be empty"
    verl091 = {str(f.relative_to(REPO)) for f in (REPO / "tests" / "engine_verl091").glob("test_*.py")}
    assert verl091 - set(all_only), "the gate's verl 0.9.1 engine part would be empty"


def _fake_venvs(tmp_path, sleeps: dict[str, float] | None = None):
    """Six venvs whose python, ruff and shellcheck log their arguments (one line per call) and exit 0. With
    ``sleeps`` ({part: seconds} for "main", "early", "first", "second": the main run and the engine lanes' pytest
    processes) those calls sleep that long and log ``START`` / ``END`` lines with the time (s since the epoch)."""
    log = tmp_path / "calls.log"
    env = {**os.environ, "QWEN3_RL_CPUACCT_ROOT": str(tmp_path / "no-cgroups")}
    sleeps = sleeps or {}
    # the part of a pytest call, from its venv and first argument after "-m pytest"
    parts = (f'case "$1 $2 $3 $4" in\n'
             f'  "ENGINE_VENV -m pytest tests/engine/test_e2e_training.py") part=early; t={sleeps.get("early", 0)};;\n'
             f'  "ENGINE_VENV -m pytest tests/engine/test_engine_core_loop.py") part=second; t={sleeps.get("second", 0)};;\n'
             f'  "ENGINE_VENV -m pytest tests/engine") part=first; t={sleeps.get("first", 0)};;\n'
             f'  "VENV -m pytest -q") part=""; t=0;;\n'  # the boundscheck rerun
             f'  "VENV -m pytest "*) part=main; t={sleeps.get("main", 0)};;\n'
             f'  *) part=""; t=0;;\n'
             f'esac\n')
    for var in ("VENV", "ENGINE_VENV", "CURRENT_ENGINE_VENV", "CURRENT_ASCEND_VENV", "VERL091_VENV",
                "VERL091_ENGINE_VENV"):
        bin_dir = tmp_path / var.lower() / "bin"
        bin_dir.mkdir(parents=True)
        for tool in ("python", "ruff", "shellcheck"):
            timed = "" if tool != "python" or not sleeps else (
                f'set -- "{var}" "$@"\n{parts}'
                f'if [[ -n "$part" ]]; then echo "$(date +%s.%N) START $part" >>"{log}"; sleep "$t"; '
                f'echo "$(date +%s.%N) END $part" >>"{log}"; fi\n')
            (bin_dir / tool).write_text(f'#!/usr/bin/env bash\necho "{var} {tool} $*" >>"{log}"\n{timed}')
            (bin_dir / tool).chmod(0o755)
        env[f"QWEN3_RL_{var}"] = str(tmp_path / var.lower())
    return env, log


@pytest.mark.parametrize("case", ["main_last", "early_last"])
def test_late_lane_second_part_starts_once_early_and_first_or_main_have_ended(tmp_path, case):
    """tests/run_tests.sh's schedule with stand-in venvs whose pytest calls sleep: the late lane's first part starts
    once the early lane has ended (or the main run and the background runs have); its second part once the early
    lane has ended and the first part or the main run has, so two streams run to the end. ``main_last``: the second
    part starts when the first part ends, long before the main run does (it used to wait for the main run);
    ``early_last``: the main run ends first, the first part starts then, the second waits for the early lane."""
    sleeps = ({"main": 14, "early": 1, "first": 1, "second": 1} if case == "main_last"
              else {"main": 1, "early": 8, "first": 1, "second": 1})
    env, log = _fake_venvs(tmp_path, sleeps)
    proc = subprocess.run(["bash", str(REPO / "tests" / "run_tests.sh")], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    at: dict[tuple[str, str], float] = {}
    for line in log.read_text().splitlines():
        f = line.split()
        if len(f) == 3 and f[1] in ("START", "END"):
            assert (f[1], f[2]) not in at, line  # each part runs once
            at[f[1], f[2]] = float(f[0])
    assert {p for _, p in at} == {"main", "early", "first", "second"}, at
    assert at["START", "first"] >= min(at["END", "early"], at["END", "main"])
    assert at["START", "second"] >= max(at["END", "early"], min(at["END", "first"], at["END", "main"]))
    if case == "main_last":  # the second part overlaps the main run
        assert at["END", "first"] <= at["START", "second"] < at["END", "main"], at
    else:  # the first part overlaps the early lane; the second starts after it
        assert at["START", "first"] < at["END", "early"] <= at["START", "second"], at


@pytest.mark.parametrize("tier", ["gate", "all", "bad"])
def test_gate_deselects_exactly_the_all_tier_and_all_runs_it(tmp_path, tier):
    """tests/run_tests.sh itself, with venvs whose tools only log their calls: the gate (default) passes a
    --deselect for each ALL_ONLY entry to every pytest part; --all passes none; a bad tier stops on one line."""
    env, log = _fake_venvs(tmp_path)
    args = ["--all"] if tier == "all" else []
    if tier == "bad":
        env["QWEN3_RL_TEST_TIER"] = "nightly"
    proc = subprocess.run(["bash", str(REPO / "tests" / "run_tests.sh"), *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=300)
    if tier == "bad":
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            "error: QWEN3_RL_TEST_TIER must be gate or all, not 'nightly'"], proc.stderr
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    all_only = _bash_array((REPO / "tests" / "run_tests.sh").read_text(), "ALL_ONLY")
    pytest_calls = [line.split() for line in log.read_text().splitlines() if line.split()[1:4] == ["python", "-m", "pytest"]]
    # the main run, the early and late engine lanes (late in two parts), the boundscheck run, both current-set parts
    assert len(pytest_calls) == 7, pytest_calls
    for call in pytest_calls:
        deselected = [a.removeprefix("--deselect=") for a in call if a.startswith("--deselect=")]
        if "tests/spec_decode/test_spec_decode_sam.py" in call:
            continue  # the boundscheck rerun takes its own file list, not the run's arguments
        assert deselected == (all_only if tier == "gate" else []), call
    assert ("== tier: gate" in proc.stdout) == (tier == "gate") and ("== tier: all" in proc.stdout) == (tier == "all")
    assert "--all" not in log.read_text()
