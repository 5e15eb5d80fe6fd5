"""``eval score``: accuracy of a model on AIME 2024 or gsm8k test, averaged over rounds.

Generation: vLLM offline (``vllm.LLM(...).chat``, one request per problem with ``n = rounds`` samples) by
default, or an OpenAI-compatible server already running (``--server URL``: ``vllm serve`` as in [ref 004];
one ``/v1/chat/completions`` request per problem and round). The prompts are the dataset's chat messages,
rendered by the model's chat template as verl renders them in training.

Sampling defaults are [ref 004]'s evaluation settings (its ais_bench ``generation_kwargs``): temperature 0.5,
top_k 10, top_p 0.95, repetition_penalty 1.03, 20480 new tokens; [ref 004] averages 16 rounds.

Judge: the training reward, ``qwen3_rl/data/reward.py`` ``compute_score`` (the final boxed / ``Answer:`` /
``####`` answer compared with the ground truth by math-verify). A round's accuracy is the share of problems
its sample answers right (percent); the score is the mean ± sample standard deviation over rounds.

Outputs (``--out DIR``): ``generations.jsonl`` (every sample with its judgement: re-judge it with
``score --rejudge DIR/generations.jsonl``), ``score.json``, ``score.md``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qwen3_rl.data.reward import compute_score

# `python -m qwen3_rl data prepare` output, relative to the data directory
DATASETS: dict[str, str] = {"aime2024": "aime2024/test.parquet", "gsm8k": "gsm8k/test.parquet"}
GENERATIONS = "generations.jsonl"
JUDGE = "qwen3_rl/data/reward.py compute_score (final boxed / Answer: / #### answer, math-verify)"


class ScoreError(ValueError):
    """A user-facing error of ``eval score``: one line, printed as ``error: <message>``."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of every request ([ref 004]'s evaluation defaults).

    ``max_tokens`` counts new tokens; ``seed`` None = vLLM's random seed ([ref 004] sets none).
    """

    temperature: float = 0.5
    top_k: int = 10
    top_p: float = 0.95
    repetition_penalty: float = 1.03
    max_tokens: int = 20480
    seed: int | None = None


@dataclass(frozen=True)
class Problem:
    """One distinct problem: ``messages`` are the chat prompt, ``ground_truth`` the reference answer."""

    index: int
    data_source: str
    messages: tuple[tuple[str, str], ...]
    ground_truth: str

    def chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass
class Sample:
    """One generated answer: problem index, round (0-based), text, vLLM finish reason, new tokens."""

    problem: int
    round: int
    text: str
    finish_reason: str | None
    completion_tokens: int
    pred: str = ""
    acc: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _to_py(v: Any) -> Any:
    """numpy / pyarrow values of a parquet row as plain Python (lists, dicts, str)."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, dict):
        return {k: _to_py(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_to_py(x) for x in v]
    return v


def load_problems(path: str | Path, limit: int | None = None) -> tuple[list[Problem], int]:
    """Distinct problems of a verl parquet (``prompt`` chat messages, ``reward_model.ground_truth``,
    ``data_source``), in file order; identical (prompt, answer) rows count once (AIME-2024 files repeat each
    problem). Returns (problems, rows read)."""
    p = Path(path)
    if not p.is_file():
        raise ScoreError(f"dataset {p} not found (python -m qwen3_rl data prepare --dataset ... --out DIR)")
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as e:  # noqa: BLE001 - any unreadable file is one error line
        raise ScoreError(f"cannot read {p}: {str(e).splitlines()[0]}") from None
    seen: set[tuple[Any, ...]] = set()
    out: list[Problem] = []
    for i, row in enumerate(rows):
        row = _to_py(row)
        msgs, rm = row.get("prompt"), row.get("reward_model")
        if not isinstance(msgs, list) or not isinstance(rm, dict) or rm.get("ground_truth") is None:
            raise ScoreError(f"{p} row {i}: needs 'prompt' (chat messages) and 'reward_model.ground_truth'")
        messages = tuple((str(m["role"]), str(m["content"])) for m in msgs)
        key = (messages, str(rm["ground_truth"]))
        if key in seen:
            continue
        seen.add(key)
        out.append(Problem(len(out), str(row.get("data_source") or ""), messages, str(rm["ground_truth"])))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ScoreError(f"{p} holds no problems")
    return out, len(rows)


# --- generation ---------------------------------------------------------------------------------------
def generate_offline(model: str, problems: Sequence[Problem], rounds: int, sampling: Sampling,
                     llm_kwargs: dict[str, Any], progress: bool = True,
                     timings: dict[str, float] | None = None) -> list[Sample]:
    """vLLM offline: one ``LLM.chat`` call, ``n = rounds`` samples per problem (vLLM's progress bar).
    ``timings`` (if given) gets ``engine_start_seconds`` (building ``LLM``)."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, **llm_kwargs)
    if timings is not None:
        timings["engine_start_seconds"] = time.perf_counter() - t0
    sp = SamplingParams(n=rounds, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                        repetition_penalty=sampling.repetition_penalty, max_tokens=sampling.max_tokens,
                        seed=sampling.seed)
    outs = llm.chat([p.chat() for p in problems], sp, use_tqdm=progress)
    samples = []
    for prob, out in zip(problems, outs, strict=True):
        for r, o in enumerate(out.outputs):
            samples.append(Sample(prob.index, r, o.text, o.finish_reason, len(o.token_ids)))
    return samples


def _post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise ScoreError(f"{url}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ScoreError(f"{url}: {getattr(e, 'reason', e)}") from None


def served_model(server: str, timeout: float = 30.0) -> str:
    """The first model id the server lists (``GET /v1/models``)."""
    import urllib.error
    import urllib.request

    url = server.rstrip("/") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            data = json.loads(resp.read()).get("data") or []
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ScoreError(f"{url}: {getattr(e, 'reason', e)}") from None
    if not data:
        raise ScoreError(f"{url} lists no model")
    return str(data[0]["id"])


def generate_server(server: str, model_name: str, problems: Sequence[Problem], rounds: int, sampling: Sampling,
                    concurrency: int = 48, progress: bool = True, timeout: float = 3600.0) -> list[Sample]:
    """OpenAI-compatible server: one chat completion per (problem, round), ``concurrency`` in flight; vLLM's
    extra sampling fields (``top_k``, ``repetition_penalty``) go in the request body as ``vllm serve`` takes
    them."""
    url = server.rstrip("/") + "/v1/chat/completions"
    jobs = [(p, r) for r in range(rounds) for p in problems]

    def one(prob: Problem, rnd: int) -> Sample:
        body: dict[str, Any] = {"model": model_name, "messages": prob.chat(), "temperature": sampling.temperature,
                                "top_p": sampling.top_p, "top_k": sampling.top_k,
                                "repetition_penalty": sampling.repetition_penalty,
                                "max_tokens": sampling.max_tokens}
        if sampling.seed is not None:
            body["seed"] = sampling.seed + rnd * len(problems) + prob.index
        resp = _post_json(url, body, timeout)
        try:
            choice = resp["choices"][0]
            text = choice["message"]["content"] or ""
            tokens = int((resp.get("usage") or {}).get("completion_tokens") or 0)
        except (KeyError, IndexError, TypeError):
            raise ScoreError(f"{url}: unexpected response {json.dumps(resp)[:200]}") from None
        return Sample(prob.index, rnd, text, choice.get("finish_reason"), tokens)

    bar = _progress(len(jobs), "generate", progress)
    samples: list[Sample] = []
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        futures = [pool.submit(one, p, r) for p, r in jobs]
        try:
            for fut in as_completed(futures):
                samples.append(fut.result())
                bar(1)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        finally:
            bar(0, close=True)
    samples.sort(key=lambda s: (s.problem, s.round))
    return samples


def _progress(total: int, desc: str, enabled: bool) -> Callable[..., None]:
    """``update(n, close=False)`` of a tqdm bar on stderr (a no-op when disabled)."""
    if not enabled:
        return lambda n, close=False: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)

    def update(n: int, close: bool = False) -> None:
        if n:
            bar.update(n)
        if close:
            bar.close()

    return update


# --- judging and the score ----------------------------------------------------------------------------
def judge(samples: Sequence[Sample], problems: Sequence[Problem]) -> None:
    """Fill ``pred`` / ``acc`` of every sample with the training reward's verdict."""
    by_index = {p.index: p for p in problems}
    for s in samples:
        prob = by_index[s.problem]
        res = compute_score(prob.data_source, s.text, prob.ground_truth)
        s.pred, s.acc = str(res["pred"]), bool(res["acc"])


def summarize(samples: Sequence[Sample], problems: Sequence[Problem], rounds: int) -> dict[str, Any]:
    """Accuracy per round (percent of problems), mean ± sample std over rounds, per-problem counts, lengths."""
    n = len(problems)
    grid = [[False] * rounds for _ in range(n)]
    seen = [[False] * rounds for _ in range(n)]
    for s in samples:
        grid[s.problem][s.round] = s.acc
        seen[s.problem][s.round] = True
    missing = sum(not x for row in seen for x in row)
    if missing:
        raise ScoreError(f"{missing} of {n * rounds} (problem, round) samples are missing")
    per_round = [100.0 * sum(grid[p][r] for p in range(n)) / n for r in range(rounds)]
    toks = [s.completion_tokens for s in samples]
    return {
        "num_problems": n,
        "rounds": rounds,
        "per_round_accuracy": per_round,
        "accuracy_mean": statistics.fmean(per_round),
        "accuracy_std": statistics.stdev(per_round) if rounds > 1 else 0.0,
        "accuracy_min": min(per_round),
        "accuracy_max": max(per_round),
        "per_problem_correct": [sum(row) for row in grid],
        "response_tokens_mean": statistics.fmean(toks) if toks else 0.0,
        "response_tokens_total": sum(toks),
        "truncated": sum(s.finish_reason == "length" for s in samples),
        "no_answer": sum(not s.pred for s in samples),
    }


def markdown(doc: dict[str, Any]) -> str:
    """The score as a markdown table (one row) with the settings under it."""
    s = doc["sampling"]
    rows = [
        "| dataset | model | problems | rounds | accuracy % (mean ± std) | min | max | response tokens (mean) "
        "| truncated | no answer |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {doc['dataset']} | {doc['model']} | {doc['num_problems']} | {doc['rounds']} | "
        f"{doc['accuracy_mean']:.2f} ± {doc['accuracy_std']:.2f} | {doc['accuracy_min']:.2f} | "
        f"{doc['accuracy_max']:.2f} | {doc['response_tokens_mean']:.0f} | {doc['truncated']} | {doc['no_answer']} |",
        "",
        f"Sampling: temperature {s['temperature']}, top_k {s['top_k']}, top_p {s['top_p']}, repetition_penalty "
        f"{s['repetition_penalty']}, max_tokens {s['max_tokens']}, seed {s['seed']}. Judge: {doc['judge']}.",
    ]
    if doc.get("generation_seconds") is not None:
        start = doc.get("engine_start_seconds") or 0.0
        rows.append(f"Generation: {doc['generation_seconds']:.1f} s for {doc['response_tokens_total']} new tokens"
                    + (f" (engine start {start:.1f} s before it)." if start else "."))
    return "\n".join(rows)


def write_outputs(out_dir: Path, doc: dict[str, Any], samples: Sequence[Sample] | None,
                  problems: Sequence[Problem] | None) -> None:
    """``score.json``, ``score.md`` and (unless re-judging) ``generations.jsonl`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if samples is not None and problems is not None:
        by_index = {p.index: p for p in problems}
        with (out_dir / GENERATIONS).open("w") as f:
            for s in samples:
                p = by_index[s.problem]
                rec = {"problem": s.problem, "round": s.round, "data_source": p.data_source,
                       "messages": p.chat(), "ground_truth": p.ground_truth, "text": s.text,
                       "finish_reason": s.finish_reason, "completion_tokens": s.completion_tokens,
                       "pred": s.pred, "acc": s.acc}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    (out_dir / "score.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / "score.md").write_text(markdown(doc) + "\n")


def rejudge(generations: str | Path) -> tuple[dict[str, Any], list[Sample], list[Problem]]:
    """Judge a saved ``generations.jsonl`` again (the current reward code); returns the new document (settings
    from the ``score.json`` beside it when there is one)."""
    g = Path(generations)
    if not g.is_file():
        raise ScoreError(f"generations file {g} not found")
    problems: dict[int, Problem] = {}
    samples: list[Sample] = []
    for ln, line in enumerate(g.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            idx = int(rec["problem"])
            msgs = tuple((m["role"], m["content"]) for m in rec["messages"])
            problems.setdefault(idx, Problem(idx, str(rec.get("data_source") or ""), msgs, str(rec["ground_truth"])))
            samples.append(Sample(idx, int(rec["round"]), str(rec["text"]), rec.get("finish_reason"),
                                  int(rec.get("completion_tokens") or 0)))
        except (ValueError, KeyError, TypeError):
            raise ScoreError(f"{g}:{ln}: not a generation record") from None
    if not samples:
        raise ScoreError(f"{g} holds no generations")
    probs = [problems[i] for i in sorted(problems)]
    if [p.index for p in probs] != list(range(len(probs))):
        raise ScoreError(f"{g}: problem indices are not 0..{len(probs) - 1}")
    rounds = max(s.round for s in samples) + 1
    judge(samples, probs)
    old: dict[str, Any] = {}
    if (g.parent / "score.json").is_file():
        old = json.loads((g.parent / "score.json").read_text())
    doc = {**{k: old.get(k) for k in ("dataset", "data_file", "model", "server", "generation_seconds")},
           "sampling": old.get("sampling") or asdict(Sampling()), "judge": JUDGE, "rejudged_from": str(g),
           **summarize(samples, probs, rounds)}
    doc["dataset"] = doc["dataset"] or (probs[0].data_source or "?")
    doc["model"] = doc["model"] or "?"
    return doc, samples, probs


def run_score(problems: Sequence[Problem], rounds: int, sampling: Sampling, *, model: str | None = None,
              server: str | None = None, served_model_name: str | None = None,
              llm_kwargs: dict[str, Any] | None = None, concurrency: int = 48,
              progress: bool = True) -> tuple[dict[str, Any], list[Sample]]:
    """Generate, judge, summarize; returns (score document without dataset fields, samples)."""
    if rounds < 1:
        raise ScoreError("--rounds must be >= 1")
    t0 = time.perf_counter()
    timings: dict[str, float] = {"engine_start_seconds": 0.0}
    if server:
        name = served_model_name or served_model(server)
        samples = generate_server(server, name, problems, rounds, sampling, concurrency, progress)
        label = name
    else:
        if not model:
            raise ScoreError("give --model DIR (offline vLLM) or --server URL")
        samples = generate_offline(model, problems, rounds, sampling, dict(llm_kwargs or {}), progress, timings)
        label = model
    seconds = time.perf_counter() - t0 - timings["engine_start_seconds"]
    t1 = time.perf_counter()
    judge(samples, problems)
    doc = {"model": label, "server": server, "sampling": asdict(sampling), "judge": JUDGE,
           "engine_start_seconds": timings["engine_start_seconds"], "generation_seconds": seconds,
           "judge_seconds": time.perf_counter() - t1, **summarize(samples, problems, rounds)}
    return doc, samples


def main(argv: Sequence[str]) -> int:
    """``eval score``: see the module docstring; 0 ok, 1 one-line error, 2 usage."""
    import argparse

    d = Sampling()
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl eval score", description=__doc__.splitlines()[0])
    src = ap.add_argument_group("model (one of)")
    src.add_argument("--model", help="HF model directory: vLLM offline LLM(...) in this process")
    src.add_argument("--server", help="OpenAI-compatible server base URL, e.g. http://127.0.0.1:6380")
    src.add_argument("--served-model-name", help="with --server (default: the first of GET /v1/models)")
    src.add_argument("--rejudge", metavar="GENERATIONS_JSONL", help="judge saved generations again, no model")
    data = ap.add_argument_group("data")
    data.add_argument("--dataset", choices=sorted(DATASETS), help="a `data prepare` output under --data-dir")
    data.add_argument("--data-dir", default="data", help="data prepare's output root (default: data)")
    data.add_argument("--data", help="a verl parquet file instead of --dataset")
    data.add_argument("--limit", type=int, help="first N distinct problems only")
    s = ap.add_argument_group("sampling (ref 004's defaults)")
    s.add_argument("--rounds", type=int, default=16, help="samples per problem, averaged (default 16)")
    s.add_argument("--temperature", type=float, default=d.temperature)
    s.add_argument("--top-k", type=int, default=d.top_k)
    s.add_argument("--top-p", type=float, default=d.top_p)
    s.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty)
    s.add_argument("--max-tokens", type=int, default=d.max_tokens, help="new tokens per answer (default 20480)")
    s.add_argument("--seed", type=int, help="base sampling seed (default: none, as ref 004)")
    e = ap.add_argument_group("offline engine (--model)")
    e.add_argument("--tensor-parallel-size", type=int, help="vLLM TP of the offline engine")
    e.add_argument("--max-model-len", type=int, help="e.g. 22528 = 2048 prompt + 20480 new tokens")
    e.add_argument("--gpu-memory-utilization", type=float)
    e.add_argument("--llm-kwargs", default="{}", help="more vllm.LLM(...) keyword arguments as JSON")
    ap.add_argument("--concurrency", type=int, default=48, help="with --server: requests in flight (default 48)")
    ap.add_argument("--out", help="output directory (score.json, score.md, generations.jsonl)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--json", action="store_true", help="print score.json instead of the markdown table")
    args = ap.parse_args(list(argv))
    try:
        if args.rejudge:
            doc, samples, probs = rejudge(args.rejudge)
            out = Path(args.out) if args.out else Path(args.rejudge).parent
            write_outputs(out, doc, samples if args.out else None, probs if args.out else None)
        else:
            if bool(args.model) == bool(args.server):
                raise ScoreError("give exactly one of --model DIR, --server URL (or --rejudge FILE)")
            if bool(args.dataset) == bool(args.data):
                raise ScoreError("give exactly one of --dataset NAME, --data FILE")
            path = Path(args.data) if args.data else Path(args.data_dir) / DATASETS[args.dataset]
            problems, nrows = load_problems(path, args.limit)
            try:
                llm_kwargs = json.loads(args.llm_kwargs)
            except ValueError:
                raise ScoreError(f"--llm-kwargs is not JSON: {args.llm_kwargs!r}") from None
            if not isinstance(llm_kwargs, dict):
                raise ScoreError("--llm-kwargs must be a JSON object")
            for key, val in (("tensor_parallel_size", args.tensor_parallel_size),
                             ("max_model_len", args.max_model_len),
                             ("gpu_memory_utilization", args.gpu_memory_utilization)):
                if val is not None:
                    llm_kwargs[key] = val
            sampling = Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.max_tokens,
                                args.seed)
            doc, samples = run_score(problems, args.rounds, sampling, model=args.model, server=args.server,
                                     served_model_name=args.served_model_name, llm_kwargs=llm_kwargs,
                                     concurrency=args.concurrency, progress=not args.no_progress)
            doc = {"dataset": args.dataset or problems[0].data_source or path.stem, "data_file": str(path),
                   "data_rows": nrows, **doc}
            if args.out:
                write_outputs(Path(args.out), doc, samples, problems)
    except ScoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2) if args.json else markdown(doc))
    return 0
