"""Adaptive draft length priced by a measured cost table (``SAM_COST_TABLE``, ``spec_decode/cost_table.py``).

Checks: the H100 table loads and prices its own rows exactly; interpolation between grid points equals hand-computed
values (and clamps / extrapolates as documented); a bad file is one error line naming it, at load, in
``sam_config`` and in ``AdaptiveK``; the table-priced choice reaches the brute-force optimum, equals the linear
model's choice on a table made from the linear model, drafts long where the table says long drafts are cheap (dense
shape, few requests) and short where they are dear (dense, 256 requests; MoE, one request); the linear model without
a table chooses as before (corpus replay figures of the code before the table); the runner builds the policy from
``sam_config.cost_table`` and its warm-up compiles the table kernels; on the dev corpus adaptive k priced by the
table is within 3 % of the best fixed k in every cell of the H100 table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwen3_rl.spec_decode.adaptive_k import AdaptiveK
from qwen3_rl.spec_decode.config import parse_sam_options
from qwen3_rl.spec_decode.cost_table import CostTableError, load_cost_table, load_cost_tables, price
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
from qwen3_rl.spec_decode.sam import SamConfig
from qwen3_rl.tools.bench.drafters import cost_cells, load_corpus, replay_visits

from helpers.fake_input_batch import FakeInputBatch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO.parent / "shared" / "bench"  # ../shared beside the checkout
H100 = BENCH / "verify_cost_h100.json"
CORPUS = BENCH / "rollouts_dev.jsonl"
DENSE = f"{H100}@qwen3-32b-tp8"
MOE = f"{H100}@qwen3-30b-a3b"
KMAX = 15


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"rows": rows}))
    return path


# a small hand-made table: B {1, 9}, k {0, 1, 3}, ctx {1000, 3000}; step_ms = a number per cell chosen by hand
SMALL = {(1, 0, 1000): 10.0, (1, 1, 1000): 12.0, (1, 3, 1000): 20.0,
         (1, 0, 3000): 14.0, (1, 1, 3000): 15.0, (1, 3, 3000): 22.0,
         (9, 0, 1000): 30.0, (9, 1, 1000): 40.0, (9, 3, 1000): 80.0,
         (9, 0, 3000): 34.0, (9, 1, 3000): 46.0, (9, 3, 3000): 90.0}


def _small(tmp_path: Path) -> Path:
    return _write(tmp_path / "small.json", [{"model": "s", "B": b, "k": k, "ctx": c, "step_ms": ms}
                                            for (b, k, c), ms in SMALL.items()])


def test_measured_table_prices_its_own_rows() -> None:
    """Every row of the H100 file: step_ms and ratio_to_k0 at the grid point are the measured ones."""
    rows = json.loads(H100.read_text())["rows"]
    tables = load_cost_tables(H100)
    assert sorted(tables) == ["qwen3-30b-a3b", "qwen3-32b-tp8"]
    t = tables["qwen3-32b-tp8"]
    assert t.b.tolist() == [1, 8, 32, 128, 256] and t.k.tolist() == [0, 1, 3, 7, 15] and t.ctx.tolist() == [1024, 8192]
    assert len(rows) == 100
    for r in rows:
        tab = tables[r["model"]]
        q = r["B"] * (1 + r["k"])
        assert tab.step_ms(r["B"], q, r["ctx"]) == pytest.approx(r["step_ms"], rel=1e-12)
        assert tab.ratio_to_k0(r["B"], q, r["ctx"]) == pytest.approx(r["ratio_to_k0"], rel=1e-3)
    # the README's figures: dense B = 256, ctx 1K, k = 3 costs 1.85x; MoE B = 1, ctx 8K, k = 15 costs 1.98x
    assert t.ratio_to_k0(256, 256 * 4, 1024) == pytest.approx(1.85, abs=0.005)
    assert tables["qwen3-30b-a3b"].ratio_to_k0(1, 16, 8192) == pytest.approx(1.98, abs=0.005)


def test_interpolation_by_hand(tmp_path: Path) -> None:
    t = load_cost_table(str(_small(tmp_path)))
    assert t.shape == "s" and t.k_max == 3 and t.q.tolist() == [1.0, 2.0, 4.0]
    # grid points
    for (b, k, c), ms in SMALL.items():
        assert t.step_ms(b, b * (1 + k), c) == pytest.approx(ms)
    # halfway along one axis
    assert t.step_ms(5, 5 * 1, 1000) == pytest.approx((10.0 + 30.0) / 2)  # B = 5 between 1 and 9, k = 0
    assert t.step_ms(1, 3, 1000) == pytest.approx((12.0 + 20.0) / 2)  # q = 3 between q = 2 (k 1) and q = 4 (k 3)
    assert t.step_ms(9, 9, 2000) == pytest.approx((30.0 + 34.0) / 2)  # ctx 2000 between 1000 and 3000
    # the middle of the cube: the mean of its 8 corners (B 5, q 3, ctx 2000), by hand
    corners = (12 + 20 + 15 + 22 + 40 + 80 + 46 + 90) / 8.0
    assert t.step_ms(5, 15, 2000) == pytest.approx(corners)
    # B 3 (w 0.25), q 2 (k 1), ctx 1500 (w 0.25): ((1-.25)*((1-.25)*12 + .25*15) + .25*((1-.25)*40 + .25*46))
    assert t.step_ms(3, 6, 1500) == pytest.approx(0.75 * (0.75 * 12 + 0.25 * 15) + 0.25 * (0.75 * 40 + 0.25 * 46))
    # requests drafting different lengths: 2 requests with k 1 and 3 send 2 + 4 = 6 query tokens (q = 3)
    assert t.step_ms(2, 6, 1000) == pytest.approx(t.step_ms(2, 2 * 3, 1000))
    # outside: B and ctx clamp to the edge, q beyond the grid continues the last slope ((20 - 12) / 2 per q)
    assert t.step_ms(100, 100, 1000) == pytest.approx(30.0)
    assert t.step_ms(1, 1, 50) == pytest.approx(10.0) and t.step_ms(1, 1, 1e6) == pytest.approx(14.0)
    assert t.step_ms(1, 6, 1000) == pytest.approx(20.0 + 2 * 4.0)
    assert t.ratio_to_k0(9, 36, 3000) == pytest.approx(90.0 / 34.0)
    curve = t.curve(5, 2000)
    assert curve.tolist() == pytest.approx([22.0, (12 + 15 + 40 + 46) / 4, (20 + 22 + 80 + 90) / 4])
    assert price(t.q, curve, 1.5) == pytest.approx((curve[0] + curve[1]) / 2)


BAD = [
    ("missing", None, "cannot read it"),
    ("text", "not json", "not JSON"),
    ("list", [], "expected a JSON object with 'rows'"),
    ("empty", {"rows": []}, "'rows' must be a non-empty list"),
    ("step", {"rows": [{"model": "s", "B": 1, "k": 0, "ctx": 8, "step_ms": -1.0}]}, "'step_ms' must be a number >= 0"),
    ("zero", {"rows": [{"model": "s", "B": 1, "k": 0, "ctx": 8, "step_ms": 0}]}, "'step_ms' must be > 0"),
    ("b0", {"rows": [{"model": "s", "B": 0, "k": 0, "ctx": 8, "step_ms": 1.0}]}, "'B' must be an integer >= 1"),
    ("kbool", {"rows": [{"model": "s", "B": 1, "k": True, "ctx": 8, "step_ms": 1.0}]}, "'k' must be an integer"),
    ("model", {"rows": [{"B": 1, "k": 0, "ctx": 8, "step_ms": 1.0}]}, "'model' (the shape)"),
    ("dup", {"rows": [{"model": "s", "B": 1, "k": 0, "ctx": 8, "step_ms": 1.0}] * 2}, "second row for s B=1 k=0"),
    ("nok0", {"rows": [{"model": "s", "B": 1, "k": 1, "ctx": 8, "step_ms": 1.0}]}, "needs rows at k = 0"),
    ("hole", {"rows": [{"model": "s", "B": b, "k": k, "ctx": 8, "step_ms": 1.0} for b, k in ((1, 0), (1, 1), (8, 0))]},
     "not a full grid"),
    ("ratio", {"rows": [{"model": "s", "B": 1, "k": k, "ctx": 8, "step_ms": 1.0 + k, "ratio_to_k0": 1.0} for k in (0, 1)]},
     "ratio_to_k0 1 is not step_ms / step_ms(k=0) = 2"),
]


@pytest.mark.parametrize("name,content,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_file_is_one_line(tmp_path: Path, name: str, content: object, msg: str) -> None:
    f = tmp_path / f"{name}.json"
    if content is not None:
        f.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(CostTableError) as err:
        load_cost_table(str(f))
    text = str(err.value)
    assert msg in text and str(f) in text and "\n" not in text, text
    # the drafter's config refuses it the same way (one line, naming the option)
    with pytest.raises(ValueError) as err2:
        parse_sam_options({"adaptive_k": True, "cost_table": str(f)}, 1)
    assert str(err2.value).startswith("speculative_config.sam_config.cost_table: cost table ") and \
        "\n" not in str(err2.value)


def test_shape_choice_and_config_checks(tmp_path: Path) -> None:
    with pytest.raises(CostTableError, match=r"holds 2 shapes \(qwen3-30b-a3b, qwen3-32b-tp8\); name one as FILE@SHAPE"):
        load_cost_table(str(H100))
    with pytest.raises(CostTableError, match=r"no shape 'qwen3-8b' \(it holds qwen3-30b-a3b, qwen3-32b-tp8\)"):
        load_cost_table(f"{H100}@qwen3-8b")
    assert load_cost_table(DENSE).shape == "qwen3-32b-tp8"
    small = str(_small(tmp_path))
    assert load_cost_table(small).shape == "s"  # one shape: the file alone
    cfg = parse_sam_options({"adaptive_k": True, "cost_table": DENSE}, KMAX)
    assert cfg.cost_table == DENSE
    with pytest.raises(ValueError, match="cost_table prices the adaptive draft length: it needs adaptive_k=True"):
        parse_sam_options({"cost_table": DENSE}, 3)
    with pytest.raises(ValueError, match=r"measures k <= 3, below num_speculative_tokens = 4"):
        parse_sam_options({"adaptive_k": True, "cost_table": small}, 4)
    with pytest.raises(ValueError, match="cost_table must be str"):
        parse_sam_options({"adaptive_k": True, "cost_table": 1}, 3)
    with pytest.raises(ValueError, match=r"measures k <= 3, below the longest draft k_max = 8"):
        AdaptiveK(8, table=load_cost_table(small))
    with pytest.raises(ValueError, match="pin needs a cost table"):
        AdaptiveK(3).pin(8, 1000)


def _trained(p: float, uniform: bool = False, table: str | None = None, steps: int = 200, n: int = 64
             ) -> AdaptiveK:
    """A policy that has seen ``steps`` steps of ``n`` requests drafting k_max tokens, each accepted with
    probability ``p`` while the previous ones were (geometric runs)."""
    pol = AdaptiveK(KMAX, uniform=uniform, table=load_cost_table(table) if table else None)
    rng = np.random.default_rng(0)
    slots = np.arange(n)
    for _ in range(steps):
        acc = np.minimum(rng.geometric(1.0 - p, n) - 1, KMAX)
        pol.observe(slots, np.full(n, KMAX), acc)
    return pol


@pytest.mark.parametrize("uniform", [False, True])
def test_table_drafts_long_where_cheap_short_where_dear(uniform: bool) -> None:
    """Same acceptance (p = 0.7), three table cells: dense with 2 requests (k = 15 costs 1.09x: long drafts),
    dense with 256 requests at 1K context (compute-bound: short), MoE with one request (every draft token reads 8
    more experts: k = 15 costs 2x, shorter than dense)."""
    dense, moe = _trained(0.7, uniform, DENSE), _trained(0.7, uniform, MOE)
    tail = dense.choose(np.arange(2), np.full(2, KMAX), 2 * 8192.0)
    bulk = dense.choose(np.arange(256) % 64, np.full(256, KMAX), 256 * 1024.0)
    one = moe.choose(np.arange(1), np.full(1, KMAX), 8192.0)
    print(f"dense tail {tail.tolist()}, dense bulk {np.bincount(bulk).tolist()}, moe one {one.tolist()}")
    assert tail.min() >= 14 and bulk.max() <= 3 and 2 <= one.max() <= 7
    assert one.max() < tail.min()
    if uniform:
        assert len(set(bulk.tolist())) == 1 and len(set(tail.tolist())) == 1
    # the same batch at 8K context: drafting costs less (1.33x at k = 3 against 1.85x), drafts get longer
    assert dense.choose(np.arange(256) % 64, np.full(256, KMAX), 256 * 8192.0).mean() > bulk.mean()
    # acceptance matters too: at p = 0.2 even the cheap tail drafts short
    low = _trained(0.2, uniform, DENSE).choose(np.arange(2), np.full(2, KMAX), 2 * 8192.0)
    assert low.max() < tail.min()


def _objective(G: np.ndarray, k: np.ndarray, runs: int, cost) -> float:
    gain = runs + sum(G[i, : k[i]].sum() for i in range(G.shape[0]))
    return gain / cost(int(k.sum()))


def test_table_choice_reaches_the_brute_force_optimum(tmp_path: Path) -> None:
    """Random acceptance and random (non-convex) measured curves: the sweep's kept set (bins, then the boundary bins
    gain by gain) is as good as the best top-m set (every m, all gains sorted)."""
    rng = np.random.default_rng(5)
    for trial in range(100):
        n = int(rng.integers(1, 12))
        base = rng.uniform(5, 50)
        rows = [{"model": "r", "B": b, "k": k, "ctx": 1000, "step_ms": base * b ** 0.3 * (1 + inc)}
                for b in (1, 16) for k, inc in zip((0, 1, 3, 7, 15), np.concatenate(
                    [[0.0], np.sort(rng.uniform(0, 3, 4))]), strict=True)]
        table = load_cost_table(str(_write(tmp_path / f"r{trial}.json", rows)))
        pol = AdaptiveK(KMAX, table=table)
        slots = np.arange(n)
        pol.first[:n] = rng.uniform(0, 1, n)
        pol.reach[:] = 10.0
        pol.acc[:] = np.sort(rng.uniform(2, 10, KMAX))[::-1]
        avail = rng.integers(0, KMAX + 1, n)
        k = pol.choose(slots, avail, n * 1000.0)
        G = pol.gains(slots)  # what the choice was made on
        curve = table.curve(n, 1000.0)

        def cost(m: int, n=n, q=table.q, curve=curve) -> float:
            return float(price(q, curve, 1.0 + m / n))

        gains = sorted(((G[i, j], i) for i in range(n) for j in range(min(avail[i], KMAX))), reverse=True)
        floor = np.minimum(avail, 1)
        best = 0.0
        for m in range(len(gains) + 1):  # top-m gains (prefixes per request since g falls with j), floor kept
            kk = floor.copy()
            cnt = np.zeros(n, np.int64)
            for _, i in gains[:m]:
                cnt[i] += 1
            kk = np.maximum(kk, cnt)
            best = max(best, _objective(G, kk, n, cost))
        got = _objective(G, k, n, cost)
        assert (k <= avail).all() and (k >= np.minimum(avail, 1)).all()
        assert got >= best * (1 - 1e-12), (trial, got, best)


def test_linear_table_chooses_as_the_linear_model(tmp_path: Path) -> None:
    """A table written from the linear model itself (base + seq * B + token * drafted + kctx * context; bilinear,
    so the interpolation is exact) gives the same draft lengths as the linear model (cross-check of both paths)."""
    base, seq, tok, kctx = 59.64, 0.3614, 0.0585, 0.07064
    rows = [{"model": "lin", "B": b, "k": k, "ctx": c, "step_ms": base + seq * b + tok * b * k + kctx * b * c / 1000}
            for b in (1, 512) for k in (0, 15) for c in (1000, 33000)]
    table = load_cost_table(str(_write(tmp_path / "lin.json", rows)))
    for n, ctx in ((2, 8000.0), (64, 4000.0), (256, 8000.0), (256, 30000.0)):
        lin, tab = _trained(0.7), AdaptiveK(KMAX, table=table)
        for name in ("reach", "acc", "first", "cobs", "cexp"):  # the same acceptance state, per request too
            setattr(tab, name, getattr(lin, name).copy())
        slots = np.arange(n) % 64
        k_lin = lin.choose(slots, np.full(n, KMAX), n * ctx)
        k_tab = tab.choose(slots, np.full(n, KMAX), n * ctx)
        assert tab.step_ms(n, 3 * n, n * ctx) == pytest.approx(lin.step_ms(n, 3 * n, n * ctx))
        print(n, ctx, np.bincount(k_lin, minlength=KMAX + 1).tolist(), np.bincount(k_tab, minlength=KMAX + 1).tolist())
        assert np.abs(k_lin - k_tab).max() <= 1 and (k_lin == k_tab).mean() >= 0.9


def test_linear_model_without_a_table_unchanged() -> None:
    """Positive control: without a table the policy is the linear model, untouched by the table path. The corpus
    replay (history 4, k_max 15, per-request k) gives the figures of the current gain model (match-length buckets,
    positions shrunk to the one before, each request's continuation factor; without that factor the model gave bulk
    2.069, tail 2.744; commit 37f99ef's model bulk 2.083, tail 2.713)."""
    groups = load_corpus(CORPUS)
    cfg = SamConfig(num_speculative_tokens=KMAX, group_mode=True, history_responses=4, adaptive_k=True)
    r = replay_visits(groups, cfg, 3, 4, use_history=True, adaptive=True)
    assert (r["bulk_mean_accepted"], r["tail_mean_accepted"]) == (2.057137527978115, 2.762458471760797)
    assert r["k_hist"] == [1480, 267, 2517, 3082, 2920, 1933, 1930, 797, 374, 223, 271, 199, 61, 46, 49, 537]
    assert AdaptiveK(KMAX).table is None


@pytest.mark.parametrize("pad", [False, True])
def test_runner_builds_the_table_policy(pad: bool) -> None:
    """``sam_config.cost_table`` reaches the runner's policy; with few requests (the dense tail) it drafts k_max,
    and with pad_drafts every draft of a step has one length."""
    cfg = parse_sam_options({"adaptive_k": True, "pad_drafts": pad, "cost_table": DENSE}, KMAX)
    sam = SamRunnerDrafter(cfg, 4096)
    pol = sam.adaptive
    assert pol is not None and pol.table is not None and pol.table.shape == "qwen3-32b-tp8" and pol.uniform == pad
    period = np.arange(100, 140, dtype=np.int32)
    text = np.tile(period, 6)
    lens = []
    for step in range(12):
        n = 160 + step * 16
        batch = FakeInputBatch.from_prompts([text[:n].tolist(), text[3: n + 3].tolist()], ["a", "b"])
        batch.num_prompt_tokens[:] = 41
        out = sam.step(batch, [[1], [1]], {"a": None, "b": None}, None)
        lens.append([len(d) for d in out])
    print(lens)
    assert all(max(x) <= KMAX for x in lens) and max(max(x) for x in lens[2:]) == KMAX
    if pad:
        assert all(len(set(x)) == 1 for x in lens)


_PROBE = """
import json, sys
from qwen3_rl.spec_decode import adaptive_k as A, cost_table as T
from qwen3_rl.spec_decode.config import parse_sam_options
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
names = [(A, "_choose_table"), (A, "_gains"), (T, "curve_into")]
before = [len(getattr(m, n).signatures) for m, n in names]
SamRunnerDrafter(parse_sam_options(json.loads(sys.argv[1]), 15), 512)
print("PROBE " + json.dumps({"before": before, "after": [len(getattr(m, n).signatures) for m, n in names]}))
"""


def test_warm_up_compiles_the_table_kernels() -> None:
    """In a fresh process, building the runner's drafter with a cost table compiles the table kernels and the gains
    kernel the first decode step calls (the warm-up's drafters carry the same config)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps({"adaptive_k": True, "cost_table": DENSE})],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")][-1][len("PROBE "):])
    assert r["before"] == [0, 0, 0] and min(r["after"]) >= 1, r


def test_corpus_goals_on_the_h100_table() -> None:
    """On the dev corpus (history 4, k_max 15) priced at every cell of the H100 table: adaptive k is >= 0.97 x the
    best fixed k in every cell (both pricings), also against the best fixed k = 1..15 on its own steps, and >= 1.10 x
    fixed k = 3 over the cells with B <= 8."""
    res = cost_cells(load_corpus(CORPUS), SamConfig(num_speculative_tokens=3, group_mode=True, history_responses=4),
                     [str(H100)], 4, KMAX)
    cells = res["cost_cells"]
    assert len(cells) == 20 and {c["segment"] for c in cells if c["B"] <= 8} == {"tail"}
    for key, g in res["cost_goals"].items():
        print(key, g)
        assert g["adaptive_vs_best_fixed_min"] >= 0.97 and g["adaptive_vs_k3_mean_small_b"] >= 1.10
        # its choices against every fixed k = 1..15 on its own steps (the same text: fixed_on_steps)
        assert g["adaptive_vs_best_fixed_same_steps_min"] >= 0.97 and g["cells_below_0.97_same_steps"] == 0
    # the fixed k priced padded is the table's own ratio: tokens per step / ratio_to_k0
    t = load_cost_tables(H100)["qwen3-32b-tp8"]
    c = next(c for c in cells if (c["shape"], c["B"], c["ctx"]) == ("qwen3-32b-tp8", 256, 1024))
    assert c["speedup_padded"]["k3"] == pytest.approx(c["tokens_per_step"]["k3"] / t.ratio_to_k0(256, 1024, 1024))
    assert c["speedup"]["k3"] >= c["speedup_padded"]["k3"]  # a short draft costs its length, not k
    assert c["speedup"]["adaptive"] > c["speedup"]["adaptive_linear"]  # the table's point: the compute-bound bulk
