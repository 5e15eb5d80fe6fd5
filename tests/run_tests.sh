#!/usr/bin/env bash
# The test command: lint (ruff, shellcheck) then pytest, in the venv made by tests/setup_env.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN3_RL_VENV:-${HOME}/.cache/qwen3_rl/venv}"

usage() {
  cat <<'USAGE'
usage: bash tests/run_tests.sh [PYTEST_ARGS...]
Runs ruff and shellcheck on the repo, then pytest (extra arguments go to pytest).
USAGE
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "error: no test environment at ${VENV}; run: bash tests/setup_env.sh" >&2
    return 1
  fi
  cd "${HERE}"
  echo "== ruff"
  "${VENV}/bin/ruff" check qwen3_rl tests
  echo "== shellcheck"
  local scripts
  mapfile -t scripts < <(git ls-files '*.sh' .ci/run 2>/dev/null || true)
  if [[ ${#scripts[@]} -gt 0 ]]; then
    "${VENV}/bin/shellcheck" -x "${scripts[@]}"
  fi
  echo "== pytest"
  local rc=0
  "${VENV}/bin/python" -m pytest "$@" || rc=$?
  if [[ ${rc} -eq 5 ]]; then
    echo "error: pytest collected no tests" >&2
    return 1
  fi
  return "${rc}"
}

main "$@"
