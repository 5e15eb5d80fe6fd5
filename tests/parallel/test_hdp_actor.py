"""HDP in the patched verl Megatron actor (the verl seam's actor hooks, ``qwen3_rl.hdp``), EXECUTED on 4 gloo ranks.

Layout: world 4 = DP 2 x CP 2 (CP groups [0, 1] and [2, 3]), TP = PP = 1. The two DP groups get mini-batches of
very different token totals, so HDP's assignment needs 1 micro-batch on DP group 0 and 4 on DP group 1. On the
MoE actor the expert-parallel all-to-alls span the DP groups: a rank that runs fewer micro-batches leaves the
others waiting in an all-to-all (a hang on the cluster). The model here stands in for that with a world-wide
``all_gather`` in every forward that checks all ranks are at the same (phase, micro-batch).

Executed: the patched ``MegatronPPOActor.__init__`` (HDP runtime built from a Megatron-like ``mpu`` over real gloo
groups), ``compute_log_prob`` and ``update_policy`` -> ``forward_backward_batch`` (HDP branch) -> the patched mcore
``model_forward`` (HDP pack/unpack, sub-group gathers). Stand-ins: Megatron's no-pipelining schedule (loss x CP /
micro-batches, megatron/core/pipeline_parallel/schedules.py:286-299), DDP (gradient mean over DP x CP) + SGD,
single-rank vocab-parallel log-probs. Checked against a single-process reference computed from the formulas:
log-probs of every row, and the update = SGD step on the mean over DP groups of the gradient of each group's
token-mean policy loss.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen3_rl.parallel.hdp import assign_hdp

from conftest import free_port

WORLD, CP = 4, 2
CP_GROUPS = [[0, 1], [2, 3]]
PROMPT, RESP, VOCAB, HIDDEN = 4, 12, 32, 8  # VOCAB > PROMPT + RESP: verl labels hold position ids
BUDGET = 12  # HDP tokens per rank per micro-batch
LR = 0.5
# per DP group: (prompt length, response length) of each row; DP group 0 short, DP group 1 long
ROWS = {0: [(2, 2), (3, 1), (2, 3), (4, 2)], 1: [(4, 12), (3, 11), (4, 12), (2, 10)]}
ADV = {0: [1.0, -1.0, 0.5, -0.5], 1: [-0.5, 1.0, -1.0, 0.25]}


class Tiny(torch.nn.Module):
    """Position-wise LM (embedding -> tanh -> vocab): a token's logits depend on that token only, so any split of
    a sequence over CP ranks gives the same per-token outputs."""

    pre_process = True
    post_process = True

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)
        self.ep_check = None  # callable run in every forward (the EP all-to-all stand-in), set per rank

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None, packed_seq_params=None,
                **_: object) -> torch.Tensor:  # [1, T] -> [1, T, V]
        if self.ep_check is not None:
            self.ep_check()
        return self.out(torch.tanh(self.emb(input_ids)))

    def zero_grad_buffer(self) -> None:
        self.zero_grad(set_to_none=True)


def make_batch(dp: int) -> dict[str, torch.Tensor]:
    """verl's layout: prompt left-padded to PROMPT, response right-padded to RESP."""
    g = torch.Generator().manual_seed(10 + dp)
    n = len(ROWS[dp])
    ids = torch.zeros(n, PROMPT + RESP, dtype=torch.long)
    attn = torch.zeros(n, PROMPT + RESP, dtype=torch.long)
    for i, (p, r) in enumerate(ROWS[dp]):
        ids[i, PROMPT - p:PROMPT + r] = torch.randint(1, VOCAB, (p + r,), generator=g)
        attn[i, PROMPT - p:PROMPT + r] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    adv = torch.tensor(ADV[dp]).unsqueeze(-1).expand(n, RESP).contiguous()
    return {"input_ids": ids, "attention_mask": attn, "responses": ids[:, PROMPT:].clone(), "position_ids": pos,
            "response_mask": attn[:, PROMPT:].clone(), "advantages": adv}


