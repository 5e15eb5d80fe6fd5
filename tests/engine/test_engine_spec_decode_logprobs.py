"""vllm 0004 (bug fix): SAM drafts for requests that ask for log-probs, and the log-probs stay right.

vLLM 0.13.0 marks every request with ``logprobs`` unsupported for drafting; the patch lifts that and keeps the
rejection sampler's raw target logits apart from the ones its temperature / top-p steps scale in place. Real
engine (``LLM`` on the patched tree, float32, dense tiny Qwen3), requests with ``logprobs=0``:

- greedy: SAM drafts, its tokens and returned log-probs equal decoding without drafts;
- seeded sampling (temperature 0.2, top-p 0.9): the tokens differ from decoding without drafts (the rejection
  sampler draws its own random numbers), so each returned log-prob is compared with the same engine's
  recomputation of that token in prefill (``prompt_logprobs`` of prompt + output, as the trainer's old-log-prob
  pass does); the run without drafts against its own recomputation gives the numerical floor;
- positive control: the same tree with only 0004 reversed drafts nothing for these requests (and does draft
  without ``logprobs``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import run_engine, tree_without
from test_engine_spec_decode import drafted, sam

PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
TOKENS = 32
GREEDY = {"max_tokens": TOKENS, "logprobs": 0}
#: the tiny random model is nearly flat (greedy tokens at log-prob ~ -5.5 of 512): a low temperature lets drafts be
#: accepted
SEEDED = {"max_tokens": TOKENS, "logprobs": 0, "temperature": 0.2, "top_p": 0.9, "seed": 11}
#: float32 on CPU: the same logits through a decode step vs. a drafted (multi-token) step or a prefill differ
#: by a few float32 roundings of the log-softmax
ATOL = 1e-4


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return float(max(np.max(np.abs(np.asarray(x) - np.asarray(y))) for x, y in zip(a, b, strict=True)))


@pytest.fixture(scope="module")
def lp_runs(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory) -> dict[str, dict]:
    runs = [{"name": "base_greedy", "sampling": GREEDY}, {"name": "sam_greedy", "llm": sam(), "sampling": GREEDY},
            {"name": "base_seeded", "sampling": SEEDED}, {"name": "sam_seeded", "llm": sam(), "sampling": SEEDED},
            {"name": "recompute", "teacher_force": ["base_seeded", "sam_seeded"]}]
    return run_engine({"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": PROMPTS,
                       "runs": runs}, tmp_path_factory.mktemp("lp"))


def test_greedy_drafts_and_equals_decoding_without_drafts(lp_runs: dict[str, dict]) -> None:
    r, base = lp_runs["sam_greedy"], lp_runs["base_greedy"]
    diff = max_diff(r["logprobs"], base["logprobs"])
    print(f"greedy, logprobs=0: SAM {drafted(r)} (drafted, accepted); max |logprob - no drafts| {diff:.2e}")
    assert drafted(r)[1] > 0 and drafted(base) == (0, 0)
    assert r["outputs"] == base["outputs"] and all(len(o) == TOKENS for o in r["outputs"])
    assert diff <= ATOL


def test_seeded_sampling_logprobs_equal_their_recomputation(lp_runs: dict[str, dict]) -> None:
    r, base, rec = lp_runs["sam_seeded"], lp_runs["base_seeded"], lp_runs["recompute"]["prompt_logprobs"]
    n = len(PROMPTS)
    floor, diff = max_diff(base["logprobs"], rec[:n]), max_diff(r["logprobs"], rec[n:])
    print(f"seeded T=0.2 top-p 0.9, logprobs=0: SAM {drafted(r)} (drafted, accepted); max |logprob - recomputed| "
          f"SAM {diff:.2e}, without drafts {floor:.2e}")
    assert drafted(r)[1] > 0
    assert diff <= ATOL and floor <= ATOL


def test_without_the_patch_nothing_is_drafted(engine_ws: Path, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    old = tree_without(engine_ws, tmp_path / "ws-without-0004", "vllm", 4, only=True)
    short = {"max_tokens": 16}
    runs = [{"name": "lp", "llm": sam(), "sampling": {**short, "logprobs": 0}},
            {"name": "no_lp", "llm": sam(), "sampling": short}]
    r = run_engine({"workspace": str(old), "model": str(tiny_models["dense"]), "prompts": PROMPTS, "runs": runs},
                   tmp_path)
    print(f"without 0004: logprobs=0 {drafted(r['lp'])}, logprobs=None {drafted(r['no_lp'])} (drafted, accepted)")
    assert drafted(r["lp"]) == (0, 0)
    assert drafted(r["no_lp"])[0] > 0
    assert r["lp"]["outputs"] == r["no_lp"]["outputs"]


@pytest.mark.ascend
def test_on_vllm_ascends_runner(engine_ws: Path, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    # vLLM-Ascend 0.13.0's own NPUModelRunner (NPUInputBatch inherits vLLM's add_request; vLLM's RejectionSampler
    # with vLLM-Ascend's in-place apply_sampling_constraints) on the CPU stand-in for torch_npu: the same claims
    runs = [{"name": "base_greedy", "sampling": GREEDY}, {"name": "sam_greedy", "llm": sam(), "sampling": GREEDY},
            {"name": "sam_seeded", "llm": sam(), "sampling": SEEDED},
            {"name": "recompute", "teacher_force": ["sam_seeded"]}]
    r = run_engine({"workspace": str(engine_ws), "model": str(tiny_models["dense"]), "prompts": PROMPTS,
                    "ascend": True, "runs": runs}, tmp_path)
    greedy = max_diff(r["sam_greedy"]["logprobs"], r["base_greedy"]["logprobs"])
    seeded = max_diff(r["sam_seeded"]["logprobs"], r["recompute"]["prompt_logprobs"])
    print(f"vLLM-Ascend: greedy SAM {drafted(r['sam_greedy'])}, max |logprob - no drafts| {greedy:.2e}; seeded SAM "
          f"{drafted(r['sam_seeded'])}, max |logprob - recomputed| {seeded:.2e} (drafted, accepted)")
    assert r["sam_greedy"]["drafter"]["class"] == "SamAscendProposer"
    assert drafted(r["sam_greedy"])[1] > 0 and drafted(r["sam_seeded"])[1] > 0
    assert r["sam_greedy"]["outputs"] == r["base_greedy"]["outputs"]
    assert greedy <= ATOL and seeded <= ATOL
