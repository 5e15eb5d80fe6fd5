"""Run vLLM 0.13.0's ``AsyncLLM`` (CPU build, patched tree) with its engine core in separate processes, as verl's
servers do, and report what the engine core processes saw; print one JSON line.

    python tests/engine/core_loop_driver.py SPEC.json

SPEC: {"workspace": DIR, "model": DIR, "prompts": [[token ids], ...], "probe_dir": DIR, "runs": [RUN, ...]}
RUN:  {"name": str, "engine": {AsyncEngineArgs kwargs}, "max_tokens": int or [int per prompt],
       "dp_ranks": optional [DP rank per prompt] (``AsyncLLM.generate(data_parallel_rank=...)``),
       "corrupt_kv": optional bool (rollout rebalance's negative control: moved KV blocks arrive as zeros),
       "same_engine": optional bool (run on the previous run's engine, which then stays up for it; its "engine"
       settings are that run's; the probe then records to this run's files)}

The engine core's worker gets a probe (``CoreProbe``, vLLM's ``worker_extension_cls``; installed on every engine
through ``collective_rpc``): it wraps the worker's ``execute_model`` and appends, for each model step, the engine
core process's pid, its vLLM DP rank, ``gc.isenabled()`` and the request ids scheduled in that step to
``<probe_dir>/<run>-<pid>.jsonl``. The worker runs in the engine core process on vLLM's CPU platform (uniproc
executor), so ``execute_model`` runs inside the engine core loop's step (within the step hooks' contexts).
The probe also records each rollout-rebalance round of the engine (``RebalanceCoordinator.run_round``, patched in
the core process) to ``<probe_dir>/<run>-rounds-<pid>.jsonl``.
Each result: {"name", "driver_pid", "outputs": [[token ids] per prompt], "steps": [probe records],
"rounds": [round records],
"gc_between_steps": ``[[pid, gc.isenabled()]]`` of a utility call to the (first) engine core after the requests}.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workspace  # noqa: E402


class CoreProbe:
    """Worker extension: records each ``execute_model`` call of this worker (see the module docstring)."""

    def probe_install(self, path: str, corrupt_kv: bool = False) -> int:
        """Record this worker's steps (and its engine's rebalance rounds) to ``path`` from now on; installed once
        per worker, a later call (a run on the same engine) only moves the records to its ``path``."""
        global _probe_path
        first = _probe_path is None
        _probe_path = path
        if not first:
            return os.getpid()
        _record_rebalance_rounds(corrupt_kv)
        inner = self.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            ids += list(scheduler_output.scheduled_cached_reqs.req_ids)
            rec = {"pid": os.getpid(), "dp_rank": int(self.vllm_config.parallel_config.data_parallel_rank),
                   "gc_enabled": gc.isenabled(), "req_ids": ids,
                   "tokens": int(scheduler_output.total_num_scheduled_tokens)}
            with open(_probe_path.replace("{pid}", str(os.getpid())), "a") as f:
                f.write(json.dumps(rec) + "\n")
            return inner(scheduler_output, *args, **kwargs)

        self.execute_model = execute_model
        return os.getpid()

    def probe_gc(self) -> list:
        """``[pid, gc.isenabled()]`` of the engine core process, read between steps (a utility call)."""
        return [os.getpid(), gc.isenabled()]


#: the probe's file pattern in this process (``{pid}`` in it is replaced), set by ``CoreProbe.probe_install``
_probe_path: str | None = None


def _record_rebalance_rounds(corrupt_kv: bool) -> None:
    """In the engine core process: append each rollout-rebalance round's report of this engine to the probe file
    (``{"round", "dp_rank", "moves": [[req_id, src, dst, phase, kv_blocks, recompute]], "kv_bytes_sent",
    "kv_bytes_received", "delivered", "kv_path", "link_gb_s"}``); ``corrupt_kv`` (negative control): moved KV blocks
    arrive as zeros."""

    import qwen3_rl.rollout.migration as migration

    run_round = migration.RebalanceCoordinator.run_round

    def recorded(coord):  # noqa: ANN001, ANN202
        rep = run_round(coord)
        rec = {"round": rep.round, "dp_rank": coord.rank, "kv_path": rep.kv_path, "link_gb_s": rep.link_gb_s,
               "moves": [[m.req_id, m.src, m.dst, m.phase, m.kv_blocks, m.recompute] for m in rep.plan.moves],
               "kv_bytes_sent": rep.kv_bytes_sent, "kv_bytes_received": rep.kv_bytes_received,
               "delivered": list(rep.delivered)}
        with open(_probe_path.replace("{pid}", f"rounds-{os.getpid()}"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rep

    migration.RebalanceCoordinator.run_round = recorded
    if corrupt_kv:
        from rebalance_driver import zero_moved_kv

        zero_moved_kv()


async def drive(engine, spec: dict, run: dict, keep: bool = False) -> tuple[list[list[int]], list]:  # noqa: ANN001
    """Install the probe in the engine's workers, send ``spec["prompts"]`` (greedy, ``run["max_tokens"]`` each, with
    ``run["dp_ranks"]`` as ``data_parallel_rank`` when given) concurrently; returns the token ids per prompt and the
    workers' gc state between steps. Shuts the engine down unless ``keep`` (the next run uses it) and the run
    succeeded."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    probe = str(Path(spec["probe_dir"]) / f"{run['name']}-{{pid}}.jsonl")
    try:
        await engine.collective_rpc("probe_install", args=(probe, bool(run.get("corrupt_kv", False))))
        lens = run.get("max_tokens", 16)
        ranks = run.get("dp_ranks")

        async def one(i: int, ids: list[int]) -> list[int]:
            extra = {} if ranks is None else {"data_parallel_rank": int(ranks[i])}
            n = int(lens[i] if isinstance(lens, list) else lens)
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            final = None
            async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, f"req-{i}", **extra):
                final = out
            return list(final.outputs[0].token_ids)

        outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(spec["prompts"])))
        between = await engine.collective_rpc("probe_gc")
    except BaseException:
        engine.shutdown()
        raise
    if not keep:
        engine.shutdown()
    return outputs, between


