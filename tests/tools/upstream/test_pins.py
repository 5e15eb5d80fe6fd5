"""The pin file: parsing, validation, and that everything else agrees with it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_rl.tools.pins import PinError, load_pins, pypi_requirement

REPO = Path(__file__).resolve().parents[3]


def test_real_pin_file_parses_and_is_complete():
    pins = load_pins(REPO / "pins.toml")
    assert set(pins.frameworks) == {"verl", "vllm", "vllm_ascend", "megatron", "mindspeed"}
    for fw in pins.frameworks.values():
        assert len(fw.commit) == 40 and int(fw.commit, 16) >= 0
        assert fw.git_url.endswith(".git") and fw.git_ref and fw.packages
    assert not pins.frameworks["mindspeed"].on_pypi
    assert pins.frameworks["vllm_ascend"].submodules
    assert "scripts" in pins.frameworks["verl"].packages and "tests" in pins.frameworks["verl"].packages
    assert pins.runtime["torch"] and pins.runtime["torch_npu"]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pins.toml"
    p.write_text(text)
    return p


GOOD = """schema = 1
[framework.a]
dir = "a"
git_url = "file:///x.git"
git_ref = "v1"
commit = "0123456789abcdef0123456789abcdef01234567"
pypi = "a-dist"
version = "1.0"
packages = ["a"]
"""


def test_minimal_pin_file(tmp_path):
    pins = load_pins(_write(tmp_path, GOOD))
    fw = pins.frameworks["a"]
    assert pypi_requirement(fw) == "a-dist==1.0"
    assert fw.pristine_message == "pristine a 1.0"
    assert pins.select("a") == [fw]
    assert pins.select(None) == [fw]


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda t: t.replace("schema = 1", "schema = 2"), "schema"),
        (lambda t: t.replace('commit = "0123456789abcdef0123456789abcdef01234567"', 'commit = "abc"'), "40"),
        (lambda t: t.replace('version = "1.0"\n', ""), "lacks version"),
        (lambda t: t.replace('packages = ["a"]', "packages = []"), "packages"),
        (lambda t: t + "[[[", "TOML"),
        (lambda t: "schema = 1\n", "no [framework"),
    ],
)
def test_bad_pin_files_give_one_line_errors(tmp_path, mutate, needle):
    with pytest.raises(PinError) as e:
        load_pins(_write(tmp_path, mutate(GOOD)))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_missing_pin_file(tmp_path):
    with pytest.raises(PinError, match="not found"):
        load_pins(tmp_path / "nope.toml")


def test_unknown_framework_names_the_known_ones(tmp_path):
    pins = load_pins(_write(tmp_path, GOOD))
    with pytest.raises(PinError, match="unknown framework zzz; known: a"):
        pins.select("a,zzz")


def test_git_only_framework_has_no_pypi_requirement():
    fw = load_pins(REPO / "pins.toml").frameworks["mindspeed"]
    with pytest.raises(PinError, match="needs --source git"):
        pypi_requirement(fw)


def test_pins_command_reads_the_file():
    pins = load_pins(REPO / "pins.toml")
    out = subprocess.run([sys.executable, "-m", "qwen3_rl", "pins", "--get", "vllm.version"],
                         cwd=REPO, text=True, capture_output=True, check=True).stdout.strip()
    assert out == pins.frameworks["vllm"].version
    shell = subprocess.run([sys.executable, "-m", "qwen3_rl", "pins", "--format", "shell"],
                           cwd=REPO, text=True, capture_output=True, check=True).stdout
    assert f"PIN_VERL_COMMIT={pins.frameworks['verl'].commit}" in shell
    bad = subprocess.run([sys.executable, "-m", "qwen3_rl", "pins", "--get", "nope.version"],
                         cwd=REPO, text=True, capture_output=True)
    assert bad.returncode == 1 and "unknown framework nope" in bad.stderr


def test_docs_pin_table_matches_pin_file():
    """The pin table of docs/patches.md is generated from pins.toml; it must not drift."""
    readme = (REPO / "docs" / "patches.md").read_text()
    pins = load_pins(REPO / "pins.toml")
    for fw in pins.frameworks.values():
        assert f"| {fw.key} | {fw.git_ref} | `{fw.commit}` |" in readme, fw.key
        assert fw.version in readme


def test_readme_generated_sections_are_current():
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "readme", "--check"], cwd=REPO, text=True,
                          capture_output=True)
    assert proc.returncode == 0, proc.stderr


def test_readme_quick_start_is_what_ci_runs():
    """The quick start's set-up (setup_cpu.sh = the engine environment + cpu-setup) and test commands are what CI
    runs: CI makes both environments and runs the tests, whose e2e fixture runs cpu-setup."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "tests/setup_engine_env.sh" in (REPO / "setup_cpu.sh").read_text()
    for cmd in ("bash tests/setup_env.sh", "bash tests/setup_engine_env.sh", "bash tests/run_tests.sh"):
        assert cmd in ci, cmd
    # every other set-up CI runs is in the quick start's test line, before the test command
    others = sorted(set(re.findall(r"bash (tests/setup_\w+\.sh)", ci)) - {"tests/setup_engine_env.sh"})
    test_line = " && ".join([f"bash {s}" for s in others] + ["bash tests/run_tests.sh"])
    assert "bash tests/setup_env.sh" in test_line
    for name in ("README.md", "README.zh-CN.md"):
        readme = (REPO / name).read_text()
        for cmd in ("bash setup_cpu.sh", test_line, "bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu"):
            assert cmd in readme, (name, cmd)
