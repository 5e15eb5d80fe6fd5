"""verl 0.6.1's (patched) FSDP ``ActorRolloutRefWorker`` on CPU, one gloo rank: where it calls verl patch 0003.

    python tests/helpers/fsdp_worker_driver.py VERL_CONFIG_DIR MODEL_DIR OUT.json

Device shims from ``QWEN3_RL_CPU_SHIMS=1`` (``qwen3_rl/cpu_device/sitecustomize.py``: the worker's
``cpu:gloo,cpu:nccl`` process group is gloo, ``torch.cpu`` gets the CUDA-style calls verl makes). The config is
verl's own ``ppo_trainer`` (FSDP2 actor, sdpa attention, vLLM rollout settings) composed by Hydra. The worker runs
for real: ``__init__`` (role ``actor_rollout``; the patched line reads ``rollout.npu_expandable_segments``),
``init_model`` (the FSDP2 actor of MODEL_DIR on CPU, then ``_build_rollout``, whose engine is the one stand-in: a
rollout that records ``resume`` / ``update_weights`` / ``release``; sync mode ends in ``trainer_mode``), then
``rollout_mode`` / ``trainer_mode`` with verl's device flags as on an A3 (``is_npu_available``, torch.npu a recorder
of ``memory._set_allocator_settings`` that hands every other call to ``torch.cpu``) around each switch.
A second worker built with ``rollout.npu_expandable_segments=false`` (``__init__`` only) switches the process off.

OUT.json: {"fsdp_version": 2, "npu_calls_after_init": [...], "npu_calls_on": [...], "npu_calls_off": [...], "rollout_calls": [...], "weights_pushed": n,
"weights_equal_hf": bool}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types


class RecordingRollout:
    """The rollout engine stand-in (vLLM's would need a device allocator for sleep mode): records the calls the
    worker's mode switches make and the weights it pushes."""

    calls: list[str] = []
    weights: dict = {}

    def __init__(self, config, model_config, device_mesh) -> None:
        self.config = config

    async def resume(self, tags):
        self.calls.append(f"resume:{','.join(tags)}")

    async def update_weights(self, weights, **kwargs):
        self.calls.append("update_weights")
        for name, t in weights:
            RecordingRollout.weights[name] = t.detach().clone()

    async def release(self):
        self.calls.append("release")


def main() -> int:
    cfg_dir, model_dir, out = sys.argv[1:4]
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    def compose_cfg(extra: list[str]):
        overrides = [
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.ref.strategy=fsdp2", "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.mode=sync",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=1", *extra]
        with initialize_config_dir(config_dir=cfg_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=overrides)
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
        OmegaConf.resolve(cfg)
        return cfg

    import verl.utils.device as device
    import verl.workers.fsdp_workers as fw

    fw.get_rollout_class = lambda name, mode: RecordingRollout
    worker = fw.ActorRolloutRefWorker(compose_cfg([]).actor_rollout_ref, role="actor_rollout")
    worker.init_model()

    npu_calls: list[str] = []
    memory = types.SimpleNamespace(_set_allocator_settings=npu_calls.append)

    class _Npu(types.ModuleType):
        def __getattr__(self, name):  # every other device call: the CPU's
            return getattr(torch.cpu, name)

    npu = _Npu("torch.npu")
    npu.memory = memory

    def as_on_a3(coro_fn):
        saved = (device.is_cuda_available, device.is_npu_available, getattr(torch, "npu", None))
        device.is_cuda_available, device.is_npu_available, torch.npu = False, True, npu
        try:
            asyncio.run(coro_fn())
        finally:
            device.is_cuda_available, device.is_npu_available = saved[:2]
            if saved[2] is None:
                del torch.npu
            else:
                torch.npu = saved[2]

    after_init = list(npu_calls)
    as_on_a3(worker.rollout_mode)
    as_on_a3(worker.trainer_mode)
    on = npu_calls[len(after_init):]
    fw.ActorRolloutRefWorker(compose_cfg(["actor_rollout_ref.rollout.npu_expandable_segments=false"]).actor_rollout_ref,
                             role="actor_rollout")
    as_on_a3(worker.rollout_mode)
    as_on_a3(worker.trainer_mode)
    off = npu_calls[len(after_init) + len(on):]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    pushed = RecordingRollout.weights
    equal = set(pushed) <= set(hf) and all(torch.equal(pushed[k].float(), hf[k]) for k in pushed)
    from verl.utils.fsdp_utils import fsdp_version

    with open(out, "w") as f:
        json.dump({"fsdp_version": fsdp_version(worker.actor_module_fsdp), "npu_calls_after_init": after_init, "npu_calls_on": on, "npu_calls_off": off,
                   "rollout_calls": RecordingRollout.calls, "weights_pushed": len(pushed),
                   "hf_weights": len(hf), "weights_equal_hf": equal}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
