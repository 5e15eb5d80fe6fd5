"""The current pin set's vLLM / vLLM-Ascend bug fixes (``patches/current/``), executed in the real 0.23 code.

vLLM 0.23.0 and vLLM-Ascend 0.23.0.post1 cannot share this process with the seed set's vLLM 0.13 (the main venv's
``patched_imports``), so each probe runs in a fresh interpreter of this venv whose ``PYTHONPATH`` is the pinned tree
(pristine, or patched by ``PIN_SET=current bash apply_all_patches.sh``): vLLM's own package tree imports on CPU.
vLLM-Ascend's ``vllm_ascend.utils`` imports torch_npu: the probe installs the recipe's torch_npu stand-in
(``qwen3_rl.cpu_device``, the device-kernel layer only) first.

* vllm 0001 rope_registry: a planted ``flash_attn`` whose Triton rotary module does not import (as a CUDA build does
  on an NPU host). Pristine: RoPE construction dies on a platform that is not the CPU. Patched: it builds, flash_attn
  is not imported; on a stand-in ROCm platform the broken build is treated as absent, a working one is used.
* vllm_ascend 0001 set_hccl_op_expansion_mode: the option reaches the groups' HCCL options in the patched tree and
  is ignored by the pristine one; bad values raise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qwen3_rl.tools.pins import load_pins
from qwen3_rl.tools.upstream.download import fill_pristine

REPO = Path(__file__).resolve().parents[2]
CURRENT = load_pins(REPO / "pins.toml", "current")
KEYS = ("vllm", "vllm_ascend")


@pytest.fixture(scope="module")
def current_trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"pristine": workspace, "patched": workspace} of the current set's vLLM and vLLM-Ascend trees."""
    pristine = fill_pristine(REPO / "pins.toml", [CURRENT.frameworks[k] for k in KEYS], pin_set="current")
    ws = tmp_path_factory.mktemp("current_patched")
    for k in KEYS:
        subprocess.run(["git", "clone", "-q", "--shared", str(pristine / CURRENT.frameworks[k].dir),
                        str(ws / CURRENT.frameworks[k].dir)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "QWEN3_RL_WORKSPACE"}
    proc = subprocess.run(["bash", str(REPO / "apply_all_patches.sh"), "--workspace", str(ws), "--only", ",".join(KEYS)],
                          env={**env, "PIN_SET": "current"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"pristine": pristine, "patched": ws}


def _probe(code: str, ws: Path, *extra: Path, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``code`` (argv: ``args``) in a fresh interpreter whose path is the workspace's vLLM and vLLM-Ascend trees,
    then ``extra``."""
    path = [REPO, ws / CURRENT.frameworks["vllm"].dir, ws / CURRENT.frameworks["vllm_ascend"].dir, *extra]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join(map(str, path)), VLLM_PLUGINS="none", VLLM_TARGET_DEVICE="cpu")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ws)


def _result(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:]
    return json.loads(line[-1][len("RESULT "):])


# ------------------------------------------------------------------------------------------ vllm 0001 rope_registry

def _plant_flash_attn(root: Path, rotary_body: str) -> Path:
    """A ``flash_attn`` package under ``root`` whose ``ops/triton/rotary.py`` holds ``rotary_body``."""
    pkg = root / "flash_attn"
    (pkg / "ops" / "triton").mkdir(parents=True)
    for d in (pkg, pkg / "ops", pkg / "ops" / "triton"):
        (d / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "rotary.py").write_text(rotary_body)
    return root


_BROKEN = 'raise ImportError("libcudart.so.12: cannot open shared object file")\n'
_WORKING = "def apply_rotary(x, cos, sin, interleaved=False):\n    return ('flash', x)\n"

_ROPE = """
import json, sys
import torch
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import common, get_rope
res = {"file": common.__file__, "is_cpu": common.current_platform.is_cpu()}
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    rope = get_rope(head_size=16, max_position=64, is_neox_style=True,
                    rope_parameters={"rope_theta": 10000.0}, dtype=torch.float32)
    res["built"] = rope.apply_rotary_emb.apply_rotary_emb_flash_attn is None
    res["imported"] = "flash_attn.ops.triton.rotary" in sys.modules
    x, cos, sin = torch.randn(5, 2, 16), torch.ones(5, 8), torch.zeros(5, 8)
    res["native_ok"] = bool(torch.equal(rope.apply_rotary_emb.forward_native(x, cos, sin), x))
    if len(sys.argv) > 1:  # stand-in ROCm platform: the broken build is absent, then a working build is used
        common.current_platform.is_rocm = lambda: True
        res["rocm_broken"] = common.ApplyRotaryEmb(is_neox_style=True).apply_rotary_emb_flash_attn
        for m in [m for m in sys.modules if m.startswith("flash_attn")]:
            del sys.modules[m]
        sys.path.insert(0, sys.argv[1])
        fn = common.ApplyRotaryEmb(is_neox_style=True).apply_rotary_emb_flash_attn
        res["rocm_working"] = list(fn(1, None, None))
print("RESULT", json.dumps(res))
"""


def test_pristine_current_rope_fails_with_unusable_flash_attn(current_trees: dict[str, Path], tmp_path: Path) -> None:
    """The bug is in vLLM 0.23.0: on a platform that is not the CPU (here vLLM's unspecified one; an NPU is one too)
    RoPE construction imports the broken flash_attn and dies."""
    fake = _plant_flash_attn(tmp_path / "fake", _BROKEN)
    proc = _probe(_ROPE, current_trees["pristine"], fake)
    assert proc.returncode != 0, proc.stdout
    assert "ImportError: libcudart.so.12" in proc.stderr
    assert "flash_attn/ops/triton/rotary.py" in proc.stderr
    assert "rotary_embedding/common.py" in proc.stderr


def test_patched_current_rope_builds_and_uses_flash_attn_only_on_rocm(current_trees: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    fake = _plant_flash_attn(tmp_path / "fake", _BROKEN)
    working = _plant_flash_attn(tmp_path / "working", _WORKING)
    proc = _probe(_ROPE, current_trees["patched"], fake, args=(str(working),))
    res = _result(proc)
    warned = "flash_attn is installed but its rotary kernel does not import (ImportError: libcudart.so.12"
    assert warned in proc.stdout + proc.stderr  # the except branch ran (stand-in ROCm, broken build)
    assert str(current_trees["patched"]) in res["file"]
    assert res["is_cpu"] is False  # the path an NPU takes
    assert res["built"] is True and res["imported"] is False and res["native_ok"] is True
    assert res["rocm_broken"] is None
    assert res["rocm_working"] == ["flash", 1]


# ----------------------------------------------------------------------- vllm_ascend 0001 set_hccl_op_expansion_mode

_HCCL = """
import json, sys
from qwen3_rl.cpu_device.npu import stand_in
stand_in.install()
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
import vllm_ascend.utils as u
res = {"file": u.__file__, "groups": {}, "options": {}, "bad": []}
additional = {"qwen3_rl": {"hccl_op_expansion_mode": {"tp": "AIV", "ep": 2}}}
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config=additional)):
    for g in ("tp", "ep", "dp", "pp", "mc2"):
        res["groups"][g] = u.get_hccl_config_for_pg_options(g)
    for g in ("tp", "dp"):
        res["options"][g] = dict(u.create_hccl_pg_options(g).hccl_config)
for bad in ({"qwen3_rl": "tp=aiv"}, {"qwen3_rl": {"hccl_op_expansion_mode": "aiv"}},
            {"qwen3_rl": {"hccl_op_expansion_mode": {"tp": "fastest"}}},
            {"qwen3_rl": {"hccl_op_expansion_mode": {"tp": 7}}},
            {"qwen3_rl": {"hccl_op_expansion_mode": {"tp": True}}}):
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config=bad)):
        try:
            u.get_hccl_config_for_pg_options("tp")
            res["bad"].append("accepted")
        except ValueError as e:
            res["bad"].append(str(e))
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    res["unset"] = u.get_hccl_config_for_pg_options("tp")
print("RESULT", json.dumps(res))
"""


def test_current_hccl_op_expansion_reaches_the_groups_only_when_patched(current_trees: dict[str, Path]) -> None:
    patched = _result(_probe(_HCCL, current_trees["patched"]))
    assert str(current_trees["patched"]) in patched["file"]
    g = patched["groups"]
    assert g["tp"]["hccl_op_expansion_mode"] == 3 and g["ep"]["hccl_op_expansion_mode"] == 2
    assert "hccl_op_expansion_mode" not in g["dp"] and "hccl_op_expansion_mode" not in g["pp"]
    assert g["mc2"] is None
    assert patched["options"]["tp"] == {**g["tp"], "group_name": "tp"}
    assert "hccl_op_expansion_mode" not in patched["options"]["dp"]
    assert patched["unset"] == {k: v for k, v in g["tp"].items() if k != "hccl_op_expansion_mode"}
    assert len(patched["bad"]) == 5 and "accepted" not in patched["bad"]
    assert "must be a mapping" in patched["bad"][0] and "must map group names" in patched["bad"][1]
    assert "unknown mode 'fastest'" in patched["bad"][2] and "unknown mode 7" in patched["bad"][3]
    assert "unknown mode True" in patched["bad"][4]  # a bool is not a mode number
    # positive control: vLLM-Ascend 0.23.0.post1 as pinned ignores the option (buffer sizes equal, no mode)
    res = _result(_probe(_HCCL, current_trees["pristine"]))
    assert str(current_trees["pristine"]) in res["file"]
    assert res["groups"]["tp"] == patched["unset"] and "hccl_op_expansion_mode" not in res["groups"]["ep"]
    assert res["bad"] == ["accepted"] * 5
