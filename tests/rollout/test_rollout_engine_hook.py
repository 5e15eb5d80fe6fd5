"""vLLM 0.13 engine-loop hook for rollout rebalance (vLLM patch 0004 + ``qwen3_rl.rollout.vllm_engine_hook``).

What is real here (patched vLLM 0.13.0 tree, executed): the v1 ``Scheduler`` with its ``KVCacheManager``
/ block pool / prefix-cache block hasher, ``Request``, ``SchedulerOutput``, ``update_from_output``,
the worker's ``InputBatch`` and block table, ``GPUModelRunner._update_states`` (the function that turns a
``SchedulerOutput`` into the worker's cached request states and persistent batch), ``OutputProcessor``,
``EngineCoreRequest`` / ``EngineCoreOutput``, the patched ``LLMEngine.step`` / ``has_unfinished_requests``
(with vLLM's DP all-reduce over a gloo group) and ``LLM._run_engine``.

Stand-ins: the model forward (``_Runner.execute``: writes a per-token KV value into the paged cache
through the worker's block table, checks every earlier position's KV, samples with the request's own
``torch.Generator`` from the ``InputBatch``), ``EngineCore`` / ``InprocClient`` (schedule -> execute ->
``update_from_output``, like ``EngineCore.step``), ``ModelConfig`` (a namespace with ``max_model_len``,
no HF model), ``get_pp_group`` (single PP stage), and the ``LLMEngine`` object is made with
``object.__new__`` (its ``__init__`` needs a model and tokenizer) with the attributes ``step`` uses.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BS = 4  # tokens per KV block
VOCAB = 1000
EOS = VOCAB + 7  # never sampled: requests end by max_tokens


def _kv_val(rid: str, pos: int, tok: int) -> float:
    """KV content of one position (exact in float32)."""
    return float((sum(rid.encode()) * 31 + pos * 7 + tok) % 4093) + 0.25


def _reference(seed: int, max_tokens: int) -> tuple[list[int], list[float]]:
    """Tokens (and the stand-in's logprobs) a seeded request produces without migration."""
    g = torch.Generator().manual_seed(seed)
    toks = [int(torch.randint(0, VOCAB, (1,), generator=g)) for _ in range(max_tokens)]
    return toks, [-(t % 13) / 8.0 for t in toks]


# ---------------------------------------------------------------------------------------------------
# stand-ins around the real scheduler / input batch
# ---------------------------------------------------------------------------------------------------
def _vllm_config(max_num_seqs: int, num_blocks: int, max_model_len: int = 512):
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig

    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_model_len, max_model_len=max_model_len,
                         is_encoder_decoder=False)
    cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cc.num_gpu_blocks = num_blocks
    vc = VllmConfig(scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu"))
    # stand-in model config: the scheduler reads only these fields
    object.__setattr__(vc, "model_config", SimpleNamespace(is_encoder_decoder=False, max_model_len=max_model_len,
                                                           is_multimodal_model=False))
    vc.parallel_config.data_parallel_size = 2
    vc.parallel_config.distributed_executor_backend = "external_launcher"
    return vc


class _Runner:
    """Worker-side stand-in: real ``InputBatch`` and ``GPUModelRunner._update_states``; a toy forward."""

    def __init__(self, vc, num_blocks: int) -> None:
        from vllm.v1.worker.gpu_input_batch import InputBatch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        self._update = GPUModelRunner._update_states
        self._valid_count = GPUModelRunner._get_valid_sampled_token_count
        sc = vc.scheduler_config
        self.device = torch.device("cpu")
        self.input_batch = InputBatch(max_num_reqs=sc.max_num_seqs, max_model_len=vc.model_config.max_model_len,
                                      max_num_batched_tokens=sc.max_num_batched_tokens, device=self.device,
                                      pin_memory=False, vocab_size=VOCAB, block_sizes=[BS], kernel_block_sizes=[BS])
        self.requests: dict = {}
        self.num_prompt_logprobs: dict = {}
        self.encoder_cache: dict = {}
        self.is_pooling_model = False
        self.uses_mrope = False
        self.uses_xdrope_dim = 0
        self.use_async_scheduling = False
        self.valid_sampled_token_count_event = None
        # two layers, both vLLM layouts: (2, num_blocks, BS, heads, dim) and (num_blocks, BS, heads, dim)
        self.kv_caches = [torch.zeros(2, num_blocks, BS, 1, 2), torch.zeros(num_blocks, BS, 1, 3)]
        self.kv_checks = 0

    def _get_valid_sampled_token_count(self) -> list[int]:
        return self._valid_count(self)

    def _may_reorder_batch(self, scheduler_output) -> None:
        return None

    def _slot(self, idx: int, pos: int) -> tuple[int, int]:
        table = self.input_batch.block_table[0].block_table.np
        return int(table[idx, pos // BS]), pos % BS

    def execute(self, so):
        from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

        self._update(self, so)
        ib = self.input_batch
        req_ids = list(ib.req_ids)
        sampled, rows = [], []
        for idx, rid in enumerate(req_ids):
            n = so.num_scheduled_tokens[rid]
            start = int(ib.num_computed_tokens_cpu[idx])
            toks = ib.token_ids_cpu[idx]
            for p in range(start):  # "attention" reads every earlier position through the block table
                b, o = self._slot(idx, p)
                want = _kv_val(rid.split("|")[-1], p, int(toks[p]))
                assert float(self.kv_caches[0][1, b, o, 0, 1]) == want, (rid, p, "layer 0")
                assert float(self.kv_caches[1][b, o, 0, 2]) == want, (rid, p, "layer 1")
                self.kv_checks += 1
            for p in range(start, start + n):
                b, o = self._slot(idx, p)
                v = _kv_val(rid.split("|")[-1], p, int(toks[p]))
                self.kv_caches[0][:, b, o] = v
                self.kv_caches[1][b, o] = v
            state = self.requests[rid]
            if start + n >= state.num_tokens:  # prefill done / decode: sample with the request's generator
                gen = ib.generators.get(idx)
                assert gen is not None, rid
                t = int(torch.randint(0, VOCAB, (1,), generator=gen))
                end = start + n + 1
                ib.token_ids_cpu[idx, start + n] = t
                ib.num_tokens[idx] = ib.num_tokens_no_spec[idx] = end
                state.output_token_ids.append(t)
                sampled.append([t])
            else:
                sampled.append([])
                t = 0
            rows.append(t)
        lp = LogprobsLists(torch.tensor(rows).reshape(-1, 1).numpy(),
                           torch.tensor([-(t % 13) / 8.0 for t in rows], dtype=torch.float32).reshape(-1, 1).numpy(),
                           torch.zeros(len(rows), dtype=torch.int64).numpy(), None)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, logprobs=lp, prompt_logprobs_dict={}, pooler_output=[])


class _Core:
    """``EngineCore`` stand-in (in-process): real scheduler, stand-in forward."""

    def __init__(self, vc, num_blocks: int) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256)
        kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer0", "layer1"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=2,
                                                                     dtype=torch.float32))])
        self.scheduler = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=SimpleNamespace(should_advance=lambda r: False),
                                   block_size=BS, log_stats=False)
        self.request_block_hasher = get_request_block_hasher(BS, sha256)
        self.batch_queue = None
        self.runner = _Runner(vc, num_blocks)
        self.model_executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=self.runner)))
        self.outputs: list = []  # SchedulerOutputs, for inspection
        self.dummy_steps = 0

    def step(self):
        from vllm.v1.engine import EngineCoreOutputs

        if not self.scheduler.has_requests():
            return EngineCoreOutputs()
        so = self.scheduler.schedule()
        self.outputs.append(so)
        out = self.scheduler.update_from_output(so, self.runner.execute(so))
        return out.get(0) or EngineCoreOutputs()


