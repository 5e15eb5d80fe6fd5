"""Suffix-automaton drafter: brute-force equivalence, lifecycle/memory, group mode, benchmark smoke."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen3_rl.spec_decode import SamConfig, SamProposer, group_key
from qwen3_rl.spec_decode import _sam_kernels as kern

from helpers.sam_reference import brute_force_propose, check_invariants, num_hubs, step_from_buffer

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO.parent / "shared" / "bench" / "rollouts_dev.jsonl"  # ../shared beside the checkout
K = 3


def _check_all_prefixes(text: np.ndarray, plen: int, rule: str, chunks: list[int]) -> None:
    """Feed ``text`` after a ``plen`` prompt in chunks; after every chunk compare with brute force."""
    p = SamProposer(rule=rule, recent_budget=1 << 30)
    p._tuning.exact_growth = len(chunks) % 2 == 0  # half the cases: every array exactly full (room checks hit)
    p.add_request("r", text[:plen])
    t = plen
    ci = 0
    while True:
        got = p.propose(["r"], K)[0]
        L, e, ref = brute_force_propose(text[:t], K, 1 if rule == "recent" else 0)
        assert got == ref.tolist(), (rule, text[:t].tolist(), got, ref.tolist(), L, e)
        if t >= text.shape[0]:
            break
        n = max(1, min(chunks[ci % len(chunks)], text.shape[0] - t))
        ci += 1
        p.extend("r", text[t: t + n])
        t += n
    np.testing.assert_array_equal(p.tokens("r"), text)
    check_invariants(p)
    p.finish("r")
    assert p.nbytes() == 0


texts = st.lists(st.integers(0, 4), min_size=1, max_size=80)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts, st.integers(1, 80), st.lists(st.integers(1, 4), min_size=1, max_size=4),
       st.sampled_from(["recent", "earliest"]))
def test_matches_brute_force_random(tokens, plen, chunks, rule):
    text = np.asarray(tokens, np.int32)
    _check_all_prefixes(text, min(plen, len(tokens)), rule, chunks)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("rule", ["recent", "earliest"])
def test_hub_index_is_transparent(rule: str, exact: bool) -> None:
    """Texts over 24 token ids give states of out-degree >= HUB_DEGREE: they become hubs (transitions
    indexed by the hub hash) and drafts still equal brute force after every chunk, with arrays grown
    exactly to the size asked for (hub-index room checks hit) or with slack."""
    rng = np.random.default_rng(7 if exact else 8)
    base = rng.integers(0, 24, 300).astype(np.int32)
    # repeats with mutations: long matches, many branching states
    text = np.concatenate([base] + [np.where(rng.random(300) < 0.1, rng.integers(0, 24, 300), base)
                                    for _ in range(3)]).astype(np.int32)
    p = SamProposer(rule=rule, recent_budget=1 << 30)
    p._tuning.exact_growth = exact
    p.add_request("r", text[:50])
    t = 50
    while t < text.shape[0]:
        got = p.propose(["r"], K)[0]
        ref = brute_force_propose(text[:t], K, 1 if rule == "recent" else 0)[2]
        assert got == ref.tolist()
        n = int(rng.integers(1, 5))
        p.extend("r", text[t: t + n])
        t += n
        if t % 97 < 4:
            check_invariants(p)  # hub index finds every hub edge; counts match
    assert num_hubs(p) > 0
    check_invariants(p)
    p.finish("r")
    assert p.nbytes() == 0


@pytest.mark.parametrize("rule", ["recent", "earliest"])
@pytest.mark.parametrize("name", ["run", "period", "fib", "thue_morse", "large_ids"])
def test_matches_brute_force_adversarial(name, rule):
    if name == "run":
        text = np.zeros(120, np.int32)  # one long run: deepest suffix-link chains
    elif name == "period":
        text = np.tile(np.array([3, 1, 4, 1, 5], np.int32), 30)
    elif name == "fib":  # Fibonacci word: many clones
        a, b = [0], [0, 1]
        while len(b) < 150:
            a, b = b, b + a
        text = np.asarray(b[:150], np.int32)
    elif name == "thue_morse":  # square-free-ish, many short repeats
        text = np.asarray([bin(i).count("1") % 2 for i in range(128)], np.int32)
    else:  # token ids near the int32 limit and a big vocabulary (root hash growth)
        rng = np.random.default_rng(1)
        base = rng.integers(2**31 - 5000, 2**31 - 1, 60).astype(np.int32)
        text = np.concatenate([base, base[10:40], rng.integers(0, 151_000, 40).astype(np.int32), base[:25]])
    _check_all_prefixes(text, 1, rule, [1, 2, 3])


@pytest.mark.parametrize("budget", [SamConfig.recent_budget, 2])
def test_bounded_recent_walk_is_a_real_occurrence(budget):
    """With a bounded update walk (the default, 1) the draft still follows an occurrence of the longest match."""
    rng = np.random.default_rng(7)
    text = np.concatenate([np.tile(rng.integers(0, 6, 40), 5), rng.integers(0, 6, 200)]).astype(np.int32)
    p = SamProposer(recent_budget=budget)
    p.add_request("r", text[:1])
    for t in range(2, text.shape[0] + 1):
        p.extend("r", text[t - 1: t])
        got = p.propose(["r"], K)[0]
        L, _, _ = brute_force_propose(text[:t], K, 1)
        if L == 0:
            assert got == []
            continue
        suffix = text[t - L: t]
        ends = [e for e in range(L - 1, t - 1) if np.array_equal(text[e - L + 1: e + 1], suffix)]
        assert any(got == text[e + 1: min(e + 1 + K, t)].tolist() for e in ends)


def test_interface_and_config_validation():
    p = SamProposer()
    with pytest.raises(ValueError):
        SamConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError):
        SamConfig(rule="frequent")
    with pytest.raises(ValueError):
        SamConfig(cache_max_responses=500)
    with pytest.raises(ValueError):
        p.add_request("x", [1, -2, 3])
    p.add_request("a", [1, 2, 3])
    with pytest.raises(KeyError):
        p.add_request("a", [1])


def test_lifecycle_memory_returns_to_zero_and_preempt_resume():
    rng = np.random.default_rng(0)
    p = SamProposer()
    assert p.nbytes() == 0
    live = {}
    for rnd in range(6):  # waves of requests: add, decode, preempt/resume some, finish/abort
        for i in range(12):
            rid = f"{rnd}-{i}"
            prompt = rng.integers(0, 50, rng.integers(5, 60)).astype(np.int32)
            p.add_request(rid, prompt)
            live[rid] = list(prompt)
        for _ in range(20):
            rids = list(live)
            acc = [rng.integers(0, 50, rng.integers(1, 4)).astype(np.int32) for _ in rids]
            drafts = p.step(rids, acc)
            for r, a, d in zip(rids, acc, drafts, strict=True):
                live[r].extend(a.tolist())
                assert len(d) <= K
        victim = next(iter(live))
        p.preempt(victim)
        p.resume(victim, live[victim] + [7, 8])  # runner knows two more tokens: they are appended
        live[victim] += [7, 8]
        other = list(live)[1]
        changed = list(live[other])
        changed[-1] = (changed[-1] + 1) % 50  # diverged text: rebuilt from the given tokens
        p.preempt(other)
        p.resume(other, changed)
        live[other] = changed
        for r in live:
            np.testing.assert_array_equal(p.tokens(r), np.asarray(live[r], np.int32))
        assert p.nbytes() > 0
        assert p.num_tokens() == sum(len(v) for v in live.values())
        for j, r in enumerate(list(live)):
            (p.finish if j % 2 else p.abort)(r)
            del live[r]
        assert p.nbytes() == 0, f"bytes left after wave {rnd}"
        assert p.num_requests == 0


def test_rejected_tokens_never_enter():
    p = SamProposer()
    p.add_request("r", [5, 6, 7, 8, 5, 6])
    assert p.propose(["r"]) == [[7, 8, 5]]
    p.extend("r", [9])  # the verifier rejected the draft and emitted 9
    np.testing.assert_array_equal(p.tokens("r"), [5, 6, 7, 8, 5, 6, 9])
    assert p.propose(["r"]) == [[]]


def test_cache_compaction_keeps_newest_responses_within_bounds():
    """One cache automaton: at most 2 x cache_max_tokens tokens and 2 x cache_max_responses responses; when
    full it is rebuilt from its newest responses (<= cache_max_responses, <= cache_max_tokens), so the newest
    response always drafts, dropped ones never do, and a running request's pointer follows the rebuild."""
    R, T = 3, 50
    p = SamProposer(group_mode=True, cache_max_responses=R, cache_max_tokens=T)
    rng = np.random.default_rng(5)
    p.add_request("live", [7, 7])
    resps = []
    for i in range(12):
        resp = (1000 * (i + 1) + np.arange(20)).astype(np.int32)  # disjoint token ids per response
        resps.append(resp)
        p.add_request(f"f{i}", rng.integers(10, 20, 3).astype(np.int32))
        p.extend(f"f{i}", resp)
        p.finish(f"f{i}")
        cache = [a for a in p._autos if a == p._cache]
        assert len(cache) == 1
        auto = p._autos[cache[0]]
        assert len(auto.strings) <= 2 * R and auto.tokens <= 2 * T
        check_invariants(p)
        # the newest response drafts (pointer of a running request re-fed after a rebuild)
        p.extend("live", resp[:4])
        assert p.propose(["live"]) == [resp[4:7].tolist()]
    # the oldest responses are gone after the rebuilds: their spans no longer draft (fresh requests, so
    # that nothing comes from their own text)
    p.add_request("old", [8, 8])
    p.extend("old", resps[0][:4])
    p.add_request("recent", [9, 9])
    p.extend("recent", resps[-2][:4])
    assert p.propose(["old", "recent"]) == [[], resps[-2][4:7].tolist()]
    for r in ("live", "old", "recent"):
        p.abort(r)
    p.clear_cache()
    assert p.nbytes() == 0


