"""Ray memory-monitor kills (qwen3_rl/tools/launch/ray_oom.py): the raylet.out parser on lines shaped as Ray 2.52's
raylet writes them, the follower, and ray_start_npu.sh with the real Ray whose memory monitor kills the stand-in
training's actor (RAY_memory_usage_threshold=0.05): the launcher says so in one line and stops the training
non-zero; the same run at a normal threshold ends 0 without that line (positive control)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from test_launch import REPO, VENV_BIN, _netns_prefix, make_cann, make_standin, make_stubs, stub_env

from qwen3_rl.tools.launch.ray_oom import OomKill, OomParser, follow_kills, parse_kills, raylet_session_dir

from helpers.netns import kill_mentioning, pids_mentioning

# The records of one kill as raylet.out holds them (ids, addresses and the process table made up; the wording,
# field order and units are Ray 2.52's: memory_monitor.cc "above threshold", node_manager.cc "Killing worker",
# its "Memory on the node" paragraph, then "Worker evicted").
T = "[2026-01-02 03:04:05,678 I 100 100] (raylet) "
ACTOR_KILL = [
    T
    + "memory_monitor.cc:88: Node memory usage above threshold, used: 24036405248, threshold_bytes: 24012677120, "
    "total bytes: 25276502016, threshold fraction: 0.95",
    T + "memory_monitor.cc:298:  file not found: /proc/1/smaps_rollup",
    T
    + "node_manager.cc:3116: Killing worker with task Type=ACTOR_CREATION_TASK, Language=PYTHON, Resources: {}, "
    "function_descriptor={type=PythonFunctionDescriptor, module_name=verl.trainer.ppo.v1.agent_loop_tq, "
    "class_name=AgentLoopWorkerTQ, function_name=__init__, function_hash=0123abcd}, lease_id=0900aa, "
    "task_name=agent_loop_worker_0_1a2b3c4d:AgentLoopWorkerTQ.__init__, job_id=01000000, depth=2, "
    "attempt_number=0, actor_creation_task_spec={actor_id=ad46fd, max_restarts=0, is_detached=0}, "
    "runtime_env_hash=-21, eager_install=1, setup_timeout_seconds=600",
    "",
    "Memory on the node (IP: 192.0.2.7, ID: 5211ae) where the lease (lease ID: 0900aa, "
    "name=agent_loop_worker_0_1a2b3c4d:AgentLoopWorkerTQ.__init__, pid=4242, memory used=0.67GB) was running was "
    "22.36GB / 23.54GB (0.950015), which exceeds the memory usage threshold of 0.95. Ray killed this worker "
    "(ID: bb94e3) because it was the most recently scheduled task; to see more information about memory usage on "
    "this node, use `ray logs raylet.out -ip 192.0.2.7`. Top 10 memory users:",
    "PID\tMEM(GB)\tCOMMAND",
    "4100\t1.69\tVLLM::Worker",
    "",
    "Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/en/latest/ray-core/"
    "scheduling/ray-oom-prevention.html.",
    T + "node_manager.cc:1437: Disconnecting worker, graceful=false, disconnect_type=4, worker_id=bb94e3",
    T + "node_manager.cc:3073: Worker evicted and process killed to reclaim memory. worker pid: 4242 "
    "worker_id=bb94e3 lease_id=0900aa",
]
# a normal task with retries left (Ray runs it again) and no task_name: named from its function descriptor
TASK_KILL = [
    T
    + "node_manager.cc:3116: Killing worker with task Type=NORMAL_TASK, Language=PYTHON, Resources: {CPU: 1, }, "
    "function_descriptor={type=PythonFunctionDescriptor, module_name=verl.single_controller.ray.base, class_name=, "
    "function_name=get_master_addr_port, function_hash=91df}, lease_id=0100f6, task_name=, job_id=01000000, "
    "depth=2, attempt_number=0, normal_task_spec={max_retries=3}, runtime_env_hash=-21",
    "Memory on the node (IP: 192.0.2.7, ID: 5211ae) where the lease (actor ID: NIL_IDlease ID: NIL_ID, "
    "name=get_master_addr_port, pid=17571, memory used=0.58GB) was running was 22.39GB / 23.54GB (0.950939), which "
    "exceeds the memory usage threshold of 0.95. Ray killed this worker (ID: 2e1fab) because it was the most "
    "recently scheduled task",
    T
    + "node_manager.cc:3073: Worker evicted and process killed to reclaim memory. worker pid: 17571 worker_id=2e1fab",
]

# a pooled worker that ran no task (Ray 2.52 kills these too; seen first in the real-Ray run below)
IDLE_KILL = [
    T + "node_manager.cc:3116: Killing worker with task Type=NORMAL_TASK, Language=PYTHON, Resources: {}, "
    "function_descriptor={type=EmptyFunctionDescriptor}, lease_id=NIL_ID, task_name=, job_id=NIL_ID, depth=0, "
    "attempt_number=0, normal_task_spec={max_retries=0}",
    "Memory on the node (IP: 127.0.0.1, ID: 8574) where the lease (actor ID: NIL_IDlease ID: NIL_ID, name=, "
    "pid=777, memory used=0.04GB) was running was 14.64GB / 23.54GB (0.621719), which exceeds the memory usage "
    "threshold of 0.05. Ray killed this worker (ID: 43e6) because it was the most recently scheduled task",
    T
    + "node_manager.cc:3073: Worker evicted and process killed to reclaim memory. worker pid: 777 lease_id=NIL_ID",
]


def test_parse_actor_kill_names_the_actor_and_memory():
    (kill,) = parse_kills(ACTOR_KILL)
    assert kill == OomKill(
        pid=4242,
        name="agent_loop_worker_0_1a2b3c4d:AgentLoopWorkerTQ.__init__",
        used_gb=22.36,
        total_gb=23.54,
        threshold=0.95,
        retried=False,
    )
    msg = kill.message(head=True)
    assert msg == (
        "Ray killed agent_loop_worker_0_1a2b3c4d:AgentLoopWorkerTQ.__init__ (pid 4242) to reclaim memory: "
        "node memory 22.36/23.54 GB above Ray's threshold 0.95; verl does not recover from this: "
        "stopping the training"
    )
    assert "\n" not in msg


def test_parse_retried_task_and_descriptor_name_and_order():
    kills = parse_kills([*TASK_KILL, "unrelated line", *ACTOR_KILL])
    assert [k.pid for k in kills] == [17571, 4242]
    assert kills[0].retried and not kills[1].retried
    # task_name is empty: module.function from the function descriptor
    assert kills[0].name == "verl.single_controller.ray.base.get_master_addr_port"
    assert kills[0].message(head=True).endswith("; Ray retries it")
    # no "Killing worker" line: the paragraph's name=; no paragraph either: "?" and no figures
    (k,) = parse_kills(TASK_KILL[1:])
    assert (k.name, k.used_gb, k.total_gb, k.threshold) == ("get_master_addr_port", 22.39, 23.54, 0.95)
    (k,) = parse_kills(TASK_KILL[2:])
    assert k == OomKill(pid=17571, name="?")
    assert "(pid 17571) to reclaim memory: node memory above Ray's threshold;" in k.message(head=True)


def test_parse_idle_worker_kill_is_not_a_loss():
    kills = parse_kills([*IDLE_KILL, *ACTOR_KILL])
    assert [(k.pid, k.idle, k.lost) for k in kills] == [(777, True, False), (4242, False, True)]
    assert kills[0].message(head=True) == (
        "Ray killed an idle worker (pid 777) to reclaim memory: node memory "
        "14.64/23.54 GB above Ray's threshold 0.05; it ran no task, nothing lost"
    )
    assert not parse_kills(TASK_KILL)[0].lost  # max_retries=3


def test_parse_no_kill_in_an_ordinary_log():
    """The memory-monitor start line and the threshold line alone are not kills."""
    lines = [
        T + "memory_monitor.cc:47: MemoryMonitor initialized with usage threshold at 24012677120 bytes (0.95 "
        "system memory), total system memory bytes: 25276502016",
        ACTOR_KILL[0],
        ACTOR_KILL[2],
    ]
    assert parse_kills(lines) == []
    p = OomParser()
    assert [p.feed(x) for x in lines] == [None, None, None]


def test_follow_kills_reads_appended_lines_and_stops(tmp_path: Path):
    log = tmp_path / "raylet.out"  # does not exist yet: waited for
    ticks: list[float] = []
    chunks = iter(["\n".join(TASK_KILL[:2]) + "\n", TASK_KILL[2][:40], TASK_KILL[2][40:] + "\n", ""])

    def sleep(dt: float) -> None:
        ticks.append(dt)
        with log.open("a") as f:
            f.write(next(chunks, ""))

    alive = iter([True, True, True, True, True, False])
    kills = list(follow_kills(log, lambda: next(alive), interval_s=0.5, sleep=sleep))
    assert [k.pid for k in kills] == [17571]  # the line split across two reads counts once
    assert ticks == [0.5] * 5


def test_follow_kills_adds_what_also_returns_except_at_the_last_read(tmp_path: Path):
    """The head's GCS losses (``also``) come after each read of the log while the job runs; not once it ended."""
    log = tmp_path / "raylet.out"
    log.write_text("\n".join(ACTOR_KILL) + "\n")
    calls: list[int] = []

    def also() -> list[OomKill]:
        calls.append(len(calls) + 1)
        return [OomKill(pid=100 + len(calls), name="gcs")]

    alive = iter([True, True, False])
    got = list(follow_kills(log, lambda: next(alive), 0.1, sleep=lambda _: None, also=also))
    assert [k.pid for k in got] == [4242, 101, 102] and calls == [1, 2]


