"""Draft length that follows the batch (``SAM_ADAPTIVE_K``): the policy, the runner, the corpus goal.

Checks: with the same acceptance statistics the cost model drafts short in a full batch and long in the
tail; a request whose drafts start breaking off drafts shorter within a bounded number of steps; draft lengths never exceed what the drafter has and respect the floor; ``pad_drafts`` (graph mode)
gets one length per step; in the runner (``SamRunnerDrafter`` over a stand-in ``InputBatch``) k changes
from step to step as the batch shrinks; on the dev corpus the tail gains >= 25 % tokens per step over
fixed k = 3 without losing in the bulk.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qwen3_rl.spec_decode.adaptive_k import AdaptiveK
from qwen3_rl.spec_decode.config import parse_sam_options
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
from qwen3_rl.spec_decode.sam import SamConfig
from qwen3_rl.tools.bench.drafters import load_corpus, replay_visits

from helpers.fake_input_batch import FakeInputBatch

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO.parent / "shared" / "bench" / "rollouts_dev.jsonl"  # ../shared beside the checkout
KMAX = 15


def _trained(p: float, uniform: bool = False, steps: int = 200, n: int = 64, seed: int = 0) -> AdaptiveK:
    """A policy that has seen ``steps`` steps of ``n`` requests drafting k_max tokens, each accepted with
    probability ``p`` while the previous ones were (geometric runs)."""
    pol = AdaptiveK(KMAX, uniform=uniform)
    rng = np.random.default_rng(seed)
    slots = np.arange(n)
    for _ in range(steps):
        acc = np.minimum(rng.geometric(1.0 - p, n) - 1, KMAX)
        pol.observe(slots, np.full(n, KMAX), acc)
    return pol


def test_short_drafts_in_the_bulk_long_in_the_tail() -> None:
    pol = _trained(0.7)
    assert abs(pol.cond()[0] - 0.7) < 0.05
    bulk = pol.choose(np.arange(256) % 64, np.full(256, KMAX), 256 * 8000.0)
    tail = pol.choose(np.arange(2), np.full(2, KMAX), 2 * 8000.0)
    print(f"bulk k {np.bincount(bulk).tolist()}, tail k {tail.tolist()}")
    assert bulk.max() <= 6 and tail.min() >= 12
    # acceptance matters too: at p = 0.2 even the tail drafts short
    low = _trained(0.2).choose(np.arange(2), np.full(2, KMAX), 2 * 8000.0)
    assert low.max() < tail.min()


def test_lengths_bounded_by_the_drafts_and_the_floor() -> None:
    pol = AdaptiveK(KMAX, k_min=3)
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 300))
        slots = rng.choice(400, n, replace=False)
        avail = rng.integers(0, KMAX + 1, n)
        k = pol.choose(slots, avail, float(n * 4000))
        assert k.shape == (n,) and (k <= avail).all() and (k >= np.minimum(avail, 3)).all()
        pol.observe(slots, k, rng.integers(0, KMAX + 1, n))
    assert pol.k_hist.sum() > 0


def test_uniform_mode_one_length_per_step() -> None:
    pol = _trained(0.7, uniform=True)
    for n in (256, 2):
        k = pol.choose(np.arange(n) % 64, np.full(n, KMAX), n * 8000.0)
        assert (k == pol.last_k).all()
    assert pol.step_hist[pol.last_k] >= 1 and (pol.step_hist > 0).sum() == 2  # bulk and tail chose differently


def test_request_that_breaks_off_early_drafts_shorter() -> None:
    """Per-request acceptance learnt online: in a batch whose drafts accept in long runs (p = 0.8 per position),
    a request whose drafts stop after their first token gets a continuation factor well below 1 and shorter drafts
    than a request accepting like the batch; one that accepts every draft whole keeps the batch's estimate (the
    factor is capped at 1); ``reset`` (a new request in the slot) forgets it."""
    pol = _trained(0.8, n=64)
    slots = np.array([100, 101, 102])  # 100 breaks off, 101 like the batch, 102 accepts everything
    rng = np.random.default_rng(3)
    for _ in range(12):
        pol.choose(slots, np.full(3, KMAX), 3 * 8000.0)
        like = min(int(rng.geometric(0.2)) - 1, KMAX)
        pol.observe(slots, np.full(3, KMAX), np.array([1, like, KMAX]))
    r = pol.factor(slots)
    k = pol.choose(slots, np.full(3, KMAX), 3 * 8000.0)
    print(f"factor {r.round(3).tolist()}, k {k.tolist()}")
    assert r[0] < 0.5 and r[1] > 0.8 and r[2] == 1.0
    assert k[0] < k[1] <= k[2]
    g = pol.gains(slots)
    assert g[0, 0] == pytest.approx(g[2, 0]) and (g[0, 1:] < g[2, 1:]).all()  # the first position is a_i's
    pol.reset(slots[:1])
    assert pol.factor(slots[:1])[0] == 1.0


def test_k_falls_within_steps_when_acceptance_drops() -> None:
    """Two requests drafting in a batch of 256 running (k_max 15, the linear cost model), both accepted whole for
    12 steps: both draft >= 12. From the step one's drafts break off after the first token, its draft length falls
    (never back up) below half within 11 steps and to at most 4 within 15, while its companion (still accepting
    whole) keeps drafting >= 12. The first 7 steps keep the length: the continuation counts banked while its runs
    beat the bucket's (the factor is capped at 1) decay by 0.8 per draft before the factor falls below 1."""
    pol = _trained(0.8, n=64)
    slots = np.array([100, 101])
    avail = np.full(2, KMAX)
    for _ in range(12):
        k = pol.choose(slots, avail, 256 * 8000.0, n_running=256)
        pol.observe(slots, k, k)
    before = int(k[0])
    after = []
    for _ in range(20):
        k = pol.choose(slots, avail, 256 * 8000.0, n_running=256)
        after.append(int(k[0]))
        pol.observe(slots, k, np.array([min(1, int(k[0])), int(k[1])]))
    print(f"k before {before}, after the drop {after}, companion {int(k[1])}, factor {pol.factor(slots).round(3)}")
    assert before >= 12 and int(k[1]) >= 12
    assert all(x >= y for x, y in zip(after, after[1:], strict=False))
    assert min(after[:11]) < before / 2 and max(after[14:]) <= 4


