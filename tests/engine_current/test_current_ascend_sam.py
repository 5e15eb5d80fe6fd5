"""SAM in vLLM-Ascend 0.23.0.post1's own engine (current set) with no patch for it: ``worker_cls`` =
``qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker`` seats the SAM drafter in the runner's n-gram seat
(``speculative_config.method="ngram"``), options from ``additional_config["qwen3_rl"]["sam_config"]``.

One engine (dense tiny model, ``NPUWorker`` -> ``NPUModelRunner`` over the torch_npu stand-in, vLLM-Ascend's rejection
sampler), four phases on the same requests: GRPO-like groups (each prompt twice, in two waves of one sample per
prompt), first SAM per request, then, after the worker RPC ``sam_reconfigure({"group_mode": True})``, SAM in group
mode, which drafts wave 2 from wave 1's finished responses (a cross-request draft that vLLM's n-gram cannot make);
then group mode with its finished-response cache off, without and with history (``history_responses``).
Greedy output is compared with HF transformers' ``generate``, which ``test_current_ascend_engine`` shows equal to the
same vLLM-Ascend engine without drafting on the same prompts and length; drafts and acceptances are vLLM's own
spec-decode counters per phase.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_current_ascend_engine import PROMPTS, TOKENS, patched_ascend_tree, run_ascend

from conftest import hf_greedy

K = 3
SAM_WORKER = "qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker"
#: each prompt twice (GRPO's n = 2), one sample of every prompt per wave
GROUP = [p for p in PROMPTS for _ in range(2)]
WAVES = [[0, 2, 4, 6], [1, 3, 5, 7]]
SAM_LLM = {
    "worker_cls": SAM_WORKER,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": K},
    "additional_config": {"qwen3_rl": {"sam_config": {}}},  # SAM per request
}

#: the engine's phases, in order (one ``sam_reconfigure`` RPC before each but the first)
PHASES = ("per_request", "group", "group_nocache", "history")
#: group mode without its finished-response cache (the control of HISTORY)
NO_CACHE = {"group_mode": True, "cache_max_responses": 0}
#: the same with each prompt's finished responses kept for its next group (history)
HISTORY = {**NO_CACHE, "history_responses": 2}


@pytest.fixture(scope="module")
def sam_runs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One vLLM-Ascend engine process, one engine, the phases of ``PHASES`` in order; HF's greedy output."""
    tmp = tmp_path_factory.mktemp("ascend023-sam")
    tree = patched_ascend_tree(tmp / "ws")
    phases = [
        {"name": "per_request", "prompts": GROUP, "waves": WAVES},
        {"name": "group", "prompts": GROUP, "waves": WAVES, "rpc": ["sam_reconfigure", {"group_mode": True}]},
        {"name": "group_nocache", "prompts": GROUP, "waves": WAVES, "rpc": ["sam_reconfigure", NO_CACHE]},
        {"name": "history", "prompts": GROUP, "waves": WAVES, "rpc": ["sam_reconfigure", HISTORY]},
    ]
    runs = run_ascend(
        {
            "tree": str(tree),
            "model": str(tiny_models["dense"]),
            "prompts": PROMPTS,
            "runs": [{"name": "sam", "llm": SAM_LLM, "sampling": {"max_tokens": TOKENS}, "phases": phases}],
        },
        tmp,
    )
    return {"runs": runs, "hf": hf_greedy(tiny_models["dense"], PROMPTS, TOKENS)}


def drafted(r: dict) -> tuple[int, int]:
    """(draft tokens, accepted tokens) of one phase, from vLLM's spec-decode counters."""
    m = r["metrics"]
    return int(m.get("spec_decode_num_draft_tokens", 0)), int(m.get("spec_decode_num_accepted_tokens", 0))


def test_sam_drafts_in_the_ascend_runner_losslessly(sam_runs: dict) -> None:
    hf_group = [o for o in sam_runs["hf"] for _ in range(2)]
    for phase in PHASES:
        r = sam_runs["runs"][f"sam:{phase}"]
        n_tok, n_acc = drafted(r)
        print(
            f"vLLM-Ascend 0.23 SAM {phase}: {n_tok} draft tokens, {n_acc} accepted ({r['metrics']}), "
            f"drafter {r['drafter']} {r.get('sam')}"
        )
        assert r["runner"] == "vllm_ascend.worker.model_runner_v1.NPUModelRunner", r["runner"]
        assert r["platform"] == "NPUPlatform", r["platform"]
        assert len(r["outputs"]) == len(GROUP) and all(len(o) == TOKENS for o in r["outputs"])
        assert r["outputs"] == hf_group, f"{phase}: SAM drafts changed the greedy output"
        assert n_tok > 0 and n_acc > 0, f"{phase}: nothing drafted or accepted ({r['metrics']})"


def test_the_drafter_is_sam_not_ngram(sam_runs: dict) -> None:
    """Positive control: the runner's drafter, read inside the engine, is our seat class (an ``AscendNgramProposer``
    subclass, not vLLM-Ascend's n-gram drafter), with the options of each phase."""
    per, grp = sam_runs["runs"]["sam:per_request"], sam_runs["runs"]["sam:group"]
    assert per["drafter"] == grp["drafter"] == "SamAscendNgramSeat", (per["drafter"], grp["drafter"])
    assert per["sam"] == {"group_mode": False, "k": K} and grp["sam"] == {"group_mode": True, "k": K}
    assert grp["rpc"] == ["SamAscendNgramSeat"], grp["rpc"]  # one worker, its reply


def test_group_mode_drafts_across_requests(sam_runs: dict) -> None:
    """Group mode drafts wave 2 from wave 1's finished responses of the same prompt: more accepted than per request
    on the same requests (cross-request drafting, which no per-request drafter such as n-gram has)."""
    per = drafted(sam_runs["runs"]["sam:per_request"])
    grp = drafted(sam_runs["runs"]["sam:group"])
    print(
        f"vLLM-Ascend 0.23 SAM, 4 prompts x 2 samples, {TOKENS} tokens, k={K}: per request {per[0]} drafted / "
        f"{per[1]} accepted; group mode {grp[0]} drafted / {grp[1]} accepted"
    )
    assert grp[1] > per[1], (per, grp)


def test_history_seeds_the_next_group(sam_runs: dict) -> None:
    """With the finished-response cache off, wave 2 drafts from wave 1 only through the history (each prompt's
    finished responses seed its next group): more accepted than the same group mode without history."""
    off = drafted(sam_runs["runs"]["sam:group_nocache"])
    hist = drafted(sam_runs["runs"]["sam:history"])
    print(
        f"vLLM-Ascend 0.23 SAM group mode, cache off: without history {off[0]} drafted / {off[1]} accepted; "
        f"history_responses=2 {hist[0]} drafted / {hist[1]} accepted"
    )
    assert sam_runs["runs"]["sam:history"]["rpc"] == ["SamAscendNgramSeat"]
    assert hist[1] > off[1], (off, hist)
