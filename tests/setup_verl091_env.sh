#!/usr/bin/env bash
# Create (or refresh) the CPU venv of the current set's trainer checks: verl 0.9.1 on torch 2.13.0 (CPU build), with
# what verl's imports and its own *_on_cpu.py tests need, mbridge and megatron-core 0.16.1. verl and megatron-core go
# in --no-deps (their extras ask for CUDA builds); our package editable. Used by tests/upstream_own/verl091_cpu.py and
# tests/patches/test_patches_verl091.py.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QWEN3_RL_VERL091_VENV:-${HOME}/.cache/qwen3_rl/verl091-venv}"
PYTHON="${PYTHON:-python3.11}"
TORCH_SPEC="torch==2.13.0"
NO_DEPS=(verl==0.9.1 megatron-core==0.16.1)
# verl 0.9.1's install requirements (its wheel's Requires-Dist, less wandb: imported only when logging to it), the
# pure-Python part of its "verl-core" extra its own tests import (server, agent loop, transfer queue), pytest-asyncio
# for its async tests, mbridge's "megatron" extra (einops, safetensors), and the ray of pins.toml's runtime.ray
DEPS=(mbridge==0.15.1 accelerate codetiming datasets dill hydra-core "numpy>=2.0.0" pandas peft "pyarrow>=19.0.0"
      pybind11 pylatexenc torchdata "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "transformers>=5.5.3,<5.11,!=5.6.0"
      "packaging>=20.0" tensorboard "TransferQueue>=0.1.10" pyzmq msgspec fastapi uvicorn cachetools
      einops safetensors pytest pytest-asyncio pytest-timeout
      scipy)  # MindSpeed core_r0.16.0's requirements.txt (its DSA feature imports it at patch time)

usage() {
  cat <<'USAGE'
usage: bash tests/setup_verl091_env.sh
Creates $QWEN3_RL_VERL091_VENV (default ~/.cache/qwen3_rl/verl091-venv): Python 3.11, torch==2.13.0 (the CPU build
pip takes from the machine's disk), verl==0.9.1 and megatron-core==0.16.1 without their dependencies, verl's install
requirements, mbridge 0.15.1, ray[default]==<pins.toml runtime.ray>, all under the full lock .ci/lock-verl091.txt,
qwen3_rl editable; it ends by making the venv equal the lock. A rerun with this script, the pins and the lock
unchanged does nothing.
USAGE
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  local ray_spec stamp want lock
  # every distribution's exact version (tests/venv_lock.py: all but the editable qwen3_rl; torch's +cpu build is the
  # one on the machine's disk, found through pip's find-links)
  lock="${HERE}/.ci/lock-verl091.txt"
  ray_spec="ray[default]==$(PYTHONPATH="${HERE}" "${PYTHON}" -m qwen3_rl pins --pins "${HERE}/pins.toml" --get runtime.ray)"
  stamp="${VENV}/.qwen3_rl-stamp"
  want="$(printf '%s\n' "${TORCH_SPEC}" "${ray_spec}" "${NO_DEPS[@]}" "${DEPS[@]}" | cat - "${lock}" "${HERE}/pyproject.toml" \
    | sha256sum | cut -d' ' -f1)"
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    echo "setup-verl091: ${VENV} up to date"
    return 0
  fi
  if [[ ! -x "${VENV}/bin/python" ]]; then
    echo "setup-verl091: creating ${VENV}"
    "${PYTHON}" -m venv "${VENV}"
  fi
  local pip=("${VENV}/bin/python" -m pip install -q -c "${lock}")
  "${pip[@]}" "${TORCH_SPEC}"
  "${pip[@]}" --no-deps "${NO_DEPS[@]}"
  # torch stays at 2.13.0: a dependency asking for another torch fails here instead of pulling a CUDA build
  "${pip[@]}" "${TORCH_SPEC}" "${ray_spec}" "${DEPS[@]}"
  flock -w 600 "${HERE}/pyproject.toml" "${pip[@]}" --no-deps -e "${HERE}"
  "${VENV}/bin/python" -c 'import torch, verl, megatron.core, mbridge; print("setup-verl091: torch", torch.__version__, "verl", verl.__version__, "megatron-core", megatron.core.__version__)'
  "${VENV}/bin/python" "${HERE}/tests/venv_lock.py" sync "${lock}"
  echo "${want}" > "${stamp}"
  echo "setup-verl091: done"
}

main "$@"