class _Client:
    """``InprocClient`` stand-in."""

    def __init__(self, core: _Core) -> None:
        self.engine_core = core

    def get_output(self):
        return self.engine_core.step()

    def add_request(self, request) -> None:
        from vllm.v1.request import Request

        self.engine_core.scheduler.add_request(
            Request.from_engine_core_request(request, self.engine_core.request_block_hasher))

    def abort_requests(self, ids) -> None:
        from vllm.v1.request import RequestStatus

        if ids:
            self.engine_core.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def execute_dummy_batch(self) -> None:
        self.engine_core.dummy_steps += 1

    def dp_engines_running(self) -> bool:
        return False


def _engine(max_num_seqs: int = 4, num_blocks: int = 64, dp_group=None):
    """Patched ``LLMEngine`` object (``object.__new__``) around the stand-in core, with its hook."""
    from vllm.plugins.extensions import build_engine_step_hooks
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor

    from qwen3_rl.rollout.vllm_engine_hook import VllmRebalanceHook

    vc = _vllm_config(max_num_seqs, num_blocks)
    eng = object.__new__(LLMEngine)
    eng.vllm_config = vc
    eng.log_stats = False
    eng.logger_manager = None
    eng.should_execute_dummy_batch = False
    eng.dp_group = dp_group
    eng.output_processor = OutputProcessor(None, log_stats=False)
    eng.engine_core = _Client(_Core(vc, num_blocks))
    # what the patched LLMEngine.__init__ does: the hooks the plugin registered (entry point), in order
    eng.step_hooks = build_engine_step_hooks(eng)
    assert isinstance(eng.qwen3_rl_rebalance_hook, VllmRebalanceHook)
    assert eng.step_hooks[-1] is eng.qwen3_rl_rebalance_hook  # no SAM here: no exchange hook
    return eng


