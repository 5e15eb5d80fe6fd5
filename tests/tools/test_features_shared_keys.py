"""A key that several switches set to the same fixed value on the current set implies none of them when a final
command is read back (``features.values_from_overrides``, what preflight checks): there ``worker_cls`` =
``rollout_worker.SamWorker`` is set by ``SAM_ENABLE`` and by ``DISABLE_GC_IN_ENGINE_STEP`` (one engine takes one worker
class). Each switch is read from its own keys instead (``speculative_config.method``, ``scheduler_cls``)."""

from __future__ import annotations

import pytest

from qwen3_rl.tools import features as F

SETUP = "train_grpo_tiny_cpu.sh"
CTX = ["VLLM_DP=1", "ROLLOUT_TP=1", "TRAIN_BATCH_SIZE=16", "PPO_MINI_BATCH_SIZE=16"]
WORKER = "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_cls"


def _read_back(env: dict[str, str]) -> dict[str, str | None]:
    reg = F.load_registry()
    pin_set = env.get("PIN_SET", "seed")
    overrides = F.setup_overrides(SETUP, env, CTX, reg)
    vals = {o.lstrip("+").partition("=")[0]: o.partition("=")[2] for o in overrides}
    return {**F.values_from_overrides(reg, vals, SETUP, pin_set), "_worker": vals.get(WORKER)}


@pytest.mark.parametrize(
    ("sam", "gc"), [("True", "False"), ("False", "True"), ("True", "True"), ("False", "False")]
)
def test_current_set_reads_sam_and_gc_from_their_own_keys(sam: str, gc: str) -> None:
    got = _read_back({"PIN_SET": "current", "SAM_ENABLE": sam, "DISABLE_GC_IN_ENGINE_STEP": gc})
    # the shared key is there whenever either is on (the condition the read-back must not rely on)
    assert (got["_worker"] == "qwen3_rl.spec_decode.rollout_worker.SamWorker") == ("True" in (sam, gc)), got
    assert (got["SAM_ENABLE"], got["DISABLE_GC_IN_ENGINE_STEP"]) == (sam, gc), got


def test_seed_set_read_back_unchanged() -> None:
    got = _read_back({"SAM_ENABLE": "True", "DISABLE_GC_IN_ENGINE_STEP": "False"})
    assert (got["SAM_ENABLE"], got["DISABLE_GC_IN_ENGINE_STEP"]) == ("True", "False"), got
