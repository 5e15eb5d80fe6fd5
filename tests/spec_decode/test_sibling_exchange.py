"""Sibling exchange of group-mode SAM drafting across DP ranks (qwen3_rl/spec_decode/sibling_exchange.py).

Lossless: with an exchange every step and no delay, every rank's drafts equal those of one drafter that
holds all siblings as its own requests, fed the same tokens in the same order. Bounded: message bytes <= the
cap (oldest tokens of the longest ranges dropped first), shadow tokens <= their bound, memory back to the
cache alone after the groups finish. Real exchange: 2 and 4 gloo processes give the drafts of the
in-process exchange.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qwen3_rl.spec_decode.sam import SEP, SamConfig, SamProposer
from qwen3_rl.spec_decode.sibling_exchange import (
    ENTRY_BYTES,
    HEADER_BYTES,
    GlooAllGather,
    SiblingExchange,
    pack_message,
    unpack_message,
    water_fill,
)
from qwen3_rl.tools.bench.drafters import load_corpus, replay_exchange

from helpers.sam_reference import check_invariants

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO.parent / "shared" / "bench" / "rollouts_dev.jsonl"  # ../shared beside the checkout
K = 3
CFG = SamConfig(num_speculative_tokens=K, group_mode=True, cache_max_responses=4, cache_max_tokens=600)


def _groups(seed: int, n_groups: int = 3, sibs: int = 4, plen: int = 24, rlen: int = 160) -> list[dict]:
    """Synthetic GRPO groups over a small vocabulary: siblings share their prompt and copy pieces of each
    other's text (so sibling drafting pays), responses of different lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(0, 40, plen).astype(np.int32)
        base = rng.integers(0, 40, rlen).astype(np.int32)
        resps = []
        for j in range(sibs):
            r = base.copy()
            flip = rng.random(rlen) < 0.25
            r[flip] = rng.integers(0, 40, int(flip.sum()))
            resps.append(r[: rlen - 13 * j])
        out.append({"key": f"grp{seed}-{g}", "prompt": prompt, "resps": resps})
    return out


def _advance(draft: np.ndarray, resp: np.ndarray, pos: int) -> int:
    a = 0
    while a < len(draft) and pos + a < resp.shape[0] and draft[a] == resp[pos + a]:
        a += 1
    return min(a + 1, resp.shape[0] - pos)


def test_water_fill_drops_oldest_tokens_of_longest_first() -> None:
    c = np.array([10, 1, 5, 3])
    assert water_fill(c, 100).tolist() == [10, 1, 5, 3]
    k = water_fill(c, 8)
    assert k.tolist() == [3, 1, 2, 2] and k.sum() == 8
    assert water_fill(c, 0).tolist() == [0, 0, 0, 0]
    rng = np.random.default_rng(0)
    for _ in range(200):
        c = rng.integers(0, 50, rng.integers(1, 30))
        b = int(rng.integers(0, c.sum() + 5))
        k = water_fill(c, b)
        assert (k <= c).all() and (k >= 0).all() and k.sum() == min(c.sum(), b)
        # no entry is cut while a longer one keeps more tokens than it
        cut = k < c
        if cut.any():
            assert k[cut].min() >= k.max() - 1


def test_message_roundtrip() -> None:
    toks = [np.array([1, 2, 3], np.int32), np.array([7], np.int32)]
    msg = pack_message(np.array([-5, 1 << 40]), np.array([3, 9], np.int32), np.array([0, 12]), np.array([3, 1]),
                       np.array([False, True]), toks)
    assert msg.shape[0] == 1 + 2 * 5 + 4
    m = unpack_message(msg)
    assert m.keys64.tolist() == [-5, 1 << 40] and m.serials.tolist() == [3, 9] and m.pos.tolist() == [0, 12]
    assert m.counts.tolist() == [3, 1] and m.fin.tolist() == [False, True] and m.tokens.tolist() == [1, 2, 3, 7]
    with pytest.raises(ValueError):
        unpack_message(msg[:-1])


