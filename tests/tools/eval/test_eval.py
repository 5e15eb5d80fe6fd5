"""``python -m qwen3_rl eval``: the judge on known right and wrong answers, the score over rounds, the
OpenAI-server path against a local stand-in server, re-judging saved generations, merge's checks and command
line, and compare. The real vLLM engine and verl's real merger run in tests/engine/test_engine_eval.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qwen3_rl.tools.eval import compare, merge, score
from qwen3_rl.tools.eval.score import Problem, Sample, Sampling

REPO = Path(__file__).resolve().parents[3]


def _problem(i: int, gt: str, source: str = "aime2024", text: str = "q") -> Problem:
    return Problem(i, source, (("user", f"{text} {i}"),), gt)


# ---- the judge: qwen3_rl/data/reward.py through eval.score.judge -----------------------------------------
JUDGED = [  # (ground truth, response, right?)
    ("\\frac{1}{2}", "so the answer is \\boxed{\\frac{1}{2}}", True),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}", True),
    ("\\frac{1}{2}", "\\boxed{1/2}", True),
    ("\\frac{1}{2}", "\\boxed{0.5}", True),
    ("\\frac{1}{2}", "Answer: $\\frac12$", True),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
    ("\\frac{1}{2}", "the answer is 1/2", False),  # no marked final answer
    ("204", "first \\boxed{12}, then corrected: \\boxed{204}", True),  # the last box counts
    ("204", "\\boxed{204} at first, but finally \\boxed{12}", False),
    ("204", "\\boxed{204.0}", True),
    ("2\\sqrt{3}", "\\boxed{2\\sqrt{3}}", True),
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}", True),
    ("2\\sqrt{3}", "\\boxed{3\\sqrt{2}}", False),
    ("\\pi", "\\boxed{\\pi}", True),
    ("72", "She sold 48 + 24 = 72 clips.\n#### 72", True),  # gsm8k marker
    ("72", "#### 71", False),
    ("1,000", "\\boxed{1000}", True),
    ("33", "", False),
]


def test_judge_known_answers() -> None:
    problems = [_problem(i, gt) for i, (gt, _, _) in enumerate(JUDGED)]
    samples = [Sample(i, 0, resp, "stop", 10) for i, (_, resp, _) in enumerate(JUDGED)]
    score.judge(samples, problems)
    got = [s.acc for s in samples]
    assert got == [ok for _, _, ok in JUDGED], [(JUDGED[i][:2], g) for i, g in enumerate(got) if g != JUDGED[i][2]]
    assert samples[0].pred == "\\frac{1}{2}" and samples[-1].pred == ""


def test_summarize_rounds_mean_std() -> None:
    problems = [_problem(i, "1") for i in range(4)]
    # round 0: 4/4 right, round 1: 2/4, round 2: 0/4 -> 100, 50, 0: mean 50, sample std 50
    right = {0: {0, 1, 2, 3}, 1: {0, 1}, 2: set()}
    samples = [Sample(p, r, "\\boxed{1}" if p in right[r] else "\\boxed{2}", "stop" if r else "length", 5)
               for r in range(3) for p in range(4)]
    score.judge(samples, problems)
    s = score.summarize(samples, problems, 3)
    assert s["per_round_accuracy"] == [100.0, 50.0, 0.0]
    assert (s["accuracy_mean"], s["accuracy_std"], s["accuracy_min"], s["accuracy_max"]) == (50.0, 50.0, 0.0, 100.0)
    assert s["per_problem_correct"] == [2, 2, 1, 1]
    assert (s["truncated"], s["no_answer"], s["response_tokens_total"]) == (4, 0, 60)
    with pytest.raises(score.ScoreError, match="1 of 12 .* samples are missing"):
        score.summarize(samples[:-1], problems, 3)


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _row(q: str, gt: str, source: str = "aime2024") -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": q}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"split": "test", "index": 0}}


def test_load_problems_dedupes_and_limits(tmp_path: Path) -> None:
    # AIME-2024 parquet files repeat each problem: identical (prompt, answer) rows count once
    rows = [_row("p1", "1"), _row("p2", "2"), _row("p1", "1"), _row("p3", "3"), _row("p2", "2")]
    f = _write_parquet(tmp_path / "aime2024" / "test.parquet", rows)
    probs, nrows = score.load_problems(f)
    assert nrows == 5 and [p.ground_truth for p in probs] == ["1", "2", "3"] and [p.index for p in probs] == [0, 1, 2]
    assert probs[0].chat() == [{"role": "user", "content": "p1"}] and probs[0].data_source == "aime2024"
    assert len(score.load_problems(f, limit=2)[0]) == 2
    with pytest.raises(score.ScoreError, match="not found"):
        score.load_problems(tmp_path / "nope.parquet")
    bad = _write_parquet(tmp_path / "bad.parquet", [{"prompt": [{"role": "user", "content": "x"}]}])
    with pytest.raises(score.ScoreError, match="row 0: needs 'prompt'"):
        score.load_problems(bad)


# ---- the --server path against a stand-in OpenAI-compatible server ----------------------------------------
class _Stub(BaseHTTPRequestHandler):
    """/v1/models and /v1/chat/completions: answers problem i right in round r unless (i + r) is odd."""

    bodies: list[dict] = []
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, obj: dict, code: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"object": "list", "data": [{"id": "merged-qwen3", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        q = body["messages"][-1]["content"]
        i = int(q.split()[-1])
        with self.lock:
            self.bodies.append(body)
            r = self.calls[q] = self.calls.get(q, -1) + 1
        ans = i if (i + r) % 2 == 0 else i + 100
        self._send({"choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": f"thinking... \\boxed{{{ans}}}"}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 7}})


@pytest.fixture
def stub_server():
    _Stub.bodies, _Stub.calls = [], {}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_score_server_cli_outputs_and_rejudge(tmp_path: Path, stub_server: str, capsys) -> None:
    rows = [_row(f"problem {i}", str(i)) for i in range(4)]
    _write_parquet(tmp_path / "data" / "aime2024" / "test.parquet", rows + rows)  # repeated, as AIME files are
    out = tmp_path / "out"
    rc = score.main(["--server", stub_server, "--dataset", "aime2024", "--data-dir", str(tmp_path / "data"),
                     "--rounds", "2", "--concurrency", "3", "--out", str(out), "--no-progress"])
    assert rc == 0
    md = capsys.readouterr().out
    # round 0: problems 0, 2 right; round 1: problems 1, 3 right -> 50 and 50
    assert "| aime2024 | merged-qwen3 | 4 | 2 | 50.00 ± 0.00 | 50.00 | 50.00 | 7 | 0 | 0 |" in md
    assert len(_Stub.bodies) == 8  # 4 distinct problems x 2 rounds
    body = _Stub.bodies[0]
    assert body["model"] == "merged-qwen3"  # from GET /v1/models
    assert {k: body[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty", "max_tokens")} == {
        "temperature": 0.5, "top_k": 10, "top_p": 0.95, "repetition_penalty": 1.03, "max_tokens": 20480}
    assert "seed" not in body
    doc = json.loads((out / "score.json").read_text())
    assert (doc["num_problems"], doc["data_rows"], doc["rounds"], doc["per_problem_correct"]) == (4, 8, 2, [1, 1, 1, 1])
    assert doc["sampling"] == {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "repetition_penalty": 1.03,
                               "max_tokens": 20480, "seed": None}
    gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 8 and {(g["problem"], g["round"]) for g in gens} == {(p, r) for p in range(4) for r in range(2)}
    assert all(g["acc"] == ((g["problem"] + g["round"]) % 2 == 0) for g in gens)
    assert (out / "score.md").read_text().startswith("| dataset | model |")
    # re-judge: the saved texts, judged against a changed ground truth, change the score
    for g in gens:
        g["ground_truth"] = str(g["problem"] + 100)
    (out / "generations.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gens))
    assert score.main(["--rejudge", str(out / "generations.jsonl"), "--json"]) == 0
    redo = json.loads(capsys.readouterr().out)
    assert redo["per_round_accuracy"] == [50.0, 50.0] and redo["per_problem_correct"] == [1, 1, 1, 1]
    assert redo["model"] == "merged-qwen3" and redo["rejudged_from"].endswith("generations.jsonl")
    for g in gens[:2]:  # problem 0 (its rounds 0 and 1) back to answer 0: round 0 gains it, round 1 loses it
        g["ground_truth"] = "0"
    (out / "generations.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gens))
    assert score.main(["--rejudge", str(out / "generations.jsonl")]) == 0
    capsys.readouterr()
    assert json.loads((out / "score.json").read_text())["per_round_accuracy"] == [75.0, 25.0]


def test_score_cli_errors(tmp_path: Path, capsys) -> None:
    assert score.main(["--dataset", "gsm8k"]) == 1
    assert "exactly one of --model DIR, --server URL" in capsys.readouterr().err
    assert score.main(["--model", "m", "--server", "http://x", "--dataset", "gsm8k"]) == 1
    capsys.readouterr()
    assert score.main(["--model", "m", "--dataset", "gsm8k", "--data-dir", str(tmp_path)]) == 1
    assert "gsm8k/test.parquet not found" in capsys.readouterr().err
    assert score.main(["--rejudge", str(tmp_path / "none.jsonl")]) == 1
    assert "not found" in capsys.readouterr().err
    f = _write_parquet(tmp_path / "d.parquet", [_row("q 0", "1")])
    assert score.main(["--server", "http://127.0.0.1:9", "--data", str(f), "--no-progress"]) == 1
    assert capsys.readouterr().err.startswith("error: http://127.0.0.1:9/v1/models:")


def test_sampling_defaults_are_ref_004() -> None:
    """[ref 004 §3.3.2]: the ais_bench generation_kwargs and max_out_len."""
    assert Sampling() == Sampling(temperature=0.5, top_k=10, top_p=0.95, repetition_penalty=1.03, max_tokens=20480,
                                  seed=None)


# ---- merge: what a complete verl Megatron checkpoint has, and verl's command ---------------------------------
def _ckpt(root: Path, step: int = 3, tie: bool = False, skip: tuple[str, ...] = ()) -> Path:
    actor = root / f"global_step_{step}" / "actor"
    files = {"dist_ckpt/common.pt": "x", "dist_ckpt/__0_0.distcp": "x", "dist_ckpt/.metadata": "x",
             "dist_ckpt/metadata.json": json.dumps({"sharded_backend": "torch_dist"}),
             "huggingface/config.json": json.dumps({"tie_word_embeddings": tie}), "transformer_config.json": "{}"}
    for rel, text in files.items():
        if rel in skip:
            continue
        (actor / rel).parent.mkdir(parents=True, exist_ok=True)
        (actor / rel).write_text(text)
    return actor


def test_merge_command_line(tmp_path: Path) -> None:
    actor = _ckpt(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3\n")
    for given in (tmp_path / "ckpt", tmp_path / "ckpt" / "global_step_3", actor):
        cmd, rc = merge.run_merge(given, tmp_path / "hf", dry_run=True, python="python3")
        assert rc == 0 and cmd == ["python3", "-m", "verl.model_merger", "merge", "--backend", "megatron",
                                   "--local_dir", str(actor), "--target_dir", str(tmp_path / "hf")]
    tied = _ckpt(tmp_path / "tied", step=7, tie=True)
    cmd, _ = merge.run_merge(tmp_path / "tied", tmp_path / "hf2", step=7, dry_run=True, trust_remote_code=True,
                             use_cpu_initialization=True)
    assert cmd[-3:] == ["--tie-word-embedding", "--trust-remote-code", "--use_cpu_initialization"]
    assert merge.check_actor_checkpoint(tied).step == 7
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "eval", "merge", str(actor), "--target",
                           str(tmp_path / "hf"), "--dry-run"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().endswith(
        f"-m verl.model_merger merge --backend megatron --local_dir {actor} --target_dir {tmp_path / 'hf'}")


@pytest.mark.parametrize(("skip", "message"), [
    (("dist_ckpt/metadata.json",), "no metadata.json, which megatron-core writes last: the save did not finish"),
    (("dist_ckpt/common.pt",), "no common.pt: the save did not get far (partial checkpoint)"),
    (("dist_ckpt/__0_0.distcp",), "no shard files next to metadata.json (partial checkpoint)"),
    (("dist_ckpt/.metadata",), "*.distcp shards without their .metadata index (partial checkpoint)"),
    (("huggingface/config.json",), "no huggingface/config.json (the merger reads the model config there)"),
    (("dist_ckpt/metadata.json", "dist_ckpt/common.pt", "dist_ckpt/__0_0.distcp", "dist_ckpt/.metadata"),
     "no dist_ckpt/ (not a verl Megatron checkpoint"),
])
def test_merge_refuses_partial_checkpoints(tmp_path: Path, capsys, skip: tuple[str, ...], message: str) -> None:
    actor = _ckpt(tmp_path / "ckpt", skip=skip)
    rc = merge.main([str(actor), "--target", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists()


def test_merge_refuses_missing_and_ambiguous(tmp_path: Path, capsys) -> None:
    assert merge.main([str(tmp_path / "none"), "--target", str(tmp_path / "hf")]) == 1
    assert "does not exist" in capsys.readouterr().err
    _ckpt(tmp_path / "ckpt", step=2)
    _ckpt(tmp_path / "ckpt", step=4)
    assert merge.main([str(tmp_path / "ckpt"), "--target", str(tmp_path / "hf")]) == 1
    assert "no latest_checkpointed_iteration.txt (an unfinished save?); give --step, one of [2, 4]" in \
        capsys.readouterr().err
    assert merge.main([str(tmp_path / "ckpt"), "--step", "5", "--target", str(tmp_path / "hf")]) == 1
    assert "global_step_5/actor does not exist" in capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("")
    assert merge.main([str(tmp_path / "ckpt"), "--step", "4", "--target", str(tmp_path / "hf")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert merge.main([str(tmp_path / "empty"), "--target", str(tmp_path / "hf2")]) == 1
    assert "holds no global_step_N/actor checkpoint" in capsys.readouterr().err


# ---- compare -------------------------------------------------------------------------------------------------
def _score_doc(path: Path, mean: float, std: float, dataset: str = "aime2024", n: int = 30) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "score.json").write_text(json.dumps({"dataset": dataset, "model": str(path), "accuracy_mean": mean,
                                                 "accuracy_std": std, "rounds": 16, "num_problems": n}))
    return path


def test_compare_table_plot_and_published(tmp_path: Path, capsys) -> None:
    before, after = _score_doc(tmp_path / "b", 30.0, 2.0), _score_doc(tmp_path / "a", 36.5, 1.5)
    png = tmp_path / "plot" / "cmp.png"
    assert compare.main([str(before), str(after / "score.json"), "--plot", str(png), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    row = doc["comparison"][0]
    assert (row["key"], row["before"], row["after"], row["measured"]) == ("aime2024/accuracy", 30.0, 36.5, 6.5)
    assert (row["published_before"], row["published_after"], row["source"]) == (38.99, 45.33, "ref 004 §3.4")
    assert row["published"] == pytest.approx(6.34) and row["ratio"] == pytest.approx(6.5 / 6.34)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc["plot"] == str(png)
    assert compare.main([str(before), str(after)]) == 0
    md = capsys.readouterr().out
    assert "| aime2024 | 30 | 30.00 ± 2.00 (16 rounds) | 36.50 ± 1.50 (16 rounds) | +6.50 | 38.99 | 45.33 | +6.34 |" in md
    g1, g2 = _score_doc(tmp_path / "g1", 10.0, 0.0, "openai/gsm8k"), _score_doc(tmp_path / "g2", 12.0, 0.0, "gsm8k")
    assert compare.main([str(g1), str(g2)]) == 0
    assert "| gsm8k | 30 | 10.00 ± 0.00 (16 rounds) | 12.00 ± 0.00 (16 rounds) | +2.00 | – | – | – |" in \
        capsys.readouterr().out
    assert compare.main([str(before), str(g2)]) == 1
    assert "not the same dataset" in capsys.readouterr().err
    assert compare.main([str(before), str(tmp_path / "none")]) == 1
    assert "not found" in capsys.readouterr().err


def test_eval_cli_dispatch() -> None:
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "eval", "--help"], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0 and "merge" in proc.stdout and "38.99 -> 45.33" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "eval", "bogus"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "unknown eval command 'bogus'" in proc.stderr
