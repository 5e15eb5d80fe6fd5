"""``python -m qwen3_rl launch <step>``: the logic behind ``ray_start_npu.sh``.

The shell script stays a thin sequence of steps; each step here reads the plan the ``resolve`` step
wrote (``--plan-dir``) and prints one-line ``error: ...`` messages on failure.

Steps: ``resolve`` (options -> plan files), ``show`` (dry-run printout), ``wait-started`` (the local
``ray start --block`` is up), ``wait-cluster`` (head: N nodes × NPUs registered), ``wait-head``
(worker: the head's GCS port answers), ``watch-head`` (worker: stay until the head goes away),
``watch-oom`` (report Ray's memory-monitor kills on this node and, on the head, any actor of the cluster that died
for good; head: exit 1 so the training is stopped; ray_oom.py, ray_actors.py),
``cpu-map`` / ``cpu-bind`` (CPU binding), ``stop`` (stop what this launcher started, by PID), ``auth`` (the
cluster's Ray token: the head writes it, a worker waits for it), ``address-file save|restore`` (leave Ray's
``ray_current_cluster`` as it was found), ``slurm-plan`` / ``slurm-task`` (launch_slurm.sbatch), ``k8s`` (a
Volcano Job or MindCluster AscendJob for a train script).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from qwen3_rl.tools.launch.cpu_binding import (
    BindingError,
    BindingMap,
    compute_binding,
    pid_alive,
    read_numa_nodes,
    run_binder,
)
from qwen3_rl.tools.launch.netinfo import tcp_reachable
from qwen3_rl.tools.launch.npu_smi import NpuSmiError, run_npu_smi
from qwen3_rl.tools.launch.options import LaunchError, LaunchPlan, parse_options, usage
from qwen3_rl.tools.launch.ray_actors import ActorLoss, DeadActor, classify, gcs_dead_actors
from qwen3_rl.tools.launch.ray_node import make_token, restore_address_file, save_address_file, wait_token
from qwen3_rl.tools.launch.ray_oom import OomKill, follow_kills, raylet_session_dir
from qwen3_rl.tools.launch.ray_status import ClusterError, query_status, wait_for_cluster
from qwen3_rl.tools.launch.train_script import TrainScriptError, parse_train_script

RAY_STARTED_MARK = "Ray runtime started"


def _die(msg: str, code: int = 1) -> int:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return code


def _log(msg: str) -> None:
    print(f"[ray_start_npu] {msg}", flush=True)


def _write_nul(path: Path, items: list[str]) -> None:
    path.write_bytes(b"".join(s.encode() + b"\0" for s in items))


def _load(plan_dir: str) -> LaunchPlan:
    return LaunchPlan.from_json((Path(plan_dir) / "plan.json").read_text())


def train_env(plan: LaunchPlan, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment the train script sees (besides what env/npu scripts export)."""
    env = dict(os.environ if base is None else base)
    env.update({"NNODES": str(plan.nnodes), "NPUS_PER_NODE": str(plan.npus_per_node),
                "RAY_ADDRESS": plan.ray_address, "SOCKET_IFNAME": plan.ifname})
    return env