def test_group_mode_drafts_from_siblings_and_cache():
    prompt = np.arange(100, 110, dtype=np.int32)
    span = [1, 2, 3, 4, 5, 6, 7, 8]
    # own-only: the sibling's text is invisible
    solo = SamProposer(group_mode=False)
    solo.add_request("a", prompt)
    solo.add_request("b", prompt)
    solo.extend("a", span)
    solo.extend("b", span[:2])
    assert solo.propose(["b"]) == [[]]
    # group mode: b follows its running sibling a
    grp = SamProposer(group_mode=True, cache_max_responses=4, cache_max_tokens=64)
    key = group_key(prompt)
    assert key == group_key(prompt.tolist()) and key != group_key(prompt[:-1])
    grp.add_request("a", prompt)
    grp.add_request("b", prompt)
    grp.add_request("x", np.arange(500, 510, dtype=np.int32))  # other group: unaffected
    grp.extend("a", span)
    grp.extend("b", span[:2])
    grp.extend("x", [42])
    assert grp.propose(["b", "x"]) == [[3, 4, 5], []]
    # finished responses enter the cache and serve any group (pointers follow on the next extend)
    grp.finish("a")
    grp.finish("b")
    grp.extend("x", span[:2])
    assert grp.propose(["x"]) == [[3, 4, 5]]
    grp.add_request("y", np.arange(700, 705, dtype=np.int32))
    grp.extend("y", [4, 5])
    assert grp.propose(["y"]) == [[6, 7, 8]]
    # the cache is bounded: many finished responses keep at most 2 x 64 tokens
    rng = np.random.default_rng(3)
    for i in range(40):
        grp.add_request(f"z{i}", [900 + i])
        grp.extend(f"z{i}", rng.integers(0, 1000, 30).astype(np.int32))
        grp.finish(f"z{i}")
    for r in ("x", "y"):
        grp.finish(r)
    assert grp.num_requests == 0
    assert 0 < grp.num_tokens() <= grp.cache_bound_tokens() == 128
    grp.clear_cache()
    assert grp.nbytes() == 0 and grp.num_tokens() == 0


