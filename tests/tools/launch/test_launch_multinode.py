"""ray_start_npu.sh on two "nodes" with the real Ray: two network namespaces made by this test.

The head and the worker each run in their own network namespace (``ip netns add``), joined by one veth
pair whose two addresses (10.213.x.1/30 and 10.213.x.2/30) exist only inside those namespaces; neither
namespace has a route anywhere else, so no Ray traffic can leave them. Each node runs the very command a
user runs on a cluster (``bash ray_start_npu.sh TRAIN --nnodes 2 --npus-per-node 16 --master-addr HEAD``)
with the fake CANN and the stub ``npu-smi`` of tests/tools/launch/test_launch.py, the venv's real ``ray``, one CPU,
its own Ray temp dir, log dir and TMPDIR.

Checked: the head waits (it reports 1/2 nodes and starts no training) until the worker's 16 NPU are
registered; the stand-in train script sees 2 live nodes and NPU=32 through ``ray.nodes()`` /
``ray.cluster_resources()`` and runs one task on each node; the head exits with the script's exit code
and stops its Ray; the worker notices that the head's cluster is gone and exits 0 by itself; no process
is left in either namespace or mentions the test's directory. Token auth (Ray 2.52, pins.toml): the head writes one
token to a file both nodes see (``--auth-token-file``); from the worker's namespace, ``ray status`` without the
token and ``ray.init`` with a wrong one are refused by the head's GCS while ``ray status`` with the token answers;
the token is written in no log or Ray session file. The namespaces (and with them the veth
pair) are deleted in the fixture's teardown, also on failure. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN
for ``ip netns``); without it the test is skipped with the failing command and its error.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_launch import REPO, VENV_BIN, make_cann, make_standin, make_stubs, stub_env

from qwen3_rl.tools.pins import load_pins

from helpers.netns import TwoNodes, describe, kill_mentioning, ns_pids, pids_mentioning, two_nodes  # noqa: F401 (fixture)

NPUS = 16
EXIT_CODE = 5
PORT = 6379  # each namespace has its own port space: nothing else listens there

# The stand-in train script: what it sees of the cluster at its very first look (no waiting), then one
# task pinned to each live node (proves both raylets run work), then the chosen exit code.
MULTINODE_STANDIN = r"""
import os, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
res = ray.cluster_resources()
alive = [n for n in ray.nodes() if n["Alive"]]
print(f"standin: nodes={len(alive)} NPU={res.get('NPU')} "
      f"node_npu={sorted(n['Resources'].get('NPU', 0) for n in alive)} "
      f"ips={sorted(n['NodeManagerAddress'] for n in alive)}", flush=True)
@ray.remote(num_cpus=0, resources={"NPU": 1})
def where():
    return ray.util.get_node_ip_address()
refs = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in alive]
print(f"standin: task_ips={sorted(ray.get(refs, timeout=60))}", flush=True)
ray.shutdown()
# Clients on the other node (the worker's namespace) try the head's GCS: without the token, with a wrong
# one, and (positive control) with the cluster's token file.
import subprocess
head = os.environ["RAY_ADDRESS"]
clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
clean["HOME"] = os.environ["EMPTY_HOME"]  # no ~/.ray/auth_token to fall back on
probe = ["ip", "netns", "exec", os.environ["PEER_NS"]]
init = ("import ray, sys\ntry:\n ray.init(address=sys.argv[1], logging_level='ERROR')\n"
        "except Exception as e:\n print('ERR', type(e).__name__, e); sys.exit(3)\nprint('CONNECTED')")
