"""verl's sync SPMD rollout (patched ``vLLMRollout``) on vLLM-Ascend 0.13.0's own engine over the CPU stand-in for
torch_npu, configured from the 235B GRPO train script with SAM on (``SAM_ENABLE=True SAM_GROUP=True``): the path a
cluster rollout takes, ``vLLMRollout`` -> ``LLM`` -> ``NPUWorker`` -> ``NPUModelRunner`` -> ``SamAscendProposer``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_engine
from test_engine_verl_rollout import PROMPTS, rollout_spec

pytestmark = pytest.mark.ascend


def test_sam_rollout_through_verl_on_vllm_ascend(engine_ws: Path, tiny_models: dict[str, Path],
                                                 tmp_path: Path) -> None:
    spec = rollout_spec(engine_ws, tiny_models["moe"], do_sample=(False,))
    # vLLM-Ascend's own custom ops (no "custom_ops: [none]"), a small fixed KV cache
    spec["overrides"] = [o for o in spec["overrides"] if "custom_ops" not in o] + [
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.num_gpu_blocks_override=256"]
    spec["ascend"] = True
    r = run_engine(spec, tmp_path, driver="rollout_driver.py")
    assert r["drafter"] == "SamAscendProposer"
    assert r["logprobs"] is None  # verl 0007
    g = r["generations"][0]
    assert len(g["responses"]) == 2 * len(PROMPTS) and all(len(x) == 48 for x in g["responses"])
    m = g["metrics"]
    print(f"greedy through verl on vLLM-Ascend: {m}")
    assert m["spec_decode_num_draft_tokens"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    # the verl seam's rollout hook: the counts in verl's per-worker metrics channel
    assert g["meta_info"]["metrics"]["spec_decode_counts/num_accepted_tokens"] == m["spec_decode_num_accepted_tokens"]
    # greedy siblings (n=2) decode the same tokens
    assert all(g["responses"][2 * i] == g["responses"][2 * i + 1] for i in range(len(PROMPTS)))