def test_group_members_keep_text_until_last_finishes():
    prompt = [1, 2, 3]
    p = SamProposer(group_mode=True, cache_max_responses=0)
    p.add_request("a", prompt)
    p.add_request("b", prompt)
    p.extend("a", [10, 11, 12, 13])
    p.finish("a")  # a's text still serves its sibling
    p.extend("b", [10, 11])
    assert p.propose(["b"]) == [[12, 13]]
    assert p.nbytes() > 0
    p.finish("b")
    assert p.nbytes() == 0


def test_batch_arrays_api_matches_list_api():
    rng = np.random.default_rng(5)
    a = SamProposer()
    b = SamProposer()
    rids = [f"r{i}" for i in range(8)]
    for r in rids:
        pr = rng.integers(0, 20, 30).astype(np.int32)
        a.add_request(r, pr)
        b.add_request(r, pr)
    for _ in range(10):
        acc = [rng.integers(0, 20, rng.integers(0, 4)).astype(np.int32) for _ in rids]
        da = a.step(rids, acc)
        slots = np.asarray([b.slot_of(r) for r in rids], np.int32)
        offs = np.concatenate([[0], np.cumsum([len(x) for x in acc])]).astype(np.int64)
        b.extend_arrays(slots, np.concatenate(acc).astype(np.int32), offs)
        out, cnt = b.propose_arrays(slots)
        assert da == [out[i, : cnt[i]].tolist() for i in range(len(rids))]


