"""The suite's own rules (tests/conftest.py): a skip fails, and the engine tests need the engine venv."""

from __future__ import annotations

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
