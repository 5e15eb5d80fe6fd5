#!/usr/bin/env bash
# Start the recipe container with every NPU of this host passed through.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: bash run_container.sh NAME IMAGE [--dry-run] [--mount HOST_DIR[:CONTAINER_DIR]]...

Starts a detached container NAME from IMAGE with --net=host, the NPU devices of this host
(/dev/davinci<N>, found on the host; override the folder with $QWEN3_RL_DEV_DIR), the driver,
npu-smi and the usual data mounts (/data, /home). Then: docker exec -it NAME bash

  --dry-run        print the docker command, run nothing
  --mount SPEC     extra -v mount (repeatable)
USAGE
}

die() { echo "error: $*" >&2; exit 1; }

device_args() {
  local dev_dir="$1" d n=0
  local -a args=()
  for d in "${dev_dir}"/davinci[0-9]*; do
    [[ -e "${d}" ]] || continue
    args+=("--device=/dev/$(basename "${d}")")
    n=$((n + 1))
  done
  ((n > 0)) || return 0
  for d in davinci_manager devmm_svm hisi_hdc; do
    [[ -e "${dev_dir}/${d}" ]] && args+=("--device=/dev/${d}")
  done
  printf '%s\n' "${args[@]}"
}

main() {
  local name="" image="" dry_run=0
  local -a extra=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      -h|--help) usage; return 0 ;;
      --dry-run) dry_run=1 ;;
      --mount) [[ $# -ge 2 ]] || die "--mount needs a value"; extra+=("-v" "$2"); shift ;;
      -*) die "unknown option $1 (see --help)" ;;
      *) if [[ -z "${name}" ]]; then name="$1"; elif [[ -z "${image}" ]]; then image="$1"; else die "unexpected argument $1"; fi ;;
    esac
    shift
  done
  [[ -n "${name}" && -n "${image}" ]] || die "NAME and IMAGE are required (see --help)"
  local dev_dir="${QWEN3_RL_DEV_DIR:-/dev}"
  local -a devices
  mapfile -t devices < <(device_args "${dev_dir}")
  [[ ${#devices[@]} -gt 0 ]] || die "no NPU devices (${dev_dir}/davinci<N>) on this host: is the Ascend driver loaded?"
  local -a cmd=(docker run -itd "${devices[@]}"
    -v /usr/local/dcmi:/usr/local/dcmi
    -v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi
    -v /usr/local/Ascend/driver:/usr/local/Ascend/driver
    -v /var/log/npu/slog/slogd:/var/log/npu/slog/slogd
    -v /usr/local/sbin/:/usr/local/sbin/
    -v /etc/localtime:/etc/localtime
    -v /dev/shm:/dev/shm
    -v /data/:/data/ -v /home/:/home/
    "${extra[@]}"
    --net=host --shm-size=500g --privileged --name "${name}" "${image}" /bin/bash)
  if ((dry_run)); then
    printf '%q ' "${cmd[@]}"; echo
    return 0
  fi
  command -v docker >/dev/null 2>&1 || die "docker not found"
  "${cmd[@]}"
  echo "started ${name}: docker exec -it ${name} bash"
}

main "$@"
