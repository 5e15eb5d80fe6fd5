"""Convert downloaded math datasets into verl's RL parquet layout (no hub access at run time).

Output columns (what ``verl.utils.dataset.rl_dataset.RLHFDataset`` and the reward managers read):
``data_source`` (str), ``prompt`` (chat messages ``[{"role": "user", "content": ...}]``), ``ability``
(str), ``reward_model`` (``{"style": "rule", "ground_truth": str}``), ``extra_info`` (``{"split", "index"}``).

Inputs (files the user downloaded):
* ``deepscaler``: DeepScaleR ``deepscaler.json``, a JSON list of ``{problem, answer, solution}``;
* ``dapo-math-17k``: BytedTsinghua-SIA DAPO-Math-17k parquet, already verl rows (checked, normalised);
* ``aime2024``: BytedTsinghua-SIA AIME-2024 parquet, already verl rows (checked, normalised);
* ``gsm8k``: ``{question, answer}`` rows whose answer ends in ``#### <number>``.
Any of them may be .json (list or JSON lines), .jsonl or .parquet.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


class DataError(ValueError):
    """Bad input for data preparation (one-line message)."""


@dataclass(frozen=True)
class DatasetSpec:
    """One supported dataset: canonical name, aliases, default split and row converter."""

    name: str
    aliases: tuple[str, ...]
    default_split: str
    data_source: str
    convert: Callable[[dict[str, Any], int, str, str], dict[str, Any]]


def _need(row: dict[str, Any], keys: Iterable[str], idx: int) -> None:
    missing = [k for k in keys if k not in row or row[k] is None]
    if missing:
        raise DataError(f"row {idx}: missing column(s) {missing} (have {sorted(row)})")


def _row(data_source: str, content: str, answer: str, split: str, idx: int) -> dict[str, Any]:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer).strip()},
        "extra_info": {"split": split, "index": idx},
    }


def _deepscaler(row: dict[str, Any], idx: int, split: str, source: str) -> dict[str, Any]:
    _need(row, ("problem", "answer"), idx)
    return _row(source, f"{str(row['problem']).strip()} {BOXED_INSTRUCTION}", row["answer"], split, idx)


def _gsm8k(row: dict[str, Any], idx: int, split: str, source: str) -> dict[str, Any]:
    _need(row, ("question", "answer"), idx)
    ans = str(row["answer"])
    if "####" not in ans:
        raise DataError(f"row {idx}: gsm8k answer has no '#### <number>' final line")
    final = ans.rsplit("####", 1)[1].strip().replace(",", "")
    return _row(source, f"{str(row['question']).strip()} {BOXED_INSTRUCTION}", final, split, idx)


def _as_messages(prompt: Any, idx: int) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    try:
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in list(prompt)]
    except (TypeError, KeyError) as exc:
        raise DataError(f"row {idx}: 'prompt' is neither text nor chat messages") from exc
    if not msgs:
        raise DataError(f"row {idx}: empty 'prompt'")
    return msgs


def _verl_rows(row: dict[str, Any], idx: int, split: str, source: str) -> dict[str, Any]:
    """Rows already in verl's layout (DAPO-Math-17k, AIME-2024): check and normalise."""
    _need(row, ("prompt", "reward_model"), idx)
    rm = row["reward_model"]
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise DataError(f"row {idx}: 'reward_model' has no 'ground_truth'")
    extra = dict(row.get("extra_info") or {})
    extra.setdefault("index", idx)
    extra["split"] = split
    return {
        "data_source": str(row.get("data_source") or source),
        "prompt": _as_messages(row["prompt"], idx),
        "ability": str(row.get("ability") or "math"),
        "reward_model": {"style": str(rm.get("style") or "rule"), "ground_truth": str(rm["ground_truth"]).strip()},
        "extra_info": extra,
    }


DATASETS: tuple[DatasetSpec, ...] = (
    DatasetSpec("deepscaler", ("deepscaler",), "train", "deepscaler", _deepscaler),
    DatasetSpec("dapo-math-17k", ("dapo-math-17k", "dapo-math", "dapo_math"), "train", "math_dapo", _verl_rows),
    DatasetSpec("aime2024", ("aime2024", "aime-2024", "aime"), "test", "aime2024", _verl_rows),
    DatasetSpec("gsm8k", ("gsm8k",), "train", "openai/gsm8k", _gsm8k),
)


def find_dataset(name: str) -> DatasetSpec:
    """Spec for ``name`` or one of its aliases; DataError listing the known names otherwise."""
    for spec in DATASETS:
        if name.lower() in spec.aliases:
            return spec
    raise DataError(f"unknown dataset '{name}' (known: {', '.join(s.name for s in DATASETS)})")


def read_records(path: Path) -> list[dict[str, Any]]:
    """Rows of a .json (list or JSON lines), .jsonl or .parquet file."""
    if not path.is_file():
        raise DataError(f"input file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 - report any reader failure as one line
            raise DataError(f"cannot read parquet {path}: {exc}") from exc
    if suffix not in (".json", ".jsonl"):
        raise DataError(f"unsupported input format '{suffix}' (use .json, .jsonl or .parquet): {path}")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: neither a JSON document nor JSON lines ({exc.msg}, line {exc.lineno})") from exc
    if not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{path}: expected a list of objects")
    return rows


def convert(spec: DatasetSpec, records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """Convert all records (raises DataError on the first bad row; empty input is an error)."""
    if not records:
        raise DataError("input has no rows")
    return [spec.convert(r, i, split, spec.data_source) for i, r in enumerate(records)]


def write_parquet(rows: list[dict[str, Any]], out_dir: Path, split: str) -> Path:
    """Write ``out_dir/<split>.parquet``; returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def prepare(dataset: str, input_path: str | Path, out_dir: str | Path, split: str | None = None) -> Path:
    """Read ``input_path``, convert for ``dataset`` and write ``out_dir/<split>.parquet``."""
    spec = find_dataset(dataset)
    split = split or spec.default_split
    rows = convert(spec, read_records(Path(input_path)), split)
    return write_parquet(rows, Path(out_dir), split)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m qwen3_rl data",
        description="Convert a downloaded dataset file to verl parquet. Forms: "
        "'data prepare --dataset NAME --input FILE --out DIR' or 'data NAME --input FILE --output DIR'.")
    p.add_argument("--dataset", help=f"one of: {', '.join(s.name for s in DATASETS)}")
    p.add_argument("--input", required=True, help="downloaded file (.json, .jsonl, .parquet)")
    p.add_argument("--out", "--output", dest="out", required=True, help="output directory")
    p.add_argument("--split", default=None, help="split name = output file stem (default per dataset)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m qwen3_rl data ...``; returns the exit code (2 with a one-line error on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = None
    if argv and argv[0] == "prepare":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        name, argv = argv[0], argv[1:]
    args = _parser().parse_args(argv)
    dataset = args.dataset or name
    if dataset is None:
        print("error: no dataset given (use --dataset NAME)", file=sys.stderr)
        return 2
    try:
        path = prepare(dataset, args.input, args.out, args.split)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import pyarrow.parquet as pq

    print(f"wrote {pq.read_metadata(path).num_rows} rows to {path}")
    return 0
