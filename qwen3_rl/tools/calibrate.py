"""``python -m qwen3_rl calibrate --setup S [--out F]``: measure the verification-cost table of a setup's rollout
engine (the ``SAM_COST_TABLE`` input of the adaptive draft length, ``qwen3_rl/spec_decode/cost_table.py``).

It starts the setup's rollout engine (the model, TP size, dtype, eager / graph mode and engine options its train
script gives verl) with dummy weights (vLLM's ``load_format="dummy"``: only the model's config is read) and the SAM
drafter at ``k_max`` with ``pad_drafts`` (every draft padded to exactly k tokens). Per cell (B, ctx) of the grid it
adds ``B`` requests of ``ctx`` random prompt tokens, runs the engine until all are decoding, then for each k of the
grid sets the drafter's length to k (k = 0: the drafts are dropped, the step decodes one token per request), runs
``--warmup`` untimed steps (the first step after a change still verifies the previous k's drafts) and times one
engine step (``LLMEngine.step``: schedule, forward over ``B * (k + 1)`` query tokens, rejection sampling, drafting).
``--steps`` rounds over the ks (every k once per round, so that load elsewhere on the machine hits every k alike);
the row's ``step_ms`` is the median over the rounds.
vLLM's own spec-decode counters check that each timed step verified ``B * k`` draft tokens
(``draft_tokens_per_step``). Rows that cost much less than a row with fewer query tokens (``inversions``: a
measurement another load disturbed) are listed in the table and printed as warnings.

The table (``verify_cost_h100.json``'s schema: rows of ``model``, ``B``, ``k``, ``ctx``, ``step_ms``,
``ratio_to_k0``) goes to ``--out`` (default ``<workspace>/calibration/verify_cost_<setup>.json``, the workspace
being ``$QWEN3_RL_WORKSPACE`` or ``<checkout>/workspace``); ``SAM_COST_TABLE=<that file>`` hands it to training.

On vLLM 0.23 (the current pin set: no ``method="sam"``) the drafter is seated through upstream's extension points
(:func:`engine_for_vllm`): vLLM-Ascend's ``ngram`` seat with ``worker_cls`` ``ascend023_worker.SamNPUWorker``, or
vLLM's ``custom_class`` with ``custom_class_worker.SamCPUWorker``; ``pad_drafts`` in ``additional_config``.

Limits: one engine (one vLLM DP rank; EP all-to-all across DP ranks is not in the measurement); the context grows
by the tokens decoded while a cell is measured (``ctx_measured`` gives the mean); the token budget
``max_num_batched_tokens`` is raised to fit ``max(B) * (k_max + 1)`` query tokens when the setup's is smaller.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qwen3_rl.tools.launch.env_contract import EngineContext
from qwen3_rl.tools.launch.train_script import TrainCommand, TrainScriptError, parse_train_script

REPO = Path(__file__).resolve().parents[2]
ROLLOUT = "actor_rollout_ref.rollout."
VLLM_KW = ROLLOUT + "engine_kwargs.vllm."
DEFAULT_BATCH = (1, 8, 32, 128, 256)
DEFAULT_K = (0, 1, 3, 7, 15)
DEFAULT_CTX = (1024, 8192)
DEFAULT_K_MAX = 15  # SAM_K_MAX's default
#: a row more than this much (relative) cheaper than a row of the same cell with fewer query tokens is reported as
#: an inversion: on a quiet device more verified tokens never cost less, so it flags a disturbed measurement
INVERSION_TOL = 0.25
#: engine options of the setup not passed to the calibration engine (one engine, no drafting of its own)
_SKIPPED_KW = ("speculative_config.", "data_parallel_size", "data_parallel_")
#: first vLLM release without the seed set's ``method="sam"``: the drafter goes in through extension points
EXTENSION_POINT_VLLM = (0, 23)
SAM_NPU_WORKER = "qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker"
SAM_CPU_WORKER = "qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker"
SAM_CUSTOM_CLASS = "qwen3_rl.spec_decode.custom_class_proposer.SamCustomClassProposer"


class CalibrateError(RuntimeError):
    """A calibration that cannot run (one line)."""


@dataclass(frozen=True)
class CalibratePlan:
    """What ``calibrate`` measures and with which engine.

    Attributes:
        setup: the train script.
        model: model folder (only its config and tokenizer are read: dummy weights).
        shape: the table's ``model`` name (``<model folder>-tp<TP>``).
        batch: running requests B per cell, ascending.
        ks: draft lengths k, ascending, starting at 0; the last is k_max.
        ctx: prompt (context) tokens per request, ascending.
        steps: rounds over the ks (timed engine steps per row).
        warmup: untimed engine steps after each change of k.
        engine: keyword arguments of ``vllm.LLM`` (the setup's rollout engine, dummy weights, SAM at k_max).
    """

    setup: str
    model: str
    shape: str
    batch: tuple[int, ...]
    ks: tuple[int, ...]
    ctx: tuple[int, ...]
    steps: int
    warmup: int
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def k_max(self) -> int:
        return self.ks[-1]

    @property
    def decode_tokens(self) -> int:
        """Upper bound of the tokens a request decodes over one cell (every k, warm-up included, all accepted)."""
        return self.steps * sum((self.warmup + 1) * (k + 1) for k in self.ks) + 8

    def cells(self) -> int:
        return len(self.batch) * len(self.ctx)

    def engine_steps(self) -> int:
        """Engine steps of the decode phases over the whole grid (prefill steps not counted)."""
        return self.cells() * self.steps * len(self.ks) * (self.warmup + 1)


def _value(raw: str) -> Any:
    """A Hydra override value as Python (JSON / YAML scalars and lists; a bare word stays a string)."""
    import yaml

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, val in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = val
    return out


def _ints(raw: str, what: str) -> tuple[int, ...]:
    try:
        vals = sorted({int(x) for x in raw.split(",") if x.strip()})
    except ValueError:
        raise CalibrateError(f"--{what} must be comma-separated integers, got {raw!r}") from None
    if not vals or vals[0] < (0 if what == "k" else 1):
        raise CalibrateError(f"--{what} {raw!r}: needs at least one value, all >= {0 if what == 'k' else 1}")
    return tuple(vals)


def plan_from_command(cmd: TrainCommand, batch: str | None = None, ks: str | None = None, ctx: str | None = None,
                      model: str | None = None, steps: int = 8, warmup: int = 1) -> CalibratePlan:
    """The calibration of a train command's rollout engine; grids default to B in
    :data:`DEFAULT_BATCH` up to ``max_num_seqs``, k in :data:`DEFAULT_K` up to k_max plus k_max (the setup's
    ``num_speculative_tokens``, else 15), ctx in :data:`DEFAULT_CTX` that fit ``max_model_len`` (else half of it).
    """
    vals = cmd.override_map()
    ec = EngineContext.from_overrides(vals)
    model = model or vals.get("actor_rollout_ref.model.path")
    if not model:
        raise CalibrateError(f"{cmd.script}: no actor_rollout_ref.model.path in the command; pass --model")
    k_max = int(_value(vals.get(VLLM_KW + "speculative_config.num_speculative_tokens", str(DEFAULT_K_MAX))))
    kg = _ints(ks, "k") if ks else tuple(sorted({k for k in DEFAULT_K if k < k_max} | {0, k_max}))
    if kg[0] != 0 or len(kg) < 2:
        raise CalibrateError(f"--k {ks!r}: the grid needs k = 0 and at least one k > 0")
    bg = _ints(batch, "batch") if batch else tuple(b for b in DEFAULT_BATCH if b <= ec.max_num_seqs) or (1,)
    model_len = ec.max_model_len or 4096
    if ctx:
        cg = _ints(ctx, "ctx")
    else:
        cg = tuple(c for c in DEFAULT_CTX if c <= model_len) or (max(model_len // 2, 1),)
    if steps < 1 or warmup < 1:
        raise CalibrateError("--steps >= 1 and --warmup >= 1 are required")
    plan = CalibratePlan(setup=str(cmd.script), model=str(model), shape="", batch=bg, ks=kg, ctx=cg, steps=steps,
                         warmup=warmup)
    extra = {k.removeprefix(VLLM_KW): _value(v) for k, v in vals.items()
             if k.startswith(VLLM_KW) and not k.removeprefix(VLLM_KW).startswith(_SKIPPED_KW)}
    engine = _nested(extra)
    engine.update(
        model=str(model), load_format="dummy", seed=0, disable_log_stats=False,
        tensor_parallel_size=ec.tensor_parallel_size,
        dtype=str(_value(vals.get(ROLLOUT + "dtype", "bfloat16"))),
        enforce_eager=ec.enforce_eager,
        gpu_memory_utilization=float(_value(vals.get(ROLLOUT + "gpu_memory_utilization", "0.5"))),
        max_model_len=max(cg) + plan.decode_tokens,
        max_num_seqs=max(ec.max_num_seqs, max(bg)),
        max_num_batched_tokens=max(ec.max_num_batched_tokens, max(bg) * (kg[-1] + 1)),
        enable_prefix_caching=False,
        speculative_config={"method": "sam", "num_speculative_tokens": kg[-1], "sam_config": {"pad_drafts": True}},
    )
    if ec.capture_sizes and not ec.enforce_eager:
        engine.setdefault("compilation_config", {})["cudagraph_capture_sizes"] = list(ec.capture_sizes)
    shape = f"{Path(str(model)).name}-tp{ec.tensor_parallel_size}"
    return CalibratePlan(**{**asdict(plan), "shape": shape, "engine": engine})


def default_out(setup: str) -> Path:
    ws = Path(os.environ.get("QWEN3_RL_WORKSPACE") or REPO / "workspace")
    return ws / "calibration" / f"verify_cost_{Path(setup).stem.removeprefix('train_')}.json"


# ---------------------------------------------------------------------------------------------- the engine side
def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.23.0+cpu`` ((0, 0) when unreadable)."""
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def engine_for_vllm(engine: dict[str, Any], vllm_version: str, device: str) -> dict[str, Any]:
    """The plan's ``LLM`` arguments for the installed vLLM (a new dict; ``engine`` untouched).

    Before :data:`EXTENSION_POINT_VLLM` (the seed set's patched vLLM) they stay as they are (``method="sam"``).
    From it on, SAM's options go to ``additional_config["qwen3_rl"]["sam_config"]`` and the drafter is seated through
    upstream's extension points: on the NPU platform (``device`` "npu", vLLM-Ascend) in the ``ngram`` seat of
    vLLM-Ascend's runner by ``worker_cls`` :data:`SAM_NPU_WORKER`; elsewhere through vLLM's ``custom_class`` with
    ``worker_cls`` :data:`SAM_CPU_WORKER` (``vllm.platforms.current_platform.device_name`` gives ``device``).
    """
    if _release(vllm_version) < EXTENSION_POINT_VLLM:
        return dict(engine)
    spec = engine["speculative_config"]
    out = {key: val for key, val in engine.items() if key != "speculative_config"}
    extra = dict(out.get("additional_config") or {})
    extra["qwen3_rl"] = {**dict(extra.get("qwen3_rl") or {}), "sam_config": dict(spec.get("sam_config") or {})}
    out["additional_config"] = extra
    k = int(spec["num_speculative_tokens"])
    if device == "npu":
        out["worker_cls"] = SAM_NPU_WORKER
        out["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k}
    else:
        out["worker_cls"] = SAM_CPU_WORKER
        out["speculative_config"] = {"method": "custom_class", "model": SAM_CUSTOM_CLASS, "num_speculative_tokens": k}
    return out


def _set_draft_len(worker: Any, k: int) -> int:
    """In each engine worker (``LLM.collective_rpc``): the SAM drafter proposes exactly ``k`` tokens per request
    from the next step (``pad_drafts``; k = 0: its drafts are dropped). Returns the drafter's padded length."""
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    d = getattr(runner, "drafter", None)
    if d is None or getattr(d, "name", "") != "sam":
        raise RuntimeError(f"the engine's drafter is {type(d).__name__}, not SAM: calibrate needs the recipe's "
                           "vLLM plugin (VLLM_PLUGINS=qwen3_rl) and its patched vLLM (vLLM 0.23: its worker_cls)")
    if not hasattr(d, "_calibrate_propose"):
        d._calibrate_propose = d.propose

        # the runner's call as it is: (scheduler_output, valid) on the seed set, (valid, ...) on vLLM(-Ascend) 0.23
        def propose(*args: Any, _d: Any = d, **kwargs: Any) -> list[list[int]]:
            out = _d._calibrate_propose(*args, **kwargs)
            return [[] for _ in out] if _d._calibrate_k == 0 else out

        d.propose = propose
    d._calibrate_k = int(k)
    d.sam.k = max(int(k), 1)
    return int(k) if d.sam.config.pad_drafts else -1


def _draft_tokens(llm: Any) -> float:
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_draft_tokens":
            return float(getattr(m, "value", 0) or 0)
    return 0.0


def measure(plan: CalibratePlan, log: Any = print) -> dict[str, Any]:
    """Run the grid on the engine (imports vLLM; one engine per process). Returns the table (a JSON object)."""
    import numpy as np
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    engine_kwargs = engine_for_vllm(plan.engine, vllm.__version__, str(getattr(current_platform, "device_name", "")))
    t_start = time.perf_counter()
    llm = LLM(**copy.deepcopy(engine_kwargs))  # the engine may add to its config dicts (vLLM-Ascend 0.23 does)
    t_engine = time.perf_counter() - t_start
    engine = llm.llm_engine
    cache = engine.vllm_config.cache_config
    kv_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
    need = max(plan.batch) * (max(plan.ctx) + plan.decode_tokens)
    if kv_tokens and need > kv_tokens:
        raise CalibrateError(f"the largest cell (B={max(plan.batch)}, ctx={max(plan.ctx)}) needs {need} KV tokens, "
                             f"the engine holds {kv_tokens}: pass a smaller --batch or --ctx")
    vocab = int(engine.vllm_config.model_config.get_vocab_size())
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    serial = 0
    for ctx in plan.ctx:
        for b in plan.batch:
            ids = [f"cal-{serial + i}" for i in range(b)]
            serial += b
            sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=plan.decode_tokens)
            for rid in ids:
                prompt = rng.integers(16, vocab, ctx).tolist()
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
            decoded = dict.fromkeys(ids, 0)
            budget = plan.engine["max_num_batched_tokens"]
            for _ in range(math.ceil(b * ctx / budget) + b + 8):  # prefill (chunked) until every request decodes
                for out in engine.step():
                    decoded[out.request_id] = len(out.outputs[0].token_ids)
                if min(decoded.values()) > 0:
                    break
            else:
                raise CalibrateError(f"B={b} ctx={ctx}: requests did not all start decoding")
            times: dict[int, list[float]] = {k: [] for k in plan.ks}
            drafts: dict[int, float] = dict.fromkeys(plan.ks, 0.0)
            ctx_seen: dict[int, list[float]] = {k: [] for k in plan.ks}
            for _ in range(plan.steps):  # rounds: every k once per round, so that load elsewhere hits all alike
                for k in plan.ks:
                    llm.collective_rpc(_set_draft_len, args=(k,))
                    for _ in range(plan.warmup):  # the first step after a change verifies the old k's drafts
                        engine.step()
                    d0 = _draft_tokens(llm)
                    t0 = time.perf_counter()
                    for out in engine.step():
                        decoded[out.request_id] = len(out.outputs[0].token_ids)
                    times[k].append((time.perf_counter() - t0) * 1e3)
                    drafts[k] += _draft_tokens(llm) - d0
                    ctx_seen[k].append(ctx + statistics.mean(decoded.values()))
                running = engine.get_num_unfinished_requests()
                if running != b:
                    raise CalibrateError(f"B={b} ctx={ctx}: {running} requests running, expected {b}")
            base = statistics.median(times[0])
            for k in plan.ks:
                med = statistics.median(times[k])
                rows.append({"model": plan.shape, "B": b, "k": k, "ctx": ctx, "query_tokens": b * (k + 1),
                             "step_ms": round(med, 4), "ratio_to_k0": round(med / base, 4),
                             "step_ms_min": round(min(times[k]), 4), "step_ms_max": round(max(times[k]), 4),
                             "draft_tokens_per_step": drafts[k] / plan.steps,
                             "ctx_measured": round(statistics.mean(ctx_seen[k]), 1)})
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            cell = [r for r in rows if r["B"] == b and r["ctx"] == ctx]
            log(f"calibrate: B={b} ctx={ctx}: " + ", ".join(f"k={r['k']} {r['step_ms']:.3f} ms" for r in cell))
    elapsed = time.perf_counter() - t_start
    import torch

    return {"tool": "python -m qwen3_rl calibrate", "setup": plan.setup, "shape": plan.shape,
            "device": _device_name(torch), "torch": torch.__version__, "load_format": "dummy",
            "grid": {"B": list(plan.batch), "k": list(plan.ks), "ctx": list(plan.ctx), "steps": plan.steps,
                     "warmup": plan.warmup},
            "engine": {k: v for k, v in engine_kwargs.items() if k != "speculative_config"},
            "drafter": engine_kwargs["speculative_config"],
            "kv_tokens": kv_tokens, "engine_start_s": round(t_engine, 2), "elapsed_s": round(elapsed, 2),
            "notes": ["step_ms: median of the timed LLMEngine.step calls (schedule + forward + sampling + "
                      "drafting); k = 0 drops the drafts of the same engine",
                      "dummy weights: drafts are rarely accepted, so each step decodes about one token"],
            "rows": rows, "inversions": inversions(rows)}


def inversions(rows: list[dict[str, Any]], key: str = "step_ms", tol: float = INVERSION_TOL) -> list[dict[str, Any]]:
    """The rows that cost less than ``1 - tol`` of a row with fewer query tokens: a longer draft in the same
    (B, ctx) cell, or more requests at the same (k, ctx). On a device of its own more verified tokens never cost
    less, so each one is a measurement some other load disturbed (re-run ``calibrate``, or raise ``--steps``).

    Args:
        rows: the table's rows (``B``, ``k``, ``ctx``, ``key`` in ms).
        key: the time to compare (``step_ms``: median; ``step_ms_min``: the fastest round).
        tol: relative tolerance.
    Returns:
        One dict per inversion: ``row`` and ``than`` (``(B, k, ctx)`` each), ``ratio`` (row / that row's time),
        worst first.
    """
    ms = {(int(r["B"]), int(r["k"]), int(r["ctx"])): float(r[key]) for r in rows}
    found = []
    for (b, k, c), t in ms.items():
        fewer = [(bb, kk, cc) for (bb, kk, cc) in ms if cc == c and ((bb == b and kk < k) or (kk == k and bb < b))]
        if not fewer:
            continue
        worst = max(fewer, key=lambda f: ms[f])
        ratio = t / ms[worst]
        if ratio < 1 - tol:
            found.append({"row": (b, k, c), "than": worst, "ratio": round(ratio, 4)})
    return sorted(found, key=lambda f: f["ratio"])


def _device_name(torch: Any) -> str:
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_available", lambda: False)():
        return str(npu.get_device_name(0))
    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


# ---------------------------------------------------------------------------------------------- CLI
HELP = """Measure the verification-cost table of a setup's rollout engine (dummy weights) for SAM_COST_TABLE.

Time: one engine start, then per cell (B, ctx) a prefill of B x ctx tokens and steps x len(k) x (warmup + 1)
engine steps. On CPU, the tiny test grid (B 1,4 x k 0,1,3,7 x ctx 32,128, 5 steps) takes 10-20 s with warm caches
on 2 shared cores (25 s with a cold compile cache). On an A3 (not measured here) the default grid (B 1..256,
k 0,1,3,7,15, ctx 1K and 8K: 10 cells, 800 timed and warm-up steps, 2.1M prefill tokens for the largest cell)
should take minutes, most of it prefill and graph capture. The table goes to --out (default
<workspace>/calibration/verify_cost_<setup>.json); give it to training with SAM_COST_TABLE=<file>, or set
SAM_COST_TABLE=calibrate and the launcher runs this first."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl calibrate", description=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", required=True, help="train script (internal/train_*.sh) whose rollout engine to time")
    ap.add_argument("--out", help="table file (default <workspace>/calibration/verify_cost_<setup>.json)")
    ap.add_argument("--model", help="model folder (default: the setup's actor_rollout_ref.model.path)")
    ap.add_argument("--batch", help=f"running requests B, comma-separated (default {DEFAULT_BATCH} up to "
                                    "max_num_seqs)")
    ap.add_argument("--k", help=f"draft lengths, comma-separated, with 0 (default {DEFAULT_K} up to k_max)")
    ap.add_argument("--ctx", help=f"context tokens per request (default {DEFAULT_CTX} within max_model_len)")
    ap.add_argument("--steps", type=int, default=8, help="rounds over the ks: timed engine steps per row (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed engine steps after each change of k (>= 1)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (engine arguments, grid) and stop")
    a = ap.parse_args(argv)
    try:
        cmd = parse_train_script(a.setup if Path(a.setup).is_file() else REPO / a.setup)
        plan = plan_from_command(cmd, a.batch, a.k, a.ctx, a.model, a.steps, a.warmup)
        out = Path(a.out) if a.out else default_out(a.setup)
        print(f"calibrate: {plan.shape}: B {list(plan.batch)} x k {list(plan.ks)} x ctx {list(plan.ctx)} "
              f"({plan.cells()} cells, {plan.engine_steps()} timed + warm-up steps) -> {out}", flush=True)
        if a.dry_run:
            print(json.dumps(asdict(plan), indent=1, default=str))
            return 0
        table = measure(plan)
    except (CalibrateError, TrainScriptError) as exc:
        print(f"error: calibrate: {exc}", file=sys.stderr)
        return 2
    from qwen3_rl.spec_decode.cost_table import load_cost_table

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    load_cost_table(str(out))  # the table must load as the drafter will load it
    for inv in table["inversions"]:
        b, k, c = inv["row"]
        print(f"warning: calibrate: B={b} k={k} ctx={c} took {inv['ratio']:.2f}x the time of B={inv['than'][0]} "
              f"k={inv['than'][1]} (fewer query tokens): another load disturbed it; re-run or raise --steps")
    print(f"calibrate: wrote {len(table['rows'])} rows to {out} in {table['elapsed_s']:.1f} s "
          f"(engine start {table['engine_start_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
