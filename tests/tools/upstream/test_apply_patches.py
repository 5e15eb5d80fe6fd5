"""apply_all_patches.sh: the real series on pristine pins, and the machinery on synthetic series."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from qwen3_rl.tools.upstream import patches as ps

from conftest import PINS, PYPI_KEYS, run_script

REPO = Path(__file__).resolve().parents[3]


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], text=True, capture_output=True,
                          check=True).stdout


def test_every_series_is_well_named_numbered_and_headed():
    for key in PINS.frameworks:
        assert ps.lint_series(key) == [], key
    proc = run_script("apply_all_patches.sh", "--lint")
    assert proc.returncode == 0 and "patch series OK" in proc.stdout, proc.stdout + proc.stderr


def test_real_series_apply_noop_revert(make_workspace):
    ws = make_workspace()
    total = sum(len(ps.series(k)) for k in PYPI_KEYS)
    only = ",".join(PYPI_KEYS)
    check = run_script("apply_all_patches.sh", "--check", "--workspace", str(ws), "--only", only)
    assert check.returncode == 0, check.stderr
    assert check.stdout.count("would apply") == total
    for key in PYPI_KEYS:
        assert git(ws / PINS.frameworks[key].dir, "status", "--porcelain") == ""  # --check changed nothing

    proc = run_script("apply_all_patches.sh", "--workspace", str(ws), "--only", only)
    assert proc.returncode == 0, proc.stderr
    snapshot = {k: git(ws / PINS.frameworks[k].dir, "diff") for k in PYPI_KEYS}
    for key in PYPI_KEYS:
        pats = ps.series(key)
        tree = ws / PINS.frameworks[key].dir
        assert [s.state for s in ps.status(tree, pats)] == [ps.State.APPLIED] * len(pats)
        for p in pats:  # every patched Python file byte-compiles
            for rel in p.files:
                f = tree / rel
                if f.suffix == ".py" and f.exists():
                    compile(f.read_text(), str(f), "exec")

    again = run_script("apply_all_patches.sh", "--workspace", str(ws), "--only", only)
    assert again.returncode == 0
    assert {k: git(ws / PINS.frameworks[k].dir, "diff") for k in PYPI_KEYS} == snapshot
    for key in PYPI_KEYS:
        if ps.series(key):
            assert f"{key}: all {len(ps.series(key))} patches already applied, nothing to do" in again.stdout

    status = run_script("apply_all_patches.sh", "--status", "--workspace", str(ws), "--only", only)
    assert status.returncode == 0
    assert status.stdout.count(" applied ") + status.stdout.count(" applied\n") >= total

    rev = run_script("apply_all_patches.sh", "--revert", "--workspace", str(ws), "--only", only)
    assert rev.returncode == 0, rev.stderr
    for key in PYPI_KEYS:
        tree = ws / PINS.frameworks[key].dir
        assert git(tree, "status", "--porcelain", "--untracked-files=all") == "", key  # byte-identical pristine


# ------------------------------------------------------------------ synthetic series on real verl
HEADER = ("Subject: {s}\nDescription: test patch\nSwitch: none\nUpstream: no\n"
          "Verified: stand-in (tests/tools/upstream/test_apply_patches.py)\n---\n")


@pytest.fixture
def synthetic(make_workspace, tmp_path):
    """verl tree + a 2-patch series touching the same file (the second builds on the first)."""
    ws = make_workspace("verl")
    tree = ws / "verl"
    rel = "verl/__init__.py"
    f = tree / rel
    orig = f.read_text()
    assert "import" in orig
    one = orig.replace("import", "import  # qwen3_rl test one\nimport", 1)
    two = one.replace("# qwen3_rl test one", "# qwen3_rl test one\n# qwen3_rl test two", 1)
    f.write_text(one)
    d1 = git(tree, "diff", "--", rel)
    git(tree, "add", rel)  # stage state one so the next diff is relative to it
    f.write_text(two)
    d2 = git(tree, "diff", "--", rel)
    git(tree, "reset", "-q", "--", rel)
    f.write_text(orig)
    assert git(tree, "status", "--porcelain") == ""
    pdir = tmp_path / "patches" / "verl"
    pdir.mkdir(parents=True)
    (pdir / "0001-verl-bugfix-one.patch").write_text(HEADER.format(s="one") + d1)
    (pdir / "0002-verl-feature-two.patch").write_text(HEADER.format(s="two") + d2)
    return ws, tree, tmp_path / "patches", rel, orig


def _apply(ws, pdir, *extra):
    return run_script("apply_all_patches.sh", "--workspace", str(ws), "--patches-dir", str(pdir),
                      "--only", "verl", *extra)


def test_stacked_series_applies_and_reverts(synthetic):
    ws, tree, pdir, rel, orig = synthetic
    assert _apply(ws, pdir).returncode == 0
    text = (tree / rel).read_text()
    assert "# qwen3_rl test one\n# qwen3_rl test two" in text
    st = _apply(ws, pdir, "--status")
    assert "0001-verl-bugfix-one.patch" in st.stdout and st.stdout.count("applied") == 2
    assert _apply(ws, pdir, "--revert").returncode == 0
    assert (tree / rel).read_text() == orig


def test_half_applied_series_is_completed(synthetic):
    ws, tree, pdir, rel, orig = synthetic
    git(tree, "apply", str(pdir / "verl" / "0001-verl-bugfix-one.patch"))
    st = ps.status(tree, ps.series("verl", pdir))
    assert [s.state for s in st] == [ps.State.APPLIED, ps.State.NOT_APPLIED]
    proc = _apply(ws, pdir)
    assert proc.returncode == 0 and "applied 0002-verl-feature-two.patch" in proc.stdout
    assert "applied 0001" not in proc.stdout


def test_conflict_is_named_and_nothing_is_half_applied(synthetic):
    ws, tree, pdir, rel, orig = synthetic
    # a third patch whose context does not exist: the whole series must be refused untouched
    bad = HEADER.format(s="bad") + (
        "diff --git a/verl/protocol.py b/verl/protocol.py\n--- a/verl/protocol.py\n+++ b/verl/protocol.py\n"
        "@@ -1,3 +1,3 @@\n-this line is not in the file\n+replacement\n context two\n context three\n"
    )
    (pdir / "verl" / "0003-verl-bugfix-bad.patch").write_text(bad)
    before = git(tree, "status", "--porcelain")
    proc = _apply(ws, pdir)
    assert proc.returncode == 1
    assert "0003-verl-bugfix-bad.patch does not apply (verl/protocol.py)" in proc.stderr
    assert "nothing was changed" in proc.stderr
    assert git(tree, "status", "--porcelain") == before == ""
    st = _apply(ws, pdir, "--status")
    assert st.returncode == 1 and "conflict" in st.stdout and "not applied" in st.stdout


def test_check_lists_and_changes_nothing(synthetic):
    ws, tree, pdir, rel, orig = synthetic
    proc = _apply(ws, pdir, "--check")
    assert proc.returncode == 0
    assert "would apply 0001-verl-bugfix-one.patch" in proc.stdout
    assert "would apply 0002-verl-feature-two.patch" in proc.stdout
    assert (tree / rel).read_text() == orig


def test_lint_catches_bad_names_numbers_and_headers(tmp_path):
    pdir = tmp_path / "verl"
    pdir.mkdir()
    diff = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"
    (pdir / "0001-verl-bugfix-ok.patch").write_text(HEADER.format(s="ok") + diff)
    (pdir / "0003-verl-bugfix-gap.patch").write_text(HEADER.format(s="gap") + diff)
    (pdir / "0004-vllm-feature-wrongfw.patch").write_text(HEADER.format(s="fw") + diff)
    (pdir / "0005-verl-feature-noheader.patch").write_text(diff)
    (pdir / "5-verl-x.patch").write_text(diff)
    problems = "\n".join(ps.lint_series("verl", tmp_path))
    assert "5-verl-x.patch: patch name must be" in problems
    assert "0003-verl-bugfix-gap.patch: expected number 0002" in problems
    assert "framework in name is 'vllm'" in problems
    assert "0005-verl-feature-noheader.patch: header lacks 'Subject:'" in problems
    proc = run_script("apply_all_patches.sh", "--lint", "--only", "verl", "--patches-dir", str(tmp_path))
    assert proc.returncode == 1 and "problem(s)" in proc.stderr


def test_lint_requires_a_verified_level_and_the_table_shows_it(tmp_path):
    pdir = tmp_path / "verl"
    pdir.mkdir()
    diff = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"
    ok = HEADER.format(s="ok").replace("Verified: stand-in (tests/tools/upstream/test_apply_patches.py)",
                                       "Verified: real engine (tests/engine/x.py: runs it);\n also on CPU")
    (pdir / "0001-verl-bugfix-ok.patch").write_text(ok + diff)
    unverified = "".join(ln for ln in HEADER.format(s="u").splitlines(True) if not ln.startswith("Verified:"))
    (pdir / "0002-verl-bugfix-unverified.patch").write_text(unverified + diff)
    (pdir / "0003-verl-bugfix-vague.patch").write_text(
        HEADER.format(s="v").replace("Verified: stand-in", "Verified: tested") + diff)
    assert ps.series("verl", tmp_path)[0].header()["Verified"] == "real engine (tests/engine/x.py: runs it); also on CPU"
    assert ps.lint_series("verl", tmp_path) == [
        "0002-verl-bugfix-unverified.patch: header lacks 'Verified:'",
        "0003-verl-bugfix-vague.patch: 'Verified:' must start with one of real engine, upstream code on CPU, "
        "stand-in, compiled/parsed only (then ';' or '(' and the tests), got 'tested'"]
    assert [ps.verified_level(v) for v in ("compiled/parsed only; x", "upstream code on CPU (x)",
                                           "stand-in \u2014 x", "real engine")] == [
        "compiled/parsed only", "upstream code on CPU", "stand-in", "real engine"]
    table = ps.markdown_table(["verl"], tmp_path).splitlines()
    assert table[0] == "| framework | patch | what | switch (default) | verified |"
    assert table[2].endswith("| ok | none | real engine |")
    # the shipped series: every patch says how it is verified, with one of the levels
    for key in PINS.frameworks:
        for p in ps.series(key):
            assert ps.verified_level(p.header()["Verified"]) in ps.VERIFIED_LEVELS, p.path.name


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--only", "nosuch"], "unknown framework nosuch"),
        (["--workspace", "/nonexistent/ws"], "workspace /nonexistent/ws does not exist"),
        (["--check", "--revert"], "not allowed with argument"),
    ],
)
def test_apply_bad_inputs(args, needle):
    proc = run_script("apply_all_patches.sh", *args)
    assert proc.returncode != 0 and needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 3


def test_missing_tree_names_the_download_command(synthetic, tmp_path):
    ws, tree, pdir, rel, orig = synthetic
    empty = tmp_path / "empty_ws"
    empty.mkdir()
    proc = _apply(empty, pdir)
    assert proc.returncode == 1
    assert "no source tree at" in proc.stderr and "download_frameworks_source_code.sh --only verl" in proc.stderr