class _Mirror:
    """One drafter holding every sibling a rank sees as its own request, fed in the rank's order."""

    def __init__(self) -> None:
        self.p = SamProposer(CFG)
        self.remote: dict[int, str] = {}

    def merge(self, ex: SiblingExchange, msgs: list[np.ndarray], groups_of: dict[int, tuple[str, np.ndarray]]
              ) -> None:
        fins = []
        for r, raw in enumerate(msgs):
            if r == ex.rank:
                continue
            m = unpack_message(raw)
            off = 0
            for i in range(m.counts.shape[0]):
                key = (r << 32) | int(m.serials[i])
                c = int(m.counts[i])
                toks = m.tokens[off: off + c]
                off += c
                g = groups_of[int(m.keys64[i])]
                if key not in self.remote:
                    if not self.p.has_group(g[0]) or c == 0:
                        continue
                    assert int(m.pos[i]) == 0  # no cap, no gap
                    self.remote[key] = f"m{key}"
                    self.p.add_request(self.remote[key], g[1], g[0])
                if c:
                    self.p.extend(self.remote[key], toks)
                if m.fin[i]:
                    fins.append(self.remote.pop(key))
        for rid in fins:
            self.p.finish(rid)


@pytest.mark.parametrize("ranks", [2, 4])
def test_exchange_lossless_same_drafts_as_siblings_together(ranks: int) -> None:
    """S = 1, D = 0: every rank's drafts for its requests == a drafter with all siblings together (the
    same tokens in the same order), every step, caches included (remote FINs fill the cache too)."""
    from qwen3_rl.spec_decode.sibling_exchange import group_key64

    groups = _groups(seed=ranks, n_groups=4, sibs=4)
    props = [SamProposer(CFG) for _ in range(ranks)]
    exs = [SiblingExchange(p, r) for r, p in enumerate(props)]
    mirrors = [_Mirror() for _ in range(ranks)]
    groups_of = {group_key64(g["key"]): (g["key"], g["prompt"]) for g in groups}
    compared = hits = 0
    for g in groups:
        live = []
        for j, resp in enumerate(g["resps"]):
            r = j % ranks
            rid = f"{g['key']}-{j}"
            props[r].add_request(rid, g["prompt"], g["key"])
            mirrors[r].p.add_request(rid, g["prompt"], g["key"])
            exs[r].track(rid, g["key"], g["prompt"].shape[0])
            live.append([rid, r, resp, 0])
        drafts = {it[0]: props[it[1]].propose([it[0]])[0] for it in live}
        while live:
            done = []
            for r in range(ranks):
                mine = [it for it in live if it[1] == r]
                acc = []
                for it in mine:
                    adv = _advance(np.asarray(drafts[it[0]]), it[2], it[3])
                    acc.append(it[2][it[3]: it[3] + adv])
                    it[3] += adv
                    if it[3] >= it[2].shape[0]:
                        done.append(it)
                if mine:
                    props[r].extend_batch([it[0] for it in mine], acc)
                    mirrors[r].p.extend_batch([it[0] for it in mine], acc)
            for it in done:
                exs[it[1]].before_finish(it[0])
                props[it[1]].finish(it[0])
                mirrors[it[1]].p.finish(it[0])
                live.remove(it)
            msgs = [e.pack() for e in exs]
            for r in range(ranks):
                exs[r].merge(msgs)
                mirrors[r].merge(exs[r], msgs, groups_of)
            drafts = {}
            for it in live:
                d = props[it[1]].propose([it[0]])[0]
                assert d == mirrors[it[1]].p.propose([it[0]])[0], (it[0], it[3])
                drafts[it[0]] = d
                compared += 1
                hits += bool(d)
    assert compared > 500 and hits > compared // 2
    for r in range(ranks):  # every group finished everywhere: only the bounded cache is held
        assert props[r].num_shadows() == 0 and props[r].num_shadow_tokens() == 0
        assert props[r].num_groups() == 0
        check_invariants(props[r])
        props[r].clear_cache()
        assert props[r].nbytes() == 0


