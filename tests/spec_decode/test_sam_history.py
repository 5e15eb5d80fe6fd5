"""SAM history across rollout steps (``SAM_HISTORY``): a prompt's finished responses seed its next group.

Checks: the store's bounds (per prompt, total bytes, least recently used eviction) and that the drafter's
memory figure counts it; a new group of a prompt drafts its first tokens from the earlier visit (positive
control: nothing without history); a response finished on another DP rank reaches this rank's history
through the sibling exchange; on the dev corpus the history raises the bulk tokens per step by >= 10 %.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qwen3_rl.spec_decode.config import parse_sam_options
from qwen3_rl.spec_decode.history import ENTRY_OVERHEAD, HistoryStore
from qwen3_rl.spec_decode.sam import SamConfig, SamProposer, group_key
from qwen3_rl.spec_decode.sibling_exchange import SiblingExchange
from qwen3_rl.tools.bench.drafters import load_corpus, replay_visits

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO.parent / "shared" / "bench" / "rollouts_dev.jsonl"  # ../shared beside the checkout
K = 3
PROMPT = np.arange(1000, 1012, dtype=np.int32)


def _resp(seed: int, n: int = 60) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 500, n).astype(np.int32)


def test_store_bounds_per_prompt_and_total_with_lru() -> None:
    st = HistoryStore(per_prompt_responses=2, per_prompt_tokens=100, max_bytes=3 * (4 * 40 + ENTRY_OVERHEAD))
    a1, a2, a3 = _resp(1, 40), _resp(2, 40), _resp(3, 40)
    st.add("a", a1)
    st.add("a", a2)
    st.add("a", a3)  # third response of "a": the oldest leaves
    assert [r.tolist() for r in st.get("a")] == [a2.tolist(), a3.tolist()]
    st.add("b", _resp(4, 40))  # 3 responses = the byte bound exactly
    assert st.nbytes() == 3 * (160 + ENTRY_OVERHEAD) and len(st) == 2
    st.get("a")  # "a" used: "b" is now the least recently used prompt
    st.add("c", _resp(5, 40))  # over the bound: "b" leaves
    assert "b" not in st and "a" in st and "c" in st and st.evicted_prompts == 1
    assert st.nbytes() <= st.max_bytes
    st.add("d", _resp(6, 250))  # longer than the per-prompt bound: its last 100 tokens kept
    assert st.get("d")[0].tolist() == _resp(6, 250)[-100:].tolist()
    assert st.nbytes() <= st.max_bytes


def test_weighted_store_orders_and_evicts_by_score() -> None:
    st = HistoryStore(per_prompt_responses=3, per_prompt_tokens=1000, max_bytes=1 << 20, weighted=True)
    rs = [_resp(i, 30) for i in range(3)]
    for r in rs:
        st.add("g", r)
    assert st.score("g", [rs[0], _resp(99, 30)], [1.0, 1.0]) == 1  # unknown response ignored
    assert st.get("g")[-1].tolist() == rs[0].tolist()  # the scored one last: preferred by the "recent" rule
    st.add("g", _resp(7, 30))  # over the bound: the lowest-scored oldest (rs[1]) leaves
    assert [r.tolist() for r in st.get("g")][:1] == [rs[2].tolist()]


def _cfg(history: int, cache: int = 0) -> SamConfig:
    return SamConfig(num_speculative_tokens=K, group_mode=True, cache_max_responses=cache, history_responses=history)


@pytest.mark.parametrize("history", [0, 4])
def test_next_visit_drafts_from_the_earlier_responses(history: int) -> None:
    p = SamProposer(_cfg(history))
    resp = _resp(11)
    p.add_request("v1-0", PROMPT)
    p.extend("v1-0", resp)
    p.finish("v1-0")  # last member: the group automaton is freed
    assert p.num_groups() == 0
    p.add_request("v2-0", PROMPT)  # the prompt's next visit
    first = p.propose(["v2-0"], K)[0]
    if history:
        assert first == resp[:K].tolist()  # drafted from the earlier visit's response
        assert p.history_strings == 1
        p.extend("v2-0", resp[:K + 1])
        assert p.propose(["v2-0"], K)[0] == resp[K + 1: 2 * K + 1].tolist()
    else:  # positive control: without history (and no cache) nothing of it is left
        assert first == [] and p.history_strings == 0


def test_memory_figure_counts_the_store_and_automata_are_freed() -> None:
    p = SamProposer(_cfg(2))
    for v in range(3):
        for j in range(3):
            p.add_request(f"{v}-{j}", PROMPT)
        for j in range(3):
            p.extend(f"{v}-{j}", _resp(10 * v + j))
        for j in range(3):
            p.finish(f"{v}-{j}")
    h = p.history
    assert h is not None and h.num_responses(group_key(PROMPT)) == 2
    # only the store is left: the automata (history strings included) were freed with the group
    assert p.nbytes() == h.nbytes() == 2 * (60 * 4 + ENTRY_OVERHEAD)
    assert p.num_tokens() == h.num_tokens() == 120
    p.clear_history()
    assert p.nbytes() == 0


def test_history_needs_group_mode_and_parses_from_sam_config() -> None:
    with pytest.raises(ValueError, match="group_mode"):
        SamConfig(history_responses=4)
    cfg = parse_sam_options({"group_mode": True, "history_responses": 4, "history_max_bytes": 1 << 20}, 3)
    assert cfg.history_responses == 4 and cfg.history_max_bytes == 1 << 20
    with pytest.raises(ValueError, match="history_responses must be int"):
        parse_sam_options({"group_mode": True, "history_responses": "4"}, 3)


def test_response_finished_on_another_rank_serves_the_next_visit() -> None:
    """Rank A runs sample 0 of a prompt, rank B sample 1; A's response reaches B through the sibling exchange
    (shadow string, FIN); at the prompt's next visit B's group starts with it. Positive control: the same
    without the exchange leaves B's history with its own response only."""
    cfg = _cfg(4)
    ra, rb = _resp(21, 80), _resp(22, 80)
    for exchange in (True, False):
        a, b = SamProposer(cfg), SamProposer(cfg)
        ea, eb = SiblingExchange(a, 0), SiblingExchange(b, 1)
        key = group_key(PROMPT)
        a.add_request("a0", PROMPT, key)
        ea.track("a0", key, PROMPT.shape[0])
        b.add_request("b1", PROMPT, key)
        eb.track("b1", key, PROMPT.shape[0])
        a.extend("a0", ra)
        b.extend("b1", rb[:40])
        ea.before_finish("a0")
        a.finish("a0")
        if exchange:
            msgs = [ea.pack(), eb.pack()]
            ea.merge(msgs)
            eb.merge(msgs)
        b.extend("b1", rb[40:])
        eb.before_finish("b1")
        b.finish("b1")
        kept = [r.tolist() for r in b.history.get(key)]  # type: ignore[union-attr]
        assert rb.tolist() in kept
        assert (ra.tolist() in kept) == exchange
        b.add_request("b-next", PROMPT, key)  # next visit on rank B
        b.extend("b-next", ra[:10])
        out = b.propose(["b-next"], K)[0]
        assert (out == ra[10: 10 + K].tolist()) == exchange


