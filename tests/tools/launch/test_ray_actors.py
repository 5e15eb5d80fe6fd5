"""Dead Ray actors read from the GCS (qwen3_rl/tools/launch/ray_actors.py): :func:`classify` on death causes as a real
Ray 2.52 recorded them (GCS actor table rows of a real run: os._exit / SIGKILL in an actor, ``exit_actor``,
``ray.kill``, handle dropped, owner ended, memory-monitor kill), and ray_start_npu.sh with the real Ray whose
stand-in training's actor crashes (``os._exit`` / SIGKILL): the head's watcher stops the training with one line
naming the class, pid, node and Ray's death cause; actors ended on purpose do not stop it (positive control)."""

from __future__ import annotations

import re

import pytest
from test_ray_oom import _launch

from qwen3_rl.tools.launch.ray_actors import ActorLoss, DeadActor, classify
from qwen3_rl.tools.launch.ray_oom import OomKill

# error messages of actor_died_error_context as Ray 2.52 wrote them in the GCS actor table (real run, this host)
CRASHED = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
    "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the "
    "worker crashed unexpectedly due to SIGSEGV or another unexpected error."
)
EXITED = (
    "The actor is dead because its worker process has died. Worker exit type: INTENDED_USER_EXIT Worker exit "
    "detail: Worker exits by an user request. Worker exits with an exit code 0. exit_actor() is called."
)
OWNER_GONE = (
    "The actor is dead because its owner has died. Owner Id: 01000000ffff Owner Ip address: 127.0.0.1 Owner "
    "worker exit type: INTENDED_USER_EXIT Worker exit detail: Owner's worker process has crashed."
)
OOM = (
    "Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.2, ID: 1f33) where the "
    "lease (lease ID: 0000a1, name=Hog.__init__, pid=29195, memory used=0.11GB) was running was 2.36GB / 23.54GB "
    "(0.100202), which exceeds the memory usage threshold of 0.05. Ray killed this worker (ID: d2f5) because it "
    "was the most recently scheduled task; to see more information"
)


def _row(context: str, reason: str = "", message: str = "", name: str = "rollout_0") -> DeadActor:
    return DeadActor("ab12", "AgentLoopWorkerTQ", name, 4242, "10.0.0.2", context, reason, message)


def test_crash_is_a_loss_naming_class_pid_node_and_cause():
    loss = classify(_row("actor_died_error_context", "WORKER_DIED", CRASHED))
    assert isinstance(loss, ActorLoss) and loss.lost and loss.pid == 4242
    assert loss.message() == (
        "Ray actor AgentLoopWorkerTQ 'rollout_0' (pid 4242) on node 10.0.0.2 died: WORKER_DIED (SYSTEM_ERROR: "
        "Worker unexpectedly exits with a connection error code 2. End of file.); verl does not recover from this: "
        "stopping the training"
    )
    node = classify(_row("actor_died_error_context", "NODE_DIED", "Its node has died.\nx"))
    assert isinstance(node, ActorLoss)
    assert "died: NODE_DIED (Its node has died. x); verl" in node.message()
    unnamed = classify(_row("actor_died_error_context", "WORKER_DIED", CRASHED, name=""))
    assert unnamed is not None
    assert unnamed.message().startswith("Ray actor AgentLoopWorkerTQ (pid 4242) on node 10.0.0.2 died")


def test_intended_ends_are_not_losses():
    """Positive control of the classification: the same WORKER_DIED reason with an intended exit, ray.kill, a
    dropped handle, an ended owner, an exception in __init__ (raised to the caller) are not losses."""
    rows = [
        _row("actor_died_error_context", "WORKER_DIED", EXITED),
        _row(
            "actor_died_error_context", "RAY_KILL", "The actor is dead because it was killed by `ray.kill`."
        ),
        _row("actor_died_error_context", "OUT_OF_SCOPE", "all references to the actor were removed."),
        _row("actor_died_error_context", "REF_DELETED", ""),
        _row("actor_died_error_context", "OWNER_DIED", OWNER_GONE),
        _row("creation_task_failure_context"),
        _row(""),
    ]
    assert [classify(r) for r in rows] == [None] * len(rows)


