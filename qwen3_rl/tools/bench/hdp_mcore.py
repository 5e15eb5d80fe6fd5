"""HDP on the current set: ours against megatron-core 0.16.1's hybrid context parallel (235B layout, reference lengths).

    python -m qwen3_rl.tools.bench.hdp_mcore [--seeds 0,1,2] [--budgets 34816,9216] [--dp 2] [--cp 4] [--verl-cp]
        [--json]

Run it in the current set's training venv (``tests/setup_verl091_env.sh``: megatron-core 0.16.1 and verl 0.9.1
installed); ``--megatron-tree`` imports megatron from a source tree instead.

Batch (one per seed): ``qwen3_rl.tools.sim.lengths.generate_lengths`` (the simulator's reference lengths: 512 prompts
x 16 samples, two-level log-normal fitted to [ref 002 §1.3]'s 235B 32K GRPO run, mean response 7345, max 32768);
sequence length = prompt + response. Layout: the 235B actor (``internal/lib/qwen3_235b_layout.sh``: TP 4, PP 4,
CP 4 on 128 dies), so DP x CP = 128 / (4 * 4) = 8 ranks: DP 2 x CP 4. One mini-batch per step (``PPO_MINI_BATCH_SIZE``
= ``TRAIN_BATCH_SIZE``). Budget ``B`` = tokens per rank per pass: 34816 is the recipe's (``ppo_max_token_len_per_gpu``
= 2048 + 32768, HDP's default ``token_budget``); 9216 the smallest multiple of 1024 that still fits the longest
sequence on 4 ranks (memory-tight, where CP sizes matter).

Packers, each given the same batch and ``B`` (verl CP only with ``--verl-cp``: verl's Karmarkar-Karp over
thousands of sequences and hundreds of micro-batches takes minutes per batch here):
  verl CP   no HDP: verl 0.9.1's default. ``_balance_batch``'s DP split (``get_seqlen_balanced_partitions`` on
            ``calculate_workload``, equal sizes), then per DP rank ``rearrange_micro_batches`` with ``max_token_len =
            B * CP`` (``engine/utils.py:111``, ``sp_size`` = CP ``engine/megatron/transformer_impl.py:836``), the
            micro-batch count raised to the DP maximum; every sequence on all CP ranks. Real verl functions.
  ours      the same DP split, then ``qwen3_rl.parallel.hdp.assign_hdp`` per CP group (cost model below); the
            world runs the maximum micro-batch count (``HDPRuntime``'s world max).
  upstream  megatron-core's ``BalancedCPScheduler.get_groups_and_subsamples`` (``pipeline_parallel/
            hybrid_cp_schedule.py``), the real function, over all DP x CP ranks (``HybridCPDataLoaderWrapper``
            gathers every DP rank's samples, ``datasets/data_schedule.py:287-295``), with
            ``max_seqlen_per_dp_cp_rank = B``. Its process group is a stand-in that only answers ``size()``. It runs
            one forward/backward pass per sample (``hybrid_context_parallel_forward_backward``) and a barrier over
            DP x CP after each group.

Cost (all three, one model): ``qwen3_rl.parallel.hdp.CostModel``, per rank ``a*t + b*s**2/k + g*[k>1]*t*(k-1)``
(linear work, causal attention, exposed ring traffic; attention-aware, ours balances on it; upstream balances on its
own ``s**2/k``, verl on ``24576*s + s**2``). Figures per (budget, packer), mean and [min, max] over the seeds:
  balance     max / mean of the per-rank totals over the step.
  lockstep    simulated step / lower bound, every pass a sync point of all DP x CP ranks: the 235B's MoE all-to-all
              spans them (EP 32 = TP 4 x DP 2 x CP 4), so pass ``j`` ends when its slowest rank does. ours / verl CP:
              sum over micro-batches of the max over ranks; upstream: sum over groups and pass index of the max over
              ranks (a rank with fewer passes in a group waits).
  free        simulated step / lower bound without that sync (a dense model): ours / verl CP the largest per-rank
              total, upstream the sum over groups of the group's largest per-rank total (its barrier).
  step_s      the lockstep step in seconds: cost units x 797.93 s / ``all_cp``, the mean over the seeds of the
              busiest DP rank's work with every sequence on all CP ranks (what the reference ran, CP without HDP;
              independent of the micro-batch partition): the reference's measured ``update_actor`` time ([ref 002
              §1.3], ``qwen3_rl.tools.report.published``) put on that work. Relative figures, not a prediction.
  passes      forward/backward passes of the busiest rank (per-pass overhead is not modelled).
  plan_ms     host time of the packer per step (ours: both CP groups; verl CP: both DP ranks).
The lower bound is ``qwen3_rl.parallel.hdp.lower_bound`` over the DP x CP ranks as one group (valid for all three).
Invariants (checked on every batch, ``check_ours`` / ``check_upstream``): every sequence placed exactly once, no rank
over ``B`` tokens in a pass, the placed tokens sum to the batch's tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from qwen3_rl.parallel import hdp
from qwen3_rl.tools.report.published import PUBLISHED
from qwen3_rl.tools.sim.lengths import REF_N, REF_NUM_PROMPTS, generate_lengths

#: the reference's measured actor-update seconds per step ([ref 002 §1.3], 235B, 128 dies, GBS 512, n 16)
REF_UPDATE_S = next(f.value for f in PUBLISHED["235b-grpo"][1] if f.key == "timing_s/update_actor")
RECIPE_BUDGET = 2048 + 32768  # ppo_max_token_len_per_gpu of the 32K recipes (internal/lib/train_common.sh)
PACKERS = ("verl CP", "ours", "upstream")


@dataclass
class Packing:
    """One packer's step on the DP x CP world: ``passes[j][r]`` = cost (model units) of rank ``r``'s ``j``-th pass
    in lockstep order (0 where the rank runs nothing), ``barriers`` = indices into ``passes`` where a barrier group
    ends (upstream's groups; ``[len(passes)]`` for the others)."""

    name: str
    passes: list[list[float]]
    barriers: list[int]
    rank_passes: list[int]
    plan_ms: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def totals(self) -> list[float]:
        """Per-rank summed cost, shape (world,)."""
        return [float(x) for x in np.sum(np.asarray(self.passes), axis=0)]

    def lockstep(self) -> float:
        return float(np.sum(np.max(np.asarray(self.passes), axis=1)))

    def free(self) -> float:
        arr, out, start = np.asarray(self.passes), 0.0, 0
        for end in self.barriers:
            out += float(np.max(np.sum(arr[start:end], axis=0)))
            start = end
        return out


# ---- upstream imports ------------------------------------------------------------------------------------------


def load_upstream(megatron_tree: Path | None = None) -> tuple[Any, str]:
    """megatron-core's ``BalancedCPScheduler`` and its version: installed, or from ``megatron_tree`` (>= 0.16)."""
    if megatron_tree is not None:
        src = megatron_tree / "megatron" / "core" / "pipeline_parallel" / "hybrid_cp_schedule.py"
        if not src.is_file():
            raise FileNotFoundError(f"{src} not found: --megatron-tree must be a megatron-core >= 0.16 tree")
        sys.path.insert(0, str(megatron_tree))
    try:
        from megatron.core.package_info import __version__
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    except ImportError as exc:
        raise FileNotFoundError(
            f"megatron-core >= 0.16 not importable ({exc}): run in the current set's venv "
            "(tests/setup_verl091_env.sh) or pass --megatron-tree"
        ) from exc
    return BalancedCPScheduler, __version__


def load_verl() -> SimpleNamespace:
    """verl's DP split and micro-batching functions (``verl.utils.seqlen_balancing``) and its version."""
    try:
        import verl
        from verl.utils.seqlen_balancing import (
            calculate_workload,
            get_seqlen_balanced_partitions,
            rearrange_micro_batches,
        )
    except ImportError as exc:
        raise FileNotFoundError(
            f"verl not importable ({exc}): run in the current set's venv (tests/setup_verl091_env.sh)"
        ) from exc
    return SimpleNamespace(
        workload=calculate_workload,
        partitions=get_seqlen_balanced_partitions,
        rearrange=rearrange_micro_batches,
        version=verl.__version__,
    )


# ---- batch and DP split ----------------------------------------------------------------------------------------


def batch_lengths(seed: int, prompts: int = REF_NUM_PROMPTS, n: int = REF_N) -> list[int]:
    """Sequence lengths (prompt + response tokens) of one reference-like step, shape (prompts * n,)."""
    lengths = generate_lengths(prompts, n, seed=seed)
    return [int(x) for x in lengths.prompt_len + lengths.response_len]


def dp_split(lens: list[int], dp: int, verl: SimpleNamespace) -> list[list[int]]:
    """verl's ``_balance_batch``: equal-size DP partitions balanced on ``calculate_workload`` (sequence indices)."""
    import torch

    work = verl.workload(torch.tensor(lens, dtype=torch.int64)).tolist()
    return [sorted(p) for p in verl.partitions(work, k_partitions=dp, equal_size=True)]


# ---- the three packers -----------------------------------------------------------------------------------------


def pack_verl_cp(
    lens: list[int], split: list[list[int]], cp: int, budget: int, cm: hdp.CostModel, verl: SimpleNamespace
) -> Packing:
    """verl's default: per DP rank ``rearrange_micro_batches`` (max_token_len = budget * cp), counts synced to the
    DP maximum; every sequence on all ``cp`` ranks. Returns sequence ids per micro-batch in ``extra['mbs']``."""
    import torch
    from tensordict import TensorDict

    def rearrange(ids: list[int], min_mb: int | None) -> list[list[int]]:
        ln = torch.tensor([lens[i] for i in ids])
        mask = torch.arange(int(ln.max()))[None, :] < ln[:, None]
        td = TensorDict({"attention_mask": mask, "input_ids": mask}, batch_size=[len(ids)])
        _, idx = verl.rearrange(td, max_token_len=budget * cp, min_num_micro_batch=min_mb)
        return [[ids[j] for j in mb] for mb in idx]

    t0 = time.perf_counter()
    mbs = [rearrange(ids, None) for ids in split]
    m = max(len(x) for x in mbs)
    mbs = [x if len(x) == m else rearrange(ids, m) for x, ids in zip(mbs, split, strict=True)]
    ms = (time.perf_counter() - t0) * 1e3
    world = len(split) * cp
    passes = [[0.0] * world for _ in range(m)]
    for d, per_rank in enumerate(mbs):
        for j, mb in enumerate(per_rank):
            c = sum(cm.cost(lens[i], cp) for i in mb)
            for r in range(d * cp, (d + 1) * cp):
                passes[j][r] = c
    return Packing("verl CP", passes, [m], [m] * world, ms, {"mbs": mbs})


def pack_ours(lens: list[int], split: list[list[int]], cp: int, budget: int, cm: hdp.CostModel) -> Packing:
    """``assign_hdp`` per CP group on its DP share; the world runs the largest micro-batch count (fillers cost 0).
    ``extra['assignments']`` holds each group's ``HDPAssignment`` (its sequence ``i`` is ``split[d][i]``)."""
    t0 = time.perf_counter()
    assigns = [hdp.assign_hdp([lens[i] for i in ids], cp, budget, cm) for ids in split]
    ms = (time.perf_counter() - t0) * 1e3
    m = max(a.num_micro_batches for a in assigns)
    world = len(split) * cp
    passes = [[0.0] * world for _ in range(m)]
    for d, a in enumerate(assigns):
        for p in a.placements:
            for r in p.ranks:
                passes[p.micro_batch][d * cp + r] += cm.cost(p.length, p.block_size)
    return Packing("ours", passes, [m], [m] * world, ms, {"assignments": assigns})


def upstream_groups(lens: list[int], world: int, budget: int, scheduler_cls: Any) -> list[list[list[int]]]:
    """Upstream's schedule: ``groups[g][r]`` = the sample ids rank ``r`` runs in group ``g``, in pass order."""
    sched = scheduler_cls(budget, SimpleNamespace(size=lambda: world))
    _, sample_id_groups = sched.get_groups_and_subsamples(list(enumerate(lens)), None)
    return [
        [list(ids) for ids in group] + [[] for _ in range(world - len(group))] for group in sample_id_groups
    ]


def pack_upstream(lens: list[int], world: int, budget: int, cm: hdp.CostModel, scheduler_cls: Any) -> Packing:
    """Upstream's groups priced by ``cm``: a sample's CP size in a group = the ranks that run it there."""
    t0 = time.perf_counter()
    groups = upstream_groups(lens, world, budget, scheduler_cls)
    ms = (time.perf_counter() - t0) * 1e3
    passes: list[list[float]] = []
    barriers: list[int] = []
    unequal = 0
    for group in groups:
        k = {i: sum(i in ids for ids in group) for ids in group for i in ids}
        depth = max(len(ids) for ids in group)
        unequal += len({len(ids) for ids in group}) > 1
        for j in range(depth):
            passes.append([cm.cost(lens[ids[j]], k[ids[j]]) if j < len(ids) else 0.0 for ids in group])
        barriers.append(len(passes))
    rank_passes = [sum(len(g[r]) for g in groups) for r in range(world)]
    return Packing(
        "upstream", passes, barriers, rank_passes, ms, {"groups": groups, "unequal_pass_groups": unequal}
    )


# ---- invariants ------------------------------------------------------------------------------------------------


def check_ours(lens: list[int], split: list[list[int]], packing: Packing, budget: int) -> int:
    """Every sequence exactly once, no rank over ``budget`` tokens in a micro-batch, and the token ranges the ranks
    hold (``rank_view``) cover exactly the batch's tokens. Returns the placed tokens."""
    seen: list[int] = []
    placed = 0
    for ids, a in zip(split, packing.extra["assignments"], strict=True):
        seen += [ids[p.seq] for p in a.placements]
        assert all(t <= budget for row in a.rank_tokens for t in row), "ours: a rank over the budget"
        for r in range(a.cp_size):
            for mb in a.rank_view(r):
                placed += sum(e - s for sl in mb for s, e in sl.token_ranges)
    assert sorted(seen) == list(range(len(lens))), "ours: a sequence left out or repeated"
    assert placed == sum(lens), f"ours: {placed} tokens placed, batch has {sum(lens)}"
    return placed


def check_upstream(lens: list[int], packing: Packing, budget: int) -> int:
    """Every sample in exactly one group, on a power-of-two number of ranks there, each rank's share
    ``ceil(s / k) <= budget`` in its pass; returns the placed tokens (each sample's ``s`` counted once)."""
    seen: list[int] = []
    placed = 0
    for group in packing.extra["groups"]:
        holders: dict[int, int] = {}
        for ids in group:
            assert len(set(ids)) == len(ids), "upstream: a sample twice on one rank in a group"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        for i, k in holders.items():
            assert k & (k - 1) == 0, f"upstream: sample {i} on {k} ranks"
            assert math.ceil(lens[i] / k) <= budget, f"upstream: sample {i} ({lens[i]} tokens) on {k} ranks"
            placed += lens[i]
        seen += list(holders)
    assert sorted(seen) == list(range(len(lens))), "upstream: a sample left out or repeated"
    assert placed == sum(lens), f"upstream: {placed} tokens placed, batch has {sum(lens)}"
    return placed


def check_verl_cp(lens: list[int], packing: Packing, cp: int, budget: int) -> int:
    """Every sequence once, each micro-batch within ``budget * cp`` tokens; returns the placed tokens."""
    seen = [i for per_rank in packing.extra["mbs"] for mb in per_rank for i in mb]
    assert sorted(seen) == list(range(len(lens))), "verl CP: a sequence left out or repeated"
    assert all(
        sum(lens[i] for i in mb) <= budget * cp for per_rank in packing.extra["mbs"] for mb in per_rank
    )
    return sum(lens[i] for i in seen)


# ---- the comparison --------------------------------------------------------------------------------------------


def run(
    seeds: list[int],
    budgets: list[int],
    dp: int,
    cp: int,
    prompts: int = REF_NUM_PROMPTS,
    n: int = REF_N,
    megatron_tree: Path | None = None,
    verl_cp: bool = False,
) -> dict[str, Any]:
    """All packers on every (budget, seed). Returns ``{"meta", "rows"}``; ``rows`` one per (budget, packer) with
    ``{metric: {"mean", "min", "max"}}`` over the seeds (metrics as in the module docstring)."""
    sched, mcore_version = load_upstream(megatron_tree)
    verl = load_verl()
    cm = hdp.CostModel()
    world = dp * cp
    per: dict[tuple[int, str], list[dict[str, float]]] = {}
    all_cp: list[float] = []  # per seed: the busiest DP rank's work with every sequence on all CP ranks
    for seed in seeds:
        lens = batch_lengths(seed, prompts, n)
        split = dp_split(lens, dp, verl)
        all_cp.append(max(sum(cm.cost(lens[i], cp) for i in ids) for ids in split))
        for budget in budgets:
            lb = hdp.lower_bound(lens, world, budget, cm)
            packs = [pack_ours(lens, split, cp, budget, cm), pack_upstream(lens, world, budget, cm, sched)]
            check_ours(lens, split, packs[0], budget)
            check_upstream(lens, packs[1], budget)
            if verl_cp:
                packs.insert(0, pack_verl_cp(lens, split, cp, budget, cm, verl))
                check_verl_cp(lens, packs[0], cp, budget)
            for p in packs:
                tot = p.totals
                per.setdefault((budget, p.name), []).append(
                    {
                        "balance": max(tot) / float(np.mean(tot)),
                        "lockstep": p.lockstep() / lb,
                        "free": p.free() / lb,
                        "lockstep_units": p.lockstep(),
                        "passes": float(max(p.rank_passes)),
                        "plan_ms": p.plan_ms,
                        "groups": float(len(p.barriers)),
                        "unequal_pass_groups": float(p.extra.get("unequal_pass_groups", 0)),
                    }
                )
    scale = REF_UPDATE_S / float(np.mean(all_cp))
    rows = []
    for budget in budgets:
        for name in PACKERS if verl_cp else PACKERS[1:]:
            vals = per[(budget, name)]
            for v in vals:
                v["step_s"] = v.pop("lockstep_units") * scale
            row: dict[str, Any] = {"budget": budget, "packer": name}
            for key in vals[0]:
                xs = [v[key] for v in vals]
                row[key] = {"mean": float(np.mean(xs)), "min": float(np.min(xs)), "max": float(np.max(xs))}
            rows.append(row)
    meta = {
        "megatron_core": mcore_version,
        "verl": verl.version,
        "dp": dp,
        "cp": cp,
        "seeds": seeds,
        "sequences": prompts * n,
        "budgets": budgets,
        "cost_model": {"a": cm.a, "b": cm.b, "g": cm.g},
        "step_s_anchor": {"all_cp_units": float(np.mean(all_cp)), "seconds": REF_UPDATE_S},
    }
    return {"meta": meta, "rows": rows}


def format_table(res: dict[str, Any]) -> str:
    """The rows as a Markdown table: mean [min-max] over the seeds."""

    def f(x: dict[str, float], nd: int) -> str:
        return f"{x['mean']:.{nd}f} [{x['min']:.{nd}f}-{x['max']:.{nd}f}]"

    m = res["meta"]
    out = [
        f"megatron-core {m['megatron_core']}, verl {m['verl']}; DP {m['dp']} x CP {m['cp']}, {m['sequences']} "
        f"sequences per step, seeds {','.join(map(str, m['seeds']))}; mean [min-max] over the seeds",
        "",
        "| budget | packer | balance | lockstep / LB | free / LB | step s | passes | groups | plan ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        out.append(
            f"| {r['budget']} | {r['packer']} | {f(r['balance'], 3)} | {f(r['lockstep'], 3)} | "
            f"{f(r['free'], 3)} | {f(r['step_s'], 1)} | {r['passes']['mean']:.0f} | {r['groups']['mean']:.1f} | "
            f"{r['plan_ms']['mean']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m qwen3_rl.tools.bench.hdp_mcore", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--seeds", default="0,1,2", help="batches (seeds of the reference lengths, comma list)")
    ap.add_argument(
        "--budgets", default=f"{RECIPE_BUDGET},9216", help="tokens per rank per pass (comma list)"
    )
    ap.add_argument("--dp", type=int, default=2, help="DP size of the actor (235B: 2)")
    ap.add_argument("--cp", type=int, default=4, help="CP size of the actor (235B: 4)")
    ap.add_argument("--prompts", type=int, default=REF_NUM_PROMPTS, help="prompts per step")
    ap.add_argument("--n", type=int, default=REF_N, help="samples per prompt")
    ap.add_argument(
        "--megatron-tree", type=Path, help="import megatron from this >= 0.16 tree, not the installed"
    )
    ap.add_argument("--verl-cp", action="store_true", help="also verl's CP micro-batching without HDP (slow)")
    ap.add_argument("--json", action="store_true", help="JSON instead of the table")
    args = ap.parse_args(argv)
    try:
        res = run(
            [int(x) for x in args.seeds.split(",")],
            [int(x) for x in args.budgets.split(",")],
            args.dp,
            args.cp,
            args.prompts,
            args.n,
            args.megatron_tree,
            args.verl_cp,
        )
    except (FileNotFoundError, hdp.HDPInfeasibleError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1) if args.json else format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
