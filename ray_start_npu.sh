#!/usr/bin/env bash
# Start (head) or join (worker) the Ray cluster on this node and, on the head, run a train script.
# Run the same command on every node:
#
#   bash ray_start_npu.sh TRAIN_SCRIPT [ENV_SCRIPT] [--nnodes N] [--master-addr HEAD_IP] [options] [-- overrides]
#
# `bash ray_start_npu.sh --help` lists the options (each falls back to an environment variable).
# The steps' logic lives in `python -m qwen3_rl launch ...` (qwen3_rl/tools/launch/cli.py); this file only
# sequences them, owns the processes it starts and stops exactly those (by PID) on exit.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY=${QWEN3_RL_PYTHON:-python3}

q3() { PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}" "$PY" -m qwen3_rl "$@"; }
say() { echo "[ray_start_npu] $*"; }
die() { echo "error: $*" >&2; exit 1; }

PLAN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/ray_start_npu.XXXXXX")
RAY_PID="" TRAIN_PID="" BINDER_PID="" WATCH_PID="" OOM_PID="" OWN_PIDFILE="" OWN_TOKEN=""

stop_pid() {  # stop_pid PID NAME GRACE_S: SIGTERM, bounded wait, then SIGKILL to its own process group
  local pid=$1 name=$2 grace=$3 i
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
  say "stopping ${name} (pid ${pid})"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < grace * 5; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then
    say "${name} (pid ${pid}) ignored SIGTERM for ${grace} s; SIGKILL to its process group"
    kill -KILL -- "-${pid}" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  stop_group "$pid" "$name"
}

# stop_group PGID NAME: what is left of a process group this launcher created with setsid after its leader
# exited. Seen with Ray 2.60 on a worker whose head is gone: the raylet is SIGKILLed while unregistering
# from the dead GCS, and its dashboard/runtime-env agents (same group) linger ~60 s. A group id is not
# reused while the group has members, so this only reaches processes started under this launcher.
stop_group() {
  local pgid=$1 name=$2 i
  kill -0 -- "-${pgid}" 2>/dev/null || return 0
  say "${name}: processes of its group ${pgid} outlived it; SIGTERM to the group"
  kill -TERM -- "-${pgid}" 2>/dev/null || true
  for ((i = 0; i < 25; i++)); do
    kill -0 -- "-${pgid}" 2>/dev/null || return 0
    sleep 0.2
  done
  say "${name}: group ${pgid} still running after 5 s; SIGKILL to the group"
  kill -KILL -- "-${pgid}" 2>/dev/null || true
}