cases = {"no_token": (clean, ["ray", "status", "--address", head]),
         "wrong_token": ({**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
                         [sys.executable, "-c", init, head]),
         "with_token": ({**clean, "RAY_AUTH_MODE": "token",
                         "RAY_AUTH_TOKEN_PATH": os.environ["RAY_AUTH_TOKEN_PATH"]}, ["ray", "status", "--address", head])}
for name, (env, cmd) in cases.items():
    p = subprocess.run(probe + cmd, env=env, capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    refused = "InvalidAuthToken" in out or "AuthenticationError" in out
    print(f"standin: client {name}: rc={p.returncode} refused={refused} active={'Active:' in p.stdout}", flush=True)
sys.exit(int(os.environ["STANDIN_EXIT"]))
"""


def _wait_for(path: Path, text: str, deadline: float, proc: subprocess.Popen[str]) -> bool:
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return True
        if proc.poll() is not None:
            return path.is_file() and text in path.read_text(errors="replace")
        time.sleep(0.2)
    return False


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else f"({path} absent)"


def _start_node(net: TwoNodes, root: Path, role: str, ns: str, bin_dir: Path, cann: Path, script: Path,
                token_file: Path, **extra_env: str) -> tuple[subprocess.Popen[str], Path]:
    """One node's launcher (the command a user runs on it) inside namespace ``ns``, its own log dir and TMPDIR under
    ``root/role``, the real ray and ip; returns the process (its own session) and the file its output goes to."""
    node = root / role
    (node / "tmp").mkdir(parents=True)
    env = stub_env(root, bin_dir, CANN_HOME=str(cann), LOG_DIR=str(node / "logs"), TMPDIR=str(node / "tmp"),
                   **extra_env)
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    env["PATH"] = f"{bin_dir}:{VENV_BIN}:{env['PATH']}"
    cmd = ["ip", "netns", "exec", ns, "bash", str(REPO / "ray_start_npu.sh"), str(script),
           "--nnodes", "2", "--npus-per-node", str(NPUS), "--master-addr", net.head_ip, "--port", str(PORT),
           "--no-preflight", "--timeout", "120", "--temp-dir", str(root / "head" / "ray"),
           "--auth-token-file", str(token_file),
           "--join-retries", "20", "--join-interval", "1", "--watch-interval", "1", "--watch-misses", "2",
           "--ray-arg=--num-cpus=1", "--ray-arg=--object-store-memory=80000000"]
    out = node / "launcher.out"
    with out.open("w") as fh:
        proc = subprocess.Popen(cmd, env=env, text=True, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, out


@pytest.mark.timeout(300)
def test_two_node_launch_in_network_namespaces(two_nodes: TwoNodes):  # noqa: F811 (the fixture)
    ray_bin = VENV_BIN / "ray"
    if not ray_bin.exists():
        pytest.skip(f"no ray in the test venv ({ray_bin})")
    pinned = load_pins().runtime["ray"]
    version = subprocess.run([str(ray_bin), "--version"], capture_output=True, text=True, timeout=60).stdout
    assert f"version {pinned}" in version, f"{ray_bin}: {version.strip()}, the image runs ray {pinned} (pins.toml)"
    net = two_nodes
    # short root: Ray's unix socket paths (under each temp dir) are length-limited
    root = Path(tempfile.mkdtemp(prefix="q3mn", dir="/tmp"))
    procs: dict[str, subprocess.Popen[str]] = {}
    t0 = time.monotonic()
    # until the head exits; the worker then has 60 s to leave (whole test < 300 s). Alone the head exits after ~45 s;
    # in CI, beside two other test parts on 2 cores, it once took over 90 s (the bound this test had then).
    deadline = t0 + 200
    try:
        bin_dir = make_stubs(root, ray=False, ip=False)  # stub npu-smi; real ray and ip
        script = make_standin(root, MULTINODE_STANDIN)
        cann = make_cann(root)
        out: dict[str, Path] = {}
        token_file = root / "shared" / "ray_token"  # storage both nodes see (here: the same host)
        (root / "empty_home").mkdir()
        token = ""
        for role, ns in (("head", net.head_ns), ("worker", net.worker_ns)):
            node = root / role
            procs[role], out[role] = _start_node(net, root, role, ns, bin_dir, cann, script, token_file,
                                                 STANDIN_EXIT=str(EXIT_CODE), RAY_DEDUP_LOGS="0",
                                                 PEER_NS=net.worker_ns, EMPTY_HOME=str(root / "empty_home"))
            if role == "head":  # the worker starts once the head reports the half-assembled cluster and waits
                ok = _wait_for(out["head"], "cluster: 1/2 nodes, 16/32 NPU registered", deadline, procs["head"])
                assert ok, f"head did not report 1/2 nodes:\n{_tail(out['head'])}"
                assert procs["head"].poll() is None, _tail(out["head"])
                assert not list((node / "logs").glob("train_standin_head_*.log")), "training started early"
                token = token_file.read_text().strip()
                assert len(token) == 64 and (token_file.stat().st_mode & 0o077) == 0, "token file not private"

        try:
            head_rc = procs["head"].wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"head still running {time.monotonic() - t0:.0f} s after the start:\n{_tail(out['head'])}\n"
                        f"--- worker\n{_tail(out['worker'])}")
        t_head = time.monotonic()
        head_out = out["head"].read_text()
        train_log = root / "head" / "logs" / f"train_standin_head_{net.head_ip}.log"
        train = train_log.read_text() if train_log.is_file() else ""
        assert head_rc == EXIT_CODE, f"head exit {head_rc}\n{head_out}\n--- training log\n{train}\n--- worker\n" \
                                     f"{_tail(out['worker'])}"
        assert "cluster: 2/2 nodes, 32/32 NPU registered" in head_out
        assert "cluster ready: 2 node(s), 32 NPU" in head_out
        assert f"training exited with code {EXIT_CODE}" in head_out
        assert "stopping ray (started by this launcher)" in head_out
        # the head's launcher returns only after its Ray is gone: nothing is left in its namespace
        assert ns_pids(net.head_ns) == [], f"head's Ray still running:\n{describe(ns_pids(net.head_ns))}"
        ips = sorted([net.head_ip, net.worker_ip])
        assert f"standin: nodes=2 NPU={2 * NPUS:.1f} node_npu=[{NPUS:.1f}, {NPUS:.1f}] ips={ips}" in train, train
        assert f"standin: task_ips={ips}" in train, train
        # token auth: a client on the other node without the cluster's token is refused, one with it is served
        assert "standin: client no_token: rc=1 refused=True active=False" in train, train
        assert "standin: client wrong_token: rc=3 refused=True active=False" in train, train
        assert "standin: client with_token: rc=0 refused=False active=True" in train, train
        assert not token_file.exists(), "the head left the cluster's token file"

        # the worker notices the head's cluster is gone and leaves on its own (bounded)
        worker_rc = procs["worker"].wait(timeout=60)
        t_worker = time.monotonic()
        worker_out = out["worker"].read_text()
        assert worker_rc == 0, f"worker exit {worker_rc}\n{worker_out}"
        assert f"joined {net.head_ip}:{PORT}; staying until the head's cluster goes away" in worker_out
        assert f"head {net.head_ip}:{PORT} is gone (2 failed checks); leaving" in worker_out
        assert "stopping ray (started by this launcher)" in worker_out

        # nothing of ours is left: no process in either namespace, none naming the test's directory
        time.sleep(0.5)
        left = ns_pids(net.head_ns) + ns_pids(net.worker_ns)
        assert left == [], f"processes left in the namespaces:\n{describe(left)}\n--- worker\n{worker_out}"
        left = pids_mentioning(str(root))
        assert left == [], f"processes left that belong to this test:\n{describe(left)}"
        for role in ("head", "worker"):
            assert not list((root / role / "logs").glob(".ray_start_npu_*.pid")), f"{role} pid file left"
        assert list((root / "head" / "ray").glob("session_*")), "the head did not use the given Ray temp dir"
        # both nodes' ray_current_cluster (Ray 2.52: in the head's temp dir) is gone with the cluster
        assert not (root / "head" / "ray" / "ray_current_cluster").exists()
        # the token appears in no log, launcher output or Ray session file of either node
        leaked = [str(f) for f in root.rglob("*") if f.is_file() and not f.is_socket() and token in
                  f.read_bytes().decode(errors="replace")]
        assert leaked == [], f"the cluster's token is written in {leaked}"
        print(f"two-node launch: head exit {head_rc} after {t_head - t0:.1f} s, worker exit {worker_rc} "
              f"{t_worker - t_head:.1f} s later")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session (start_new_session)
                proc.wait(timeout=10)
        kill_mentioning(str(root))
        shutil.rmtree(root, ignore_errors=True)


# ---- a memory-monitor kill on the worker node stops the head's training (ray_actors.py via the GCS) ------------
# The stand-in places one actor on the worker node (max_restarts=0, 64 MiB held) and then waits, as verl's trainer
# waits for a dead rollout actor; the worker's Ray runs with RAY_memory_usage_threshold=0.05 (test_ray_oom.py).
# Both test nodes share one Ray session dir on this host (Ray 2.52 workers take the head's temp dir), whose
# node_ip_address.json holds the last-started node's address: the driver is given the head's own (on a cluster each
# node has its own), else it attaches to the worker's raylet and the GCS, unable to reach it, ends its job. For the
# same reason the worker's watcher here follows the head's raylet.out (the worker's raylet writes raylet.1.out).
WORKER_HOG_STANDIN = r"""
import os, signal, time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False,
         _node_ip_address=os.environ["HEAD_IP"])
worker = [n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == os.environ["WORKER_IP"]][0]

@ray.remote(num_cpus=0, max_restarts=0)
class Hog:
    def __init__(self):
        self.buf = bytearray(64 * 2**20)
    def where(self):
        return ray.util.get_node_ip_address(), os.getpid()

hog = Hog.options(scheduling_strategy=NodeAffinitySchedulingStrategy(worker["NodeID"], soft=False)).remote()
try:
    print("standin: hog on", ray.get(hog.where.remote(), timeout=30), flush=True)
except Exception as exc:  # the actor killed before it answered
    print("standin: hog failed:", type(exc).__name__, flush=True)
def on_term(*_):
    open(os.environ["STANDIN_MARK"], "w").write("SIGTERM")
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)
hold = float(os.environ["STANDIN_HOLD_S"])
time.sleep(hold)
print("standin: done after", hold, "s", flush=True)
"""


def _two_node_run(net: TwoNodes, worker_threshold: str, hold_s: str) -> dict[str, str | int]:
    """Both launchers on WORKER_HOG_STANDIN (token auth on) in a short temp root of their own (Ray's socket paths
    are length-limited), removed afterwards; returns their exit codes and outputs, the training log and what the
    stand-in recorded on SIGTERM. Asserts that no process is left (namespaces, test dir)."""
    root = Path(tempfile.mkdtemp(prefix="q3mo", dir="/tmp"))
    procs: dict[str, subprocess.Popen[str]] = {}
    out: dict[str, Path] = {}
    deadline = time.monotonic() + 150  # until the head exits (a loaded shared host: Ray starts slowly)
    try:
        bin_dir = make_stubs(root, ray=False, ip=False)
        script = make_standin(root, WORKER_HOG_STANDIN)
        cann = make_cann(root)
        for role, ns in (("head", net.head_ns), ("worker", net.worker_ns)):
            procs[role], out[role] = _start_node(
                net, root, role, ns, bin_dir, cann, script, root / "shared" / "ray_token", WORKER_IP=net.worker_ip,
                HEAD_IP=net.head_ip, STANDIN_HOLD_S=hold_s, STANDIN_MARK=str(root / "term.txt"),
                RAY_memory_monitor_refresh_ms="100",
                RAY_memory_usage_threshold=worker_threshold if role == "worker" else "0.98")
            if role == "head":  # as above: the worker starts once the head's Ray is up (their shared session dir)
                ok = _wait_for(out["head"], "cluster: 1/2 nodes", deadline, procs["head"])
                assert ok, f"head did not report 1/2 nodes:\n{_tail(out['head'])}"
        try:
            head_rc = procs["head"].wait(timeout=max(1.0, deadline - time.monotonic()))
            worker_rc = procs["worker"].wait(timeout=60)  # it leaves once the head's cluster is gone
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{exc}\n--- head\n{_tail(out['head'])}\n--- worker\n{_tail(out['worker'])}") from exc
        time.sleep(0.5)
        left = ns_pids(net.head_ns) + ns_pids(net.worker_ns) + pids_mentioning(str(root))
        assert left == [], f"processes left:\n{describe(left)}\n--- worker\n{_tail(out['worker'])}"
        train_log = root / "head" / "logs" / f"train_standin_head_{net.head_ip}.log"
        mark = root / "term.txt"
        return {"head_rc": head_rc, "worker_rc": worker_rc, "head": out["head"].read_text(),
                "worker": out["worker"].read_text(), "train": train_log.read_text() if train_log.is_file() else "",
                "term": mark.read_text() if mark.is_file() else ""}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        kill_mentioning(str(root))
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(240)
def test_memory_kill_on_the_worker_stops_the_heads_training(two_nodes: TwoNodes):  # noqa: F811 (the fixture)
    """The worker's memory monitor kills the stand-in's actor there; the head's watcher reads it from the GCS,
    prints one line naming the worker node and stops the training (exit 1); the worker then leaves by itself."""
    r = _two_node_run(two_nodes, worker_threshold="0.05", hold_s="600")
    dump = "\n".join(f"--- {k}\n{v}" for k, v in r.items())
    errors = [ln for ln in str(r["head"]).splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, dump
    m = re.fullmatch(rf"error: Ray killed Hog.__init__ \(pid (\d+)\) on node {re.escape(two_nodes.worker_ip)} to "
                     r"reclaim memory: node memory [0-9.]+/[0-9.]+ GB above Ray's threshold 0.05; verl does not "
                     r"recover from this: stopping the training", errors[0])
    assert m, dump
    assert r["head_rc"] == 1 and r["term"] == "SIGTERM" and "standin: done" not in str(r["train"]), dump
    assert r["worker_rc"] == 0, dump
    print(f"worker-node memory kill: head exit {r['head_rc']}; {errors[0]}")


@pytest.mark.timeout(240)
def test_no_kill_on_the_worker_runs_to_the_end(two_nodes: TwoNodes):  # noqa: F811 (the fixture)
    """Positive control: the same two nodes with the worker at threshold 0.98: the actor lives, the run ends 0."""
    r = _two_node_run(two_nodes, worker_threshold="0.98", hold_s="3")
    dump = "\n".join(f"--- {k}\n{v}" for k, v in r.items())
    assert r["head_rc"] == 0 and r["worker_rc"] == 0, dump
    assert "error:" not in str(r["head"]) + str(r["worker"]) and r["term"] == "", dump
    assert f"standin: hog on ('{two_nodes.worker_ip}'," in str(r["train"]), dump
    assert "standin: done after 3.0 s" in str(r["train"]), dump
