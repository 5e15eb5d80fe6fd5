"""vLLM-Ascend 0.13.0's own engine on CPU: ``LLM`` -> ``EngineCore`` -> ``NPUWorker`` -> ``NPUModelRunner`` with
the Ascend attention backend, Ascend RMSNorm / SiluAndMul / rotary embedding and the fused MoE (all-gather
dispatcher, grouped matmul), over the CPU stand-in for torch_npu (``qwen3_rl/cpu_device/npu``), with every
vllm / vllm_ascend patch applied by ``apply_all_patches.sh``.

Greedy output is compared with vLLM's own CPU engine (``CPUModelRunner``, native ops) and with HF transformers'
``generate``; SAM runs through the patched ``NPUModelRunner`` (vllm_ascend 0002 / 0003); the HCCL op-expansion
setting (vllm_ascend 0001) is read back from the process group the stand-in's ``"hccl"`` backend created.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_engine
from test_engine_spec_decode import drafted, sam

pytestmark = pytest.mark.ascend

K = 3
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
GROUP = [p for p in PROMPTS for _ in range(2)]
WAVES = [[0, 2, 4, 6], [1, 3, 5, 7]]
ALONE = [[0], [1], [2], [3]]
TOKENS = 48
GATED_LENS = [16, 16, TOKENS, TOKENS]
#: vLLM-Ascend reads this group's options for the TP communicator (vllm_ascend 0001): mode "aiv" = 3.
HCCL = {"qwen3_rl": {"hccl_op_expansion_mode": {"tp": "aiv"}}}
#: The kernels vLLM-Ascend's eager path must have called on the stand-in (dense; MoE adds the routing ones).
DENSE_KERNELS = {"torch_npu.npu_rms_norm", "torch_npu.npu_add_rms_norm", "torch_npu.npu_swiglu",
                 "torch_npu._npu_rotary_embedding", "torch_npu._npu_reshape_and_cache",
                 "torch_npu.npu_fused_infer_attention_score", "torch_npu._npu_matmul_add_fp32"}
#: seeded sampling runs (temperature 1): two with the same seed, one with another
SEEDED = {"a": 7, "b": 7, "c": 8}
SEEDED_TOKENS = 16
MOE_KERNELS = {"_C_ascend.moe_gating_top_k", "_C_ascend.npu_moe_init_routing_custom",
               "torch_npu.npu_grouped_matmul", "torch_npu.npu_moe_token_unpermute"}


def hf_greedy(model: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF transformers' greedy ``generate``, one prompt at a time, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = []
    for p in prompts:
        ids = m.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def ascend_runs(request, engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory) -> dict:
    """One vLLM-Ascend engine process per model (runs one after another in it), one vLLM-CPU engine process for
    the reference, and HF transformers."""
    model = tiny_models[request.param]
    base = {"sampling": {"max_tokens": TOKENS}}
    ngram = {"speculative_config": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                                    "prompt_lookup_min": 1}}
    gated = {"speculative_config": {"method": "sam", "num_speculative_tokens": K, "disable_by_batch_size": 2}}
    runs = [
        # first run of the process: vLLM's groups are created here, with the TP op-expansion setting
        {"name": "base", "llm": {"additional_config": HCCL}, **base},
        {"name": "alone", "phases": ALONE, **base},
        # 4 running requests > threshold 2: drafting off; on again once the two short ones finish
        {"name": "gated", "max_tokens": GATED_LENS, "llm": gated},
    ]
    # the rest split over the two models (one engine per run; CI time): per request, pad_drafts and n-gram on the
    # dense model, group mode against per request on the same two waves on the MoE model
    runs += [{"name": "sam", "llm": sam(), **base}, {"name": "sam_pad", "llm": sam(pad_drafts=True), **base},
             {"name": "ngram", "llm": ngram, **base}] if request.param == "dense" else [
        {"name": "base_group", "prompts": GROUP, "phases": WAVES, **base},
        {"name": "sam_own_waves", "llm": sam(), "prompts": GROUP, "phases": WAVES, **base},
        {"name": "sam_group", "llm": sam(group_mode=True), "prompts": GROUP, "phases": WAVES, **base}]
    # per-request seeds: vLLM builds torch.Generator(device="npu") per seeded request
    runs += [{"name": f"seeded_{tag}", "sampling": {"max_tokens": SEEDED_TOKENS, "temperature": 1.0, "seed": seed}}
             for tag, seed in SEEDED.items()]
    spec = {"workspace": str(engine_ws), "model": str(model), "prompts": PROMPTS, "ascend": True, "runs": runs}
    tmp = tmp_path_factory.mktemp(f"ascend-{request.param}")
    runs = run_engine(spec, tmp)
    cpu_runs = [{"name": "base", **base},
                {"name": "seeded", "sampling": {"max_tokens": SEEDED_TOKENS, "temperature": 1.0, "seed": SEEDED["a"]}}]
    cpu = run_engine({"workspace": str(engine_ws), "model": str(model), "prompts": PROMPTS, "runs": cpu_runs}, tmp)
    return {"model": request.param, "runs": runs, "vllm_cpu": cpu["base"]["outputs"],
            "vllm_cpu_seeded": cpu["seeded"]["outputs"],
            "hf": hf_greedy(model, PROMPTS, TOKENS)}


def test_runs_on_vllm_ascends_runner_and_kernels(ascend_runs: dict) -> None:
    r = ascend_runs["runs"]["base"]
    called = {k for k, v in r["npu_calls"].items() if v > 0}
    want = DENSE_KERNELS | (MOE_KERNELS if ascend_runs["model"] == "moe" else set())
    print(f"{ascend_runs['model']}: stand-in kernel calls {r['npu_calls']}")
    assert want <= called, f"not called: {want - called}"


def test_greedy_output_equals_vllm_cpu_engine_and_transformers(ascend_runs: dict) -> None:
    runs = ascend_runs["runs"]
    out = runs["base"]["outputs"]
    assert len(out) == len(PROMPTS) and all(len(o) == TOKENS for o in out)
    assert out == ascend_runs["vllm_cpu"], "vLLM-Ascend (stand-in) differs from vLLM's CPU engine"
    assert out == ascend_runs["hf"], "vLLM-Ascend (stand-in) differs from HF transformers"
    assert runs["alone"]["outputs"] == out, "batched differs from one request at a time"
    if "base_group" in runs:  # two waves of the 4 prompts (outputs in wave order): each sibling's is its prompt's
        assert runs["base_group"]["outputs"] == out + out


def test_sam_drafter_built_once_per_engine(ascend_runs: dict) -> None:
    # vllm 0003 builds SAM in GPUModelRunner.__init__; the vllm_ascend seam (0002) hands that drafter to the Ascend adapter
    runs = ascend_runs["runs"]
    for name in [n for n in ("sam", "sam_pad", "sam_group", "sam_own_waves", "gated") if n in runs]:
        assert runs[name]["drafter"]["class"] == "SamAscendProposer"
        assert runs[name]["sam_builds"] == 1, f"{name}: SAM drafter built {runs[name]['sam_builds']} times"
    assert runs["base"]["sam_builds"] == 0 and runs.get("ngram", runs["base"])["sam_builds"] == 0


def _reference(runs: dict, name: str) -> list[list[int]]:
    """The same prompts decoded without drafts: the base run (group waves: base_group; shorter requests: the
    base output's prefix, greedy)."""
    if name in ("sam_group", "sam_own_waves"):
        return runs["base_group"]["outputs"]
    if name == "gated":
        return [o[:n] for o, n in zip(runs["base"]["outputs"], GATED_LENS, strict=True)]
    return runs["base"]["outputs"]


SPEC_RUNS = {"dense": ("sam", "sam_pad", "ngram", "gated"), "moe": ("sam_own_waves", "sam_group", "gated")}


def test_spec_decode_is_lossless_and_accepted(ascend_runs: dict) -> None:
    runs = ascend_runs["runs"]
    assert drafted(runs["base"]) == (0, 0)
    for name in SPEC_RUNS[ascend_runs["model"]]:
        proposed, accepted = drafted(runs[name])
        print(f"{ascend_runs['model']} {name}: {proposed} draft tokens, {accepted} accepted")
        assert runs[name]["outputs"] == _reference(runs, name), f"{name}: output differs from decoding without drafts"
        assert proposed > 0 and accepted > 0, f"{name}: {proposed} drafted, {accepted} accepted"


def test_pad_drafts_and_group_mode(ascend_runs: dict) -> None:
    runs = ascend_runs["runs"]
    if ascend_runs["model"] == "dense":
        m = runs["sam_pad"]["metrics"]
        assert m["spec_decode_num_draft_tokens"] == K * m["spec_decode_num_drafts"] > 0
        m = runs["sam"]["metrics"]
        assert m["spec_decode_num_draft_tokens"] < K * m["spec_decode_num_drafts"]
    else:
        group, own = drafted(runs["sam_group"]), drafted(runs["sam_own_waves"])
        print(f"moe: two waves of 4: group mode {group}, per request {own}")
        assert group[1] > own[1]


def test_batch_size_threshold_switches_in_npu_model_runner(ascend_runs: dict) -> None:
    # vllm_ascend 0002: NPUModelRunner.spec_decode_gate; 4 running requests > 2: off; 2 left: on again
    gate = ascend_runs["runs"]["gated"]["drafter"]["gate"]
    print(f"{ascend_runs['model']} gate: {gate}")
    assert gate["threshold"] == 2 and gate["steps_off"] >= 15 and gate["steps_on"] > 0 and gate["switches"] == 2


def test_hccl_op_expansion_reaches_the_tp_process_group(ascend_runs: dict) -> None:
    # vllm_ascend 0001: the TP group's ProcessGroupHCCL.Options carry the mode (aiv = 3); other groups do not
    groups = ascend_runs["runs"]["base"]["hccl_groups"]
    print(f"{ascend_runs['model']}: hccl_config per vLLM group: {groups}")
    assert groups["tp"]["hccl_op_expansion_mode"] == 3
    assert "hccl_buffer_size" in groups["tp"]
    assert all(cfg is None or "hccl_op_expansion_mode" not in cfg for name, cfg in groups.items() if name != "tp")


def test_per_request_seeds_are_reproducible_and_equal_the_vllm_cpu_engine(ascend_runs: dict) -> None:
    """``SamplingParams(seed=...)``: vLLM makes ``torch.Generator(device="npu")`` per request
    (``gpu_model_runner.py:818``; the stand-in's host generator) and vLLM-Ascend's sampler draws each request's
    exponential noise from it, as vLLM's CPU sampler does (``topk_topp_sampler.py:159-168``): same seed, same
    tokens, also across the two engines; another seed, other tokens."""
    runs = ascend_runs["runs"]
    a, b, c = (runs[f"seeded_{t}"]["outputs"] for t in "abc")
    print(f"{ascend_runs['model']}: seed 7: {a[0]}; seed 8: {c[0]}; vLLM CPU seed 7: {ascend_runs['vllm_cpu_seeded'][0]}")
    assert all(len(o) == SEEDED_TOKENS for o in a)
    assert a == b, "same seed, different tokens"
    assert a != c, "different seeds, same tokens"
    assert a != [o[:SEEDED_TOKENS] for o in runs["base"]["outputs"]], "sampled tokens equal the greedy ones"
    assert a == ascend_runs["vllm_cpu_seeded"], "vLLM-Ascend's seeded sampling differs from vLLM's CPU engine"
