"""The pass-set comparison of tests/upstream_own/verl_cpu.py on real pytest junit XML (a tiny suite run here)."""

from __future__ import annotations

import json
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


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_recorded_key_changes_with_a_byte_of_the_tree_or_the_repo_and_the_record_answers_only_its_key(
        tmp_path: Path) -> None:
    recorded = verl_cpu.recorded
    tree = _tree(tmp_path / "tree", {"verl/a.py": b"x = 1\n", "tests/t_on_cpu.py": b"def test(): pass\n",
                                     ".git/HEAD": b"ref\n", "verl/__pycache__/a.pyc": b"\0"})
    repo = _tree(tmp_path / "repo", {"tests/s.py": b"script\n", "stub/m.py": b"m\n"})
    key = recorded.run_key(tree, [""], repo, ["tests/s.py", "stub"])
    records = tmp_path / "records"
    outcomes = {"tests/t_on_cpu.py::test": "passed", "tests/t_on_cpu.py::test_b": "failed"}
    # no record yet, then the record for this key
    assert recorded.lookup("verl", key, records) == (None, "no record verl.json")
    recorded.write("verl", key, outcomes, records)
    assert recorded.lookup("verl", key, records)[0] == outcomes
    # .git and __pycache__ are not inputs; a changed byte of the tree or of a repo input misses the record
    (tree / ".git" / "HEAD").write_bytes(b"other\n")
    (tree / "verl" / "__pycache__" / "a.pyc").write_bytes(b"\1")
    assert recorded.run_key(tree, [""], repo, ["tests/s.py", "stub"]) == key
    (tree / "verl" / "a.py").write_bytes(b"x = 2\n")
    (repo / "stub" / "m.py").write_bytes(b"n\n")
    key2 = recorded.run_key(tree, [""], repo, ["tests/s.py", "stub"])
    assert {k for k in key if key[k] != key2[k]} == {"tree", "repo"}
    rec, why = recorded.lookup("verl", key2, records)
    assert rec is None and why == "record verl.json is for other inputs (repo, tree changed)"
    # a missing input is an error, not an empty digest; a record that passes nothing is refused
    with pytest.raises(FileNotFoundError):
        recorded.run_key(tree, ["nothing-here"], repo, [])
    with pytest.raises(ValueError):
        recorded.write("verl", key, {"t::a": "failed"}, records)


def test_record_keeps_its_package_list_and_a_packages_mismatch_names_what_moved(tmp_path: Path) -> None:
    recorded = verl_cpu.recorded
    repo = _tree(tmp_path / "repo", {"tests/s.py": b"script\n"})
    key = recorded.run_key(repo, ["tests"], repo, ["tests/s.py"])
    # the key keeps this interpreter's package list beside its digest; the record shows it one line per package
    assert key["package_list"] == recorded.package_list() != []
    assert key["packages"] == recorded.packages_digest(key["package_list"])
    records = tmp_path / "records"
    outcomes = {"tests/t_on_cpu.py::test": "passed"}
    path = recorded.write("verl", key, outcomes, records)
    assert json.loads(path.read_text())["key"]["package_list"] == key["package_list"]
    assert f'\n   "{key["package_list"][0]}",\n' in path.read_text()
    assert recorded.lookup("verl", key, records)[0] == outcomes
    # a record from a venv where numpy was older, old-one was installed and new-one was not
    then = ["numpy==1.26.4", "old-one==1.0", "same==2.0"]
    now = ["new-one==3.0", "numpy==2.0.0", "same==2.0"]
    recorded.write("verl", {**key, "packages": recorded.packages_digest(then), "package_list": then}, outcomes,
                   records)
    rec, why = recorded.lookup("verl", {**key, "packages": recorded.packages_digest(now), "package_list": now},
                               records)
    assert rec is None and why == ("record verl.json is for other inputs (packages changed); packages moved: "
                                   "new-one 3.0 new, numpy 1.26.4 -> 2.0.0, old-one 1.0 gone")
    # a record from before the list (digests only) still says which part changed
    recorded.write("verl", {k: v for k, v in key.items() if k != "package_list"} | {"packages": "0" * 64}, outcomes,
                   records)
    assert recorded.lookup("verl", key, records) == (None, "record verl.json is for other inputs (packages changed)")
    # a package list that is not the one the digest is over is refused
    with pytest.raises(ValueError):
        recorded.write("verl", {**key, "package_list": then}, outcomes, records)