def _add(eng, rid: str, prompt: list[int], max_tokens: int, seed: int, stop: list[str] | None = None) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreRequest

    sp = SamplingParams(max_tokens=max_tokens, seed=seed, temperature=0.8, top_p=0.9, logprobs=0,
                        stop=stop or [], output_kind=RequestOutputKind.FINAL_ONLY)
    req = EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), mm_features=None, sampling_params=sp,
                            pooling_params=None, eos_token_id=EOS, arrival_time=time.time(), lora_request=None,
                            cache_salt=None, data_parallel_rank=None)
    eng.add_request(rid, req, sp)


def _prompt(rank: int, i: int) -> list[int]:
    return [(rank * 100 + i * 11 + k) % VOCAB for k in range(5 + 3 * i)]


def _move(src, dst, gid: str) -> tuple[int, int]:
    """One migration by hand, as the coordinator does it: export, gather KV, release, allocate, scatter,
    import. Returns (blocks freed on src, blocks taken on dst)."""
    from qwen3_rl.rollout.migration import gather_kv_blocks, pack_request, scatter_kv_blocks, unpack_request

    hs, hd = src.qwen3_rl_rebalance_hook, dst.qwen3_rl_rebalance_hook
    pool_s = src.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    pool_d = dst.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    st, blocks = hs.export_request(gid)
    kv = gather_kv_blocks(hs.kv_cache_spec(), blocks) if blocks else None
    free_s = pool_s.get_num_free_blocks()
    hs.release_request(gid)
    st = unpack_request(pack_request(st))  # the bytes that travel
    free_d = pool_d.get_num_free_blocks()
    new = hd.allocate_blocks(st) if st.num_kv_blocks else []
    assert len(new) == len(blocks)
    if new:
        scatter_kv_blocks(hd.kv_cache_spec(), new, kv)
    hd.import_request(st, new)
    return pool_s.get_num_free_blocks() - free_s, free_d - pool_d.get_num_free_blocks()


def _run(eng, steps: int) -> list:
    outs = []
    for _ in range(steps):
        outs += eng.step()
    return outs


def _sched_reqs(eng) -> dict:
    return eng.engine_core.engine_core.scheduler.requests


