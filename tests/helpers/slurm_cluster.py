"""A real Slurm on this machine for the tests: Debian's ``munge``, ``slurmctld`` and ``slurmd`` (22.05), started
by the test with a generated munge key and a generated ``slurm.conf`` under one directory, stopped by PID.

Nodes: one ``slurmd`` per network namespace the test made (``ip netns``), each with its own address; with one
node and no namespace the node and the controller sit on 127.0.0.1. Several ``slurmd`` on one host need either a
Slurm built with ``--enable-multiple-slurmd`` (Debian's is not) or separate network namespaces: each ``slurmd``
binds the same port in its own namespace, and the controller runs in the first node's namespace.

Every client command (``sbatch``, ``squeue``, ``scancel``, ``scontrol``) runs with ``SLURM_CONF`` pointing at the
generated file, in the first node's namespace.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CTLD_PORT = 6817
SLURMD_PORT = 6818


class SlurmSetupError(RuntimeError):
    """A daemon did not start (message names the command and the tail of its log)."""


@dataclass
class Node:
    """One Slurm node: its ``NodeName``, ``NodeAddr``, network namespace, and node-local directories.

    ``local_dirs`` maps a path every node uses (e.g. the Ray temp dir: Ray 2.52 workers take the head's path) to
    this node's own directory, bind-mounted there in a mount namespace of this node's ``slurmd`` (and so of its
    jobs), as separate machines have their own ``/tmp``.
    """

    name: str
    addr: str
    netns: str | None = None  # None: the host's namespace
    local_dirs: dict[str, str] = field(default_factory=dict)


@dataclass
class SlurmCluster:
    root: Path
    nodes: list[Node]
    cpus: int
    npus: int
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _ns(self, node: Node) -> list[str]:
        # nsenter --net: the network namespace only. `ip netns exec` also remounts /sys in a new mount namespace,
        # where slurmd finds no /sys/fs/cgroup and refuses to start (its cgroup plugin loads whatever the proctrack)
        return ["nsenter", f"--net=/run/netns/{node.netns}"] if node.netns else []

    def client(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60,
               check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command in the first node's namespace."""
        p = subprocess.run([*self._ns(self.nodes[0]), *args], env=self.env(env), capture_output=True, text=True,
                           timeout=timeout, check=False)
        if check and p.returncode != 0:
            raise SlurmSetupError(f"`{' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
        return p

    def write_config(self) -> None:
        for d in ("etc", "munge", "state", "log", "spool", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key), "--bits", "1024"], check=True,
                       capture_output=True, timeout=30)
        os.chmod(key, 0o600)
        ctl = self.nodes[0]
        r = self.root
        lines = [
            "ClusterName=q3rl",
            # slurmctld accepts only a SlurmctldHost named as this host; its address is the first node's
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({ctl.addr})", "MailProg=/bin/true",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={CTLD_PORT}", f"SlurmdPort={SLURMD_PORT}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd.%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd.%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            # no cgroup in a container: the step's processes are tracked by parentage; the launcher itself
            # stops what it started (and the test checks nothing is left)
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin", "MpiDefault=none", "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "KillWait=60", "MessageTimeout=30", "InactiveLimit=0",
            "GresTypes=npu",
        ]
        lines += [f"NodeName={n.name} NodeAddr={n.addr} CPUs={self.cpus} Gres=npu:{self.npus} State=UNKNOWN"
                  for n in self.nodes]
        lines.append(f"PartitionName=q3 Nodes={','.join(n.name for n in self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=YES")
        self.conf.write_text("\n".join(lines) + "\n")
        # a count-only GRES (no device files): Slurm hands out the count and sets it in the job's environment
        (self.root / "etc" / "gres.conf").write_text(
            "".join(f"NodeName={n.name} Name=npu Count={self.npus}\n" for n in self.nodes))
        for n in self.nodes:
            (self.root / "spool" / n.name).mkdir(parents=True, exist_ok=True)

    def _start(self, argv: list[str], log: Path, node: Node | None = None) -> subprocess.Popen:
        env = self.env()
        p = subprocess.Popen([*(self._ns(node) if node else []), *argv], env=env, stdout=log.open("w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self, timeout_s: float = 60) -> None:
        self.write_config()
        r = self.root
        self._start(["munged", "-F", "--force", f"--socket={self.socket}", f"--key-file={r}/munge/munge.key",
                     f"--pid-file={r}/run/munged.pid", f"--log-file={r}/log/munged.log",
                     f"--seed-file={r}/munge/munged.seed"], r / "log" / "munged.out")
        self._wait(lambda: self.socket.exists(), "munged", r / "log" / "munged.out", timeout_s)
        # -i: ignore state from an earlier run; -D: foreground (this process owns it)
        self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)], r / "log" / "slurmctld.out", self.nodes[0])
        self._wait(lambda: self.client("scontrol", "ping", check=False).returncode == 0, "slurmctld",
                   r / "log" / "slurmctld.log", timeout_s)
        for n in self.nodes:
            argv = [*self._ns(n), "slurmd", "-D", "-f", str(self.conf), "-N", n.name]
            if n.local_dirs:
                binds = " && ".join(f"mkdir -p {shlex.quote(dst)} {shlex.quote(src)} && mount --bind "
                                    f"{shlex.quote(src)} {shlex.quote(dst)}" for dst, src in n.local_dirs.items())
                argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f"{binds} && exec {shlex.join(argv)}"]
            self._start(argv, r / "log" / f"slurmd.{n.name}.out")

        def idle() -> bool:
            p = self.client("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
            return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

        self._wait(idle, "slurmd (nodes idle)", r / "log" / "slurmctld.log", timeout_s)

    def _wait(self, ok, what: str, log: Path, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ok():
                return
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.5)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.is_file() else "(no log)"
        raise SlurmSetupError(f"{what} did not come up within {timeout_s:g} s; {log}:\n{tail}")

    def stop(self) -> None:
        """Stop the daemons this harness started (by PID; slurmd first, munged last)."""
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    def helper_pids(self) -> set[int]:
        """Helper processes the daemons fork for themselves (slurmctld's ``slurmscriptd``): not a job's."""
        ours = {p.pid for p in self.procs}
        out = set()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                comm = (d / "comm").read_text().strip()
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if comm == "slurmscriptd" and ppid in ours:
                out.add(int(d.name))
        return out

    def job_state(self, job_id: str) -> str:
        p = self.client("scontrol", "show", "job", job_id, "-o", check=False)
        for tok in p.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "GONE"

    def wait_job(self, job_id: str, timeout_s: float) -> str:
        """Wait (bounded) until the job leaves PENDING/RUNNING/COMPLETING; returns its final state."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.job_state(job_id)
            if st not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return st
            time.sleep(1.0)
        raise AssertionError(f"job {job_id} still {self.job_state(job_id)} after {timeout_s:g} s")


def missing_tools() -> list[str]:
    """Slurm/munge programs the harness needs that are not installed (Debian: slurmctld slurmd slurm-client munge)."""
    return [t for t in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
            if shutil.which(t) is None]
