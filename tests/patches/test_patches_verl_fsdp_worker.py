"""verl patch 0003 (expandable-segments hot swap on the NPU allocator) where verl's FSDP worker calls it, EXECUTED:
the patched FSDP ``ActorRolloutRefWorker`` runs on CPU in a child process (``tests/helpers/fsdp_worker_driver.py``:
``__init__``, ``init_model`` with the FSDP2 actor of the repo's tiny Qwen3 and verl's ``_build_rollout``,
``rollout_mode`` / ``trainer_mode``), with verl's device flags as on an A3 around the mode switches and the NPU
allocator a recorder. The rollout engine is the one stand-in (it records the calls and the weights pushed). Checked:
with ``rollout.npu_expandable_segments`` at its default the switches reach
``torch.npu.memory._set_allocator_settings`` (off for the rollout, on for training), after a worker built with
``false`` nothing reaches it (upstream's behaviour on NPU); the switches run around a real weight push (the FSDP2
actor's full state equals the HF weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import PINS, REPO, free_port

DRIVER = REPO / "tests" / "helpers" / "fsdp_worker_driver.py"


def test_fsdp_worker_switches_the_npu_allocator_around_rollout(patched_workspace: Path,
                                                               tmp_path: Path) -> None:
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    model = make_tiny_model(tmp_path / "dense", TinySpec(moe=False))
    verl = patched_workspace / PINS.frameworks["verl"].dir
    megatron = patched_workspace / PINS.frameworks["megatron"].dir
    env = {**os.environ, "QWEN3_RL_CPU_SHIMS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join(str(p) for p in (REPO / "qwen3_rl" / "cpu_device", verl, megatron, REPO))}
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(DRIVER), str(verl / "verl" / "trainer" / "config"), str(model), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    res = json.loads(out.read_text())
    assert res["fsdp_version"] == 2
    assert res["npu_calls_after_init"] == []  # init_model's own trainer_mode ran with the CPU's flags
    assert res["npu_calls_on"] == ["expandable_segments:False", "expandable_segments:True"]
    assert res["npu_calls_off"] == []
    # init_model's trainer_mode, then twice rollout_mode + trainer_mode, each with the real weight push
    assert res["rollout_calls"] == ["release"] + ["resume:weights", "update_weights", "resume:kv_cache", "release"] * 2
    assert res["weights_pushed"] == res["hf_weights"] > 0 and res["weights_equal_hf"]
