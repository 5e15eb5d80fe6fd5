#!/usr/bin/env bash
# CANN / HCCL / torch-npu environment, sourced by ray_start_npu.sh on every node BEFORE `ray start`
# (Ray workers inherit it). Setup-specific settings (timeouts, vLLM switches) live in the optional
# ENV_SCRIPT, which the launcher sources first; this file only fills in what is still unset, including
# the vLLM-Ascend settings every setup needs (`python -m qwen3_rl preflight` checks them).
#
#   source internal/npu_env.sh [--check=strict|warn]
#
# Inputs: CANN_HOME (default /usr/local/Ascend), SOCKET_IFNAME (the interface that reaches the head;
# the launcher exports it). Every path sourced is checked first; in strict mode (default) a missing
# one is a one-line error naming it and `return 1`; --check=warn (used by --dry-run) only warns;
# --check=skip (the launcher's CPU profile, a node without NPUs) neither looks for nor sources CANN.
# shellcheck disable=SC1090,SC1091

_q3_mode=strict
case "${1:-}" in
  --check=warn) _q3_mode=warn ;;
  --check=skip) _q3_mode=skip ;;
  --check=strict|"") ;;
  *) echo "error: npu_env.sh: unknown argument '$1' (use --check=strict|warn|skip)" >&2; return 2 ;;
esac

_q3_missing() {
  if [[ "${_q3_mode}" == strict ]]; then
    echo "error: $1" >&2
    return 1
  fi
  echo "warning: $1" >&2
}

_q3_source() {
  # source a vendor set_env.sh that may read unset variables, without leaking `set +u`
  local had_u=0
  [[ $- == *u* ]] && had_u=1
  set +u
  source "$1"
  ((had_u)) && set -u
  return 0
}

CANN_HOME=${CANN_HOME:-/usr/local/Ascend}
if [[ "${_q3_mode}" != skip ]]; then
  # CANN 8.x layouts: <home>/ascend-toolkit (bare metal, [ref 000]) or <home>/cann/ascend-toolkit (images)
  _q3_toolkit=""
  for _q3_c in "${ASCEND_TOOLKIT_SET_ENV:-}" "${CANN_HOME}/ascend-toolkit/set_env.sh" \
               "${CANN_HOME}/cann/ascend-toolkit/set_env.sh"; do
    [[ -n "${_q3_c}" && -f "${_q3_c}" ]] && { _q3_toolkit=${_q3_c}; break; }
  done
  _q3_rc=0
  if [[ -z "${_q3_toolkit}" ]]; then
    _q3_missing "CANN toolkit not found: ${CANN_HOME}/ascend-toolkit/set_env.sh (nor ${CANN_HOME}/cann/ascend-toolkit/set_env.sh); set --cann-home or CANN_HOME" || _q3_rc=1
  else
    _q3_source "${_q3_toolkit}"
  fi
  _q3_atb=""
  for _q3_c in "${CANN_HOME}/nnal/atb/set_env.sh" "${CANN_HOME}/cann/nnal/atb/set_env.sh"; do
    [[ -f "${_q3_c}" ]] && { _q3_atb=${_q3_c}; break; }
  done
  if [[ -z "${_q3_atb}" ]]; then
    ((_q3_rc)) || _q3_missing "CANN NNAL/ATB not found: ${CANN_HOME}/nnal/atb/set_env.sh (vLLM-Ascend needs it); set --cann-home or CANN_HOME" || _q3_rc=1
  else
    _q3_source "${_q3_atb}"
  fi
  if ((_q3_rc == 0)) && [[ ! -d "${CANN_HOME}/driver/lib64" ]]; then
    _q3_missing "Ascend driver libraries not found: ${CANN_HOME}/driver/lib64 (mount /usr/local/Ascend/driver into the container)" || _q3_rc=1
  fi
  if ((_q3_rc)); then
    unset _q3_mode _q3_toolkit _q3_atb _q3_c _q3_rc
    return 1
  fi
  if [[ -d "${CANN_HOME}/driver/lib64" ]]; then
    export LD_LIBRARY_PATH="${CANN_HOME}/driver/lib64/common:${CANN_HOME}/driver/lib64/driver${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  fi
fi

# Host sockets of HCCL / gloo / torch RPC go over the interface that reaches the head.
if [[ -n "${SOCKET_IFNAME:-}" ]]; then
  export HCCL_SOCKET_IFNAME=${HCCL_SOCKET_IFNAME:-${SOCKET_IFNAME}}
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-${SOCKET_IFNAME}}
  export TP_SOCKET_IFNAME=${TP_SOCKET_IFNAME:-${SOCKET_IFNAME}}
fi
# CANN logs: errors only on the console (the per-op INFO logs cost host time).
export ASCEND_GLOBAL_LOG_LEVEL=${ASCEND_GLOBAL_LOG_LEVEL:-3}
export ASCEND_SLOG_PRINT_TO_STDOUT=${ASCEND_SLOG_PRINT_TO_STDOUT:-0}
# HCCL rendezvous: a cluster of 8 nodes needs more than the 120 s default to connect.
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}
# vLLM-Ascend: no FRACTAL_NZ weight format. Its default (1) casts only quantized weights (bf16 is
# untouched), but NPUWorker.wake_up raises for any non-zero value (vllm_ascend/worker/worker.py:181-184),
# and every setup wakes the rollout engine each step (sleep mode, rollout.free_cache_engine=True).
export VLLM_ASCEND_ENABLE_NZ=${VLLM_ASCEND_ENABLE_NZ:-0}
unset _q3_mode _q3_toolkit _q3_atb _q3_c _q3_rc
# shellcheck disable=SC2317  # reached when the file is executed instead of sourced
return 0 2>/dev/null || true
