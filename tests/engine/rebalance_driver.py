"""One vLLM DP rank of a real 2-rank vLLM 0.13.0 engine (CPU build, patched tree) under the external launcher,
with rollout rebalance on or off; prints one JSON line with this rank's outputs and what the rebalance did.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/engine/rebalance_driver.py SPEC.json

SPEC: {"workspace": DIR, "model": DIR, "prompts": {rank: [[token ids], ...]}, "max_tokens": {rank: [int]},
"rebalance": bool, "kv_path": "device" | "host", "interval": steps between rounds, "max_num_seqs": int,
"corrupt_kv": bool (negative control: moved KV blocks are zeroed on arrival)}.
Result: {"rank", "outputs": [[token ids] per prompt], "reports": [round reports], "kv_path", "backend",
"link_gb_s", "steps"}. The process group is gloo (verl's workers init it before building the engine); vLLM's
DP group's device group is gloo on its CPU platform, so ``kv_path=device`` runs the device-group code over gloo.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workspace  # noqa: E402


def zero_moved_kv() -> None:
    """Negative control of the KV moves: wrap ``migration.move_kv_blocks`` so that every received KV block is
    zeroed after the transfer (a run whose outputs then still equal the unmoved run's would prove nothing)."""
    import torch

    import qwen3_rl.rollout.migration as migration

    real = migration.move_kv_blocks

    def zeroing(kv_spec, comm, sends, recvs, **kw):  # noqa: ANN001, ANN003, ANN202
        out = real(kv_spec, comm, sends, recvs, **kw)
        for _, ids in recvs:
            for cache, axis in zip(kv_spec.caches, kv_spec.block_axes, strict=True):
                cache.index_fill_(axis, torch.as_tensor(list(ids), dtype=torch.long), 0)
        return out

    migration.move_kv_blocks = zeroing


def keep_external_launcher_on_cpu() -> None:
    """Platform shim: vLLM's CPU platform turns any multi-process executor into ``mp``
    (``vllm/platforms/cpu.py:213-226``); the rollout runs vLLM under verl's external launcher (one engine per
    process, DP ranks in lockstep), which the CPU worker serves as the NPU worker does. Keep it."""
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):  # noqa: ANN001
        backend = vllm_config.parallel_config.distributed_executor_backend
        orig(cls, vllm_config)
        if backend == "external_launcher":
            vllm_config.parallel_config.distributed_executor_backend = backend

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def main() -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # stacks on demand if a rank hangs
    spec = json.loads(Path(sys.argv[1]).read_text())
    workspace.activate(Path(spec["workspace"]))
    import torch.distributed as dist
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from qwen3_rl.trainer.seam import configure_rollout_rebalance

    keep_external_launcher_on_cpu()
    rank = int(os.environ["RANK"])
    os.environ.setdefault("LOCAL_RANK", str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              compilation_config={"custom_ops": ["none"]}, gpu_memory_utilization=0.5,
              distributed_executor_backend="external_launcher", data_parallel_size=2, tensor_parallel_size=1,
              max_num_seqs=int(spec.get("max_num_seqs", 4)), enable_prefix_caching=False)
    configure_rollout_rebalance({"rollout_rebalance": bool(spec["rebalance"]),
                                 "rollout_rebalance_interval_steps": int(spec.get("interval", 4)),
                                 "rollout_rebalance_kv_path": spec.get("kv_path", "device"),
                                 "rollout_rebalance_timeout_s": 120.0,
                                 # always with KV, whatever a loaded host's measured link would price
                                 "rollout_rebalance_prefill_tokens_per_s": 0.0,
                                 "rollout_rebalance_max_round_s": 0.0}, llm)
    if spec.get("corrupt_kv"):  # negative control: the moved KV arrives as zeros
        zero_moved_kv()
    prompts = spec["prompts"][str(rank)]
    lens = spec["max_tokens"][str(rank)]
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
    hook = llm.llm_engine.qwen3_rl_rebalance_hook
    coord = hook.coordinator
    out = {"rank": rank, "outputs": [list(o.outputs[0].token_ids) for o in res], "steps": hook.steps,
           "reports": [], "kv_path": None, "backend": None, "link_gb_s": None}
    if coord is not None:
        out["kv_path"], out["backend"] = coord.kv_path, coord.kv_comm.backend
        out["link_gb_s"] = (coord.link_bytes_per_s or 0.0) / 1e9
        out["reports"] = [{"moves": [[m.req_id, m.src, m.dst, m.phase, m.kv_blocks, m.recompute] for m in r.plan.moves],
                           "kv_bytes_sent": r.kv_bytes_sent, "kv_bytes_received": r.kv_bytes_received,
                           "kv_path": r.kv_path} for r in coord.reports]
    print("ENGINE_RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