def test_cap_honoured_gaps_marked_and_never_drafted() -> None:
    """A cap far below the pending tokens: every message <= the cap, the longest ranges lose their oldest
    tokens, the receiver marks the gap (SEP) and no draft ever contains SEP."""
    cap = HEADER_BYTES + 2 * ENTRY_BYTES + 4 * 10  # two entries and 10 tokens
    a, b = SamProposer(CFG), SamProposer(CFG)
    ea, eb = SiblingExchange(a, 0, cap), SiblingExchange(b, 1, cap)
    prompt = np.arange(10, dtype=np.int32)
    text = np.tile(np.arange(100, 120, dtype=np.int32), 10)
    a.add_request("x", prompt, "g")
    a.add_request("y", prompt, "g")
    ea.track("x", "g", 10)
    ea.track("y", "g", 10)
    b.add_request("z", prompt, "g")
    eb.track("z", "g", 10)
    a.extend("x", text[:30])
    a.extend("y", text[:4])
    msg = ea.pack()
    assert 4 * msg.shape[0] <= cap
    m = unpack_message(msg)
    assert m.counts.tolist() == [6, 4]  # y kept whole, x its newest 6
    assert m.pos.tolist() == [24, 0] and m.tokens[:6].tolist() == text[24:30].tolist()
    assert ea.stats.tokens_dropped == 24
    eb.merge([msg, None])
    assert b.num_shadows() == 2
    # gap: x's shadow = prompt, SEP, text[24:30]; z drafts from it but never past the gap marker
    b.extend("z", text[:23])
    out = b.propose(["z"], 3)[0]
    assert SEP not in out
    for _ in range(40):
        a.extend("x", text[30:33])
        eb.merge([ea.pack(), None])
        b.extend("z", text[23:24])
        assert SEP not in b.propose(["z"], 3)[0]
    assert max(ea.stats.history) <= cap


def test_shadow_memory_bounded_and_freed() -> None:
    p = SamProposer(CFG)
    p.max_shadow_tokens = 300
    ex = SiblingExchange(p, 0)
    sender = SamProposer(CFG)
    es = SiblingExchange(sender, 1)
    prompt = np.arange(20, dtype=np.int32)
    p.add_request("local", prompt, "g")
    ex.track("local", "g", 20)
    for j in range(6):
        sender.add_request(f"s{j}", prompt, "g")
        es.track(f"s{j}", "g", 20)
    rng = np.random.default_rng(1)
    for _ in range(30):
        for j in range(6):
            sender.extend(f"s{j}", rng.integers(0, 50, 5))
        ex.merge([None, es.pack()])
        assert p.num_shadow_tokens() <= 300
        check_invariants(p)
    assert p.num_shadows() >= 1
    held = p.nbytes()
    for j in range(6):
        es.before_finish(f"s{j}")
        sender.finish(f"s{j}")
    ex.merge([None, es.pack()])
    assert p.num_shadows() == 0 and p.nbytes() >= held  # closed shadows stay with the group (and cache)
    ex.before_finish("local")
    p.finish("local")
    assert p.num_groups() == 0 and p.num_shadow_tokens() == 0
    p.clear_cache()
    assert p.nbytes() == 0
    # an open shadow keeps its group alive after the local member finished; close_shadows frees it
    p.add_request("l2", prompt, "h")
    ex.track("l2", "h", 20)
    sender.add_request("t", prompt, "h")
    es.track("t", "h", 20)
    sender.extend("t", np.arange(5))
    ex.merge([None, es.pack()])
    ex.before_finish("l2")
    p.finish("l2")
    assert p.has_group("h") and p.num_shadows() == 1
    p.close_shadows()
    assert not p.has_group("h") and p.num_shadow_tokens() == 0
    p.clear_cache()
    assert p.nbytes() == 0


