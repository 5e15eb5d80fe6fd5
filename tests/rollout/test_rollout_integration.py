"""Rollout balancing wired into the trainers and the engine loop.

* data rebalance: verl patch 0013 drives RayPPOTrainer.fit (GRPO, with validation and balance_batch) and
  our DAPO trainer (filter_groups, two generation batches) on the patched verl on CPU with fake worker
  groups: the batch reaches ``generate_sequences`` dealt over the rollout DP pieces and comes back in
  dataset order with each response and reward on its prompt's row; uneven / async errors; Hydra keys.
* rollout rebalance: ``qwen3_rl.rollout.migration`` across 3 CPU processes (torch.distributed gloo):
  requests migrate with their KV blocks, sampling params and generator state; nothing lost or
  duplicated; a peer that never shows up gives a clear timeout error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
RESP_LEN = 4
PROMPT_LEN = 2


# ---------------------------------------------------------------------------------------------------
# fakes: a rollout worker group that dispatches like verl (contiguous DP pieces) and records them
# ---------------------------------------------------------------------------------------------------
class _FakeActorRolloutWG:
    """``actor_rollout_wg`` stand-in: ``world_size`` workers, rollout mesh DP rank ``r // tp``.

    ``generate_sequences`` chunks the batch like verl's nd dispatch (``DataProto.chunk(dp)``) and answers
    each row with ``responses = [pid, piece, received_row, 1]`` where ``pid`` is read from the prompt.
    Response lengths (attention mask) vary with the pid so ``balance_batch`` really reorders.
    """

    def __init__(self, world_size: int = 8, tp: int = 2) -> None:
        self.world_size = world_size
        self._dispatch_info: dict = {}
        self.mesh = [r // tp for r in range(world_size)]
        self.queries = 0
        self.received: list[list[int]] = []  # pid of each row, in the order generate_sequences got them
        self.pieces: list[list[list[int]]] = []  # per call: pids of each DP piece
        self.updated: list = []

    def _query_dispatch_info(self, mesh_name: str) -> list[int]:
        assert mesh_name == "rollout"
        self.queries += 1
        return list(self.mesh)

    def generate_sequences(self, batch):
        import torch
        from verl import DataProto

        dp = max(self.mesh) + 1
        pids = batch.batch["input_ids"][:, 0].tolist()
        self.received.append(pids)
        outs, pieces, row = [], [], 0
        for piece, chunk in enumerate(batch.chunk(dp)):  # what verl's dispatch does
            n = len(chunk)
            cp = chunk.batch["input_ids"][:, 0]
            pieces.append(cp.tolist())
            resp = torch.stack([cp, torch.full((n,), piece), torch.arange(row, row + n), torch.ones(n, dtype=torch.long)],
                               dim=1)
            valid = (cp % 3 + 1).unsqueeze(1)  # 1..3 response tokens valid
            mask = torch.cat([torch.ones(n, PROMPT_LEN, dtype=torch.long),
                              (torch.arange(RESP_LEN).unsqueeze(0) < valid).long()], dim=1)
            outs.append(DataProto.from_dict(tensors={"responses": resp, "prompts": chunk.batch["input_ids"],
                                                     "attention_mask": mask}))
            row += n
        self.pieces.append(pieces)
        out = DataProto.concat(outs)
        out.meta_info["timing"] = {"generate_sequences": 0.01}
        return out

    def compute_log_prob(self, batch):
        import torch
        from verl import DataProto

        z = torch.zeros(len(batch), RESP_LEN)
        return DataProto.from_dict(tensors={"old_log_probs": z, "entropys": z.clone()})

    def update_actor(self, batch):
        from verl import DataProto

        self.updated.append(batch)
        return DataProto(meta_info={"metrics": {"actor/pg_loss": [0.0]}})

    def load_checkpoint(self, *_a, **_k):
        return None


def _reward_from_response(data):
    """Reward depends only on the response: ``pid * 10 + received_row``, so a misattached response
    shows up as a reward that does not match its row's prompt."""
    import torch

    r = torch.zeros(len(data), RESP_LEN)
    r[:, 0] = (data.batch["responses"][:, 0] * 10 + data.batch["responses"][:, 2]).float()
    return r


def _grpo_reward_fn(data, return_dict=False):
    r = _reward_from_response(data)
    return {"reward_tensor": r, "reward_extra_info": {}} if return_dict else r


