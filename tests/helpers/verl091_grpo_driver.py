"""verl 0.9.1's V1 trainer (``verl.trainer.main_ppo.run_ppo``, the sync trainer) running GRPO steps on CPU: the
Megatron actor through verl's engine (mbridge 0.15.1, megatron-core 0.16.1) and the rollout on vLLM 0.23's CPU engine
behind verl's own vLLM server, in one local Ray cluster; prints one line ``VERL_GRPO_RESULT {json}``.

    python tests/helpers/verl091_grpo_driver.py WORK_DIR

Runs in the venv of ``tests/setup_verl091_engine_env.sh``. The config is composed by Hydra from verl's own
``ppo_megatron_trainer.yaml`` (overrides in :func:`overrides`: the repo's tiny dense Qwen3 and tiny ``sum`` data,
:data:`STEPS` GRPO steps, the seed tiny run's layout: two trainer processes, actor TP 2, each with its colocated vLLM
server (TP 1)). The task runner is :class:`CheckedTaskRunner`: verl's ``TaskRunnerV1.run`` sequence
(``main_ppo.py:137-162``: TransferQueue, the trainer class from verl's registry, ``init``, the agent loop manager,
``fit``), then, with the trainer still up:

* the actor's rollout export: ``engine.get_per_tensor_param()`` in each trainer worker (what ``update_weights``
  streams to its server, ``engine_workers.py:786``), HF names -> tensors, saved to WORK_DIR/export_rank{r}.pt;
* each server's weights: every parameter of the model vLLM's worker holds (vLLM names), saved from inside the
  engine by verl's ``collective_rpc`` to WORK_DIR/server_{i}.pt; and each server's weight version
  (``global_steps``, set by the sync).

The reward is ``verl091_grpo_reward.py`` through verl's ``reward.custom_reward_function`` (the untrained tiny model
scores 0 on gsm8k's rule in every sample: no advantage, no update).

verl's own ``file`` logger writes every step's metrics to WORK_DIR/metrics.jsonl. The device layer
(``verl091_grpo_site/sitecustomize.py``: ``megatron16_shims``, ``verl091_cpu.PLATFORM_CPU_HOST``,
``vllm023_reload.CPU_LINEAR_KEEPS_WEIGHT``) is in every Ray process; the one setting that is not verl's config: Ray is
started with ``num_gpus`` = the trainer's process count (``RAY_GPU_SLOTS``: verl places its workers on the platform's
resource, ``"GPU"``, and asks each worker's accelerator id when it launches the servers,
``vllm_async_server.py:1343-1353``; on this host those are slots of the CPU, no device).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SITE = HERE / "verl091_grpo_site"
STEPS = 2
TP = 2  # the seed tiny run's layout: actor TP 2 over 2 trainer processes, one vLLM CPU engine (TP 1) per process
N_PROMPTS = 4  # prompts per step (data.train_batch_size)
N_SAMPLES = 4  # GRPO group size (rollout.n)
RESPONSE_LEN = 24
RAY_TIMEOUT_S = 1200
ENGINE = {
    "num_gpu_blocks_override": 256,
    "compilation_config": {"custom_ops": ["none"], "cudagraph_mode": "NONE"},
}


def overrides(model: Path, data: dict[str, Path], work: Path) -> list[str]:
    """Hydra overrides of verl's ``ppo_megatron_trainer.yaml`` for the tiny run."""
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    eng = json.dumps(ENGINE).replace('"', "")  # Hydra dict syntax
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data['train']}",
        f"data.val_files={data['test']}",
        f"data.train_batch_size={N_PROMPTS}",
        "data.max_prompt_length=96",
        f"data.max_response_length={RESPONSE_LEN}",
        "data.dataloader_num_workers=0",
        "data.shuffle=False",
        f"actor_rollout_ref.model.path={model}",
        f"{a}.megatron.tensor_model_parallel_size={TP}",
        f"{a}.megatron.sequence_parallel={TP > 1}",
        f"{a}.megatron.vanilla_mbridge=True",  # mbridge (pins.toml [sets.current.runtime])
        f"{a}.megatron.use_distributed_optimizer=True",
        f"{a}.optim.lr=1e-3",
        f"{a}.ppo_mini_batch_size={N_PROMPTS}",
        f"{a}.ppo_micro_batch_size_per_gpu={N_PROMPTS * N_SAMPLES}",
        f"{a}.use_dynamic_bsz=False",
        f"{a}.use_kl_loss=False",
        f"{a}.entropy_coeff=0.0",
        f"{r}.log_prob_micro_batch_size_per_gpu={N_PROMPTS * N_SAMPLES}",
        f"{r}.name=vllm",
        f"{r}.n={N_SAMPLES}",
        f"{r}.tensor_model_parallel_size=1",
        f"{r}.dtype=float32",
        f"{r}.enforce_eager=True",
        f"{r}.free_cache_engine=False",  # vLLM's sleep mode needs CUDA's allocator (vLLM refuses it on CPU)
        f"+{r}.enable_sleep_mode=False",
        f"{r}.gpu_memory_utilization=0.5",
        f"{r}.max_model_len=160",
        f"{r}.max_num_seqs=16",
        f"{r}.max_num_batched_tokens=2048",
        f"+{r}.engine_kwargs.vllm={eng}",
        f"{r}.agent.num_workers=1",
        f"reward.custom_reward_function.path={HERE / 'verl091_grpo_reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",  # 8 reward / 8 storage processes by default: 2 shared cores here
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "trainer.use_v1=True",
        "trainer.critic_warmup=0",
        "trainer.logger=[console,file]",
        "trainer.project_name=verl091_grpo",
        "trainer.experiment_name=tiny",
        f"trainer.n_gpus_per_node={TP}",
        "trainer.nnodes=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={STEPS}",
        "trainer.total_epochs=100",
        f"trainer.default_local_dir={work / 'ckpt'}",
    ]


