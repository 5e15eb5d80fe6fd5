"""ray_start_npu.sh: dry runs of the five train scripts, bad inputs, stub-ray runs (head, worker, stop) and one
real Ray head in a loopback-only network namespace. The helpers at the top (stub ``ray``/``npu-smi``/``ip``
recording their calls, fake CANN, model, parquet) are shared with test_preflight.py and test_cpu_binding.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from qwen3_rl.tools.launch.netinfo import NetError, parse_addr_show, parse_route_get
from qwen3_rl.tools.launch.ray_status import ClusterError, ClusterStatus, parse_ray_status, wait_for_cluster

from conftest import free_port
from helpers.netns import kill_mentioning, pids_mentioning

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data"
VENV_BIN = Path(sys.executable).parent  # the venv running the tests (its ray is the one the launcher uses)
PY = str(VENV_BIN / "python") if (VENV_BIN / "python").exists() else "python3"

RAY_STATUS_TEMPLATE = """======== Autoscaler status: 2026-11-21 22:20:18.934640 ========
Node status
---------------------------------------------------------------
Active:
{active}
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/{cpus}.0 CPU
 0.0/{npus}.0 NPU
 0B/15.20GiB memory
 0B/6.51GiB object_store_memory

From request_resources:
 (none)
Pending Demands:
 (no resource demands)
"""

STUB_RAY = r"""#!/usr/bin/env bash
# stub ray: records argv; 'start ... --block' stays up until SIGTERM; 'status' prints a canned status
echo "ray $*" >> "${STUB_LOG:?}"
case "$1" in
  start)
    if [[ -n "${STUB_RAY_FAIL_START:-}" ]]; then echo "ConnectionError: GCS unreachable"; exit 1; fi
    echo "Ray runtime started."
    trap 'echo "ray-stub TERM $$" >> "$STUB_LOG"; sleep "${STUB_RAY_TERM_DELAY:-0}"; echo "ray-stub exit $$" >> "$STUB_LOG"; exit 0' TERM
    while :; do sleep 0.1; done ;;
  status)
    n=${STUB_NODES:-1}
    active=""; for ((i = 0; i < n; i++)); do active+=" 1 node_$(printf '%056d' "$i")"$'\n'; done
    python3 -c 'import os, sys; t = open(os.environ["STUB_STATUS_TEMPLATE"]).read()
print(t.format(active=sys.argv[1].rstrip(), cpus=sys.argv[2], npus=sys.argv[3]), end="")' \
      "$active" "$((4 * n))" "${STUB_NPU_TOTAL:-16}"
    ;;
  stop) echo "stub: ray stop must never be called" >&2; exit 99 ;;
esac
"""

STUB_NPU_SMI = r"""#!/usr/bin/env bash
echo "npu-smi $*" >> "${STUB_LOG:?}"
case "$*" in
  "info -m") cat "${STUB_NPU_MAP:?}" ;;
  "info -t topo") cat "${STUB_NPU_TOPO:?}" ;;
  "info") cat "${STUB_NPU_INFO:?}" ;;
  *) echo "stub npu-smi: unsupported: $*" >&2; exit 2 ;;
esac
"""

# ip stub: STUB_IP_ADDRS="eth0=10.20.0.1,lo=127.0.0.1" are this node's addresses;
# STUB_IP_UNREACHABLE lists destinations without a route.
STUB_IP = r"""#!/usr/bin/env bash
echo "ip $*" >> "${STUB_LOG:?}"
IFS=',' read -ra pairs <<< "${STUB_IP_ADDRS:-lo=127.0.0.1}"
if [[ "$1 $2" == "route get" ]]; then
  dst=$3
  if [[ ",${STUB_IP_UNREACHABLE:-}," == *",$dst,"* ]]; then echo "RTNETLINK answers: Network is unreachable" >&2; exit 2; fi
  first=""
  for p in "${pairs[@]}"; do
    dev=${p%%=*}; ip=${p#*=}
    if [[ "$ip" == "$dst" ]]; then echo "local $dst dev lo table local src $dst uid 0"; exit 0; fi
    [[ -z "$first" && "$dev" != lo ]] && first="$dev $ip"
  done
  read -r dev src <<< "$first"
  echo "$dst via 10.20.0.254 dev $dev src $src uid 0"; exit 0
fi
if [[ "$*" == "-o addr show" ]]; then
  i=1
  for p in "${pairs[@]}"; do
    echo "$i: ${p%%=*}    inet ${p#*=}/24 brd 10.20.0.255 scope global ${p%%=*}\       valid_lft forever preferred_lft forever"
    i=$((i + 1))
  done
  exit 0
fi
echo "stub ip: unsupported: $*" >&2; exit 2
"""


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def make_stubs(root: Path, ray: bool = True, npu_smi: bool = True, ip: bool = True) -> Path:
    """Create ``root/bin`` with the chosen stubs; returns the bin dir."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    if ray:
        write_exe(bin_dir / "ray", STUB_RAY)
        (root / "ray_status.tpl").write_text(RAY_STATUS_TEMPLATE)
    if npu_smi:
        write_exe(bin_dir / "npu-smi", STUB_NPU_SMI)
    if ip:
        write_exe(bin_dir / "ip", STUB_IP)
    return bin_dir


def make_cann(root: Path) -> Path:
    """A fake CANN install: toolkit and ATB set_env.sh scripts exporting what the real ones export."""
    home = root / "Ascend"
    tk = home / "ascend-toolkit" / "latest"
    tk.mkdir(parents=True)
    (home / "ascend-toolkit" / "set_env.sh").write_text(
        f'export ASCEND_TOOLKIT_HOME={tk}\nexport ASCEND_HOME_PATH={tk}\n'
        f'export LD_LIBRARY_PATH={tk}/lib64:$LD_LIBRARY_PATH\n')
    (home / "nnal" / "atb").mkdir(parents=True)
    (home / "nnal" / "atb" / "set_env.sh").write_text(f"export ATB_HOME_PATH={home}/nnal/atb\n")
    (home / "driver" / "lib64").mkdir(parents=True)
    return home


def make_model(root: Path, config: str = "qwen3_32b_config.json", weights: bool = True) -> Path:
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text((DATA / config).read_text())
    if weights:
        (model / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 16)
    return model


def make_parquet(path: Path, columns: tuple[str, ...] = ("data_source", "prompt", "ability", "reward_model",
                                                          "extra_info")) -> Path:
    import pandas as pd

    row = {"data_source": "x", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "train", "index": 0}}
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{c: row[c] for c in columns}]).to_parquet(path)
    return path


