#!/usr/bin/env bash
# Apply patches/<framework>/NNNN-*.patch, in order, to the workspace trees (all or nothing).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
  cat <<'USAGE'
usage: bash apply_all_patches.sh [--check | --status | --revert | --lint] [--only LIST] [--workspace DIR]
                                 [--pin-set SET]

  (no flag)        apply every not-yet-applied patch; a rerun on a patched tree does nothing
  --check          dry run: list the patches that would apply, change nothing
  --status         table: patch, applied / not applied / conflict
  --revert         reverse the applied patches, last first
  --lint           check patch names, numbering and headers
  --only LIST      comma-separated subset: verl,vllm,vllm_ascend,megatron,mindspeed
  --workspace DIR  workspace (default: $QWEN3_RL_WORKSPACE or the set's: ./workspace, ./workspace-current)
  --pin-set SET    seed (default) or current: the pin set and its series, patches/<fw>/ or
                   patches/current/<fw>/ [PIN_SET]

Each framework's series is checked whole before any file changes; a conflict names the patch and
the file and leaves the tree untouched.
USAGE
}

main() {
  case "${1:-}" in
    -h|--help) usage; return 0 ;;
  esac
  PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}" exec python3 -m qwen3_rl patches "$@"
}

main "$@"
