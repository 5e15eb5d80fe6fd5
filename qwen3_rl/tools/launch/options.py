"""Launcher options (flags with environment fallbacks) and the launch plan derived from them.

``ray_start_npu.sh`` hands its whole argument list to :func:`parse_options`; the resulting
:class:`LaunchPlan` holds every command the shell will run (``ray start``, the train script) and the
variables it exports. Every value error is a :class:`LaunchError` with a one-line message.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qwen3_rl.tools.launch.netinfo import NetError, interface_ips, node_net, resolve_host

REPO = Path(__file__).resolve().parents[3]
DEFAULT_NPU_ENV = REPO / "internal" / "npu_env.sh"


class LaunchError(RuntimeError):
    """Bad launcher input (one-line message, printed as ``error: ...``)."""


# flag -> (environment fallback, default); the help text shows both
ENV_FALLBACKS: dict[str, tuple[str, str | None]] = {
    "nnodes": ("NNODES", "1"),
    "npus_per_node": ("NPUS_PER_NODE", "16"),
    "master_addr": ("MASTER_ADDR", None),
    "port": ("RAY_PORT", "6379"),
    "ifname": ("SOCKET_IFNAME", None),
    "timeout": ("RAY_WAIT_TIMEOUT", "900"),
    "log_dir": ("LOG_DIR", str(REPO / "logs")),
    "dashboard_host": ("RAY_DASHBOARD_HOST", "127.0.0.1"),
    "dashboard_port": ("RAY_DASHBOARD_PORT", "8265"),
    "role": ("RAY_ROLE", "auto"),
    "temp_dir": ("RAY_TEMP_DIR", None),
    "join_retries": ("RAY_JOIN_RETRIES", "30"),
    "join_interval": ("RAY_JOIN_INTERVAL", "10"),
    "watch_interval": ("RAY_WATCH_INTERVAL", "10"),
    "watch_misses": ("RAY_WATCH_MISSES", "3"),
    "cann_home": ("CANN_HOME", "/usr/local/Ascend"),
    "npu_env": ("NPU_ENV_SCRIPT", str(DEFAULT_NPU_ENV)),
    "device": ("LAUNCH_DEVICE", "npu"),
    "auth_token_file": ("RAY_AUTH_TOKEN_FILE", None),
}
BOOL_FALLBACKS = {"dashboard": "RAY_DASHBOARD", "cpu_binding": "CPU_BINDING", "no_preflight": "SKIP_PREFLIGHT",
                  "no_oom_watch": "SKIP_OOM_WATCH"}


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the shell needs, resolved once.

    ``ray_start`` is the full argv (ending in ``--block``: the process stays in the foreground of its
    own session and stops all Ray processes it started when it receives SIGTERM).
    """

    mode: str  # run | dry-run | stop
    role: str  # head | worker
    device: str  # npu | cpu (CPU profile: no NPU on the node; see cpu_profile_error)
    train_script: str
    env_script: str
    train_args: list[str]
    nnodes: int
    npus_per_node: int
    master_addr: str
    master_ip: str
    port: int
    ray_address: str
    ifname: str
    node_ip: str
    timeout: float
    log_dir: str
    log_file: str
    ray_log: str
    pidfile: str
    dashboard: bool
    dashboard_host: str
    dashboard_port: int
    cpu_binding: bool
    preflight: bool
    join_retries: int
    join_interval: float
    watch_interval: float
    watch_misses: int
    cann_home: str
    npu_env: str
    ray_bin: str
    ray_start: list[str]
    python: str
    repo: str
    # Ray token auth: mode "token" | "disabled"; the token file Ray reads (RAY_AUTH_TOKEN_PATH; "" when the
    # token comes in RAY_AUTH_TOKEN); auth_token_make: this node (the head) writes a new token there
    auth_mode: str = "disabled"
    auth_token_file: str = ""
    auth_token_make: bool = False
    ray_address_file: str = ""  # <ray temp dir>/ray_current_cluster (restored on exit; see launch/ray_node.py)
    oom_watch: bool = True  # follow raylet.out for Ray memory-monitor kills (launch/ray_oom.py)
    pin_set: str = "seed"  # PIN_SET (qwen3_rl.tools.pins.resolve_pin_set): which pin set's stack this node runs
    notes: list[str] = field(default_factory=list)

    def shell_vars(self) -> dict[str, str]:
        """Scalar fields as ``NAME=value`` for the shell (lists are written separately)."""
        out: dict[str, str] = {}
        for k, v in asdict(self).items():
            if isinstance(v, list):
                continue
            out[k.upper()] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> LaunchPlan:
        return cls(**json.loads(text))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ray_start_npu.sh",
        usage="bash ray_start_npu.sh TRAIN_SCRIPT [ENV_SCRIPT] [options] [-- HYDRA_OVERRIDES...]",
        description="Start (or join) the Ray cluster on this node and, on the head, run TRAIN_SCRIPT. "
                    "Run the same command on every node; the node whose address is --master-addr is the head.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every option falls back to the environment variable in brackets.",
        add_help=False,
    )
    ap.add_argument("train_script", nargs="?", help="internal/train_*.sh")
    ap.add_argument("env_script", nargs="?", help="optional env script sourced before ray start (set -a)")

    def opt(flag: str, dest: str, help_: str, **kw: object) -> None:
        env, default = ENV_FALLBACKS[dest]
        ap.add_argument(flag, dest=dest, default=None, help=f"{help_} [{env}; default {default or 'see text'}]",
                        **kw)

    opt("--nnodes", "nnodes", "number of nodes")
    opt("--npus-per-node", "npus_per_node", "NPU dies per node")
    opt("--master-addr", "master_addr", "head node address (default: 127.0.0.1 for one node; required above one)")
    opt("--port", "port", "Ray GCS port on the head")
    opt("--ifname", "ifname", "interface for HCCL/GLOO sockets (default: the one routing to the master)")
    opt("--timeout", "timeout", "seconds for the cluster to assemble")
    opt("--log-dir", "log_dir", "directory for the training and Ray logs")
    ap.add_argument("--dashboard", action="store_true", default=None,
                    help="start Ray's dashboard (job API) [RAY_DASHBOARD=1; default off]")
    opt("--dashboard-host", "dashboard_host", "dashboard bind address")
    opt("--dashboard-port", "dashboard_port", "dashboard port")
    ap.add_argument("--cpu-binding", action="store_true", default=None,
                    help="pin each NPU's processes to its NUMA node's cores [CPU_BINDING=1; default off]")
    opt("--role", "role", "auto | head | worker")
    opt("--temp-dir", "temp_dir", "Ray temp dir (head: passed to ray start; Ray 2.52 workers use the head's path, give the same "
                                  "one there) [default: $RAY_TMPDIR/ray, $TMPDIR/ray or /tmp/ray]")
    opt("--join-retries", "join_retries", "worker: attempts to reach/join the head")
    opt("--join-interval", "join_interval", "worker: seconds between attempts")
    opt("--watch-interval", "watch_interval", "worker: seconds between checks that the head is alive")
    opt("--watch-misses", "watch_misses", "worker: failed checks in a row before leaving")
    opt("--cann-home", "cann_home", "CANN install root (holds ascend-toolkit/ or cann/)")
    opt("--npu-env", "npu_env", "the CANN/HCCL/vLLM environment file sourced on every node")
    opt("--auth-token-file", "auth_token_file",
        "Ray auth token file of a cluster run: the head writes a new token there, workers read it (storage all "
        "nodes see); unused when RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH is set (default <log-dir>/.ray_auth_token_<port>)")
    opt("--device", "device", "npu | cpu. cpu = CPU profile for a node without NPUs (the tiny CPU run): Ray "
                              "advertises --npus-per-node worker slots under verl's NPU resource name, CANN is not "
                              "sourced, preflight skips its npu-smi/CANN/patch checks; refused on a node with NPUs")
    ap.add_argument("--ray-arg", action="append", default=None, metavar="ARG",
                    help="extra 'ray start' argument, repeatable (e.g. --ray-arg=--num-cpus=64) [RAY_START_ARGS]")
    ap.add_argument("--no-preflight", action="store_true", default=None,
                    help="skip 'python -m qwen3_rl preflight' before ray start, except its environment "
                         "contract (--env-only) [SKIP_PREFLIGHT=1]")
    ap.add_argument("--no-oom-watch", action="store_true", default=None,
                    help="do not watch for lost Ray actors: memory-monitor kills in raylet.out, and on the head "
                         "the GCS's dead actors of any node (on, the head stops the training after one, as verl "
                         "waits forever for the lost actor) [SKIP_OOM_WATCH=1]")
    ap.add_argument("--dry-run", action="store_true", help="print every command and the environment; run nothing")
    ap.add_argument("--stop", action="store_true", help="stop the Ray (and training) this launcher started here")
    ap.add_argument("-h", "--help", action="store_true", help="show this help")
    return ap


