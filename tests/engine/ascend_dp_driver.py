"""One rank of vLLM data parallelism on vLLM-Ascend's own engine over the CPU stand-in (qwen3_rl.cpu_device.npu),
as verl's sync rollout launches it: ``distributed_executor_backend="external_launcher"``, the torchrun-style
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), each rank generating its own share of the
prompts; prints one JSON line.

    RANK=r WORLD_SIZE=2 ... python tests/engine/ascend_dp_driver.py SPEC.json

SPEC: {"workspace": DIR, "model": DIR, "prompts": [[ids], ...] (rank r takes its contiguous share),
       "max_tokens": int, "enable_expert_parallel": bool, optional: "ascend_tree": a vLLM-Ascend tree to run
       (default WORKSPACE/vllm-ascend), "llm": extra LLM kwargs, "moe_probe": true (record the fused MoE's calls)}
Result: {"rank", "outputs": [[ids] per own prompt], "dp": (rank, size) of vLLM's DP group, "ep": EP group size,
"npu_calls": stand-in kernel calls, "routing_ranges": the expert ranges the routing kernel was asked for,
"moe": with moe_probe, per MoE communication type: forward calls, rows, and the routed-path bodies run with their rows
(more bodies than calls: the step was chunked)}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workspace  # noqa: E402


def rebalance_report(llm) -> dict | None:
    """Requests the rebalance hook sent / received / delivered home on this rank, over all rounds."""
    hook = getattr(llm.llm_engine, "qwen3_rl_rebalance_hook", None)
    coord = getattr(hook, "coordinator", None)
    if coord is None:
        return None
    return {"rounds": coord.rounds, "sent": [r for rep in coord.reports for r in rep.sent],
            "received": [r for rep in coord.reports for r in rep.received],
            "delivered": [r for rep in coord.reports for r in rep.delivered],
            "kv_out": sum(rep.kv_bytes_sent for rep in coord.reports),
            "kv_in": sum(rep.kv_bytes_received for rep in coord.reports)}


def eplb_type4(llm, loads: list) -> dict | None:
    """vLLM-Ascend's EPLB policy factory (patched: the vllm_ascend seam 0002) asked for policy type 4 on the load this
    engine's routing recorded: per layer (routing calls cycle through the layers), per EP rank, tokens per expert
    slot, gathered over the EP ranks; rank 0 rebalances and returns the placement."""
    import torch
    import torch.distributed as dist
    from vllm_ascend.eplb.core.policy.policy_abstract import DynamicConfig
    from vllm_ascend.eplb.core.policy.policy_factory import PolicyFactory

    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    per_layer = [[0] * len(loads[0]) for _ in range(layers)]
    for i, counts in enumerate(loads):
        per_layer[i % layers] = [a + b for a, b in zip(per_layer[i % layers], counts, strict=True)]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_layer)
    if dist.get_rank() != 0:
        return None
    workload = torch.tensor(gathered).permute(1, 0, 2)  # [layers, ranks, slots]
    ranks, slots = workload.shape[1], workload.shape[2]
    table = torch.arange(ranks * slots).view(1, ranks, slots).repeat(layers, 1, 1)
    policy = PolicyFactory.generate_policy(4, DynamicConfig())
    changed, priority, new_table = policy.rebalance_experts(table, workload)
    return {"policy": type(policy).__name__, "workload": workload.tolist(), "table": table.tolist(),
            "changed": int(changed), "new_table": torch.as_tensor(new_table).tolist()}


def probe_fused_moe() -> dict:
    """Count ``AscendFusedMoE.forward_impl`` calls and the runs of its routed-path body (``_forward_impl_body``, the
    upstream body the vLLM-Ascend seam's ``forward_impl_hook`` wraps) per MoE communication type, with their row
    counts. The methods run unchanged."""
    from vllm.forward_context import get_forward_context
    from vllm_ascend.ops.fused_moe.fused_moe import AscendFusedMoE

    seen: dict = {}

    def comm() -> dict:
        name = getattr(get_forward_context().moe_comm_type, "name", "NONE")
        return seen.setdefault(name, {"calls": 0, "rows": [], "bodies": 0, "body_rows": []})

    outer = AscendFusedMoE.forward_impl
    body_name = "_forward_impl_body"
    assert hasattr(AscendFusedMoE, body_name), "the vLLM-Ascend seam patch is not applied"

    def forward_impl(self, hidden_states, router_logits, *args, **kwargs):
        c = comm()
        c["calls"] += 1
        c["rows"].append(int(hidden_states.shape[0]))
        return outer(self, hidden_states, router_logits, *args, **kwargs)

    AscendFusedMoE.forward_impl = forward_impl
    body = getattr(AscendFusedMoE, body_name)

    def one_chunk(self, hidden_states, router_logits, *args, **kwargs):
        c = comm()
        c["bodies"] += 1
        c["body_rows"].append(int(hidden_states.shape[0]))
        return body(self, hidden_states, router_logits, *args, **kwargs)

    setattr(AscendFusedMoE, body_name, one_chunk)
    return seen


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    ws = Path(spec["workspace"])
    os.environ["VLLM_PLUGINS"] = "ascend,qwen3_rl"
    workspace.activate(ws)
    from qwen3_rl.cpu_device.npu import ops, stand_in
    from qwen3_rl.cpu_device.npu import run as ascend_run

    ranges: set[tuple[int, int]] = set()
    loads: list = []  # per routing call: tokens per local expert (the kernel's counts output)
    routing = ops.npu_moe_init_routing_custom

    def probe(*args, **kwargs):  # records the expert range and the per-expert counts (the kernel runs unchanged)
        ranges.add(tuple(kwargs.get("active_expert_range") or ()))
        out = routing(*args, **kwargs)
        loads.append(out[2].tolist())
        return out

    ops.C_ASCEND_OPS["npu_moe_init_routing_custom"] = (ops.C_ASCEND_OPS["npu_moe_init_routing_custom"][0], probe)
    ascend_run.prepare([spec.get("ascend_tree") or str(ws / "vllm-ascend")])
    moe = probe_fused_moe() if spec.get("moe_probe") else None
    from vllm import LLM, SamplingParams
    from vllm.distributed import parallel_state as ps
    from vllm.inputs import TokensPrompt

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              num_gpu_blocks_override=256, data_parallel_size=world, distributed_executor_backend="external_launcher",
              enable_expert_parallel=bool(spec.get("enable_expert_parallel")), **spec.get("llm", {}))
    loads.clear()
    if moe is not None:
        moe.clear()  # the generation below only  # the load of the generation below only (not the profiling and warm-up runs)
    share = len(spec["prompts"]) // world
    mine = spec["prompts"][rank * share:(rank + 1) * share]
    if spec.get("rebalance"):  # vllm 0003 / verl 0013: rollout rebalance between the DP engines, as verl sets it
        from qwen3_rl.trainer.seam import configure_rollout_rebalance

        configure_rollout_rebalance(spec["rebalance"], llm)
        mine = [spec["prompts"][i] for i in spec["rebalance_split"][rank]]
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in mine], sp, use_tqdm=False)
    # (the routing kernel that records the load runs on the all-gather path; test_ascend_dp.py checks it is there)
    eplb = eplb_type4(llm, loads) if spec.get("enable_expert_parallel") and loads else None
    print("ENGINE_RESULT " + json.dumps({"eplb": eplb,
        "rank": rank, "outputs": [list(r.outputs[0].token_ids) for r in res],
        "dp": [ps.get_dp_group().rank_in_group, ps.get_dp_group().world_size], "ep": ps.get_ep_group().world_size,
        "npu_calls": dict(stand_in.CALLS), "routing_ranges": sorted(ranges), "rebalance": rebalance_report(llm),
        "moe": moe, "soc": __import__("torch").npu.get_soc_version()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
