"""One GRPO step of the tiny CPU run with the rollout on vLLM-Ascend's own engine (markers ``e2e`` and ``ascend``).

The same product command as ``test_e2e_training.py`` (``ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device
cpu``: verl's trainer, the Megatron actor on gloo, verl's sync rollout, the weight sync), with
``QWEN3_RL_CPU_ROLLOUT=ascend``: the device layer's ``sitecustomize`` installs the NPU stand-in in each process when
it first imports vLLM (after verl has settled on the CPU device) and selects vLLM-Ascend's platform, so the
rollout runs ``NPUWorker`` -> ``NPUModelRunner`` -> the Ascend attention backend and, with SAM on,
``SamAscendProposer`` (the vllm_ascend seam, 0002) instead of vLLM's CPU runner. Checked: the step trains (a step record
and its checkpoint), SAM drafted and accepted tokens in it, and the rollout workers ran vLLM-Ascend's worker and
runner (the e2e probe's record of the engine it synced weights into, and the stand-in kernels called).
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
    # the probe (qwen3_rl/cpu_device/probe.py) in each rollout worker: vLLM-Ascend's worker, runner and SAM adapter
    # held the weights the actor synced (all equal), and the stand-in's NPU kernels ran during generation
    syncs, gens = run.of("weight_sync"), run.of("generate_end")
    assert {e["rank"] for e in syncs} == {0, 1} and {e["rank"] for e in gens} == {0, 1}
    for e in syncs:
        print(f"rank {e['rank']}: {e['worker']} / {e['runner']} / {e['drafter']}, weights equal: {e['all_equal']}")
        assert (e["worker"], e["runner"], e["drafter"]) == ("NPUWorker", "NPUModelRunner", "SamAscendProposer")
        assert e["all_equal"] and e["compared"] == e["engine_params"] > 0
    for e in gens:
        assert e["npu_calls"] and e["npu_calls"].get("torch_npu.npu_fused_infer_attention_score", 0) > 0, e


@pytest.mark.server
@pytest.mark.timeout(2400)
def test_grpo_step_with_vllm_ascend_behind_the_servers(cpu_ws: Path, tmp_path: Path) -> None:
    """Server mode (``ROLLOUT_MODE=async``, routing on): verl's vLLM servers run vLLM-Ascend's engine core over the
    stand-in (the device layer installs it in the engine core the server spawns), the model runner in the worker
    processes is vLLM-Ascend's: the step trains, SAM drafts in the servers' engines, every sync is exact."""
    env = {**ASCEND_ROLLOUT, "ROLLOUT_MODE": "async", "SERVER_ROUTING": "True"}
    run = launch(cpu_ws, "internal/train_grpo_tiny_cpu.sh", tmp_path / "ascend-server", env=env)
    assert run.rc == 0, _tail(run)
    step = check_step_log_and_ckpt(run, [1])["steps"]["1"]
    drafted, accepted = step.get("rollout/spec_decode/draft_tokens", 0), step.get("rollout/spec_decode/accepted_tokens", 0)
    print(f"GRPO step, vLLM-Ascend behind the servers: {drafted} draft tokens, {accepted} accepted ({run.seconds:.0f} s)")
    assert drafted > 0 and accepted > 0, {k: v for k, v in step.items() if "spec_decode" in k}
    assert step["rollout/routing/sibling_same_engine"] == 1.0
    syncs = run.of("weight_sync")
    assert {e["rank"] for e in syncs} == {0, 1}
    for e in syncs:
        assert (e["worker"], e["runner"], e["drafter"]) == ("NPUWorker", "NPUModelRunner", "SamAscendProposer")
        assert e["all_equal"] and e["compared"] == e["engine_params"] > 0
    assert len(run.of("server_request")) == 16 * 8  # the step's requests, answered by the two servers