def test_history_raises_bulk_tokens_per_step_on_the_dev_corpus() -> None:
    """Goal: with samples 0-3 of each prompt as the earlier visit, bulk tokens/step of the current group
    (samples 4-7, all running together) >= 1.10 x without history."""
    groups = load_corpus(CORPUS)
    base = replay_visits(groups, _cfg(0, 64), K, 4, use_history=False)
    hist = replay_visits(groups, _cfg(4, 64), K, 4, use_history=True)
    print(f"bulk {base['bulk_mean_accepted']:.3f} -> {hist['bulk_mean_accepted']:.3f}, "
          f"tail {base['tail_mean_accepted']:.3f} -> {hist['tail_mean_accepted']:.3f}")
    assert base["response_tokens"] == hist["response_tokens"] > 30000
    assert hist["history_strings"] == 4 * len(groups) and base["history_strings"] == 0
    assert hist["bulk_mean_accepted"] >= 1.10 * base["bulk_mean_accepted"]


def test_bench_cli_history_and_adaptive(tmp_path: Path) -> None:
    """``python -m qwen3_rl.tools.bench.drafters --group --history 4 --adaptive-k 8``, tiny cost run: the three visit
    methods report bulk / tail figures and their cost with the history store filled and within its bound."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "qwen3_rl.tools.bench.drafters", "--corpus", str(CORPUS), "--k", "3", "--group",
           "--history", "4", "--adaptive-k", "8", "--limit-prompts", "3", "--batch", "16", "--context-len", "2048",
           "--cost-steps", "3", "--cost-repeats", "1", "--vllm-tree", str(tmp_path / "no-vllm"),
           "--methods", "sam_group", "sam_group_history", "sam_group_adaptive", "--json"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
    m = json.loads(out.stdout)["methods"]
    for name in ("sam_group", "sam_group_history", "sam_group_adaptive"):
        r = m[name]
        assert r["current_requests"] == 12 and r["tail_steps"] > 0 and r["tail_mean_accepted"] >= 1.0, name
        assert r["us_per_step"] > 0 and 4 <= r["bytes_per_token"] <= 400, name
    assert m["sam_group"]["history_strings"] == 0 and m["sam_group_history"]["history_strings"] == 12
    for name in ("sam_group_history", "sam_group_adaptive"):
        assert m[name]["history_store_within_bound"] and m[name]["history_store_tokens"] == 2 * 4 * 2048 // 4
    assert max(i for i, c in enumerate(m["sam_group_adaptive"]["k_hist"]) if c) > 3
    assert m["vllm_ngram"]["mean_accepted"] is None and m["vllm_ngram"]["unavailable"]


def _contains(hay: np.ndarray, needle: np.ndarray) -> bool:
    """``needle`` occurs as a contiguous run of ``hay`` (both int32)."""
    if needle.shape[0] > hay.shape[0]:
        return False
    win = np.lib.stride_tricks.sliding_window_view(hay, needle.shape[0])
    return bool((win == needle).all(axis=1).any())


def test_cost_history_holds_no_sibling_continuation() -> None:
    """The cost run's history (an earlier visit) must not hold a running sibling's own continuation (its drafts
    would then be accepted in full): reversed responses by default; the verbatim setup holds them (positive
    control of the check)."""
    from qwen3_rl.tools.bench.drafters import build_contexts, history_texts

    groups = load_corpus(CORPUS, limit_prompts=3)
    ctxs, conts, keys = build_contexts(groups, 16, 2048, 16, 8)
    for verbatim in (False, True):
        hist = history_texts(groups, keys, 4, 2048 // 4, verbatim)
        found = sum(_contains(h, conts[r]) for r in range(16) for h in hist[keys[r]])
        assert all(h.shape[0] == 512 for v in hist.values() for h in v)
        if verbatim:
            assert found >= 4  # siblings 0-3 of each group find their continuation
        else:
            assert found == 0
