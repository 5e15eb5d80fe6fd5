"""The current set's old-log-prob skip checked on verl 0.9.1's own code, on CPU, in the verl 0.9.1 venv.

    python tests/helpers/verl091_old_log_prob_driver.py OUT_JSON     # a verl 0.9.1 tree and the repo on PYTHONPATH

``loss``: per policy-loss mode (verl's ``register_policy_loss`` registry, ``trainer/ppo/core_algos.py``), the actor
config composed by Hydra from verl's ``ppo_megatron_trainer.yaml``, a batch in verl's no-padding layout
(``left_right_2_no_padding``, as the trainer sends it) and a tiny next-token model (embedding -> tanh -> linear, its
log-probs by verl's ``logprobs_from_logits``), three losses through verl's ``ppo_loss`` and their gradients:

* ``recomputed``: upstream's way, ``old_log_probs`` from a separate forward pass without grad (the old-log-prob pass);
* ``current``: ``qwen3_rl.trainer.verl091_old_log_prob.on_policy_ppo_loss`` on a batch without ``old_log_probs``
  (the training forward's log-probs, detached);
* ``bypass``: ``old_log_probs`` = the rollout engine's log-probs, as ``bypass_mode`` sets them
  (``trainer_base.py:1641-1647``); stand-in: the recomputed ones plus ``ROLLOUT_MISMATCH`` (Gaussian, std
  :data:`MISMATCH_STD` nats per response token), named for what it models, the train/inference kernel mismatch.

``skip``: the recipe's trainer class (``qwen3_rl_sync``) with the tiny GRPO config: ``_compute_old_log_prob`` with the
switch on and off, the actor worker group replaced by a counter of ``compute_log_prob`` calls (off: upstream's method
reaches the call, which the counter then stops), and ``_update_actor`` on a stand-in ``update_actor`` (the
``calculate_entropy`` sent, the metrics logged); and the start-up check's refusals.

OUT_JSON: {"loss": {mode: {"recomputed" | "current" | "bypass": loss, "grad_diff_current" | "grad_diff_bypass":
max abs gradient difference to recomputed, "ratio_current_max_dev" | "ratio_bypass_max_dev": max |ratio - 1| on
response tokens}}, "skip": {...}, "versions": {...}}.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch

MODES = ["vanilla", "gspo", "geo_mean", "cispo"]  # policy-loss modes of verl 0.9.1 that read old_log_prob
MISMATCH_STD = 0.05  # nats: the ROLLOUT_MISMATCH stand-in's spread per token
VOCAB, HIDDEN = 64, 16
PROMPTS = [[11, 42, 7, 9, 3], [5, 50, 17]]
RESPONSES = [[8, 30, 21, 60], [7, 1, 40, 13, 25, 33]]
ADVANTAGES = [1.0, -1.0]
ACTOR = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.entropy_coeff=0.0",
]


def compose(overrides: list[str]) -> object:
    """verl 0.9.1's ``ppo_megatron_trainer`` config with ``overrides``."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    conf_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        return hydra_compose("ppo_megatron_trainer", overrides=overrides)


def padded_batch() -> dict[str, torch.Tensor]:
    """The trainer's padded batch: prompts [b, P] left-padded, responses [b, R] right-padded, and the rest."""
    p_len, r_len, b = max(map(len, PROMPTS)), max(map(len, RESPONSES)), len(PROMPTS)
    prompts = torch.zeros(b, p_len, dtype=torch.long)
    responses = torch.zeros(b, r_len, dtype=torch.long)
    attn = torch.zeros(b, p_len + r_len, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        prompts[i, p_len - len(p) :] = torch.tensor(p)
        responses[i, : len(r)] = torch.tensor(r)
        attn[i, p_len - len(p) : p_len + len(r)] = 1
    response_mask = attn[:, p_len:].clone()
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "advantages": torch.tensor(ADVANTAGES)[:, None] * response_mask.float(),
    }