def _batch_dict(pids: list[int]) -> dict:
    import torch

    return {"input_ids": torch.tensor([[p] * PROMPT_LEN for p in pids]),
            "attention_mask": torch.ones(len(pids), PROMPT_LEN, dtype=torch.long),
            "position_ids": torch.arange(PROMPT_LEN).repeat(len(pids), 1),
            "pid": torch.tensor([[p] for p in pids]),
            "data_source": np.array(["t"] * len(pids), dtype=object)}


class _Loader(list):
    sampler = None


class _Tok:
    eos_token_id, pad_token_id = 0, 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(int(i)) for i in ids)


class _Pool:
    def get_n_gpus(self) -> int:
        return 8


def _verl_config_dir(ws: Path) -> Path:
    return ws / "verl" / "verl" / "trainer" / "config"


def _compose_verl(ws: Path, overrides: list[str], config_name: str = "ppo_megatron_trainer"):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(_verl_config_dir(ws)), version_base=None):
            return compose(config_name=config_name, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _grpo_trainer(ws: Path, *, data_rebalance: bool, n: int, train: list[list[int]], val: list[list[int]] | None,
                  extra: list[str] = ()):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    cfg = _compose_verl(ws, [
        f"+qwen3_rl.data_rebalance.enable={str(data_rebalance).lower()}",
        f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.logger=[console]",
        "trainer.resume_mode=disable", f"trainer.val_before_train={val is not None}", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.total_epochs=1", "trainer.balance_batch=true",
        "algorithm.adv_estimator=grpo", *extra])
    from verl.utils.qwen3_rl_hooks import trainer_hooks

    t = RayPPOTrainer.__new__(RayPPOTrainer)
    t.config = cfg
    t.qwen3_rl_hooks = trainer_hooks(cfg)  # what RayPPOTrainer.__init__ sets (the verl seam)
    t.actor_rollout_wg = _FakeActorRolloutWG()
    t.async_rollout_mode = t.use_rm = t.use_reference_policy = t.use_critic = False
    t.reward_fn = t.val_reward_fn = _grpo_reward_fn
    t.tokenizer = _Tok()
    t.total_training_steps = len(train)
    t.train_dataloader = _Loader(_batch_dict(p) for p in train)
    t.val_dataloader = _Loader(_batch_dict(p) for p in (val or []))
    t.resource_pool_manager = _Pool()
    return t


def _check_trained_rows(batch) -> None:
    """Every row's response and reward belong to its own prompt; groups (uid) hold one prompt each."""
    pid = batch.batch["pid"][:, 0]
    resp = batch.batch["responses"]
    assert resp[:, 0].tolist() == pid.tolist(), "a response sits on another prompt's row"
    expect = (resp[:, 0] * 10 + resp[:, 2]).float()
    assert batch.batch["token_level_scores"][:, 0].tolist() == expect.tolist()
    by_uid: dict[str, set[int]] = {}
    for u, p in zip(batch.non_tensor_batch["uid"], pid.tolist(), strict=True):
        by_uid.setdefault(u, set()).add(p)
    assert all(len(s) == 1 for s in by_uid.values())


def test_grpo_fit_permutes_generation_and_restores_order(patched_imports: Path) -> None:
    """RayPPOTrainer.fit (patched): generation gets the dealt layout, training gets dataset order."""
    pytest.importorskip("tensordict")
    # 4 prompts x n=4 = 16 rows, rollout mesh: 8 workers, TP2 -> 4 DP pieces
    on = _grpo_trainer(patched_imports, data_rebalance=True, n=4, train=[[10, 11, 12, 13]], val=[[20, 21, 22]])
    on.fit()
    wg = on.actor_rollout_wg
    assert wg.queries == 1 and wg._dispatch_info["rollout"] == [0, 0, 1, 1, 2, 2, 3, 3]  # verl's cache filled
    # validation (first call): 3 rows padded to 8 workers (verl repeats the batch cyclically:
    # 20 21 22 20 21 22 20 21), dealt over 4 pieces: piece r gets padded rows r and r + 4
    assert wg.received[0] == [20, 21, 21, 22, 22, 20, 20, 21]
    # training: every DP piece holds one sample of each prompt (off: each piece = one whole prompt)
    assert wg.pieces[1] == [[10, 11, 12, 13]] * 4
    batch = wg.updated[0]
    assert len(batch) == 16
    _check_trained_rows(batch)
    # balance_batch reordered after the restore; restore itself gave dataset order: each prompt's samples
    # carry the rows they were generated at under the dealt layout (pid p, sample k -> row k*4 + p-10)
    pairs = sorted(zip(batch.batch["pid"][:, 0].tolist(), batch.batch["responses"][:, 2].tolist(), strict=True))
    assert pairs == sorted((10 + p, k * 4 + p) for p in range(4) for k in range(4))

    off = _grpo_trainer(patched_imports, data_rebalance=False, n=4, train=[[10, 11, 12, 13]], val=None)
    off.fit()
    assert off.actor_rollout_wg.queries == 0  # switch off: nothing queried, nothing permuted
    assert off.actor_rollout_wg.pieces[0] == [[10] * 4, [11] * 4, [12] * 4, [13] * 4]
    _check_trained_rows(off.actor_rollout_wg.updated[0])


def test_grpo_validation_restores_before_unpad(patched_imports: Path) -> None:
    """_validate (patched): the scores reach the right prompts after pad -> deal -> generate -> restore -> unpad."""
    seen = []

    def val_fn(data, return_dict=False):
        seen.append((data.batch["pid"][:, 0].tolist(), data.batch["responses"][:, 0].tolist()))
        return {"reward_tensor": _reward_from_response(data)}

    t = _grpo_trainer(patched_imports, data_rebalance=True, n=2, train=[], val=[[1, 2, 3, 4, 5], [6, 7, 8]])
    t.val_reward_fn = val_fn
    t.global_steps = 0
    metrics = t._validate()
    assert metrics
    assert seen == [([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]), ([6, 7, 8], [6, 7, 8])]
    assert t.actor_rollout_wg.received[0] == [1, 5, 2, 1, 3, 2, 4, 3]  # 1..5 + pads 1 2 3, dealt over 4


def test_grpo_uneven_batch_and_async_mode_errors(patched_imports: Path) -> None:
    from qwen3_rl.rollout.data_rebalance import DataRebalanceError

    # 3 prompts x n=2 = 6 rows, 4 DP pieces: a clear error before anything is generated
    t = _grpo_trainer(patched_imports, data_rebalance=True, n=2, train=[[1, 2, 3]], val=None)
    with pytest.raises(DataRebalanceError, match="6 rows is not a multiple of the rollout DP size 4"):
        t.fit()
    assert t.actor_rollout_wg.received == []
    t = _grpo_trainer(patched_imports, data_rebalance=True, n=2, train=[[1, 2]], val=None)
    t.async_rollout_mode = True
    with pytest.raises(DataRebalanceError, match="needs the sync rollout"):
        t.fit()


def test_dp_size_derivation(patched_imports: Path) -> None:
    """The DP size comes from verl's dispatch info when the worker group has it, else from the config
    (world / (TP * verl DP * PP), vLLM's own DP in engine_kwargs does not enter)."""
    from qwen3_rl.rollout.data_rebalance import (
        DataRebalanceError,
        rollout_dp_size,
        rollout_dp_size_from_config,
    )

    cfg = OmegaConf.create({"trainer": {"n_gpus_per_node": 16, "nnodes": 8},
                            "actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 4, "data_parallel_size": 1,
                                                              "pipeline_model_parallel_size": 1,
                                                              "engine_kwargs": {"vllm": {"data_parallel_size": 32}}}}})
    assert rollout_dp_size_from_config(cfg) == 32  # 235B: 128 dies / TP4 = vLLM DP32 ranks = 32 pieces
    assert rollout_dp_size(object(), cfg) == 32
    wg = _FakeActorRolloutWG(world_size=8, tp=4)
    assert rollout_dp_size(wg, cfg) == 2 and rollout_dp_size(wg, cfg) == 2 and wg.queries == 1
    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = 3
    with pytest.raises(DataRebalanceError, match="not divisible"):
        rollout_dp_size_from_config(cfg)
    bad = OmegaConf.create({"qwen3_rl": {"data_rebalance": {"enable": "true"}}})
    from qwen3_rl.trainer.seam import SeamConfigError, data_rebalance_enabled

    with pytest.raises(SeamConfigError, match="qwen3_rl.data_rebalance.enable must be bool"):
        data_rebalance_enabled(bad)


