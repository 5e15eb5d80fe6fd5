"""CPU binding: npu-smi parsers on recorded (reconstructed) output, the per-die core map, and a live
binder pass that really changes a child process's affinity through a stub ``npu-smi``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_launch import DATA, PY, REPO, make_cann, make_stubs, run_launcher, stub_env

from qwen3_rl.tools.launch.cpu_binding import BindingError, BindingMap, compute_binding, plan_process_binding
from qwen3_rl.tools.launch.npu_smi import (
    NpuProcess,
    NpuSmiError,
    format_cpulist,
    parse_chip_map,
    parse_cpulist,
    parse_processes,
    parse_topo_affinity,
)

TOPO = (DATA / "npu_smi_topo_a3.txt").read_text()
CHIPS = (DATA / "npu_smi_info_m_a3.txt").read_text()
INFO = (DATA / "npu_smi_info_a3.txt").read_text()


def test_parse_recorded_topo_chip_map_and_processes():
    aff = parse_topo_affinity(TOPO)
    assert sorted(aff) == list(range(16))
    assert aff[0] == list(range(0, 40)) and aff[5] == list(range(40, 80)) and aff[15] == list(range(120, 160))
    chips = parse_chip_map(CHIPS)
    assert len(chips) == 16 and all(c.name == "Ascend 910" for c in chips)  # Mcu rows skipped
    assert [(c.npu_id, c.chip_id, c.logic_id) for c in chips[:3]] == [(0, 0, 0), (0, 1, 1), (1, 0, 2)]
    procs = parse_processes(INFO)
    assert [(p.npu_id, p.chip_id, p.pid, p.name) for p in procs] == [
        (0, 0, 300100, "python3"), (0, 1, 300101, "python3"), (3, 1, 300107, "ray::WorkerDict"),
        (7, 1, 300115, "python3")]


def test_topo_errors_and_split_affinity():
    with pytest.raises(NpuSmiError, match="no 'CPU Affinity' column"):
        parse_topo_affinity("\n".join(ln.replace("CPU Affinity", "") for ln in TOPO.splitlines()))
    with pytest.raises(NpuSmiError, match="no header row"):
        parse_topo_affinity("npu-smi: command not supported\n")
    two = ("           NPU0       NPU1       CPU Affinity\n"
           "NPU0       X          HCCS       0-19,80-99\n"
           "NPU1       HCCS       X          20-39,100-119\n\nLegend:\n")
    assert parse_topo_affinity(two) == {0: list(range(0, 20)) + list(range(80, 100)),
                                        1: list(range(20, 40)) + list(range(100, 120))}
    with pytest.raises(NpuSmiError, match="row NPU0"):
        parse_topo_affinity(two.replace("0-19,80-99", "19-0"))


@given(st.sets(st.integers(0, 300), min_size=1, max_size=60))
def test_cpulist_round_trip(cores: set[int]):
    assert parse_cpulist(format_cpulist(cores)) == sorted(cores)


def test_compute_binding_restricts_to_online_and_labels_numa():
    numa = {n: list(range(40 * n, 40 * n + 40)) for n in range(4)}
    bmap = compute_binding(TOPO, CHIPS, range(160), numa, npus=range(16))
    assert bmap.cores[4] == list(range(40, 80)) and bmap.numa[4] == [1] and bmap.numa[15] == [3]
    assert bmap.chips[(3, 1)] == 7
    assert "NPU 7 (card 3 chip 1): NUMA 1, cores 40-79" in bmap.describe().splitlines()
    assert BindingMap.from_json(bmap.to_json()) == bmap
    partial = compute_binding(TOPO, CHIPS, list(range(0, 10)) + list(range(40, 45)), None, npus=range(8))
    assert partial.cores[0] == list(range(10)) and partial.cores[4] == list(range(40, 45))
    with pytest.raises(BindingError, match="NPU 8: none of its affinity cores 80-119 is online here"):
        compute_binding(TOPO, CHIPS, range(80), None, npus=range(16))
    with pytest.raises(BindingError, match="NPU 16 is not in the npu-smi topology"):
        compute_binding(TOPO, CHIPS, range(160), None, npus=range(17))


def test_process_plan_maps_card_chip_to_logic_id_and_unions():
    bmap = compute_binding(TOPO, CHIPS, range(160), None)
    procs = parse_processes(INFO) + [NpuProcess(7, 0, 300100, "python3", 1)]  # pid 300100 also on logic 14
    plan = plan_process_binding(procs, bmap)
    assert plan[300101] == ([1], list(range(0, 40)))
    assert plan[300107] == ([7], list(range(40, 80)))
    assert plan[300115] == ([15], list(range(120, 160)))
    assert plan[300100] == ([0, 14], list(range(0, 40)) + list(range(120, 160)))


def test_binder_pins_a_live_process_through_stub_npu_smi(tmp_path: Path):
    online = sorted(os.sched_getaffinity(0))
    target = online[-1]
    child = subprocess.Popen(["sleep", "30"])
    try:
        topo = tmp_path / "topo.txt"
        topo.write_text("           NPU0       NPU1       CPU Affinity\n"
                        f"NPU0       X          HCCS       {target}\n"
                        f"NPU1       HCCS       X          {format_cpulist(online)}\n")
        info = tmp_path / "info.txt"
        info.write_text("| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |\n"
                        f"| 0       0                 | {child.pid:<13} | sleep                    | 100                     |\n")
        bmap = compute_binding(topo.read_text(), CHIPS, online, None, npus=range(2))
        (tmp_path / "map.json").write_text(bmap.to_json())
        bin_dir = make_stubs(tmp_path, ray=False, ip=False)
        env = stub_env(tmp_path, bin_dir, STUB_NPU_INFO=str(info), PYTHONPATH=str(REPO))
        p = subprocess.run([PY, "-m", "qwen3_rl", "launch", "cpu-bind", "--map", str(tmp_path / "map.json"), "--once"],
                           env=env, text=True, capture_output=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert os.sched_getaffinity(child.pid) == {target}
        assert f"cpu-bind: pid {child.pid} (NPU 0) -> cores {target} (1 thread(s) changed)" in p.stdout
        assert "npu-smi info" in (tmp_path / "calls.log").read_text()
    finally:
        child.kill()
        child.wait()


def test_launcher_prints_map_in_dry_run_and_fails_cleanly_without_topology(tmp_path: Path):
    bin_dir = make_stubs(tmp_path)
    env = stub_env(tmp_path, bin_dir, STUB_IP_ADDRS="eth0=10.20.0.1,lo=127.0.0.1")
    script = "internal/train_grpo_qwen3_32b_32die_true_weight.sh"
    p = run_launcher([script, "--cpu-binding", "--dry-run"], env)
    assert p.returncode == 0, p.stderr
    # this machine has fewer cores than an A3 node: the recorded topology's dies 4-15 are not online here
    online = sorted(os.sched_getaffinity(0))
    if max(online) < 40:
        assert "(map not computed here: NPU 4: none of its affinity cores 40-79 is online here" in p.stdout
    else:
        assert "NPU 0 (card 0 chip 0)" in p.stdout
    assert "cpu binding: on" in p.stdout
    # real launch with a topology lacking the CPU Affinity column: one-line error before Ray starts
    bad = tmp_path / "topo_bad.txt"
    bad.write_text("\n".join(ln.replace("CPU Affinity", "") for ln in TOPO.splitlines()))
    env.update(STUB_NPU_TOPO=str(bad), CANN_HOME=str(make_cann(tmp_path)))
    p = run_launcher([script, "--cpu-binding", "--no-preflight"], env)
    assert p.returncode == 1
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("error:")] == [
        "error: --cpu-binding: npu-smi info -t topo: no 'CPU Affinity' column (cannot compute CPU binding)"]
    assert "ray start" not in (tmp_path / "calls.log").read_text()