def cpu_profile_error(dev_dir: str = "/dev") -> str:
    """Why the CPU profile must not run on this node ('' = no NPU visible): NPU device files, or an
    ``npu-smi`` on PATH that lists dies."""
    import glob

    devs = sorted(glob.glob(os.path.join(dev_dir, "davinci[0-9]*")))
    if devs:
        return f"this node has NPU devices ({', '.join(devs[:3])}{' ...' if len(devs) > 3 else ''})"
    if shutil.which("npu-smi"):
        from qwen3_rl.tools.launch.npu_smi import NpuSmiError, parse_chip_map, run_npu_smi

        try:
            chips = parse_chip_map(run_npu_smi("info", "-m", timeout_s=10.0))
        except NpuSmiError:
            return ""
        if chips:
            return f"npu-smi lists {len(chips)} NPU die(s) on this node"
    return ""


def usage() -> str:
    return _parser().format_help()


def _value(ns: argparse.Namespace, dest: str, env: dict[str, str]) -> tuple[str | None, str]:
    """(value, where it came from) with flag > environment > default."""
    flag = getattr(ns, dest)
    name, default = ENV_FALLBACKS[dest]
    if flag is not None:
        return flag, "--" + dest.replace("_", "-")
    if env.get(name, "") != "":
        return env[name], name
    return default, f"default of --{dest.replace('_', '-')}"


