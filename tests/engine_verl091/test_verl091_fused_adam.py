"""``FUSED_ADAM`` of the current set's CPU device layer (``qwen3_rl/cpu_device/megatron16_shims.py``): MindSpeed
core_r0.16.0's ``apex.optimizers.FusedAdam`` stood in for on the CPU, so that megatron-core 0.16.1 takes the branch it
takes on an A3 and a run can resume from its checkpoint.

What is checked, in a fresh process each (``tests/helpers/fused_adam16_driver.py``: world size 1 on gloo,
megatron's ``DistributedOptimizer`` over a tiny model):

* without the item (positive control): megatron falls back to torch's Adam and ``DistributedOptimizer.state_dict()``
  of a fresh optimizer, the call verl's ``load_checkpoint`` makes first, fails with ``assert len(steps) == 1``
  (``distrib_optimizer.py:642``): the failure the tiny run's resume hit;
* with it: megatron's Apex branch with the stand-in, the fresh ``state_dict()`` works; two steps equal
  ``torch.optim.AdamW`` fed the same gradients with the same group settings (moments exact, parameters within
  float32 rounding); the state holds ``exp_avg`` / ``exp_avg_sq`` only and each group's step count is the Python
  ``int`` 2 (MindSpeed core_r0.16.0's ``AdamW`` layout), saved as such.

The resume itself (restored weights and optimizer state, step numbers) is checked by
``test_verl091_tiny_learning.py::test_grpo_tiny_resumes_on_the_current_set``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.tiny_launch import free_port

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "helpers" / "fused_adam16_driver.py"
TIMEOUT_S = 300


def _drive(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(DRIVER), mode, str(free_port())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fresh_state_dict_fails_without_the_stand_in() -> None:
    out = _drive("no-shim")
    print(out)
    assert out["apex_or_te"] is False and out["adam"] == "torch.optim.adam.Adam", out
    assert out["fresh_state_dict"] == "AssertionError at distrib_optimizer.py:642: assert len(steps) == 1", (
        out
    )


def test_stand_in_is_megatrons_fused_adam_with_mindspeeds_layout() -> None:
    out = _drive("shim")
    print(out)
    assert out["apex_or_te"] is True and out["adam"].endswith("megatron16_shims.CpuFusedAdam16"), out
    assert out["fresh_state_dict"] == "ok", out
    cmp = out["against_torch_adamw"]
    assert cmp["tensors"] >= 2, cmp
    assert cmp["max_abs_diff"]["exp_avg"] == 0.0 and cmp["max_abs_diff"]["exp_avg_sq"] == 0.0, cmp
    assert cmp["max_abs_diff"]["param"] <= 1e-6, cmp
    assert out["state_keys"] == ["exp_avg", "exp_avg_sq"], out
    assert out["group_steps"] and all(type(s) is int and s == 2 for s in out["group_steps"]), out
    assert out["saved_steps"] == out["group_steps"], out