# ---- DAPO: two generation batches, filter_groups ----------------------------------------------------
def test_dapo_fit_data_rebalance_with_filter_groups(patched_imports: Path) -> None:
    import torch

    from qwen3_rl.trainer.dapo import make_dapo_trainer_class

    from helpers.dapo_probe import make_probe_trainer

    cls = make_dapo_trainer_class()
    n = 4
    # informative iff a group's rewards differ; reward decided by the response (pid, sample slot)
    informative = {0: False, 1: True, 2: False, 3: True}
    trained = []

    def reward_fn(data, return_dict=False):
        resp = data.batch["responses"]
        # received row = k * 2 + p % 2 for sample k of prompt p: sample parity decides for informative prompts
        acc = [float(informative[int(p)] and (int(row) // 2) % 2 == 0)
               for p, row in zip(resp[:, 0], resp[:, 2], strict=True)]
        r = torch.zeros(len(data), RESP_LEN)
        r[:, -1] = torch.tensor(acc)
        return {"reward_tensor": r, "reward_extra_info": {"acc": acc}}

    wg = _FakeActorRolloutWG(world_size=8, tp=2)  # 4 DP pieces
    t = make_probe_trainer(cls, n=n, resp_len=RESP_LEN, actor_rollout_wg=wg, reward_fn=reward_fn,
                           resource_pool_manager=_Pool(), qwen3_rl={"data_rebalance": {"enable": True}},
                           on_update=trained.append,
                           train_dataloader=[_batch_dict([0, 1]), _batch_dict([2, 3])])  # 1 informative group per batch
    t.fit()
    # each generation batch (2 prompts x 4) dealt over 4 pieces: each piece gets one sample of each prompt
    assert wg.pieces == [[[0, 1]] * 4, [[2, 3]] * 4]
    assert len(trained) == 1
    batch = trained[0]
    assert batch.batch["pid"][:, 0].tolist() == [1] * 4 + [3] * 4  # kept groups, dataset order
    assert batch.batch["responses"][:, 0].tolist() == [1] * 4 + [3] * 4
    # sample k of prompt p was generated at dealt row k*2 + (p % 2) of its generation batch
    assert batch.batch["responses"][:, 2].tolist() == [1, 3, 5, 7] * 2
    assert batch.non_tensor_batch["acc"].tolist() == [1.0, 0.0, 1.0, 0.0] * 2
    assert batch.batch["token_level_scores"][:, -1].tolist() == [1.0, 0.0, 1.0, 0.0] * 2
    assert t.global_steps == 2


# ---------------------------------------------------------------------------------------------------
# rollout rebalance: request migration with KV across CPU processes (gloo)
# ---------------------------------------------------------------------------------------------------
BLOCK = 4  # tokens per KV block in the toy engine


def _kv_value(req_id: str, pos: int, tok: int, layer: int) -> float:
    """KV "content" of one token position: exact in bfloat16 (halves below 128)."""
    h = sum(req_id.encode()) % 97
    return float((h * 31 + pos * 7 + tok) % 120) + 0.5 * layer


def _reference_tokens(seed: int, top_k: int, max_tokens: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(0, top_k, (1,), generator=g)) for _ in range(max_tokens)]


class _ToyReq:
    def __init__(self, rid: str, origin: int, prompt: list[int], params: dict, seed: int) -> None:
        import torch

        self.rid, self.origin, self.prompt, self.params, self.seed = rid, origin, prompt, params, seed
        self.out: list[int] = []
        self.gen = torch.Generator().manual_seed(seed)
        self.blocks: list[int] = []
        self.computed = 0

    def token_at(self, p: int) -> int:
        return self.prompt[p] if p < len(self.prompt) else self.out[p - len(self.prompt)]


class _ToyEngine:
    """A continuous-batching engine with a paged KV cache (two cache layouts), FCFS admission and a
    seeded per-request sampler; it implements the coordinator's EngineHooks."""

    def __init__(self, rank: int, reqs: list[_ToyReq], num_blocks: int, max_num_seqs: int) -> None:
        import torch

        self.rank, self.max_num_seqs, self.num_blocks = rank, max_num_seqs, num_blocks
        self.c0 = torch.zeros(num_blocks, BLOCK, 2, 3)  # block axis 0
        self.c1 = torch.zeros(2, num_blocks, BLOCK, 3, dtype=torch.bfloat16)  # block axis 1
        self.free = list(range(num_blocks))
        self.waiting: list[_ToyReq] = list(reqs)
        self.running: dict[str, _ToyReq] = {}
        self.results: dict[str, list[int]] = {}
        self.finished_remote: list = []
        self.imported: list[tuple[str, dict, int | None, int, int]] = []

    # -- engine ---------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _write_kv(self, r: _ToyReq, p: int) -> None:
        b, off = r.blocks[p // BLOCK], p % BLOCK
        tok = r.token_at(p)
        self.c0[b, off] = _kv_value(r.rid, p, tok, 0)
        self.c1[:, b, off] = _kv_value(r.rid, p, tok, 1)

    def check_kv(self, r: _ToyReq) -> None:
        for p in range(r.computed):
            b, off = r.blocks[p // BLOCK], p % BLOCK
            tok = r.token_at(p)
            assert float(self.c0[b, off, 0, 0]) == _kv_value(r.rid, p, tok, 0), (r.rid, p, "layer 0")
            assert float(self.c1[1, b, off, 2]) == _kv_value(r.rid, p, tok, 1), (r.rid, p, "layer 1")

    def _grow(self, r: _ToyReq, tokens: int) -> None:
        need = -(-tokens // BLOCK) - len(r.blocks)
        assert need <= len(self.free), "toy engine out of KV blocks"
        r.blocks += [self.free.pop() for _ in range(max(0, need))]

    def step(self) -> None:
        from qwen3_rl.rollout.rebalance import blocks_needed

        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            n = len(r.prompt) + len(r.out)
            if blocks_needed(n, BLOCK) > len(self.free):
                break
            self.waiting.pop(0)
            self._grow(r, n + 1)
            for p in range(n):  # prefill (recompute for a request that arrived without KV)
                self._write_kv(r, p)
            r.computed = n
            self.running[r.rid] = r
        for r in list(self.running.values()):
            import torch

            self.check_kv(r)
            r.out.append(int(torch.randint(0, r.params["top_k"], (1,), generator=r.gen)))
            self._grow(r, r.computed + 2)
            self._write_kv(r, r.computed)
            r.computed += 1
            if len(r.out) == r.params["max_tokens"]:
                del self.running[r.rid]
                self.free += r.blocks
                r.blocks = []
                if r.origin == self.rank:
                    assert r.rid not in self.results
                    self.results[r.rid] = list(r.out)
                else:
                    from qwen3_rl.rollout.migration import FinishedRemote

                    self.finished_remote.append(FinishedRemote(r.rid, r.origin, tuple(r.out), "length"))

    # -- EngineHooks ----------------------------------------------------------------------------
    def load_state(self, rank: int):
        from qwen3_rl.rollout.rebalance import RankState, RunningRequest, WaitingRequest

        return RankState(rank, tuple(WaitingRequest(r.rid, len(r.prompt) + len(r.out)) for r in self.waiting),
                         tuple(RunningRequest(r.rid, r.computed, len(r.blocks)) for r in self.running.values()),
                         self.max_num_seqs, self.num_blocks)

    def _find(self, rid: str) -> _ToyReq:
        if rid in self.running:
            return self.running[rid]
        return next(r for r in self.waiting if r.rid == rid)

    def export_request(self, rid: str):
        from qwen3_rl.rollout.migration import RequestState

        r = self._find(rid)
        st = RequestState(rid, r.origin, tuple(r.prompt), tuple(r.out), dict(r.params), r.seed,
                          r.gen.get_state().numpy().tobytes(), r.computed, len(r.blocks), {"sent_by": self.rank})
        return st, list(r.blocks)

    def release_request(self, rid: str) -> None:
        r = self._find(rid)
        self.running.pop(rid, None)
        if r in self.waiting:
            self.waiting.remove(r)
        self.free += r.blocks
        r.blocks = []

    def allocate_blocks(self, state) -> list[int]:
        assert state.num_kv_blocks <= len(self.free)
        return [self.free.pop() for _ in range(state.num_kv_blocks)]

    def kv_cache_spec(self):
        from qwen3_rl.rollout.migration import KVCacheSpec

        return KVCacheSpec((self.c0, self.c1), (0, 1))

    def import_request(self, state, block_ids: list[int]) -> None:
        import torch

        r = _ToyReq(state.req_id, state.origin_rank, list(state.prompt_token_ids), dict(state.sampling_params),
                    state.seed)
        r.out = list(state.output_token_ids)
        r.gen.set_state(torch.frombuffer(bytearray(state.generator_state), dtype=torch.uint8))
        r.blocks, r.computed = list(block_ids), state.num_computed_tokens
        self.check_kv(r)  # KV content equal after the transfer
        self.imported.append((r.rid, r.params, r.seed, len(block_ids), state.extra["sent_by"]))
        if block_ids:
            self.running[r.rid] = r
        else:
            self.waiting.append(r)

    def pop_finished_remote(self) -> list:
        out, self.finished_remote = self.finished_remote, []
        return out

    def deliver(self, result) -> None:
        assert result.req_id not in self.results
        self.results[result.req_id] = list(result.output_token_ids)


def _requests_for(rank: int) -> list[_ToyReq]:
    """Rank 0: 10 long requests (a queue, max_num_seqs 4); ranks 1, 2: two short ones each."""
    if rank == 0:
        spec = [(f"r0-{i}", 24 + 3 * i, 5 + i) for i in range(10)]
    else:
        spec = [(f"r{rank}-{i}", 3 + i, 3) for i in range(2)]
    return [_ToyReq(rid, rank, [rank, i, 7][: 2 + i % 2], {"top_k": 50 + i, "max_tokens": mt, "temperature": 0.7},
                    seed=1000 * rank + i) for i, (rid, mt, _) in enumerate(spec)]


def _migration_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    import datetime
    import json

    import torch
    import torch.distributed as dist

    from qwen3_rl.rollout.migration import RebalanceCoordinator, RebalanceSettings, TorchDistCommunicator
    from qwen3_rl.rollout.rebalance import RebalanceConfig

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        eng = _ToyEngine(rank, _requests_for(rank), num_blocks=96, max_num_seqs=4)
        coord = RebalanceCoordinator(eng, TorchDistCommunicator(None, timeout_s=30),
                                     RebalanceConfig(buckets=(1, 2, 4), block_size=BLOCK, max_moves=4),
                                     RebalanceSettings(enable=True, interval_steps=3, prefill_tokens_per_s=0.0,
                                                       max_round_s=0.0))
        step = 0
        while True:
            flag = torch.tensor([int(eng.has_work() or coord.has_pending())])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # vLLM's DP "has unfinished requests" sync
            if not int(flag):
                break
            eng.step()
            step += 1
            coord.on_step(step)
            assert step < 500, "engine loop did not terminate"
        moves = [(m.req_id, m.src, m.dst, m.phase, m.kv_blocks) for rep in coord.reports for m in rep.plan.moves]
        res = {"results": eng.results, "imported": eng.imported, "moves": moves, "steps": step,
               "kv_in": sum(r.kv_bytes_received for r in coord.reports), "free": len(eng.free)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def test_gloo_migration_moves_requests_with_kv(tmp_path: Path) -> None:
    """3 CPU processes: queued and running requests migrate (KV blocks by gloo P2P); every request comes
    back to its origin exactly once with the tokens it would have produced without migration (sampling
    params, seed and generator state travel with it), KV content checked on arrival and every step."""
    import json

    import torch.multiprocessing as mp

    world = 3
    # fork: the children reuse the imported torch (spawn costs ~3 s of imports per process here)
    mp.start_processes(_migration_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world,
                       join=True, start_method="fork")
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    moves = {tuple(m) for r in res for m in r["moves"]}
    assert {m[3] for m in moves} == {1, 2}, f"expected waiting (1) and running+KV (2) moves, got {moves}"
    assert all(m[4] > 0 for m in moves if m[3] == 2)
    assert sum(r["kv_in"] for r in res) > 0
    for rank in range(world):
        own = {r.rid: r for r in _requests_for(rank)}
        got = res[rank]["results"]
        assert sorted(got) == sorted(own), f"rank {rank}: lost or foreign results"
        for rid, r in own.items():
            assert got[rid] == _reference_tokens(r.seed, r.params["top_k"], r.params["max_tokens"]), rid
        assert res[rank]["free"] == 96  # every block freed, none leaked by migration
    imported = [tuple(x) for r in res for x in r["imported"]]
    assert imported, "nothing was migrated"
    every = {r.rid: r for rank in range(world) for r in _requests_for(rank)}
    for rid, params, seed, _nblocks, _src in imported:
        assert params == every[rid].params and seed == every[rid].seed
    ids = [rid for r in res for rid in r["results"]]
    assert len(ids) == len(set(ids)) == len(every)


def _timeout_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from qwen3_rl.rollout.migration import (
        RebalanceCoordinator,
        RebalanceSettings,
        RebalanceTimeoutError,
        TorchDistCommunicator,
    )
    from qwen3_rl.rollout.rebalance import RebalanceConfig

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1.5))
    if rank == 1:  # a DP rank that never joins the round
        time.sleep(4.5)
        return
    comm = TorchDistCommunicator(None, timeout_s=1.5)
    msgs = []
    t0 = time.monotonic()
    try:
        comm.exchange([], [(1, torch.zeros(2, dtype=torch.int64))], "request sizes (P2P)")
    except RebalanceTimeoutError as e:
        msgs.append(str(e))
    eng = _ToyEngine(0, _requests_for(0), num_blocks=96, max_num_seqs=4)
    coord = RebalanceCoordinator(eng, comm, RebalanceConfig(buckets=(1, 2, 4), block_size=BLOCK),
                                 RebalanceSettings(enable=True, interval_steps=1, timeout_s=1.5, kv_link_gb_s=0.5))
    try:
        coord.on_step(1)
    except RebalanceTimeoutError as e:
        msgs.append(str(e))
    msgs.append(f"elapsed {time.monotonic() - t0:.1f}")
    Path(out_dir, "timeout.txt").write_text("\n".join(msgs))


def test_collective_timeout_is_a_clear_error(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_timeout_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    lines = (tmp_path / "timeout.txt").read_text().splitlines()
    assert len(lines) == 3, lines
    assert "request sizes (P2P) with DP rank(s) [1] did not complete within 1.5 s" in lines[0]
    assert "load exchange (all_gather) with DP rank(s) [1] did not complete within 1.5 s" in lines[1]
    assert "rollout rebalance round 1, DP rank 0" in lines[1]
    assert float(lines[2].split()[1]) < 4.5  # returned instead of hanging


# ---------------------------------------------------------------------------------------------------
# config switches: declared in the patched verl config, mapped from the train scripts' env vars
# ---------------------------------------------------------------------------------------------------
SWITCHES = {"DATA_REBALANCE": ("data_rebalance.enable", False), "ROLLOUT_REBALANCE": ("rollout_rebalance.enable", False),
            "ROLLOUT_REBALANCE_INTERVAL_STEPS": ("rollout_rebalance.interval_steps", 32),
            "ROLLOUT_REBALANCE_MAX_MOVES": ("rollout_rebalance.max_moves", 128)}


def test_switches_declared_and_mapped_from_scripts(patched_imports: Path) -> None:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from qwen3_rl.tools.launch.train_script import parse_train_script
    from qwen3_rl.trainer.seam import RecipeConfig, SeamConfigError, settings_from_rollout_config

    default = _compose_verl(patched_imports, ["actor_rollout_ref.rollout.name=vllm"])
    OmegaConf.resolve(default)  # as verl's main_ppo does before the workers get their sub-configs
    r = omega_conf_to_dataclass(default.actor_rollout_ref.rollout, dataclass_type=RolloutConfig)
    rc = RecipeConfig.from_group(r.qwen3_rl)
    assert (rc.data_rebalance.enable, rc.rollout_rebalance.enable, rc.rollout_rebalance.interval_steps,
            rc.rollout_rebalance.max_moves, rc.rollout_rebalance.timeout_s) == (False, False, 32, 128, 60.0)
    on = _compose_verl(patched_imports, ["actor_rollout_ref.rollout.name=vllm",
                                         "+qwen3_rl.data_rebalance.enable=true",
                                         "+qwen3_rl.rollout_rebalance.enable=true",
                                         "+qwen3_rl.rollout_rebalance.interval_steps=8"])
    OmegaConf.resolve(on)
    settings, max_moves = settings_from_rollout_config(
        omega_conf_to_dataclass(on.actor_rollout_ref.rollout, dataclass_type=RolloutConfig))
    assert (settings.enable, settings.interval_steps, max_moves) == (True, 8, 128)
    for typo in ("+qwen3_rl.data_rebalanse.enable=true", "+qwen3_rl.rollout_rebalance.enabled=true"):
        with pytest.raises(SeamConfigError):
            RecipeConfig.from_group(_compose_verl(patched_imports, [typo]).qwen3_rl)

    env_base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    scripts = sorted((REPO / "internal").glob("train_*.sh"))
    from test_train_configs import FULLY_ASYNC, SETUPS

    from qwen3_rl.tools.features import load_registry

    reg = load_registry()  # the switches' defaults come from the seam's dataclasses, not from the scripts

    assert [p.name for p in scripts] == sorted({**SETUPS, **FULLY_ASYNC})

    for script in scripts:
        default_ov = dict(o.split("=", 1) for o in parse_train_script(script, env=env_base).overrides if "=" in o)
        for var, (key, default_val) in SWITCHES.items():
            assert reg.default(reg.features[var], script.name, {}) == str(default_val), (script.name, var)
            assert default_ov[f"+qwen3_rl.{key}"] == str(default_val), (script.name, key)
        if script.name in FULLY_ASYNC:  # server rollout: data rebalance is refused there (test_train_configs)
            continue
        cmd = parse_train_script(script, env={**env_base, "DATA_REBALANCE": "True", "ROLLOUT_REBALANCE_MAX_MOVES": "7"})
        ov = dict(o.split("=", 1) for o in cmd.overrides if "=" in o)
        assert ov["+qwen3_rl.data_rebalance.enable"] == "True"
        assert ov["+qwen3_rl.rollout_rebalance.enable"] == "False"
        assert ov["+qwen3_rl.rollout_rebalance.max_moves"] == "7"


def test_configure_rollout_rebalance_needs_engine_hook() -> None:
    from types import SimpleNamespace

    from qwen3_rl.rollout.migration import ENGINE_HOOK_ATTR, MigrationError
    from qwen3_rl.trainer.seam import configure_rollout_rebalance

    llm = SimpleNamespace(llm_engine=SimpleNamespace())
    assert configure_rollout_rebalance({"rollout_rebalance": False}, llm).enable is False
    with pytest.raises(MigrationError, match="needs the vLLM engine-loop hook"):
        configure_rollout_rebalance({"rollout_rebalance": True}, llm)
    got = []
    setattr(llm.llm_engine, ENGINE_HOOK_ATTR, SimpleNamespace(configure=lambda s, m: got.append((s, m))))
    s = configure_rollout_rebalance({"rollout_rebalance": True, "rollout_rebalance_interval_steps": 4,
                                     "rollout_rebalance_max_moves": 9}, llm)
    assert got == [(s, 9)] and s.interval_steps == 4
    for bad in ({"rollout_rebalance": "yes"}, {"rollout_rebalance": True, "rollout_rebalance_max_moves": 0},
                {"rollout_rebalance": True, "rollout_rebalance_interval_steps": 0}):
        with pytest.raises(ValueError):
            configure_rollout_rebalance(bad, llm)


def test_request_state_and_kv_blocks_round_trip() -> None:
    import torch

    from qwen3_rl.rollout.migration import (
        KVCacheSpec,
        MigrationError,
        RequestState,
        gather_kv_blocks,
        pack_request,
        scatter_kv_blocks,
        unpack_request,
    )

    g = torch.Generator().manual_seed(5)
    torch.randint(0, 9, (3,), generator=g)
    st = RequestState("req-ä", 3, (1, 2, 3), (9, 8), {"temperature": 0.6, "top_p": 0.95, "stop": ["</s>"]}, 5,
                      g.get_state().numpy().tobytes(), 4, 2, {"arrival": 1.5})
    back = unpack_request(pack_request(st))
    assert back == st
    g2 = torch.Generator()
    g2.set_state(torch.frombuffer(bytearray(back.generator_state), dtype=torch.uint8))
    assert torch.randint(0, 1000, (4,), generator=g2).tolist() == torch.randint(0, 1000, (4,), generator=g).tolist()
    empty = RequestState("w", 0, (7,), (), {}, None, b"", 0, 0, {})
    assert unpack_request(pack_request(empty)) == empty  # an empty generator state differs from None
    assert unpack_request(pack_request(empty)).generator_state == b"" and back.seed == 5
    buf = pack_request(st)
    with pytest.raises(MigrationError, match="bytes, header says"):
        unpack_request(buf[:-1])
    with pytest.raises(MigrationError, match="not a request state"):
        unpack_request(np.zeros(32, dtype=np.uint8))
    with pytest.raises(MigrationError, match="JSON"):
        pack_request(RequestState("x", 0, (), (), {"obj": object()}))

    a = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 2, 3)
    b = torch.arange(2 * 6 * 2, dtype=torch.int8).reshape(2, 6, 2)
    src = KVCacheSpec((a, b), (0, 1))
    assert src.bytes_per_block == 2 * 3 * 4 + 2 * 2
    flat = gather_kv_blocks(src, [4, 1])
    dst = KVCacheSpec((torch.zeros_like(a), torch.zeros_like(b)), (0, 1))
    scatter_kv_blocks(dst, [0, 5], flat)
    assert torch.equal(dst.caches[0][0], a[4]) and torch.equal(dst.caches[0][5], a[1])
    assert torch.equal(dst.caches[1][:, 0], b[:, 4]) and torch.equal(dst.caches[1][:, 5], b[:, 1])
    assert dst.caches[0][1:5].abs().sum() == 0
    with pytest.raises(MigrationError, match="blocks need"):
        scatter_kv_blocks(dst, [0], flat)
