"""HDP benchmark: max per-rank cost / lower bound on reference-like length batches, vs verl's Karmarkar-Karp.

    python -m qwen3_rl.tools.bench.hdp [--batches 5] [--sizes 64,256] [--cp 4,8] [--json]

Lengths: prompt ~ log-normal (mean 74, clipped to 2048) + response ~ log-normal (mean 7345, sigma
``--sigma``, clipped to 32768), as in the Qwen3-235B 32K GRPO run of [ref 002 §1.3] (mean input 73.7, mean output
7344.97, max response 32768). Per CP size C the per-rank token budget is ``--budget`` (default
``ceil((32768 + 2048) / C)`` rounded up to a multiple of 1024, the smallest that lets the longest sequence run).

Compared on the same batch and cost model (``qwen3_rl.parallel.hdp.CostModel``):
  hdp      ``assign_hdp`` (DP for short, aligned CP blocks for long, bin packing + refinement)
  pure_cp  every sequence split over all C ranks (CP only, as CP8 in [ref 002 §4.2]); micro-batches from verl 0.6.1's
           ``get_seqlen_balanced_partitions`` (Karmarkar-Karp) on the per-sequence cost, as verl's
           ``rearrange_micro_batches`` does; micro-batch count raised until every micro-batch fits the budget
  pure_dp  every sequence whole on one rank; verl's KK partition of the sequences over the C ranks on the cost;
           ``budget_violations`` counts sequences longer than the budget (pure DP cannot run them)
Each reports ``ratio`` = max per-rank cost / ``lower_bound`` (>= 1; lower is better) and HDP's speedup over
pure CP (= pure_cp cost / hdp cost). verl is imported from ``--verl-tree`` (default: the workspace's verl tree,
made from the pinned wheel when missing, ``qwen3_rl.tools.bench.upstream_trees``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from qwen3_rl.parallel import hdp
from qwen3_rl.tools.bench.upstream_trees import UpstreamTreeError, upstream_tree

MAX_PROMPT, MAX_RESPONSE = 2048, 32768


def reference_like_lengths(n: int, seed: int, sigma: float = 0.8) -> list[int]:
    """Sequence lengths (prompt + response) of a reference-like batch (means 74 + 7345 before clipping)."""
    rng = np.random.default_rng(seed)
    resp = rng.lognormal(np.log(7345) - sigma**2 / 2, sigma, n)
    prompt = rng.lognormal(np.log(74) - 0.5**2 / 2, 0.5, n)
    total = np.minimum(np.rint(prompt), MAX_PROMPT) + np.minimum(np.rint(resp), MAX_RESPONSE)
    return np.maximum(total, 1).astype(int).tolist()


def default_budget(cp: int) -> int:
    need = -(-(MAX_PROMPT + MAX_RESPONSE) // cp) + 2
    return -(-need // 1024) * 1024


def load_kk(verl_tree: Path) -> Any:
    """verl 0.6.1's ``get_seqlen_balanced_partitions`` imported from the pristine tree."""
    if not (verl_tree / "verl" / "utils" / "seqlen_balancing.py").is_file():
        raise FileNotFoundError(f"{verl_tree}/verl/utils/seqlen_balancing.py not found (pass --verl-tree)")
    if str(verl_tree) not in sys.path:
        sys.path.insert(0, str(verl_tree))
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    return get_seqlen_balanced_partitions


def _scaled(costs: list[float]) -> list[int]:
    return [max(1, int(round(c * 1000))) for c in costs]


