"""Verification pricing from a measured step table (``qwen3_rl.tools.sim.step_table``, ``simulate rollout
--step-table F --shape NAME``): interpolation at and between grid points, the shared H100 table, one-line errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from qwen3_rl.tools.sim.drafting import TPS, DraftModel
from qwen3_rl.tools.sim.simulate import SimError, StepModel, main
from qwen3_rl.tools.sim.step_table import StepTableError, interp_ratio, load_step_table, table_from_rows

REPO = Path(__file__).resolve().parents[3]
H100 = REPO.parent / "shared" / "bench" / "verify_cost_h100.json"  # ../shared beside the checkout


def _step(b: float, k: float, c: float) -> float:
    return 10.0 + b * (1.0 + k) + 0.01 * c * (1.0 + 0.5 * k)


def _rows(shape: str = "toy", drop: tuple = (), ratio: bool = False) -> list[dict]:
    rows = []
    for b, k, c in itertools.product((1, 9), (0, 2), (100, 300)):
        if (b, k, c) in drop:
            continue
        row = {"model": shape, "B": b, "k": k, "ctx": c, "step_ms": _step(b, k, c)}
        if ratio:
            row["ratio_to_k0"] = 2.0 + k  # deliberately not step_ms / step_ms(k = 0): the given ratio wins
        rows.append(row)
    return rows


def test_grid_points_between_and_outside() -> None:
    t = table_from_rows(_rows(), "toy")
    assert (t.Bs, t.ks, t.ctxs) == ((1.0, 9.0), (0.0, 2.0), (100.0, 300.0))
    for b, k, c in itertools.product((1, 9), (0, 2), (100, 300)):  # exact at every grid point
        assert interp_ratio(t, b, k, c) == pytest.approx(_step(b, k, c) / _step(b, 0, c))
    corners = [_step(b, k, c) / _step(b, 0, c) for b, k, c in itertools.product((1, 9), (0, 2), (100, 300))]
    assert interp_ratio(t, 5, 1, 200) == pytest.approx(sum(corners) / 8)  # the centre: mean of the corners
    r2 = _step(9, 2, 100) / _step(9, 0, 100)
    assert interp_ratio(t, 9, 0.5, 100) == pytest.approx(0.75 * 1.0 + 0.25 * r2)  # a quarter of the way in k
    assert interp_ratio(t, 400, 9, 1e6) == pytest.approx(interp_ratio(t, 9, 2, 300))  # clamped at the edges
    assert interp_ratio(t, 0.5, -1, 1) == 1.0
    given = table_from_rows(_rows(ratio=True), "toy")
    assert interp_ratio(given, 1, 2, 100) == 4.0 and interp_ratio(given, 1, 1, 100) == 3.0


def test_shared_h100_table() -> None:
    """The 30B-A3B grid of the shared H100 table: its axes, a cell read back, and a context between two cells."""
    t = load_step_table(H100, "qwen3-30b-a3b")
    assert (t.Bs, t.ks, t.ctxs) == ((1, 8, 32, 128, 256), (0, 1, 3, 7, 15), (1024, 8192))
    rows = {(r["B"], r["k"], r["ctx"]): r["ratio_to_k0"] for r in json.loads(H100.read_text())["rows"]
            if r["model"] == "qwen3-30b-a3b"}
    assert interp_ratio(t, 256, 3, 8192) == rows[(256, 3, 8192)] == pytest.approx(1.148)
    assert interp_ratio(t, 256, 3, 4608) == pytest.approx((rows[(256, 3, 1024)] + rows[(256, 3, 8192)]) / 2)
    assert interp_ratio(t, 256, 5, 8192) == pytest.approx((rows[(256, 3, 8192)] + rows[(256, 7, 8192)]) / 2)


def test_draft_model_prices_by_the_table() -> None:
    """Verify model "table": the fitted decode step times the ratio at (bucket, k, context per request), plus the
    drafter; a segment of one step costs the same; adaptive k picks what the table makes cheap."""
    sm = StepModel()
    t = table_from_rows(_rows(), "toy")
    dm = DraftModel(TPS[("current", "bulk")], TPS[("current", "tail")], fixed_k=None, verify_model="table", table=t)
    assert dm.verify_ms(sm, 2, 9, 9, 9 * 300.0) == pytest.approx(
        sm.step_ms(9, 2700.0) * _step(9, 2, 300) / _step(9, 0, 300) + 0.4)
    k, tau, _ = dm.pick(sm, 9, 9, 2700.0)
    assert dm.segment_ms(sm, 1, 9, 9, 2700.0, 0.0) == pytest.approx(dm.verify_ms(sm, k, 9, 9, 2700.0) / tau)
    flat = table_from_rows([{**r, "step_ms": 5.0} for r in _rows()], "toy")  # drafting free: the longest k wins
    assert DraftModel(TPS[("current", "tail")], TPS[("current", "tail")], fixed_k=None, verify_model="table",
                      table=flat).pick(sm, 4, 4, 400.0)[0] == 15
    with pytest.raises(SimError):
        DraftModel((1.0,), (1.0,), verify_model="table")


@pytest.mark.parametrize("case, word", [
    ("missing", "not found"), ("garbage", "not a JSON"), ("norows", "no 'rows'"), ("shape", "no rows for shape"),
    ("hole", "does not fill its grid"), ("nok0", "no k = 0"), ("dup", "two rows"), ("text", "finite number"),
])
def test_bad_table_is_a_one_line_error(case: str, word: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    f = tmp_path / "t.json"
    rows = _rows()
    body = {"rows": rows}
    if case == "garbage":
        f.write_text("{not json")
    elif case != "missing":
        if case == "norows":
            body = {"rows": []}
        elif case == "shape":
            body = {"rows": _rows("other")}
        elif case == "hole":
            body = {"rows": _rows(drop=((9, 2, 300),))}
        elif case == "nok0":
            body = {"rows": [r for r in rows if r["k"] != 0]}
        elif case == "dup":
            body = {"rows": [*rows, rows[0]]}
        elif case == "text":
            body = {"rows": [{**rows[0], "step_ms": "fast"}, *rows[1:]]}
        f.write_text(json.dumps(body))
    with pytest.raises(StepTableError, match=word):
        load_step_table(f, "toy")
    lens = tmp_path / "len.jsonl"
    assert main(["gen-lengths", "--out", str(lens), "--num-prompts", "4", "--n", "4"]) == 0
    capsys.readouterr()
    assert main(["rollout", "--lengths", str(lens), "--dp", "2", "--max-num-seqs", "8", "--drafting",
                 "sam_group+adaptive", "--step-table", str(f), "--shape", "toy"]) == 2
    err = capsys.readouterr().err
    assert word in err and len(err.strip().splitlines()) == 1


def test_cli_step_table_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--step-table`` rows: verify model "table" in the config, a rollout faster than without drafting; the
    table and --verify-model together, or a table without --shape, are one-line errors."""
    lens = tmp_path / "len.jsonl"
    assert main(["gen-lengths", "--out", str(lens), "--num-prompts", "16", "--n", "4", "--seed", "3"]) == 0
    capsys.readouterr()
    base = ["rollout", "--lengths", str(lens), "--dp", "2", "--max-num-seqs", "32", "--policy", "both"]
    assert main([*base, "--drafting", "none,sam_group_exchange+adaptive", "--step-table", str(H100), "--shape",
                 "qwen3-30b-a3b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["verify_model"] == "table" and out["config"]["shape"] == "qwen3-30b-a3b"
    res = out["results"]
    assert res["both+sam_group_exchange+adaptive"]["makespan_s"] < res["both"]["makespan_s"]
    for extra, word in ((["--verify-model", "roofline"], "drop --verify-model"), ([], "go together")):
        argv = [*base, "--drafting", "sam_group+adaptive", "--step-table", str(H100), *extra]
        if extra:
            argv += ["--shape", "qwen3-30b-a3b"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert word in err and len(err.strip().splitlines()) == 1