def test_replay_spread_exchange_matches_siblings_together() -> None:
    """The benchmark replay on the dev corpus (first 6 prompts): 8 ranks with an exchange every step is
    within 1 % of siblings together, far above spread without exchange, and holds the message bound."""
    groups = load_corpus(CORPUS, limit_prompts=6)
    cfg = SamConfig(num_speculative_tokens=K, group_mode=True)
    together = replay_exchange(groups, cfg, K, 1)["mean_accepted"]
    ex = replay_exchange(groups, cfg, K, 8, every=1, delay=0)
    late = replay_exchange(groups, cfg, K, 8, every=1, delay=1)
    alone = replay_exchange(groups, cfg, K, 8, every=1 << 30, delay=0)  # never exchanges
    assert ex["mean_accepted"] >= 0.99 * together
    assert together >= late["mean_accepted"] >= alone["mean_accepted"] + 0.05
    assert ex["bytes_per_exchange_rank_max"] <= 16384 and ex["tokens_dropped"] == 0


# ------------------------------------------------------------------------------------------ gloo
def _gloo_rank(rank: int, world: int, store: str, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        comm = GlooAllGather(dist.new_group(backend="gloo"))
        res = _run_exchange(world, rank, comm)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _run_exchange(world: int, rank: int, comm) -> dict:  # type: ignore[no-untyped-def]
    """Rank ``rank`` of ``world`` runs sibling j on rank j % world; every step exchanges through ``comm``
    (a callable msg -> all ranks' messages); returns its drafts and byte counts."""
    groups = _groups(seed=7, n_groups=3, sibs=world + 1)
    p = SamProposer(CFG)
    ex = SiblingExchange(p, rank)
    out: list[list[int]] = []
    for g in groups:
        live = []
        for j, resp in enumerate(g["resps"]):
            if j % world == rank:
                rid = f"{g['key']}-{j}"
                p.add_request(rid, g["prompt"], g["key"])
                ex.track(rid, g["key"], g["prompt"].shape[0])
                live.append([rid, resp, 0])
        drafts = {it[0]: p.propose([it[0]])[0] for it in live}
        # lockstep: every rank runs as many steps as the longest response needs (idle ranks still exchange)
        for _ in range(max(r.shape[0] for r in g["resps"]) + 2):
            acc, done = [], []
            for it in live:
                adv = _advance(np.asarray(drafts[it[0]]), it[1], it[2])
                acc.append(it[1][it[2]: it[2] + adv])
                it[2] += adv
                if it[2] >= it[1].shape[0]:
                    done.append(it)
            if live:
                p.extend_batch([it[0] for it in live], acc)
            for it in done:
                ex.before_finish(it[0])
                p.finish(it[0])
                live.remove(it)
            ex.merge(comm(ex.pack()))
            drafts = {it[0]: p.propose([it[0]])[0] for it in live}
            out.extend(drafts[it[0]] for it in live)
    return {"drafts": out, "bytes": ex.stats.bytes_sent, "merged": ex.stats.tokens_merged,
            "groups": p.num_groups(), "shadows": p.num_shadows()}


def _in_process(world: int) -> list[dict]:
    """The same run with all ranks in one process (generators stepped in lockstep)."""
    import threading

    res: list[dict] = [{} for _ in range(world)]
    barrier = threading.Barrier(world)
    box: list = [None] * world

    def comm_for(r: int):  # type: ignore[no-untyped-def]
        def comm(msg: np.ndarray) -> list[np.ndarray]:
            box[r] = msg
            barrier.wait()
            got = list(box)
            barrier.wait()
            return got
        return comm

    threads = [threading.Thread(target=lambda r=r: res.__setitem__(r, _run_exchange(world, r, comm_for(r))))
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_exchange_between_processes(world: int, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_gloo_rank, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True,
                       start_method="fork")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    want = _in_process(world)
    for r in range(world):
        assert got[r]["drafts"] == want[r]["drafts"], r
        assert got[r]["bytes"] == want[r]["bytes"] and got[r]["merged"] == want[r]["merged"] > 0
        assert got[r]["groups"] == 0 and got[r]["shadows"] == 0


# ------------------------------------------------------------------------------------ simulator
def test_simulate_rollout_with_drafting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``simulate rollout --drafting``: requests advance tokens-per-step per step by layout; data rebalance
    with the exchange beats data rebalance alone, group drafting alone and spread drafting without it."""
    from qwen3_rl.tools.sim.lengths import Lengths
    from qwen3_rl.tools.sim.simulate import Drafting, StepModel, main, with_drafting

    lens = Lengths(num_prompts=2, n=2, prompt_len=np.array([100, 100, 40, 40]),
                   response_len=np.array([1000, 999, 10, 1]))
    st = StepModel()
    same, st1 = with_drafting(lens, st, 1.0, 0.4)
    assert same is lens and st1 is st
    d, sd = with_drafting(lens, st, 2.0, 0.4)
    assert d.response_len.tolist() == [500, 500, 5, 1] and d.prompt_len.tolist() == [50, 50, 20, 20]
    assert sd.per_kctx_ms == 2 * st.per_kctx_ms and sd.t0_ms == st.t0_ms + 0.4
    dr = Drafting()
    assert dr.tokens_per_step("none", "data-rebalance") == 1.0
    assert dr.tokens_per_step("sam_group", "default") == dr.tokens_per_step("sam_group_exchange", "default")
    assert dr.tokens_per_step("sam_group", "data-rebalance") < dr.tokens_per_step("sam_group_exchange", "both")
    out = tmp_path / "len.jsonl"
    assert main(["gen-lengths", "--out", str(out), "--num-prompts", "64", "--n", "8", "--seed", "1"]) == 0
    capsys.readouterr()
    assert main(["rollout", "--lengths", str(out), "--dp", "8", "--max-num-seqs", "64", "--policy",
                 "default,data-rebalance", "--drafting", "all", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    assert set(res) == {"default", "data-rebalance", "default+sam_group", "data-rebalance+sam_group",
                        "data-rebalance+sam_group_exchange"}
    ms = {k: v["makespan_s"] for k, v in res.items()}
    assert res["data-rebalance+sam_group_exchange"]["tokens_per_step"] == dr.exchange
    assert ms["data-rebalance+sam_group_exchange"] < min(ms["data-rebalance+sam_group"], ms["default+sam_group"],
                                                        ms["data-rebalance"]) < ms["default"]


def test_unheld_groups_filtered_and_siblings_per_group_capped() -> None:
    """Entries of groups a rank does not hold are dropped while parsing; beyond ``max_shadows_per_group``
    remote siblings are ignored (no string, skipped in the fast path); all freed with the group."""
    recv = SamProposer(CFG)
    recv.max_shadows_per_group = 2
    ex = SiblingExchange(recv, 0)
    send = SamProposer(CFG)
    es = SiblingExchange(send, 1)
    pa, pb = np.arange(10, dtype=np.int32), np.arange(50, 60, dtype=np.int32)
    for j in range(4):
        send.add_request(f"a{j}", pa, "A")
        es.track(f"a{j}", "A", 10)
        send.add_request(f"b{j}", pb, "B")
        es.track(f"b{j}", "B", 10)
        send.extend(f"a{j}", np.arange(100, 110) + j)
        send.extend(f"b{j}", np.arange(200, 210) + j)
    msg = es.pack()
    assert ex.merge([None, msg]) == 0  # no group held here yet
    assert recv.num_shadows() == 0
    recv.add_request("mine", pa, "A")  # now group A is held (the filter is rebuilt), B still is not
    ex.track("mine", "A", 10)
    for j in range(4):
        send.extend(f"a{j}", [7, 8])
        send.extend(f"b{j}", [7, 8])
    merged = ex.merge([None, es.pack()])
    assert recv.num_shadows() == 4  # 2 shadow strings + 2 ignored siblings of group A, none of B
    assert merged == 2 * (10 + 1 + 2)  # prompt copy + gap marker (their first 10 tokens were missed) + 2
    assert recv.num_shadow_tokens() == merged
    for j in range(4):
        send.extend(f"a{j}", [9])
    assert ex.merge([None, es.pack()]) == 2
    check_invariants(recv)
    for j in range(4):
        es.before_finish(f"a{j}")
        send.finish(f"a{j}")
    ex.merge([None, es.pack()])
    ex.before_finish("mine")
    recv.finish("mine")
    assert recv.num_groups() == 0 and recv.num_shadows() == 0 and recv.num_shadow_tokens() == 0
    recv.clear_cache()
    assert recv.nbytes() == 0