def test_benchmark_smoke(tmp_path, pristine_workspace):
    """Two prompts of the corpus, tiny cost run: JSON keys and sane numbers (arctic may be null); vLLM's n-gram
    drafter from the workspace's vLLM tree (the pinned wheel's sources). The corpus is an input: missing, it fails."""
    assert CORPUS.is_file(), f"shared corpus {CORPUS} missing (../shared/bench beside the checkout)"
    cmd = [sys.executable, "-m", "qwen3_rl.tools.bench.drafters", "--corpus", str(CORPUS), "--k", "3", "--group",
           "--limit-prompts", "2", "--batch", "4", "--context-len", "512", "--cost-steps", "3", "--cost-repeats", "3",
           "--spread", "8", "--json"]
    env = {**os.environ, "QWEN3_RL_WORKSPACE": str(pristine_workspace)}
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=True, env=env)
    res = json.loads(out.stdout)
    methods = res["methods"]
    assert set(methods) >= {"sam", "sam_group", "vllm_ngram", "arctic_suffix"}
    assert methods["vllm_ngram"]["mean_accepted"] is not None, methods["vllm_ngram"]
    for name, m in methods.items():
        assert set(m) >= {"mean_accepted", "acceptance_rate", "us_per_step", "bytes_per_token"}, name
        if m["mean_accepted"] is None:
            assert m.get("unavailable"), f"{name} null without a reason"
            assert name in ("vllm_ngram", "arctic_suffix", "vllm_suffix"), f"our method {name} failed: {m}"
            continue
        assert 1.0 <= m["mean_accepted"] <= 4.0 and 0.0 <= m["acceptance_rate"] <= 1.0
    for name in ("sam", "sam_group"):
        m = methods[name]
        assert m["us_per_step"] > 0 and 4 <= m["bytes_per_token"] <= 400
        runs = m["us_per_step_runs"]  # three fresh runs; the reported figure is their median
        assert len(runs) == 3 and round(m["us_per_step"], 1) == sorted(runs)[1]
        assert m["nbytes_after_clear_cache"] == 0
    assert methods["sam"]["nbytes_after_finish"] == 0
    # group mode sees the siblings: it must draft better than own-only on the same responses
    assert methods["sam_group"]["mean_accepted"] > methods["sam"]["mean_accepted"]
    assert res["response_tokens"] > 0 and res["prompts"] == 2
    ex = methods["sam_group_exchange"]  # spread over 8 ranks, exchange every step
    assert ex["ranks"] == 8 and ex["mean_accepted"] >= 0.99 * ex["siblings_together_batched"]
    assert ex["us_per_step"] > 0 and ex["cost_shadow_strings"] == 3 and ex["merged_tokens_per_step"] > 0
    assert 0 < ex["bytes_per_step_rank_full"] <= 16384 and ex["tokens_dropped"] == 0


