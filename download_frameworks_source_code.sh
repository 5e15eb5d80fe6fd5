#!/usr/bin/env bash
# Fetch the pinned upstream source trees (pins.toml) into a workspace.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
  cat <<'USAGE'
usage: bash download_frameworks_source_code.sh [--source git|pypi] [--dest DIR] [--only LIST] [--force]

  --source git    clone each framework and check out the exact pinned commit (seed set's default)
  --source pypi   download the pinned wheels and unpack their text sources as one-commit git
                  repos (for CI, inspection, or networks with a PyPI mirror but no GitHub);
                  MindSpeed is not on PyPI and needs git (or --archive-dir); the current set's
                  default (its vllm-ascend is an sdist with no upstream tag)
  --dest DIR      workspace (default: $QWEN3_RL_WORKSPACE or ./workspace)
  --only LIST     comma-separated subset: verl,vllm,vllm_ascend,megatron,mindspeed
  --wheel-dir DIR wheel cache for pypi mode (default: ~/.cache/qwen3_rl/wheels)
  --arch ARCH     wheel architecture for pypi mode (default: this machine's)
  --archive-dir DIR  pypi mode: MindSpeed (not on PyPI) from DIR/mindspeed-<commit>.tar.gz, checked
                  against DIR/SHA256SUMS (e.g. ../shared/upstream)
  --pin-set SET   pin set: seed (default) or current [PIN_SET]
  --force         replace a tree at the wrong commit or with local changes
  --pins FILE     pin file (default: pins.toml beside this script)

A second run verifies the trees and changes nothing.
USAGE
}

main() {
  case "${1:-}" in
    -h|--help) usage; return 0 ;;
  esac
  PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}" exec python3 -m qwen3_rl download "$@"
}

main "$@"