def test_raylet_session_dir_by_process_group(tmp_path: Path):
    proc = tmp_path / "proc"
    for pid, pgid, argv in [
        (10, 7, [b"/x/ray/core/src/ray/raylet/raylet", b"--session_dir=/r/session_A"]),
        (11, 9, [b"/x/raylet", b"--session_dir=/r/session_B"]),
        (12, 7, [b"/usr/bin/python", b"--session_dir=/r/session_C"]),
    ]:
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (ray) S 1 {pgid} {pgid} 0 -1")
        (proc / str(pid) / "cmdline").write_bytes(b"\0".join(argv) + b"\0")
    assert raylet_session_dir(7, str(proc)) == Path("/r/session_A")
    assert raylet_session_dir(9, str(proc)) == Path("/r/session_B")
    assert raylet_session_dir(8, str(proc)) is None


# ---- the launcher with the real Ray's memory monitor ----------------------------------------------------------
HOG_STANDIN = r"""
import os, signal, time
import ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=0, resources={"NPU": 1}, max_restarts=0)
class Hog:
    def __init__(self):
        self.buf = bytearray(64 * 2**20)  # 64 MiB held while the actor lives
    def ping(self):
        return len(self.buf)

hog = Hog.remote()
try:
    print("standin: ping", ray.get(hog.ping.remote(), timeout=20), flush=True)
except Exception as exc:  # the actor killed before it answered
    print("standin: ping failed:", type(exc).__name__, flush=True)
def on_term(*_):  # recorded in a file: tee, in the same process group, is stopped too
    open(os.environ["STANDIN_MARK"], "w").write("SIGTERM")
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)
hold = float(os.environ["STANDIN_HOLD_S"])
time.sleep(hold)  # like verl's trainer after a rollout actor died: it waits (here bounded)
print("standin: done after", hold, "s", flush=True)
"""


