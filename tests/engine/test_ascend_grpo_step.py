"""One GRPO step of the tiny CPU run in server mode with vLLM-Ascend's own engine behind verl's vLLM servers
(markers ``e2e``, ``ascend``, ``server``).

The same product command as ``test_e2e_training.py`` (``ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device
cpu``) with ``QWEN3_RL_CPU_ROLLOUT=ascend`` and ``ROLLOUT_MODE=async``: the device layer installs the NPU stand-in in
the engine core each server spawns, the model runner in the worker processes is vLLM-Ascend's. The sync rollout on
vLLM-Ascend (``NPUWorker`` -> ``NPUModelRunner`` -> ``SamAscendProposer``, the weights synced, the stand-in's kernels
called) is the resumed run of ``test_e2e_training.py::test_grpo_learns_then_fault_and_resume``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_e2e_training import (
    ASCEND_ROLLOUT,
    SHORT,
    _tail,
    check_ascend_rollout,
    check_step_log_and_ckpt,
    launch,
)

pytestmark = [pytest.mark.e2e, pytest.mark.ascend]

ASCEND_ROLLOUT_STEP = {**SHORT, **ASCEND_ROLLOUT, "TOTAL_TRAINING_STEPS": "1"}


@pytest.mark.server
@pytest.mark.timeout(2400)
def test_grpo_step_with_vllm_ascend_behind_the_servers(cpu_ws: Path, tmp_path: Path) -> None:
    """Server mode (``ROLLOUT_MODE=async``, routing on): verl's vLLM servers run vLLM-Ascend's engine core over the
    stand-in (the device layer installs it in the engine core the server spawns), the model runner in the worker
    processes is vLLM-Ascend's: the step trains, SAM drafts in the servers' engines, every sync is exact."""
    env = {**ASCEND_ROLLOUT_STEP, "ROLLOUT_MODE": "async", "SERVER_ROUTING": "True"}
    run = launch(cpu_ws, "internal/train_grpo_tiny_cpu.sh", tmp_path / "ascend-server", env=env)
    assert run.rc == 0, _tail(run)
    step = check_step_log_and_ckpt(run, [1])["steps"]["1"]
    check_ascend_rollout(run, step, sync_rollout=False)
    assert step["rollout/routing/sibling_same_engine"] == 1.0
    assert len(run.of("server_request")) == 16 * 8  # the step's requests, answered by the two servers