def _actor_export(worker: Any, path: str) -> list[str]:
    """Run in the trainer worker actor (``__ray_call__``): the actor engine's rollout export, saved to ``path``."""
    import torch

    inst = worker
    for cand in getattr(worker, "worker_dict", {}).values():
        if hasattr(cand, "actor"):
            inst = cand
    gen, _ = inst.actor.engine.get_per_tensor_param()
    items = [(k, v.detach().to("cpu").clone()) for k, v in gen]
    torch.save({"tensors": dict(items), "names": [k for k, _ in items]}, path)
    return [k for k, _ in items]


def _server_weights(wrapper: Any, path: str) -> int:
    """Run by vLLM on its worker (verl's ``collective_rpc``): every parameter of the model it serves, saved."""
    import torch

    worker = getattr(wrapper, "worker", wrapper)
    model = worker.model_runner.model
    sd = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch.save(sd, path)
    return len(sd)


@ray.remote(num_cpus=1)
class CheckedTaskRunner:
    """verl's ``TaskRunnerV1.run`` sequence, then the weight read-out of both sides (module docstring)."""

    def run(self, config: Any, work: str) -> dict:
        import transfer_queue as tq
        from omegaconf import OmegaConf
        from verl.trainer.main_ppo import TaskRunnerV1
        from verl.trainer.ppo.v1 import get_trainer_cls

        runner = TaskRunnerV1.__ray_metadata__.modified_class()
        config.transfer_queue.enable = True
        OmegaConf.resolve(config)
        runner.config = config
        tq.init(config.transfer_queue)
        out: dict = {}
        try:
            runner.trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config=config)
            out["trainer_class"] = type(runner.trainer).__module__ + "." + type(runner.trainer).__qualname__
            t0 = time.perf_counter()
            runner.trainer.init()
            runner.init_agent_loop_manager()
            out["init_s"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            runner.trainer.fit(runner.agent_loop_manager)
            out["fit_s"] = round(time.perf_counter() - t0, 1)
            out["global_steps"] = runner.trainer.global_steps
            wg = runner.trainer.actor_rollout_wg
            # every rank runs the export (its TP all-gathers are collective)
            out["export_names"] = ray.get(
                [
                    w.__ray_call__.remote(_actor_export, f"{work}/export_rank{i}.pt")
                    for i, w in enumerate(wg.workers)
                ],
                timeout=RAY_TIMEOUT_S,
            )[0]
            replicas = runner.trainer.llm_server_manager.get_replicas()
            servers = [srv for rep in replicas for srv in rep.servers]
            out["servers"] = len(servers)
            ray.get(
                [
                    srv.collective_rpc.remote(method=_server_weights, args=(f"{work}/server_{i}.pt",))
                    for i, srv in enumerate(servers)
                ],
                timeout=RAY_TIMEOUT_S,
            )
            out["server_global_steps"] = ray.get(
                [srv.__ray_call__.remote(lambda s: getattr(s, "global_steps", None)) for srv in servers],
                timeout=60,
            )
        finally:
            tracking = getattr(runner.trainer, "logger", None) if getattr(runner, "trainer", None) else None
            if tracking is not None:
                tracking.finish(exit_code=0)
            tq.close()
        return out


def main() -> int:
    work = Path(sys.argv[1]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    from qwen3_rl.tools.tiny_data import make_tiny_data
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    model = make_tiny_model(work / "dense", TinySpec(moe=False))
    data = make_tiny_data(work / "data", n_train=N_PROMPTS * STEPS, n_test=4, kind="sum")

    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    conf_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        cfg = compose("ppo_megatron_trainer", overrides=overrides(model, data, work))

    env = dict(get_ppo_ray_runtime_env(cfg).get("env_vars", {}))
    env.update(
        {
            "QWEN3_RL_VERL091_CPU": "1",
            "RAY_AUTH_MODE": "disabled",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # verl's collective_rpc carries the read-out function
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VERL_FILE_LOGGER_PATH": str(work / "metrics.jsonl"),
            "PYTHONPATH": os.pathsep.join(
                [
                    str(SITE),
                    str(REPO),
                    str(REPO / "qwen3_rl" / "cpu_device"),
                    os.environ.get("PYTHONPATH", ""),
                ]
            ).rstrip(os.pathsep),
        }
    )
    ray.init(
        address="local",
        num_cpus=16,  # logical slots: TransferQueue, the task runner, reward loop and workers each hold one
        num_gpus=TP,  # RAY_GPU_SLOTS (module docstring)
        include_dashboard=False,
        _temp_dir=str(work / "ray"),
        runtime_env={"env_vars": env},
        log_to_driver=True,
    )
    t0 = time.perf_counter()
    try:
        runner = CheckedTaskRunner.remote()
        out = ray.get(runner.run.remote(cfg, str(work)), timeout=RAY_TIMEOUT_S)
    finally:
        ray.shutdown()
    out["total_s"] = round(time.perf_counter() - t0, 1)
    out["shims"] = [
        "RAY_GPU_SLOTS",
        "megatron16_shims",
        "verl091_cpu.PLATFORM_CPU_HOST",
        "vllm023_reload.CPU_LINEAR_KEEPS_WEIGHT",
    ]
    print("VERL_GRPO_RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