# shellcheck disable=SC2329  # invoked by the EXIT trap
# The stops take at most 25 + 5 + 2 + 5 + 20 s (+ 5 s per group left behind): under Slurm's KillWait (>= 60 s, launch.md),
# after which Slurm SIGKILLs this launcher and a Ray of its own process group (setsid) would be left running. A
# worker's `ray start --block` whose head is already gone can ignore SIGTERM until then (seen after scancel).
cleanup() {
  local rc=$?
  # A repeated signal must not cut the stops short: Slurm's scancel sends SIGTERM again while this runs, and with
  # the default action back the launcher died mid-stop, leaving a worker's `ray start` (own process group) behind.
  trap - EXIT
  trap '' INT TERM HUP
  if [[ -n "$TRAIN_PID" ]] && kill -0 "$TRAIN_PID" 2>/dev/null; then
    kill -TERM -- "-${TRAIN_PID}" 2>/dev/null || true   # the training's own process group
    stop_pid "$TRAIN_PID" "training" 25
  fi
  stop_pid "$WATCH_PID" "head watcher" 5
  stop_pid "$OOM_PID" "memory-kill watcher" 2
  stop_pid "$BINDER_PID" "cpu binder" 5
  stop_pid "$RAY_PID" "ray (started by this launcher)" 20
  [[ -n "$RAY_PID" ]] && { q3 launch address-file restore --plan-dir "$PLAN_DIR" || true; }   # Ray's ray_current_cluster
  [[ -n "$OWN_TOKEN" ]] && rm -f "$OWN_TOKEN"
  [[ -n "$OWN_PIDFILE" ]] && rm -f "$OWN_PIDFILE"
  rm -rf "$PLAN_DIR"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# 0. CPU profile (--device cpu): the engine environment and the patched trees `bash setup_cpu.sh` made (PATH,
#    PYTHONPATH, the device layer), or one line naming that command
q3 cpu-env --launcher-args "$@" > "$PLAN_DIR/cpu.env" || exit 1
while IFS= read -r -d '' kv; do export "${kv%%=*}=${kv#*=}"; done < "$PLAN_DIR/cpu.env"
PY=${QWEN3_RL_PYTHON:-python3}

# 1. options -> plan (one-line errors for every bad input)
q3 launch resolve --plan-dir "$PLAN_DIR" "$@" || exit $?
declare -A P=()
while IFS= read -r -d '' kv; do P[${kv%%=*}]=${kv#*=}; done < "$PLAN_DIR/vars"
[[ "${P[MODE]}" == help ]] && exit 0
if [[ "${P[MODE]}" == stop ]]; then
  q3 launch stop --plan-dir "$PLAN_DIR"
  exit $?
fi
mapfile -d '' RAY_START < "$PLAN_DIR/ray_start.argv"
mapfile -d '' TRAIN_CMD < "$PLAN_DIR/train.argv"
DRY=$([[ "${P[MODE]}" == dry-run ]] && echo 1 || echo 0)

# 2. environment: setup env script, then CANN/HCCL (paths checked), then the launcher's own exports
export NNODES=${P[NNODES]} NPUS_PER_NODE=${P[NPUS_PER_NODE]} SOCKET_IFNAME=${P[IFNAME]}
export CANN_HOME=${P[CANN_HOME]} RAY_ADDRESS=${P[RAY_ADDRESS]}
# Ray token auth, one explicit mode for every Ray process of the run (ray start, ray status, the training):
# on, with one token per cluster, except a CPU-profile run on loopback (options.py _auth; docs/launch.md)
export RAY_AUTH_MODE=${P[AUTH_MODE]}
[[ -n "${P[AUTH_TOKEN_FILE]}" ]] && export RAY_AUTH_TOKEN_PATH=${P[AUTH_TOKEN_FILE]}
if [[ -n "${P[ENV_SCRIPT]}" ]]; then
  set -a
  # shellcheck source=/dev/null
  source "${P[ENV_SCRIPT]}"
  set +a
fi
if [[ "${P[DEVICE]}" == cpu ]]; then
  NPU_ENV_CHECK=skip   # CPU profile: no CANN on this node; the file's other settings still apply
elif [[ $DRY == 1 ]]; then
  NPU_ENV_CHECK=warn
else
  NPU_ENV_CHECK=strict
fi
# shellcheck source=/dev/null
source "${P[NPU_ENV]}" "--check=${NPU_ENV_CHECK}" || exit 1

if [[ $DRY == 1 ]]; then
  q3 launch show --plan-dir "$PLAN_DIR"
  exit $?
fi

# 2c. head, SAM_COST_TABLE=calibrate: the rollout engine's verification-cost table (dummy weights, this node's
#     devices, before Ray starts), handed to training as SAM_COST_TABLE=<file> (docs/sam_decoding.md)
if [[ "${P[ROLE]}" == head ]]; then
  mkdir -p "${P[LOG_DIR]}"
  q3 launch calibrate --train-script "${P[TRAIN_SCRIPT]}" --out "${P[LOG_DIR]}/verify_cost_table.json" \
    --env-out "$PLAN_DIR/calibrate.env" || die "SAM_COST_TABLE=calibrate failed (see above)"
  while IFS= read -r -d '' kv; do export "${kv%%=*}=${kv#*=}"; done < "$PLAN_DIR/calibrate.env"
fi

# 3. preflight (all problems at once) before anything starts; with --no-preflight still the environment
#    contract (env vars / engine keys the pinned upstream refuses at start-up or wake-up; no file or node access)
pre=(q3 preflight "${P[TRAIN_SCRIPT]}" --npu-env "${P[NPU_ENV]}" --nnodes "${P[NNODES]}"
     --npus-per-node "${P[NPUS_PER_NODE]}" --role "${P[ROLE]}")
[[ "${P[DEVICE]}" == cpu ]] && pre+=(--no-node-checks)   # no npu-smi / CANN / patch workspace on a CPU node
[[ -n "${P[ENV_SCRIPT]}" ]] && pre+=(--env-script "${P[ENV_SCRIPT]}")
extra=()
((${#TRAIN_CMD[@]} > 2)) && extra=(-- "${TRAIN_CMD[@]:2}")
if [[ "${P[PREFLIGHT]}" == 1 ]]; then
  "${pre[@]}" "${extra[@]}" || die "preflight failed (see above); fix it or pass --no-preflight"
else
  "${pre[@]}" --env-only "${extra[@]}" || die "the environment breaks the pinned upstream's contract (see above)"
fi

mkdir -p "${P[LOG_DIR]}"
if [[ -f "${P[PIDFILE]}" ]] && kill -0 "$(cut -d' ' -f1 "${P[PIDFILE]}")" 2>/dev/null; then
  die "a launcher is already running here for port ${P[PORT]} (${P[PIDFILE]}); stop it with --stop"
fi

# 4. CPU binding (optional): the map is printed, a binder process applies it to NPU processes
if [[ "${P[CPU_BINDING]}" == 1 ]]; then
  q3 launch cpu-map --plan-dir "$PLAN_DIR" --out "$PLAN_DIR/cpu_map.json" || exit 1
  cp "$PLAN_DIR/cpu_map.json" "${P[LOG_DIR]}/cpu_map_${P[ROLE]}_${P[NODE_IP]}.json"
  PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}" setsid "$PY" -m qwen3_rl launch cpu-bind --map "$PLAN_DIR/cpu_map.json" --parent-pid $$ \
    >> "${P[LOG_DIR]}/cpu_bind_${P[NODE_IP]}.log" 2>&1 &
  BINDER_PID=$!
fi

start_ray() {  # start this node's Ray in its own session; returns non-zero if it does not come up
  say "$(printf '%q ' "${RAY_START[@]}")> ${P[RAY_LOG]}"
  q3 launch address-file save --plan-dir "$PLAN_DIR"
  setsid "${RAY_START[@]}" > "${P[RAY_LOG]}" 2>&1 < /dev/null &
  RAY_PID=$!
  OWN_PIDFILE=${P[PIDFILE]}
  echo "$$ $RAY_PID" > "$OWN_PIDFILE"
  q3 launch wait-started --log "${P[RAY_LOG]}" --pid "$RAY_PID" --timeout 180
}

# watch_oom UNTIL_PID: report Ray memory-monitor kills on this node; the head's also reads the GCS actor table for
# actors that died for good on any node (OOM, crash; ray_actors.py) and exits 1 on the first loss
watch_oom() {
  [[ "${P[OOM_WATCH]}" == 1 ]] || return 0
  q3 launch watch-oom --plan-dir "$PLAN_DIR" --ray-pid "$RAY_PID" --until "$1" &
  OOM_PID=$!
}

if [[ "${P[ROLE]}" == head ]]; then
  # 5h. head: start, wait (bounded) for every node's NPUs, run the training with its log teed
  if [[ "${P[AUTH_TOKEN_MAKE]}" == 1 ]]; then OWN_TOKEN=${P[AUTH_TOKEN_FILE]}; fi
  q3 launch auth --plan-dir "$PLAN_DIR" || exit 1
  start_ray || exit 1
  q3 launch wait-cluster --plan-dir "$PLAN_DIR" --pid "$RAY_PID" || exit 1
  say "training: ${TRAIN_CMD[*]} (log ${P[LOG_FILE]})"
  cd "${P[REPO]}"
  # the log is appended to across runs: progress reads only what this run writes
  LOG_START=0
  if [[ -f "${P[LOG_FILE]}" ]]; then LOG_START=$(stat -c %s "${P[LOG_FILE]}"); fi
  # own session, so that cleanup can stop the whole pipeline; exit status = the train script's
  # shellcheck disable=SC2016  # expanded by the inner bash
  setsid bash -c 'log=$1; shift; "$@" 2>&1 | tee -a "$log"; exit "${PIPESTATUS[0]}"' _ \
    "${P[LOG_FILE]}" "${TRAIN_CMD[@]}" &
  TRAIN_PID=$!
  if [[ "${P[DEVICE]}" == cpu ]]; then  # CPU profile: "step N of M" with each step's time, from the log
    q3 report "${P[LOG_FILE]}" --follow "$TRAIN_PID" --from-byte "$LOG_START" &
    WATCH_PID=$!
  fi
  watch_oom "$TRAIN_PID"
  rc=0
  if [[ -n "$OOM_PID" ]]; then
    # a killed or crashed actor leaves verl waiting forever: the watcher's exit 1 stops the training (cleanup)
    done_pid=""
    wait -n -p done_pid "$TRAIN_PID" "$OOM_PID" || rc=$?
    if [[ "$done_pid" == "$OOM_PID" ]]; then
      OOM_PID=""
      ((rc == 0)) || exit "$rc"
      wait "$TRAIN_PID" || rc=$?
    fi
  else
    wait "$TRAIN_PID" || rc=$?
  fi
  TRAIN_PID=""
  if [[ -n "$OOM_PID" ]]; then   # its last read (bounded: a GCS that stopped answering), then it exits
    for ((i = 0; i < 75; i++)); do kill -0 "$OOM_PID" 2>/dev/null || break; sleep 0.2; done
    stop_pid "$OOM_PID" "memory-kill watcher" 2
    OOM_PID=""
  fi
  say "training exited with code ${rc}"
  if [[ -n "$WATCH_PID" ]]; then
    wait "$WATCH_PID" 2>/dev/null || true
    WATCH_PID=""
    plots="${P[LOG_DIR]}/plots"
    if q3 report "${P[LOG_FILE]}" --plot "$plots" > "${P[LOG_DIR]}/report.txt" 2>&1; then
      say "plots: ${plots} (reward, val accuracy, response length, step time; table: ${P[LOG_DIR]}/report.txt)"
    else
      say "no plots: $(tail -n 1 "${P[LOG_DIR]}/report.txt")"
    fi
  fi
  exit "$rc"
fi

# 5w. worker: join with bounded retries, then stay until the head's cluster goes away
for ((attempt = 1; ; attempt++)); do
  q3 launch wait-head --plan-dir "$PLAN_DIR" || exit 1
  q3 launch auth --plan-dir "$PLAN_DIR" || exit 1
  if start_ray; then break; fi
  stop_pid "$RAY_PID" "ray (failed join)" 10
  RAY_PID=""
  ((attempt < P[JOIN_RETRIES])) || die "could not join ${P[RAY_ADDRESS]} after ${attempt} attempts (see ${P[RAY_LOG]})"
  sleep "${P[JOIN_INTERVAL]}"
done
watch_oom "$RAY_PID"
q3 launch watch-head --plan-dir "$PLAN_DIR" --pid "$RAY_PID" &
WATCH_PID=$!
rc=0
wait "$WATCH_PID" || rc=$?
WATCH_PID=""
exit "$rc"
