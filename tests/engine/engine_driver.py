"""Run the real vLLM 0.13.0 engine (CPU build, patched tree) for one or more configurations, in this
process, one after another; print one JSON line with the results.

    python tests/engine/engine_driver.py SPEC.json

SPEC: {"workspace": DIR, "model": DIR, "prompts": [[token ids], ...], "runs": [RUN, ...]}
RUN:  {"name": str, "llm": {LLM kwargs}, "sampling": {SamplingParams kwargs},
       "prompts": optional override, "phases": optional [[prompt indices], ...] (one generate call per
       phase), "max_tokens": optional [per prompt] (requests that finish early shrink the batch),
       "gc_policy": optional bool (qwen3_rl.rollout.gc_control's per-step gc switch, the gc_guard hook),
       "teacher_force": optional [run names]: the prompts are those runs' prompts + outputs (in order), one
       token generated with prompt_logprobs=0: the result's "prompt_logprobs" are the engine's log-probs of
       those outputs recomputed in prefill (what a trainer's old-log-prob pass does)}
SPEC "ascend": true runs vLLM-Ascend's own engine (NPUWorker -> NPUModelRunner) on the CPU stand-in
(qwen3_rl.cpu_device.npu) instead of vLLM's CPU runner: Ascend's custom ops on (no "custom_ops": ["none"]),
a fixed KV-cache size; each result then also has "npu_calls" (the stand-in kernels called so far).
Each result: {"name", "outputs": [[token ids] per prompt (per phase, flattened in order)],
"metrics": vLLM's own counters from LLM.get_metrics(), "drafter": the runner's drafter state,
"gc_enabled_in_step": [gc.isenabled() seen inside each LLMEngine.step (its body, within the hooks' contexts)
called by LLM._run_engine], with sampling "logprobs" set: "logprobs": [[the sampled token's returned log-prob
per position] per prompt]; with teacher_force: "prompt_logprobs": [[log-prob of each output token] per prompt]}.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workspace  # noqa: E402

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def counters(llm) -> dict[str, float]:
    """vLLM's own spec-decode counters (Prometheus-style metrics of the v1 engine)."""
    out = {}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name.split(":", 1)[1]] = float(getattr(m, "value", 0) or 0)
    return out


