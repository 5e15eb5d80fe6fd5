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
  ``token_ids_cpu[i, :num_prompt_tokens[i]]``; group key = hash of the prompt ids), then catch up;
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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from qwen3_rl.spec_decode.config import SamOptions
from qwen3_rl.spec_decode.sam import SamProposer, group_key
from qwen3_rl.spec_decode.sibling_exchange import SiblingExchange


class SamRunnerDrafter:
    """SAM drafting over a runner's persistent batch.

    Args:
        k: number of speculative tokens (``num_speculative_tokens``).
        options: validated ``sam_config`` options.
        max_model_len: the engine's max model length (tokens); drafts never exceed it.
    """

    def __init__(self, k: int, options: SamOptions, max_model_len: int) -> None:
        self.k = int(k)
        self.options = options
        self.max_model_len = int(max_model_len)
        self.drafter = SamProposer(options.sam_config(self.k))
        self._fed: dict[str, int] = {}  # req_id -> tokens held by the automaton
        self._paused: set[str] = set()
        # sibling exchange (sam_config.group_exchange): its rank is set by the engine hook (exchange_hook.py)
        self.exchange: SiblingExchange | None = (
            SiblingExchange(self.drafter, -1, options.exchange_max_bytes) if options.group_exchange else None)
        self.drafter.max_shadows_per_group = options.exchange_max_siblings
        self.drafter.max_shadow_tokens = options.exchange_max_shadow_tokens

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
        for i, r in enumerate(req_ids):
            have = self._fed.get(r)
            if have is None:
                plen = int(input_batch.num_prompt_tokens[i])
                prompt = tok[i, :plen]
                gid = group_key(prompt)
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

    def propose(self, input_batch: Any, valid_sampled_token_ids: Sequence[Sequence[int]], slots: np.ndarray
                ) -> list[list[int]]:
        """Drafts per batch row (as vLLM's n-gram adapter: none for rows with no sampled token this step,
        for requests whose sampling needs no speculation, or at the max model length)."""
        n = len(valid_sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(n)]
        unsupported = input_batch.spec_decode_unsupported_reqs
        num = input_batch.num_tokens_no_spec
        req_ids = input_batch.req_ids
        rows = [i for i in range(n) if valid_sampled_token_ids[i] and req_ids[i] not in unsupported
                and num[i] < self.max_model_len - 1]
        if not rows:
            return out
        rows_a = np.asarray(rows, np.int64)
        drafts, counts = self.drafter.propose_arrays(np.ascontiguousarray(slots[rows_a]), self.k)
        room = self.max_model_len - 1 - np.asarray(num[rows_a], np.int64)  # draft + bonus must fit
        pad = self.options.pad_drafts
        for j, i in enumerate(rows):
            lim = int(min(self.k, room[j]))
            c = int(min(counts[j], lim))
            d = drafts[j, :c].tolist()
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
