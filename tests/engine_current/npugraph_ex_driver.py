"""Build vLLM 0.23's ``VllmConfig`` through vLLM-Ascend 0.23.0.post1's own platform (``NPUPlatform``) over the recipe's
CPU stand-in for torch_npu, once per case, and print what vLLM-Ascend made of the graph keys (one JSON line).

    python tests/engine_current/npugraph_ex_driver.py SPEC.json

SPEC: {"tree": the vLLM-Ascend 0.23 source tree, "model": DIR,
       "cases": [{"name": str, "engine": {EngineArgs kwargs}, "env": optional {variable: value} for this case}, ...]}

``EngineArgs(**engine).create_engine_config()`` is vLLM's own path to a ``VllmConfig``; it calls
``current_platform.check_and_update_config`` (vLLM-Ascend's ``platform.py:450``), which builds ``AscendConfig`` from
``additional_config`` (``ascend_config.py:27``) and picks the compilation / graph mode. Nothing is compiled or
captured: graph capture needs the NPU runtime. Each result: {"name", "error": None or "<type>: <message>",
"cudagraph_mode", "mode": vLLM's compilation mode, "enable_npugraph_ex" / "enable_static_kernel": the
``AscendCompilationConfig`` in effect (``get_ascend_config()``), "additional": ``additional_config
["ascend_compilation_config"]`` as the workers receive it, "splitting_ops", "capture_sizes", "oot_compiler",
"worker_cls", "spec_k": the drafter's k (0 without one), "attn_cg_support": vLLM-Ascend's attention metadata builder's
graph support, "resolved": the mode and sizes after vLLM's ``resolve_cudagraph_mode_and_sizes`` with that support and
the runner's ``uniform_decode_query_len`` = 1 + k (the call the model runner makes at KV-cache set-up, on a copy),
"sam_pad_drafts": ``pad_drafts`` of the SamConfig the recipe's NPU drafter seat builds from this config
(``custom_class_proposer.config_from_vllm_config``; None without ``additional_config.qwen3_rl.sam_config``)}.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

RESULT_TAG = "NPUGRAPH_EX_RESULT"


def probe(case: dict[str, Any], model: str) -> dict[str, Any]:
    """One case: its ``VllmConfig`` as vLLM-Ascend leaves it (see the module docstring for the keys)."""
    import vllm_ascend.ops  # noqa: F401 - first, as the worker does: attention_v1 alone hits an import cycle
    from vllm.engine.arg_utils import EngineArgs
    from vllm_ascend.ascend_config import get_ascend_config
    from vllm_ascend.attention.attention_v1 import AscendAttentionMetadataBuilder

    from qwen3_rl.spec_decode.custom_class_proposer import config_from_vllm_config, sam_requested

    env = case.get("env") or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        kwargs = {"model": model, "dtype": "float32", "max_model_len": 512, "seed": 0, **case["engine"]}
        try:
            cfg = EngineArgs(**kwargs).create_engine_config()
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            return {"name": case["name"], "error": f"{type(exc).__name__}: {exc}"}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    cc = cfg.compilation_config
    acc = get_ascend_config().ascend_compilation_config
    k = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 0
    support = AscendAttentionMetadataBuilder.get_cudagraph_support(cfg, None)
    resolved = copy.deepcopy(cc)
    mode = resolved.resolve_cudagraph_mode_and_sizes(
        support, "AscendAttentionBackend", 1 + k, cfg.parallel_config.tensor_parallel_size
    )
    return {
        "name": case["name"],
        "error": None,
        "cudagraph_mode": cc.cudagraph_mode.name,
        "mode": cc.mode.name,
        "enable_npugraph_ex": acc.enable_npugraph_ex,
        "enable_static_kernel": acc.enable_static_kernel,
        "additional": cfg.additional_config.get("ascend_compilation_config"),
        "splitting_ops": cc.splitting_ops,
        "capture_sizes": cc.cudagraph_capture_sizes,
        "oot_compiler": cc.oot_compiler,
        "worker_cls": cfg.parallel_config.worker_cls,
        "spec_k": k,
        "attn_cg_support": support.name,
        "resolved": {"cudagraph_mode": mode.name, "capture_sizes": resolved.cudagraph_capture_sizes},
        "sam_pad_drafts": config_from_vllm_config(cfg).pad_drafts if sam_requested(cfg) else None,
    }


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    # vLLM-Ascend's platform plugin and ours (as ascend_driver.py)
    os.environ["VLLM_PLUGINS"] = "ascend,qwen3_rl"
    os.environ.pop("VLLM_TARGET_DEVICE", None)
    from qwen3_rl.cpu_device.npu import run as ascend_run

    ascend_run.prepare([spec["tree"]])
    from qwen3_rl.cpu_device import vllm023_shims

    vllm023_shims.install_ascend()
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "NPUPlatform", type(current_platform)
    results = [probe(case, spec["model"]) for case in spec["cases"]]
    print(f"{RESULT_TAG} {json.dumps(results, default=str)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
