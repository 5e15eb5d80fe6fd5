"""SAM behind vLLM 0.23's ``custom_class`` proposer interface (``custom_class_proposer.py``), without vLLM.

The interface passes no request ids: the proposer recognises each row's request from its text (``RowIdentity``).
Checked on a runner-like batch (token buffer + counts, rows condensed when a request finishes, as vLLM's
``InputBatch.condense`` moves the last rows into the holes):

* the drafts equal those of the seed set's ``SamRunnerDrafter`` given the true request ids, step by step;
* positive control: a proposer that forgets identities (every row new each step) drafts differently;
* requests that leave are released after ``max_absent_steps``; one coming back is fed again from the buffer;
* options that need request ids (group mode, history) are refused in one line unless the worker binds the proposer
  to its runner (``custom_class_worker``); bound, group mode drafts a finished sibling's response.

The real engine run (vLLM 0.23.0's CPU engine) is ``tests/engine_current/test_current_spec_decode.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from qwen3_rl.spec_decode.config import parse_sam_options, split_gate_option
from qwen3_rl.spec_decode.custom_class_proposer import BINDING_WORKERS, RowIdentity, SamCustomClassProposer
from qwen3_rl.spec_decode.ngram_seat import NgramSeatMixin
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter

K = 3
MAX_LEN = 4096
ROWS = 8


def vllm_config(k: int = K, sam_config: dict | None = None, worker_cls: str = "auto") -> SimpleNamespace:
    extra = {"qwen3_rl": {"sam_config": sam_config}} if sam_config is not None else {}
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=MAX_LEN),
                           scheduler_config=SimpleNamespace(max_num_seqs=ROWS), additional_config=extra,
                           parallel_config=SimpleNamespace(worker_cls=worker_cls))


class Batch:
    """A runner's persistent batch: token buffer, counts, prompt lengths, request ids per row (condensed)."""

    def __init__(self) -> None:
        self.tok = np.zeros((ROWS, MAX_LEN), np.int32)
        self.num = np.zeros(ROWS, np.int32)
        self.plen = np.zeros(ROWS, np.int32)
        self.ids: list[str] = []

    def add(self, rid: str, prompt: np.ndarray) -> None:
        i = len(self.ids)
        self.ids.append(rid)
        self.tok[i, : prompt.size] = prompt
        self.num[i] = self.plen[i] = prompt.size

    def remove(self, rid: str) -> None:
        """Finish ``rid``; the last row moves into its place (``InputBatch.condense``)."""
        i, last = self.ids.index(rid), len(self.ids) - 1
        if i != last:
            self.tok[i], self.num[i], self.plen[i] = self.tok[last], self.num[last], self.plen[last]
            self.ids[i] = self.ids[last]
        self.ids.pop()

    def view(self) -> SimpleNamespace:
        n = len(self.ids)
        return SimpleNamespace(num_reqs=n, req_ids=list(self.ids), req_id_to_index={r: i for i, r in enumerate(self.ids)},
                               token_ids_cpu=self.tok, num_tokens_no_spec=self.num[:n].copy(),
                               num_prompt_tokens=self.plen[:n].copy(), spec_decode_unsupported_reqs=set())


def text(seed: int, n: int) -> np.ndarray:
    """Periodic-ish token text (period 11 + noise): suffix matches, so drafts happen."""
    rng = np.random.default_rng(seed)
    base = (np.arange(n) * 7 + seed) % 11 + 20 * (seed % 3)
    noise = rng.random(n) < 0.15
    return np.where(noise, rng.integers(100, 200, n), base).astype(np.int32)


