"""Data preparation (downloaded files -> verl parquet) and the answer verifier, on tiny files written here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qwen3_rl.data.reward import compute_score, extract_final_answer
from qwen3_rl.tools.data.prepare import DataError, main, prepare

REPO = Path(__file__).resolve().parents[2]
COLUMNS = {"data_source", "prompt", "ability", "reward_model", "extra_info"}


def _verl_row(i: int, q: str, gt: str, source: str = "math_dapo") -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": q}], "ability": "MATH",
            "reward_model": {"ground_truth": gt, "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": f"id{i}"}}


def test_deepscaler_json_to_verl_parquet(tmp_path: Path) -> None:
    src = tmp_path / "deepscaler.json"
    src.write_text(json.dumps([{"problem": "What is 1+1?", "answer": "2", "solution": "..."},
                               {"problem": "Half of one?", "answer": "\\frac{1}{2}", "solution": "..."}]))
    out = prepare("deepscaler", src, tmp_path / "out")
    assert out == tmp_path / "out" / "train.parquet"
    rows = pq.read_table(out).to_pylist()
    assert set(rows[0]) == COLUMNS and len(rows) == 2
    assert rows[1]["prompt"][0]["role"] == "user" and "\\boxed{}" in rows[1]["prompt"][0]["content"]
    assert rows[1]["reward_model"] == {"style": "rule", "ground_truth": "\\frac{1}{2}"}
    assert rows[0]["extra_info"] == {"split": "train", "index": 0} and rows[0]["data_source"] == "deepscaler"


def test_dapo_and_aime_parquet_pass_through(tmp_path: Path) -> None:
    src = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist([_verl_row(i, f"q{i} Answer: $Answer", str(i)) for i in range(3)]), src)
    rows = pq.read_table(prepare("dapo-math", src, tmp_path / "dapo")).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["data_source"] == "math_dapo" and rows[0]["extra_info"]["index"] == "id0"
    aime = tmp_path / "aime-2024.parquet"
    pq.write_table(pa.Table.from_pylist([_verl_row(0, "aime q", "204", "aime2024")]), aime)
    out = prepare("aime2024", aime, tmp_path / "aime")
    assert out.name == "test.parquet" and pq.read_table(out).to_pylist()[0]["extra_info"]["split"] == "test"


def test_gsm8k_jsonl(tmp_path: Path) -> None:
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"work\n#### {1000 + i:,}"})
                             for i in range(2)))
    rows = pq.read_table(prepare("gsm8k", src, tmp_path / "g")).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1000", "1001"]
    assert rows[0]["data_source"] == "openai/gsm8k"


def test_cli_forms_and_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "d.json"
    src.write_text(json.dumps([{"problem": "p", "answer": "1"}]))
    assert main(["prepare", "--dataset", "deepscaler", "--input", str(src), "--out", str(tmp_path / "a")]) == 0
    assert main(["deepscaler", "--input", str(src), "--output", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "train.parquet").is_file()
    capsys.readouterr()

    def err(argv: list[str]) -> str:
        assert main(argv) == 2
        text = capsys.readouterr().err.strip()
        assert len(text.splitlines()) == 1, text
        return text

    assert "unknown dataset 'mmlu' (known: deepscaler, dapo-math-17k, aime2024, gsm8k)" in err(
        ["prepare", "--dataset", "mmlu", "--input", str(src), "--out", str(tmp_path)])
    assert "input file not found" in err(["gsm8k", "--input", str(tmp_path / "none.json"), "--out", str(tmp_path)])
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([{"question": "q", "solution": "s"}]))
    assert "row 0: missing column(s) ['problem', 'answer']" in err(
        ["deepscaler", "--input", str(wrong), "--out", str(tmp_path)])
    nohash = tmp_path / "g.json"
    nohash.write_text(json.dumps([{"question": "q", "answer": "42"}]))
    assert "no '#### <number>'" in err(["gsm8k", "--input", str(nohash), "--out", str(tmp_path)])
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    assert "unsupported input format '.csv'" in err(["deepscaler", "--input", str(csv), "--out", str(tmp_path)])
    empty = tmp_path / "e.json"
    empty.write_text("[]")
    assert "input has no rows" in err(["deepscaler", "--input", str(empty), "--out", str(tmp_path)])
    nogt = tmp_path / "nogt.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "reward_model": {"style": "rule"}}]), nogt)
    assert "'reward_model' has no 'ground_truth'" in err(["aime", "--input", str(nogt), "--out", str(tmp_path)])
    with pytest.raises(DataError):
        prepare("deepscaler", tmp_path / "none.parquet", tmp_path)


def test_dispatcher_branch(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "data", "prepare", "--dataset", "nope", "--input",
                           "x", "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: unknown dataset 'nope'")


LONG_COT = " ".join(f"step {i}: we get {i * 7 % 101} and {i}." for i in range(3000))  # every small number


@pytest.mark.parametrize(("response", "gt", "ok"), [
    ("so the result is \\boxed{\\frac{1}{2}}", "0.5", True),
    ("thus \\boxed{x^2+2x+1}.", "(x+1)^2", True),
    ("nested \\boxed{\\sqrt{\\frac{3}{4}}}", "\\frac{\\sqrt{3}}{2}", True),
    ("a first guess \\boxed{5}, corrected: \\boxed{7}", "5", False),  # the LAST marked answer counts
    ("Long work\nAnswer: 72", "72", True),  # DAPO / AIME prompt format
    ("Answer: $\\boxed{204}$", "204", True),
    ("... #### 1,000", "1000", True),  # GSM8K format
    (LONG_COT, "42", False),  # right number somewhere, no marked answer
    (LONG_COT + " The answer is 42 I think", "42", False),  # unmarked
    (LONG_COT + " so \\boxed{41}", "42", False),
    (LONG_COT + " so \\boxed{42}", "42", True),
    ("\\boxed{", "1", False),  # malformed
    ("", "1", False),
])
def test_verifier(response: str, gt: str, ok: bool) -> None:
    res = compute_score("deepscaler", response, gt)
    assert res["acc"] is ok and res["score"] == (1.0 if ok else 0.0)
    assert compute_score("math_dapo", response, gt, incorrect_score=-1.0)["score"] == (1.0 if ok else -1.0)


def test_extract_final_answer() -> None:
    assert extract_final_answer("x \\fbox{3} y") == "3"
    assert extract_final_answer("\\boxed 9") == "9"
    assert extract_final_answer("no answer here 12") is None
    assert compute_score("openai/gsm8k", "#### 18", "Natalia sold ... #### 18")["acc"] is True


def test_reward_file_loads_like_verl(tmp_path: Path) -> None:
    """verl imports custom_reward_function.path by file location as 'custom_module': no package imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("custom_module_test", REPO / "qwen3_rl" / "data" / "reward.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    assert mod.compute_score(data_source="aime2024", solution_str="Answer: 204", ground_truth="204",
                             extra_info={})["acc"] is True