# ---------------------------------------------------------------------------------------------------
# two real schedulers in one process, moves by hand
# ---------------------------------------------------------------------------------------------------
def test_move_waiting_and_running_between_real_schedulers(patched_imports: Path, monkeypatch) -> None:
    import vllm.v1.worker.gpu_model_runner as gmr

    from qwen3_rl.rollout.migration import FinishedRemote, MigrationError

    monkeypatch.setattr(gmr, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True))
    e0, e1 = _engine(max_num_seqs=2), _engine(max_num_seqs=4)
    h0, h1 = e0.qwen3_rl_rebalance_hook, e1.qwen3_rl_rebalance_hook
    h1.rank = 1
    spec = {"0": (9, 11), "1": (7, 12), "2": (6, 13), "3": (8, 14)}  # id: (max_tokens, seed), same ids on e1
    for rid, (mt, seed) in spec.items():
        _add(e0, rid, _prompt(0, int(rid)), mt, seed)
    _add(e1, "0", _prompt(1, 0), 4, 99)  # rank 1's own request "0": ids collide across DP ranks
    _add(e0, "9", _prompt(0, 9), 5, 5, stop=["</s>"])
    _run(e0, 3)
    _run(e1, 1)
    s0 = e0.engine_core.engine_core.scheduler
    st = h0.load_state(0)
    assert [w.req_id for w in st.waiting] == ["r0|2", "r0|3"]  # "9" (stop strings) is pinned, hidden
    assert [(r.req_id, r.num_tokens, r.kv_blocks) for r in st.running] == [("r0|0", 7, 2), ("r0|1", 10, 3)]
    assert st.max_num_seqs == 2 and st.num_kv_blocks == s0.kv_cache_manager.block_pool.get_num_free_blocks() + 5
    with pytest.raises(MigrationError, match="stop strings"):
        h0.export_request("r0|9")

    # waiting request: same id on the wire (global), params and seed kept, queued on the target
    sp_before = s0.requests["2"].sampling_params
    assert _move(e0, e1, "r0|2") == (0, 0)
    moved = _sched_reqs(e1)["r0|2"]
    assert "2" not in _sched_reqs(e0) and moved in list(e1.engine_core.engine_core.scheduler.waiting)
    for f in ("seed", "temperature", "top_p", "max_tokens", "logprobs", "output_kind", "_all_stop_token_ids"):
        assert getattr(moved.sampling_params, f) == getattr(sp_before, f), f
    assert moved.prompt_token_ids == _prompt(0, 2) and moved.eos_token_id == EOS

    # running request: KV blocks move, origin frees them, num_computed_tokens kept
    r1 = s0.requests["1"]
    computed, out_before = r1.num_computed_tokens, list(r1.output_token_ids)
    freed, taken = _move(e0, e1, "r0|1")
    assert freed == taken == 3
    s1 = e1.engine_core.engine_core.scheduler
    r1b = s1.requests["r0|1"]
    assert r1b in s1.running and r1b.num_computed_tokens == computed and list(r1b.output_token_ids) == out_before
    assert e1.engine_core.engine_core.runner.requests["r0|1"].generator is not None

    _run(e0, 1)
    _run(e1, 1)
    so0, so1 = e0.engine_core.engine_core.outputs[-1], e1.engine_core.engine_core.outputs[-1]
    assert "1" in so0.finished_req_ids and "1" not in so0.num_scheduled_tokens  # origin no longer runs it
    assert "1" not in e0.engine_core.engine_core.runner.requests
    assert so1.num_scheduled_tokens["r0|1"] == 1  # decode, not prefill
    assert "r0|1" in so1.scheduled_cached_reqs.req_ids
    assert "r0|1" not in [n.req_id for n in so1.scheduled_new_reqs]
    assert so1.num_scheduled_tokens["r0|2"] == len(_prompt(0, 2))  # the moved waiting request: prefill
    kv_checked = e1.engine_core.engine_core.runner.kv_checks
    assert kv_checked >= computed  # the moved KV was read through the target's block table and matched

    # run both to the end; hosted results go back to the origin's output processor
    outs0, outs1 = [], []
    for _ in range(40):
        outs0 += e0.step()
        outs1 += e1.step()
        for fr in h1.pop_finished_remote():
            assert isinstance(fr, FinishedRemote) and fr.origin_rank == 0
            h0.deliver(fr)
        outs0 += h0.take_ready()
    got0 = {o.request_id: o for o in outs0 if o.finished}
    got1 = {o.request_id: o for o in outs1 if o.finished}
    assert sorted(got0) == ["0", "1", "2", "3", "9"] and sorted(got1) == ["0"]  # nothing lost or duplicated
    for rid, (mt, seed) in spec.items():
        toks, lps = _reference(seed, mt)
        c = got0[rid].outputs[0]
        assert list(c.token_ids) == toks, rid  # seed + generator state travelled
        assert [next(iter(d.values())).logprob for d in c.logprobs] == pytest.approx(lps), rid
        assert c.finish_reason == "length"
    assert list(got1["0"].outputs[0].token_ids) == _reference(99, 4)[0]
    for e in (e0, e1):
        s = e.engine_core.engine_core.scheduler
        assert not s.requests and s.kv_cache_manager.block_pool.get_num_free_blocks() == 63  # nothing leaked
        assert not e.output_processor.has_unfinished_requests()


