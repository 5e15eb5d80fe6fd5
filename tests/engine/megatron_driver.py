"""One rank of verl 0.6.1's patched Megatron ``ActorRolloutRefWorker`` (role ``actor_rollout``) on CPU:
megatron-core 0.12.1 on gloo, rollout = vLLM 0.13.0's real CPU engine. Prints one JSON line.

    python tests/engine/megatron_driver.py SPEC.json     (one process per rank)

The parent starts ``world`` of these with the environment Ray gives verl's workers (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The worker's config is composed by Hydra from a
real train script (``rollout_driver.compose_config``); only device-layer shims are installed
(``qwen3_rl/cpu_device/megatron_shims.py``). ``free_cache_engine=False``: vLLM's sleep mode needs a device allocator.

SPEC: {"workspace": DIR, "script": "internal/train_....sh", "env": {VAR: value}, "overrides": [Hydra
overrides], "prompts": [[token ids], ...] (the whole batch; each rank generates its rollout-DP piece, as
verl's dispatch hands it out), "out": DIR (rank r writes r.pt there: the actor's HF-named weights after
the step)}
Result (``ENGINE_RESULT {...}``): {"rank", "parallel": {tp, pp, ep, etp, dp}, "timings_s": {stage: s},
"responses": [[ids]] (the whole batch, gathered), "old_log_probs_finite": bool, "entropy_mean",
"rollout_log_probs_max_abs_diff" (actor log-probs of the rollout's tokens vs vLLM's own, same weights),
"update_metrics": {...}, "params_changed": {megatron name: max abs change}, "sync": {"checked": n,
"mismatched": [...], "missing": [...]} (actor's HF weights vs the vLLM engine's parameters, exact),
"sync_before_update_equal_initial": bool}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workspace  # noqa: E402


def compare_sync(hf: dict, vllm_params: dict) -> dict:
    """Exact comparison of the actor's HF-named weights with the engine's parameters (``probe.compare``, the
    check the training runs make after every sync), in this driver's result keys."""
    import probe

    s = probe.compare(hf, vllm_params)
    return {"checked": s["compared"], "mismatched": s["unequal"], "missing": s["unused"], "unchecked": s["missing"],
            "max_abs_diff": s["max_abs_diff"]}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    ws = Path(spec["workspace"])
    workspace.activate(ws)
    import gloo_shims
    import megatron_shims

    megatron_shims.install()
    gloo_shims.install()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    import torch
    import torch.distributed as dist
    from rollout_driver import compose_config

    from engine_driver import runner_of

    cfg = compose_config(spec)
    from megatron.core import parallel_state as mpu
    from verl import DataProto
    from verl.workers.megatron_workers import ActorRolloutRefWorker

    timings["import_compose"] = time.perf_counter() - t0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    t = time.perf_counter()
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout")
    timings["worker_init"] = time.perf_counter() - t
    t = time.perf_counter()
    worker.init_model()
    timings["init_model"] = time.perf_counter() - t
    print(f"rank {rank}: init_model done in {timings['init_model']:.1f}s", file=sys.stderr, flush=True)

    parallel = {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size(),
                "ep": mpu.get_expert_model_parallel_world_size(),
                "etp": mpu.get_expert_tensor_parallel_world_size(), "dp": mpu.get_data_parallel_world_size()}

    def hf_weights() -> dict:
        """The actor's full weights, gathered over TP/PP/EP and HF-named by verl's own generator."""
        from verl.utils.megatron_utils import per_tensor_generator

        return {k: v.detach().clone().cpu() for k, v in per_tensor_generator(
            worker.actor.actor_module, worker.actor_model_config, worker.weight_converter, worker.tf_config,
            worker.layer_name_mapping)}

    def engine_params() -> dict:
        model = runner_of(worker.rollout.inference_engine).model
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    # ---- rollout: each rank generates its piece of the batch (verl's dispatch by rollout DP rank) ----
    tok = worker.tokenizer
    prompts = spec["prompts"]
    rollout_dp = world // int(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    per = len(prompts) // rollout_dp
    mine = prompts[(rank // (world // rollout_dp)) * per:][:per]
    width = max(len(p) for p in prompts)

    def batch(rows):
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask, torch.clamp(mask.cumsum(-1) - 1, min=0)

    ids, mask, pos = batch(mine)
    initial = hf_weights()
    t = time.perf_counter()
    gen = worker.generate_sequences(DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos}, meta_info={"do_sample": False}))
    timings["generate_sequences"] = time.perf_counter() - t
    # generate_sequences synced the initial weights into the engine (rollout_mode) before generating
    sync_initial = compare_sync(initial, engine_params())

    # collect from the rollout DP ranks, as verl's collect does; the actor (DP 1 here) gets the whole batch
    parts: list = [None] * world
    dist.all_gather_object(parts, {k: v for k, v in gen.batch.items()})
    step = len(parts) // rollout_dp
    full = {k: torch.cat([parts[r * step][k] for r in range(rollout_dp)]) for k in parts[0]}
    # what RayPPOTrainer adds after generation (ray_trainer.py compute_response_mask)
    full["response_mask"] = full["attention_mask"][:, -full["responses"].shape[1]:].clone()
    data = DataProto.from_dict(full)
    data.meta_info.update({"global_token_num": data.batch["attention_mask"].sum(-1).tolist(),
                           "temperature": float(cfg.actor_rollout_ref.rollout.temperature)})

    t = time.perf_counter()
    lp = worker.compute_log_prob(data)
    timings["compute_log_prob"] = time.perf_counter() - t
    old = lp.batch["old_log_probs"]
    ent = lp.batch["entropys"]
    result_extra = {}
    if "rollout_log_probs" in full:
        rmask = full["response_mask"].bool()
        result_extra["rollout_log_probs_max_abs_diff"] = (
            (old - full["rollout_log_probs"]).abs()[rmask].max().item())

    # GRPO-style advantages from a made-up reward (the reward function is not under test here)
    data.batch["old_log_probs"] = old
    resp_mask = full["response_mask"].float()
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(old.shape[0], 1, generator=g).expand_as(old) * resp_mask
    data.batch["advantages"] = adv.contiguous()
    data.meta_info["temperature"] = float(cfg.actor_rollout_ref.rollout.temperature)

    before = {n: p.detach().clone() for n, p in worker.actor.actor_module[0].named_parameters()}
    t = time.perf_counter()
    out = worker.update_actor(data)
    timings["update_actor"] = time.perf_counter() - t
    changed = {n: (p.detach() - before[n]).abs().max().item()
               for n, p in worker.actor.actor_module[0].named_parameters()}

    # the weight sync verl runs when it switches to rollout mode (generate_sequences does the same)
    from verl.utils.ray_utils import get_event_loop

    loop = get_event_loop()
    t = time.perf_counter()
    loop.run_until_complete(worker.rollout_mode())
    timings["rollout_mode_sync"] = time.perf_counter() - t
    after = hf_weights()
    sync = compare_sync(after, engine_params())
    loop.run_until_complete(worker.trainer_mode())
    out_dir = Path(spec["out"])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(after, out_dir / f"{rank}.pt")

    def mean(v):
        flat = torch.tensor(v, dtype=torch.float64).flatten() if isinstance(v, list) else torch.tensor([float(v)])
        return float(flat.mean()) if flat.numel() else None

    metrics = {k: mean(v) for k, v in out.meta_info["metrics"].items() if isinstance(v, (int, float, list))}
    result = {"rank": rank, "parallel": parallel, "timings_s": timings,
              "responses": full["responses"].tolist(),
              "old_log_probs_finite": bool(torch.isfinite(old).all()),
              "entropy_mean": float(ent[resp_mask.bool()].mean()),
              "update_metrics": metrics, "params_changed": changed,
              "sync_initial": sync_initial, "sync": sync,
              "initial_equals_after": all(torch.equal(initial[k], after[k]) for k in initial),
              **result_extra}
    print("ENGINE_RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
