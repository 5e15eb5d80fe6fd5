"""Run vLLM-Ascend 0.23.0.post1's own engine (``NPUWorker`` -> ``NPUModelRunner``, Ascend attention, norms, rotary and
fused MoE) on vLLM 0.23.0 over the recipe's CPU stand-in for torch_npu, in this process; print one JSON line.

    python tests/engine_current/ascend_driver.py SPEC.json

SPEC: {"tree": the vLLM-Ascend 0.23 source tree (pristine or patched), "model": DIR, "prompts": [[token ids], ...],
       "env": optional {variable: value} set before anything is imported,
       "runs": [{"name": str, "model": optional DIR (default SPEC's), "llm": {LLM kwargs},
                 "sampling": {SamplingParams kwargs}, "moe_probe": optional bool (count MoE forwards, see MoeProbe),
                 "phases": optional [{"name": str, "prompts": [[token ids], ...], "waves": [[prompt indices], ...],
                                      "rpc": optional [worker method, argument],
                                      "max_tokens": optional [per prompt]}, ...]}
                or {"name": str, "calibrate": [arguments of ``python -m qwen3_rl calibrate``]}, ...]}
A calibrate run gives {"name", "rc", "stdout", "table": the JSON its --out file holds (None if none), "seconds"}.
Each result: {"name", "outputs": [[token ids] per prompt], "platform": vLLM's current platform class,
"runner": the worker's model-runner class, "attn_backends": the attention layers' implementation classes,
"npu_calls": the stand-in kernels called so far ({name: calls}), "metrics": vLLM's spec-decode counters
(``LLM.get_metrics()``), "drafter": the runner's drafter class}. A run with phases gives one result per phase, named
"<run>:<phase>", in the same engine: the worker RPC first (``LLM.collective_rpc``; its return value is "rpc"), then one
``generate`` per wave; "outputs" in the phase's prompt order, "metrics" counted over the phase alone,
"sam": our SAM drafter's group mode and k (absent for other drafters). Phases also give "steps": per drafter call
[batch rows, longest draft, draft tokens, rows with a draft] (what the drafter returned to the runner) and "drafted_per_pos" (draft
tokens returned at each position, summed), with "moe_probe": true "moe": :class:`MoeProbe`'s counts over the phase, "probe": the seed set's
``qwen3_rl.spec_decode.metrics.RolloutProbe`` counts over the phase and their ``step_metrics``, "per_pos": vLLM's
``spec_decode_num_accepted_tokens_per_pos`` over the phase, and with adaptive k "adaptive": the table's file, the
drafter's histograms and, per choice, whether it equals the choice of a copy of the policy priced by the table file
read again (``agree``) and by the linear model (``linear_same``); "seconds": the phase's wall time.

Every run: float32, eager (NPU graphs need the device runtime), vLLM-Ascend's custom ops (its default), the
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), 64 KV blocks.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

from engine_driver import counters  # this folder's vLLM-CPU driver (the script's folder is on sys.path)


def runner_of(llm):  # noqa: ANN001, ANN201
    """The in-process engine's model runner (uniproc executor)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.update(spec.get("env") or {})
    # vLLM-Ascend's platform plugin and ours, whatever the caller's environment says (the tests' conftest selects
    # "qwen3_rl" alone and the CPU target device for vLLM's own CPU engine)
    os.environ["VLLM_PLUGINS"] = "ascend,qwen3_rl"
    os.environ.pop("VLLM_TARGET_DEVICE", None)
    from qwen3_rl.cpu_device.npu import run as ascend_run
    from qwen3_rl.cpu_device.npu import stand_in

    ascend_run.prepare([spec["tree"]])
    from qwen3_rl.cpu_device import vllm023_shims

    vllm023_shims.install_ascend()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from qwen3_rl.spec_decode.metrics import RolloutProbe, step_metrics

    results = []
    for run in spec["runs"]:
        drop_rope_buffers()
        if "calibrate" in run:
            results.append(calibrate(run))
            continue
        kwargs = dict(
            model=run.get("model", spec["model"]),
            dtype="float32",
            enforce_eager=True,
            seed=0,
            max_model_len=512,
            gpu_memory_utilization=0.5,
            num_gpu_blocks_override=64,
            disable_log_stats=False,
        )
        kwargs.update(run.get("llm", {}))
        llm = LLM(**kwargs)
        moe_probe = MoeProbe(runner_of(llm).get_model()) if run.get("moe_probe") else None
        base = {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True, **run.get("sampling", {})}
        phases = run.get("phases") or [{"name": None, "prompts": spec["prompts"]}]
        for phase in phases:
            prompts = phase["prompts"]
            t0 = time.perf_counter()
            rpc = llm.collective_rpc(phase["rpc"][0], args=(phase["rpc"][1],)) if phase.get("rpc") else None
            trace = Trace(runner_of(llm))
            before, pos_before = counters(llm), per_pos(llm)
            probe = RolloutProbe({"engine_kwargs": {"vllm": kwargs}}, llm)
            lens = phase.get("max_tokens")
            outs: dict[int, list[int]] = {}
            for wave in phase.get("waves") or [list(range(len(prompts)))]:
                res = llm.generate(
                    [TokensPrompt(prompt_token_ids=prompts[i]) for i in wave],
                    [SamplingParams(**{**base, **({"max_tokens": lens[i]} if lens else {})}) for i in wave],
                    use_tqdm=False,
                )
                outs.update({i: list(o.outputs[0].token_ids) for i, o in zip(wave, res, strict=True)})
            after, pos_after = counters(llm), per_pos(llm)
            counts = probe.finish()
            name = run["name"] if phase["name"] is None else f"{run['name']}:{phase['name']}"
            out = result(
                llm,
                name,
                [outs[i] for i in sorted(outs)],
                stand_in.CALLS,
                {k: v - before.get(k, 0.0) for k, v in after.items()},
                rpc,
            )
            out.update(trace.report())
            if moe_probe is not None:
                out["moe"] = moe_probe.take()
            out["seconds"] = round(
                time.perf_counter() - t0, 2
            )  # the RPC (a drafter's build) and the generate calls
            out["probe"] = {"counts": counts, "step_metrics": step_metrics(counts)}
            out["per_pos"] = [
                a - b for a, b in zip(pos_after, pos_before + [0] * len(pos_after), strict=False)
            ]
            results.append(out)
        del llm
        gc.collect()
    print("ENGINE_RESULT " + json.dumps(results))
    return 0


