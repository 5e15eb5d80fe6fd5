"""verl 0.9.1's own Megatron training engine (``verl/workers/engine/megatron/transformer_impl.py``, mbridge as the
bridge, megatron-core 0.16.1) on CPU over gloo, driven through the worker API verl's V1 trainer calls, on a verl tree
first on ``PYTHONPATH``.

    python tests/helpers/verl091_engine_driver.py engine HF_DIR OUT_DIR      # every rank (RANK / WORLD_SIZE / ...)
    python tests/helpers/verl091_engine_driver.py hf HF_DIR OUT_DIR          # after the engine run, one process

``engine``: the trainer's config is composed by Hydra from verl's own ``ppo_megatron_trainer.yaml`` (overrides in
:func:`overrides`: float32, TP = WORLD_SIZE, vanilla mbridge: pins.toml's current set), turned into the actor's
dataclasses as ``ActorRolloutRefWorker.init_model`` does (``verl/workers/engine_workers.py:590-645``) and handed to
verl's ``TrainingWorker`` (the actor's worker class, ``:459``), which builds the engine through ``EngineRegistry``.
Then, with the batch of :func:`make_batch` (left-padded prompts, right-padded responses, converted by verl's
``left_right_2_no_padding`` as the trainer does):

1. ``infer_batch`` with ``calculate_entropy`` / ``compute_loss=False`` (the trainer's old-log-prob call,
   ``trainer/ppo/v1/trainer_base.py:1651-1658``): log-probs [b, R] (``no_padding_2_padding``);
2. the rollout export ``engine.get_per_tensor_param()`` (what ``update_weights`` streams to vLLM,
   ``engine_workers.py:786``), before the step;
3. ``infer_batch`` with ``compute_loss=True`` and verl's ``ppo_loss`` (set by ``set_loss_fn``, as ``init_model``
   does): the loss before the step, with ``old_log_probs`` = step 1's log-probs and fixed advantages;
4. ``train_mini_batch`` (``update_actor``'s call, ``:713-716``, with ``_update_actor``'s extra info,
   ``trainer_base.py:1846-1856``): one mini-batch, one optimizer step;
5. 3 again (the loss after the step on the same batch), 1 again (log-probs after), 2 again (export after).

Rank 0 writes OUT_DIR/engine.pt: {"versions", "engine_class", "tp", "batch" (the padded batch), "logp_before" /
"logp_after" [b, R], "loss_before" / "loss_after" (floats), "train_metrics", "params_before" / "params_after"
(megatron name -> rank 0's TP shard), "export_before" / "export_after" (HF name -> tensor, the generator's items),
"export_names_after" (names in the generator's order, duplicates kept)}; every rank r writes
OUT_DIR/params_rank{r}.pt: {"params_before", "params_after"} (its TP shards, DDP's ``module.`` names).

``hf``: HF transformers (float32) in a process without the device shims (transformers 5 leaves RoPE's
``inv_freq`` uninitialised under the seed CUDA_CALLS shim, see ``verl091_mbridge_driver.py``): the log-probs of the
same batch from HF_DIR's weights, and from a model into which ``export_after`` is loaded with
``load_state_dict(strict=True)``; that model's ``state_dict()`` compared with ``export_after`` tensor by tensor.
OUT_DIR/hf.pt: {"logp_hf" / "logp_hf_exported" [b, R], "file_tensors" (the safetensors' tensors),
"state_dict_equal" (name -> bool), "missing" / "unexpected", "transformers"}.

Device layer: ``qwen3_rl/cpu_device/megatron16_shims.py`` and ``qwen3_rl/cpu_device/verl091_cpu.py`` (the only
CPU-specific code; ``qwen3_rl/cpu_device`` must be on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if sys.argv[1] == "engine":
    from qwen3_rl.cpu_device import megatron16_shims, verl091_cpu

    megatron16_shims.install()  # before megatron is imported
    verl091_cpu.install()

import torch  # noqa: E402

LR = 5e-5  # Adam, one step: every weight moves by about LR; the ratios stay inside the PPO clip range (0.8, 1.2)
PROMPTS = [[11, 42, 7, 99, 3], [5, 250, 17]]  # token ids; the batch pads prompts on the left
RESPONSES = [[8, 300, 21, 64], [77, 1, 402, 13, 256, 90]]  # and responses on the right
ADVANTAGES = [1.0, -1.0]  # one per sequence, the same on every response token


def overrides(hf_dir: str, tp: int, n: int) -> list[str]:
    """Hydra overrides of verl's ``ppo_megatron_trainer.yaml`` for this run (``n`` sequences per batch)."""
    actor = "actor_rollout_ref.actor"
    return [
        f"actor_rollout_ref.model.path={hf_dir}",
        f"{actor}.megatron.tensor_model_parallel_size={tp}",
        f"{actor}.megatron.sequence_parallel={tp > 1}",
        f"{actor}.megatron.vanilla_mbridge=True",  # mbridge (pins.toml [sets.current.runtime])
        f"{actor}.megatron.use_distributed_optimizer=True",
        f"{actor}.optim.lr={LR}",
        f"{actor}.optim.total_training_steps=1",  # the trainer sets it from the data (constant LR here)
        f"{actor}.ppo_mini_batch_size={n}",
        f"{actor}.ppo_micro_batch_size_per_gpu={n}",
        f"{actor}.use_dynamic_bsz=False",
        f"{actor}.use_kl_loss=False",
        f"{actor}.entropy_coeff=0.0",
        f"{actor}.shuffle=False",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={n}",
        "actor_rollout_ref.rollout.n=1",
    ]


