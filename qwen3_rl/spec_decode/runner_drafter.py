"""SAM drafter driven by a vLLM v1 model runner's persistent batch (the logic of the Ascend adapter).

The runner keeps, per batch row ``i``, the request's text in ``input_batch.token_ids_cpu[i]``: prompt
+ every accepted token; ``num_tokens_no_spec[i]`` counts them (draft tokens that were scheduled
for verification sit beyond it and are never read here). vLLM-Ascend 0.13 calls the drafter after
``_bookkeeping_sync`` has appended this step's accepted tokens (``model_runner_v1.py:1721-1749``),
so the buffer is the single source of truth: each step the drafter appends
``token_ids_cpu[i, fed:num_tokens_no_spec[i]]`` to the request's automaton (``fed`` = tokens it
already holds). This feeds accepted tokens only, and catches up after steps without drafting
(batch-size threshold), after preemption, and after chunked prefill.

Lifecycle, from the runner's own state (no scheduler event is needed, so none can be missed):

* a batch row whose request the drafter does not hold -> ``add_request`` (prompt =
  ``token_ids_cpu[i, :num_prompt_tokens[i]]``; group key = hash of the prompt ids, or of their first
  ``extra_args[GROUP_PROMPT_LEN_KEY]`` when the request's sampling parameters carry it: a request resumed after a
  weight sync carries its response so far in its prompt and stays in its siblings' group), then catch up;
* a held request absent from the batch but still in ``runner.requests`` (preempted, or not scheduled
  this step) -> ``preempt``; back in the batch -> ``resume`` and catch up; if the runner's text
  became shorter than what the drafter holds (tokens discarded after a KV-load failure) the
  request is rebuilt from the buffer;
* a held request in ``scheduler_output.finished_req_ids``, or no longer in ``runner.requests``, or
  re-submitted under the same id (in ``scheduled_new_reqs``) -> ``finish`` (memory released; in
  group mode its response enters the finished-response cache).

The drafter reads the runner's buffers and writes none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from qwen3_rl.spec_decode.adaptive_k import AdaptiveK
from qwen3_rl.spec_decode.config import table_for
from qwen3_rl.spec_decode.history import resolve_max_bytes
from qwen3_rl.spec_decode.sam import SamConfig, SamProposer, group_key
from qwen3_rl.spec_decode.sibling_exchange import SiblingExchange

#: ``SamplingParams.extra_args`` key: how many leading prompt tokens name the request's group (the fully-async
#: rollout sets it on a request resumed after a weight sync: original prompt + its response so far)
GROUP_PROMPT_LEN_KEY = "qwen3_rl_group_prompt_len"


def group_prompt_len(state: Any, num_prompt_tokens: int) -> int:
    """Prompt tokens that name the group of a request whose runner state is ``state`` (``runner.requests[id]``, or
    None): ``extra_args[GROUP_PROMPT_LEN_KEY]`` of its sampling parameters, clipped to ``[1, num_prompt_tokens]``,
    else the whole prompt."""
    extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
    n = extra.get(GROUP_PROMPT_LEN_KEY) if isinstance(extra, Mapping) else None
    return num_prompt_tokens if n is None else max(1, min(int(n), num_prompt_tokens))


class SamRunnerDrafter:
    """SAM drafting over a runner's persistent batch.

    Builds the drafter and compiles every kernel it will call (``_warm_up``) so the engine's first decode step
    compiles nothing.

    Args:
        config: the drafter's config (``config.parse_sam_options``; k = ``num_speculative_tokens``).
        max_model_len: the engine's max model length (tokens); drafts never exceed it.
    """

    def __init__(self, config: SamConfig, max_model_len: int) -> None:
        self._setup(config, max_model_len, rank=-1)
        if self.drafter.history is not None:  # the store's bound, once per engine process
            print(resolve_max_bytes(config.history_max_bytes, drafters=config.history_drafters)[1], flush=True)
        _warm_up(config)

    def _setup(self, config: SamConfig, max_model_len: int, rank: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = int(max_model_len)
        self.drafter = SamProposer(config)
        self._fed: dict[str, int] = {}  # req_id -> tokens held by the automaton
        self._paused: set[str] = set()
        # sibling exchange (sam_config.group_exchange): its rank is set by the engine hook (exchange_hook.py)
        self.exchange: SiblingExchange | None = (
            SiblingExchange(self.drafter, rank, config.exchange_max_bytes) if config.group_exchange else None)
        # adaptive draft length (sam_config.adaptive_k): k = num_speculative_tokens is then k_max
        self.adaptive: AdaptiveK | None = (
            AdaptiveK(config.num_speculative_tokens, config.adaptive_k_min, config.verify_base_ms,
                      config.verify_seq_ms, config.verify_token_ms, config.verify_kctx_ms, uniform=config.pad_drafts,
                      table=table_for(config))
            if config.adaptive_k else None)
        self._drafted: dict[str, int] = {}  # adaptive: draft tokens proposed to each request last step

    # ------------------------------------------------------------------ lifecycle
    @property
    def request_ids(self) -> set[str]:
        return set(self._fed)

    def fed(self, req_id: str) -> int:
        """Tokens of ``req_id`` the automaton holds (prompt + accepted)."""
        return self._fed[req_id]

    def is_paused(self, req_id: str) -> bool:
        return req_id in self._paused

    def _finish(self, req_id: str) -> None:
        if self.exchange is not None:
            self.exchange.before_finish(req_id)
        self.drafter.finish(req_id)
        del self._fed[req_id]
        self._paused.discard(req_id)
        self._drafted.pop(req_id, None)

    def release_all(self) -> None:
        """Finish every held request (engine reset / sleep)."""
        for r in list(self._fed):
            self._finish(r)
        if self.exchange is not None:
            self.drafter.close_shadows()

    def exchange_round(self, all_gather: Any) -> int:
        """One sibling exchange (every DP rank at the same engine step): send this rank's new tokens,
        append the other ranks' to the shadow strings. ``all_gather``: message -> every rank's message.
        Returns the tokens merged here."""
        if self.exchange is None:
            raise RuntimeError("sam_config.group_exchange is off")
        return self.exchange.merge(all_gather(self.exchange.pack()))

    def _lifecycle(self, input_batch: Any, live: Mapping[str, Any] | None, scheduler_output: Any) -> None:
        finished: Iterable[str] = getattr(scheduler_output, "finished_req_ids", None) or ()
        for r in finished:
            if r in self._fed:
                self._finish(r)
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            if new.req_id in self._fed:  # same id submitted again: the old request is over
                self._finish(new.req_id)
        in_batch = input_batch.req_id_to_index
        for r in [r for r in self._fed if r not in in_batch]:
            if live is not None and r not in live:
                self._finish(r)
            elif r not in self._paused:
                self.drafter.preempt(r)
                self._paused.add(r)

    # ------------------------------------------------------------------ per step
    def observe(self, input_batch: Any, live: Mapping[str, Any] | None = None, scheduler_output: Any = None
                ) -> np.ndarray:
        """Bring the automata in line with the runner's batch; returns the drafter slots, int32[num_reqs].

        Args:
            input_batch: vLLM ``InputBatch`` (rows ``0..num_reqs-1`` in use after ``condense``).
            live: ``runner.requests`` (every unfinished request the worker holds), or None.
            scheduler_output: this step's ``SchedulerOutput`` (``finished_req_ids``, ``scheduled_new_reqs``).
        """
        self._lifecycle(input_batch, live, scheduler_output)
        n = input_batch.num_reqs
        req_ids: Sequence[str] = input_batch.req_ids[:n]
        tok = input_batch.token_ids_cpu
        num = np.asarray(input_batch.num_tokens_no_spec[:n], dtype=np.int64)
        fed = np.empty(n, np.int64)
        d = self.drafter
        fresh: list[str] = []
        for i, r in enumerate(req_ids):
            have = self._fed.get(r)
            if have is None:
                fresh.append(r)
                plen = int(input_batch.num_prompt_tokens[i])
                prompt = tok[i, :plen]
                gid = group_key(prompt[:group_prompt_len(None if live is None else live.get(r), plen)])
                d.add_request(r, prompt, group_id=gid)
                if self.exchange is not None:
                    self.exchange.track(r, gid, plen)
                have = plen
            elif r in self._paused:
                d.resume(r)
                self._paused.discard(r)
            if num[i] < have:  # runner dropped tokens: rebuild from its buffer
                d.resume(r, tok[i, : num[i]])
                have = int(num[i])
                if self.exchange is not None:
                    self.exchange.resync(r)
            fed[i] = have
        slots = np.fromiter((d.slot_of(r) for r in req_ids), np.int32, n)
        delta = num - fed
        if self.adaptive is not None:
            self._observe_acceptance(req_ids, slots, delta, fresh)
        if n and int(delta.max()) > 0:
            rows = np.flatnonzero(delta > 0)
            lens = delta[rows]
            offs = np.zeros(rows.shape[0] + 1, np.int64)
            np.cumsum(lens, out=offs[1:])
            row_of = np.repeat(rows, lens)
            col = fed[row_of] + (np.arange(int(offs[-1]), dtype=np.int64) - np.repeat(offs[:-1], lens))
            toks = np.ascontiguousarray(tok[row_of, col], dtype=np.int32)
            d.extend_arrays(np.ascontiguousarray(slots[rows]), toks, offs)
        for i, r in enumerate(req_ids):
            self._fed[r] = int(num[i])
        return slots

    def _observe_acceptance(self, req_ids: Sequence[str], slots: np.ndarray, delta: np.ndarray,
                            fresh: Sequence[str]) -> None:
        """Adaptive k: the verification results of last step's drafts. A row that advanced ``delta`` >= 1
        tokens accepted ``delta - 1`` of its draft tokens (the last one is the bonus token)."""
        pol = self.adaptive
        assert pol is not None
        if fresh:
            pol.reset(np.fromiter((self.drafter.slot_of(r) for r in fresh), np.int64, len(fresh)))
        drafted = np.fromiter((self._drafted.get(r, 0) for r in req_ids), np.int64, len(req_ids))
        on = (drafted > 0) & (delta >= 1)
        if on.any():
            pol.observe(slots[on], drafted[on], delta[on] - 1)
        for r in np.asarray(req_ids, dtype=object)[on].tolist():
            self._drafted[r] = 0

    def propose(self, input_batch: Any, valid_sampled_token_ids: Sequence[Sequence[int]], slots: np.ndarray
                ) -> list[list[int]]:
        """Drafts per batch row (as vLLM's n-gram adapter: none for rows with no sampled token this step,
        for requests whose sampling needs no speculation, or at the max model length)."""
        n = len(valid_sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(n)]
        unsupported = getattr(input_batch, "spec_decode_unsupported_reqs", ())  # gone in vLLM 0.23: all supported
        num = input_batch.num_tokens_no_spec
        req_ids = input_batch.req_ids
        rows = [i for i in range(n) if valid_sampled_token_ids[i] and req_ids[i] not in unsupported
                and num[i] < self.max_model_len - 1]
        if not rows:
            return out
        rows_a = np.asarray(rows, np.int64)
        drafts, counts = self.drafter.propose_arrays(np.ascontiguousarray(slots[rows_a]), self.k)
        room = self.max_model_len - 1 - np.asarray(num[rows_a], np.int64)  # draft + bonus must fit
        pad = self.config.pad_drafts
        kk = np.full(len(rows), self.k, np.int64)
        pol = self.adaptive
        if pol is not None:
            avail = np.minimum(counts.astype(np.int64), np.maximum(room, 0))
            ctx = float(np.asarray(num[:n], np.int64).sum())
            dslots = np.ascontiguousarray(slots[rows_a])
            kk = pol.choose(dslots, avail, ctx, n_running=n, match_len=self.drafter.match_lengths(dslots))
            if pad:
                kk[:] = pol.last_k  # one k for the step (uniform decode batch), padded below
        for j, i in enumerate(rows):
            lim = int(min(kk[j], room[j]))
            c = int(min(counts[j], lim))
            d = drafts[j, :c].tolist()
            if pol is not None:  # the policy learns from real draft tokens: pad tokens are no drafts
                self._drafted[req_ids[i]] = c
            if pad and c < lim:
                last = d[-1] if d else int(input_batch.token_ids_cpu[i, num[i] - 1])
                d.extend([last] * (lim - c))
            out[i] = d
        return out

    def step(self, input_batch: Any, valid_sampled_token_ids: Sequence[Sequence[int]],
             live: Mapping[str, Any] | None = None, scheduler_output: Any = None) -> list[list[int]]:
        """``observe`` then ``propose``: one decode step of the runner."""
        slots = self.observe(input_batch, live, scheduler_output)
        return self.propose(input_batch, valid_sampled_token_ids, slots)


# ---------------------------------------------------------------------------------------------- warm-up
#: Warm-up prompt (40 ids < 13, periodic: repeated suffixes, so matches, clones and drafts happen); every
#: row's response is random ids < 16, of which each decode step accepts 1..k + 1 tokens.
_WARM_PROMPT = np.array([(7 * i) % 13 for i in range(40)], np.int32)
_WARM_STEPS = 6  # decode steps of phase 2


def _warm_batch(texts: list[np.ndarray], nums: list[int], prompt_len: int) -> SimpleNamespace:
    """A minimal stand-in of vLLM's ``InputBatch`` over ``texts`` (row i holds ``nums[i]`` valid tokens)."""
    width = max(t.shape[0] for t in texts)
    tok = np.zeros((len(texts), width), np.int32)
    for i, t in enumerate(texts):
        tok[i, : t.shape[0]] = t
    ids = [f"warm-{i}" for i in range(len(texts))]
    return SimpleNamespace(num_reqs=len(texts), req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                           token_ids_cpu=tok, num_tokens_no_spec=np.asarray(nums, np.int32),
                           num_prompt_tokens=np.full(len(texts), prompt_len, np.int32),
                           spec_decode_unsupported_reqs=set())