def pure_cp(lens: list[int], cp: int, budget: int, cm: hdp.CostModel, kk: Any) -> dict[str, Any]:
    per_rank_tok = [hdp.tokens_on_rank(s, cp) for s in lens]
    m = max(1, -(-sum(per_rank_tok) // budget))
    work = _scaled([cm.cost(s, cp) for s in lens])
    while True:
        parts = kk(work, min(m, len(lens)), False)
        if all(sum(per_rank_tok[i] for i in p) <= budget for p in parts) or m >= len(lens):
            break
        m += 1
    cost = sum(cm.cost(s, cp) for s in lens)
    return {"cost": cost, "micro_batches": len(parts)}


def pure_dp(lens: list[int], cp: int, budget: int, cm: hdp.CostModel, kk: Any) -> dict[str, Any]:
    parts = kk(_scaled([cm.cost(s, 1) for s in lens]), cp, False)
    costs = [sum(cm.cost(lens[i], 1) for i in p) for p in parts]
    return {"cost": max(costs), "budget_violations": sum(1 for s in lens if s > budget)}


def run(sizes: list[int], cps: list[int], batches: int, budget: int | None, sigma: float, verl_tree: Path | None,
        seed: int) -> dict[str, Any]:
    cm = hdp.CostModel()
    kk = load_kk(verl_tree) if verl_tree is not None else None
    out: dict[str, Any] = {"cost_model": {"a": cm.a, "b": cm.b, "g": cm.g}, "sigma": sigma, "cases": {}}
    for cp in cps:
        B = budget or default_budget(cp)
        for n in sizes:
            rows = []
            for b in range(batches):
                lens = reference_like_lengths(n, seed + 1000 * b + n, sigma)
                lb = hdp.lower_bound(lens, cp, B, cm)
                t0 = time.perf_counter()
                a = hdp.assign_hdp(lens, cp, B, cm)
                ms = (time.perf_counter() - t0) * 1e3
                row = {"mean_len": float(np.mean(lens)), "max_len": max(lens), "hdp_ratio": a.max_cost / lb,
                       "hdp_ms": ms, "hdp_micro_batches": a.num_micro_batches,
                       "hdp_dp_fraction": sum(p.block_size == 1 for p in a.placements) / n}
                if kk is not None:
                    pc = pure_cp(lens, cp, B, cm, kk)
                    pd = pure_dp(lens, cp, B, cm, kk)
                    row.update({"pure_cp_ratio": pc["cost"] / lb, "pure_cp_micro_batches": pc["micro_batches"],
                                "pure_dp_ratio": pd["cost"] / lb, "pure_dp_budget_violations": pd["budget_violations"],
                                "speedup_vs_pure_cp": pc["cost"] / a.max_cost})
                rows.append(row)
            agg: dict[str, Any] = {"cp": cp, "budget": B, "batch_size": n, "batches": batches}
            for key in rows[0]:
                vals = [r[key] for r in rows]
                agg[key] = round(float(np.mean(vals)), 4)
                if key.endswith("_ratio"):
                    agg[key + "_max"] = round(float(np.max(vals)), 4)
            out["cases"][f"cp{cp}_n{n}"] = agg
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl.tools.bench.hdp", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256", help="sequences per CP group per step (comma list)")
    ap.add_argument("--cp", default="4,8", help="CP sizes (comma list, powers of two)")
    ap.add_argument("--batches", type=int, default=5, help="random batches per case")
    ap.add_argument("--budget", type=int, default=None, help="tokens per rank per micro-batch (default per CP)")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of response lengths")
    ap.add_argument("--verl-tree", help="verl source tree (default: the workspace's, fetched if missing)")
    ap.add_argument("--no-verl", action="store_true", help="skip the verl baselines (no verl import)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    verl_tree = None
    if not args.no_verl:
        try:
            verl_tree = upstream_tree("verl", args.verl_tree)
        except UpstreamTreeError as exc:
            print(f"error: {exc} (or --no-verl: HDP alone, without verl's baselines)", file=sys.stderr)
            return 1
    res = run([int(x) for x in args.sizes.split(",")], [int(x) for x in args.cp.split(",")], args.batches,
              args.budget, args.sigma, verl_tree, args.seed)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for label, case in res["cases"].items():
            print(label, case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
