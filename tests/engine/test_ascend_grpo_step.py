"""One GRPO step of the tiny CPU run with the rollout on vLLM-Ascend's own engine (markers ``e2e`` and ``ascend``).

The same product command as ``test_e2e_training.py`` (``ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device
cpu``: verl's trainer, the Megatron actor on gloo, verl's sync rollout, the weight sync), with
``QWEN3_RL_CPU_ROLLOUT=ascend``: the device layer's ``sitecustomize`` installs the NPU stand-in in each process when
it first imports vLLM (after verl has settled on the CPU device) and selects vLLM-Ascend's platform, so the
rollout runs ``NPUWorker`` -> ``NPUModelRunner`` -> the Ascend attention backend and, with SAM on,
``SamAscendProposer`` (vllm_ascend 0003) instead of vLLM's CPU runner. Checked: the step trains (a step record
and its checkpoint), SAM drafted and accepted tokens in it, and the rollout workers ran vLLM-Ascend's worker and
runner (their log lines), not vLLM's CPU ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_e2e_training import SHORT, _tail, check_step_log_and_ckpt, launch

pytestmark = [pytest.mark.e2e, pytest.mark.ascend]

ASCEND_ROLLOUT = {**SHORT, "TOTAL_TRAINING_STEPS": "1", "SAM_ENABLE": "True", "SAM_GROUP": "True",
                  "QWEN3_RL_CPU_ROLLOUT": "ascend",
                  # the stand-in's device size: vLLM-Ascend sizes the KV cache from it (ROLLOUT_GPU_MEMORY_UTILIZATION)
                  "QWEN3_RL_NPU_MEMORY_GIB": "1"}


@pytest.mark.timeout(2400)
def test_grpo_step_with_the_rollout_on_vllm_ascend(cpu_ws: Path, tmp_path: Path) -> None:
    run = launch(cpu_ws, "internal/train_grpo_tiny_cpu.sh", tmp_path / "ascend", env=ASCEND_ROLLOUT)
    assert run.rc == 0, _tail(run)
    doc = check_step_log_and_ckpt(run, [1])
    step = doc["steps"]["1"]
    drafted = step.get("rollout/spec_decode/draft_tokens", 0)
    accepted = step.get("rollout/spec_decode/accepted_tokens", 0)
    print(f"GRPO step on vLLM-Ascend: {drafted} draft tokens, {accepted} accepted ({run.seconds:.0f} s)")
    assert drafted > 0 and accepted > 0, {k: v for k, v in step.items() if "spec_decode" in k}
    logs = "\n".join(f.read_text(errors="replace") for f in (tmp_path / "ascend" / "logs").rglob("*") if f.is_file())
    logs += run.log
    assert "vllm_ascend.worker.worker" in logs or "NPUWorker" in logs, "no vLLM-Ascend worker in the run's logs"
    assert "cpu_worker" not in logs and "CPUModelRunner" not in logs, "vLLM's CPU runner ran the rollout"