def _launch(
    threshold: str, hold_s: str, standin: str = HOG_STANDIN, **extra_env: str
) -> tuple[subprocess.CompletedProcess[str], str, str, float]:
    """ray_start_npu.sh with the real Ray in a loopback-only network namespace, running ``standin`` (HOG_STANDIN;
    test_ray_actors.py's too); returns the launcher's process, the training log, what the stand-in recorded on
    SIGTERM ("" = none) and the seconds."""
    prefix = _netns_prefix()
    assert prefix is not None, (
        "cannot create a network namespace here (unshare --net); the real-Ray runs need one"
    )
    assert (VENV_BIN / "ray").exists(), f"no ray in the test venv ({VENV_BIN})"
    root = Path(
        tempfile.mkdtemp(prefix="q3oom", dir="/tmp")
    )  # short: Ray's unix socket paths are length-limited
    try:
        bin_dir = make_stubs(root, ray=False, npu_smi=False, ip=False)
        script = make_standin(root, standin)
        env = stub_env(
            root,
            bin_dir,
            CANN_HOME=str(make_cann(root)),
            RAY_memory_usage_threshold=threshold,
            RAY_memory_monitor_refresh_ms="100",
            STANDIN_HOLD_S=hold_s,
            STANDIN_MARK=str(root / "term.txt"),
            RAY_AUTH_MODE="disabled",
            **extra_env,
        )
        env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
        cmd = (
            f"ip link set lo up && exec bash {REPO}/ray_start_npu.sh {script} --no-preflight --timeout 60 "
            f"--npus-per-node 1 --ray-arg=--num-cpus=1 --ray-arg=--object-store-memory=100000000 "
            f"--log-dir {root}/logs"
        )
        t0 = time.time()
        p = subprocess.run(
            [*prefix, "bash", "-c", cmd], env=env, text=True, capture_output=True, timeout=90, cwd=REPO
        )
        took = time.time() - t0
        log = root / "logs" / "train_standin_head_127.0.0.1.log"
        text = log.read_text() if log.is_file() else ""
        mark = root / "term.txt"
        term = mark.read_text() if mark.is_file() else ""
        time.sleep(0.5)
        assert pids_mentioning(str(root / "ray")) == [], "Ray processes left behind"
        return p, text, term, took
    finally:
        kill_mentioning(str(root / "ray"))
        shutil.rmtree(root, ignore_errors=True)


