"""On-policy update without the old-log-prob pass (verl seam ``qwen3_rl.old_log_prob``, ``qwen3_rl.trainer.old_log_prob``).

* the on-policy check and its error on configs;
* the patched Megatron actor's ``update_policy`` / ``compute_log_prob`` EXECUTED on CPU with a tiny
  model (Megatron's pipeline schedule, the TP collectives and the mcore forward replaced by single-rank
  stand-ins): switch on without ``old_log_probs`` gives the same parameter update as upstream with the
  recomputed ``old_log_probs``, and reports ``actor/entropy`` (computed without autograd);
* the patched GRPO ``RayPPOTrainer.fit`` and our DAPO trainer driven with fake worker groups:
  ``compute_log_prob`` is not called for old_log_prob when on (the ref log-prob still is), is called
  when off, and the trainer refuses an off-policy config.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from qwen3_rl.trainer.old_log_prob import (
    OldLogProbConfigError,
    check_on_policy,
    check_single_update,
    old_log_prob_for_loss,
    on_policy_problems,
    policy_loss_with_entropy,
    training_entropy,
)

PROMPT_LEN, RESP_LEN, VOCAB = 3, 4, 11


def _trainer_cfg(switch: object = True, **actor: object) -> OmegaConf:
    base = {
        "qwen3_rl": {"old_log_prob": {"enable": switch}},
        "data": {"train_batch_size": 8},
        "algorithm": {"use_kl_in_reward": False,
                      "rollout_correction": {"bypass_mode": False, "rollout_is": None, "rollout_rs": None,
                                             "rollout_token_veto_threshold": None}},
        "actor_rollout_ref": {"actor": {"strategy": "megatron", "ppo_epochs": 1, "ppo_mini_batch_size": 8},
                              "rollout": {"temperature": 0.9}},
    }
    cfg = OmegaConf.create(base)
    cfg.actor_rollout_ref.actor.merge_with(actor)
    return cfg


# ---- pure logic ----------------------------------------------------------------------------------
def test_check_on_policy_accepts_and_refuses() -> None:
    assert check_on_policy(_trainer_cfg()) is True
    assert check_on_policy(_trainer_cfg(False, ppo_epochs=4)) is False  # off: no check
    assert check_on_policy(_trainer_cfg(None)) is False
    with pytest.raises(OldLogProbConfigError, match="ppo_epochs=2"):
        check_on_policy(_trainer_cfg(ppo_epochs=2))
    with pytest.raises(OldLogProbConfigError, match=r"ppo_mini_batch_size=2 != data.train_batch_size=8 \(4 optim"):
        check_on_policy(_trainer_cfg(ppo_mini_batch_size=2))
    with pytest.raises(OldLogProbConfigError, match="strategy='fsdp'"):
        check_on_policy(_trainer_cfg(strategy="fsdp"))
    with pytest.raises(OldLogProbConfigError, match="must be true or false"):
        check_on_policy(_trainer_cfg("yes"))
    cfg = _trainer_cfg(ppo_epochs=2, ppo_mini_batch_size=4)
    cfg.algorithm.rollout_correction.bypass_mode = True
    cfg.algorithm.rollout_correction.rollout_is = "token"
    cfg.algorithm.use_kl_in_reward = True
    problems = on_policy_problems(cfg)
    assert len(problems) == 5  # every violation is listed, not just the first
    with pytest.raises(OldLogProbConfigError) as err:
        check_on_policy(cfg)
    for key in ("ppo_epochs", "ppo_mini_batch_size", "bypass_mode", "rollout_is", "use_kl_in_reward"):
        assert key in str(err.value)


def test_check_single_update() -> None:
    check_single_update(16, 16, 1)
    with pytest.raises(OldLogProbConfigError, match="32 rows, mini-batch 16 rows, 1 epochs"):
        check_single_update(32, 16, 1)
    with pytest.raises(OldLogProbConfigError, match="2 epochs"):
        check_single_update(16, 16, 2)


def test_old_log_prob_and_entropy_helpers() -> None:
    lp = torch.randn(2, 3, requires_grad=True)
    old = old_log_prob_for_loss(lp, {}, True)
    assert torch.equal(old, lp) and not old.requires_grad
    stored = torch.zeros(2, 3)
    assert old_log_prob_for_loss(lp, {"old_log_probs": stored}, False) is stored
    with pytest.raises(KeyError):
        old_log_prob_for_loss(lp, {}, False)  # upstream behaviour kept: the key is required when off
    assert training_entropy(0.0, False) == training_entropy(0, False)
    off, on0, on1 = training_entropy(0.0, False), training_entropy(0.0, True), training_entropy(0.01, True)
    assert (off.calculate, on0.calculate, on0.in_loss, on0.detached, on1.in_loss, on1.detached) == (
        False, True, False, True, True, False)
    pg, ent = torch.tensor(2.0, requires_grad=True), torch.tensor(0.5, requires_grad=True)
    stats: dict = {}
    assert policy_loss_with_entropy(pg, ent, 0.0, on0, stats) is pg and stats == {"actor/entropy": 0.5}
    loss = policy_loss_with_entropy(pg, ent, 0.1, on1, stats)
    loss.backward()
    assert loss.item() == pytest.approx(1.95) and ent.grad.item() == pytest.approx(-0.1)


# ---- the patched Megatron actor, executed ------------------------------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, V]
        return self.out(torch.tanh(self.emb(input_ids)))

    def zero_grad_buffer(self) -> None:
        self.zero_grad(set_to_none=True)


class _SGD:
    def __init__(self, model: torch.nn.Module, lr: float = 0.5) -> None:
        self.model, self.lr = model, lr

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads)).item()
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p -= self.lr * p.grad
        return True, norm, 0


class _Mpu:
    def get_pipeline_model_parallel_last_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_group(self):
        return None

    def get_virtual_pipeline_model_parallel_world_size(self):
        return None

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def is_pipeline_last_stage(self, ignore_virtual: bool = True) -> bool:
        return True


@pytest.fixture
def megatron_actor(patched_imports, monkeypatch):
    """The patched ``verl.workers.actor.megatron_actor`` with single-rank stand-ins for Megatron's
    schedule, pipeline/TP state and collectives; records whether entropy was computed under autograd."""
    import verl.models.mcore as mcore
    import verl.workers.actor.megatron_actor as ma

    grad_modes: list[bool] = []

    def entropy(logits: torch.Tensor) -> torch.Tensor:  # [B, S, V] -> [B, S] nats
        grad_modes.append(torch.is_grad_enabled())
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(logp.exp() * logp).sum(-1)

    def log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    def forward_fn(model, input_ids, attention_mask, position_ids, multi_modal_inputs, logits_processor,
                   logits_processor_args, **_):
        return logits_processor(model(input_ids), **logits_processor_args)

    def schedule(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 forward_only):
        out = []
        for _ in range(num_microbatches):
            output, loss_fn = forward_step_func(data_iterator, model[0])
            loss, stats = loss_fn(output)
            if not forward_only:
                (loss / num_microbatches).backward()  # Megatron scales each micro-batch loss by 1/n
            out.append(stats)
        return out

    monkeypatch.setattr(ma, "mpu", _Mpu())
    monkeypatch.setattr(ma, "broadcast_dict_tensor", lambda *a, **k: None)
    monkeypatch.setattr(ma, "get_forward_backward_func", lambda: schedule)
    monkeypatch.setattr(ma, "vocab_parallel_entropy", entropy)
    monkeypatch.setattr(ma, "vocab_parallel_log_probs_from_logits", log_probs)
    monkeypatch.setattr(mcore, "get_mcore_forward_fn", lambda hf_config: forward_fn)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: None)
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)  # verl calls it after each pass
    return ma, grad_modes


def _flat(values: list) -> list[float]:
    return [float(x) for v in values for x in (v if isinstance(v, list) else [v])]


def _actor(ma, model: torch.nn.Module, switch: bool, entropy_coeff: float = 0.0, mini: int = 4):
    actor = ma.MegatronPPOActor.__new__(ma.MegatronPPOActor)
    actor.config = OmegaConf.create({
        "ppo_mini_batch_size": mini, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1, "data_loader_seed": 0,
        "shuffle": False, "use_kl_loss": False, "entropy_coeff": entropy_coeff, "clip_ratio": 0.2,
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean",
        "policy_loss": {"loss_mode": "vanilla"}, "use_dynamic_bsz": False,
        "megatron": {"context_parallel_size": 1}, "qwen3_rl": {"old_log_prob": {"enable": switch}}})
    actor.qwen3_rl_hooks = ma.actor_hooks(actor.config)  # what __init__ builds; None when off
    assert (actor.qwen3_rl_hooks is None) is (not switch)
    actor.actor_module = [model]
    actor.actor_optimizer = _SGD(model)
    actor.use_torch_profiler, actor.prof, actor.use_fused_kernels, actor.hf_config = False, None, False, None
    return actor


def _batch(rows: int = 4):
    from verl import DataProto

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, PROMPT_LEN + RESP_LEN), generator=g)
    attn = torch.ones_like(ids)
    attn[1, -2:] = 0  # a shorter response
    resp_mask = attn[:, -RESP_LEN:].clone()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).repeat_interleave(rows // 4).unsqueeze(-1).expand(rows, RESP_LEN)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": attn, "responses": ids[:, -RESP_LEN:].clone(),
                 "position_ids": torch.arange(ids.shape[1]).expand(rows, -1).clone(), "response_mask": resp_mask,
                 "advantages": adv.contiguous()},
        meta_info={"temperature": 0.9})


def test_megatron_actor_switch_same_update_and_entropy(megatron_actor) -> None:
    from verl.trainer.ppo.core_algos import agg_loss

    ma, grad_modes = megatron_actor
    base = _Tiny()
    # upstream: old_log_probs (and the entropy metric) from compute_log_prob, then update_policy
    m_off = copy.deepcopy(base)
    off = _actor(ma, m_off, switch=False)
    batch_off = _batch()
    probe = batch_off.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids", "response_mask"])
    probe.meta_info = {"micro_batch_size": 4, "temperature": 0.9}  # own dict: select() shares meta_info
    old, ent = off.compute_log_prob(probe, calculate_entropy=True)
    batch_off.batch["old_log_probs"] = old
    grad_modes.clear()
    met_off = off.update_policy(off.make_minibatch_iterator(batch_off))
    assert grad_modes == [] and "actor/entropy" not in met_off  # coeff 0: no entropy in the update upstream

    # switch on: no old_log_probs in the batch at all
    m_on = copy.deepcopy(base)
    on = _actor(ma, m_on, switch=True)
    batch_on = _batch()
    assert "old_log_probs" not in batch_on.batch.keys()
    met_on = on.update_policy(on.make_minibatch_iterator(batch_on))
    for p_off, p_on in zip(m_off.parameters(), m_on.parameters(), strict=True):
        assert torch.allclose(p_off, p_on, atol=1e-6)  # identical update
    assert not torch.allclose(next(base.parameters()), next(m_on.parameters()))  # it did update
    # per micro-batch metric lists (verl nests each micro-batch's values: [[v0], [v1]])
    assert _flat(met_on["actor/pg_clipfrac"]) == [0.0, 0.0] and _flat(met_on["actor/ppo_kl"]) == [0.0, 0.0]
    assert _flat(met_on["actor/pg_loss"]) == pytest.approx(_flat(met_off["actor/pg_loss"]), abs=1e-6)
    # actor/entropy from the training forward, per micro-batch, = the skipped pass's numbers
    mask = batch_on.batch["response_mask"]
    expected = [agg_loss(ent[i:i + 2], mask[i:i + 2], "token-mean").item() for i in (0, 2)]
    assert _flat(met_on["actor/entropy"]) == pytest.approx(expected, abs=1e-5)
    assert grad_modes == [False, False]  # metric only: computed without autograd


def test_megatron_actor_switch_with_entropy_bonus_and_guard(megatron_actor) -> None:
    ma, grad_modes = megatron_actor
    base = _Tiny()
    m_off, m_on = copy.deepcopy(base), copy.deepcopy(base)
    off, on = _actor(ma, m_off, False, entropy_coeff=0.05), _actor(ma, m_on, True, entropy_coeff=0.05)
    b_off = _batch()
    probe = b_off.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids", "response_mask"])
    probe.meta_info = {"micro_batch_size": 4, "temperature": 0.9}
    b_off.batch["old_log_probs"] = off.compute_log_prob(probe)[0]
    off.update_policy(off.make_minibatch_iterator(b_off))
    grad_modes.clear()
    met_on = on.update_policy(on.make_minibatch_iterator(_batch()))
    assert grad_modes == [True, True]  # in the loss: with autograd
    assert len(_flat(met_on["actor/entropy"])) == 2
    for p_off, p_on in zip(m_off.parameters(), m_on.parameters(), strict=True):
        assert torch.allclose(p_off, p_on, atol=1e-6)
    # a rank holding two mini-batches is refused before any step
    two = _actor(ma, copy.deepcopy(base), True, mini=2)
    with pytest.raises(OldLogProbConfigError, match="4 rows, mini-batch 2 rows"):
        two.make_minibatch_iterator(_batch())


# ---- the patched GRPO trainer's fit and our DAPO trainer, with fake worker groups -----------------
class _FakeActorWG:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.update_batches: list = []

    def generate_sequences(self, gen_batch):
        from verl import DataProto

        self.calls.append("generate_sequences")
        n = len(gen_batch)
        prompts = gen_batch.batch["input_ids"]
        return DataProto.from_dict(
            tensors={"responses": torch.ones(n, RESP_LEN, dtype=torch.long), "prompts": prompts,
                     "input_ids": torch.cat([prompts, torch.ones(n, RESP_LEN, dtype=torch.long)], -1),
                     "attention_mask": torch.ones(n, prompts.shape[1] + RESP_LEN, dtype=torch.long),
                     "position_ids": torch.arange(prompts.shape[1] + RESP_LEN).expand(n, -1).clone()},
            meta_info={"timing": {"generate_sequences": 0.01}})

    def compute_log_prob(self, batch):
        from verl import DataProto

        self.calls.append("compute_log_prob")
        n = len(batch)
        return DataProto.from_dict(tensors={"old_log_probs": torch.full((n, RESP_LEN), -1.0),
                                            "entropys": torch.full((n, RESP_LEN), 0.7)},
                                   meta_info={"temperature": 0.9})

    def compute_ref_log_prob(self, batch):
        from verl import DataProto

        self.calls.append("compute_ref_log_prob")
        return DataProto.from_dict(tensors={"ref_log_prob": torch.full((len(batch), RESP_LEN), -1.1)})

    def update_actor(self, batch):
        from verl import DataProto

        self.calls.append("update_actor")
        self.update_batches.append(batch)
        return DataProto(meta_info={"metrics": {"actor/pg_loss": [0.1], "actor/entropy": [0.6]}})

    def load_checkpoint(self, *_a, **_k):
        return None


class _Loader(list):
    sampler = None


def _reward_fn(data, return_dict=False):
    r = torch.zeros(len(data), RESP_LEN)
    r[::2, -1] = 1.0
    return {"reward_tensor": r, "reward_extra_info": {}}


def _grpo_config(switch: bool, mini: int = 2):
    from pathlib import Path

    import verl

    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
    over = OmegaConf.create({
        "data": {"train_batch_size": 2},
        "algorithm": {"adv_estimator": "grpo"},
        "qwen3_rl": {"old_log_prob": {"enable": switch}},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini, "use_kl_loss": True},
                              "rollout": {"n": 2, "temperature": 0.9}},
        "trainer": {"project_name": "p", "experiment_name": "e", "logger": ["console"], "resume_mode": "disable",
                    "val_before_train": False, "total_epochs": 1, "test_freq": -1, "save_freq": -1,
                    "balance_batch": False, "critic_warmup": 0, "rollout_data_dir": None},
    })
    return OmegaConf.merge(cfg, over)


def _trainer(cls, config, wg):
    from verl.utils.qwen3_rl_hooks import trainer_hooks

    t = cls.__new__(cls)
    t.config = config
    t.qwen3_rl_hooks = trainer_hooks(config)  # what RayPPOTrainer.__init__ builds (validates the group)
    t.actor_rollout_wg, t.async_rollout_mode, t.use_rm, t.use_critic = wg, False, False, False
    t.use_reference_policy, t.ref_in_actor = True, True
    t.reward_fn, t.val_reward_fn = _reward_fn, None
    t.total_training_steps = 1

    class _Pool:
        def get_n_gpus(self) -> int:
            return 1

    t.resource_pool_manager = _Pool()
    t.train_dataloader = _Loader([{
        "input_ids": torch.tensor([[1, 2], [3, 4]]), "attention_mask": torch.ones(2, 2, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1], [0, 1]]), "data_source": np.array(["t", "t"], dtype=object)}])
    return t


def test_grpo_fit_skips_old_log_prob_only_when_on(patched_imports) -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    wg_on = _FakeActorWG()
    _trainer(RayPPOTrainer, _grpo_config(True), wg_on).fit()
    assert wg_on.calls == ["generate_sequences", "compute_ref_log_prob", "update_actor"]
    sent = wg_on.update_batches[0]
    assert "old_log_probs" not in sent.batch.keys() and "ref_log_prob" in sent.batch.keys()
    assert sent.meta_info["temperature"] == 0.9  # what compute_log_prob's output carried upstream

    wg_off = _FakeActorWG()
    _trainer(RayPPOTrainer, _grpo_config(False), wg_off).fit()
    assert wg_off.calls == ["generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor"]
    assert "old_log_probs" in wg_off.update_batches[0].batch.keys()

    wg_bad = _FakeActorWG()
    with pytest.raises(OldLogProbConfigError, match=r"ppo_mini_batch_size=1 != data.train_batch_size=2"):
        _trainer(RayPPOTrainer, _grpo_config(True, mini=1), wg_bad).fit()  # refused when the hooks are built
    assert "update_actor" not in wg_bad.calls and "compute_log_prob" not in wg_bad.calls


def test_grpo_trainer_init_refuses_off_policy(patched_imports) -> None:
    """The check runs in RayPPOTrainer.__init__, before any worker is created."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import Role

    with pytest.raises(OldLogProbConfigError, match="ppo_mini_batch_size=1"):
        RayPPOTrainer(_grpo_config(True, mini=1), tokenizer=None, role_worker_mapping={Role.ActorRollout: object},
                      resource_pool_manager=None)


def test_dapo_hook_skips_old_log_prob(patched_imports) -> None:
    from qwen3_rl.trainer.dapo import make_dapo_trainer_class

    cls = make_dapo_trainer_class()
    for switch, expect in ((True, []), (False, ["compute_log_prob"])):
        wg = _FakeActorWG()
        t = _trainer(cls, _grpo_config(switch), wg)
        batch = _batch()
        metrics: dict = {}
        out = t._compute_old_log_prob(batch, metrics, {})
        assert wg.calls == expect
        if switch:
            assert out.meta_info["temperature"] == 0.9 and "old_log_probs" not in out.batch.keys()
            assert metrics == {}  # actor/entropy will come from update_actor
        else:
            assert "old_log_probs" in out.batch.keys() and metrics["actor/entropy"] == pytest.approx(0.7)
    with pytest.raises(OldLogProbConfigError):
        _trainer(cls, _grpo_config(True, mini=1), _FakeActorWG())