def _warm_up(config: SamConfig) -> None:
    """Compile and run every kernel a ``SamRunnerDrafter`` with ``config`` calls, on throwaway drafters.

    The numba kernels compile at their first call (seconds each, tens of seconds in all when numba's disk
    cache is cold); without this the first decode step of the engine pays for it. The drafters made here
    are discarded: the caller's drafter holds nothing of them (numba's compiled code is the only effect).

    Phases (the same calls a runner makes, same argument types, so the same compiled signatures):

    1. add + extend: three requests of one prompt enter (root hash growth, state/edge growth, warm pass);
    2. decode: ``_WARM_STEPS`` steps of observe + propose (drafts, cache pointer follow);
    3. lifecycle: requests leave the batch (preempted), come back with a shorter text (rebuilt) and
       finish one per step (group mode: cache insertion, rebuild of a full cache, pointer re-sync);
    4. sibling exchange (only with ``group_exchange``): two ranks exchange every step, one message over
       the cap (pack, capped pack, parse, shadow append).
    """
    opts = dataclasses.replace(config, cache_max_responses=1, cache_max_tokens=16, exchange_max_bytes=128,
                               exchange_max_siblings=0) if config.group_mode else config
    drafters = [SamRunnerDrafter.__new__(SamRunnerDrafter) for _ in range(2 if config.group_exchange else 1)]
    for rank, d in enumerate(drafters):
        d._setup(opts, 1 << 20, rank)
    k = config.num_speculative_tokens
    rng = np.random.default_rng(0)
    texts = [np.concatenate([_WARM_PROMPT, rng.integers(0, 16, 4 * _WARM_STEPS * (k + 1), dtype=np.int32)])
             for _ in range(3)]
    plen = _WARM_PROMPT.shape[0]
    nums = [plen] * len(texts)

    def exchange() -> None:
        if config.group_exchange:
            msgs = [d.exchange.pack() for d in drafters]
            for d in drafters:
                d.exchange.merge(msgs)

    for step in range(_WARM_STEPS):  # phases 1 and 2
        for d in drafters:
            batch = _warm_batch(texts, nums, plen)
            d.step(batch, [[1]] * batch.num_reqs, None, None)
        exchange()
        nums = [n + 1 + (step + i) % (k + 1) for i, n in enumerate(nums)]
    live = {"warm-0": 0, "warm-1": 1, "warm-2": 2}
    for d in drafters:  # phase 3
        d.step(_warm_batch(texts, [n + k + 1 for n in nums], plen), [[1]] * 3, live, None)
        d.observe(_warm_batch(texts[:1], nums[:1], plen), live, None)  # warm-1, warm-2 preempted
    exchange()
    for d in drafters:
        d.step(_warm_batch(texts[:2], [nums[0], nums[1] - 2], plen), [[1]] * 2, live,  # warm-1 shorter: rebuilt
               SimpleNamespace(finished_req_ids={"warm-2"}, scheduled_new_reqs=()))
    exchange()
    for d in drafters:
        d.step(_warm_batch(texts[:2], [nums[0] + 1, nums[1]], plen), [[1]] * 2, live,
               SimpleNamespace(finished_req_ids={"warm-0"}, scheduled_new_reqs=()))
    exchange()
    for d in drafters:
        d.release_all()
