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

Adaptive k, the cost table and ``calibrate`` in the same engine process: first ``python -m qwen3_rl calibrate`` times
vLLM-Ascend's engine (its own ``LLM``, dummy weights, SAM in the n-gram seat padded to k) and writes a table; then,
after the four phases above, the 8 requests run in one wave whose batch shrinks (one sample of each prompt stops at
``SHORT`` tokens): SAM at fixed k (the control), adaptive k priced by two made-up tables (one makes drafts free while
at most 4 requests run and as dear as a whole step per token above, the other the reverse), and adaptive k priced by
the calibrated table. The driver records what the drafter returns per step and recomputes each adaptive choice from
the table file read again. The seed set's metrics reader (``RolloutProbe``) reads vLLM's counters of every phase.
"""

from __future__ import annotations

import json
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

#: the shrinking batch: all 8 requests in one wave, the first sample of each prompt stops after SHORT tokens
SHORT = 8
LENGTHS = [SHORT if i % 2 == 0 else TOKENS for i in range(len(GROUP))]
#: the made-up tables' batch split: drafts cost nothing at B <= SPLIT, a whole step per draft token above (tail), or
#: the reverse (bulk)
SPLIT = 4
#: the adaptive phases (after ``fixed_k``, the control at fixed k = K), each with its table's name
TABLES = {"table_tail": "tail", "table_bulk": "bulk", "calibrated": "calibrated"}
#: ``calibrate``'s grid (k up to the engine's K, the longest draft the tables must price)
CAL_GRID = ["--batch", "1,4", "--k", "0,1,3", "--ctx", "32", "--steps", "2"]


def made_up_table(cheap_tail: bool) -> dict:
    """A cost table (B 1, 4, 5, 8 x k 0..K x ctx 1, 4096): 10 ms whatever k on one side of SPLIT, 10 ms per query
    token (a draft token costs a whole decode step) on the other."""
    rows = []
    for b in (1, SPLIT, SPLIT + 1, 8):
        free = (b <= SPLIT) == cheap_tail
        for k in range(K + 1):
            for ctx in (1, 4096):
                rows.append(
                    {"model": "made-up", "B": b, "k": k, "ctx": ctx, "step_ms": 10.0 * (1 if free else k + 1)}
                )
    return {"rows": rows}


@pytest.fixture(scope="module")
def sam_runs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One vLLM-Ascend engine process: ``calibrate``'s engine, then one SAM engine with the phases of ``PHASES``,
    ``fixed_k`` and ``TABLES`` in order; HF's greedy output; the three tables' files."""
    tmp = tmp_path_factory.mktemp("ascend023-sam")
    tree = patched_ascend_tree(tmp / "ws")
    tables = {"calibrated": tmp / "calibrated.json", "tail": tmp / "tail.json", "bulk": tmp / "bulk.json"}
    tables["tail"].write_text(json.dumps(made_up_table(cheap_tail=True)))
    tables["bulk"].write_text(json.dumps(made_up_table(cheap_tail=False)))
    shrink = {"prompts": GROUP, "max_tokens": LENGTHS}
    phases = [
        {"name": "per_request", "prompts": GROUP, "waves": WAVES},
        {"name": "group", "prompts": GROUP, "waves": WAVES, "rpc": ["sam_reconfigure", {"group_mode": True}]},
        {"name": "group_nocache", "prompts": GROUP, "waves": WAVES, "rpc": ["sam_reconfigure", NO_CACHE]},
        {"name": "history", "prompts": GROUP, "waves": WAVES, "rpc": ["sam_reconfigure", HISTORY]},
        {"name": "fixed_k", **shrink, "rpc": ["sam_reconfigure", {}]},
    ] + [
        {
            "name": name,
            **shrink,
            "rpc": ["sam_reconfigure", {"adaptive_k": True, "cost_table": str(tables[t])}],
        }
        for name, t in TABLES.items()
    ]
    calibrate = [
        "--setup",
        "internal/train_grpo_tiny_cpu.sh",
        "--model",
        str(tiny_models["dense"]),
        "--out",
        str(tables["calibrated"]),
        *CAL_GRID,
    ]
    runs = run_ascend(
        {
            "tree": str(tree),
            "model": str(tiny_models["dense"]),
            "prompts": PROMPTS,
            # the stand-in device's size: calibrate's engine sizes its KV cache by gpu_memory_utilization of it
            "env": {"QWEN3_RL_NPU_MEMORY_GIB": "1"},
            "runs": [
                {"name": "calibrate", "calibrate": calibrate},
                {"name": "sam", "llm": SAM_LLM, "sampling": {"max_tokens": TOKENS}, "phases": phases},
            ],
        },
        tmp,
    )
    return {"runs": runs, "hf": hf_greedy(tiny_models["dense"], PROMPTS, TOKENS), "tables": tables}


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