def batch_td() -> object:
    """The batch in verl's no-padding layout, with the global-batch info the engine adds per micro-batch."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = padded_batch()
    data = left_right_2_no_padding(
        tu.get_tensordict({k: v.clone() for k, v in batch.items()}, non_tensor_dict={})
    )
    tu.assign_non_tensor(
        data, dp_size=1, batch_num_tokens=int(batch["response_mask"].sum()), global_batch_size=len(PROMPTS)
    )
    return data


def forward(model: torch.nn.Module, data: object) -> torch.Tensor:
    """Log-probs of each packed token's successor, nested like the engine's output (prompt + response tokens)."""
    from verl.utils.torch_functional import logprobs_from_logits

    ids = data["input_ids"]
    flat = ids.values()
    logits = model(flat)  # [nnz, V]
    labels = torch.roll(flat, shifts=-1)
    return torch.nested.nested_tensor_from_jagged(logprobs_from_logits(logits, labels), offsets=ids.offsets())


def loss_case(mode: str) -> dict[str, float]:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from qwen3_rl.trainer.verl091_old_log_prob import on_policy_ppo_loss

    cfg = compose([*ACTOR, f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, VOCAB)
    )
    out: dict[str, float] = {}

    def run(kind: str) -> tuple[float, list[torch.Tensor], torch.Tensor]:
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        data = batch_td()
        mask = (
            data["response_mask"].to_padded_tensor(0)
            if data["response_mask"].is_nested
            else data["response_mask"]
        )
        if kind != "current":  # upstream: the old-log-prob pass, a separate forward without grad
            with torch.no_grad():
                old = no_padding_2_padding(forward(model, data), data)
            if kind == "bypass":
                gen = torch.Generator().manual_seed(1)
                rollout_mismatch = torch.randn(old.shape, generator=gen) * MISMATCH_STD
                old = old + rollout_mismatch * mask
            data["old_log_probs"] = old
        model.zero_grad(set_to_none=True)
        lp = forward(model, data)
        fn = on_policy_ppo_loss if kind == "current" else ppo_loss
        loss, _ = fn(actor, {"log_probs": lp}, data)
        loss.backward()
        ratio = torch.exp(no_padding_2_padding(lp, data).detach() - data["old_log_probs"])
        return float(loss), [p.grad.clone() for p in model.parameters()], (ratio - 1).abs()[mask.bool()].max()

    ref_loss, ref_grads, ref_dev = run("recomputed")
    out["recomputed"], out["ratio_recomputed_max_dev"] = ref_loss, float(ref_dev)
    out["grad_norm"] = float(torch.cat([g.flatten() for g in ref_grads]).norm())
    for kind in ("current", "bypass"):
        loss, grads, dev = run(kind)
        out[kind] = loss
        out[f"grad_diff_{kind}"] = max(
            float((g - r).abs().max()) for g, r in zip(grads, ref_grads, strict=True)
        )
        out[f"ratio_{kind}_max_dev"] = float(dev)
    return out


class _CountingWorkerGroup:
    """The actor worker group's ``compute_log_prob``, counted; a call stops the step there (``_Reached``).
    ``update_actor`` records the ``calculate_entropy`` the trainer sends and answers with the worker's metric names
    (``ppo_loss``'s ``actor/entropy_loss`` only when the forward computes entropy, as the worker does)."""

    ENTROPY_LOSS = 0.625  # nats per token: the update's actor/entropy_loss in this stand-in

    def __init__(self) -> None:
        self.calls = 0
        self.calculate_entropy: list[bool] = []

    def compute_log_prob(self, batch: object) -> object:
        self.calls += 1
        raise _Reached

    def update_actor(self, batch: object) -> dict:
        on = bool(batch.extra_info["calculate_entropy"])
        self.calculate_entropy.append(on)
        metrics = {"actor/pg_loss": [0.25], "mfu": [0.0]}
        if on:
            metrics["actor/entropy_loss"] = [self.ENTROPY_LOSS]
        return {"metrics": metrics}


class _Reached(Exception):
    """Upstream's ``_compute_old_log_prob`` reached the worker's ``compute_log_prob``."""


def skip_case() -> dict:
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta

    from qwen3_rl.trainer import verl091_old_log_prob as olp
    from qwen3_rl.trainer.old_log_prob import OldLogProbConfigError
    from qwen3_rl.trainer.verl091_spec_metrics import trainer_class

    base = [
        *ACTOR,
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.rollout.calculate_log_probs=False",
    ]
    res: dict = {"mro": [c.__name__ for c in trainer_class().__mro__[:4]]}
    for switch in (True, False):
        cfg = compose([*base, f"+qwen3_rl.old_log_prob.enable={switch}"])
        trainer = trainer_class().__new__(trainer_class())
        trainer.config = cfg
        trainer.actor_rollout_wg = wg = _CountingWorkerGroup()
        # what init() sets before the workers start (the rest of init starts Ray workers: not run here)
        trainer._qwen3_rl_skip_old_log_prob = olp.prepare(cfg)
        batch, reached = KVBatchMeta(partition_id="train", keys=["0", "1"], tags=[{}, {}]), False
        try:
            returned = trainer._compute_old_log_prob(batch, {})
        except _Reached:
            reached, returned = True, None
        extra_info = dict(batch.extra_info)
        update_metrics: dict = {}
        trainer._update_actor(
            KVBatchMeta(partition_id="train", keys=["0", "1"], tags=[{}, {}]), update_metrics
        )
        res[f"switch_{switch}"] = {
            "calls": wg.calls,
            "reached": reached,
            "same_batch": returned is batch,
            "extra_info": extra_info,
            "loss_fn": olp.actor_loss_fn(cfg).func.__name__ if switch else None,
            "update_calculate_entropy": wg.calculate_entropy,
            "update_metrics": {k: float(v) for k, v in update_metrics.items()},
        }
    refusals = {}
    for name, extra in {
        "two_mini_batches": ["actor_rollout_ref.actor.ppo_mini_batch_size=8"],
        "rollout_log_probs": ["actor_rollout_ref.rollout.calculate_log_probs=True"],
        "bypass": ["algorithm.rollout_correction.bypass_mode=True"],
        "two_epochs": ["actor_rollout_ref.actor.ppo_epochs=2"],
    }.items():
        cfg = compose([*base, "+qwen3_rl.old_log_prob.enable=True", *extra])
        try:
            olp.check(cfg)
            refusals[name] = None
        except OldLogProbConfigError as e:
            refusals[name] = str(e)
    res["refusals"] = refusals
    res["switch_default"] = olp.check(compose(base))
    assert OmegaConf.select(compose(base), "qwen3_rl") is None
    return res


def engine_main(hf_dir: str, out_pt: str, kind: str) -> int:
    """One ``update_actor`` step of verl 0.9.1's Megatron engine (TP 1, one process) on the engine driver's batch:
    ``kind`` ``upstream`` = the old-log-prob pass (``infer_batch``, the worker's ``compute_log_prob`` call) then
    ``train_mini_batch`` with verl's ``ppo_loss``; ``current`` = ``train_mini_batch`` on the batch without
    ``old_log_probs`` with :func:`on_policy_ppo_loss` and ``calculate_entropy``. Writes {"params_before" /
    "params_after" (name -> tensor), "metrics", "infer_calls", "logp_old", "actor/entropy" (nats per token: upstream
    from the pass as the trainer aggregates it, ours the switch's metric from the update)}."""
    sys.path.insert(0, str(Path(__file__).parent))
    import verl091_engine_driver as engine_driver  # its import installs the device layer (argv[1] == "engine")
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from qwen3_rl.trainer.verl091_old_log_prob import entropy_metric, on_policy_ppo_loss

    batch = engine_driver.make_batch(pad_id=0)
    n = batch["input_ids"].shape[0]
    cfg = compose(engine_driver.overrides(hf_dir, 1, n))
    wcfg, actor_config, model_config = engine_driver.float32_worker_config(cfg)
    ecfg = wcfg.engine_config
    ecfg.use_dynamic_bsz = False
    ecfg.infer_micro_batch_size_per_gpu = n
    ecfg.micro_batch_size_per_gpu = n
    ecfg.use_remove_padding = model_config.get("use_remove_padding", False)
    worker = TrainingWorker(config=wcfg)
    worker.reset()
    calls = {"infer_batch": 0}
    infer = worker.infer_batch

    def counted_infer(data: object) -> object:
        calls["infer_batch"] += 1
        return infer(data)

    worker.infer_batch = counted_infer

    def td(**extra: object) -> object:
        data = left_right_2_no_padding(
            tu.get_tensordict({k: v.clone() for k, v in batch.items()}, non_tensor_dict={})
        )
        tu.assign_non_tensor(data, temperature=1.0, **extra)
        return data

    def params() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in worker.engine.module[0].named_parameters()}

    res: dict = {"params_before": params(), "logp_old": None}
    train = td(
        calculate_entropy=False,
        global_batch_size=n,
        mini_batch_size=n,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
    )
    if kind == "upstream":
        worker.set_loss_fn(partial(ppo_loss, config=actor_config))
        data = td(calculate_entropy=True, compute_loss=False)
        inferred = worker.infer_batch(data)
        res["logp_old"] = no_padding_2_padding(tu.get(inferred, "log_probs"), data).float()
        train["old_log_probs"] = res["logp_old"].clone()
        # actor/entropy as the trainer computes it from this pass (trainer_base.py:1668, :1675-1686), [b, R] nats
        entropy = no_padding_2_padding(tu.get(inferred, "entropy"), data)
        res["actor/entropy"] = agg_loss(
            loss_mat=entropy,
            loss_mask=batch["response_mask"],
            loss_agg_mode=actor_config.loss_agg_mode,
            loss_scale_factor=actor_config.loss_scale_factor,
        ).item()
    else:
        worker.set_loss_fn(partial(on_policy_ppo_loss, config=actor_config))
        # the switch's trainer sends calculate_entropy (actor.calculate_entropy, set by olp.keep_entropy_metric)
        tu.assign_non_tensor(train, calculate_entropy=True)
    out = worker.train_mini_batch(train)
    res["metrics"] = {
        k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in tu.get(out, "metrics").items()
    }
    if kind == "current":  # the trainer's reduction (trainer_base.py:1860-1863), then the mixin's metric
        step_metrics = reduce_metrics(rename_dict(dict(tu.get(out, "metrics")), "actor/"))
        entropy_metric(step_metrics)
        res["actor/entropy"] = float(step_metrics["actor/entropy"])
    res["params_after"] = params()
    res["infer_calls"] = calls["infer_batch"]
    res["has_old_log_probs"] = "old_log_probs" in train.keys()
    torch.save(res, out_pt)
    torch.distributed.destroy_process_group()
    return 0


def main(out_json: str) -> int:
    import importlib.metadata as md

    import verl

    res = {
        "versions": {p: md.version(p) for p in ("verl", "torch", "tensordict")},
        "verl_file": verl.__file__,
    }
    res["loss"] = {mode: loss_case(mode) for mode in MODES}
    res["skip"] = skip_case()
    Path(out_json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        sys.exit(engine_main(*sys.argv[2:5]))
    sys.exit(main(sys.argv[1]))