@pytest.mark.parametrize("group_mode", [False, True])
def test_tight_growth_and_batch_paths_agree(group_mode):
    """Arrays grown to exactly the size asked for (every room check hit), warm-up pass on and off,
    the buffer path and the list path: same drafts, same texts, counts always within capacity."""
    rng = np.random.default_rng(11)
    base = rng.integers(0, 12, 400).astype(np.int32)
    cfg = SamConfig(group_mode=group_mode, cache_max_responses=3, cache_max_tokens=200)
    tight, ref, buf = SamProposer(cfg), SamProposer(cfg), SamProposer(cfg)
    tight._tuning.exact_growth = True
    tight._tuning.warm_lanes = 0
    ref._tuning.warm_lanes = 16
    rids = [f"r{i}" for i in range(6)]
    texts = {}
    for i, r in enumerate(rids):
        start = int(rng.integers(0, 200))
        prompt = base[start: start + 20] if i % 3 else np.array([1, 2, 3], np.int32)
        for p in (tight, ref, buf):
            p.add_request(r, prompt, group_id=f"g{i % 2}")
        texts[r] = list(prompt)
    runner = np.zeros((len(rids), 1024), np.int32)  # runner-like token buffer, one row per request
    for step in range(60):
        acc = [base[(step * 7 + 13 * i) % 300: (step * 7 + 13 * i) % 300 + int(rng.integers(1, 5))]
               for i in range(len(rids))]
        for r, a in zip(rids, acc, strict=True):
            texts[r] += a.tolist()
        d_ref = ref.step(rids, acc)
        slots = tight.slots_of(rids)
        offs = np.concatenate([[0], np.cumsum([len(a) for a in acc])]).astype(np.int64)
        out, cnt = tight.step_arrays(slots, np.concatenate(acc), offs)
        assert [out[i, : cnt[i]].tolist() for i in range(len(rids))] == d_ref
        for i, r in enumerate(rids):
            runner[i, : len(texts[r])] = texts[r]
        nt = np.array([len(texts[r]) for r in rids], np.int64)
        out, cnt = step_from_buffer(buf, buf.slots_of(rids), runner, nt)
        assert [out[i, : cnt[i]].tolist() for i in range(len(rids))] == d_ref
        check_invariants(tight)
        if step == 30 and group_mode:  # finished responses enter the (tiny) cache, new ones start
            for p in (tight, ref, buf):
                p.finish(rids[0])
                p.add_request(rids[0], [9, 9], group_id="g9")
            texts[rids[0]] = [9, 9]
    assert num_hubs(tight) > 0  # the hub index was exercised (12 token ids: degrees >= HUB_DEGREE)
    for r in rids:
        np.testing.assert_array_equal(tight.tokens(r), np.asarray(texts[r], np.int32))
        for p in (tight, ref, buf):
            p.finish(r)
    for p in (tight, ref, buf):
        p.clear_cache()
        check_invariants(p)
        assert p.nbytes() == 0 and p.num_requests == 0


def test_cache_pointer_fixup_once_matches_reference():
    """Cache pointers fixed up once per step (the fast path) equal those fixed up before every token (the
    reference), through cache growth (stale pointers), cache rebuilds (re-feed) and fallbacks to the root, with
    the warm-up pass on (16 lanes for 10 requests, or 3 lanes recycled) and off."""
    rng = np.random.default_rng(21)
    cfg = SamConfig(group_mode=True, cache_max_responses=5, cache_max_tokens=400)
    props = [SamProposer(cfg) for _ in range(4)]
    props[0]._tuning.cache_fix_each = True
    props[2]._tuning.warm_lanes = 0
    props[3]._tuning.warm_lanes = 3
    base = rng.integers(0, 8, 600).astype(np.int32)
    live: dict[str, int] = {}
    nxt = 0
    hubs = 0
    for step in range(80):
        while len(live) < 10:
            rid = f"r{nxt}"
            start = int(rng.integers(0, 500))
            for p in props:
                p.add_request(rid, base[start: start + 5], group_id=f"g{nxt % 4}")
            live[rid] = start + 5
            nxt += 1
        rids = list(live)
        acc = []
        for r in rids:
            n = int(rng.integers(0, 5))
            # mostly the base text (long matches), sometimes noise (fallbacks to the root)
            acc.append(base[live[r] % 590: live[r] % 590 + n] if rng.random() < 0.8
                       else rng.integers(0, 12, n).astype(np.int32))
            live[r] += n
        res = [p.step(rids, acc) for p in props]
        assert res[0] == res[1] == res[2] == res[3], step
        cols = [kern.M_CST, kern.M_CLN, kern.M_CSTAMP, kern.M_CVER]
        ptr = [p._SM[np.ix_(p.slots_of(rids), cols)] for p in props]
        for other in ptr[1:]:
            np.testing.assert_array_equal(ptr[0], other)
        hubs = max(hubs, num_hubs(props[1]))
        for r in rids[: int(rng.integers(0, 3))]:  # finished responses grow the cache / rebuild it
            for p in props:
                p.finish(r)
            del live[r]
    assert hubs > 0  # hub states were indexed (cache and group automata)
    for p in props:
        check_invariants(p)
        for r in list(live):
            p.finish(r)
        p.clear_cache()
        assert p.nbytes() == 0