# ---------------------------------------------------------------------------------------------- adaptive k, tables
def shrink_expected(hf: list[list[int]]) -> list[list[int]]:
    """HF's greedy output of the shrinking-batch phases (request i: its prompt's first ``LENGTHS[i]`` tokens)."""
    return [hf[i // 2][:n] for i, n in enumerate(LENGTHS)]


def longest_by_batch(r: dict) -> tuple[list[int], list[int]]:
    """The longest draft the drafter returned at each step with more than SPLIT rows, and at each with at most."""
    big = [k for rows, k, *_ in r["steps"] if rows > SPLIT]
    small = [k for rows, k, *_ in r["steps"] if rows <= SPLIT]
    return big, small


@pytest.mark.parametrize("phase", ["fixed_k", *TABLES])
def test_shrinking_batch_is_lossless(sam_runs: dict, phase: str) -> None:
    r = sam_runs["runs"][f"sam:{phase}"]
    n_tok, n_acc = drafted(r)
    print(
        f"vLLM-Ascend 0.23 SAM {phase}: {n_tok} draft tokens, {n_acc} accepted; per step [rows, longest draft, "
        f"draft tokens, rows drafting] {r['steps']}; adaptive {r.get('adaptive')}; {r['seconds']} s"
    )
    assert r["runner"] == "vllm_ascend.worker.model_runner_v1.NPUModelRunner", r["runner"]
    assert r["outputs"] == shrink_expected(sam_runs["hf"]), f"{phase}: drafts changed the greedy output"
    assert n_tok > 0 and n_acc > 0, (phase, r["metrics"])


def test_fixed_k_drafts_k_at_every_batch_size(sam_runs: dict) -> None:
    """Positive control of the adaptive phases: without adaptive k the drafter returns drafts of K tokens while more
    than SPLIT requests run and while fewer do, on the same requests."""
    r = sam_runs["runs"]["sam:fixed_k"]
    big, small = longest_by_batch(r)
    assert "adaptive" not in r and big and small, r["steps"]
    assert max(big) == K and max(small) == K, r["steps"]


@pytest.mark.parametrize(("phase", "cheap_tail"), [("table_tail", True), ("table_bulk", False)])
def test_adaptive_k_follows_the_table_as_the_batch_shrinks(
    sam_runs: dict, phase: str, cheap_tail: bool
) -> None:
    """Per step, the longest draft follows the table at the step's batch size: where the table prices a draft token
    at a whole step, no request drafts more than k_min = 1 token; where drafts cost nothing, drafts of 2+ tokens are
    returned. The two tables swap the sides, on the same requests; every choice equals the one a copy of the policy
    makes with the table file read again."""
    r = sam_runs["runs"][f"sam:{phase}"]
    big, small = longest_by_batch(r)
    dear, free = (big, small) if cheap_tail else (small, big)
    ad = r["adaptive"]
    print(f"{phase}: longest draft per step, B > {SPLIT}: {big}; B <= {SPLIT}: {small}; {ad}")
    assert ad["table"] == str(sam_runs["tables"]["tail" if cheap_tail else "bulk"])
    assert dear and max(dear) <= 1, r["steps"]
    assert free and max(free) >= 2, r["steps"]
    assert ad["choices"] > 0 and ad["agree"] == ad["choices"], ad


def test_calibrate_writes_a_table_of_the_ascend_engine(sam_runs: dict) -> None:
    """``calibrate`` on vLLM-Ascend 0.23's engine: SAM seated by our worker class in the n-gram seat, the stand-in
    device named, every timed step verified B * k draft tokens (vLLM's counters), and the table loads."""
    from qwen3_rl.spec_decode.cost_table import load_cost_table

    cal = sam_runs["runs"]["calibrate"]
    assert cal["rc"] == 0, cal["stdout"][-3000:]
    data = cal["table"]
    print(cal["stdout"].strip().splitlines()[-1], data["device"], f"{cal['seconds']} s in the driver")
    print("step ms per (B, k):", {(r["B"], r["k"]): r["step_ms"] for r in data["rows"]})
    assert data["engine"]["worker_cls"] == SAM_WORKER and data["drafter"]["method"] == "ngram", data[
        "drafter"
    ]
    assert data["engine"]["additional_config"]["qwen3_rl"]["sam_config"] == {"pad_drafts": True}
    assert "Ascend" in data["device"], data["device"]
    assert all(r["draft_tokens_per_step"] == r["B"] * r["k"] for r in data["rows"]), data["rows"]
    table = load_cost_table(str(sam_runs["tables"]["calibrated"]))
    assert table.k.tolist() == [0, 1, 3] and table.b.tolist() == [1.0, 4.0]


def test_calibrated_table_drives_adaptive_k(sam_runs: dict) -> None:
    """The drafter loads calibrate's file (the policy's table is that file) and every draft length it chose is the
    choice priced by that table (recomputed from the file); how often the linear model would have chosen the same is
    printed."""
    r = sam_runs["runs"]["sam:calibrated"]
    ad = r["adaptive"]
    print(f"calibrated: {ad}; linear model same choice in {ad['linear_same']} of {ad['choices']}")
    assert ad["table"] == str(sam_runs["tables"]["calibrated"])
    assert ad["choices"] > 0 and ad["agree"] == ad["choices"], ad
    assert sum(ad["k_hist"][1:]) > 0, ad


# ---------------------------------------------------------------------------------------------- spec-decode metrics
@pytest.mark.parametrize("phase", [*PHASES, "fixed_k", *TABLES])
def test_spec_decode_metrics_come_out_of_the_engine(sam_runs: dict, phase: str) -> None:
    """vLLM's spec-decode counters of vLLM-Ascend 0.23's engine, read by the seed set's ``RolloutProbe``: its counts
    equal the counters, its step metrics are their ratios, accepted tokens per position add up to the accepted
    tokens and never rise with the position, and none exceeds the draft tokens the drafter returned there."""
    r = sam_runs["runs"][f"sam:{phase}"]
    m, probe = r["metrics"], r["probe"]
    counts = probe["counts"]
    print(
        f"{phase}: probe {probe}; accepted per position {r['per_pos']}; drafted per position "
        f"{r['drafted_per_pos']}"
    )
    assert counts == {
        "num_drafts": int(m["spec_decode_num_drafts"]),
        "num_draft_tokens": int(m["spec_decode_num_draft_tokens"]),
        "num_accepted_tokens": int(m["spec_decode_num_accepted_tokens"]),
    }, (counts, m)
    sm = probe["step_metrics"]
    assert sm["rollout/spec_decode/acceptance_rate"] == pytest.approx(
        counts["num_accepted_tokens"] / counts["num_draft_tokens"]
    )
    assert sm["rollout/spec_decode/mean_acceptance_length"] == pytest.approx(
        1 + counts["num_accepted_tokens"] / counts["num_drafts"]
    )
    pos = r["per_pos"]
    assert len(pos) == K and sum(pos) == counts["num_accepted_tokens"] > 0, pos
    assert all(a >= b for a, b in zip(pos, pos[1:], strict=False)), pos
    assert pos[0] <= counts["num_drafts"] <= sum(step[3] for step in r["steps"]), (counts, r["steps"])
    returned = r["drafted_per_pos"] + [0] * K
    assert all(pos[j] <= returned[j] for j in range(K)), (pos, returned)
    assert counts["num_draft_tokens"] <= sum(returned), (counts, returned)