def _int(ns: argparse.Namespace, dest: str, env: dict[str, str], lo: int, hi: int | None = None) -> int:
    raw, src = _value(ns, dest, env)
    try:
        val = int(str(raw))
    except ValueError:
        raise LaunchError(f"{src}={raw!r} is not an integer") from None
    if val < lo or (hi is not None and val > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise LaunchError(f"{src}={val} must be {rng}")
    return val


def _float(ns: argparse.Namespace, dest: str, env: dict[str, str], lo: float) -> float:
    raw, src = _value(ns, dest, env)
    try:
        val = float(str(raw))
    except ValueError:
        raise LaunchError(f"{src}={raw!r} is not a number") from None
    if not val > lo:
        raise LaunchError(f"{src}={raw} must be > {lo:g}")
    return val


def _bool(ns: argparse.Namespace, dest: str, env: dict[str, str]) -> bool:
    if getattr(ns, dest):
        return True
    raw = env.get(BOOL_FALLBACKS[dest], "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise LaunchError(f"{BOOL_FALLBACKS[dest]}={raw!r} must be 0 or 1")


def parse_options(argv: list[str], env: dict[str, str] | None = None) -> LaunchPlan | None:
    """Parse the launcher's arguments into a :class:`LaunchPlan` (``None`` for ``--help``).

    Args:
        argv: arguments after the script name (may contain ``--`` followed by Hydra overrides).
        env: environment used for fallbacks (default ``os.environ``).

    Raises:
        LaunchError: any invalid input, with a one-line message.
    """
    env = dict(os.environ if env is None else env)
    train_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1 :]
    ap = _parser()

    def fail(message: str) -> None:
        raise LaunchError(message.replace("\n", " "))

    ap.error = fail  # type: ignore[method-assign]
    ns = ap.parse_args(argv)
    if ns.help:
        return None
    if ns.dry_run and ns.stop:
        raise LaunchError("--dry-run and --stop cannot be combined")
    mode = "stop" if ns.stop else ("dry-run" if ns.dry_run else "run")
    from qwen3_rl.tools.pins import PinError, resolve_pin_set

    try:
        pin_set = resolve_pin_set(env=env)
    except PinError as exc:
        raise LaunchError(str(exc)) from exc

    nnodes = _int(ns, "nnodes", env, 1)
    npus = _int(ns, "npus_per_node", env, 1, 64)
    port = _int(ns, "port", env, 1, 65535)
    timeout = _float(ns, "timeout", env, 0)
    dash_port = _int(ns, "dashboard_port", env, 1, 65535)
    join_retries = _int(ns, "join_retries", env, 1)
    join_interval = _float(ns, "join_interval", env, 0)
    watch_interval = _float(ns, "watch_interval", env, 0)
    watch_misses = _int(ns, "watch_misses", env, 1)
    dashboard = _bool(ns, "dashboard", env)
    cpu_binding = _bool(ns, "cpu_binding", env)
    preflight = not _bool(ns, "no_preflight", env)
    oom_watch = not _bool(ns, "no_oom_watch", env)
    device, device_src = _value(ns, "device", env)
    if device not in ("npu", "cpu"):
        raise LaunchError(f"{device_src}={device!r} must be npu or cpu")
    if device == "cpu":
        reason = cpu_profile_error()
        if reason:
            raise LaunchError(f"{device_src}=cpu is for nodes without NPUs, but {reason}: launch without it")
    role_raw, role_src = _value(ns, "role", env)
    if role_raw not in ("auto", "head", "worker"):
        raise LaunchError(f"{role_src}={role_raw!r} must be auto, head or worker")

    dash_host, dash_src = _value(ns, "dashboard_host", env)
    try:
        ipaddress.ip_address(str(dash_host))
    except ValueError:
        raise LaunchError(f"{dash_src}={dash_host!r} is not an IP address") from None
    if dashboard and not ipaddress.ip_address(str(dash_host)).is_loopback:
        notes = [f"dashboard (Ray job API) listens on {dash_host}:{dash_port}, reachable from the network"]
    else:
        notes = []

    if ns.train_script is None:
        raise LaunchError("missing TRAIN_SCRIPT (usage: bash ray_start_npu.sh TRAIN_SCRIPT [ENV_SCRIPT] [options])")
    train = Path(ns.train_script)
    if not train.is_file():
        raise LaunchError(f"train script not found: {train}")
    env_script = ""
    if ns.env_script is not None:
        if not Path(ns.env_script).is_file():
            raise LaunchError(f"env script not found: {ns.env_script}")
        env_script = str(Path(ns.env_script).resolve())
    npu_env, _ = _value(ns, "npu_env", env)
    if not Path(str(npu_env)).is_file():
        raise LaunchError(f"NPU environment file not found: {npu_env} (--npu-env / NPU_ENV_SCRIPT)")

    master, master_src = _value(ns, "master_addr", env)
    if master is None:
        if nnodes > 1:
            raise LaunchError(f"--master-addr (or MASTER_ADDR) is required with {nnodes} nodes: "
                              "give the head's IP, the same on every node")
        master = "127.0.0.1"
    try:
        master_ip = resolve_host(str(master))
        if nnodes > 1 and ipaddress.ip_address(master_ip).is_loopback:
            raise LaunchError(f"{master_src}={master} is a loopback address but --nnodes={nnodes}: "
                              "other nodes cannot reach it")
        net = node_net(master_ip)
        ifname_raw, if_src = _value(ns, "ifname", env)
        ifname, node_ip = net.ifname, net.node_ip
        if ifname_raw:
            ips = interface_ips(str(ifname_raw))
            ifname = str(ifname_raw)
            if node_ip not in ips:
                v4 = [ip for ip in ips if ":" not in ip]
                node_ip = (v4 or ips)[0]
    except NetError as exc:
        raise LaunchError(str(exc)) from None

    role = str(role_raw)
    if role == "auto":
        role = "head" if net.is_local else "worker"
    elif role == "head" and not net.is_local:
        raise LaunchError(f"--role head but the master address {master_ip} is not an address of this node")

    ray_bin = shutil.which("ray") or ""
    if not ray_bin and mode == "run":
        raise LaunchError("'ray' not found on PATH (activate the environment that has verl and Ray installed)")
    ray_bin = ray_bin or "ray"

    extra: list[str] = []
    for item in (ns.ray_arg or shlex.split(env.get("RAY_START_ARGS", ""))):
        extra.append(item)
    temp_dir, _ = _value(ns, "temp_dir", env)
    resources = json.dumps({"NPU": npus})
    if device == "cpu" and not any(a.startswith("--num-cpus") for a in extra):
        # verl asks for one CPU per worker bundle besides its driver actor: enough logical CPUs for both
        # (Ray's logical CPUs only gate scheduling; the processes share the cores)
        # pin set current: verl 0.9.1's fully-async actors ask for 10 + 10 + 2 + 1 more (fully_async_rollouter.py:329,
        # fully_async_trainer.py:53, message_queue.py:26, fully_async_main.py:35; OMP_NUM_THREADS=1 in the profile)
        extra.insert(0, f"--num-cpus={max(os.cpu_count() or 1, 2 * npus + 4 + (23 if pin_set == 'current' else 0))}")
        notes.append(f"CPU profile: {npus} worker slot(s) advertised as Ray resource NPU (no NPU on this node)")
    if device == "cpu" and pin_set == "current" and not any(a.startswith("--num-gpus") for a in extra):
        # verl 0.9.1 places its workers on its platform's Ray resource, "GPU" for the CPU host platform of the
        # device layer (qwen3_rl/cpu_device/verl091_cpu.py): the same worker slots, under that name
        extra.insert(0, f"--num-gpus={npus}")
        notes.append(f"CPU profile, pin set current: the {npus} worker slot(s) also advertised as Ray resource GPU")
    if role == "head":
        ray_start = [ray_bin, "start", "--head", f"--port={port}", f"--node-ip-address={node_ip}",
                     f"--resources={resources}", "--disable-usage-stats"]
        if dashboard:
            ray_start += ["--include-dashboard=true", f"--dashboard-host={dash_host}",
                          f"--dashboard-port={dash_port}"]
        else:
            ray_start += ["--include-dashboard=false"]
    else:
        # A worker's Ray is stopped once the head's GCS is gone. On SIGTERM, `ray start --block` (Ray 2.60,
        # ray/_private/node.py _drain_node_before_shutdown) first asks the GCS to drain the node and waits up
        # to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (default 30 s), which then can only time out: off here
        # unless the user sets it. (The drain is for Ray Serve proxies; verl does not use it.)
        drain = env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
        ray_start = ["env", f"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S={drain}", ray_bin, "start",
                     f"--address={master_ip}:{port}", f"--node-ip-address={node_ip}", f"--resources={resources}",
                     "--disable-usage-stats"]
        if dashboard:
            notes.append("--dashboard only applies on the head")
    if temp_dir and role == "head":
        # Ray 2.52 (pins.toml runtime.ray) takes --temp-dir on the head only: a worker warns, ignores it and uses
        # the head's path (ray/scripts/scripts.py); the worker's --temp-dir only tells the launcher that path
        ray_start += [f"--temp-dir={temp_dir}"]
    ray_start += extra + ["--block"]

    log_dir_raw, _ = _value(ns, "log_dir", env)
    log_dir = Path(str(log_dir_raw)).resolve()
    auth_mode, token_file, token_make = _auth(ns, env, str(device), master_ip, role, port, log_dir, notes)
    from qwen3_rl.tools.launch.ray_node import ADDRESS_FILE, ray_temp_root
    stem = f"{train.stem}_{role}_{node_ip}"
    cann_home, _ = _value(ns, "cann_home", env)
    return LaunchPlan(
        mode=mode, role=role, device=str(device), train_script=str(train.resolve()), env_script=env_script, train_args=train_args,
        nnodes=nnodes, npus_per_node=npus, master_addr=str(master), master_ip=master_ip, port=port,
        ray_address=f"{master_ip}:{port}", ifname=ifname, node_ip=node_ip, timeout=timeout,
        log_dir=str(log_dir), log_file=str(log_dir / f"{stem}.log"), ray_log=str(log_dir / f"ray_{stem}.log"),
        pidfile=str(log_dir / f".ray_start_npu_{role}_{port}.pid"),
        dashboard=dashboard, dashboard_host=str(dash_host), dashboard_port=dash_port, cpu_binding=cpu_binding,
        preflight=preflight, join_retries=join_retries, join_interval=join_interval,
        watch_interval=watch_interval, watch_misses=watch_misses, cann_home=str(cann_home),
        npu_env=str(Path(str(npu_env)).resolve()), ray_bin=ray_bin, ray_start=ray_start,
        python=sys.executable, repo=str(REPO), pin_set=pin_set, oom_watch=oom_watch, auth_mode=auth_mode, auth_token_file=token_file,
        auth_token_make=token_make,
        ray_address_file=str(ray_temp_root(str(temp_dir) if temp_dir else None, env) / ADDRESS_FILE), notes=notes,
    )


def _auth(ns: argparse.Namespace, env: dict[str, str], device: str, master_ip: str, role: str, port: int,
          log_dir: Path, notes: list[str]) -> tuple[str, str, bool]:
    """Ray token auth for this launch: (mode, token file for RAY_AUTH_TOKEN_PATH or "", head makes the token).

    Token auth is on for every run except a CPU-profile run on a loopback master (the tiny CPU run): with auth off,
    whoever reaches a node's Ray ports (GCS, client server, dashboard) can run code there, and Ray binds its GCS
    port on every interface even for 127.0.0.1 (docs/launch.md). ``RAY_AUTH_MODE=disabled`` is refused unless the
    master is a loopback address.
    """
    loopback = ipaddress.ip_address(master_ip).is_loopback
    raw = env.get("RAY_AUTH_MODE", "")
    if raw == "":
        mode = "disabled" if device == "cpu" and loopback else "token"
    elif raw in ("token", "disabled"):
        mode = raw
    else:
        raise LaunchError(f"RAY_AUTH_MODE={raw!r} must be token or disabled")
    if mode == "disabled":
        if not loopback:
            raise LaunchError(f"RAY_AUTH_MODE=disabled with master {master_ip}: a cluster's Ray ports stay "
                              "token-authenticated (unset RAY_AUTH_MODE)")
        return mode, "", False
    if env.get("RAY_AUTH_TOKEN", ""):
        notes.append("Ray auth: token from RAY_AUTH_TOKEN (given to every node by the scheduler or the user)")
        return mode, "", False
    if env.get("RAY_AUTH_TOKEN_PATH", ""):
        notes.append("Ray auth: token file from RAY_AUTH_TOKEN_PATH (made by the user)")
        return mode, str(Path(env["RAY_AUTH_TOKEN_PATH"]).resolve()), False
    raw_file, _ = _value(ns, "auth_token_file", env)
    token_file = Path(str(raw_file)).resolve() if raw_file else log_dir / f".ray_auth_token_{port}"
    notes.append(f"Ray auth: token file {token_file} ("
                 + ("the head writes a new token there" if role == "head" else "written by the head; "
                    "must be on storage this node shares with it") + ")")
    return mode, str(token_file), role == "head"