def test_preempted_request_moves_with_its_generator(patched_imports: Path, monkeypatch) -> None:
    """A waiting request that has generated tokens (preempted) resumes on the target like a local
    preemption: KV recomputed for prompt + outputs, same sampler stream."""
    import vllm.v1.worker.gpu_model_runner as gmr

    from qwen3_rl.rollout.vllm_engine_hook import (
        AwayOutput,
        default_buckets,
        dp_groups_from_ranks,
        kv_block_axis,
        sampling_params_from_dict,
        sampling_params_to_dict,
    )

    monkeypatch.setattr(gmr, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True))
    e0, e1 = _engine(max_num_seqs=2), _engine(max_num_seqs=2)
    e1.qwen3_rl_rebalance_hook.rank = 1
    _add(e0, "5", _prompt(0, 5), 10, 321)
    _run(e0, 4)
    s0 = e0.engine_core.engine_core.scheduler
    req = s0.requests["5"]
    s0.running.remove(req)
    s0._preempt_request(req, time.monotonic())  # what the scheduler does when KV runs out
    assert req.num_output_tokens == 4 and req.num_computed_tokens == 0
    st0 = e0.qwen3_rl_rebalance_hook.load_state(0)
    assert [w.req_id for w in st0.waiting] == ["r0|5"] and not st0.running
    assert _move(e0, e1, "r0|5") == (0, 0)
    outs = _run(e1, 12)
    assert not outs  # the hosted request's output is not handed to rank 1's front end
    (fr,) = e1.qwen3_rl_rebalance_hook.pop_finished_remote()
    assert fr.req_id == "r0|5" and list(fr.output_token_ids) == _reference(321, 10)[0]
    so = e1.engine_core.engine_core.outputs[0]
    assert so.scheduled_cached_reqs.resumed_req_ids == {"r0|5"} and so.num_scheduled_tokens["r0|5"] == 5 + 15 + 4
    e0.qwen3_rl_rebalance_hook.deliver(fr)
    (o,) = e0.qwen3_rl_rebalance_hook.take_ready()
    assert o.finished and list(o.outputs[0].token_ids) == _reference(321, 10)[0]

    # helpers
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=3, seed=1, stop_token_ids=[5, 6], temperature=0.5, bad_words=["x"])
    sp._all_stop_token_ids = {5, 6, 7}
    back = sampling_params_from_dict(json.loads(json.dumps(sampling_params_to_dict(sp))))
    assert back == sp and back._all_stop_token_ids == {5, 6, 7}
    a = AwayOutput([1, 2], [(torch.tensor([1]).numpy(), torch.tensor([float("-inf")]).numpy(),
                            torch.tensor(0).numpy())] * 2, 1, None, 3)
    b = AwayOutput.from_json(json.loads(json.dumps(a.to_json(), allow_nan=False)))
    assert b.token_ids == [1, 2] and b.finish_reason == 1 and float(b.logprob_rows[1][1][0]) == float("-inf")
    assert kv_block_axis((2, 64, 4, 1, 2), 64) == 1 and kv_block_axis((64, 4, 1, 2), 64) == 0
    assert dp_groups_from_ranks([[0, 2], [1, 3], [2, 0], [3, 1]]) == [[0, 2], [1, 3]]
    assert default_buckets([1, 2, 4, 8, 16, 512], 16) == (1, 2, 4, 8, 16)
    assert default_buckets(None, 6) == (1, 2, 4, 6)