def test_cost_contexts_are_distinct_realistic_samples():
    """Benchmark cost contexts: exact length, tail = own prompt + response prefix, continuation = rest of
    that response, filler only from other prompts' responses, no span shared verbatim between siblings."""
    from qwen3_rl.tools.bench.drafters import ROUND_SHIFT, Sample, build_contexts

    rng = np.random.default_rng(2)
    groups = []
    for p in range(4):  # token ids encode (prompt, sample): base = 1000 * (10 p + s + 1)
        prompt = np.full(5, 100 + p, np.int32)
        groups.append([Sample(p, s, prompt, (1000 * (10 * p + s + 1) + rng.integers(0, 50, 60 + 10 * s)).astype(np.int32))
                       for s in range(3)])
    ctxs, conts, keys = build_contexts(groups, 12, 400, 30, 3)
    assert [c.shape[0] for c in ctxs] == [400] * 12 and [c.shape[0] for c in conts] == [30] * 12
    assert keys[:6] == ["g0"] * 3 + ["g1"] * 3
    for r, (ctx, cont) in enumerate(zip(ctxs, conts, strict=True)):
        gi, j = divmod(r, 3)
        own = groups[gi % 4][j]
        s0 = int(np.flatnonzero(ctx == 100 + gi % 4)[-1]) + 1  # end of the own prompt
        np.testing.assert_array_equal(np.concatenate([ctx[s0:], cont])[: own.response.shape[0]],
                                      own.response[: ctx.shape[0] - s0 + 30])
        filler = ctx[: s0 - 5] % ROUND_SHIFT
        assert filler.size and not np.any(filler // 10000 == gi % 4), "tail prompt's answers in filler"
        assert np.all(filler >= 1000), "filler holds prompts"
        for r2 in range(12):  # no 8-token span of one context appears in a sibling's context
            if r2 != r and r2 // 3 == gi:
                grams = {tuple(ctx[i: i + 8]) for i in range(s0 - 13)}
                assert not any(tuple(ctxs[r2][i: i + 8]) in grams for i in range(392))


def test_bad_token_ranges_raise_before_anything_changes():
    """The kernel checks every request's range and length first: a bad one raises and changes nothing."""
    p = SamProposer()
    p.add_request("a", [1, 2, 3, 1, 2])
    p.add_request("b", [4, 5, 6])
    slots = p.slots_of(["a", "b"])
    before = [p.tokens("a"), p.tokens("b")]
    runner = np.array([[1, 2, 3, 1, 2, 3, 0], [4, 5, 6, 4, 0, 0, 0]], np.int32)
    with pytest.raises(ValueError, match="shorter than the drafter's text"):
        step_from_buffer(p, slots, runner, np.array([6, 2]))  # b's buffer is behind its text
    with pytest.raises(ValueError, match="must not end before they start"):
        p.extend_arrays(slots, np.array([3, 4], np.int32), np.array([0, 2, 1]))
    s = int(slots[1])
    p._SM[s, kern.M_LEN] = kern.MAX_STRING_LEN - 1  # pretend b is at the length limit (no 16M-token build)
    with pytest.raises(ValueError, match="longer than"):
        step_from_buffer(p, slots, runner, np.array([6, kern.MAX_STRING_LEN + 1]))
    p._SM[s, kern.M_LEN] = 3
    for r, want in zip(("a", "b"), before, strict=True):
        np.testing.assert_array_equal(p.tokens(r), want)  # a was not extended although its range was good
    out, cnt = step_from_buffer(p, slots, runner, np.array([6, 4]))
    assert [out[i, : cnt[i]].tolist() for i in range(2)] == [[1, 2, 3], [5, 6, 4]]  # the good step still works
    check_invariants(p)