class MoeProbe:
    """Counts, per call of each ``AscendFusedMoE`` layer's ``forward_impl`` (whatever callable the layer holds: the
    class's, or the instance wrapper of ``qwen3_rl.moe.chunking_ascend023``), the rows of that call and of each
    fused-experts call inside it (``quant_method.apply``: routing, dispatch, grouped matmuls, combine)."""

    def __init__(self, model) -> None:  # noqa: ANN001
        from vllm_ascend.ops.fused_moe.fused_moe import AscendFusedMoE

        self.forwards: list[list] = []  # [rows of the forward_impl call, [rows of each apply call]]
        self._open: list[list[int]] = []
        layers = [m for m in model.modules() if isinstance(m, AscendFusedMoE)]
        self.layers, self.wrapped = len(layers), sum("forward_impl" in vars(m) for m in layers)
        seen: set[int] = set()
        for m in layers:
            m.forward_impl = self._outer(m.forward_impl)
            if id(m.quant_method) not in seen:
                seen.add(id(m.quant_method))
                m.quant_method.apply = self._inner(m.quant_method.apply)

    def _outer(self, fn):  # noqa: ANN001, ANN202
        def forward_impl(hidden_states, router_logits, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            self._open.append([])
            try:
                return fn(hidden_states, router_logits, *args, **kwargs)
            finally:
                self.forwards.append([int(hidden_states.shape[0]), self._open.pop()])

        return forward_impl

    def _inner(self, fn):  # noqa: ANN001, ANN202
        def apply(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self._open:
                self._open[-1].append(int(kwargs["x"].shape[0]))
            return fn(*args, **kwargs)

        return apply

    def take(self) -> dict:
        out = {"layers": self.layers, "wrapped": self.wrapped, "forwards": self.forwards}
        self.forwards = []
        return out


def drop_rope_buffers() -> None:
    """Forget vLLM-Ascend's rotary cos / sin buffers before an engine is built. They are module globals, made once per
    process with the first engine's ``max_num_batched_tokens`` (``ops/rotary_embedding.py:62-86``): a later engine
    with a larger budget (here after ``calibrate``'s) would write past them. One engine per process, as in a
    rollout, never meets this."""
    from vllm_ascend.ops import rotary_embedding as rope

    rope._cos = rope._sin = rope._cos_mla = rope._sin_mla = None


def per_pos(llm) -> list[int]:  # noqa: ANN001
    """vLLM's accepted tokens per draft position (the ``Vector`` of ``LLM.get_metrics()``; [] without a drafter)."""
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            return [int(v) for v in m.values]
    return []


def calibrate(run: dict) -> dict:
    """``python -m qwen3_rl calibrate`` with ``run["calibrate"]`` as its arguments, in this process (the stand-in
    and vLLM-Ascend's platform already in place)."""
    import contextlib
    import io

    from qwen3_rl.tools import calibrate as cal

    args = list(run["calibrate"])
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = cal.main(args)
    seconds = round(time.perf_counter() - t0, 2)
    out = Path(args[args.index("--out") + 1])
    table = json.loads(out.read_text()) if out.is_file() else None
    gc.collect()
    return {"name": run["name"], "rc": rc, "stdout": buf.getvalue(), "table": table, "seconds": seconds}


_PRICING = frozenset({"table", "_q", "_curve", "_cnt", "_gsum"})  # AdaptiveK's fields set from its cost table


class Trace:
    """What the runner's drafter returns per call, and (adaptive k) whether each choice is the table's.

    Wraps the methods of the drafter instance the runner holds now (a ``sam_reconfigure`` RPC replaces it: a new
    trace per phase); the engine's calls go through unchanged.
    """

    def __init__(self, runner) -> None:  # noqa: ANN001
        self.steps: list[list[int]] = []
        self.drafted_per_pos: list[int] = []  # draft tokens returned at each draft position, over the phase
        self.agree = self.linear_same = self.choices = 0
        d = getattr(runner, "drafter", None)
        self.policy = getattr(getattr(d, "sam", None), "adaptive", None)
        if d is None:  # no drafter: nothing to trace
            return
        inner = d.propose

        def propose(sampled, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            out = inner(sampled, *args, **kwargs)
            longest = max((len(x) for x in out), default=0)
            self.steps.append([len(sampled), longest, sum(len(x) for x in out), sum(1 for x in out if x)])
            self.drafted_per_pos += [0] * (longest - len(self.drafted_per_pos))
            for x in out:
                for j in range(len(x)):
                    self.drafted_per_pos[j] += 1
            return out

        d.propose = propose
        if self.policy is not None and self.policy.table is not None:
            self._check_choices(self.policy)

    def _check_choices(self, pol) -> None:  # noqa: ANN001
        """Each choice is recomputed, before the drafter makes it, by copies of the policy's state priced by the
        table file read again and by the linear model."""
        import copy

        import numpy as np

        from qwen3_rl.spec_decode.adaptive_k import AdaptiveK
        from qwen3_rl.spec_decode.cost_table import load_cost_table

        table = load_cost_table(pol.table.source)
        inner = pol.choose

        def twin(priced_by):  # noqa: ANN001, ANN202
            t = AdaptiveK(
                pol.k_max,
                pol.k_min,
                pol.base_ms,
                pol.seq_ms,
                pol.token_ms,
                pol.kctx_ms,
                pol.uniform,
                table=priced_by,
            )
            # every piece of the policy's state (acceptance counts, per-request estimates, the pinned cell) but
            # its pricing (the table and its buffers) and the wrapped ``choose``: a twin missing a field decides on
            # other gains than the drafter's
            for attr, value in vars(pol).items():
                if attr not in _PRICING and attr != "choose":
                    setattr(t, attr, copy.deepcopy(value))
            return t

        def choose(slots, avail, ctx_tokens, n_running=None, match_len=None):  # noqa: ANN001, ANN202
            args = (
                np.array(slots),
                np.array(avail),
                ctx_tokens,
                n_running,
                None if match_len is None else np.array(match_len),
            )
            by_table, by_linear = twin(table).choose(*args), twin(None).choose(*args)
            out = inner(slots, avail, ctx_tokens, n_running, match_len)
            self.choices += 1
            self.agree += int(np.array_equal(out, by_table))
            self.linear_same += int(np.array_equal(out, by_linear))
            return out

        pol.choose = choose

    def report(self) -> dict:
        out: dict = {"steps": self.steps, "drafted_per_pos": self.drafted_per_pos}
        pol = self.policy
        if pol is not None:
            out["adaptive"] = {
                "table": None if pol.table is None else pol.table.source,
                "k_hist": [int(x) for x in pol.k_hist],
                "step_hist": [int(x) for x in pol.step_hist],
                "choices": self.choices,
                "agree": self.agree,
                "linear_same": self.linear_same,
            }
        return out


def result(llm, name: str, outputs: list[list[int]], calls: dict, metrics: dict, rpc: object) -> dict:  # noqa: ANN001
    """One result entry (see the module docstring)."""
    from vllm.platforms import current_platform

    runner = runner_of(llm)
    layers = runner.vllm_config.compilation_config.static_forward_context.values()
    drafter = getattr(runner, "drafter", None)
    sam = getattr(drafter, "sam", None)
    out = {
        "name": name,
        "outputs": outputs,
        "platform": type(current_platform).__name__,
        "runner": f"{type(runner).__module__}.{type(runner).__name__}",
        "attn_backends": sorted(
            {type(getattr(m, "impl", None)).__name__ for m in layers if getattr(m, "impl", None) is not None}
        ),
        "npu_calls": dict(calls),
        "metrics": metrics,
        "drafter": type(drafter).__name__,
        "rpc": rpc,
    }
    if sam is not None:
        out["sam"] = {"group_mode": bool(sam.config.group_mode), "k": int(sam.k)}
    return out


if __name__ == "__main__":
    sys.exit(main())