def test_configure_refuses_unsupported_engines(patched_imports: Path) -> None:
    from qwen3_rl.rollout.migration import MigrationError, RebalanceSettings
    from qwen3_rl.trainer.seam import configure_rollout_rebalance

    eng = _engine()
    hook = eng.qwen3_rl_rebalance_hook
    hook.configure(RebalanceSettings(enable=False), 8)
    assert not hook.enabled and hook.after_step(["x"]) == ["x"] and hook.has_unfinished() is False
    outs = SimpleNamespace(outputs=[1])
    assert hook.filter_outputs(outs) is outs
    eng.vllm_config.parallel_config.data_parallel_size = 1
    with pytest.raises(MigrationError, match="data_parallel_size is 1"):
        configure_rollout_rebalance({"rollout_rebalance": True}, SimpleNamespace(llm_engine=eng))
    eng.vllm_config.parallel_config.data_parallel_size = 2
    eng.vllm_config.scheduler_config.async_scheduling = True
    with pytest.raises(MigrationError, match="async scheduling"):
        hook.configure(RebalanceSettings(enable=True), 8, comm=SimpleNamespace(rank=0, size=2))
    # the patched LLMEngine sources: hooks built in __init__ by the seam (nothing of ours named upstream)
    import inspect

    from vllm.v1.engine import llm_engine

    assert "self.step_hooks: list[EngineStepHook] = build_engine_step_hooks(self)" in inspect.getsource(
        llm_engine.LLMEngine.__init__)
    assert "qwen3_rl" not in inspect.getsource(llm_engine)


# ---------------------------------------------------------------------------------------------------
# two gloo processes: patched LLMEngine.step / has_unfinished_requests and LLM._run_engine, coordinator
# ---------------------------------------------------------------------------------------------------
SPEC = {0: [(str(i), 10 + 4 * i, 100 + i) for i in range(7)], 1: [(str(i), 3 + i, 200 + i) for i in range(2)]}


def _gloo_worker(rank: int, world: int, store: str, out_dir: str, device_group: bool = False) -> None:
    import datetime

    import torch.distributed as dist
    import vllm.distributed.parallel_state as ps
    from vllm.entrypoints.llm import LLM

    from qwen3_rl.rollout.migration import RebalanceSettings, TorchDistCommunicator
    from qwen3_rl.rollout.rebalance import RebalanceConfig

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        eng = _engine(max_num_seqs=4, num_blocks=96, dp_group=dist.new_group(backend="gloo"))
        if device_group:
            # vLLM's DP GroupCoordinator (stand-in namespace): its device group is a gloo group, as on vLLM's CPU
            # platform (dist_backend "gloo"); an A3 has an HCCL group here
            dev = dist.new_group(ranks=[0, 1], backend="gloo")
            ps.get_dp_group = lambda: SimpleNamespace(ranks=[0, 1], device_group=dev)
        hook = eng.qwen3_rl_rebalance_hook
        # default communicator (a gloo group per vLLM DP group, made collectively) and planner config;
        # default KV path: the device group (host path when the DP group has none). Running requests always
        # travel with their KV here (no recompute, no round-time bound): the move-vs-recompute choice follows
        # the link measured on this machine, which a loaded host slows below the recompute price
        hook.configure(RebalanceSettings(enable=True, interval_steps=2, timeout_s=60, prefill_tokens_per_s=0.0,
                                         max_round_s=0.0), 8)
        coord = hook.coordinator
        assert isinstance(coord.comm, TorchDistCommunicator) and coord.comm.size == 2
        assert coord.kv_path == ("device" if device_group else "host")
        assert (coord.kv_comm is not coord.comm and coord.kv_comm.batched) if device_group else coord.kv_comm is coord.comm
        assert hook.coordinator.cfg == RebalanceConfig(buckets=(1, 2, 4), block_size=BS, max_moves=8)
        for rid, mt, seed in SPEC[rank]:
            _add(eng, rid, _prompt(rank, int(rid)), mt, seed)
        llm = object.__new__(LLM)
        llm.llm_engine = eng
        outs = llm._run_engine(use_tqdm=False)
        core = eng.engine_core.engine_core
        moves = [(m.req_id, m.src, m.dst, m.phase, m.kv_blocks) for rep in hook.coordinator.reports
                 for m in rep.plan.moves]
        res = {"outs": {o.request_id: [list(o.outputs[0].token_ids), [next(iter(d.values())).logprob
                                                                        for d in o.outputs[0].logprobs],
                                       o.outputs[0].finish_reason] for o in outs},
               "n_outs": len(outs), "moves": moves, "steps": hook.steps, "dummy": core.dummy_steps,
               "free": core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
               "left": sorted(core.scheduler.requests), "kv_checks": core.runner.kv_checks,
               "kv_in": sum(r.kv_bytes_received for r in hook.coordinator.reports),
               "recomputed": [x for r in hook.coordinator.reports for x in r.recomputed],
               "paths": sorted({r.kv_path for r in hook.coordinator.reports}),
               "links": sorted({r.link_gb_s for r in hook.coordinator.reports}),
               "backend": hook.coordinator.kv_comm.backend}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device_group", [True, False], ids=["device_path", "host_path"])