def run(k: int = K, sam_config: dict | None = None, make_keys_forget: bool = False
        ) -> tuple[list, list, SamCustomClassProposer]:
    """Drive both drafters over the same batch history: 6 requests, one finishing (condense) at step 10, one more
    joining at step 12, one paused for 3 steps (out of the batch, back later). Returns both draft lists."""
    ours = SamCustomClassProposer(vllm_config(k, sam_config))
    ref = SamRunnerDrafter(parse_sam_options(split_gate_option(sam_config)[0], k), MAX_LEN)  # never gated
    full = {f"r{j}": text(j, 400) for j in range(8)}
    b = Batch()
    for j in range(6):
        b.add(f"r{j}", full[f"r{j}"][:40])
    paused: tuple[str, int, int] | None = None
    got, want = [], []
    for step in range(30):
        if step == 10:
            b.remove("r1")
        if step == 12:
            b.add("r6", full["r6"][:40])
        if step == 15:  # r3 preempted: leaves the batch (its row condensed) and comes back at step 18
            i = b.ids.index("r3")
            paused = ("r3", int(b.num[i]), int(b.plen[i]))
            b.remove("r3")
        if step == 18 and paused is not None:
            rid, n, p = paused
            b.add(rid, full[rid][:p])
            b.num[len(b.ids) - 1] = n
            b.tok[len(b.ids) - 1, :n] = full[rid][:n]
        for i, rid in enumerate(b.ids):  # this step's accepted tokens: 1..3 each
            adv = 1 + (step + i) % 3
            n = int(b.num[i])
            b.tok[i, n: n + adv] = full[rid][n: n + adv]
            b.num[i] = n + adv
        sampled = [[1]] * len(b.ids)
        if make_keys_forget:
            ours.rows.row_keys = []
            ours.rows.parked.clear()
        got.append(ours.propose(sampled, b.num.copy(), b.tok))
        v = b.view()
        want.append(ref.step(v, sampled, {r: None for r in b.ids + ([paused[0]] if paused else [])}, None))
    return got, want, ours


ADAPTIVE = {"adaptive_k": True}


@pytest.mark.parametrize("k,opts", [(K, None), (7, ADAPTIVE), (7, {**ADAPTIVE, "pad_drafts": True})])
def test_drafts_equal_the_runner_drafter_with_true_ids(k: int, opts: dict | None) -> None:
    got, want, ours = run(k, opts)
    assert got == want
    assert sum(len(d) for step in got for d in step) > 100  # drafting happened
    # 7 requests; r3 back after preemption and every condensed row recognised, not re-added
    assert ours.rows.new == 7 and ours.rows.moved >= 2, (ours.rows.new, ours.rows.moved)


def test_positive_control_forgetting_rows() -> None:
    """Without the row identity every row is a new request each step: per request the drafts depend on the text
    only (the same drafts, each text fed again every step), but adaptive k loses each request's acceptance record
    and drafts differently."""
    got, want, ours = run(make_keys_forget=True)
    assert got == want and ours.rows.new > 100
    got, want, ours = run(7, ADAPTIVE, make_keys_forget=True)
    assert got != want


def test_absent_requests_are_released_and_fed_again_on_return() -> None:
    rows = RowIdentity(max_absent_steps=2, max_paused=8)
    tok = np.zeros((2, 64), np.int32)
    tok[0, :10] = np.arange(10) + 1
    tok[1, :10] = np.arange(10) + 50
    keys, alive = rows.assign(np.array([10, 10]), tok)
    rows.fed_to(keys, np.array([10, 10]), tok)
    assert keys == ["row-0", "row-1"] and alive == {"row-0", "row-1"}
    only0 = np.array([10])
    for step in range(3):  # row 1's request is missing
        keys, alive = rows.assign(only0, tok)
        rows.fed_to(keys, only0, tok)
        assert keys == ["row-0"]
        assert ("row-1" in alive) == (step < 2), (step, alive)
    assert rows.released == 1
    tok[0] = tok[1]  # it comes back (in row 0): a new key, fed from the buffer
    keys, _ = rows.assign(only0, tok)
    assert keys == ["row-2"] and rows.new == 3


@pytest.mark.parametrize("opts", [{"group_mode": True}, {"group_mode": True, "history_responses": 2}])
def test_options_needing_request_ids_are_refused_without_the_binding_worker(opts: dict) -> None:
    with pytest.raises(ValueError, match="need request ids") as e:
        SamCustomClassProposer(vllm_config(sam_config=opts))
    assert "\n" not in str(e.value) and BINDING_WORKERS[0] in str(e.value)
    ours = SamCustomClassProposer(vllm_config(sam_config=opts, worker_cls=BINDING_WORKERS[0]))  # accepted
    assert ours.config.group_mode and ours.runner is None


