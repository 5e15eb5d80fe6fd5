"""HDP against megatron-core 0.16's hybrid context parallel balancing, on reference-like 32K length batches.

    python -m qwen3_rl.tools.bench.hdp_mcore --megatron-tree PATH [--cp 4] [--sizes 256] [--batches 5] [--json]

Both assign the same batch (lengths as ``qwen3_rl.tools.bench.hdp``: [ref 002 §1.3]'s 235B 32K GRPO run) to one group
of ``C`` ranks with the same per-rank token budget ``B`` (default: the smallest multiple of 1024 that lets the longest
sequence run on all ``C`` ranks):

  ours      ``qwen3_rl.parallel.hdp.assign_hdp``: micro-batches of aligned power-of-two blocks, no barrier between
            micro-batches; a rank's step time is the sum of its micro-batches' costs.
  upstream  megatron-core's ``BalancedCPScheduler.get_groups_and_subsamples`` (``pipeline_parallel/
            hybrid_cp_schedule.py``, imported from ``--megatron-tree``, called on a stand-in of the DPxCP process
            group that only answers ``size()``): each sample gets CP size ``2**ceil(log2(s / B))``; samples are
            packed into *groups*, each ended by a barrier over the DPxCP group
            (``hybrid_context_parallel_forward_backward``), so the step is the sum over groups of the slowest rank.

Costs of both are evaluated with the same model (``qwen3_rl.parallel.hdp.CostModel``; upstream balances on its own
estimate ``s**2 / cp``). Reported per case (mean over batches, and worst): ``balance`` = max / mean of the per-rank
totals, ``step`` = simulated step (ours: max per-rank total; upstream: sum over groups of the group maximum) over
the lower bound ``qwen3_rl.parallel.hdp.lower_bound``, upstream's group count, the forward/backward passes of its
busiest rank (one per sample: ``hybrid_context_parallel_forward_backward`` runs each sub-sample alone; ours runs one
packed pass per micro-batch, ``ours_micro_batches``) and upstream's step over ours. Neither model has a per-pass
overhead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from qwen3_rl.parallel import hdp
from qwen3_rl.tools.bench.hdp import default_budget, reference_like_lengths


def load_scheduler(megatron_tree: Path) -> Any:
    """megatron-core's ``BalancedCPScheduler`` from ``megatron_tree`` (0.16 or later)."""
    src = megatron_tree / "megatron" / "core" / "pipeline_parallel" / "hybrid_cp_schedule.py"
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found: --megatron-tree must be a megatron-core >= 0.16 tree")
    if str(megatron_tree) not in sys.path:
        sys.path.insert(0, str(megatron_tree))
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    return BalancedCPScheduler


def upstream_assignment(lens: list[int], cp: int, budget: int, scheduler_cls: Any) -> list[list[list[int]]]:
    """Upstream's groups: ``groups[g][r]`` = the sample indices rank ``r`` runs in group ``g``."""
    sched = scheduler_cls(budget, SimpleNamespace(size=lambda: cp))
    _, sample_id_groups = sched.get_groups_and_subsamples(list(enumerate(lens)), None)
    return [[list(ids) for ids in group] for group in sample_id_groups]


def upstream_costs(lens: list[int], groups: list[list[list[int]]], budget: int, cm: hdp.CostModel
                   ) -> dict[str, Any]:
    """Per-rank totals, per-group maxima and checks of upstream's assignment under ``cm``. A sample's CP size in a
    group is the number of ranks that run it there; every sample must run exactly once, within the budget."""
    cp = len(groups[0])
    totals = [0.0] * cp
    group_max, seen = [], []
    for group in groups:
        holders: dict[int, list[int]] = {}
        for r, ids in enumerate(group):
            for i in ids:
                holders.setdefault(i, []).append(r)
        per_rank = [0.0] * cp
        for i, ranks in holders.items():
            k = len(ranks)
            assert k & (k - 1) == 0 and hdp.tokens_on_rank(lens[i], k) <= budget, (i, lens[i], k)
            for r in ranks:
                per_rank[r] += cm.cost(lens[i], k)
        seen += list(holders)
        group_max.append(max(per_rank))
        totals = [t + c for t, c in zip(totals, per_rank, strict=True)]
    assert sorted(seen) == list(range(len(lens))), "upstream left out or repeated a sample"
    forwards = max(sum(len(group[r]) for group in groups) for r in range(cp))
    return {"totals": totals, "step": sum(group_max), "groups": len(groups), "forwards": forwards}


def run(sizes: list[int], cps: list[int], batches: int, budget: int | None, sigma: float, megatron_tree: Path,
        seed: int) -> dict[str, Any]:
    cm = hdp.CostModel()
    sched = load_scheduler(megatron_tree)
    out: dict[str, Any] = {"cost_model": {"a": cm.a, "b": cm.b, "g": cm.g}, "sigma": sigma, "cases": {}}
    for cp in cps:
        B = budget or default_budget(cp)
        for n in sizes:
            rows = []
            for b in range(batches):
                lens = reference_like_lengths(n, seed + 1000 * b + n, sigma)
                lb = hdp.lower_bound(lens, cp, B, cm)
                ours = hdp.assign_hdp(lens, cp, B, cm)
                up = upstream_costs(lens, upstream_assignment(lens, cp, B, sched), B, cm)
                rows.append({
                    "ours_balance": max(ours.rank_cost) / float(np.mean(ours.rank_cost)),
                    "ours_step": ours.max_cost / lb,
                    "ours_micro_batches": ours.num_micro_batches,
                    "upstream_balance": max(up["totals"]) / float(np.mean(up["totals"])),
                    "upstream_step": up["step"] / lb,
                    "upstream_groups": up["groups"],
                    "upstream_forwards": up["forwards"],
                    "upstream_over_ours": up["step"] / ours.max_cost,
                })
            agg: dict[str, Any] = {"cp": cp, "budget": B, "batch_size": n, "batches": batches}
            for key in rows[0]:
                vals = [r[key] for r in rows]
                agg[key] = round(float(np.mean(vals)), 4)
                agg[key + "_worst"] = round(float(np.max(vals)), 4)
            out["cases"][f"cp{cp}_n{n}"] = agg
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl.tools.bench.hdp_mcore", description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-tree", required=True, help="a megatron-core >= 0.16 source tree (holds megatron/)")
    ap.add_argument("--sizes", default="256", help="sequences per group per step (comma list)")
    ap.add_argument("--cp", default="4", help="ranks in the group (comma list, powers of two)")
    ap.add_argument("--batches", type=int, default=5, help="random batches per case")
    ap.add_argument("--budget", type=int, default=None, help="tokens per rank per micro-batch (default per CP)")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of response lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        res = run([int(x) for x in args.sizes.split(",")], [int(x) for x in args.cp.split(",")], args.batches,
                  args.budget, args.sigma, Path(args.megatron_tree), args.seed)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for label, case in res["cases"].items():
            print(label, case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