def test_gloo_engine_loop_rebalances_with_real_schedulers(patched_imports: Path, tmp_path: Path, monkeypatch,
                                                          device_group: bool) -> None:
    """2 processes, each a real scheduler + patched LLMEngine loop (``LLM._run_engine``); rank 0 holds 7
    long requests (max_num_seqs 4), rank 1 two short ones, with the same request ids. Waiting and running
    requests move; each rank's ``generate`` returns exactly its own requests, once, with the tokens and
    logprobs an unmigrated run gives (the stand-in forward checks every earlier position's KV at every
    step); no block leaked. ``device_path``: the KV goes over the DP group's device group (gloo on CPU,
    batched P2P, staged on the cache's device); ``host_path``: the DP group has no device group, the KV
    goes through host memory over the gloo coordination group. The link is measured at the first round."""
    import torch.multiprocessing as mp
    import vllm.distributed.parallel_state as ps
    import vllm.v1.worker.gpu_model_runner as gmr

    monkeypatch.setattr(gmr, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True))
    monkeypatch.setattr(ps, "get_dp_group", lambda: SimpleNamespace(ranks=[0, 1]))  # vLLM DP group: both ranks
    mp.start_processes(_gloo_worker, args=(2, str(tmp_path / "store"), str(tmp_path), device_group), nprocs=2,
                       join=True, start_method="fork")
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    path = "device" if device_group else "host"
    assert res[0]["paths"] == res[1]["paths"] == [path] and res[0]["backend"] == "gloo"
    assert res[0]["links"] == res[1]["links"] and len(res[0]["links"]) == 1 and res[0]["links"][0] > 0  # measured
    moves = {tuple(m) for m in res[0]["moves"]}
    assert moves == {tuple(m) for m in res[1]["moves"]}  # same plan on both ranks
    assert {m[3] for m in moves} == {1, 2}, moves  # waiting and running (+KV) moves
    assert res[0]["kv_in"] + res[1]["kv_in"] > 0 and res[0]["recomputed"] == res[1]["recomputed"] == []
    assert res[0]["steps"] == res[1]["steps"]  # lockstep, dummy steps included
    for rank in range(2):
        r = res[rank]
        assert r["n_outs"] == len(SPEC[rank]) and sorted(r["outs"]) == sorted(x[0] for x in SPEC[rank])
        for rid, mt, seed in SPEC[rank]:
            toks, lps = _reference(seed, mt)
            assert r["outs"][rid][0] == toks, (rank, rid)
            assert r["outs"][rid][1] == pytest.approx(lps) and r["outs"][rid][2] == "length"
        assert r["free"] == 95 and r["left"] == []
    assert res[1]["kv_checks"] > 0
    print("moves", sorted(moves), "steps", res[0]["steps"], "dummy", res[0]["dummy"], res[1]["dummy"])