def runner_of(llm):
    """The engine's model runner (in-process engine, uniproc executor)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def drafter_state(llm) -> dict:
    runner = runner_of(llm)
    d = getattr(runner, "drafter", None)
    if d is None:
        return {}
    st = {"class": type(d).__name__}
    hook = getattr(llm.llm_engine, "qwen3_rl_sibling_exchange", None)  # the vllm seam (0003)
    sam = getattr(d, "sam", None)
    if hook is not None and getattr(sam, "exchange", None) is not None:
        st["exchange"] = {"enabled": hook.enabled, "hook_steps": hook.steps, "exchanges": hook.exchanges,
                          "rank": sam.exchange.rank, "world": hook._comm.world if hook._comm else None,
                          "bytes_sent": sam.exchange.stats.bytes_sent,
                          "tokens_sent": sam.exchange.stats.tokens_sent,
                          "tokens_merged": sam.exchange.stats.tokens_merged}
    if sam is not None and getattr(sam.drafter, "history", None) is not None:
        h = sam.drafter.history
        st["history"] = {"strings": sam.drafter.history_strings, "responses": h.num_responses(),
                         "bytes": h.nbytes(), "bound": h.max_bytes}
    if sam is not None and getattr(sam, "adaptive", None) is not None:
        st["adaptive"] = {"step_hist": [int(x) for x in sam.adaptive.step_hist],
                          "k_hist": [int(x) for x in sam.adaptive.k_hist],
                          "table": sam.adaptive.table.source if sam.adaptive.table is not None else None}
    gate = getattr(d, "gate", None) or getattr(runner, "spec_decode_gate", None)  # vLLM-CPU / NPUModelRunner
    if gate is not None:
        st["gate"] = {"threshold": gate.threshold, "steps_on": gate.steps_on, "steps_off": gate.steps_off,
                      "switches": gate.switches}
    return st


class _Calls(list):
    def pop(self) -> int:  # calls since the last pop
        n = len(self)
        self.clear()
        return n


def _count_calls(cls, name: str) -> _Calls:
    """Count calls of ``cls.name`` (a test probe: the method itself runs unchanged)."""
    calls, orig = _Calls(), getattr(cls, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    setattr(cls, name, counted)
    return calls


def hccl_groups() -> dict:
    """vLLM's device groups -> the ``hccl_config`` their "hccl" process group was created with (stand-in record)."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    from qwen3_rl.cpu_device.npu import hccl

    out = {}
    for name in ("_TP", "_DP", "_EP", "_PP"):
        g = getattr(ps, name, None)
        if g is not None:
            out[name[1:].lower()] = hccl.GROUP_OPTIONS.get(dist._get_process_group_name(g.device_group), "absent")
    return out


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    ascend = bool(spec.get("ascend"))
    if ascend:
        os.environ["VLLM_PLUGINS"] = "ascend,qwen3_rl"
    workspace.activate(Path(spec["workspace"]))
    if ascend:
        from qwen3_rl.cpu_device.npu import run as ascend_run
        from qwen3_rl.cpu_device.npu import stand_in

        ascend_run.prepare([str(Path(spec["workspace"]) / "vllm-ascend")])
        import qwen3_rl.spec_decode.runner_drafter as runner_drafter

        sam_builds = _count_calls(runner_drafter.SamRunnerDrafter, "__init__")
    else:
        import shims

        shims.install_ascend_pytorch_rejection_sampler(Path(spec["workspace"]) / "vllm-ascend")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from qwen3_rl.rollout import gc_control

    results = []
    done: dict[str, dict] = {}
    for run in spec["runs"]:
        prompts = run.get("prompts", spec["prompts"])
        forced = [done[n] for n in run.get("teacher_force", [])]
        if forced:  # prompt + the earlier run's output; only the output part's log-probs are kept
            prompts = [p + o for r in forced for p, o in zip(r["prompts"], r["outputs"], strict=True)]
            cut = [len(p) for r in forced for p in r["prompts"]]
            run = {**run, "sampling": {**run.get("sampling", {}), "max_tokens": 1, "prompt_logprobs": 0}}
        kwargs = dict(model=spec["model"], dtype="float32", enforce_eager=True, seed=0,
                      compilation_config={"custom_ops": ["none"]}, max_model_len=512,
                      gpu_memory_utilization=0.5, disable_log_stats=False,
                      # 256 blocks (32768 tokens at 128 a block on CPU; a run here needs under 1000): the CPU runner's
                      # default, VLLM_CPU_KVCACHE_SPACE's 1 GiB minimum, stays resident after the in-process LLM is
                      # deleted, so 12 runs in one process grew it to 13.7 GB beside a launcher run on 24 GiB
                      num_gpu_blocks_override=256)
        if ascend:
            del kwargs["compilation_config"]
        kwargs.update(run.get("llm", {}))
        llm = LLM(**kwargs)
        base = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True, **run.get("sampling", {})}
        lens = run.get("max_tokens")
        sps = [SamplingParams(**{**base, **({"max_tokens": lens[i]} if lens else {})}) for i in range(len(prompts))]
        gc_control.set_decode_gc_disabled(bool(run.get("gc_policy", False)))
        seen_gc: list[bool] = []
        # the step body the seam's LLMEngine.step runs inside every hook's step_context (gc_guard among them)
        engine_step = llm.llm_engine._step

        def step(engine_step=engine_step, seen_gc=seen_gc):
            seen_gc.append(gc.isenabled())
            return engine_step()

        llm.llm_engine._step = step
        phases = run.get("phases") or [list(range(len(prompts)))]
        outs, lps, plps = [], [], []
        for idx in phases:
            res = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in idx], [sps[i] for i in idx],
                               use_tqdm=False)
            outs += [list(o.outputs[0].token_ids) for o in res]
            if base.get("logprobs") is not None:
                lps += [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                        for o in res]
            if forced:
                plps += [[d[t].logprob for t, d in zip(o.prompt_token_ids[cut[i]:], o.prompt_logprobs[cut[i]:],
                                                        strict=True)] for i, o in zip(idx, res, strict=True)]
        gc_control.set_decode_gc_disabled(False)
        done[run["name"]] = {"prompts": [prompts[i] for idx in phases for i in idx], "outputs": outs}
        results.append({"name": run["name"], "outputs": outs, "metrics": counters(llm),
                        **({"logprobs": lps} if lps else {}), **({"prompt_logprobs": plps} if forced else {}),
                        "drafter": drafter_state(llm), "gc_enabled_in_step": seen_gc,
                        "gc_enabled_after": gc.isenabled(),
                        **({"npu_calls": dict(stand_in.CALLS), "sam_builds": sam_builds.pop(),
                            "hccl_groups": hccl_groups()} if ascend else {})})
        del llm
        gc.collect()
    print("ENGINE_RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
