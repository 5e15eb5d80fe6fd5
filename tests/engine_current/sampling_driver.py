"""vLLM 0.23.0's CPU engine under sampling, with and without a drafter, in this process; prints one JSON line.

    python tests/engine_current/sampling_driver.py SPEC.json

SPEC: {"model": DIR, "prompts": [[token ids], ...], "sampling": {SamplingParams kwargs, ``n`` included},
       "runs": [{"name": str, "llm": {LLM kwargs}, "expand_shim": bool}, ...]}
``expand_shim`` false: ``vllm023_shims.install(expand=False)`` (vLLM-CPU's ``expand_kernel`` as shipped, the
positive control of ``CPU_EXPAND_KERNEL_DTYPE``); such runs must come before the first run with it true (a shim once
installed stays in this process; the CPU runner takes the kernels from ``cpu_triton_utils`` when it is built).
Each result: {"name", "outputs": [[token ids] per sample, prompts in order, ``n`` each], "metrics": vLLM's own
spec-decode counters, "drafter": the runner's drafter class}.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from engine_driver import counters, drafter_state


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from qwen3_rl.cpu_device import vllm023_shims

    vllm023_shims.install(expand=False)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = []
    expanded = False
    for run in spec["runs"]:
        if run["expand_shim"]:
            vllm023_shims.install()
            expanded = True
        elif expanded:
            raise ValueError("a run without the expand shim after one with it")
        kwargs = dict(
            model=spec["model"],
            dtype="float32",
            enforce_eager=True,
            seed=0,
            compilation_config={"custom_ops": ["none"]},
            max_model_len=512,
            gpu_memory_utilization=0.2,
            disable_log_stats=False,
            num_gpu_blocks_override=512,
        )
        kwargs.update(run.get("llm", {}))
        llm = LLM(**kwargs)
        res = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]],
            SamplingParams(**spec["sampling"]),
            use_tqdm=False,
        )
        outs = [list(c.token_ids) for o in res for c in o.outputs]
        results.append(
            {
                "name": run["name"],
                "outputs": outs,
                "metrics": counters(llm),
                "drafter": drafter_state(llm).get("class"),
            }
        )
        del llm
        gc.collect()
    print("SAMPLING_RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
