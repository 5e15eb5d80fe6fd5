#!/usr/bin/env bash
# Create (or refresh) the CPU test environment: a venv on the runtime's torch (pins.toml
# runtime.torch, the version the NPU image runs), the test requirements, our package installed
# editable. Upstream frameworks are NOT installed: tests unpack the pinned wheels and put the
# (patched) trees on sys.path.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN3_RL_VENV:-${HOME}/.cache/qwen3_rl/venv}"
PYTHON="${PYTHON:-python3.11}"

usage() {
  cat <<'USAGE'
usage: bash tests/setup_env.sh
Creates $QWEN3_RL_VENV (default ~/.cache/qwen3_rl/venv) with torch==<pins.toml runtime.torch>
(PyPI's build: the CUDA build, which runs on CPU; ~8 GB with its nvidia-* wheels, ~2 min uncached),
.ci/requirements-test.txt under .ci/constraints-test.txt and the full lock .ci/lock-test.txt, and qwen3_rl
editable; it ends by making the venv equal the lock. A rerun with unchanged pin, requirement and lock files does
nothing; a venv holding another torch is made anew.
USAGE
}

# A runtime version from pins.toml (stdlib only: runs before the venv exists).
runtime_pin() {
  PYTHONPATH="${HERE}" "${PYTHON}" -m qwen3_rl pins --pins "${HERE}/pins.toml" --get "runtime.$1"
}
runtime_torch() { runtime_pin torch; }

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  local stamp want torch_spec ray_spec have lock
  # every distribution's exact version (tests/venv_lock.py: all but the editable qwen3_rl); .ci/constraints-test.txt
  # keeps the bounds the lock was resolved in
  lock="${HERE}/.ci/lock-test.txt"
  torch_spec="torch==$(runtime_torch)"
  ray_spec="ray[default]==$(runtime_pin ray)"
  if [[ "${torch_spec}" == "torch==" ]]; then
    echo "error: no runtime.torch in ${HERE}/pins.toml" >&2
    return 1
  fi
  stamp="${VENV}/.qwen3_rl-stamp"
  want="$(printf '%s\n' "${torch_spec}" "${ray_spec}" | cat - "${HERE}/.ci/requirements-test.txt" \
    "${HERE}/.ci/constraints-test.txt" "${lock}" "${HERE}/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    echo "setup: ${VENV} up to date (${torch_spec})"
    return 0
  fi
  if [[ -x "${VENV}/bin/python" ]]; then
    have="$("${VENV}/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
    if [[ -n "${have}" && "torch==${have%%+*}" != "${torch_spec}" ]]; then
      # Another torch build leaves its own nvidia-* wheels behind: start from an empty venv.
      if [[ ! -f "${stamp}" ]]; then
        echo "error: ${VENV} holds torch ${have}, not ${torch_spec}, and was not made by this script; remove it or set QWEN3_RL_VENV" >&2
        return 1
      fi
      echo "setup: ${VENV} holds torch ${have}; recreating it for ${torch_spec}"
      rm -rf "${VENV}"
    fi
  fi
  if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "setup: creating ${VENV}"
    "${PYTHON}" -m venv "${VENV}"
  fi
  echo "setup: installing ${torch_spec} and the test requirements into ${VENV} (first time: several minutes)"
  "${VENV}/bin/python" -m pip install -q -c "${lock}" --upgrade pip
  "${VENV}/bin/python" -m pip install -q -c "${HERE}/.ci/constraints-test.txt" -c "${lock}" "${torch_spec}" \
    "${ray_spec}" -r "${HERE}/.ci/requirements-test.txt"
  # .ci/run runs both set-up scripts at once; the editable install writes qwen3_rl.egg-info into the checkout:
  # one at a time (the lock is on a file every checkout has, so no lock file is left behind)
  flock -w 600 "${HERE}/pyproject.toml" "${VENV}/bin/python" -m pip install -q --no-deps -e "${HERE}"
  "${VENV}/bin/python" - "${torch_spec#torch==}" <<'PY'
import sys

import torch

print(f"setup: torch {torch.__version__}")
assert torch.__version__.split("+")[0] == sys.argv[1], (torch.__version__, sys.argv[1])
PY
  "${VENV}/bin/python" "${HERE}/tests/venv_lock.py" sync "${lock}"
  echo "${want}" > "${stamp}"
  echo "setup: done"
}

main "$@"