def stub_env(root: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    """Environment for a launcher run: stubs first on PATH, venv python, stub data files."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "NNODES", "NPUS_PER_NODE", "MASTER_ADDR", "RAY_PORT", "SOCKET_IFNAME", "RAY_ADDRESS", "CPU_BINDING",
        "RAY_DASHBOARD", "LOG_DIR", "CANN_HOME", "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "PYTHONPATH")}
    env.update({
        "PATH": f"{bin_dir}:{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        "QWEN3_RL_PYTHON": PY,
        "STUB_LOG": str(root / "calls.log"),
        "STUB_STATUS_TEMPLATE": str(root / "ray_status.tpl"),
        "STUB_NPU_MAP": str(DATA / "npu_smi_info_m_a3.txt"),
        "STUB_NPU_TOPO": str(DATA / "npu_smi_topo_a3.txt"),
        "STUB_NPU_INFO": str(DATA / "npu_smi_info_a3.txt"),
        "LOG_DIR": str(root / "logs"),
        "TMPDIR": str(root),
    })
    env.update(extra)
    return env


def run_launcher(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "ray_start_npu.sh"), *args], env=env, text=True,
                          capture_output=True, timeout=timeout, cwd=REPO)


def calls(root: Path) -> list[str]:
    f = root / "calls.log"
    return f.read_text().splitlines() if f.is_file() else []


STANDIN_SCRIPT = r"""#!/usr/bin/env bash
# stand-in train script: same print protocol as internal/train_*.sh, small layout
set -euo pipefail
NNODES=${NNODES:-1}
NPUS_PER_NODE=${NPUS_PER_NODE:-16}
ACTOR_TP=${ACTOR_TP:-8}
overrides=(
  "data.train_files=${TRAIN_FILE:-}"
  "data.val_files=${VAL_FILE:-}"
  data.prompt_key=prompt
  "data.train_batch_size=${TRAIN_BATCH_SIZE:-32}"
  "data.max_prompt_length=${MAX_PROMPT_LENGTH:-1024}"
  "data.max_response_length=${MAX_RESPONSE_LENGTH:-2048}"
  "actor_rollout_ref.model.path=${MODEL_PATH:-}"
  "actor_rollout_ref.actor.ppo_mini_batch_size=${PPO_MINI_BATCH_SIZE:-16}"
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
  actor_rollout_ref.actor.use_dynamic_bsz=True
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096
  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=${ACTOR_TP}"
  actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1
  "actor_rollout_ref.actor.megatron.expert_model_parallel_size=${ACTOR_EP:-1}"
  "actor_rollout_ref.rollout.tensor_model_parallel_size=${ROLLOUT_TP:-8}"
  actor_rollout_ref.rollout.n=4
  actor_rollout_ref.rollout.gpu_memory_utilization=0.85
  "trainer.nnodes=${NNODES}"
  "trainer.n_gpus_per_node=${NPUS_PER_NODE}"
)
cmd=(python3 -m standin_trainer --config-name standin "${overrides[@]}" "$@")
if [[ "${QWEN3_RL_PRINT_COMMAND:-0}" == 1 ]]; then
  printf '%s\0' "${#cmd[@]}" "${cmd[@]}"; env -0; exit 0
fi
export PYTHONPATH="$(dirname "${BASH_SOURCE[0]}")${PYTHONPATH:+:${PYTHONPATH}}"
exec "${cmd[@]}"
"""


def make_standin(root: Path, module_body: str) -> Path:
    """A stand-in train script whose ``python3 -m standin_trainer`` runs ``module_body``."""
    d = root / "standin"
    d.mkdir(parents=True, exist_ok=True)
    (d / "standin_trainer.py").write_text(module_body)
    return write_exe(d / "train_standin.sh", STANDIN_SCRIPT)


def json_of(path: Path) -> dict:
    return json.loads(path.read_text())


# =================================================================================================
# tests
# =================================================================================================
# the cluster setups (the tiny CPU setups run with --device cpu: test_cpu_profile_*)
TRAIN_SCRIPTS = sorted(p.name for p in (REPO / "internal").glob("train_*.sh") if "tiny_cpu" not in p.name)
ENV_235B = str(REPO / "internal" / "qwen3_235b_env.sh")
HEAD_ADDRS = "eth0=10.20.0.1,lo=127.0.0.1"
WORKER_ADDRS = "eth0=10.20.0.5,lo=127.0.0.1"


@pytest.fixture
def stubs(tmp_path: Path):
    root = tmp_path
    bin_dir = make_stubs(root)
    return root, bin_dir


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


# ---- parsers ------------------------------------------------------------------------------------
def test_parse_ray_status_recorded_and_old_format():
    st = parse_ray_status(RAY_STATUS_TEMPLATE.format(active=" 1 node_a\n 1 node_b", cpus="8", npus="32"))
    assert (st.active_nodes, st.pending_nodes) == (2, 0)
    assert st.totals == {"CPU": 8.0, "NPU": 32.0}
    old = ("======== Autoscaler status ========\nNode status\n-----\nActive:\n 3 ray.worker.npu\n 1 ray.head\n"
           "Pending:\n 2 ray.worker.npu, 1 launching\nRecent failures:\n (no failures)\n\nResources\n-----\n"
           "Usage:\n 2.0/64.0 CPU\n 16.0/48.0 NPU\n 0B/1.00GiB memory\n\nDemands:\n (no resource demands)\n")
    st = parse_ray_status(old)
    assert (st.active_nodes, st.pending_nodes, st.totals["NPU"]) == (4, 2, 48.0)
    with pytest.raises(ClusterError, match="no 'Active:'"):
        parse_ray_status("Ray is not running")


def test_wait_for_cluster_counts_nodes_and_npus_and_times_out():
    seq = iter([ClusterStatus(1, 0, {"NPU": 16.0}), ClusterStatus(2, 0, {"NPU": 16.0}),
                ClusterStatus(2, 0, {"NPU": 32.0})])
    t = [0.0]
    logs: list[str] = []
    st = wait_for_cluster(lambda: next(seq), 2, 16, 100, 1, log=logs.append, clock=lambda: t[0],
                          sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert st.totals["NPU"] == 32.0 and t[0] == 2.0
    assert logs[-1] == "cluster: 2/2 nodes, 32/32 NPU registered"
    with pytest.raises(ClusterError, match=r"within 3 s: 1/8 nodes, 16/128 NPU registered"):
        wait_for_cluster(lambda: ClusterStatus(1, 0, {"NPU": 16.0}), 8, 16, 3, 1, log=lambda m: None,
                         clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    with pytest.raises(ClusterError, match="local 'ray start' exited"):
        wait_for_cluster(lambda: ClusterStatus(1, 0, {}), 1, 16, 3, alive=lambda: False, log=lambda m: None)


def test_parse_ip_outputs():
    r = parse_route_get("10.0.0.7 via 10.0.0.1 dev eth0 src 10.0.0.5 uid 0 \n    cache \n")
    assert (r.local, r.dev, r.src) == (False, "eth0", "10.0.0.5")
    r = parse_route_get("local 10.0.0.5 dev lo table local src 10.0.0.5 uid 0\n    cache <local>\n")
    assert (r.local, r.dev) == (True, "lo")
    addrs = parse_addr_show(
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
        "2: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever\n"
        "2: eth0    inet6 fd00::2/64 scope global \\       valid_lft forever preferred_lft forever\n"
        "5: bond0.100@bond0    inet 10.1.1.1/16 scope global bond0.100\n")
    assert addrs == {"lo": ["127.0.0.1"], "eth0": ["192.0.2.2", "fd00::2"], "bond0.100": ["10.1.1.1"]}
    with pytest.raises(NetError):
        parse_route_get("RTNETLINK answers: Network is unreachable")


# ---- dry runs of the five train scripts -----------------------------------------------------------
@pytest.mark.parametrize("nnodes", [1, 8])
@pytest.mark.parametrize("script", TRAIN_SCRIPTS)
def test_dry_run_prints_full_plan(stubs, script: str, nnodes: int):
    root, bin_dir = stubs
    env = stub_env(root, bin_dir, STUB_IP_ADDRS=HEAD_ADDRS)
    args = [f"internal/{script}", *([ENV_235B] if "235b" in script else []), "--nnodes", str(nnodes), "--dry-run"]
    if nnodes > 1:
        args += ["--master-addr", "10.20.0.1"]
    p = run_launcher(args, env)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    ip = "10.20.0.1" if nnodes > 1 else "127.0.0.1"
    assert f"cluster:     {nnodes} node(s) x 16 NPUs = {16 * nnodes} NPUs; head {ip}:6379" in out
    assert f"ray start --head --port=6379 --node-ip-address={ip} '--resources={{\"NPU\": 16}}'" in out
    assert "--include-dashboard=false --block > " in out
    assert f"wait until {nnodes} node(s) and {16 * nnodes} NPU are registered" in out
    if "fully_async" in script:  # the trainer's and the rollout's dies share each node
        train = re.search(r"\n        trainer\.n_gpus_per_node=(\d+)\n", out)
        roll = re.search(r"\n        rollout\.n_gpus_per_node=(\d+)\n", out)
        assert train and roll and int(train.group(1)) + int(roll.group(1)) == 16, out
        assert f"        trainer.nnodes={nnodes}\n" in out and f"        rollout.nnodes={nnodes}\n" in out
    else:
        assert f"        trainer.nnodes={nnodes}\n" in out and "        trainer.n_gpus_per_node=16\n" in out
    assert "final command: python3 -m " in out
    assert f"  NNODES={nnodes}\n" in out and f"  RAY_ADDRESS={ip}:6379\n" in out
    assert f"  HCCL_SOCKET_IFNAME={'eth0' if nnodes > 1 else 'lo'}\n" in out
    if "235b" in script:
        assert "  HCCL_CONNECT_TIMEOUT=1800\n" in out  # the env script's value wins over npu_env.sh's default
    assert "preflight (a real launch stops on errors):" in out
    assert "error: [npu]" not in out  # stub npu-smi shows the 16 dies
    assert not [c for c in calls(root) if c.startswith("ray ")], "dry run must not run ray"


def test_dry_run_worker_and_dashboard(stubs):
    root, bin_dir = stubs
    env = stub_env(root, bin_dir, STUB_IP_ADDRS=WORKER_ADDRS, RAY_DASHBOARD="1")
    p = run_launcher(["internal/train_grpo_qwen3_32b_32die_true_weight.sh", "--nnodes", "2", "--master-addr",
                      "10.20.0.1", "--port", "6380", "--dry-run"], env)
    assert p.returncode == 0, p.stderr
    assert "role:        worker" in p.stdout
    assert "ray start --address=10.20.0.1:6380 --node-ip-address=10.20.0.5" in p.stdout
    assert "this node:   10.20.0.5 on interface eth0" in p.stdout
    assert "note:        --dashboard only applies on the head" in p.stdout
    assert "stay while 10.20.0.1:6380 answers" in p.stdout
    assert "pin set:     seed (PIN_SET; pins.toml)" in p.stdout  # the default set, reported
    # head with the dashboard: bound to loopback unless told otherwise
    env = stub_env(root, bin_dir, STUB_IP_ADDRS=HEAD_ADDRS)
    p = run_launcher(["internal/train_grpo_qwen3_32b_32die_true_weight.sh", "--dashboard", "--dry-run"], env)
    assert "--include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port=8265" in p.stdout
    p = run_launcher(["internal/train_grpo_qwen3_32b_32die_true_weight.sh", "--dashboard", "--dashboard-host",
                      "0.0.0.0", "--dry-run"], env)
    assert "reachable from the network" in p.stdout


def test_help(stubs):
    root, bin_dir = stubs
    p = run_launcher(["--help"], stub_env(root, bin_dir))
    assert p.returncode == 0 and "--nnodes" in p.stdout and "[NNODES; default 1]" in p.stdout


# ---- bad inputs: one clear error line each --------------------------------------------------------
S32 = "internal/train_grpo_qwen3_32b_32die_true_weight.sh"
BAD_INPUTS = [
    ("no-script", [], {}, "missing TRAIN_SCRIPT"),
    ("missing-script", ["internal/nope.sh"], {}, "train script not found: internal/nope.sh"),
    ("missing-env-script", [S32, "internal/nope_env.sh"], {}, "env script not found: internal/nope_env.sh"),
    ("zero-nodes", [S32, "--nnodes", "0"], {}, "--nnodes=0 must be >= 1"),
    ("nodes-not-int", [S32, "--nnodes", "two"], {}, "--nnodes='two' is not an integer"),
    ("env-nodes-bad", [S32], {"NNODES": "8x"}, "NNODES='8x' is not an integer"),
    ("npus-zero", [S32, "--npus-per-node", "0"], {}, "--npus-per-node=0 must be in 1..64"),
    ("port-range", [S32, "--port", "70000"], {}, "--port=70000 must be in 1..65535"),
    ("multi-node-no-master", [S32, "--nnodes", "2"], {}, "--master-addr (or MASTER_ADDR) is required with 2 nodes"),
    ("multi-node-loopback", [S32, "--nnodes", "2", "--master-addr", "127.0.0.1"], {}, "is a loopback address"),
    ("unknown-option", [S32, "--nodes", "2"], {}, "unrecognized arguments: --nodes 2"),
    ("bad-ifname", [S32, "--ifname", "ib7"], {}, "interface 'ib7' not found or has no address"),
    ("unreachable-master", [S32, "--nnodes", "2", "--master-addr", "10.99.0.1"], {"STUB_IP_UNREACHABLE": "10.99.0.1"},
     "master 10.99.0.1 is unreachable from this node: RTNETLINK answers: Network is unreachable"),
    ("unresolvable-master", [S32, "--nnodes", "2", "--master-addr", "no-such-head.invalid"], {},
     "cannot resolve master address 'no-such-head.invalid'"),
    ("bad-timeout", [S32, "--timeout", "-5"], {}, "--timeout=-5 must be > 0"),
    ("bad-role", [S32, "--role", "boss"], {}, "--role='boss' must be auto, head or worker"),
    ("head-role-remote", [S32, "--nnodes", "2", "--master-addr", "10.20.0.9", "--role", "head"], {},
     "--role head but the master address 10.20.0.9 is not an address of this node"),
    ("bad-dashboard-host", [S32, "--dashboard", "--dashboard-host", "everywhere"], {},
     "--dashboard-host='everywhere' is not an IP address"),
    ("bad-bool-env", [S32], {"CPU_BINDING": "maybe"}, "CPU_BINDING='maybe' must be 0 or 1"),
    ("dry-run-and-stop", [S32, "--dry-run", "--stop"], {}, "--dry-run and --stop cannot be combined"),
    ("bad-pin-set", [S32, "--dry-run"], {"PIN_SET": "newest"}, "PIN_SET='newest' is not a pin set of pins.toml"),
    ("script-fails", ["internal/train_grpo_qwen3_235b_128die_true_weight.sh"], {"ROLLOUT_TP": "0"},
     "failed in print mode"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_one_line_error(stubs, case):
    _, args, extra, expected = case
    root, bin_dir = stubs
    p = run_launcher(args, stub_env(root, bin_dir, STUB_IP_ADDRS=HEAD_ADDRS, **extra))
    assert p.returncode != 0
    errs = _errors(p.stderr)
    assert len(errs) == 1, p.stderr
    assert expected in errs[0], errs[0]
    assert not [c for c in calls(root) if c.startswith("ray start")]


def test_missing_cann_is_one_line_error(stubs):
    root, bin_dir = stubs
    env = stub_env(root, bin_dir, CANN_HOME=str(root / "no_cann"))
    p = run_launcher([S32, "--no-preflight"], env)
    assert p.returncode == 1
    errs = _errors(p.stderr)
    assert errs == [f"error: CANN toolkit not found: {root}/no_cann/ascend-toolkit/set_env.sh (nor "
                    f"{root}/no_cann/cann/ascend-toolkit/set_env.sh); set --cann-home or CANN_HOME"]
    assert not [c for c in calls(root) if c.startswith("ray start")]


def test_worker_cannot_reach_head(stubs):
    root, bin_dir = stubs
    port = free_port()  # nothing listens there
    env = stub_env(root, bin_dir, CANN_HOME=str(make_cann(root)))
    p = run_launcher([S32, "--role", "worker", "--master-addr", "127.0.0.1", "--port", str(port), "--no-preflight",
                      "--join-retries", "2", "--join-interval", "0.1"], env)
    assert p.returncode == 1
    assert _errors(p.stderr) == [f"error: head 127.0.0.1:{port} not reachable after 2 attempts: start the head "
                                 "first, check --master-addr/--port and the firewall"]
    assert not [c for c in calls(root) if c.startswith("ray start")]


# ---- launcher runs with stub ray ----------------------------------------------------------------
def _good_files(root: Path) -> dict[str, str]:
    return {"MODEL_PATH": str(make_model(root)), "TRAIN_FILE": str(make_parquet(root / "d" / "train.parquet")),
            "VAL_FILE": str(make_parquet(root / "d" / "val.parquet")), "CANN_HOME": str(make_cann(root))}


EXIT3 = "import os, sys\nprint('standin: RAY_ADDRESS=' + os.environ['RAY_ADDRESS'], flush=True)\nsys.exit(3)\n"


def test_head_run_with_stubs_tees_log_and_returns_training_exit_code(stubs):
    root, bin_dir = stubs
    script = make_standin(root, EXIT3)
    env = stub_env(root, bin_dir, **_good_files(root))
    p = run_launcher([str(script), "--no-preflight", "--timeout", "10"], env)
    assert p.returncode == 3, p.stderr
    c = calls(root)
    starts = [x for x in c if x.startswith("ray start")]
    assert starts == ['ray start --head --port=6379 --node-ip-address=127.0.0.1 --resources={"NPU": 16} '
                      '--disable-usage-stats --include-dashboard=false --block']
    assert "ray status --address 127.0.0.1:6379" in c
    assert any(x.startswith("ray-stub TERM") for x in c), "the launcher must stop the Ray it started"
    assert not any(x.startswith("ray stop") for x in c)
    log = root / "logs" / "train_standin_head_127.0.0.1.log"
    assert "standin: RAY_ADDRESS=127.0.0.1:6379" in log.read_text()
    assert "training exited with code 3" in p.stdout
    assert not (root / "logs" / ".ray_start_npu_head_6379.pid").exists()


def test_head_preflight_failure_stops_before_ray(stubs):
    root, bin_dir = stubs
    script = make_standin(root, EXIT3)
    env = stub_env(root, bin_dir, **_good_files(root), ACTOR_TP="3", TRAIN_BATCH_SIZE="30")
    p = run_launcher([str(script), "--timeout", "10"], env)
    assert p.returncode == 1
    assert "error: [layout] actor TP3 x PP1 x CP1 = 3 does not divide the world size 16" in p.stderr
    assert "error: [batch] data.train_batch_size 30 is not a multiple of ppo_mini_batch_size 16" in p.stderr
    assert "error: preflight failed" in p.stderr
    assert not [c for c in calls(root) if c.startswith("ray start")]


def test_head_times_out_when_nodes_missing(stubs):
    root, bin_dir = stubs
    script = make_standin(root, EXIT3)
    env = stub_env(root, bin_dir, **_good_files(root), STUB_NODES="1", STUB_NPU_TOTAL="16")
    env["STUB_IP_ADDRS"] = HEAD_ADDRS  # two nodes need a non-loopback master: the stub ip gives us 10.20.0.1
    p = run_launcher([str(script), "--nnodes", "2", "--master-addr", "10.20.0.1", "--no-preflight", "--timeout", "1"],
                     env)
    assert p.returncode == 1
    assert _errors(p.stderr) == ["error: cluster did not assemble within 1 s: 1/2 nodes, 16/32 NPU registered"]
    assert any(x.startswith("ray-stub TERM") for x in calls(root))


def test_worker_joins_and_leaves_when_head_goes(stubs):
    root, bin_dir = stubs
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.close()
            except OSError:
                pass
        srv.close()

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    env = stub_env(root, bin_dir, CANN_HOME=str(make_cann(root)))
    # the head's token file, as a head on shared storage leaves it (the worker waits for it before joining)
    (root / "logs").mkdir(exist_ok=True)
    (root / "logs" / f".ray_auth_token_{port}").write_text("ab" * 32)
    proc = subprocess.Popen(["bash", str(REPO / "ray_start_npu.sh"), S32, "--role", "worker", "--master-addr",
                             "127.0.0.1", "--port", str(port), "--no-preflight", "--watch-interval", "0.2",
                             "--watch-misses", "2"], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    try:
        deadline = time.time() + 20
        while time.time() < deadline and not [c for c in calls(root) if c.startswith("ray start")]:
            time.sleep(0.1)
        time.sleep(1.0)
        assert proc.poll() is None, "worker must stay while the head answers"
        stop.set()  # the head goes away
        out, err = proc.communicate(timeout=20)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    c = calls(root)
    assert [x for x in c if x.startswith("ray start")] == [
        f'ray start --address=127.0.0.1:{port} --node-ip-address=127.0.0.1 --resources={{"NPU": 16}} '
        "--disable-usage-stats --block"]
    assert "is gone (2 failed checks); leaving" in out
    assert any(x.startswith("ray-stub TERM") for x in c)


def test_stop_stops_only_this_launcher(stubs):
    root, bin_dir = stubs
    script = make_standin(root, "import time\nprint('standin: training', flush=True)\ntime.sleep(60)\n")
    env = stub_env(root, bin_dir, **_good_files(root))
    proc = subprocess.Popen(["bash", str(REPO / "ray_start_npu.sh"), str(script), "--no-preflight"], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        log = root / "logs" / "train_standin_head_127.0.0.1.log"
        deadline = time.time() + 30
        while time.time() < deadline and not (log.is_file() and "standin: training" in log.read_text()):
            time.sleep(0.1)
        assert log.is_file(), "training did not start"
        p = run_launcher([str(script), "--stop"], env)
        assert p.returncode == 0, p.stderr
        assert "sending SIGTERM to the launcher" in p.stdout
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143
    assert any(x.startswith("ray-stub TERM") for x in calls(root))
    p = run_launcher([str(script), "--stop"], env)
    assert p.returncode == 0 and "nothing to stop" in p.stdout



def test_repeated_sigterm_does_not_cut_the_stops_short(stubs):
    """scancel sends SIGTERM again while the launcher stops what it started (the clean-clone CI saw a worker's
    launcher die mid-stop and its ``ray start`` outlive the job). Here Ray takes 3 s to stop and the launcher gets
    three more SIGTERMs meanwhile: it still waits for Ray, removes its pid file and exits 143 by its own trap."""
    root, bin_dir = stubs
    script = make_standin(root, "import time\nprint('standin: training', flush=True)\ntime.sleep(60)\n")
    env = stub_env(root, bin_dir, **_good_files(root), STUB_RAY_TERM_DELAY="3")
    proc = subprocess.Popen(["bash", str(REPO / "ray_start_npu.sh"), str(script), "--no-preflight"], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    pidfile = root / "logs" / ".ray_start_npu_head_6379.pid"
    try:
        log = root / "logs" / "train_standin_head_127.0.0.1.log"
        deadline = time.time() + 30
        while time.time() < deadline and not (log.is_file() and "standin: training" in log.read_text()):
            time.sleep(0.1)
        assert log.is_file() and pidfile.is_file(), "training did not start"
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while time.time() < deadline and not any(x.startswith("ray-stub TERM") for x in calls(root)):
            time.sleep(0.05)
        assert any(x.startswith("ray-stub TERM") for x in calls(root)), "the launcher never stopped its Ray"
        for _ in range(3):  # while Ray is still stopping
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (proc.returncode, out[-2000:], err[-2000:])
    c = calls(root)
    term = [x.split()[-1] for x in c if x.startswith("ray-stub TERM")]
    assert [x.split()[-1] for x in c if x.startswith("ray-stub exit")] == term, c  # Ray finished stopping
    assert not pidfile.exists(), "the launcher died before its clean-up ended"


# ---- one real Ray head, confined to a network namespace with only loopback ---------------------------
RAY_STANDIN = r"""
import os, socket, sys
import ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
res = ray.cluster_resources()
@ray.remote(num_cpus=0, resources={"NPU": 1})
def where():
    return ray.util.get_node_ip_address(), os.getpid()
ip, pid = ray.get(where.remote())
nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
print(f"standin: NPU={res.get('NPU')} task_ip={ip} nodes={nodes} ifaces={sorted(socket.if_nameindex())}",
      flush=True)
ray.shutdown()
sys.exit(7)
"""


def _netns_prefix() -> list[str] | None:
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "--net", "--map-root-user", "true"], capture_output=True)
    if probe.returncode != 0:
        probe = subprocess.run([unshare, "--net", "true"], capture_output=True)
        return [unshare, "--net"] if probe.returncode == 0 else None
    return [unshare, "--net", "--map-root-user"]


def test_real_ray_head_in_loopback_namespace(tmp_path: Path):
    """ray_start_npu.sh with the real ray (pins.toml runtime.ray): head with a fake NPU resource inside a fresh
    network namespace (only lo), waits, runs a stand-in train script that runs an NPU task, exits with its code,
    and leaves no Ray process behind. Token auth is on (an NPU-profile run): the launcher's own cluster check and
    the training use the head's token file, not the stale ``~/.ray/auth_token`` the home holds.

    The node is left as found: Ray's ``ray_current_cluster`` (under ``$TMPDIR/ray``, no --temp-dir) is gone after
    the launcher exits, so a bare ``ray.init(num_cpus=1)`` afterwards on the same node starts its own Ray instead
    of attaching to the dead cluster ("When connecting to an existing cluster, num_cpus and num_gpus must not be
    provided" before the fix)."""
    ray_bin = VENV_BIN / "ray"
    if not ray_bin.exists():
        pytest.skip(f"no ray in the test venv ({ray_bin})")
    prefix = _netns_prefix()
    if prefix is None:
        pytest.skip("cannot create a network namespace here (unshare --net failed); the real-Ray test needs one "
                    "to keep Ray's traffic on loopback")
    root = Path(tempfile.mkdtemp(prefix="q3rl", dir="/tmp"))  # short: Ray's unix socket paths are length-limited
    try:
        bin_dir = make_stubs(root, ray=False, npu_smi=False, ip=False)
        script = make_standin(root, RAY_STANDIN)
        env = stub_env(root, bin_dir, CANN_HOME=str(make_cann(root)), RAY_DEDUP_LOGS="0")
        env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
        (root / "home" / ".ray").mkdir(parents=True)
        (root / "home" / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
        env["HOME"] = str(root / "home")
        env.pop("RAY_AUTH_MODE", None)
        temp_dir = root / "ray"  # Ray's default under TMPDIR=root (stub_env): where a bare ray.init() looks
        port = 6379  # a fresh namespace: every port is free
        fresh = ("import ray; ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80_000_000, "
                 "logging_level='ERROR'); print('fresh ray.init:', ray.cluster_resources().get('CPU')); ray.shutdown()")
        cmd = (f"ip link set lo up && {{ bash {REPO}/ray_start_npu.sh {script} --no-preflight --timeout 60 "
               f"--port {port} --ray-arg=--num-cpus=1 --ray-arg=--object-store-memory=100000000"
               f" --log-dir {root}/logs; rc=$?; }}; {VENV_BIN / 'python'} -c \"{fresh}\"; exit $rc")
        t0 = time.time()
        p = subprocess.run([*prefix, "bash", "-c", cmd], env=env, text=True, capture_output=True, timeout=150,
                           cwd=REPO)
        took = time.time() - t0
        log = (root / "logs" / "train_standin_head_127.0.0.1.log")
        text = log.read_text() if log.is_file() else ""
        assert p.returncode == 7, f"{p.stdout}\n{p.stderr}\n{text}"
        # Ray wrote its address file for the launch's cluster, and the launcher removed it once that Ray stopped
        assert f"removed {temp_dir}/ray_current_cluster (it pointed at this launch's stopped cluster" in p.stdout
        assert "fresh ray.init: 1.0" in p.stdout, p.stderr[-3000:]
        assert "When connecting to an existing cluster" not in p.stderr
        assert f"Ray auth: new cluster token in {root}/logs/.ray_auth_token_{port}" in p.stdout
        assert not (root / "logs" / f".ray_auth_token_{port}").exists(), "the head left its token file"
        assert "standin: NPU=16.0 task_ip=127.0.0.1 nodes=['127.0.0.1']" in text
        assert "'lo'" in text and "'eth" not in text
        assert "cluster ready: 1 node(s), 16 NPU" in p.stdout
        assert "training exited with code 7" in p.stdout
        time.sleep(0.5)
        left = pids_mentioning(str(temp_dir))
        assert left == [], f"Ray processes left behind: {left}"
        print(f"real-ray launch took {took:.1f} s")
    finally:
        kill_mentioning(str(root / "ray"))
        shutil.rmtree(root, ignore_errors=True)



# ---- CPU profile (--device cpu): the tiny CPU training run on a node without NPUs ----------------------------

TINY = "internal/train_grpo_tiny_cpu.sh"


def test_cpu_profile_refused_on_a_node_with_npus(stubs):
    root, bin_dir = stubs  # the stub npu-smi lists an A3's 16 dies
    p = run_launcher([TINY, "--device", "cpu", "--npus-per-node", "2", "--dry-run"], stub_env(root, bin_dir))
    assert p.returncode != 0
    assert _errors(p.stderr) == ["error: --device=cpu is for nodes without NPUs, but npu-smi lists 16 NPU die(s) "
                                 "on this node: launch without it"], p.stderr
    p = run_launcher([TINY, "--npus-per-node", "2", "--dry-run"], stub_env(root, bin_dir, LAUNCH_DEVICE="gpu"))
    assert _errors(p.stderr) == ["error: LAUNCH_DEVICE='gpu' must be npu or cpu"], p.stderr


def test_cpu_profile_npu_device_files_refused(tmp_path, monkeypatch):
    from qwen3_rl.tools.launch.options import cpu_profile_error

    monkeypatch.setenv("PATH", str(make_stubs(tmp_path, ray=False, npu_smi=False, ip=False)))
    assert cpu_profile_error(str(tmp_path)) == ""
    (tmp_path / "davinci0").touch()
    assert cpu_profile_error(str(tmp_path)) == f"this node has NPU devices ({tmp_path}/davinci0)"


def test_cpu_profile_dry_run_without_cann(tmp_path):
    """No npu-smi, no CANN: the plan skips CANN, preflight runs without node checks, Ray gets worker slots."""
    bin_dir = make_stubs(tmp_path, npu_smi=False)
    env = stub_env(tmp_path, bin_dir, CANN_HOME=str(tmp_path / "no_cann"), MODEL_PATH=str(make_model(tmp_path)))
    p = run_launcher([TINY, "--device", "cpu", "--npus-per-node", "2", "--dry-run"], env)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "1 node(s) x 2 worker slots = 2 worker slots; head 127.0.0.1:6379 (CPU profile: no NPU)" in out
    assert "--check=skip  (CPU profile: CANN not sourced" in out
    assert "--npus-per-node 2 --role head --no-node-checks" in out
    ray_line = next(ln for ln in out.splitlines() if " ray start --head" in ln or "ray start --head" in ln)
    assert '--resources={"NPU": 2}' in ray_line and "--num-cpus=" in ray_line
    assert "CANN toolkit not found" not in p.stderr


def test_npu_env_check_skip_exports_without_cann(tmp_path):
    script = (f'set -euo pipefail; CANN_HOME={tmp_path}/none; source {REPO}/internal/npu_env.sh --check=skip; '
              'echo "NZ=${VLLM_ASCEND_ENABLE_NZ} HCCL=${HCCL_CONNECT_TIMEOUT}"')
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.strip() == "NZ=0 HCCL=1200"
