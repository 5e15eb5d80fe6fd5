"""launch_slurm.sbatch and its Python side (qwen3_rl/tools/launch/slurm.py) without a Slurm: Slurm's output parsed as
22.05 prints it, the script's lint, --help and refusal outside a job. The real Slurm run is tests/engine/test_slurm.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_rl.tools.launch.slurm import SlurmError, interface_of, parse_node_addr, parse_npus_per_node

REPO = Path(__file__).resolve().parents[3]
SBATCH = REPO / "launch_slurm.sbatch"

# `scontrol show job 7 -o` of `sbatch -N 2 --gres=npu:16` on Slurm 22.05 (shortened; the fields read are as printed)
JOB_2205 = ("JobId=7 JobName=qwen3-rl UserId=root(0) JobState=RUNNING NodeList=q3a,q3b BatchHost=q3a NumNodes=2 "
            "NumCPUs=4 NumTasks=2 TRES=cpu=4,node=2,billing=4,gres/npu=32 TresPerNode=gres:npu:16 Command=x")


def test_npus_per_node_from_gres():
    assert parse_npus_per_node(JOB_2205) == 16
    assert parse_npus_per_node("TresPerNode=gres/npu:8") == 8
    assert parse_npus_per_node("TresPerNode=gres/npu=4") == 4
    assert parse_npus_per_node("TresPerNode=gres:npu:910c:16") == 16
    assert parse_npus_per_node("TresPerNode=gres:gpu:8") is None
    assert parse_npus_per_node("JobId=7 NumNodes=2") is None


def test_node_addr_and_interface():
    assert parse_node_addr("NodeName=q3a Arch=x86_64 CoresPerSocket=1 NodeAddr=10.213.5.1 NodeHostName=q3a") == \
        "10.213.5.1"
    with pytest.raises(SlurmError, match="no NodeAddr"):
        parse_node_addr("NodeName=q3a")
    addr_show = ("1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n"
                 "7: q3h5@if6    inet 10.213.5.1/30 scope global q3h5\\       valid_lft forever\n")
    assert interface_of("10.213.5.1", addr_show) == "q3h5"
    with pytest.raises(SlurmError, match="no interface of this node holds its Slurm NodeAddr 10.9.9.9"):
        interface_of("10.9.9.9", addr_show)


def test_sbatch_script_lint_help_and_refusal_outside_slurm():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    p = subprocess.run([shellcheck, "-x", "-s", "bash", str(SBATCH)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    head = SBATCH.read_text().splitlines()[:5]
    assert head[1:4] == ["#SBATCH --job-name=qwen3-rl", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"]
    p = subprocess.run(["bash", str(SBATCH), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "sbatch --nodes=8 --gres=npu:16 launch_slurm.sbatch TRAIN_SCRIPT" in p.stdout
    env = {"PATH": "/usr/bin:/bin"}
    p = subprocess.run(["bash", str(SBATCH), "internal/train_grpo_tiny_cpu.sh"], capture_output=True, text=True,
                       timeout=30, env=env)
    assert p.returncode == 2 and p.stderr.strip() == "error: submit this file with sbatch (see --help)"
