#!/usr/bin/env bash
# Create (or refresh) the current-set vLLM-Ascend CPU check environment, installed the way vLLM-Ascend 0.23.0.post1
# installs on the cluster (its Dockerfile*: vLLM from source with VLLM_TARGET_DEVICE=empty, then vLLM-Ascend's
# requirements on torch 2.10.0): torch of pins.toml's current runtime, vLLM of the current set built from its sdist
# as a Python-only tree (no compiled ops), vLLM-Ascend's requirements.txt bar its NPU packages, arctic-inference.
# vLLM-Ascend 0.23.0.post1's own unit tests run in it (tests/upstream_own/vllm_ascend023_cpu.py: the pinned sdist's
# tree on PYTHONPATH, torch_npu replaced by the CPU stand-in qwen3_rl/cpu_device/npu).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN3_RL_CURRENT_ASCEND_VENV:-${HOME}/.cache/qwen3_rl/current-ascend-venv}"
PYTHON="${PYTHON:-python3.11}"
ARCTIC_SPEC="arctic-inference==0.1.1"

usage() {
  cat <<'USAGE'
usage: bash tests/setup_current_ascend_env.sh
Creates $QWEN3_RL_CURRENT_ASCEND_VENV (default ~/.cache/qwen3_rl/current-ascend-venv): Python 3.11,
torch==<pins.toml current runtime.torch> (PyPI's build, runs on CPU), vllm==<current vllm.version> built from its
sdist (the one tests/upstream_own/vllm023_cpu.py pins and caches) with VLLM_TARGET_DEVICE=empty (Python only, as vLLM-Ascend's Dockerfile installs it), then
.ci/requirements-current-ascend.txt under .ci/constraints-current-ascend.txt, arctic-inference==0.1.1 built from its
sdist, every step under the full lock .ci/lock-current-ascend.txt, and qwen3_rl editable; it ends by making the
venv equal the lock. vLLM-Ascend itself is not installed: its checks run the pinned sdist's tree. A rerun with
unchanged pins, requirement and lock files does nothing.
USAGE
}

pin() {
  PIN_SET=current PYTHONPATH="${HERE}" "${PYTHON}" -m qwen3_rl pins --pins "${HERE}/pins.toml" --get "$1"
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  local torch_spec vllm_spec stamp want cons lock
  torch_spec="torch==$(pin runtime.torch)"
  vllm_spec="vllm==$(pin vllm.version)"
  cons="${HERE}/.ci/constraints-current-ascend.txt"
  # every distribution's exact version (tests/venv_lock.py: all but the editable qwen3_rl and vLLM, built from the
  # pinned sdist file, whose URL and sha256 tests/upstream_own/vllm_cpu.py checks)
  lock="${HERE}/.ci/lock-current-ascend.txt"
  stamp="${VENV}/.qwen3_rl-stamp"
  want="$(printf '%s\n' "${torch_spec}" "${vllm_spec}" "${ARCTIC_SPEC}" \
    | cat - "${HERE}/.ci/requirements-current-ascend.txt" "${cons}" "${lock}" "${HERE}/pyproject.toml" | sha256sum \
    | cut -d' ' -f1)"
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    echo "setup-current-ascend: ${VENV} up to date"
    return 0
  fi
  if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "setup-current-ascend: creating ${VENV}"
    "${PYTHON}" -m venv "${VENV}"
  fi
  echo "setup-current-ascend: installing into ${VENV} (first time: about 10 minutes)"
  local pip=("${VENV}/bin/python" -m pip install -q -c "${lock}")
  "${pip[@]}" --upgrade pip
  "${pip[@]}" -c "${cons}" "${torch_spec}"
  # vLLM's build requirements (its pyproject.toml) bar torch: the build uses the torch above instead of fetching
  # the torch vLLM's pyproject names (2.11.0) into an isolated build environment; an empty target compiles nothing
  "${pip[@]}" -c "${cons}" "setuptools>=77.0.3,<81.0.0" "setuptools-scm>=8.0" "setuptools-rust>=1.9.0" \
    "packaging>=24.2" cmake ninja wheel jinja2
  # the sdist vLLM 0.23.0's own-test run checks (pinned URL and sha256, cached in <cache>/sdists): an index may
  # serve the wheels alone, so pip is handed the file; the check at the end compares its version with the pin
  local sdist
  sdist="$(cd "${HERE}" && "${PYTHON}" -c 'import sys; sys.path[:0] = ["tests/upstream_own", "."]
from vllm023_cpu import CURRENT
from vllm_cpu import sdist
print(sdist(CURRENT))')"
  VLLM_TARGET_DEVICE=empty "${pip[@]}" -c "${cons}" --no-build-isolation "${sdist}"
  "${pip[@]}" -c "${cons}" -r "${HERE}/.ci/requirements-current-ascend.txt"
  # PyPI has only an sdist; its build uses the tools installed above (cmake, ninja, nanobind), and its CMake finds
  # nanobind through the first python on PATH: the venv's
  PATH="${VENV}/bin:${PATH}" "${pip[@]}" -c "${cons}" --no-build-isolation --no-deps "${ARCTIC_SPEC}"
  # other set-up scripts may run at once; the editable install writes qwen3_rl.egg-info into the checkout: one at
  # a time (the lock is on a file every checkout has, so no lock file is left behind)
  flock -w 600 "${HERE}/pyproject.toml" "${pip[@]}" --no-deps -e "${HERE}"
  TORCH_WANT="${torch_spec#torch==}" VLLM_WANT="${vllm_spec#vllm==}" "${VENV}/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util
import os
import torch
import vllm
print(f"setup-current-ascend: torch {torch.__version__}, vllm {md.version('vllm')}, "
      f"transformers {md.version('transformers')}, arctic-inference {md.version('arctic-inference')}")
assert torch.__version__.split("+")[0] == os.environ["TORCH_WANT"], torch.__version__
assert md.version("vllm") == f"{os.environ['VLLM_WANT']}+empty", md.version("vllm")
assert importlib.util.find_spec("vllm._C") is None, "vLLM's compiled ops: this venv is the Python-only tree"
PY
  "${VENV}/bin/python" "${HERE}/tests/venv_lock.py" sync "${lock}"
  "${VENV}/bin/python" -m pip check
  echo "${want}" > "${stamp}"
  echo "setup-current-ascend: done"
}

main "$@"