def reference_log_probs(model: Tiny, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """[n, RESP]: response token j scored by the logits of position PROMPT - 1 + j, zero where that position is
    padding (verl's label_mask)."""
    src = b["input_ids"][:, PROMPT - 1:-1]
    lp = torch.log_softmax(model(src), -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    return lp * b["attention_mask"][:, PROMPT - 1:-1]


def reference_update() -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """Parameters after one SGD step on mean_dp(grad of the DP group's token-mean of -A * log-prob) (the PPO loss
    at ratio 1, where its gradient is -A * grad log-prob), and each DP group's log-probs."""
    model = Tiny()
    lps = {}
    loss = torch.zeros(())
    for dp in ROWS:
        b = make_batch(dp)
        lp = reference_log_probs(model, b)
        lps[dp] = lp.detach()
        mask = b["response_mask"].float()
        loss = loss + (-b["advantages"] * lp * mask).sum() / mask.sum() / len(ROWS)
    loss.backward()
    with torch.no_grad():
        params = {k: (p - LR * p.grad).clone() for k, p in model.named_parameters()}
    return params, lps


# ---------------------------------------------------------------------------------------------- one rank
class _Mpu:
    """The ``megatron.core.parallel_state`` calls the actor and HDP make, over real gloo groups."""

    def __init__(self, rank: int, cp_group, pp_group) -> None:
        self.rank, self.cp_group, self.pp_group = rank, cp_group, pp_group
        self.cp_ranks = CP_GROUPS[rank // CP]

    def get_context_parallel_global_ranks(self):
        return list(self.cp_ranks)

    def get_context_parallel_rank(self) -> int:
        return self.cp_ranks.index(self.rank)

    def get_context_parallel_world_size(self) -> int:
        return CP

    def get_context_parallel_group(self):
        return self.cp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return 1

    def get_virtual_pipeline_model_parallel_world_size(self):
        return None

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_last_rank(self) -> int:
        return self.rank

    def get_pipeline_model_parallel_group(self):
        return self.pp_group

    def is_pipeline_last_stage(self, ignore_virtual: bool = True) -> bool:
        return True


class _DdpSgd:
    """Megatron DDP (gradient mean over the DP x CP ranks) + plain SGD."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self):
        import torch.distributed as dist

        for p in self.model.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            with torch.no_grad():
                p -= LR * g / dist.get_world_size()
        return True, 0.0, 0


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        import verl.models.mcore as mcore
        import verl.workers.actor.megatron_actor as ma
        from omegaconf import OmegaConf
        from verl import DataProto
        from verl.models.mcore.model_forward import model_forward_gen

        cp_groups = [dist.new_group(g) for g in CP_GROUPS]
        pp_groups = [dist.new_group([r]) for r in range(WORLD)]
        mpu = _Mpu(rank, cp_groups[rank // CP], pp_groups[rank])
        made: list[tuple[int, ...]] = []
        real_new_group = dist.new_group

        def new_group(ranks, *a, **k):
            made.append(tuple(ranks))
            return real_new_group(ranks, *a, **k)

        phase = {"name": 0, "calls": 0, "per_phase": {}}

        def ep_check() -> None:  # the EP all-to-all of one micro-batch: every rank must be at the same one
            me = torch.tensor([phase["name"], phase["calls"]])
            got = [torch.zeros(2, dtype=torch.long) for _ in range(WORLD)]
            dist.all_gather(got, me)
            if any(not torch.equal(g, me) for g in got):
                raise RuntimeError(f"EP all-to-all mismatch on rank {rank}: (phase, micro-batch) "
                                   f"{[tuple(g.tolist()) for g in got]}")
            phase["calls"] += 1
            phase["per_phase"][phase["name"]] = phase["calls"]

        def schedule(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                     forward_only):
            store = []
            for _ in range(num_microbatches):
                output, loss_func = forward_step_func(data_iterator, model[0])
                loss, reduced = loss_func(output)
                if not forward_only:
                    (loss * CP / num_microbatches).backward()
                store.append(reduced)
            return store

        def log_probs_from_logits(logits, labels):
            return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

        ma.mpu = mpu
        ma.get_forward_backward_func = lambda: schedule
        ma.get_model_config = lambda module: SimpleNamespace()
        ma.vocab_parallel_log_probs_from_logits = log_probs_from_logits
        mcore.get_mcore_forward_fn = lambda hf_config: model_forward_gen(False)
        if not hasattr(torch.cpu, "empty_cache"):
            torch.cpu.empty_cache = lambda: None  # verl calls get_torch_device().empty_cache() after each pass
        dist.new_group = new_group
        model = Tiny()
        model.ep_check = ep_check
        config = OmegaConf.create({
            "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 1, "data_loader_seed": 0,
            "shuffle": False, "use_kl_loss": False, "entropy_coeff": 0.0, "clip_ratio": 0.2, "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean",
            "policy_loss": {"loss_mode": "vanilla"}, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 16,
            "megatron": {"tensor_model_parallel_size": 1, "context_parallel_size": CP}, "profiler": {},
            "qwen3_rl": {"hdp": {"enable": True, "token_budget": BUDGET}}})
        actor = ma.MegatronPPOActor(config, None, None, SimpleNamespace(sequence_parallel=False), [model],
                                    _DdpSgd(model))
        out["new_groups"] = list(made)
        # a second runtime (e.g. another actor) reuses the groups; the whole-CP block is Megatron's CP group
        from qwen3_rl.parallel.hdp_runtime import HDPConfig, HDPRuntime

        again = HDPRuntime.from_megatron(HDPConfig(enable=True), mpu, 16)
        dist.new_group = real_new_group
        out["new_groups_again"] = made[len(out["new_groups"]):]
        out["full_block_is_cp_group"] = actor.qwen3_rl_hooks.hdp.process_groups.group(0, CP) is mpu.cp_group
        out["same_groups"] = again.process_groups is actor.qwen3_rl_hooks.hdp.process_groups

        batch = make_batch(rank // CP)  # verl dispatches by DP: both CP ranks of a group hold the same rows
        data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0, "use_dynamic_bsz": True,
                                                             "max_token_len": 16})
        phase["name"], phase["calls"] = 1, 0
        log_probs, _ = actor.compute_log_prob(data)
        out["log_probs"] = log_probs.tolist()
        data.batch["old_log_probs"] = log_probs
        data.meta_info = {"temperature": 1.0}
        phase["name"], phase["calls"] = 2, 0
        metrics = actor.update_policy(actor.make_minibatch_iterator(data))
        out["pg_loss_stats"] = len(metrics["actor/pg_loss"])
        out["micro_batches"] = dict(phase["per_phase"])
        out["params"] = {k: p.detach().tolist() for k, p in model.named_parameters()}
    except BaseException:  # noqa: BLE001 - report to the parent instead of hanging it
        out["error"] = traceback.format_exc(limit=6)
    results[rank] = out
    os._exit(0)  # no interpreter teardown (gloo threads)


def run_ranks() -> dict[int, dict]:
    import torch.multiprocessing as mp

    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        ctx = mp.start_processes(_rank_main, args=(port, results), nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + 300
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                pytest.fail(f"gloo ranks did not finish within 300 s (hang); reported: {dict(results)}")
        return dict(results)


def test_unequal_dp_groups_run_the_same_micro_batches(patched_imports: Path) -> None:
    # the patched modules are imported here from the patched tree; the spawned ranks import them from the same
    # sys.path (spawn, not fork: a fork copies locks that threads of earlier tests in this process may hold)
    import verl.models.mcore.model_forward  # noqa: F401
    import verl.workers.actor.megatron_actor as ma

    assert Path(ma.__file__).is_relative_to(patched_imports)
    # precondition: HDP's own micro-batch counts differ between the DP groups (1 vs 4: three sequences need both
    # ranks (16 and 14 tokens > the budget 12, 8 tokens per rank each), the 12-token one fits next to none of them)
    own = {dp: assign_hdp([p + r for p, r in ROWS[dp]], CP, BUDGET).num_micro_batches for dp in ROWS}
    assert own == {0: 1, 1: 4}
    res = run_ranks()
    assert sorted(res) == list(range(WORLD))
    for rank, out in res.items():
        assert "error" not in out, f"rank {rank}:\n{out['error']}"
    params, ref_lps = reference_update()
    for rank, out in res.items():
        # HDP sub-groups: blocks of 1 rank only (CP 2: the block of 2 is Megatron's CP group), made once
        assert out["new_groups"] == [(0,), (1,), (2,), (3,)], (rank, out["new_groups"])
        assert out["new_groups_again"] == [] and out["same_groups"] and out["full_block_is_cp_group"], rank
        # every rank ran the world-wide maximum, in compute_log_prob (phase 1) and in the update (phase 2)
        assert out["micro_batches"] == {1: 4, 2: 4}, (rank, out["micro_batches"])
        # statistics only from the micro-batches in which the rank runs a sequence (not from filler-only ones)
        a = assign_hdp([p + r for p, r in ROWS[rank // CP]], CP, BUDGET)
        busy = {p.micro_batch for p in a.placements if rank % CP in p.ranks}
        assert out["pg_loss_stats"] == len(busy), (rank, out["pg_loss_stats"], busy)
        assert torch.allclose(torch.tensor(out["log_probs"]), ref_lps[rank // CP], atol=1e-6), rank
        for k, want in params.items():
            assert torch.allclose(torch.tensor(out["params"][k]), want, atol=1e-6), (rank, k)


def test_plan_pads_to_the_synced_count_with_filler_micro_batches() -> None:
    """Single process: ``plan`` with a count sync of 3 on an assignment of 1 micro-batch gives 2 filler-only
    micro-batches (loss scale 0) and scales the real one by the padded count."""
    from qwen3_rl.parallel.hdp_runtime import HDPConfig, HDPRuntime

    seen = []

    def sync(n: int) -> int:
        seen.append(n)
        return 3

    rt = HDPRuntime(HDPConfig(enable=True), 0, 2, 1, 64, sync_num_micro_batches=sync)
    am = torch.zeros(2, 8, dtype=torch.bool)
    am[0, :5] = am[1, :6] = True
    loss_mask = am[:, 2:].long()  # 3 + 4 loss tokens
    step = rt.plan(am, loss_mask)
    assert seen == [1] and len(step.micro_batches) == 3
    real, *pad = step.micro_batches
    assert not real.is_filler and all(mb.is_filler and mb.loss_scale == 0.0 for mb in pad)
    assert [mb.num_micro_batches for mb in step.micro_batches] == [3, 3, 3]
    # rank 0's tokens over the CP group's tokens, times Megatron's 1/M undone with the padded M = 3
    own = sum(loss_mask[i].sum().item() for i in real.seq_indices)
    assert real.loss_scale == pytest.approx(own * 3 / 7)
    with pytest.raises(ValueError, match="num_micro_batches 0 < the assignment's 1"):
        from qwen3_rl.parallel.hdp_wiring import plan_micro_batches

        plan_micro_batches(step.assignment, 0, num_micro_batches=0)