def test_judge_against_a_recorded_pristine_run_names_a_changed_outcome(runs: dict[str, dict[str, str]],
                                                                      tmp_path: Path) -> None:
    """The patched run is a real pytest process on the flipped suite; the pristine outcomes come from a record of the
    suite as written: the comparison must name the two flipped ids (positive control) and pass against itself."""
    tree = _tree(tmp_path / "b", {"tests/sub/test_mod_on_cpu.py": SUITE.replace("assert n == 1",
                                                                                  "assert n == 2").encode()})

    def patched_run(name: str) -> dict[str, subprocess.Popen]:
        out = tmp_path / f"{name}" / "patched-run"
        out.mkdir(parents=True)
        log = (out / "pytest.log").open("wb")
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        return {"patched": subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir",
             str(tree), "--junitxml", str(out / "junit.xml"), "tests/sub/test_mod_on_cpu.py"], cwd=tree, env=env,
            stdout=log, stderr=subprocess.STDOUT)}

    assert not verl_cpu.judge("t", "T", patched_run("differ"), tmp_path / "differ", 0.0,
                              recorded_pristine=runs["same"])
    assert verl_cpu.judge("t", "T", patched_run("equal"), tmp_path / "equal", 0.0, recorded_pristine=runs["flipped"])


def test_patched_record_answers_only_a_byte_equal_patched_tree_and_the_package_it_names(
        runs: dict[str, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both sides of a comparison from records: the patched record's key is the patched tree (and the recipe's
    package once the tree names it); a record made for other bytes is not used, and two recorded sides are still
    compared (a flipped patched record fails the judgement)."""
    import argparse

    pristine = _tree(tmp_path / "pristine", {"up/a.py": b"x = 1\n"})
    patched = _tree(tmp_path / "patched", {"up/a.py": b"x = 1\n", "up/seam.py": b"import qwen3_rl  # seam\n"})
    repo = _tree(tmp_path / "repo", {"tests/s.py": b"script\n", "qwen3_rl/__init__.py": b"v = 1\n"})
    records = tmp_path / "records"
    plain = argparse.Namespace(full=False, record=False)
    assert verl_cpu.names_package(patched) and not verl_cpu.names_package(pristine)
    sides = verl_cpu.record_sides("t", "up", pristine, patched, ("tests/s.py",), plain, repo, records)
    assert (sides.pristine, sides.patched) == (None, None)
    assert [n for n, _ in sides.trees(pristine, patched)] == ["patched", "pristine"]
    # the package is in the patched key only: the pristine key equals one taken without it
    assert sides.pristine_key["repo"] == verl_cpu.recorded.run_key(pristine, [""], repo, ["tests/s.py"])["repo"]
    assert sides.patched_key["repo"] == verl_cpu.recorded.run_key(
        patched, [""], repo, ["tests/s.py", "qwen3_rl"])["repo"]
    verl_cpu.recorded.write("up", sides.pristine_key, runs["same"], records)
    verl_cpu.recorded.write("up-patched", sides.patched_key, runs["same"], records)
    sides = verl_cpu.record_sides("t", "up", pristine, patched, ("tests/s.py",), plain, repo, records)
    assert sides.pristine == sides.patched == runs["same"] and sides.trees(pristine, patched) == []
    assert verl_cpu.judge("t", "T", {}, tmp_path, 0.0, recorded_pristine=sides.pristine,
                          recorded_patched=sides.patched)
    assert not verl_cpu.judge("t", "T", {}, tmp_path, 0.0, recorded_pristine=sides.pristine,
                              recorded_patched=runs["flipped"])
    # --full and --record use no record
    for flags in (argparse.Namespace(full=True, record=False), argparse.Namespace(full=False, record=True)):
        again = verl_cpu.record_sides("t", "up", pristine, patched, ("tests/s.py",), flags, repo, records)
        assert (again.pristine, again.patched) == (None, None)
    # a byte of the package: the patched tree that names it runs again, the pristine one does not
    (repo / "qwen3_rl" / "__init__.py").write_bytes(b"v = 2\n")
    sides = verl_cpu.record_sides("t", "up", pristine, patched, ("tests/s.py",), plain, repo, records)
    assert sides.pristine == runs["same"] and sides.patched is None
    assert "up-patched.json is for other inputs (repo changed)" in capsys.readouterr().out
    # a byte of the patched tree misses the record even with the package as recorded
    (repo / "qwen3_rl" / "__init__.py").write_bytes(b"v = 1\n")
    (patched / "up" / "a.py").write_bytes(b"x = 2\n")
    sides = verl_cpu.record_sides("t", "up", pristine, patched, ("tests/s.py",), plain, repo, records)
    assert sides.pristine == runs["same"] and sides.patched is None
    # a patched tree that does not name the package is keyed without it
    (patched / "up" / "seam.py").write_bytes(b"# no import\n")
    sides = verl_cpu.record_sides("t", "up", pristine, patched, ("tests/s.py",), plain, repo, records)
    assert sides.patched_key["repo"] == sides.pristine_key["repo"]
