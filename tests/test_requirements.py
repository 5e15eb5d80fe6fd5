"""requirements.txt (NPU runtime) agrees with pins.toml and with vllm-ascend's own requirements."""

from __future__ import annotations

import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from qwen3_rl.tools.pins import load_pins
from qwen3_rl.tools.upstream.common import default_cache
from qwen3_rl.tools.upstream.download import fetch_wheel

REPO = Path(__file__).resolve().parent.parent
PINS = load_pins(REPO / "pins.toml")


def _ours() -> dict[str, Requirement]:
    reqs = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            spec = list(r.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"not pinned exactly: {line}"
            reqs[canonicalize_name(r.name)] = r
    return reqs


def _exact(r: Requirement) -> str:
    return next(iter(r.specifier)).version


def test_every_line_is_pinned_and_matches_the_pin_file():
    ours = _ours()
    assert _exact(ours["torch"]) == PINS.runtime["torch"]
    assert _exact(ours["torch-npu"]) == PINS.runtime["torch_npu"]
    assert _exact(ours["mbridge"]) == PINS.runtime["mbridge"]  # USE_MBRIDGE=True (verl use_mbridge)
    assert _exact(ours["ray"]) == PINS.runtime["ray"]  # one Ray: the image and both test environments
    patched = {canonicalize_name(fw.pypi) for fw in PINS.frameworks.values() if fw.pypi}
    assert not patched & set(ours), "patched frameworks are installed from the workspace, not requirements.txt"


def _wheel_requires(key: str) -> list[Requirement]:
    wheel = fetch_wheel(PINS.frameworks[key], default_cache() / "wheels")
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate({"extra": "", "python_version": "3.11"}):
                out.append(r)
    return out


def test_consistent_with_vllm_ascend_and_verl_requirements():
    ours = _ours()
    checked = 0
    for key in ("vllm_ascend", "verl"):
        for r in _wheel_requires(key):
            name = canonicalize_name(r.name)
            if name in ours and r.specifier:
                assert r.specifier.contains(_exact(ours[name]), prereleases=True), (
                    f"{key} requires {r}, requirements.txt pins {ours[name]}")
                checked += 1
    assert checked >= 8  # torch, torch-npu, numpy, transformers, numba, fastapi, ...