def test_oom_death_is_a_memory_kill_on_its_node():
    kill = classify(_row("oom_context", message=OOM))
    assert kill == OomKill(
        pid=4242, name="Hog.__init__", used_gb=2.36, total_gb=23.54, threshold=0.05, node="10.0.0.2"
    )
    assert kill.message(head=True) == (
        "Ray killed Hog.__init__ (pid 4242) on node 10.0.0.2 to reclaim memory: node memory 2.36/23.54 GB above "
        "Ray's threshold 0.05; verl does not recover from this: stopping the training"
    )
    bare = classify(_row("oom_context", message="Task was killed due to the node running low on memory."))
    assert bare == OomKill(pid=4242, name="AgentLoopWorkerTQ", node="10.0.0.2")


# ---- the launcher with the real Ray: a crashed actor anywhere stops the training ------------------------------
CRASH_STANDIN = r"""
import os, signal, time
import ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=0, max_restarts=0)
class RolloutWorker:
    def pid(self):
        return os.getpid()
    def crash(self):
        os._exit(3)
    def quit(self):
        ray.actor.exit_actor()

mode = os.environ["STANDIN_MODE"]
w = RolloutWorker.options(name="rollout_0").remote()
pid = ray.get(w.pid.remote(), timeout=30)
print("standin: actor pid", pid, flush=True)
if mode == "os_exit":
    w.crash.remote()
elif mode == "sigkill":
    os.kill(pid, signal.SIGKILL)  # the actor's process (one host here)
else:  # intended ends: ray.kill, exit_actor, a dropped handle
    ray.kill(w)
    q = RolloutWorker.remote()
    ray.get(q.pid.remote(), timeout=30)
    try:
        ray.get(q.quit.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        pass
    s = RolloutWorker.remote()
    ray.get(s.pid.remote(), timeout=30)
    del s
def on_term(*_):
    open(os.environ["STANDIN_MARK"], "w").write("SIGTERM")
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)
hold = float(os.environ["STANDIN_HOLD_S"])
time.sleep(hold)  # like verl's trainer waiting for the dead actor's rollouts (here bounded)
print("standin: done after", hold, "s", flush=True)
"""


@pytest.mark.parametrize("mode", ["os_exit", "sigkill"])
def test_real_ray_actor_crash_stops_the_training(mode: str):
    p, text, term, took = _launch("0.98", "600", CRASH_STANDIN, STANDIN_MODE=mode)
    out = f"{p.stdout}\n{p.stderr}\n{text}"
    pid = re.search(r"standin: actor pid (\d+)", text)
    assert pid, out
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: Ray actor RolloutWorker 'rollout_0' (pid {pid.group(1)}) on node 127.0.0.1 died: WORKER_DIED "
        "(SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2. End of file.); verl does not "
        "recover from this: stopping the training"
    ], out
    assert p.returncode == 1 and term == "SIGTERM" and "standin: done" not in text, out
    print(f"{mode} run: launcher exited {p.returncode} after {took:.1f} s; {errors[0]}")


def test_real_ray_intended_actor_ends_do_not_stop_the_training():
    """Positive control: ray.kill, exit_actor and a dropped handle end three actors; the run goes on to its end."""
    p, text, term, took = _launch("0.98", "4", CRASH_STANDIN, STANDIN_MODE="intended")
    out = f"{p.stdout}\n{p.stderr}\n{text}"
    assert p.returncode == 0, out
    assert "error:" not in p.stderr and "Ray actor" not in out and term == "", out
    assert "standin: actor pid" in text and "standin: done after 4.0 s" in text, out
    print(f"control run: launcher exited 0 after {took:.1f} s")
