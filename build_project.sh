#!/usr/bin/env bash
# Install the patched stack (vllm, vllm-ascend, megatron-core, MindSpeed, verl) and qwen3_rl, in order.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
  cat <<'USAGE'
usage: bash build_project.sh [--dry-run] [--skip-npu] [--only LIST] [--workspace DIR] [--python PY]

Installs into the active Python environment, in order: requirements.txt, vllm
(VLLM_TARGET_DEVICE=empty), vllm-ascend (needs CANN sourced and torch_npu), megatron-core,
MindSpeed, verl (all editable, from the patched trees in the workspace) and qwen3_rl.

  --dry-run          print the steps, run nothing
  --skip-npu         skip the NPU-only build (vllm-ascend) on a machine without CANN
  --only LIST        comma-separated subset: vllm,vllm_ascend,megatron,mindspeed,verl
  --workspace DIR    workspace (default: $QWEN3_RL_WORKSPACE or ./workspace)
  --python PY        target interpreter (default: python3)
  --pin-set SET      seed (default) or current [PIN_SET]: the set's workspace and requirements file
  --no-requirements  skip requirements.txt
  --no-package       skip qwen3_rl itself

Trees made with --source pypi have no build files: verl, megatron and vllm (pure Python for the
empty target) are linked into site-packages with a .pth file; vllm-ascend is refused (it compiles
operators: download it with --source git). A rerun skips what is already installed.
USAGE
}

main() {
  case "${1:-}" in
    -h|--help) usage; return 0 ;;
  esac
  local py="${PYTHON:-python3}"
  PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}" exec "${py}" -m qwen3_rl build --python "$(command -v "${py}")" "$@"
}

main "$@"