def test_real_ray_memory_kill_stops_the_training():
    """Ray's memory monitor at threshold 0.05 kills the stand-in's Hog actor (max_restarts=0); the training then
    waits (600 s, as verl does); the launcher reports the kill in one line and stops it with exit 1."""
    p, text, term, took = _launch("0.05", "600")
    out = f"{p.stdout}\n{p.stderr}\n{text}"
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: Ray killed")]
    assert len(errors) == 1, out
    assert (
        "Hog.__init__ (pid " in errors[0] and "above Ray's threshold 0.05; verl does not recover" in errors[0]
    ), out
    assert p.returncode == 1, out
    assert term == "SIGTERM", out  # the launcher stopped the waiting training
    assert "standin: done" not in text, out
    print(f"memory-kill run: launcher exited {p.returncode} after {took:.1f} s; {errors[0]}")


def test_real_ray_normal_threshold_runs_to_the_end():
    """Positive control: the same run at threshold 0.98 (the default 0.95 would depend on what else this shared
    host holds) ends 0, with no memory-kill line."""
    p, text, term, took = _launch("0.98", "3")
    out = f"{p.stdout}\n{p.stderr}\n{text}"
    assert p.returncode == 0, out
    assert "Ray killed" not in out and term == "", out
    assert "standin: ping 67108864" in text and "standin: done after 3.0 s" in text, out
    print(f"control run: launcher exited 0 after {took:.1f} s")
