"""The pass-set comparison of tests/upstream_own/verl_cpu.py on real pytest junit XML (a tiny suite run here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_module

verl_cpu = load_module(REPO / "tests" / "upstream_own" / "verl_cpu.py", "upstream_own_verl_cpu")

SUITE = '''
import pytest

class TestGroup:
    def test_ok(self):
        pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_error(broken):
    pass
'''


def _junit(tmp_path: Path, name: str, body: str) -> Path:
    tree = tmp_path / name
    (tree / "tests" / "sub").mkdir(parents=True)
    (tree / "tests" / "sub" / "test_mod_on_cpu.py").write_text(body)
    out = tree / "junit.xml"
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # start-up time: the suite needs no plugin
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir",
                    str(tree), "--junitxml", str(out), "tests/sub/test_mod_on_cpu.py"], cwd=tree, capture_output=True,
                   check=False, timeout=120, env=env)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Outcomes of the suite as written and of a copy whose parametrized test flips (one pytest run each)."""
    tmp = tmp_path_factory.mktemp("junit")
    return {"same": verl_cpu.outcomes(_junit(tmp, "a", SUITE)),
            "flipped": verl_cpu.outcomes(_junit(tmp, "b", SUITE.replace("assert n == 1", "assert n == 2")))}


def test_outcomes_read_ids_and_kinds_from_pytest_junit(runs: dict[str, dict[str, str]]) -> None:
    got = runs["same"]
    f = "tests/sub/test_mod_on_cpu.py"
    assert got == {f"{f}::TestGroup::test_ok": "passed", f"{f}::test_param[1]": "passed",
                   f"{f}::test_param[2]": "failed", f"{f}::test_error": "error"}


def test_equal_outcomes_compare_equal_and_a_changed_one_is_named(runs: dict[str, dict[str, str]]) -> None:
    a = runs["same"]
    assert verl_cpu.compare(a, dict(a)) == []
    diff = verl_cpu.compare(a, runs["flipped"])
    assert diff == ["  tests/sub/test_mod_on_cpu.py::test_param[1]: pristine passed, patched failed",
                    "  tests/sub/test_mod_on_cpu.py::test_param[2]: pristine failed, patched passed"]


def test_a_test_missing_on_one_side_is_a_difference() -> None:
    assert verl_cpu.compare({"t.py::a": "passed", "t.py::b": "passed"}, {"t.py::a": "passed"}) == [
        "  t.py::b: pristine passed, patched absent"]