def _texts(n: int, rng: np.random.Generator, length: int = 400) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per request a prompt and a continuation: a request-specific period of 40 tokens, 15 % of them replaced
    by random tokens (drafts from the request's own text are accepted in runs of a few tokens)."""
    prompts, conts = [], []
    for i in range(n):
        period = rng.integers(0, 2000, 40)
        seq = np.tile(period, length // 40 + 1)[:length]
        noise = rng.random(length) < 0.15
        seq[noise] = rng.integers(0, 2000, int(noise.sum()))
        prompts.append(np.concatenate([[5000 + i], seq[:80]]).astype(np.int32))
        conts.append(seq[80:].astype(np.int32))
    return prompts, conts


@pytest.mark.parametrize("pad", [False, True])
def test_runner_k_follows_the_batch(pad: bool) -> None:
    """128 requests decode; after 12 steps all but 2 finish. The runner's drafts: <= k_max, a short longest
    draft while 128 run, a long one in the tail; with pad_drafts every draft of a step has one length."""
    cfg = parse_sam_options({"adaptive_k": True, "pad_drafts": pad}, KMAX)
    sam = SamRunnerDrafter(cfg, 4096)
    rng = np.random.default_rng(3)
    prompts, conts = _texts(128, rng, 800)
    rids = [f"r{i}" for i in range(128)]
    texts = {r: p.tolist() for r, p in zip(rids, prompts, strict=True)}
    pos = dict.fromkeys(rids, 0)
    drafts = {r: [] for r in rids}
    longest: list[tuple[int, int]] = []
    live = list(rids)
    for step in range(40):
        finished = set()
        if step == 12:
            finished = set(live[2:])
            live = live[:2]
        for r in live:  # verify last step's drafts against the continuation, then the bonus token
            c, d, p0 = conts[rids.index(r)], drafts[r], pos[r]
            a = 0
            while a < len(d) and d[a] == c[p0 + a]:
                a += 1
            texts[r] += c[p0: p0 + a + 1].tolist()
            pos[r] = p0 + a + 1
        batch = FakeInputBatch.from_prompts([texts[r] for r in live], live)
        batch.num_prompt_tokens[:] = 81
        sched = type("S", (), {"finished_req_ids": finished, "scheduled_new_reqs": ()})()
        out = sam.step(batch, [[1]] * len(live), {r: None for r in live}, sched)
        drafts = dict(zip(live, out, strict=True))
        lens = [len(d) for d in out]
        assert max(lens) <= KMAX
        if pad:
            assert len(set(lens)) == 1
        longest.append((len(live), max(lens)))
    bulk = [k for n, k in longest[2:12]]
    tail = [k for n, k in longest[16:]]
    print(f"longest draft per step (running, k): {longest}")
    # 15 % noise: about 0.85 of a reached position is accepted, so with 128 running the linear model keeps drafts
    # up to ~9 tokens (a token's gain above token_ms x the step's tokens per ms); with 2 running, up to 15.
    # pad_drafts: the policy learns from the real draft tokens only (pad tokens are no drafts)
    assert max(bulk) <= 9 and max(bulk) < np.median(tail) and np.median(tail) >= (9 if pad else 10)
    pol = sam.adaptive
    assert pol is not None and (pol.step_hist > 0).sum() >= 2


def test_adaptive_needs_valid_floor() -> None:
    with pytest.raises(ValueError, match="adaptive_k_min"):
        SamConfig(num_speculative_tokens=3, adaptive_k_min=4)
    with pytest.raises(ValueError, match="verify_token_ms must be float"):
        parse_sam_options({"verify_token_ms": "0.1"}, 3)
    assert parse_sam_options({"verify_token_ms": 0, "adaptive_k": True}, 8).verify_token_ms == 0


def test_tail_gain_on_the_dev_corpus() -> None:
    """Goal: history + adaptive k (k_max 15) >= 1.25 x the tail tokens/step of history at fixed k = 3, and not
    below it in the bulk."""
    groups = load_corpus(CORPUS)
    hist = SamConfig(num_speculative_tokens=3, group_mode=True, history_responses=4)
    fixed = replay_visits(groups, hist, 3, 4, use_history=True)
    ada_cfg = SamConfig(num_speculative_tokens=KMAX, group_mode=True, history_responses=4, adaptive_k=True)
    ada = replay_visits(groups, ada_cfg, 3, 4, use_history=True, adaptive=True)
    print(f"tail {fixed['tail_mean_accepted']:.3f} -> {ada['tail_mean_accepted']:.3f}, "
          f"bulk {fixed['bulk_mean_accepted']:.3f} -> {ada['bulk_mean_accepted']:.3f}, k {ada['k_hist']}")
    assert ada["response_tokens"] == fixed["response_tokens"]
    assert ada["tail_mean_accepted"] >= 1.25 * fixed["tail_mean_accepted"]
    assert ada["bulk_mean_accepted"] >= fixed["bulk_mean_accepted"]
    assert sum(1 for c in ada["k_hist"][1:] if c) >= 5  # many different lengths chosen


def test_simulator_per_step_k_and_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``simulate rollout --drafting BASE+...``: the verification step costs more with more draft tokens; the
    adaptive model drafts short in a full batch and long in the tail; history and adaptive k shorten the
    rollout; a draft token made expensive turns adaptive k down to 1 (positive control of the cost term)."""
    from qwen3_rl.tools.sim.drafting import TPS, DraftModel, draft_model, parse_drafting
    from qwen3_rl.tools.sim.simulate import Drafting, SimError, StepModel, main

    sm = StepModel()
    dm = DraftModel(TPS[("current", "bulk")], TPS[("current", "tail")], fixed_k=None)
    k_bulk, tau_b, ms_b = dm.pick(sm, 256, 256, 256 * 4000.0)
    k_tail, tau_t, ms_t = dm.pick(sm, 4, 4, 4 * 4000.0)
    assert k_bulk < k_tail and k_tail >= 10 and tau_t > tau_b
    assert ms_b == pytest.approx(sm.step_ms(256, 256 * 4000.0) + 0.4 + 0.0585 * 256 * k_bulk)
    costly = DraftModel(TPS[("current", "bulk")], TPS[("current", "tail")], fixed_k=None, token_ms=50.0)
    assert costly.pick(sm, 4, 4, 0.0)[0] == 1
    assert parse_drafting("sam_group_exchange+history+adaptive") == ("sam_group_exchange",
                                                                     frozenset({"history", "adaptive"}))
    for bad in ("sam_group+fast", "none+history", "sam_group"):
        with pytest.raises(SimError):
            parse_drafting(bad)
    spread = draft_model("sam_group_exchange+verify", "both", Drafting())
    assert spread.layout == pytest.approx(Drafting().exchange / Drafting().together) and spread.fixed_k == 3
    out = tmp_path / "len.jsonl"
    assert main(["gen-lengths", "--out", str(out), "--num-prompts", "64", "--n", "8", "--seed", "1"]) == 0
    capsys.readouterr()
    names = [f"sam_group_exchange+{m}" for m in ("verify", "adaptive", "history", "history+adaptive")]
    assert main(["rollout", "--lengths", str(out), "--dp", "8", "--max-num-seqs", "64", "--policy", "both",
                 "--drafting", ",".join(["none", *names]), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    ms = {k.split("+", 1)[-1] if "+" in k else "none": v["makespan_s"] for k, v in res.items()}
    print({k: round(v, 1) for k, v in ms.items()})
    assert ms["sam_group_exchange+history+adaptive"] < min(ms["sam_group_exchange+history"],
                                                           ms["sam_group_exchange+adaptive"])
    assert max(ms["sam_group_exchange+history"], ms["sam_group_exchange+adaptive"]) < \
        ms["sam_group_exchange+verify"] < ms["none"]
    ks = res["both+sam_group_exchange+adaptive"]["engine_steps_per_k"]
    assert len(ks) >= 2 and res["both+sam_group_exchange+verify"]["engine_steps_per_k"] == {"3": sum(ks.values())}
    # roofline verification: extra query tokens are free until their compute exceeds the fitted decode step
    capsys.readouterr()
    assert main(["rollout", "--lengths", str(out), "--dp", "8", "--max-num-seqs", "64", "--policy", "both",
                 "--drafting", ",".join(names), "--verify-model", "roofline", "--json"]) == 0
    roof = json.loads(capsys.readouterr().out)["results"]
    ms_r = {k.split("+", 1)[-1]: v["makespan_s"] for k, v in roof.items()}
    print("roofline", {k: round(v, 1) for k, v in ms_r.items()})
    for name in names:  # never dearer than the linear charge per draft token
        assert ms_r[name] <= ms[name] + 1e-9
    assert ms_r["sam_group_exchange+history+adaptive"] < ms["sam_group_exchange+history+adaptive"]


def test_roofline_verification_cost() -> None:
    """``--verify-model roofline``: the step is the fitted decode step while the query tokens' compute stays under
    it (k = 0 never changes the fit), the compute side (FLOP at the stated inputs) once it is larger; the adaptive
    pick then drafts longer in a full batch than the linear charge allows."""
    from qwen3_rl.tools.sim.drafting import ATTN_FLOP_PER_CTX, FLOP_PER_TOKEN, TPS, DraftModel
    from qwen3_rl.tools.sim.simulate import SimError, StepModel

    sm = StepModel()
    roof = DraftModel(TPS[("history", "bulk")], TPS[("history", "tail")], fixed_k=None, verify_model="roofline")
    lin = DraftModel(TPS[("history", "bulk")], TPS[("history", "tail")], fixed_k=None)
    ctx = 256 * 4000.0
    assert roof.rank_flop_per_ms == pytest.approx(4 * 390e12 * 0.5 / 1000)
    assert roof.verify_ms(sm, 0, 256, 256, ctx) == pytest.approx(sm.step_ms(256, ctx) + 0.4)  # fit unchanged
    comp15 = 16 * (FLOP_PER_TOKEN * 256 + ATTN_FLOP_PER_CTX * ctx) / roof.rank_flop_per_ms
    assert sm.t0_ms + comp15 > sm.step_ms(256, ctx)  # k = 15 in a full batch reaches the roof ...
    assert roof.verify_ms(sm, 15, 256, 256, ctx) == pytest.approx(sm.t0_ms + comp15 + 0.4)
    assert roof.verify_ms(sm, 3, 4, 4, 4 * 30000.0) == pytest.approx(sm.step_ms(4, 4 * 30000.0) + 0.4)  # tail: free
    k_roof, k_lin = roof.pick(sm, 256, 256, ctx)[0], lin.pick(sm, 256, 256, ctx)[0]
    assert k_lin < k_roof < 15  # ... so the pick stops short of k_max in the bulk
    with pytest.raises(SimError):
        DraftModel((1.0,), (1.0,), verify_model="free")
    with pytest.raises(SimError):
        DraftModel((1.0,), (1.0,), verify_model="roofline", mfu=0.0)


def test_simulator_history_coverage_and_sibling_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--history-coverage F``: a share F of the requests drafts with history, the rest without (tokens per
    request-step = harmonic mean per k), so the history row slows as F falls and equals the no-history row at
    F = 0 (same tables); F = 1 is the plain history row. ``--draft-siblings 8``: the no-history tables measured
    with 8 current siblings draft more than those with 4 and leave the full-coverage history tables untouched."""
    from qwen3_rl.tools.sim.drafting import TPS, TPS_SIBLINGS8, draft_model, history_tables
    from qwen3_rl.tools.sim.simulate import Drafting, SimError, main

    assert history_tables(1.0) == {p: TPS[p] for p in (("history", "bulk"), ("history", "tail"))}
    for seg in ("bulk", "tail"):
        assert history_tables(0.0)[("history", seg)] == pytest.approx(TPS[("current", seg)])
        half = history_tables(0.5)[("history", seg)]
        h, c = TPS[("history", seg)], TPS[("current", seg)]
        assert half[2] == pytest.approx(2.0 / (1.0 / h[2] + 1.0 / c[2]))  # 2 requests of L tokens: 2L / steps
        assert all(min(a, b) <= x <= max(a, b) for x, a, b in zip(half, h, c, strict=True))
    assert all(a > b for a, b in zip(TPS_SIBLINGS8[("current", "bulk")][1:], TPS[("current", "bulk")][1:],
                                     strict=True))
    # the 8-sibling tables' source: the lockstep replay with all 8 samples of every prompt current, no history
    r8 = replay_visits(load_corpus(CORPUS), SamConfig(num_speculative_tokens=3, group_mode=True), 3, 0,
                       use_history=False)
    assert r8["current_requests"] == 176
    assert (r8["bulk_mean_accepted"], r8["tail_mean_accepted"]) == pytest.approx(
        (TPS_SIBLINGS8[("current", "bulk")][2], TPS_SIBLINGS8[("current", "tail")][2]), abs=5e-4)
    assert draft_model("sam_group+history", "default", Drafting(), siblings=8, coverage=0.0).bulk == \
        pytest.approx(TPS_SIBLINGS8[("current", "bulk")])
    with pytest.raises(SimError):
        draft_model("sam_group+history", "default", Drafting(), coverage=1.5)

    out = tmp_path / "len.jsonl"
    assert main(["gen-lengths", "--out", str(out), "--num-prompts", "16", "--n", "8", "--seed", "1"]) == 0
    names = "sam_group_exchange+verify,sam_group_exchange+history"

    def run(*extra: str) -> dict[str, float]:
        capsys.readouterr()
        assert main(["rollout", "--lengths", str(out), "--dp", "4", "--max-num-seqs", "32", "--policy", "both",
                     "--drafting", names, "--json", *extra]) == 0
        res = json.loads(capsys.readouterr().out)["results"]
        return {k.split("+", 2)[-1]: v["makespan_s"] for k, v in res.items()}

    full, half_, zero = run(), run("--history-coverage", "0.5"), run("--history-coverage", "0")
    sib8 = run("--draft-siblings", "8")
    print({"F=1": full, "F=0.5": half_, "F=0": zero, "siblings 8": sib8})
    assert full["history"] < half_["history"] < zero["history"]
    assert zero["history"] == pytest.approx(full["verify"])  # F = 0: the no-history tables
    assert full["verify"] == half_["verify"] == zero["verify"]  # coverage acts on history rows only
    assert sib8["verify"] < full["verify"] and sib8["history"] == full["history"]
    for bad, word in ((["--history-coverage", "-0.1"], "--history-coverage"), (["--draft-siblings", "5"], "siblings")):
        capsys.readouterr()
        assert main(["rollout", "--lengths", str(out), "--dp", "4", "--max-num-seqs", "32", "--drafting", names,
                     *bad]) == 2
        err = capsys.readouterr().err
        assert word in err and len(err.strip().splitlines()) == 1  # one line
