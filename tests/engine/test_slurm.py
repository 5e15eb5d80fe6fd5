"""The tiny CPU GRPO run through a real Slurm on two nodes (marker ``e2e``): ``sbatch launch_slurm.sbatch``.

Slurm is Debian's 22.05 (``slurmctld``, ``slurmd``, ``munge``), started by the test (tests/helpers/slurm_cluster.py) with a
generated munge key and ``slurm.conf``. The two nodes are two network namespaces joined by a veth pair
(tests/helpers/netns.py), one ``slurmd`` each, each with its own Ray temp dir (bind-mounted in the ``slurmd``'s mount
namespace, as separate machines have their own ``/tmp``); the controller runs in the first node's namespace. Every
node advertises a count-only GRES ``npu:1``.

1. One training step: ``sbatch -N 2 --gres=npu:1 launch_slurm.sbatch internal/train_grpo_tiny_cpu.sh --device cpu
   ...`` with ``TOTAL_TRAINING_STEPS=1``. The job completes with exit 0; the head (the job's first node, its
   ``NodeAddr`` as master) reports 2 nodes and 2 NPU slots (from the GRES); verl's report has step 1 and its
   checkpoint; both ranks' weight syncs are exact; Ray ran worker processes in the second node's own temp dir; Ray
   token auth was on (a two-node run) with the token made by the batch step; afterwards no process of the job is
   left in either namespace and both nodes' ``ray_current_cluster`` are gone.
2. ``scancel`` during a step: the same command with two steps is cancelled once the rollout of step 1 started; the
   job ends CANCELLED within a bound and nothing of it is left running in either namespace.
3. A failed node: the NPU env file given exists on the first node only; the second node's launcher stops with
   its one-line error, the head's bounded cluster wait fails, the job is FAILED with both errors in its log
   under their task numbers, and nothing is left.

Only loopback and the test's own namespaces carry traffic.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_e2e_training import SHORT, Run, _events, check_step_log_and_ckpt, launch_env

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the Slurm and namespace harnesses

from qwen3_rl.tools.pins import load_pins  # noqa: E402

from helpers.netns import TwoNodes, describe, ns_pids, pids_mentioning, two_nodes  # noqa: E402,F401
from helpers.slurm_cluster import Node, SlurmCluster, missing_tools  # noqa: E402

pytestmark = pytest.mark.e2e

REPO = HERE.parents[1]
JOB_TIMEOUT_S = 900  # one sbatch run, submit to end
CANCEL_TIMEOUT_S = 150  # scancel to CANCELLED with nothing left


@pytest.fixture(scope="module")
def ray_tmp() -> Iterator[Path]:
    """The Ray temp dir path every node uses (short: Ray's socket paths are length-limited)."""
    d = Path(tempfile.mkdtemp(prefix="q3s", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def slurm(two_nodes: TwoNodes, tmp_path: Path, ray_tmp: Path) -> Iterator[SlurmCluster]:  # noqa: F811
    missing = missing_tools()
    if missing:
        pytest.fail(f"Slurm test needs {missing}: apt-get install slurmctld slurmd slurm-client munge (.ci/run does)")
    net = two_nodes
    nodes = [Node("q3a", net.head_ip, net.head_ns, {str(ray_tmp): str(tmp_path / "node_a_tmp")}),
             Node("q3b", net.worker_ip, net.worker_ns, {str(ray_tmp): str(tmp_path / "node_b_tmp")})]
    cluster = SlurmCluster(tmp_path / "slurm", nodes, cpus=2, npus=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _ray_version() -> str:
    import ray

    return ray.__version__


def _job_left(cluster: SlurmCluster, net: TwoNodes, marks: list[str]) -> list[int]:
    """PIDs of the job still running: any process in the two namespaces but the Slurm daemons, or naming ``marks``."""
    daemons = {p.pid for p in cluster.procs} | cluster.helper_pids()
    left = [p for p in ns_pids(net.head_ns) + ns_pids(net.worker_ns) if p not in daemons]
    for m in marks:
        left += [p for p in pids_mentioning(m) if p not in daemons and p not in left]
    return left


def _submit(cluster: SlurmCluster, run_dir: Path, env: dict[str, str], ray_tmp: Path, *extra: str) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create the output file's folder
    args = ["sbatch", "--parsable", "-N", "2", "--gres=npu:1", "-o", str(run_dir / "slurm-%j.out"), "-D", str(REPO),
            str(REPO / "launch_slurm.sbatch"), "internal/train_grpo_tiny_cpu.sh", "--device", "cpu",
            "--temp-dir", str(ray_tmp), "--log-dir", str(run_dir / "logs"), "--timeout", "180",
            "--join-interval", "2", "--watch-interval", "2", "--watch-misses", "2", *extra]
    return cluster.client(*args, env=env).stdout.strip().split(";")[0]


def test_slurm_two_nodes_one_step_then_scancel(slurm: SlurmCluster, two_nodes: TwoNodes,  # noqa: F811
                                               cpu_ws: Path, tmp_path: Path,  # noqa: F811
                                               ray_tmp: Path) -> None:
    pinned = load_pins().runtime["ray"]
    assert _ray_version() == pinned, f"ray {_ray_version()} here, the image runs {pinned} (pins.toml runtime.ray)"
    net = two_nodes
    node_tmp = {"a": tmp_path / "node_a_tmp", "b": tmp_path / "node_b_tmp"}

    # 1. one training step on two nodes
    run_dir = tmp_path / "one_step"
    # no validation (SHORT): what this job checks is the cluster, the step and its checkpoint
    env = launch_env(cpu_ws, run_dir, run_dir / "ckpt", {**SHORT, "TOTAL_TRAINING_STEPS": "1"})
    t0 = time.monotonic()
    job = _submit(slurm, run_dir, env, ray_tmp)
    state = slurm.wait_job(job, JOB_TIMEOUT_S)
    took = time.monotonic() - t0
    out = (run_dir / f"slurm-{job}.out").read_text(errors="replace")
    tail = "\n".join(out.splitlines()[-80:])
    assert state == "COMPLETED", f"job {job} {state}:\n{tail}"
    info = slurm.client("scontrol", "show", "job", job, "-o", check=False).stdout
    assert " ExitCode=0:0 " in f" {info} ", info
    assert f"[slurm] job {job}: 2 node(s), head q3a ({net.head_ip}), npu GRES per node: 1" in out
    assert f"0: [slurm] node q3a: NodeAddr {net.head_ip} on {net.head_if} (SOCKET_IFNAME)" in out
    assert f"1: [slurm] node q3b: NodeAddr {net.worker_ip} on {net.worker_if} (SOCKET_IFNAME)" in out
    assert "0: [ray_start_npu] cluster ready: 2 node(s), 2 NPU" in out, tail
    assert f"1: [ray_start_npu] joined {net.head_ip}:6379" in out, tail
    # token auth on (two nodes), the token made by the batch step and handed over in srun's environment
    assert "0: [ray_start_npu] Ray auth: token from RAY_AUTH_TOKEN" in out, tail
    assert "1: [ray_start_npu] Ray auth: token from RAY_AUTH_TOKEN" in out, tail
    assert f"[slurm] job {job}: srun exited with code 0" in out, tail
    run = Run(0, out, _events(run_dir / "probe"), run_dir / "probe", run_dir / "ckpt", took)
    doc = check_step_log_and_ckpt(run, [1])
    syncs = run.of("weight_sync")
    assert {e["rank"] for e in syncs} == {0, 1} and all(e["all_equal"] for e in syncs), syncs
    # rank 1's worker ran on the second node: its Ray worker logs are in that node's own temp dir
    assert list(node_tmp["b"].glob("session_*/logs/python-core-worker-*.log")), "no Ray worker ran on node q3b"
    for n, d in node_tmp.items():
        assert not (d / "ray_current_cluster").exists(), f"node {n}: Ray's ray_current_cluster left behind"
    left = _job_left(slurm, net, [str(run_dir), str(ray_tmp)])
    assert left == [], f"processes of job {job} left:\n{describe(left)}"
    print(f"slurm: 2 nodes, one GRPO step: job {job} COMPLETED in {took:.0f} s "
          f"(step {float(doc['steps']['1'].get('timing_s/step', 0)):.0f} s)")

    # 2. scancel during a step: nothing of the job is left
    run_dir = tmp_path / "cancelled"
    env = launch_env(cpu_ws, run_dir, run_dir / "ckpt", SHORT)  # 2 steps
    job = _submit(slurm, run_dir, env, ray_tmp)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not [e for e in _events(run_dir / "probe") if e["event"] == "generate_start"]:
        assert slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), \
            f"job {job} ended before its first rollout:\n{(run_dir / f'slurm-{job}.out').read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"job {job}: no rollout started within {JOB_TIMEOUT_S} s"
        time.sleep(1.0)
    t_cancel = time.monotonic()
    slurm.client("scancel", job)
    state = slurm.wait_job(job, CANCEL_TIMEOUT_S)
    t_end = time.monotonic()
    assert state == "CANCELLED", f"job {job} {state} after scancel"
    while (left := _job_left(slurm, net, [str(run_dir), str(ray_tmp)])) and time.monotonic() - t_cancel < CANCEL_TIMEOUT_S:
        time.sleep(1.0)
    out = (run_dir / f"slurm-{job}.out").read_text(errors="replace")
    assert left == [], f"processes of cancelled job {job} left {CANCEL_TIMEOUT_S} s after scancel:\n{describe(left)}" \
                       f"\n--- job log\n{out[-4000:]}"
    assert not (run_dir / "ckpt" / "global_step_2").exists(), "the cancelled run finished step 2"
    print(f"slurm: scancel during step 1: job {job} CANCELLED {t_end - t_cancel:.0f} s after scancel, nothing left "
          f"{time.monotonic() - t_cancel:.0f} s after it; job log tail:\n" + "\n".join(out.splitlines()[-12:]))
    print(json.dumps({"one_step_job_s": round(took), "cancel_to_cancelled_s": round(t_end - t_cancel)}))

    # 3. a failed node fails the job, with its error in the job log: the NPU env file exists on the first node
    #    only (in its node-local directory), so the second node's launcher stops at its option check
    (node_tmp["a"] / "npu_env.sh").write_text((REPO / "internal" / "npu_env.sh").read_text())
    run_dir = tmp_path / "failed_node"
    env = launch_env(cpu_ws, run_dir, run_dir / "ckpt")
    t0 = time.monotonic()
    job = _submit(slurm, run_dir, env, ray_tmp, "--npu-env", str(ray_tmp / "npu_env.sh"), "--timeout", "20")
    state = slurm.wait_job(job, 300)
    out = (run_dir / f"slurm-{job}.out").read_text(errors="replace")
    assert state == "FAILED", f"job {job} {state}:\n{out[-4000:]}"
    assert f"1: error: NPU environment file not found: {ray_tmp / 'npu_env.sh'}" in out, out[-4000:]
    assert "0: error: cluster did not assemble within 20 s: 1/2 nodes" in out, out[-4000:]
    assert f"[slurm] job {job}: srun exited with code 1" in out or "srun exited with code 2" in out, out[-2000:]
    left = _job_left(slurm, net, [str(run_dir), str(ray_tmp)])
    assert left == [], f"processes of failed job {job} left:\n{describe(left)}"
    print(f"slurm: failed node: job {job} FAILED in {time.monotonic() - t0:.0f} s with the node's error in its log")