def make_batch(pad_id: int) -> dict[str, torch.Tensor]:
    """The trainer's padded batch (``DataProto.batch``): prompts [b, P] left-padded, responses [b, R]
    right-padded, input_ids / attention_mask / position_ids [b, P + R], response_mask [b, R], advantages [b, R]."""
    p_len, r_len = max(map(len, PROMPTS)), max(map(len, RESPONSES))
    b = len(PROMPTS)
    prompts = torch.full((b, p_len), pad_id, dtype=torch.long)
    responses = torch.full((b, r_len), pad_id, dtype=torch.long)
    attn = torch.zeros(b, p_len + r_len, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        prompts[i, p_len - len(p) :] = torch.tensor(p)
        responses[i, : len(r)] = torch.tensor(r)
        attn[i, p_len - len(p) : p_len + len(r)] = 1
    response_mask = attn[:, p_len:].clone()
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.tensor(ADVANTAGES)[:, None] * response_mask.float()
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attn,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "advantages": advantages,
    }


def float32_worker_config(cfg: Any) -> tuple[Any, Any, Any]:
    """ActorRolloutRefWorker.init_model's actor branch (``engine_workers.py:590-645``) on the composed ``cfg``:
    (TrainingWorkerConfig, ActorConfig, HFModelConfig), the engine config's dtype float32 for the exact comparison
    with HF. McoreEngineConfig's validation accepts only bfloat16 / float16 (``verl/workers/config/engine.py:218``)
    and its fields are frozen (``verl/base_config.py:33-38``), so the validated config's dtype is set past both; the
    engine reads it once (``transformer_impl.py:277-278``: param_dtype, and from that mbridge's dtype, tf_config.fp16
    / bf16 False, the optimizer's fp16 / bf16 False)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig

    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    wcfg = TrainingWorkerConfig(
        model_type=model_config.get("model_type", "language_model"),
        model_config=model_config,
        engine_config=actor_config.engine,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
    )
    object.__setattr__(wcfg.engine_config, "dtype", "float32")
    return wcfg, actor_config, model_config


def engine_main(hf_dir: str, out_dir: Path, extra: tuple[str, ...] = ()) -> int:
    """The engine check; ``extra``: Hydra overrides after :func:`overrides`' (e.g. the switches' keys)."""
    import importlib.metadata as md
    from functools import partial

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = make_batch(pad_id=0)
    n = batch["input_ids"].shape[0]
    conf_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        cfg = compose("ppo_megatron_trainer", overrides=[*overrides(hf_dir, world, n), *extra])

    wcfg, actor_config, model_config = float32_worker_config(cfg)
    ecfg = wcfg.engine_config
    ecfg.use_dynamic_bsz = cfg.actor_rollout_ref.actor.use_dynamic_bsz
    ecfg.infer_micro_batch_size_per_gpu = cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    ecfg.micro_batch_size_per_gpu = cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
    ecfg.use_remove_padding = model_config.get("use_remove_padding", False)
    worker = TrainingWorker(config=wcfg)
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor_config))
    engine = worker.engine

    def td(**extra) -> object:
        data = tu.get_tensordict({k: v.clone() for k, v in batch.items()}, non_tensor_dict={})
        data = left_right_2_no_padding(data)
        tu.assign_non_tensor(data, temperature=1.0, **extra)
        return data

    def log_probs() -> torch.Tensor:
        data = td(calculate_entropy=True, compute_loss=False)
        out = worker.infer_batch(data)
        return no_padding_2_padding(tu.get(out, "log_probs"), data).float() if out is not None else None

    def loss_on(old: torch.Tensor) -> float:
        data = td(calculate_entropy=False, compute_loss=True, global_batch_size=n)
        data["old_log_probs"] = old.clone()
        out = worker.infer_batch(data)
        return float(tu.get(out, "metrics")["loss"]) if out is not None else None

    def params() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in engine.module[0].named_parameters()}

    def export() -> tuple[dict[str, torch.Tensor], list[str]]:
        gen, _ = engine.get_per_tensor_param()
        items = [(k, v.detach().clone()) for k, v in gen]
        return dict(items), [k for k, _ in items]

    res: dict = {"versions": {p: md.version(p) for p in ("verl", "megatron-core", "mbridge", "torch")}}
    res["engine_class"] = type(engine).__module__ + "." + type(engine).__qualname__
    res["tp"] = world
    res["batch"] = batch
    res["params_before"] = params()
    res["logp_before"] = logp0 = log_probs()
    old = torch.zeros_like(batch["advantages"]) if logp0 is None else logp0
    # every rank needs old_log_probs of the same shape; TP ranks > 0 get rank 0's through a broadcast
    torch.distributed.broadcast(old, src=0)
    res["export_before"], _ = export()
    res["loss_before"] = loss_on(old)

    data = td(
        calculate_entropy=False,
        global_batch_size=n,
        mini_batch_size=n,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
    )
    data["old_log_probs"] = old.clone()
    out = worker.train_mini_batch(data)
    res["train_metrics"] = None if out is None else tu.get(out, "metrics")

    res["loss_after"] = loss_on(old)
    res["logp_after"] = log_probs()
    res["params_after"] = params()
    res["export_after"], res["export_names_after"] = export()
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({k: res[k] for k in ("params_before", "params_after")}, out_dir / f"params_rank{rank}.pt")
    if rank == 0:
        torch.save(res, out_dir / "engine.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def hf_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs [b, R] of each response under ``model`` (float32, each sequence unpadded, alone)."""
    p_len = batch["prompts"].shape[1]
    out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    for i in range(batch["input_ids"].shape[0]):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        n_prompt = int(batch["attention_mask"][i, :p_len].sum())
        with torch.no_grad():
            logits = model(ids).logits.float()[0]
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        resp = lp[n_prompt - 1 :]
        out[i, : resp.numel()] = resp
    return out


def hf_main(hf_dir: str, out_dir: Path) -> int:
    import importlib.metadata as md

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    eng = torch.load(out_dir / "engine.pt", weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    res: dict = {"transformers": md.version("transformers")}
    res["logp_hf"] = hf_log_probs(model, eng["batch"])
    res["file_tensors"] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        res["file_tensors"].update(load_file(str(f)))
    exported = eng["export_after"]
    missing, unexpected = model.load_state_dict(exported, strict=False)
    res["missing"], res["unexpected"] = sorted(missing), sorted(unexpected)
    sd = model.state_dict()
    res["state_dict_equal"] = {k: k in sd and torch.equal(sd[k], v) for k, v in exported.items()}
    res["logp_hf_exported"] = hf_log_probs(model, eng["batch"])
    torch.save(res, out_dir / "hf.pt")
    return 0


if __name__ == "__main__":
    mode, hf, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    raise SystemExit(engine_main(hf, out) if mode == "engine" else hf_main(hf, out))