# --- steps ---------------------------------------------------------------------------------------
def cmd_resolve(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--plan-dir":
        return _die("usage: launch resolve --plan-dir DIR [launcher args...]", 2)
    plan_dir, rest = Path(argv[1]), argv[2:]
    plan_dir.mkdir(parents=True, exist_ok=True)
    try:
        plan = parse_options(rest)
    except LaunchError as exc:
        return _die(str(exc), 2)
    if plan is None:
        print(usage())
        (plan_dir / "vars").write_bytes(b"MODE=help\0")
        return 0
    if plan.mode != "stop":
        try:
            parse_train_script(plan.train_script, env=train_env(plan), env_file=plan.env_script or None,
                               extra_args=plan.train_args)
        except TrainScriptError as exc:
            return _die(str(exc), 2)
    (plan_dir / "plan.json").write_text(plan.to_json())
    (plan_dir / "env.before.json").write_text(json.dumps(dict(os.environ)))
    _write_nul(plan_dir / "vars", [f"{k}={v}" for k, v in plan.shell_vars().items()])
    _write_nul(plan_dir / "ray_start.argv", plan.ray_start)
    _write_nul(plan_dir / "train.argv", ["bash", plan.train_script, *plan.train_args])
    return 0


def _q(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def format_plan(plan: LaunchPlan, env_now: dict[str, str], env_before: dict[str, str],
                preflight_lines: list[str], cpu_map: str | None) -> str:
    """The dry-run printout: every step with its command, the environment, preflight findings."""
    lines = ["== ray_start_npu.sh plan (dry run: nothing is started) =="]
    where = "this node holds the master address" if plan.role == "head" else "joins the head"
    slots = "NPUs" if plan.device == "npu" else "worker slots"
    lines += [f"role:        {plan.role} ({where})",
              f"cluster:     {plan.nnodes} node(s) x {plan.npus_per_node} {slots} = "
              f"{plan.nnodes * plan.npus_per_node} {slots}; head {plan.ray_address}"
              + ("" if plan.device == "npu" else " (CPU profile: no NPU)"),
              f"this node:   {plan.node_ip} on interface {plan.ifname}",
              f"logs:        {plan.log_file} (training), {plan.ray_log} (ray)",
              f"dashboard:   {f'{plan.dashboard_host}:{plan.dashboard_port}' if plan.dashboard else 'off'}",
              f"cpu binding: {'on' if plan.cpu_binding else 'off'}",
              f"pin set:     {plan.pin_set} (PIN_SET; pins.toml)"]
    lines += [f"note:        {n}" for n in plan.notes]
    step = 0

    def add(text: str) -> None:
        nonlocal step
        step += 1
        lines.append(f"[{step}] {text}")

    if plan.env_script:
        add(f"source (set -a) {plan.env_script}")
    if plan.device == "cpu":
        add(f"source {plan.npu_env} --check=skip  (CPU profile: CANN not sourced; GLOO sockets on {plan.ifname})")
    else:
        add(f"source {plan.npu_env}  (CANN from {plan.cann_home}; HCCL/GLOO sockets on {plan.ifname})")
    add(f"{plan.python} -m qwen3_rl preflight {plan.train_script} --npu-env {plan.npu_env} --nnodes {plan.nnodes} "
        f"--npus-per-node {plan.npus_per_node} --role {plan.role}"
        + (" --no-node-checks" if plan.device == "cpu" else "")
        + (f" --env-script {plan.env_script}" if plan.env_script else "")
        + ("" if plan.preflight else " --env-only  (--no-preflight: the environment contract only)"))
    if plan.cpu_binding:
        add(f"{plan.python} -m qwen3_rl launch cpu-map (npu-smi info -t topo) then cpu-bind in the background")
        if cpu_map:
            lines += ["      " + ln for ln in cpu_map.splitlines()]
    if plan.role == "worker":
        add(f"wait for the head {plan.ray_address} (up to {plan.join_retries} attempts, {plan.join_interval:g} s apart)")
    add(f"setsid {_q(plan.ray_start)} > {plan.ray_log}")
    if plan.role == "head":
        add(f"wait until {plan.nnodes} node(s) and {plan.nnodes * plan.npus_per_node} NPU are registered "
            f"({plan.ray_bin} status --address {plan.ray_address}; timeout {plan.timeout:g} s)")
        add(f"cd {plan.repo} && bash {_q([plan.train_script, *plan.train_args])} 2>&1 | tee -a {plan.log_file}")
        try:
            cmd = parse_train_script(plan.train_script, env=train_env(plan, env_now), extra_args=plan.train_args)
            lines.append(f"      final command: {cmd.argv[0]} -m {cmd.entry_module} --config-name {cmd.config_name}")
            lines += [f"        {o}" for o in cmd.overrides]
        except TrainScriptError as exc:
            lines.append(f"      (cannot print the final command: {exc})")
        add("on exit: SIGTERM to the 'ray start --block' above (it stops the Ray processes it started); "
            "exit with the training's exit code")
    else:
        add(f"stay while {plan.ray_address} answers (every {plan.watch_interval:g} s; leave after "
            f"{plan.watch_misses} misses), then SIGTERM the 'ray start --block' above and exit")
    lines.append("environment set for Ray and the training (env script, npu_env.sh, launcher):")
    launcher = train_env(plan, {})
    changed = {k: v for k, v in env_now.items() if env_before.get(k) != v}
    changed.update(launcher)
    for k in sorted(changed):
        lines.append(f"  {k}={changed[k]}")
    lines.append("preflight (a real launch stops on errors):" if plan.preflight
                 else "preflight: skipped; environment contract (a real launch stops on errors):")
    lines += ["  " + ln for ln in preflight_lines]
    return "\n".join(lines)


def cmd_show(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch show")
    ap.add_argument("--plan-dir", required=True)
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    before = json.loads((Path(a.plan_dir) / "env.before.json").read_text())
    now = dict(os.environ)
    from qwen3_rl.tools.launch.preflight import run_preflight

    # the same check as the real launch (ray_start_npu.sh step 3): full preflight, or the env contract only
    findings = run_preflight(plan.train_script, plan.env_script or None, plan.nnodes, plan.npus_per_node, plan.role,
                             extra_args=plan.train_args, env=train_env(plan, now), npu_env=plan.npu_env,
                             env_only=not plan.preflight, node_checks=plan.device != "cpu")
    pre = [f.line() for f in findings] or ["no problems found"]
    cpu_map = None
    if plan.cpu_binding:
        try:
            cpu_map = _compute_map(plan).describe()
        except (BindingError, NpuSmiError) as exc:
            cpu_map = f"(map not computed here: {exc})"
    print(format_plan(plan, now, before, pre, cpu_map))
    return 0


def cmd_wait_started(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch wait-started")
    ap.add_argument("--log", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=180.0)
    a = ap.parse_args(argv)
    deadline = time.monotonic() + a.timeout
    log = Path(a.log)
    while True:
        text = log.read_text(errors="replace") if log.is_file() else ""
        if RAY_STARTED_MARK in text:
            return 0
        if not pid_alive(a.pid):
            last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["(empty log)"]
            return _die(f"'ray start' exited before the node was up; last line of {log}: {last[0].strip()}")
        if time.monotonic() > deadline:
            return _die(f"'ray start' did not come up within {a.timeout:g} s (see {log})")
        time.sleep(0.2)


def cmd_wait_cluster(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch wait-cluster")
    ap.add_argument("--plan-dir", required=True)
    ap.add_argument("--pid", type=int, help="the local 'ray start --block'; waiting stops if it exits")
    ap.add_argument("--interval", type=float, default=2.0)
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    try:
        st = wait_for_cluster(lambda: query_status(plan.ray_bin, plan.ray_address), plan.nnodes,
                              plan.npus_per_node, plan.timeout, a.interval,
                              alive=(lambda: pid_alive(a.pid)) if a.pid else (lambda: True), log=_log)
    except ClusterError as exc:
        return _die(str(exc))
    _log(f"cluster ready: {st.active_nodes} node(s), {st.totals.get('NPU', 0):g} NPU")
    return 0


def cmd_wait_head(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch wait-head")
    ap.add_argument("--plan-dir", required=True)
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    for attempt in range(1, plan.join_retries + 1):
        if tcp_reachable(plan.master_ip, plan.port, timeout_s=min(5.0, plan.join_interval + 1)):
            return 0
        _log(f"head {plan.ray_address} not reachable (attempt {attempt}/{plan.join_retries})")
        if attempt < plan.join_retries:
            time.sleep(plan.join_interval)
    return _die(f"head {plan.ray_address} not reachable after {plan.join_retries} attempts: start the head "
                "first, check --master-addr/--port and the firewall")


def watch_head(reachable: Callable[[], bool], local_alive: Callable[[], bool], interval_s: float, misses: int,
               sleep: Callable[[float], None] = time.sleep) -> str:
    """Return ``"head-gone"`` after ``misses`` failed checks in a row, ``"local-exit"`` if local Ray died."""
    failed = 0
    while True:
        if not local_alive():
            return "local-exit"
        failed = 0 if reachable() else failed + 1
        if failed >= misses:
            return "head-gone"
        sleep(interval_s)


def cmd_watch_head(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch watch-head")
    ap.add_argument("--plan-dir", required=True)
    ap.add_argument("--pid", type=int, required=True)
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    _log(f"joined {plan.ray_address}; staying until the head's cluster goes away")
    why = watch_head(lambda: tcp_reachable(plan.master_ip, plan.port, timeout_s=3.0), lambda: pid_alive(a.pid),
                     plan.watch_interval, plan.watch_misses)
    if why == "local-exit":
        return _die(f"the local 'ray start' exited (see {plan.ray_log})")
    _log(f"head {plan.ray_address} is gone ({plan.watch_misses} failed checks); leaving")
    return 0


def cmd_watch_oom(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch watch-oom")
    ap.add_argument("--plan-dir", required=True)
    ap.add_argument("--ray-pid", type=int, required=True, help="the launcher's 'setsid ray start --block'")
    ap.add_argument("--until", type=int, required=True, help="watch while this process runs")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between reads of raylet.out")
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    latest = Path(plan.ray_address_file).parent / "session_latest"
    session = None
    for _ in range(int(30 / 0.2)):  # the raylet is up once wait-started returned; bounded in case it is not
        session = raylet_session_dir(a.ray_pid)
        if session is not None or not pid_alive(a.until):
            break
        time.sleep(0.2)
    if session is None:
        session = latest
        _log(f"memory-kill watch: no raylet of this launcher's Ray found; following {latest}")
    elif latest.resolve() != session.resolve():
        _log(f"memory-kill watch: {latest} is another cluster's; following this launch's {session}")
    also = _gcs_losses(plan.ray_address) if plan.role == "head" else None
    reported: set[int] = set()  # pids: a kill on the head is both in its raylet.out and in the GCS
    log = session / "logs" / "raylet.out"
    for kill in follow_kills(log, lambda: pid_alive(a.until), a.interval, also=also):
        if kill.pid and kill.pid in reported:
            continue
        reported.add(kill.pid)
        if not kill.lost:  # an idle worker, or Ray runs the task again / restarts the actor
            print(f"warning: {kill.message(head=False)}", file=sys.stderr, flush=True)
            continue
        _die(kill.message(head=plan.role == "head"))
        if plan.role == "head":
            return 1
    return 0


def _gcs_losses(address: str) -> Callable[[], list[OomKill | ActorLoss]] | None:
    """Head: each call returns the actors (cluster-wide) that died for good since the last call (ray_actors.py);
    ``None`` (this node's raylet log only) if ray is not importable here."""
    try:
        read: Callable[[], list[DeadActor]] = gcs_dead_actors(address)
    except ImportError as exc:
        _log(f"actor watch: ray is not importable ({exc}); following this node's raylet log only")
        return None
    seen: set[str] = set()
    failing = [False]

    def losses() -> list[OomKill | ActorLoss]:
        try:
            rows = read()
        except Exception as exc:  # the GCS not answering (yet / any more): tried again at the next poll
            if not failing[0]:
                _log(f"actor watch: cannot read the GCS actor table at {address} ({exc}); retrying")
            failing[0] = True
            return []
        failing[0] = False
        out = []
        for row in rows:
            if row.actor_id not in seen:
                seen.add(row.actor_id)
                loss = classify(row)
                if loss is not None:
                    out.append(loss)
        return out

    return losses


def _compute_map(plan: LaunchPlan) -> BindingMap:
    topo = run_npu_smi("info", "-t", "topo")
    chips = run_npu_smi("info", "-m")
    return compute_binding(topo, chips, os.sched_getaffinity(0), read_numa_nodes(),
                           npus=range(plan.npus_per_node))


def cmd_cpu_map(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch cpu-map")
    ap.add_argument("--plan-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    try:
        bmap = _compute_map(plan)
    except (BindingError, NpuSmiError) as exc:
        return _die(f"--cpu-binding: {exc}")
    Path(a.out).write_text(bmap.to_json())
    _log("CPU binding map (each NPU's processes -> these cores):")
    for line in bmap.describe().splitlines():
        _log("  " + line)
    return 0


def cmd_cpu_bind(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch cpu-bind")
    ap.add_argument("--map", required=True)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--parent-pid", type=int)
    ap.add_argument("--once", action="store_true")
    a = ap.parse_args(argv)
    bmap = BindingMap.from_json(Path(a.map).read_text())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return run_binder(bmap, a.interval, a.parent_pid, once=a.once, log=_log)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cmd_stop(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch stop")
    ap.add_argument("--plan-dir", required=True)
    ap.add_argument("--grace", type=float, default=60.0)
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    pidfile = Path(plan.pidfile)
    if not pidfile.is_file():
        _log(f"nothing to stop: no launcher running here for port {plan.port} ({pidfile} absent)")
        return 0
    try:
        launcher_pid, ray_pid = (int(x) for x in pidfile.read_text().split()[:2])
    except ValueError:
        return _die(f"cannot read {pidfile}")
    targets = []
    if pid_alive(launcher_pid) and "ray_start_npu.sh" in _cmdline(launcher_pid):
        targets.append(("launcher", launcher_pid))
    elif pid_alive(ray_pid) and " start " in _cmdline(ray_pid) and "--block" in _cmdline(ray_pid):
        targets.append(("ray start", ray_pid))
    if not targets:
        _log(f"nothing to stop: processes in {pidfile} are gone")
        pidfile.unlink(missing_ok=True)
        return 0
    for name, pid in targets:
        _log(f"sending SIGTERM to the {name} (pid {pid})")
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + a.grace
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for _, p in targets) and not pid_alive(ray_pid):
            _log("stopped")
            return 0
        time.sleep(0.5)
    return _die(f"still running after {a.grace:g} s: pids {[p for _, p in targets]} (ray start {ray_pid})")


def cmd_auth(argv: list[str]) -> int:
    """Head: write a new token to the plan's token file. Worker: wait (bounded) until the head's token is there."""
    ap = argparse.ArgumentParser(prog="launch auth")
    ap.add_argument("--plan-dir", required=True)
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    if plan.auth_mode != "token":
        _log("Ray auth: off (RAY_AUTH_MODE=disabled: a loopback master)")
        return 0
    if not plan.auth_token_file:
        _log("Ray auth: token from RAY_AUTH_TOKEN")
        return 0
    path = Path(plan.auth_token_file)
    if plan.auth_token_make:
        try:
            make_token(path)
        except OSError as exc:
            return _die(f"cannot write the Ray auth token file {path}: {exc.strerror}")
        _log(f"Ray auth: new cluster token in {path} (mode 0600; workers read the same file)")
        return 0
    if plan.role == "worker":
        wait_s = plan.join_retries * plan.join_interval
        if not wait_token(path, wait_s):
            return _die(f"no Ray auth token in {path} after {wait_s:g} s: the head writes it there, so it must be "
                        "on storage both nodes see (--auth-token-file), or give every node RAY_AUTH_TOKEN")
    elif not path.is_file():
        return _die(f"Ray auth token file {path} (RAY_AUTH_TOKEN_PATH) not found")
    _log(f"Ray auth: token from {path}")
    return 0


def cmd_address_file(argv: list[str]) -> int:
    """``save``: record Ray's ray_current_cluster before ``ray start``; ``restore``: put it back after Ray stopped."""
    ap = argparse.ArgumentParser(prog="launch address-file")
    ap.add_argument("action", choices=["save", "restore"])
    ap.add_argument("--plan-dir", required=True)
    a = ap.parse_args(argv)
    plan = _load(a.plan_dir)
    state = Path(a.plan_dir) / "address_file.json"
    if a.action == "save":
        if not state.is_file():  # a worker's join retry must not record the file after the first attempt
            save_address_file(Path(plan.ray_address_file), state)
        return 0
    if state.is_file():
        _log(restore_address_file(state, plan.port))
    return 0


def cmd_slurm_plan(argv: list[str]) -> int:
    from qwen3_rl.tools.launch.slurm import cmd_slurm_plan as run

    return run(argv)


def cmd_slurm_task(argv: list[str]) -> int:
    from qwen3_rl.tools.launch.slurm import cmd_slurm_task as run

    return run(argv)


def cmd_k8s(argv: list[str]) -> int:
    from qwen3_rl.tools.launch.k8s import main as run

    return run(argv)


#: ``SAM_COST_TABLE`` value asking the launcher to measure the table first (``launch calibrate``)
CALIBRATE = "calibrate"


def calibrate_wanted(env: Mapping[str, str]) -> bool:
    """Whether ``SAM_COST_TABLE=calibrate`` asks for a measured table before training."""
    return env.get("SAM_COST_TABLE", "").strip() == CALIBRATE


def cmd_calibrate(argv: list[str]) -> int:
    """Head, before preflight: with ``SAM_COST_TABLE=calibrate`` run ``python -m qwen3_rl calibrate`` on the train
    script's rollout engine and write ``SAM_COST_TABLE=<table>`` (NUL-terminated) to ``--env-out`` for the launcher
    to export; otherwise write nothing there."""
    ap = argparse.ArgumentParser(prog="launch calibrate")
    ap.add_argument("--train-script", required=True)
    ap.add_argument("--out", required=True, help="the table file")
    ap.add_argument("--env-out", required=True, help="the environment to export (NUL-separated)")
    a = ap.parse_args(argv)
    Path(a.env_out).write_text("")
    if not calibrate_wanted(os.environ):
        return 0
    import subprocess

    _log(f"SAM_COST_TABLE=calibrate: measuring the verification-cost table of {a.train_script} -> {a.out}")
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "calibrate", "--setup", a.train_script, "--out", a.out],
                          stdout=sys.stderr, check=False)
    if proc.returncode != 0:
        return _die(f"SAM_COST_TABLE=calibrate: calibrate exited with {proc.returncode} (see above)")
    _write_nul(Path(a.env_out), [f"SAM_COST_TABLE={a.out}"])
    return 0


STEPS: dict[str, Callable[[list[str]], int]] = {
    "resolve": cmd_resolve, "show": cmd_show, "wait-started": cmd_wait_started, "wait-cluster": cmd_wait_cluster,
    "wait-head": cmd_wait_head, "watch-head": cmd_watch_head, "watch-oom": cmd_watch_oom, "cpu-map": cmd_cpu_map,
    "cpu-bind": cmd_cpu_bind, "stop": cmd_stop, "auth": cmd_auth, "address-file": cmd_address_file, "slurm-plan": cmd_slurm_plan,
    "slurm-task": cmd_slurm_task, "k8s": cmd_k8s, "calibrate": cmd_calibrate,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in STEPS:
        return _die(f"usage: python -m qwen3_rl launch {{{','.join(STEPS)}}} ... (used by ray_start_npu.sh)", 2)
    return STEPS[argv[0]](argv[1:])
