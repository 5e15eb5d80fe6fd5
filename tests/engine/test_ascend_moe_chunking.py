"""Chunked MoE prefill (the vLLM-Ascend seam's MoE forward hook, qwen3_rl.moe.chunking) in vLLM-Ascend's own engine, on the A3 expert-parallel path.

The hook chunks only steps whose MoE communication type is ALLTOALL, which ``select_moe_comm_method``
(``vllm_ascend/ascend_forward_context.py:242-276``) picks only on an A3 with EP > 1 and more tokens than the MC2
capacity (decode steps take MC2). So: the vLLM-Ascend tree built for an A3 (the same sources, its generated
``vllm_ascend/_build_info.py`` saying ``A3``, as vLLM-Ascend's ``setup.py`` writes it for an A3 ``SOC_VERSION``;
the stand-in's ``get_soc_version`` follows the build), the tiny Qwen3-MoE with DP 2 + EP 2 over 2 processes
(``external_launcher``, as verl runs it), ``max_num_seqs=2`` (MC2 capacity 2 tokens: each rank's prefill step
exceeds it). Prefill runs the all-to-all dispatcher (``npu_moe_token_permute``, gloo ``all_to_all_single``,
``npu_moe_token_unpermute``), decode the MC2 kernels (``npu_moe_distribute_dispatch_v2`` / ``combine_v2``).
Greedy output with ``moe_prefill_chunk_size=3`` equals the run without it and HF transformers; the probe counts
the routed-path bodies per ALLTOALL forward (the positive control: more bodies than forwards, each <= 3 rows).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_ascend_dp import run_dp

from test_ascend_engine import PROMPTS, hf_greedy

pytestmark = pytest.mark.ascend
TOKENS = 24
CHUNK = 3
#: what vLLM-Ascend's setup.py generates for an A3 SOC_VERSION (ascend910_93xx)
A3_BUILD_INFO = "# Auto-generated file\n__device_type__ = 'A3'\n"


def a3_tree(engine_ws: Path, dst: Path) -> Path:
    """A copy of the workspace's patched vLLM-Ascend tree whose build info is an A3 build's."""
    tree = dst / "vllm-ascend-a3"
    shutil.copytree(engine_ws / "vllm-ascend", tree, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    (tree / "vllm_ascend" / "_build_info.py").write_text(A3_BUILD_INFO)
    return tree


@pytest.fixture(scope="module")
def a3_runs(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ascend-a3")
    tree = a3_tree(engine_ws, tmp)
    llm = {"max_num_seqs": 2, "max_num_batched_tokens": 32}
    runs = {}
    for name, extra in (("plain", {}), ("chunked", {"additional_config": {"moe_prefill_chunk_size": CHUNK}})):
        d = tmp / name
        d.mkdir()
        runs[name] = run_dp(engine_ws, tiny_models["moe"], d, True, ascend_tree=str(tree), moe_probe=True,
                            max_tokens=TOKENS, llm={**llm, **extra})
    return {"runs": runs, "hf": hf_greedy(tiny_models["moe"], PROMPTS, TOKENS)}


def test_a3_expert_parallel_paths_run_and_equal_transformers(a3_runs: dict) -> None:
    for name, (r0, r1) in a3_runs["runs"].items():
        print(f"A3 EP2 {name}: soc {r0['soc']}, MoE comm types {({k: v['calls'] for k, v in r0['moe'].items()})}, "
              f"kernels {r0['npu_calls']}")
        assert r0["soc"] == r1["soc"] == 253 and r0["ep"] == r1["ep"] == 2
        for r in (r0, r1):  # prefill on all-to-all, decode on MC2, both ranks
            assert r["moe"]["ALLTOALL"]["calls"] > 0 and r["moe"]["MC2"]["calls"] > 0
            calls = r["npu_calls"]
            assert calls["torch_npu.npu_moe_token_permute"] > 0 and calls["torch_npu.npu_moe_token_unpermute"] > 0
            assert calls["torch_npu.npu_moe_distribute_dispatch_v2"] == calls[
                "torch_npu.npu_moe_distribute_combine_v2"] > 0
        assert r0["outputs"] + r1["outputs"] == a3_runs["hf"], f"{name}: differs from HF transformers"


def test_chunked_moe_prefill_runs_and_is_token_identical(a3_runs: dict) -> None:
    plain, chunked = a3_runs["runs"]["plain"], a3_runs["runs"]["chunked"]
    assert chunked[0]["outputs"] + chunked[1]["outputs"] == plain[0]["outputs"] + plain[1]["outputs"]
    for p, c in zip(plain, chunked, strict=True):
        pa, ca = p["moe"]["ALLTOALL"], c["moe"]["ALLTOALL"]
        print(f"rank {c['rank']}: ALLTOALL forwards {ca['calls']} rows {ca['rows']} -> bodies {ca['bodies']} "
              f"rows {ca['body_rows']}; unchunked bodies {pa['bodies']}")
        # without the switch one body per forward; with it every forward above CHUNK rows runs in chunks
        assert pa["bodies"] == pa["calls"] and pa["body_rows"] == pa["rows"]
        assert ca["calls"] == pa["calls"] and ca["bodies"] > ca["calls"]
        assert max(ca["body_rows"]) <= CHUNK and sum(ca["body_rows"]) == sum(ca["rows"])
        mc2 = c["moe"]["MC2"]
        assert mc2["bodies"] == mc2["calls"], "decode (MC2) steps must not be chunked"
