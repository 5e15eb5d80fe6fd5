#!/usr/bin/env bash
# Create (or refresh) the CPU test environment: a venv with the test requirements, our package
# installed editable. Upstream frameworks are NOT installed: tests unpack the pinned wheels and
# put the (patched) trees on sys.path.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN3_RL_VENV:-${HOME}/.cache/qwen3_rl/venv}"
PYTHON="${PYTHON:-python3.11}"

usage() {
  cat <<'USAGE'
usage: bash tests/setup_env.sh
Creates $QWEN3_RL_VENV (default ~/.cache/qwen3_rl/venv) with .ci/requirements-test.txt under
.ci/constraints-test.txt and installs qwen3_rl editable. A rerun with unchanged requirement files
does nothing.
USAGE
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  local stamp want
  if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "setup: creating ${VENV}"
    "${PYTHON}" -m venv "${VENV}"
  fi
  stamp="${VENV}/.qwen3_rl-stamp"
  want="$(cat "${HERE}/.ci/requirements-test.txt" "${HERE}/.ci/constraints-test.txt" "${HERE}/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    echo "setup: ${VENV} up to date"
    return 0
  fi
  echo "setup: installing test requirements into ${VENV} (first time: several minutes)"
  "${VENV}/bin/python" -m pip install -q --upgrade pip
  "${VENV}/bin/python" -m pip install -q -c "${HERE}/.ci/constraints-test.txt" -r "${HERE}/.ci/requirements-test.txt"
  "${VENV}/bin/python" -m pip install -q --no-deps -e "${HERE}"
  echo "${want}" > "${stamp}"
  echo "setup: done"
}

main "$@"
