"""SAM, n-gram, the batch-size threshold, the gc switch (vLLM seam hooks + plugin) and the in-process drafts fix
(vllm 0002) in vLLM 0.13.0's real engine.

Every configuration runs the real ``LLM(...)`` (in-process ``LLMEngine`` -> ``EngineCore`` ->
``Scheduler`` -> ``CPUModelRunner``/``GPUModelRunner``) on the patched tree; drafting is counted with
vLLM's own spec-decode counters (``LLM.get_metrics()``), and losslessness is checked against the same
engine decoding without drafts (greedy, float32, vLLM's native ops).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_engine, tree_without

K = 3
KMAX = 15  # adaptive draft length: vLLM's num_speculative_tokens is k_max

# Four prompts of varied shape (ids < 512, the tiny vocabulary); GROUP repeats each twice, as GRPO's n=2,
# generated in two waves (first samples, then second samples) so the second wave can draft from the
# finished siblings (group mode's finished-response cache).
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
GROUP = [p for p in PROMPTS for _ in range(2)]
WAVES = [[0, 2, 4, 6], [1, 3, 5, 7]]


def sam(k: int = K, **sam_config) -> dict:
    spec = {"method": "sam", "num_speculative_tokens": k}
    if sam_config:
        spec["sam_config"] = sam_config
    return {"speculative_config": spec}


def drafted(r: dict) -> tuple[int, int]:
    m = r["metrics"]
    return int(m.get("spec_decode_num_draft_tokens", 0)), int(m.get("spec_decode_num_accepted_tokens", 0))


#: the runs made on both models: decoding without drafts, SAM per request, group mode, pad_drafts (the
#: model-dependent claim: SAM is lossless on the dense and on the MoE model)
MODEL_RUNS = [
    {"name": "base"},
    {"name": "base_group", "prompts": GROUP, "phases": WAVES},
    {"name": "sam", "llm": sam()},
    {"name": "sam_group", "llm": sam(group_mode=True), "prompts": GROUP, "phases": WAVES},
    {"name": "sam_pad", "llm": sam(pad_drafts=True)},
]
#: the batch-size threshold's requests: the two short ones finish first and shrink the batch from 4 to 2
GATE_LENS = [16, 16, 64, 64]
#: runs made on the dense model only: the drafter logic above the runner (sibling drafting, exchange, history,
#: adaptive k, the batch-size gate, the gc hook) and vLLM's n-gram reference do not depend on the model
DENSE_RUNS = [
    {"name": "sam_own_waves", "llm": sam(), "prompts": GROUP, "phases": WAVES},
    {"name": "sam_group_exchange", "llm": sam(group_mode=True, group_exchange=True), "prompts": GROUP,
     "phases": WAVES},
    # history across generate calls: wave 2 (the prompts' second samples) drafts from wave 1's responses;
    # the finished-response cache is off, so without history nothing of wave 1 is left (positive control)
    {"name": "sam_group_nocache", "llm": sam(group_mode=True, cache_max_responses=0), "prompts": GROUP,
     "phases": WAVES},
    {"name": "sam_history", "llm": sam(group_mode=True, cache_max_responses=0, history_responses=4),
     "prompts": GROUP, "phases": WAVES},
    {"name": "sam_history_adaptive", "llm": sam(KMAX, group_mode=True, cache_max_responses=0,
                                                history_responses=4, adaptive_k=True),
     "prompts": GROUP, "phases": WAVES},
    {"name": "sam_adaptive_pad", "llm": sam(KMAX, adaptive_k=True, pad_drafts=True)},
    {"name": "ngram", "llm": {"speculative_config": {"method": "ngram", "num_speculative_tokens": K,
                                                      "prompt_lookup_max": 3, "prompt_lookup_min": 1}}},
    # test_batch_size_threshold_switches_in_the_step_loop
    {"name": "gate_base", "max_tokens": GATE_LENS},
    {"name": "gated", "max_tokens": GATE_LENS,
     "llm": {"speculative_config": {"method": "sam", "num_speculative_tokens": K, "disable_by_batch_size": 2}}},
    # test_gc_switch_in_the_real_engine_loop
    {"name": "gc_off", "prompts": PROMPTS[:2], "sampling": {"max_tokens": 8}},
    {"name": "gc_on", "prompts": PROMPTS[:2], "sampling": {"max_tokens": 8}, "gc_policy": True},
]


@pytest.fixture(scope="module")
def dense_runs(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory) -> dict[str, dict]:
    """One engine process on the dense model: MODEL_RUNS, then DENSE_RUNS."""
    spec = {"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": PROMPTS,
            "runs": MODEL_RUNS + DENSE_RUNS}
    return run_engine(spec, tmp_path_factory.mktemp("sam-dense"))


@pytest.fixture(scope="module")
def moe_runs(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory) -> dict[str, dict]:
    """One engine process on the MoE model: MODEL_RUNS only."""
    spec = {"workspace": str(engine_ws), "model": str(tiny_models["moe"]), "prompts": PROMPTS, "runs": MODEL_RUNS}
    return run_engine(spec, tmp_path_factory.mktemp("sam-moe"))


@pytest.fixture(params=["dense", "moe"])
def sam_runs(request) -> dict[str, dict]:
    """The runs of one model (each model's engine process runs once per module)."""
    return request.getfixturevalue(f"{request.param}_runs")


def test_sam_builds_in_the_real_runner(sam_runs: dict[str, dict]) -> None:
    # vLLM seam: GPUModelRunner.__init__ builds the registry's "sam" drafter (the plugin's; pristine raises
    # "Unknown speculative decoding method: sam"), in the constructor vLLM-CPU and vLLM-Ascend both run.
    for name in ("sam", "sam_group", "sam_pad"):
        assert sam_runs[name]["drafter"]["class"] == "SamVllmProposer"


@pytest.mark.parametrize("sam_runs,name,base", [
    *((m, n, b) for n, b in (("sam", "base"), ("sam_group", "base_group"), ("sam_pad", "base")) for m in ("dense", "moe")),
    ("dense", "sam_adaptive_pad", "base"), ("dense", "ngram", "base")], indirect=["sam_runs"])
def test_greedy_output_is_token_identical(sam_runs: dict[str, dict], name: str, base: str) -> None:
    """SAM per request, group mode and pad_drafts on both models; adaptive k and vLLM's n-gram on the dense model only
    (the drafter's choice of k above the runner and n-gram do not depend on the model; SAM lossless on MoE stays
    checked by the three above)."""
    out, ref = sam_runs[name]["outputs"], sam_runs[base]["outputs"]
    assert len(out) == len(ref) and all(len(o) == 64 for o in out)
    assert out == ref


@pytest.mark.parametrize("sam_runs,name", [
    *((m, n) for n in ("sam", "sam_group", "sam_pad") for m in ("dense", "moe")), ("dense", "ngram")],
    indirect=["sam_runs"])
def test_drafts_are_proposed_and_accepted(sam_runs: dict[str, dict], name: str) -> None:
    """SAM's three modes on both models; vLLM's n-gram reference on the dense model only (it does not depend on it)."""
    proposed, accepted = drafted(sam_runs[name])
    print(f"{name}: {proposed} draft tokens, {accepted} accepted")
    assert proposed > 0, f"{name}: no draft token reached the scheduler"
    assert accepted > 0, f"{name}: drafts proposed but none accepted"
    assert drafted(sam_runs["base"]) == (0, 0)


def test_pad_drafts_fills_every_draft_to_k(sam_runs: dict[str, dict]) -> None:
    # pad_drafts: every drafted step carries exactly k tokens (FULL_DECODE_ONLY graph shape)
    m = sam_runs["sam_pad"]["metrics"]
    assert m["spec_decode_num_draft_tokens"] == K * m["spec_decode_num_drafts"] > 0
    m = sam_runs["sam"]["metrics"]
    assert m["spec_decode_num_draft_tokens"] < K * m["spec_decode_num_drafts"]


def test_group_mode_drafts_from_siblings(dense_runs: dict[str, dict]) -> None:
    """Dense model only: drafting from the siblings is drafter logic above the runner, independent of the model (SAM
    group mode lossless on MoE stays checked in test_greedy_output_is_token_identical)."""
    sam_runs = dense_runs
    # Greedy siblings share their text: in the second wave the group automaton drafts each sample from
    # its finished sibling, so group mode accepts more than per-request SAM on the same two waves.
    group, own = drafted(sam_runs["sam_group"]), drafted(sam_runs["sam_own_waves"])
    print(f"two waves of 4: group mode {group}, per request {own} (draft tokens, accepted)")
    assert sam_runs["sam_own_waves"]["outputs"] == sam_runs["base_group"]["outputs"]
    assert group[1] > own[1]


def test_group_exchange_in_the_real_engine(dense_runs: dict[str, dict]) -> None:
    """Dense model only: the exchange hook and the drafter above the runner do not depend on the model."""
    sam_runs = dense_runs
    # the sam_sibling_exchange hook (vLLM seam + plugin): with sam_config.group_exchange it runs after every
    # LLMEngine.step and all-gathers over
    # vLLM's own gloo DP group, here of one rank (vLLM-CPU cannot run DP > 1 under the external launcher:
    # vllm/platforms/cpu.py:213-225). Nothing comes from other ranks, so drafting and output are exactly
    # group mode's: the exchange runs in the real engine loop without changing a token or a draft.
    r = sam_runs["sam_group_exchange"]
    ex = r["drafter"]["exchange"]
    print(f"exchange: {ex}, drafted/accepted {drafted(r)}")
    assert ex["enabled"] and ex["world"] == 1 and ex["rank"] == 0
    assert ex["exchanges"] == ex["hook_steps"] > 64 and ex["tokens_sent"] > 0 and ex["tokens_merged"] == 0
    assert r["outputs"] == sam_runs["base_group"]["outputs"] == sam_runs["sam_group"]["outputs"]
    assert drafted(r) == drafted(sam_runs["sam_group"]) and drafted(r)[1] > 0
    assert "exchange" not in sam_runs["sam_group"]["drafter"]


def test_batch_size_threshold_switches_in_the_step_loop(dense_runs: dict[str, dict]) -> None:
    """Dense model only (runs of the dense engine process): the gate is drafter logic above the runner."""
    # disable_by_batch_size=2: with 4 running requests drafting is off; once the two short ones finish
    # (max_tokens 16) the batch is 2 and drafting comes back, fed with every token generated meanwhile.
    r = dense_runs
    gate = r["gated"]["drafter"]["gate"]
    print(f"gate: {gate}, drafted/accepted {drafted(r['gated'])}")
    assert gate["threshold"] == 2
    # starts on, off at the first 4-request step, on again at 2: two switches
    assert gate["steps_off"] >= 15 and gate["steps_on"] > 0 and gate["switches"] == 2
    assert drafted(r["gated"])[1] > 0
    assert r["gated"]["outputs"] == r["gate_base"]["outputs"]


def test_gc_switch_in_the_real_engine_loop(dense_runs: dict[str, dict]) -> None:
    """Dense model only (runs of the dense engine process): the hook wraps LLMEngine.step whatever the model."""
    # the gc_guard engine-step hook (vLLM seam + plugin): the collector is off around each LLMEngine.step while
    # the policy is on, and restored after; with the policy off, nothing changes.
    r = dense_runs
    assert r["gc_off"]["gc_enabled_in_step"] and all(r["gc_off"]["gc_enabled_in_step"])
    assert r["gc_on"]["gc_enabled_in_step"] and not any(r["gc_on"]["gc_enabled_in_step"])
    assert r["gc_on"]["gc_enabled_after"] is True


def test_inproc_client_drafts_only_with_the_inproc_fix(engine_ws: Path, tiny_models: dict[str, Path],
                                                       tmp_path: Path) -> None:
    # vllm 0002 (bug fix): without it the in-process client (verl's SPMD mode) never calls EngineCore.post_step,
    # so no draft reaches the scheduler. Same tree with only 0002 reversed (the seam 0003 touches other files):
    # zero drafts; with it: drafts.
    old = tree_without(engine_ws, tmp_path / "ws-without-0002", "vllm", 2, only=True)
    runs = [{"name": "sam", "llm": sam(), "sampling": {"max_tokens": 32}}]
    with_fix = run_engine({"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": PROMPTS,
                           "runs": runs}, tmp_path)
    without = run_engine({"workspace": str(old), "model": str(tiny_models["dense"]), "prompts": PROMPTS,
                          "runs": runs}, tmp_path)
    print(f"with 0002: {drafted(with_fix['sam'])}, without: {drafted(without['sam'])}")
    assert drafted(without["sam"]) == (0, 0)
    assert drafted(with_fix["sam"])[1] > 0
    assert with_fix["sam"]["outputs"] == without["sam"]["outputs"]


def test_history_serves_the_next_generate_call(dense_runs: dict[str, dict]) -> None:
    """Dense model only: the history store is drafter logic above the runner, independent of the model."""
    sam_runs = dense_runs
    # Two generate calls on the same prompts: every group of call 1 is freed when its only member finishes;
    # with history_responses the group of call 2 starts with call 1's response (greedy: the same text), so
    # call 2 drafts from it. Lossless against decoding without drafts; the cache-off run is the control.
    hist, ctrl = sam_runs["sam_history"], sam_runs["sam_group_nocache"]
    print(f"history: {drafted(hist)} {hist['drafter']['history']}, without: {drafted(ctrl)} (drafted, accepted)")
    assert hist["outputs"] == ctrl["outputs"] == sam_runs["base_group"]["outputs"]
    assert hist["drafter"]["history"]["strings"] == len(PROMPTS)  # one seeded response per prompt in call 2
    assert 0 < hist["drafter"]["history"]["bytes"] <= hist["drafter"]["history"]["bound"]
    assert drafted(hist)[1] > drafted(ctrl)[1] + 32 * len(PROMPTS) // 2
    assert "history" not in ctrl["drafter"]


def test_adaptive_k_varies_per_step_and_is_lossless(dense_runs: dict[str, dict]) -> None:
    """Dense model only: the choice of k is drafter logic above the runner, independent of the model."""
    sam_runs = dense_runs
    # k_max 15 with history: the drafter chooses each request's draft length per step from the cost model and
    # the acceptance it sees; the engine verifies drafts of varying length without changing a token.
    r = sam_runs["sam_history_adaptive"]
    ad = r["drafter"]["adaptive"]
    print(f"adaptive: {drafted(r)} (drafted, accepted); longest draft per step {ad['step_hist']}; "
          f"per request {ad['k_hist']}")
    assert r["outputs"] == sam_runs["base_group"]["outputs"]
    assert drafted(r)[1] > 0
    assert sum(1 for c in ad["step_hist"][1:] if c) >= 2  # k changes from step to step
    assert max(i for i, c in enumerate(ad["k_hist"]) if c) > K  # and goes beyond the fixed k
    # pad_drafts (graph mode) with adaptive k: one padded length per step, still lossless (parametrized above)
    pad = sam_runs["sam_adaptive_pad"]
    print(f"adaptive + pad_drafts: {drafted(pad)}; k per step {pad['drafter']['adaptive']['step_hist']}")
    assert drafted(pad)[0] > 0
