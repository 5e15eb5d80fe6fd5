"""The tiny CPU runs as a user starts them, for the tests of both pin sets: ``bash ray_start_npu.sh
internal/train_*_tiny_cpu.sh --device cpu`` with a workspace, a probe directory and a checkpoint directory, and what
they read back from a run (the launcher's output, the probe records, ``python -m qwen3_rl report --json``).

Used by ``tests/engine/test_e2e_training.py`` (seed set, and the tests that import from it) and
``tests/engine_verl091/test_verl091_tiny_learning.py`` (current set: ``PIN_SET=current`` in ``env``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.ports import free_port  # noqa: F401  (the launch tests import it from here)

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 1500  # one launcher run, start to exit
LEARNING_MARGIN = 0.10  # validation accuracy after training >= before + this


def actor_death_watch(pid: int) -> re.Pattern[str]:
    """The line of the launcher's actor-death watch (``qwen3_rl.tools.launch.ray_actors``) naming the Ray actor of
    process ``pid`` as dead: ``error: Ray actor <label> (pid P) on node N died: <cause>; ...``."""
    return re.compile(rf"error: Ray actor .* \(pid {pid}\) on node \S+ died: ")


@dataclass
class Run:
    rc: int
    log: str
    events: list[dict] = field(default_factory=list)
    probe: Path = Path()
    ckpt: Path = Path()
    seconds: float = 0.0

    def of(self, event: str) -> list[dict]:
        return [e for e in self.events if e["event"] == event]


def engine_venv() -> Path:
    """The environment these tests run in (the engine venv): the launcher's CPU profile is pointed at it."""
    return Path(sys.executable).parent.parent


