"""vLLM 0.13 engine-loop hook for rollout rebalance (sync SPMD rollout, external-launcher DP; and the DP engine core
processes of ``AsyncLLM``: :class:`CoreRebalanceHook`, at the end).

The plugin (:mod:`qwen3_rl.vllm_plugin`) registers the engine-step hook ``rollout_rebalance`` (order 30) with the
vLLM seam patch: every ``LLMEngine`` gets one :class:`VllmRebalanceHook` (also set as
``llm_engine.qwen3_rl_rebalance_hook``, where ``qwen3_rl.trainer.seam.configure_rollout_rebalance`` finds it), called at the
seam's points of the engine loop (``vllm/v1/engine/llm_engine.py``):

* ``has_unfinished_requests``: ``hook.has_unfinished()`` is OR-ed into the local flag *before* vLLM's DP
  all-reduce, so a rank that only hosts other ranks' requests runs real steps (not dummy batches) and
  every rank keeps stepping until all migrated results are home; after the all-reduce, a rank whose
  scheduler is empty (``hook.idle_in_lockstep()``: its own requests are away) runs a dummy batch, so it
  still joins vLLM's per-step DP batch coordination;
* ``step``: ``hook.filter_outputs(engine_core.get_output())`` takes the per-step outputs of requests
  hosted for another rank out of the batch (this rank's ``OutputProcessor`` does not know them) and
  accumulates their tokens / logprobs / finish reason;
* after every step, including dummy steps: ``hook.after_step(request_outputs)`` counts the step, runs a
  :class:`~qwen3_rl.rollout.migration.RebalanceCoordinator` round every ``interval_steps`` steps and returns
  the step's outputs plus the ``RequestOutput`` of own requests whose results came back from other ranks.

Off (``configure`` never called, or called with ``enable=False``) every call is a no-op / identity.

The hook implements :class:`~qwen3_rl.rollout.migration.EngineHooks` on the in-process ``EngineCore``
(``LLMEngine.engine_core`` is an ``InprocClient``; ``.engine_core.scheduler`` is the v1 ``Scheduler``,
``.engine_core.model_executor.driver_worker.worker.model_runner`` the worker's model runner):

* waiting requests move as ``Request`` objects rebuilt on the target from the request state (prompt and
  output ids, ``SamplingParams`` incl. private stop-id fields, eos id, arrival time, priority) and queued
  with ``Scheduler.add_request``; a request with generated tokens (preempted before) is queued as
  ``PREEMPTED`` with its worker state (generator state, output ids) pre-installed, so vLLM's resume path
  recomputes its KV exactly as after a local preemption;
* running requests: the origin removes the request with ``Scheduler.finish_requests(id, FINISHED_ABORTED)``
  (frees its blocks; the worker drops its cached state on the next ``SchedulerOutput.finished_req_ids``)
  without telling its ``OutputProcessor`` (the request stays open there); the target allocates
  ``ceil(num_computed_tokens / block_size)`` blocks with ``KVCacheManager.allocate_slots``, the coordinator
  writes the KV into them, and the request is appended to ``Scheduler.running`` with its
  ``num_computed_tokens``; the worker's ``model_runner.requests[id]`` gets a ``CachedRequestState`` with the
  prompt / output ids, the new block ids and the sampler generator (state restored), so the next
  ``schedule()`` schedules it for one decode token and ``_update_states`` puts it in the persistent batch;
* results: a request finished on a host is returned to its origin (coordinator) and fed to the origin's
  ``OutputProcessor`` as one ``EngineCoreOutput`` carrying every token (and logprob row) generated away
  from the origin, so ``LLM.generate`` on the origin returns it like any other request.

Not migrated (stay on their rank, hidden from the planner with their slots and blocks subtracted from the
rank's capacity): requests with stop strings (checked by the origin's detokenizer step by step),
structured output, LoRA, multimodal or prompt-embeds inputs, pooling requests, requests waiting for
remote KV / grammar compilation. Refused at ``configure``: vLLM DP size 1, a multiprocess engine core,
async scheduling, a batch queue, pipeline parallelism, more than one KV cache group.
Speculative decoding: a migrated request's pending draft tokens are dropped and no drafter state travels
(the target's drafter proposes from the request's tokens, which are in its input batch).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qwen3_rl.rollout.migration import (
    FinishedRemote,
    KVCacheSpec,
    MigrationError,
    RebalanceCoordinator,
    RebalanceSettings,
    RequestState,
    TorchDistCommunicator,
)
from qwen3_rl.rollout.rebalance import RankState, RebalanceConfig, RunningRequest, WaitingRequest

logger = logging.getLogger("qwen3_rl.rollout.rebalance")

#: SamplingParams fields msgspec does not encode (leading underscore) but the engine relies on
_PRIVATE_SP_FIELDS = ("_all_stop_token_ids", "_bad_words_token_ids", "_eos_token_id")  # the last: vLLM 0.23


# ---------------------------------------------------------------------------------------------------
# small codecs (JSON-safe: RequestState.extra goes through json with allow_nan=False)
# ---------------------------------------------------------------------------------------------------
def encode_array(a: np.ndarray) -> dict[str, Any]:
    """``{"dtype", "shape", "b64"}`` of an array (exact, including -inf / nan)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_array` (a writable copy)."""
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def sampling_params_to_dict(sp: Any) -> dict[str, Any]:
    """vLLM ``SamplingParams`` -> JSON-serialisable dict (msgspec builtins + the private stop-id fields)."""
    import msgspec

    d = msgspec.to_builtins(sp)
    for name in _PRIVATE_SP_FIELDS:
        v = getattr(sp, name, None)
        if isinstance(v, set):
            v = sorted(v)
        d[name] = v
    return d


def sampling_params_from_dict(d: dict[str, Any]) -> Any:
    """Inverse of :func:`sampling_params_to_dict`."""
    import msgspec
    from vllm.sampling_params import SamplingParams

    pub = {k: v for k, v in d.items() if k not in _PRIVATE_SP_FIELDS}
    sp = msgspec.convert(pub, SamplingParams)
    if d.get("_all_stop_token_ids") is not None:
        sp._all_stop_token_ids = set(d["_all_stop_token_ids"])
    if d.get("_bad_words_token_ids") is not None:
        sp._bad_words_token_ids = [list(x) for x in d["_bad_words_token_ids"]]
    if d.get("_eos_token_id") is not None:
        sp._eos_token_id = int(d["_eos_token_id"])
    return sp


@dataclass
class AwayOutput:
    """What a request produced since it left its origin rank (accumulated over every host it visited).

    ``token_ids``: generated ids, in order; ``logprob_rows``: per token ``(ids (K+1,), logprobs (K+1,),
    rank ())`` when the request asked for logprobs; ``finish_reason``: ``FinishReason`` int once finished.
    """

    token_ids: list[int] = field(default_factory=list)
    logprob_rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    def add(self, out: Any) -> None:
        """Append one ``EngineCoreOutput`` of the request."""
        self.token_ids.extend(int(t) for t in out.new_token_ids)
        lp = out.new_logprobs
        if lp is not None:
            for i in range(len(out.new_token_ids)):
                self.logprob_rows.append((np.asarray(lp.logprob_token_ids[i]), np.asarray(lp.logprobs[i]),
                                          np.asarray(lp.sampled_token_ranks[i])))
        if out.finish_reason is not None:
            self.finish_reason = int(out.finish_reason)
            self.stop_reason = out.stop_reason
        self.num_cached_tokens = int(getattr(out, "num_cached_tokens", 0))  # vLLM 0.23: in prefill_stats

    def to_json(self) -> dict[str, Any]:
        """JSON-safe form (arrays base64)."""
        d: dict[str, Any] = {"token_ids": self.token_ids, "finish_reason": self.finish_reason,
                             "stop_reason": self.stop_reason, "num_cached_tokens": self.num_cached_tokens}
        if self.logprob_rows:
            d["logprobs"] = {k: encode_array(np.stack([r[i] for r in self.logprob_rows]))
                             for i, k in enumerate(("ids", "lps", "ranks"))}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> AwayOutput:
        """Inverse of :meth:`to_json` (None -> empty)."""
        if not d:
            return cls()
        rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        if "logprobs" in d:
            ids, lps, ranks = (decode_array(d["logprobs"][k]) for k in ("ids", "lps", "ranks"))
            rows = [(ids[i], lps[i], ranks[i]) for i in range(ids.shape[0])]
        return cls(list(d["token_ids"]), rows, d.get("finish_reason"), d.get("stop_reason"),
                   int(d.get("num_cached_tokens", 0)))

    def engine_core_output(self, req_id: str) -> Any:
        """One ``EngineCoreOutput`` carrying everything (for the origin's ``OutputProcessor``)."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.outputs import LogprobsLists

        lp = None
        if self.logprob_rows:
            lp = LogprobsLists(np.stack([r[0] for r in self.logprob_rows]), np.stack([r[1] for r in self.logprob_rows]),
                               np.stack([r[2] for r in self.logprob_rows]), None)
        fr = FinishReason(self.finish_reason) if self.finish_reason is not None else None
        cached = ({"num_cached_tokens": self.num_cached_tokens}
                  if "num_cached_tokens" in EngineCoreOutput.__struct_fields__ else {})  # a field of vLLM 0.13's
        return EngineCoreOutput(request_id=req_id, new_token_ids=list(self.token_ids), new_logprobs=lp,
                                finish_reason=fr, stop_reason=self.stop_reason, **cached)


def kv_block_axis(shape: Sequence[int], num_blocks: int) -> int:
    """Block axis of a KV cache tensor: ``(num_blocks, ...)`` -> 0, ``(2, num_blocks, ...)`` -> 1."""
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        return 1
    if shape and shape[0] == num_blocks:
        return 0
    raise MigrationError(f"KV cache tensor of shape {tuple(shape)} has no block axis of size {num_blocks} "
                         "(expected (num_blocks, ...) or (2, num_blocks, ...))")


def dp_groups_from_ranks(per_rank: Sequence[Sequence[int]]) -> list[list[int]]:
    """The distinct DP groups (sorted global ranks) from every rank's own DP group, in a fixed order, so
    every process creates the same ``new_group`` sequence."""
    return [list(g) for g in sorted({tuple(sorted(int(r) for r in g)) for g in per_rank})]


def default_buckets(capture_sizes: Sequence[int] | None, max_num_seqs: int) -> tuple[int, ...]:
    """Graph batch-size buckets for the planner: vLLM's capture sizes up to ``max_num_seqs`` plus
    ``max_num_seqs``; eager (no capture sizes): powers of two below ``max_num_seqs`` plus it."""
    sizes = {int(s) for s in (capture_sizes or []) if 0 < int(s) <= max_num_seqs}
    if not sizes:
        sizes = {1 << k for k in range(max(1, max_num_seqs).bit_length()) if (1 << k) < max_num_seqs}
    sizes.add(int(max_num_seqs))
    return tuple(sorted(sizes))


def generator_state(runner: Any, req_id: str) -> bytes | None:
    """The sampler generator state of ``req_id`` in a model runner (None without a seeded generator)."""
    cached = runner.requests.get(req_id)
    if cached is None or cached.generator is None:
        return None
    return cached.generator.get_state().cpu().numpy().tobytes()


def worker_request_state(runner: Any, state: RequestState, req_id: str, sp: Any, block_ids: list[int]) -> Any:
    """The ``CachedRequestState`` of a migrated request for a model runner (prompt / output ids, KV block ids,
    the sampler generator with its state restored, as ``GPUModelRunner._update_states`` would build it)."""
    from vllm.sampling_params import SamplingType
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    gen = None
    if sp.sampling_type == SamplingType.RANDOM_SEED:  # as GPUModelRunner._update_states
        gen = torch.Generator(device=getattr(runner, "device", "cpu"))
        if state.generator_state is not None:
            gen.set_state(torch.frombuffer(bytearray(state.generator_state), dtype=torch.uint8))
        else:
            gen.manual_seed(sp.seed)
    return CachedRequestState(req_id=req_id, prompt_token_ids=list(state.prompt_token_ids),
                              mm_features=[], sampling_params=sp, generator=gen, block_ids=(list(block_ids),),
                              num_computed_tokens=int(state.num_computed_tokens),
                              output_token_ids=list(state.output_token_ids), lora_request=None, prompt_embeds=None)


def runner_kv_cache_spec(runner: Any, num_blocks: int) -> KVCacheSpec:
    """The KV cache tensors of a model runner with their block axes."""
    caches: list[torch.Tensor] = []
    for layer in runner.kv_caches:
        caches.extend(layer if isinstance(layer, list | tuple) else [layer])
    if not caches:
        raise MigrationError("the model runner has no KV cache tensors")
    return KVCacheSpec(tuple(caches), tuple(kv_block_axis(c.shape, num_blocks) for c in caches))


# ---------------------------------------------------------------------------------------------------
# the hook
# ---------------------------------------------------------------------------------------------------
class VllmRebalanceHook:
    """Engine-loop hook of one ``LLMEngine`` (see the module docstring).

    Args:
        llm_engine: the ``vllm.v1.engine.llm_engine.LLMEngine`` (or a stand-in with ``engine_core``
            (in-process client), ``output_processor``, ``vllm_config``).
    """

    def __init__(self, llm_engine: Any) -> None:
        self.llm_engine = llm_engine
        self.coordinator: RebalanceCoordinator | None = None
        self.steps = 0
        self.rank = 0
        self._foreign: dict[str, tuple[int, AwayOutput]] = {}  # hosted for another rank: origin, output
        self._finished: list[FinishedRemote] = []
        self._ready: list[Any] = []  # RequestOutputs of returned own requests, handed out by after_step
        self._incoming: dict[str, Any] = {}  # Request objects built by allocate_blocks, used by import_request
        self._foreign_req: dict[str, Any] = {}  # hosted Request objects (their output ids at finish)

    # -- engine access ----------------------------------------------------------------------------------
    @property
    def core(self) -> Any:
        """The in-process ``EngineCore``."""
        core = getattr(self.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise MigrationError("rollout rebalance needs the in-process engine core (LLMEngine with "
                                 "multiprocess_mode=False, as verl's SPMD rollout builds it)")
        return core

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def model_runner(self) -> Any:
        return self.core.model_executor.driver_worker.worker.model_runner

    @property
    def block_size(self) -> int:
        return int(self.scheduler.block_size)

    @property
    def enabled(self) -> bool:
        return self.coordinator is not None

    # -- configuration ----------------------------------------------------------------------------------
    def configure(self, settings: RebalanceSettings, max_moves: int, *, comm: Any = None,
                  cfg: RebalanceConfig | None = None, kv_comm: Any = None) -> None:
        """Switch on (``settings.enable``) with a coordinator over this TP rank's DP group.

        ``comm``: a :class:`~qwen3_rl.rollout.migration.Communicator` for the coordination messages
        (default: a gloo group per vLLM DP group with ``settings.timeout_s``, created collectively by every
        process); ``cfg``: planner config (default: vLLM's graph capture sizes as buckets, the KV block
        size, ``max_moves``); ``kv_comm``: the KV path's communicator (default with ``kv_path="device"``:
        vLLM's DP group's ``device_group`` — HCCL on an A3, NCCL on GPUs, gloo on vLLM's CPU platform —
        batched; without one the KV takes the host path over ``comm``, and the log says so).
        """
        if not settings.enable:
            self.coordinator = None
            return
        vc = self.llm_engine.vllm_config
        pc, sc = vc.parallel_config, vc.scheduler_config
        problems = []
        if pc.data_parallel_size <= 1:
            problems.append(f"vLLM data_parallel_size is {pc.data_parallel_size} (needs > 1: engine_kwargs.vllm."
                            "data_parallel_size with the external launcher)")
        if getattr(pc, "pipeline_parallel_size", 1) > 1:
            problems.append("pipeline parallelism is not supported")
        if getattr(sc, "async_scheduling", False):
            problems.append("async scheduling is not supported (output placeholders in flight)")
        core = self.core
        if getattr(core, "batch_queue", None) is not None:
            problems.append("the engine core runs a batch queue (max_concurrent_batches > 1)")
        if len(core.scheduler.kv_cache_config.kv_cache_groups) != 1:
            problems.append("only one KV cache group (full attention) is supported")
        if problems:
            raise MigrationError("actor_rollout_ref.rollout.rollout_rebalance=True cannot run on this engine: "
                                 + "; ".join(problems))
        if cfg is None:
            capture = getattr(getattr(vc, "compilation_config", None), "cudagraph_capture_sizes", None)
            cfg = RebalanceConfig(buckets=default_buckets(capture, sc.max_num_seqs), block_size=self.block_size,
                                  max_moves=int(max_moves))
        if cfg.block_size != self.block_size:
            raise MigrationError(f"planner block size {cfg.block_size} != KV block size {self.block_size}")
        if comm is None:
            comm = TorchDistCommunicator(_dp_rebalance_group(settings.timeout_s), timeout_s=settings.timeout_s)
        path = settings.kv_path
        if path == "device" and kv_comm is None:
            group = _dp_device_group()
            if group is None:
                path = "host"
                logger.warning("rollout rebalance: the vLLM DP group has no device group; KV moves through host "
                               "memory over gloo (kv_path=host)")
            else:
                kv_comm = TorchDistCommunicator(group, timeout_s=settings.timeout_s, batched=True)
        self.rank = comm.rank
        self.coordinator = RebalanceCoordinator(self, comm, cfg, settings, kv_comm=kv_comm if path == "device" else None,
                                                kv_path=path)
        logger.info("rollout rebalance on: DP rank %d of %d, KV path %s (%s backend), round bound %s s, link %s",
                    comm.rank, comm.size, path, getattr(self.coordinator.kv_comm, "backend", "?"),
                    settings.max_round_s or "no", f"{settings.kv_link_gb_s:g} GB/s (configured)"
                    if settings.kv_link_gb_s else "measured at the first round")

    # -- engine-step hook interface (vllm.plugins.extensions.EngineStepHook, vLLM seam patch) ------------
    def step_context(self) -> contextlib.AbstractContextManager:
        """Nothing around the step."""
        return contextlib.nullcontext()

    def has_unfinished(self) -> bool:
        """OR-ed into ``LLMEngine.has_unfinished_requests`` before the DP all-reduce."""
        if self.coordinator is None:
            return False
        return bool(self.coordinator.has_pending() or self._foreign or self._finished or self._ready
                    or self.scheduler.has_requests())

    def idle_in_lockstep(self) -> bool:
        """True when this rank's scheduler holds nothing while the DP loop goes on (its requests are away, or it
        only waits for results): ``LLMEngine.step`` must then run a dummy batch, or the other ranks' forward
        waits for this rank in vLLM's DP batch coordination (``coordinate_batch_across_dp``) forever.
        ``EngineCore.step`` skips the model when the scheduler is empty, so nothing else joins for it."""
        return self.coordinator is not None and not self.scheduler.has_requests()

    def filter_outputs(self, outputs: Any) -> Any:
        """Take hosted (foreign) requests' outputs out of ``EngineCoreOutputs`` and accumulate them."""
        if not self._foreign:
            return outputs
        keep = []
        for out in outputs.outputs:
            entry = self._foreign.get(out.request_id)
            if entry is None:
                keep.append(out)
                continue
            origin, acc = entry
            acc.add(out)
            if out.finish_reason is not None:
                del self._foreign[out.request_id]
                req = self._foreign_req.pop(out.request_id)
                self._finished.append(FinishedRemote(out.request_id, origin,
                                                     tuple(int(t) for t in req.output_token_ids), str(out.finish_reason),
                                                     {"away": acc.to_json()}))
        outputs.outputs = keep
        return outputs

    def after_step(self, request_outputs: list[Any] | None = None) -> list[Any]:
        """Count the step, run a round when due, return the step's outputs + returned own results."""
        outs = list(request_outputs or [])
        if self.coordinator is None:
            return outs
        self.steps += 1
        self.coordinator.on_step(self.steps)
        return outs + self.take_ready()

    def take_ready(self) -> list[Any]:
        """``RequestOutput``s of own requests whose results came back (each handed out once)."""
        out, self._ready = self._ready, []
        return out

    # -- EngineHooks ------------------------------------------------------------------------------------
    def _pinned_reason(self, req: Any) -> str | None:
        """Why a request must stay on its rank (None: it may move)."""
        from vllm.v1.request import RequestStatus

        sp = req.sampling_params
        if sp is None or req.pooling_params is not None:
            return "pooling request"
        if sp.stop:
            return "stop strings are checked by the origin's detokenizer"
        if req.structured_output_request is not None:
            return "structured output"
        if req.lora_request is not None:
            return "LoRA"
        if req.mm_features or req.prompt_embeds is not None or req.prompt_token_ids is None:
            return "multimodal / prompt-embeds input"
        if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.RUNNING):
            return f"status {req.status.name}"
        if req.num_output_placeholders:
            return "output placeholders in flight"
        return None

    # request ids: LLM.generate numbers requests "0", "1", ... on every DP rank, so the ids the planner and
    # the transfer see are global: "r<origin>|<id>". A rank's own requests keep their id in its scheduler;
    # requests hosted for another rank are held under the global id.
    def global_id(self, sched_id: str) -> str:
        """Global id of a request in this rank's scheduler."""
        return sched_id if sched_id in self._foreign else f"r{self.rank}|{sched_id}"

    @staticmethod
    def origin_id(gid: str, origin: int) -> str:
        """The origin's own id of a global id."""
        prefix = f"r{origin}|"
        if not gid.startswith(prefix):
            raise MigrationError(f"request id {gid!r} is not a global id of DP rank {origin}")
        return gid[len(prefix):]

    def _sched_id(self, gid: str) -> str:
        return gid if gid in self._foreign else self.origin_id(gid, self.rank)

    def _target_id(self, state: RequestState) -> str:
        """Id under which this rank's scheduler holds an incoming request."""
        return self.origin_id(state.req_id, self.rank) if state.origin_rank == self.rank else state.req_id

    def _kv_blocks(self, req: Any) -> int:
        return -(-int(req.num_computed_tokens) // self.block_size)

    def load_state(self, rank: int) -> RankState:
        sched = self.scheduler
        waiting, running = [], []
        pinned_running, movable_blocks = 0, 0
        for req in sched.waiting:
            if self._pinned_reason(req) is None:
                waiting.append(WaitingRequest(self.global_id(req.request_id), int(req.num_tokens)))
        for req in sched.running:
            if self._pinned_reason(req) is None:
                nb = self._kv_blocks(req)
                running.append(RunningRequest(self.global_id(req.request_id), int(req.num_computed_tokens), nb))
                movable_blocks += nb
            else:
                pinned_running += 1
        free = int(sched.kv_cache_manager.block_pool.get_num_free_blocks())
        # the planner sees free = pool - sum(running kv_blocks): make that the real number of free blocks
        return RankState(rank, tuple(waiting), tuple(running), int(sched.max_num_running_reqs) - pinned_running,
                         free + movable_blocks)

    def export_request(self, req_id: str) -> tuple[RequestState, list[int]]:
        from vllm.v1.request import RequestStatus

        sid = self._sched_id(req_id)
        req = self.scheduler.requests.get(sid)
        if req is None:
            raise MigrationError(f"DP rank {self.rank}: request {req_id} is not in the scheduler")
        why = self._pinned_reason(req)
        if why is not None:
            raise MigrationError(f"DP rank {self.rank}: request {req_id} cannot migrate ({why})")
        running = req.status == RequestStatus.RUNNING
        n_computed = int(req.num_computed_tokens) if running else 0
        nb = self._kv_blocks(req) if running else 0
        blocks = list(self.scheduler.kv_cache_manager.get_block_ids(sid)[0][:nb]) if running else []
        if len(blocks) != nb:
            raise MigrationError(f"DP rank {self.rank}: request {req_id} holds {len(blocks)} blocks, needs {nb}")
        gen_state = self._generator_state(sid)
        origin, away = self._foreign.get(req_id, (self.rank, AwayOutput()))
        sp = req.sampling_params
        # eos_token_id / num_cached_tokens: Request fields of vLLM 0.13, gone in 0.23 (eos in the sampling params)
        extra = {"status": "running" if running else ("preempted" if req.num_output_tokens else "waiting"),
                 "eos_token_id": getattr(req, "eos_token_id", None), "arrival_time": float(req.arrival_time),
                 "priority": int(req.priority), "cache_salt": req.cache_salt,
                 "num_preemptions": int(req.num_preemptions),
                 "num_cached_tokens": int(getattr(req, "num_cached_tokens", -1)),
                 "away": away.to_json()}
        st = RequestState(req_id, origin, tuple(int(t) for t in req.prompt_token_ids),
                          tuple(int(t) for t in req.output_token_ids), sampling_params_to_dict(sp), sp.seed,
                          gen_state, n_computed, nb, extra)
        return st, blocks

    def _generator_state(self, sid: str) -> bytes | None:
        """The sampler generator state of a request in the worker (None without a seeded generator)."""
        return generator_state(self.model_runner, sid)

    def _install_worker_state(self, state: RequestState, req: Any, block_ids: list[int]) -> None:
        """Put the migrated request's ``CachedRequestState`` into the worker's model runner."""
        self.model_runner.requests[req.request_id] = worker_request_state(self.model_runner, state, req.request_id,
                                                                          req.sampling_params, block_ids)

    def release_request(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        # finish_requests frees the blocks and queues the id in finished_req_ids (the worker drops its
        # cached state on the next step); the OutputProcessor is NOT told: the request stays open there
        self.scheduler.finish_requests(self._sched_id(req_id), RequestStatus.FINISHED_ABORTED)
        self._foreign.pop(req_id, None)
        self._foreign_req.pop(req_id, None)

    def _build_request(self, state: RequestState) -> Any:
        from vllm.v1.request import Request

        ex = state.extra
        # vLLM 0.13's Request takes eos_token_id (5th); 0.23's has client_index there (eos is in the params)
        eos = {"eos_token_id": ex.get("eos_token_id")} if "eos_token_id" in inspect.signature(Request).parameters else {}
        req = Request(self._target_id(state), list(state.prompt_token_ids), sampling_params_from_dict(state.sampling_params),
                      None, arrival_time=ex.get("arrival_time"), cache_salt=ex.get("cache_salt"),
                      priority=int(ex.get("priority", 0)), block_hasher=self.core.request_block_hasher, **eos)
        if state.output_token_ids:
            req.append_output_token_ids(list(state.output_token_ids))
        req.num_preemptions = int(ex.get("num_preemptions", 0))
        req.num_cached_tokens = int(ex.get("num_cached_tokens", -1))
        return req

    def allocate_blocks(self, state: RequestState) -> list[int]:
        sched = self.scheduler
        sid = self._target_id(state)
        self._check_new_id(sid)
        req = self._build_request(state)
        blocks = sched.kv_cache_manager.allocate_slots(req, state.num_computed_tokens)
        if blocks is None:
            raise MigrationError(f"DP rank {self.rank}: no room for {state.num_kv_blocks} KV blocks of migrated "
                                 f"request {state.req_id} ({sched.kv_cache_manager.block_pool.get_num_free_blocks()}"
                                 " free)")
        ids = list(sched.kv_cache_manager.get_block_ids(sid)[0])
        self._incoming[sid] = req
        return ids

    def kv_cache_spec(self) -> KVCacheSpec:
        return runner_kv_cache_spec(self.model_runner, int(self.scheduler.kv_cache_config.num_blocks))

    def _check_new_id(self, req_id: str) -> None:
        sched = self.scheduler
        if req_id in sched.requests or req_id in self._incoming:
            raise MigrationError(f"DP rank {self.rank}: migrated request {req_id} is already here")
        if req_id in sched.finished_req_ids:
            raise MigrationError(f"DP rank {self.rank}: request {req_id} left this rank and comes back before a "
                                 "step flushed its worker state (rounds must be >= 1 step apart)")

    def import_request(self, state: RequestState, block_ids: list[int]) -> None:
        from vllm.v1.request import RequestStatus

        sched = self.scheduler
        sid = self._target_id(state)
        if block_ids:
            req = self._incoming.pop(sid)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = int(state.num_computed_tokens)
            sched.requests[req.request_id] = req
            sched.running.append(req)
            self._install_worker_state(state, req, block_ids)
        else:
            self._check_new_id(sid)
            req = self._build_request(state)
            if state.output_token_ids:  # resumes like a local preemption: KV recomputed, worker state kept
                req.status = RequestStatus.PREEMPTED
                self._install_worker_state(state, req, [])
            sched.add_request(req)
        away = AwayOutput.from_json(state.extra.get("away"))
        if state.origin_rank != self.rank:
            self._foreign[state.req_id] = (state.origin_rank, away)
            self._foreign_req[state.req_id] = req
        elif away.token_ids:  # home again: the origin's front end catches up on what was generated away
            self._feed_origin(sid, away, len(state.output_token_ids))

    def pop_finished_remote(self) -> list[FinishedRemote]:
        out, self._finished = self._finished, []
        return out

    def deliver(self, result: FinishedRemote) -> None:
        away = AwayOutput.from_json(result.extra.get("away"))
        if away.finish_reason is None:
            raise MigrationError(f"DP rank {self.rank}: returned result {result.req_id} is not finished")
        self._feed_origin(self.origin_id(result.req_id, self.rank), away, len(result.output_token_ids))

    def _feed_origin(self, req_id: str, away: AwayOutput, total_out: int) -> None:
        op = self.llm_engine.output_processor
        rs = op.request_states.get(req_id)
        if rs is None:
            raise MigrationError(f"DP rank {self.rank}: request {req_id} is not open in this rank's output processor")
        have = len(rs.detokenizer.output_token_ids)
        if have + len(away.token_ids) != total_out:
            raise MigrationError(f"DP rank {self.rank}: request {req_id}: front end has {have} tokens, {len(away.token_ids)} "
                                 f"came back, the request has {total_out}")
        res = op.process_outputs([away.engine_core_output(req_id)])
        if res.reqs_to_abort:
            self.llm_engine.engine_core.abort_requests(res.reqs_to_abort)
        self._ready.extend(res.request_outputs)


#: ``additional_config[ENGINE_CONFIG_KEY]`` section of an engine core process's rebalance settings (server mode)
CORE_SETTINGS_KEY = "rollout_rebalance"


def core_settings(vllm_config: Any) -> RebalanceSettings | None:
    """The rebalance settings an engine core process reads from its own config,
    ``additional_config = {"qwen3_rl": {"rollout_rebalance": {<RebalanceSettings fields>}}}`` (None when absent;
    a bad value raises as ``RebalanceSettings`` does)."""
    from qwen3_rl.rollout.gc_control import ENGINE_CONFIG_KEY

    extra = getattr(vllm_config, "additional_config", None)
    section = extra.get(ENGINE_CONFIG_KEY) if isinstance(extra, dict) else None
    raw = section.get(CORE_SETTINGS_KEY) if isinstance(section, dict) else None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise MigrationError(f"additional_config.{ENGINE_CONFIG_KEY}.{CORE_SETTINGS_KEY} must be a mapping, got "
                             f"{raw!r}")
    return RebalanceSettings(**raw)


class CoreRebalanceHook(VllmRebalanceHook):
    """The rebalance hook of one DP engine core process (``DPEngineCoreProc``, server mode: ``AsyncLLM`` with
    ``data_parallel_size`` > 1), called by the seam's engine-core loop points.

    Same coordinator and engine access as :class:`VllmRebalanceHook`, with what differs there:

    * the engine is the ``EngineCoreProc`` itself (scheduler; the model runner of its uniproc executor, in this
      process); there is no ``OutputProcessor`` in the process;
    * settings come from the engine's own ``additional_config`` (:func:`core_settings`); the hook configures
      itself at its first ``after_engine_core_step``, which every DP engine core reaches in lockstep (real or
      dummy step);
    * rounds run from ``after_engine_core_step``; an own request's result that came back, or the tokens of an
      own request back home, leave as one ``EngineCoreOutput`` of this (origin) engine to the request's client
      (``Request.client_index``, kept while the request is away), so ``AsyncLLM``'s output processor in the
      front end finishes it like any other; hosted requests' outputs are filtered out as in sync mode.

    When the executor runs the model in other processes (vLLM's multiprocess executor; verl's
    ``ExternalZeroMQDistributedExecutor`` on its hybrid workers) the engine core cannot reach the KV cache: the
    coordination then goes over the engine cores' own DP group (:class:`ProcessGroupCommunicator`), and the
    worker state and KV of a round go through the executor's ``collective_rpc`` to the workers (:class:`WorkerKV`,
    the coordinator's ``remote_kv``), which move their KV shards over their vLLM DP group.
    """

    def __init__(self, engine_core: Any) -> None:
        super().__init__(engine_core)
        self._core = engine_core
        self._settings = core_settings(getattr(engine_core, "vllm_config", None))
        self._client_of: dict[str, int] = {}  # own (scheduler) id -> client index, while away
        self._out: dict[int, list[Any]] = {}  # client index -> EngineCoreOutput to send
        #: set when the model (and KV cache) runs in worker processes: the coordinator hands KV moves to it
        self.remote_kv: WorkerKV | None = None

    @property
    def core(self) -> Any:
        return self._core

    def _local_runner(self) -> Any:
        worker = getattr(getattr(self._core.model_executor, "driver_worker", None), "worker", None)
        return getattr(worker, "model_runner", None)

    @property
    def model_runner(self) -> Any:
        runner = self._local_runner()
        if runner is None:
            raise MigrationError(f"DP rank {self.rank}: the model runs in worker processes "
                                 f"({type(self._core.model_executor).__name__}); use the workers' KV path")
        return runner

    def configure(self, settings: RebalanceSettings, max_moves: int, **kwargs: Any) -> None:
        """As :meth:`VllmRebalanceHook.configure`; when the executor runs the model in other processes, the
        coordination goes over the engine cores' own DP group (vLLM's stateless gloo group of
        ``DPEngineCoreProc``) and the KV over the workers' DP device group (:class:`WorkerKV`)."""
        if not settings.enable or self._local_runner() is not None:
            super().configure(settings, max_moves, **kwargs)
            return
        group = getattr(self._core, "dp_group", None)
        if group is None:
            raise MigrationError("rollout rebalance in an engine core with remote workers needs DPEngineCoreProc's "
                                 "DP group (vLLM data_parallel_size > 1)")
        comm = ProcessGroupCommunicator(group, settings.timeout_s)
        self.remote_kv = WorkerKV(self._core.model_executor, int(self.scheduler.kv_cache_config.num_blocks),
                                  settings.timeout_s)
        super().configure(settings, max_moves, comm=comm, kv_comm=comm)
        assert self.coordinator is not None
        self.coordinator.kv_path = "workers"
        logger.info("rollout rebalance: DP rank %d, the KV moves between the model workers over their vLLM DP "
                    "group (%s executor)", self.rank, type(self._core.model_executor).__name__)

    def _generator_state(self, sid: str) -> bytes | None:
        if self.remote_kv is None:
            return super()._generator_state(sid)
        return self.remote_kv.call(worker_generator_state, sid)[0]

    def _install_worker_state(self, state: RequestState, req: Any, block_ids: list[int]) -> None:
        if self.remote_kv is None:
            super()._install_worker_state(state, req, block_ids)
            return
        self.remote_kv.call(worker_install_request, state, req.request_id,
                            sampling_params_to_dict(req.sampling_params), list(block_ids))

    def kv_cache_spec(self) -> Any:
        if self.remote_kv is None:
            return super().kv_cache_spec()
        return self.remote_kv.spec()

    def has_unfinished(self) -> bool:
        return bool(super().has_unfinished() or any(self._out.values()))

    def export_request(self, req_id: str) -> tuple[RequestState, list[int]]:
        st, blocks = super().export_request(req_id)
        if st.origin_rank == self.rank:
            sid = self._sched_id(req_id)
            self._client_of[sid] = int(self.scheduler.requests[sid].client_index)
        return st, blocks

    def _build_request(self, state: RequestState) -> Any:
        req = super()._build_request(state)
        if state.origin_rank == self.rank:  # home again: its client
            req.client_index = self._client_of.pop(req.request_id, 0)
        return req

    def _feed_origin(self, req_id: str, away: AwayOutput, total_out: int) -> None:
        out = away.engine_core_output(req_id)
        client = self._client_of.pop(req_id, None) if out.finished else self._client_of.get(req_id)
        if client is None:
            client = int(getattr(self.scheduler.requests.get(req_id), "client_index", 0))
        self._out.setdefault(client, []).append(out)

    def after_engine_core_step(self) -> dict[int, Any]:
        """Count the step (real or dummy), configure at the first one, run a round when due; returns the
        ``EngineCoreOutputs`` of own requests whose results or tokens came back, per client index."""
        from vllm.v1.engine import EngineCoreOutputs

        if self._settings is not None:
            settings, self._settings = self._settings, None
            self.configure(settings, settings.max_moves)
        if self.coordinator is None:
            return {}
        self.steps += 1
        self.coordinator.on_step(self.steps)
        out, self._out = self._out, {}
        idx = int(getattr(self._core, "engine_index", 0))
        return {client: EngineCoreOutputs(engine_index=idx, outputs=outs) for client, outs in out.items() if outs}


class ProcessGroupCommunicator:
    """:class:`~qwen3_rl.rollout.migration.Communicator` over a ``ProcessGroup`` object that torch.distributed has no
    name for (vLLM's stateless DP group of the engine core processes): the group's own ``allgather`` / ``send`` /
    ``recv``, each waited with ``timeout_s``. Ranks are the group's ranks (the DP ranks)."""

    def __init__(self, group: Any, timeout_s: float = 60.0) -> None:
        self.group = group
        self.rank, self.size = int(group.rank()), int(group.size())
        self.timeout_s = float(timeout_s)
        self.round = 0
        self.backend = "gloo"

    def _wait(self, work: Any, what: str, peers: Sequence[int]) -> None:
        from qwen3_rl.rollout.migration import RebalanceTimeoutError

        try:
            ok = work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise RebalanceTimeoutError(f"rollout rebalance round {self.round}, DP rank {self.rank}: {what} with DP "
                                        f"rank(s) {sorted(set(peers))} failed: {e}") from e
        if ok is False:
            raise RebalanceTimeoutError(f"rollout rebalance round {self.round}, DP rank {self.rank}: {what} with DP "
                                        f"rank(s) {sorted(set(peers))} did not complete within {self.timeout_s:g} s")

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        import pickle

        others = [r for r in range(self.size) if r != self.rank]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(self.group.allgather([sizes], [n]), what, others)
        width = int(max(int(x[0]) for x in sizes))
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[:data.numel()] = data
        outs = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(self.group.allgather([outs], [buf]), what, others)
        return [pickle.loads(o[:int(k[0])].numpy().tobytes()) for o, k in zip(outs, sizes, strict=True)]

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 what: str) -> None:
        seq: dict[tuple[str, int], int] = {}
        works = []
        for dst, t in sends:
            tag = seq.setdefault(("s", dst), 0)
            seq["s", dst] = tag + 1
            works.append((self.group.send([t.contiguous()], dst, tag), dst))
        for src, t in recvs:
            tag = seq.setdefault(("r", src), 0)
            seq["r", src] = tag + 1
            works.append((self.group.recv([t], src, tag), src))
        for w, peer in works:
            self._wait(w, what, [peer])


class WorkerKV:
    """The KV side of a round when the model runs in worker processes (``remote_kv`` of
    :class:`~qwen3_rl.rollout.migration.EngineHooks`): each call is one ``collective_rpc`` of the engine core's
    executor to all its workers (every TP rank moves its own KV shard to the same TP rank of the other DP rank,
    over the workers' vLLM DP group, ``get_dp_group().device_group``: HCCL on an A3, gloo on vLLM's CPU platform).
    Both DP ranks' engine cores call it in the same round, so their workers meet in the same P2P exchange."""

    def __init__(self, executor: Any, num_blocks: int, timeout_s: float) -> None:
        self.executor, self.num_blocks, self.timeout_s = executor, int(num_blocks), float(timeout_s)
        self._spec: Any = None

    def call(self, fn: Any, *args: Any) -> list[Any]:
        return list(self.executor.collective_rpc(fn, args=args))

    def spec(self) -> Any:
        if self._spec is None:
            bpb = max(int(b) for b in self.call(worker_kv_bytes_per_block, self.num_blocks))
            self._spec = _RemoteKVSpec(bpb)
        return self._spec

    def move_kv(self, sends: list, recvs: list, chunk_bytes: int, what: str) -> tuple[int, int]:
        res = self.call(worker_move_kv, self.num_blocks, sends, recvs, int(chunk_bytes), self.timeout_s, what)
        return sum(int(r[0]) for r in res), sum(int(r[1]) for r in res)

    def probe_link(self, probe_bytes: int, chunk_bytes: int) -> tuple[float, int, int]:
        res = self.call(worker_probe_link, self.num_blocks, int(probe_bytes), int(chunk_bytes), self.timeout_s)
        return max(float(r[0]) for r in res), sum(int(r[1]) for r in res), sum(int(r[2]) for r in res)


@dataclass(frozen=True)
class _RemoteKVSpec:
    bytes_per_block: int


# -- run in the model worker processes (collective_rpc: ``fn(worker, *args)``) --------------------------------
def _worker_dp_kv_comm(worker: Any, timeout_s: float) -> TorchDistCommunicator:
    group = _dp_device_group()
    if group is None:
        raise MigrationError("the model worker has no vLLM DP device group")
    return TorchDistCommunicator(group, timeout_s=timeout_s, batched=True)


def worker_kv_bytes_per_block(worker: Any, num_blocks: int) -> int:
    """Bytes of one KV block of this worker's cache (its TP shard)."""
    return int(runner_kv_cache_spec(worker.model_runner, num_blocks).bytes_per_block)


def worker_generator_state(worker: Any, req_id: str) -> bytes | None:
    """A request's sampler generator state in this worker."""
    return generator_state(worker.model_runner, req_id)


def worker_install_request(worker: Any, state: RequestState, req_id: str, sp: dict[str, Any],
                           block_ids: list[int]) -> None:
    """Put a migrated request's ``CachedRequestState`` into this worker's model runner."""
    runner = worker.model_runner
    runner.requests[req_id] = worker_request_state(runner, state, req_id, sampling_params_from_dict(sp), block_ids)


def worker_move_kv(worker: Any, num_blocks: int, sends: list, recvs: list, chunk_bytes: int, timeout_s: float,
                   what: str) -> tuple[int, int]:
    """This worker's part of a round's KV moves (its shard), over its vLLM DP device group."""
    from qwen3_rl.rollout import migration

    spec = runner_kv_cache_spec(worker.model_runner, num_blocks)
    return migration.move_kv_blocks(spec, _worker_dp_kv_comm(worker, timeout_s), sends, recvs, staging=None,
                                    chunk_bytes=chunk_bytes, what=what)


def worker_probe_link(worker: Any, num_blocks: int, probe_bytes: int, chunk_bytes: int,
                      timeout_s: float) -> tuple[float, int, int]:
    """This worker's part of the KV link probe (``migration.probe_link_time``)."""
    from qwen3_rl.rollout.migration import probe_link_time

    spec = runner_kv_cache_spec(worker.model_runner, num_blocks)
    return probe_link_time(spec, _worker_dp_kv_comm(worker, timeout_s), probe_bytes, chunk_bytes, None)


def _dp_device_group() -> Any:
    """The vLLM DP group's device group (``GroupCoordinator.device_group``: HCCL / NCCL / gloo on CPU), or None
    when vLLM's parallel state has none."""
    from vllm.distributed.parallel_state import get_dp_group

    try:
        return getattr(get_dp_group(), "device_group", None)
    except AssertionError:  # parallel state not initialised
        return None


def _dp_rebalance_group(timeout_s: float) -> Any:
    """A gloo group over this process's vLLM DP group with ``timeout_s`` (created collectively: every
    process of the world gathers everyone's DP group and creates all groups in the same order)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_dp_group

    mine = list(get_dp_group().ranks)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    own = None
    for ranks in dp_groups_from_ranks(per_rank):
        g = dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=timeout_s), backend="gloo")
        if dist.get_rank() in ranks:
            own = g
    return own


__all__: Sequence[str] = ("VllmRebalanceHook", "CoreRebalanceHook", "core_settings", "AwayOutput", "sampling_params_to_dict", "sampling_params_from_dict",
                          "kv_block_axis", "dp_groups_from_ranks", "default_buckets", "encode_array",
                          "decode_array")
