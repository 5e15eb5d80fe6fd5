"""Benchmark (prints figures, asserts nothing): SAM drafter warm-up in vLLM 0.13.0's real CPU engine.

    ~/.cache/qwen3_rl/engine-venv/bin/python tests/engine/bench_sam_first_step.py [--max-tokens N]

Builds the patched engine tree and the tiny dense model as the engine tests do (``workspace.build``,
``make_tiny_model``), then runs one engine per configuration, each in a fresh child process, with
``speculative_config={"method": "sam", "num_speculative_tokens": 3, "sam_config": {"group_mode": True}}``:

* ``cold, no warm-up``: empty numba cache (``NUMBA_CACHE_DIR`` = a new directory), the load-time warm-up
  replaced by a no-op in the bench process (``runner_drafter._warm_up``): the kernels compile inside the first decode step
  (the behaviour before the warm-up existed);
* ``cold, warm-up``: empty numba cache, warm-up on: the kernels compile in the engine constructor;
* ``cached, no warm-up`` / ``cached, warm-up``: the same with the numba cache the cold warm-up run filled.

Per run it prints the engine construction time (``LLM(...)``, s), the wall time of the first and second
``LLMEngine.step`` (s; step 1 = prefill of 4 prompts + the first draft), of the slowest later step (a
request's finish is the first call of some kernels) and of all steps together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]


def child(spec: dict) -> None:
    """One engine: time its construction and its first steps; print one ``BENCH`` JSON line."""
    import workspace

    workspace.activate(Path(spec["workspace"]))
    import shims

    shims.install_ascend_pytorch_rejection_sampler(Path(spec["workspace"]) / "vllm-ascend")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from qwen3_rl.spec_decode import runner_drafter

    if not spec["warm_up"]:  # the cold first step: the drafter's constructor compiles nothing
        runner_drafter._warm_up = lambda config: None
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=0,
              compilation_config={"custom_ops": ["none"]}, max_model_len=512, gpu_memory_utilization=0.5,
              speculative_config={"method": "sam", "num_speculative_tokens": 3, "sam_config": {"group_mode": True}})
    construct = time.perf_counter() - t0
    steps: list[float] = []
    engine_step = llm.llm_engine.step

    def step():
        t = time.perf_counter()
        out = engine_step()
        steps.append(time.perf_counter() - t)
        return out

    llm.llm_engine.step = step
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    print("BENCH " + json.dumps({"construct_s": construct, "steps_s": steps}))


def run(spec: dict, cache_dir: Path) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, __file__, "--child", f.name], capture_output=True, text=True, env=env,
                          timeout=1800)
    os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"engine child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt (default 16)")
    args = ap.parse_args()
    if args.child:
        child(json.loads(Path(args.child).read_text()))
        return 0

    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model
    from qwen3_rl.tools.upstream.download import pristine_dir

    import workspace

    # the engine tests' pristine upstream tree (tests/conftest.py ``pristine_workspace``)
    pristine = pristine_dir(REPO / "pins.toml")
    if not pristine.is_dir():
        raise SystemExit(f"no pristine upstream tree at {pristine}: run the engine tests once first")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ws = workspace.build(root / "ws", pristine)
        model = make_tiny_model(root / "dense", TinySpec(moe=False))
        base = {"workspace": str(ws), "model": str(model), "max_tokens": args.max_tokens}
        for name, warm, cache in (("cold, no warm-up", False, "a"), ("cold, warm-up", True, "b"),
                                  ("cached, no warm-up", False, "b"), ("cached, warm-up", True, "b")):
            r = run({**base, "warm_up": warm}, root / f"numba-cache-{cache}")
            s = r["steps_s"]
            print(f"{name:20s} construct {r['construct_s']:6.2f} s  step1 {s[0]:6.2f} s  step2 {s[1]:6.3f} s  "
                  f"slowest later step {max(s[2:]):6.3f} s  all {len(s)} steps {sum(s):6.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