def collect(spec: dict, run: dict, outputs: list, between: list) -> dict:
    """The run's result: outputs, the probe's per-step records and rebalance rounds (all processes)."""
    steps, rounds = [], []
    for f in sorted(Path(spec["probe_dir"]).glob(f"{run['name']}-*.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        (rounds if f.name.startswith(f"{run['name']}-rounds-") else steps).extend(recs)
    return {"name": run["name"], "driver_pid": os.getpid(), "outputs": outputs, "steps": steps,
            "rounds": rounds, "gc_between_steps": between}


async def run_group(spec: dict, runs: list[dict]) -> list[dict]:
    """``runs`` on one engine (made with the first run's settings), one after another; shut down after the last."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = dict(model=spec["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
                  compilation_config={"custom_ops": ["none"]}, gpu_memory_utilization=0.5,
                  worker_extension_cls="core_loop_driver.CoreProbe")
    kwargs.update(runs[0].get("engine", {}))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    results = []
    for i, run in enumerate(runs):
        outputs, between = await drive(engine, spec, run, keep=i < len(runs) - 1)
        results.append(collect(spec, run, outputs, between))
    return results


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workspace.activate(Path(spec["workspace"]))
    groups: list[list[dict]] = []
    for run in spec["runs"]:
        if run.get("same_engine"):
            if not groups or run.get("engine", {}) != groups[-1][0].get("engine", {}) or run.get("corrupt_kv"):
                raise SystemExit(f"error: run {run['name']}: same_engine needs the previous run's engine settings "
                                 "(and no corrupt_kv: the probe is installed by the engine's first run)")
            groups[-1].append(run)
        else:
            groups.append([run])
    results = [r for group in groups for r in asyncio.run(run_group(spec, group))]
    print("ENGINE_RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
