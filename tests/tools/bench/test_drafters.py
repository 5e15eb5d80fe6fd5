"""``python -m qwen3_rl.tools.bench.drafters --cost-table FILE``: fixed k = 1, 3, 7, 15 and adaptive k priced at
every cell of a measured cost table (``cost_cells``), on a small slice of the dev corpus; a bad table stops before
any replay with one error line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO.parent / "shared" / "bench"  # ../shared beside the checkout
CORPUS = BENCH / "rollouts_dev.jsonl"
H100 = BENCH / "verify_cost_h100.json"
CTX32K = BENCH / "verify_cost_h100_ctx32k.json"


def _bench(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "qwen3_rl.tools.bench.drafters", "--corpus", str(CORPUS), "--group", "--history", "4",
           "--limit-prompts", "3", "--skip-cost", "--methods", "sam_group_history", "--vllm-tree",
           str(tmp_path / "no-vllm"), *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_cost_table_cells(tmp_path: Path) -> None:
    proc = _bench(tmp_path, "--cost-table", str(CTX32K), "--cost-table", f"{H100}@qwen3-32b-tp8", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    cells = res["cost_cells"]
    # ctx32k: 2 shapes x B {8, 64, 256} x ctx {32768}; the H100 file's dense shape: B {1, 8, 32, 128, 256} x 2 ctx
    assert len(cells) == 6 + 10
    assert {(c["table"], c["shape"]) for c in cells} == {
        (CTX32K.name, "qwen3-30b-a3b"), (CTX32K.name, "qwen3-32b-tp8"), (H100.name, "qwen3-32b-tp8")}
    methods = {"k1", "k3", "k7", "k15", "adaptive", "adaptive_linear"}
    for c in cells:
        assert {"shape", "B", "ctx", "segment", "speedup", "speedup_padded"} <= set(c)
        assert c["segment"] == ("tail" if c["B"] <= 8 else "bulk")
        assert set(c["speedup"]) == set(c["speedup_padded"]) == methods
        assert all(v > 0 for v in (*c["speedup"].values(), *c["speedup_padded"].values()))
        # a draft helps per step when it is nearly free: the dense shape with few requests
        if c["shape"] == "qwen3-32b-tp8" and c["B"] <= 8:
            assert c["speedup"]["k3"] > 1.2 and c["speedup"]["adaptive"] > 1.2
    assert set(res["cost_goals"]) == {"speedup", "speedup_padded"}
    assert res["cost_history"] == 4 and res["cost_k_max"] == 15
    # the text form prints the cell table
    text = _bench(tmp_path, "--cost-table", str(CTX32K))
    assert text.returncode == 0 and "| shape | B | ctx | segment | k1 | k3 | k7 | k15 | adaptive |" in text.stdout


@pytest.mark.parametrize("spec,msg", [("none.json", "cannot read it"), ("bad.json", "not JSON"),
                                      (f"{H100}@qwen3-8b", "no shape 'qwen3-8b'")])
def test_bad_cost_table_is_one_line(tmp_path: Path, spec: str, msg: str) -> None:
    (tmp_path / "bad.json").write_text("{")
    if not spec.startswith("/"):
        spec = str(tmp_path / spec)
    proc = _bench(tmp_path, "--cost-table", spec, "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: cost table ") and msg in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_halves_split_the_prompts() -> None:
    """``--half a`` / ``b``: the odd and the even prompts of the file, disjoint, together all of it; another value is
    refused."""
    from qwen3_rl.tools.bench.drafters import load_corpus

    every = [g[0].prompt_id for g in load_corpus(CORPUS)]
    a = [g[0].prompt_id for g in load_corpus(CORPUS, half="a")]
    b = [g[0].prompt_id for g in load_corpus(CORPUS, half="b")]
    assert a == every[0::2] and b == every[1::2] and not set(a) & set(b) and len(a) + len(b) == len(every) == 22
    assert [len(g) for g in load_corpus(CORPUS, half="a")] == [8] * 11
    with pytest.raises(ValueError, match="half must be"):
        load_corpus(CORPUS, half="c")


def test_fixed_k_on_the_same_steps() -> None:
    """``fixed_on_steps`` prices fixed k on another replay's own steps: on the fixed k = 3 replay's steps it gives that
    replay's own priced speedup (``priced_speedup``, both pricings); on an adaptive replay's steps (proposals up to 15
    tokens) fixed k = 1, 3 and 15 give three different figures."""
    from qwen3_rl.spec_decode.cost_table import load_cost_tables
    from qwen3_rl.spec_decode.sam import SamConfig
    from qwen3_rl.tools.bench.drafters import fixed_on_steps, load_corpus, priced_speedup, replay_visits

    groups = load_corpus(CORPUS, limit_prompts=3)
    table = load_cost_tables(H100)["qwen3-30b-a3b"]
    rec: list[tuple[int, int, int]] = []
    sts: list = []
    cfg = SamConfig(num_speculative_tokens=3, group_mode=True, history_responses=4)
    replay_visits(groups, cfg, 3, 4, use_history=True, record=rec, states=sts)
    assert len(sts) == len(rec) and all(s.shape == (n, 3) for s, (n, _, _) in zip(sts, rec, strict=True))
    for seg, b in (("tail", 1.0), ("bulk", 32.0)):
        own = priced_speedup(rec, table, b, 8192.0, seg)
        assert own is not None and fixed_on_steps(sts, table, b, 8192.0, seg, 3, False) == pytest.approx(own)
        padded = priced_speedup(rec, table, b, 8192.0, seg, fixed_k=3)
        assert fixed_on_steps(sts, table, b, 8192.0, seg, 3, True) == pytest.approx(padded)
    # an adaptive replay (k_max 15): its states hold proposals up to 15 tokens, so the fixed k differ
    ada = SamConfig(num_speculative_tokens=15, group_mode=True, history_responses=4, adaptive_k=True,
                    cost_table=f"{H100}@qwen3-30b-a3b")
    rec_a: list[tuple[int, int, int]] = []
    sts_a: list = []
    replay_visits(groups, ada, 15, 4, use_history=True, adaptive=True, cell=(1.0, 8192.0), record=rec_a,
                  states=sts_a)
    figs = {k: fixed_on_steps(sts_a, table, 1.0, 8192.0, "tail", k, False) for k in (1, 3, 15)}
    print("fixed k on the adaptive replay's tail:", figs, "adaptive:", priced_speedup(rec_a, table, 1.0, 8192.0, "tail"))
    assert len(set(figs.values())) == 3
    tail = [s for s in sts_a if s.shape[0] <= 8]
    assert tail and any(int(s[:, 0].max()) > 3 for s in tail)  # matches beyond 3 tokens: what k = 15 would take