def _events(probe: Path) -> list[dict]:
    out = []
    for f in sorted(probe.glob("events-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["time"])


def launch_env(ws: Path, run_dir: Path, ckpt: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a tiny CPU run (also the Slurm test's): the workspace ``cpu-setup`` made and the engine
    environment, which the launcher's CPU profile turns into PATH / PYTHONPATH itself; the probe, checkpoint and
    rollout-dump directories under ``run_dir``."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("RAY_", "VLLM_", "QWEN3_RL_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    full.update({
        "QWEN3_RL_WORKSPACE": str(ws), "QWEN3_RL_ENGINE_VENV": str(engine_venv()),
        "QWEN3_RL_E2E_PROBE_DIR": str(run_dir / "probe"),
        "CKPT_DIR": str(ckpt), "ROLLOUT_DATA_DIR": str(run_dir / "rollout_data"),
    })
    full.update(env or {})
    return full


def launch(ws: Path, script: str, run_dir: Path, env: dict[str, str] | None = None, ckpt: Path | None = None,
           on_event=None, timeout_s: float = RUN_TIMEOUT_S, args: list[str] | None = None) -> Run:
    """``bash ray_start_npu.sh <script> --device cpu [-- ARGS]`` with ``QWEN3_RL_WORKSPACE=ws``: the launcher's CPU
    profile finds the engine environment and the patched trees itself (``python -m qwen3_rl cpu-env``); ``args``:
    extra Hydra overrides for the train script.

    ``on_event(events, proc)`` is called every second while the run is alive (the fault test kills from it).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / "probe"
    ckpt = ckpt or run_dir / "ckpt"
    full = launch_env(ws, run_dir, ckpt, env)
    ray_tmp = tempfile.mkdtemp(prefix="q3r", dir="/tmp")  # Ray's socket paths must stay under 107 characters
    cmd = ["bash", str(REPO / "ray_start_npu.sh"), str(REPO / script), "--device", "cpu",
           "--port", str(free_port()), "--temp-dir", ray_tmp, "--log-dir", str(run_dir / "logs"),
           "--timeout", "180", *(["--", *args] if args else [])]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out_file = run_dir / "launcher.out"
    try:
        with open(out_file, "w") as sink:
            import threading

            pump = threading.Thread(target=lambda: shutil.copyfileobj(proc.stdout, sink), daemon=True)
            pump.start()
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    raise AssertionError(f"{script}: no exit within {timeout_s} s (see {out_file})")
                if on_event is not None:
                    on_event(_events(probe), proc)
                time.sleep(1.0)
            pump.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode != 0:
            _keep_ray_logs(Path(ray_tmp), run_dir / "ray_logs", out_file)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    log = out_file.read_text(errors="replace")
    return Run(proc.returncode, log, _events(probe), probe, ckpt, time.monotonic() - t0)


#: Ray's own logs of the head (its session directory) that tell why a node or the cluster died
RAY_DIAG_LOGS = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err")


def _keep_ray_logs(ray_tmp: Path, keep: Path, out_file: Path, n: int = 12) -> None:
    """A failed run: Ray's own logs (``RAY_DIAG_LOGS`` of every session under ``ray_tmp``) are copied to ``keep``
    and their last ``n`` lines appended to the launcher's output, with the memory then available (a node Ray marked
    dead is told apart from a raylet that crashed only there)."""
    import psutil  # vLLM's and Ray's dependency: in both engine environments

    lines = [f"-- a failed run: Ray's own logs (kept in {keep}); memory available now "
             f"{psutil.virtual_memory().available / 2**30:.1f} GiB --"]
    for session in sorted(ray_tmp.glob("session_2*")):
        for name in RAY_DIAG_LOGS:
            f = session / "logs" / name
            if not f.is_file():
                continue
            dest = keep / session.name / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
            tail = f.read_text(errors="replace").splitlines()[-n:]
            lines += [f"-- {session.name}/logs/{name}: last {len(tail)} lines --", *(t[:400] for t in tail)]
    with open(out_file, "a") as sink:
        sink.write("\n".join(lines) + "\n")


_ERROR_LINE = re.compile(r"Traceback|Error|Exception|error:|Killed|FAILED")


def _tail(run: Run, n: int = 80) -> str:
    """The run's last 30 error lines first (each cut to 400 characters; a failure message may be shortened from the
    middle, so the cause must come before the metrics lines), then its last ``n`` lines."""
    lines = run.log.splitlines()
    errors = [line[:400] for line in lines if _ERROR_LINE.search(line)][-30:]
    return "\n".join([f"rc={run.rc}; {len(errors)} error line(s):", *errors, f"-- last {n} lines --", *lines[-n:]])


def report(run: Run) -> dict:
    """``python -m qwen3_rl report LOG --json`` of the run's training log."""
    log_files = sorted((run.probe.parent / "logs").glob("train_*_head_*.log"))
    assert log_files, f"no training log under {run.probe.parent / 'logs'}"
    rep = subprocess.run([sys.executable, "-m", "qwen3_rl", "report", str(log_files[0]), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    return json.loads(rep.stdout)


def check_step_log_and_ckpt(run: Run, steps: list[int]) -> dict:
    """``qwen3_rl report --json`` finds exactly ``steps`` trained (a step record with ``timing_s/step``; a
    validation before training is step 0); the checkpoints of the last two exist (verl keeps two)."""
    doc = report(run)
    got = sorted(int(s) for s, m in doc["steps"].items() if "timing_s/step" in m)
    assert got == steps, f"report found steps {got}, expected {steps}"
    for s in steps[-2:]:
        assert (run.ckpt / f"global_step_{s}" / "actor").is_dir(), f"no checkpoint global_step_{s}/actor"
    assert (run.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps[-1])
    return doc


def val_accuracy(doc: dict, step: int) -> float:
    """verl's ``val-core/<data source>/acc/mean@1`` at ``step`` (0 = before training)."""
    m = doc["steps"].get(str(step), {})
    keys = [k for k in m if k.startswith("val-core/") and "/acc/mean@" in k]
    assert len(keys) == 1, f"step {step}: val-core accuracy keys {keys} (all val keys: {[k for k in m if 'val' in k]})"
    return float(m[keys[0]])