def test_bound_proposer_drafts_from_the_runners_batch() -> None:
    """Bound to a runner (``custom_class_worker``), group mode drafts from the runner's ids and live requests: the
    second sample of a prompt drafts its finished sibling's response (the finished-response cache)."""
    ours = SamCustomClassProposer(vllm_config(sam_config={"group_mode": True}, worker_cls=BINDING_WORKERS[0]))
    b = Batch()
    rng = np.random.default_rng(5)  # no repeats: the sibling's response is the only earlier occurrence
    prompt, resp = rng.permutation(5000)[:30].astype(np.int32), rng.permutation(5000)[:60].astype(np.int32) + 5000
    b.add("a", prompt)
    runner = SimpleNamespace(input_batch=None, requests={"a": None})
    ours.bind_runner(runner)
    for n in range(1, 60):  # sample "a" decodes its response, then finishes
        b.tok[0, 30: 30 + n] = resp[:n]
        b.num[0] = 30 + n
        runner.input_batch = b.view()
        ours.propose([[1]], b.num.copy(), b.tok)
    b.remove("a")
    runner.requests = {"b": None}
    b.add("b", prompt)
    b.tok[0, 30] = resp[0]
    b.num[0] = 31
    runner.input_batch = b.view()
    draft = ours.propose([[1]], b.num.copy(), b.tok)[0]
    assert draft == resp[1: 1 + K].tolist(), draft
    assert ours.rows.new == 0  # the text-recognition path was not used


def test_exchange_is_refused() -> None:
    with pytest.raises(ValueError, match="engine-step hook"):
        SamCustomClassProposer(vllm_config(sam_config={"group_mode": True, "group_exchange": True},
                                           worker_cls=BINDING_WORKERS[0]))


def test_bad_option_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="unknown option") as e:
        SamCustomClassProposer(vllm_config(sam_config={"adaptive": True}))
    assert "\n" not in str(e.value)


def rows_per_step() -> list[int]:
    """Batch rows at each of ``run``'s 30 steps (6; 5 while r1 is gone and before r6 joins; 5 while r3 is away)."""
    return [5 if step in (10, 11, 15, 16, 17) else 6 for step in range(30)]


@pytest.mark.parametrize("threshold", [5, 6])
def test_batch_size_gate_from_sam_config(threshold: int) -> None:
    """``sam_config.disable_by_batch_size`` (the current set's form of vLLM 0.13's ``disable_by_batch_size``): no
    drafts in a step with more rows than the threshold; at or below it the same drafts as the never-gated drafter
    (fed while off, so nothing was lost). Threshold 6 = every step's batch: the positive control, nothing gated."""
    got, want, ours = run(K, {"disable_by_batch_size": threshold})
    assert ours.config == parse_sam_options(None, K)  # the option is the gate's, not the drafter's
    rows = rows_per_step()
    for step, (g, w, n) in enumerate(zip(got, want, rows, strict=True)):
        assert g == (w if n <= threshold else [[]] * n), step
    on = [n <= threshold for n in rows]
    drafted_on = sum(len(d) for step, o in zip(got, on, strict=True) if o for d in step)
    assert drafted_on > 0 and ours.gate.steps_on == sum(on) and ours.gate.steps_off == on.count(False)
    print(f"threshold {threshold}: {sum(on)} of 30 steps drafted, {drafted_on} draft tokens")


@pytest.mark.parametrize("bad", [0, -1, True, "4", 2.5])
def test_bad_batch_size_threshold_is_refused_in_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match="sam_config.disable_by_batch_size") as e:
        SamCustomClassProposer(vllm_config(sam_config={"disable_by_batch_size": bad}))
    assert "\n" not in str(e.value)


def test_ngram_seat_takes_the_gate_from_sam_config() -> None:
    """The vLLM 0.23 n-gram seats' shared part (``ngram_seat.NgramSeatMixin``): drafts of the runner's batch, none
    while the batch holds more rows than ``sam_config.disable_by_batch_size``."""
    b = Batch()
    for j in range(3):
        b.add(f"r{j}", np.tile(text(j, 20), 3))  # repeated text: a suffix match at once
    runner = SimpleNamespace(input_batch=b.view(), requests={r: None for r in b.ids})
    gated = NgramSeatMixin(vllm_config(sam_config={"disable_by_batch_size": 2}), runner)
    open_ = NgramSeatMixin(vllm_config(sam_config={"disable_by_batch_size": 3}), runner)
    assert gated.gate.threshold == 2 and open_.gate.threshold == 3
    assert gated.propose([[1]] * 3) == [[], [], []]
    drafts = open_.propose([[1]] * 3)
    assert all(len(d) == K for d in drafts), drafts
