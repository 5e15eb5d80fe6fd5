"""EPLB benchmark: balancedness and runtime of expert placements on the same loads.

    python -m qwen3_rl.tools.bench.eplb --loads FILE.csv --num-ranks R --num-nodes N --num-groups G \\
        --redundant X [--prev-loads PREV.csv] [--policies a,b,...] [--json]
    python -m qwen3_rl.tools.bench.eplb --write-synthetic OUT.csv [--layers 94 --experts 128 --zipf 1.0 ...]
    python -m qwen3_rl.tools.bench.eplb --suite [--json]      # the standard Qwen3-235B cases

CSV: one row per MoE layer, one column per logical expert, token counts (no header). Balancedness of a layer
= mean / max of the per-rank loads (a replica carries ``tokens / replicas``); reported as the mean over
layers (each layer's all-to-all waits for its busiest rank). ``ms`` = wall time of one call on all layers
(ours is numba-compiled; compilation is excluded and reported once as ``compile_ms``).

Policies:
  identity          no EPLB: no redundant experts, expert e on rank e // (E / R)
  vllm_default      vLLM 0.13 ``DefaultEplbPolicy.rebalance_experts``, loaded by path from the pinned tree
  ours              ``qwen3_rl.moe.eplb.rebalance_experts``
  ours_migration    ``rebalance_experts_migration_aware`` against the previous placement (below)
  ascend_dynamic_ep, ascend_dynamic_ep_v2, ascend_flashlb
                    vLLM-Ascend 0.13 policies 1, 2, 3 (``rebalance_experts(current_table, workload)``), fed
                    vLLM-Ascend's initial placement and per-slot loads; v2 needs ``vllm.logger`` (imports vLLM)
The previous placement (for ``moved`` counts) is ours on ``--prev-loads`` if given, else ours on the loads
perturbed by multiplicative log-normal noise (sigma ``--drift``), i.e. the previous EPLB window.
The vLLM / vLLM-Ascend trees default to the workspace's (``--vllm-tree`` / ``--ascend-tree`` override), made from
the pinned wheels when missing (``qwen3_rl.tools.bench.upstream_trees``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qwen3_rl.moe import eplb
from qwen3_rl.tools.bench.upstream_trees import UpstreamTreeError, upstream_tree

ALL_POLICIES = (
    "identity", "vllm_default", "ours", "ours_migration",
    "ascend_dynamic_ep", "ascend_dynamic_ep_v2", "ascend_flashlb",
)
DEFAULT_POLICIES = ("identity", "vllm_default", "ours", "ours_migration", "ascend_dynamic_ep", "ascend_flashlb")


# ------------------------------------------------------------------------------------------------ loads


def synthetic_loads(
    num_layers: int = 94,
    num_experts: int = 128,
    zipf: float = 1.0,
    tokens: int = 65536,
    topk: int = 8,
    seed: int = 0,
) -> np.ndarray:
    """Zipf-like skewed loads ``[layers, experts]`` (int64 token counts).

    Per layer the experts are randomly permuted and expert of popularity rank k (1-based) gets probability
    proportional to ``k ** -zipf``; ``tokens * topk`` routed selections are drawn from that distribution
    (multinomial). Qwen3-235B-A22B: 94 MoE layers, 128 experts, top-8.
    """
    rng = np.random.default_rng(seed)
    p = np.arange(1, num_experts + 1, dtype=np.float64) ** (-zipf)
    p /= p.sum()
    out = np.empty((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        out[layer, rng.permutation(num_experts)] = rng.multinomial(tokens * topk, p)
    return out


def hot_loads(num_layers: int = 94, num_experts: int = 128, hot: int = 16, tokens: int = 65536) -> np.ndarray:
    """Every token on the first ``hot`` experts (the issue's extreme case), equal load among them."""
    out = np.zeros((num_layers, num_experts), dtype=np.int64)
    out[:, :hot] = tokens
    return out


def drift(loads: np.ndarray, sigma: float, seed: int) -> np.ndarray:
    """Previous-window loads: multiplicative log-normal noise (``sigma`` in log space)."""
    rng = np.random.default_rng(seed)
    return np.rint(loads * rng.lognormal(0.0, sigma, size=loads.shape)).astype(np.int64)


def read_csv(path: str | Path) -> np.ndarray:
    arr = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    if np.any(arr < 0):
        raise ValueError(f"{path}: negative token counts")
    return arr


def write_csv(path: str | Path, loads: np.ndarray) -> None:
    np.savetxt(path, loads, delimiter=",", fmt="%d")


# ------------------------------------------------------------------------------------------------ baselines


def load_vllm_default(vllm_tree: Path | None) -> Any:
    """vLLM 0.13's ``DefaultEplbPolicy`` loaded by path (only abstract.py + default.py; no vLLM import)."""
    if vllm_tree is None:
        raise FileNotFoundError("no vLLM tree (see the hint above)")
    pdir = vllm_tree / "vllm" / "distributed" / "eplb" / "policy"
    if not (pdir / "default.py").is_file():
        raise FileNotFoundError(f"{pdir}/default.py not found (pass --vllm-tree)")
    name = "_qwen3_rl_vllm_eplb_policy"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(pdir)]
        sys.modules[name] = pkg
    return importlib.import_module(f"{name}.default").DefaultEplbPolicy


def load_ascend_policy(ascend_tree: Path | None, module: str, cls: str, vllm_tree: Path | None) -> Any:
    """A vLLM-Ascend 0.13 policy class loaded by path from ``vllm_ascend/eplb/core/policy``."""
    if ascend_tree is None:
        raise FileNotFoundError("no vLLM-Ascend tree (see the hint above)")
    pdir = ascend_tree / "vllm_ascend" / "eplb" / "core" / "policy"
    if not (pdir / f"{module}.py").is_file():
        raise FileNotFoundError(f"{pdir}/{module}.py not found (pass --ascend-tree)")
    if module.endswith("_v2") and vllm_tree is not None and str(vllm_tree) not in sys.path:
        sys.path.insert(0, str(vllm_tree))  # policy_dynamic_ep_v2 imports vllm.logger
    name = "_qwen3_rl_ascend_eplb_policy"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(pdir)]
        sys.modules[name] = pkg
    return getattr(importlib.import_module(f"{name}.{module}"), cls)


def ascend_initial_table(num_experts: int, num_ranks: int, num_redundant: int) -> np.ndarray:
    """vLLM-Ascend's initial placement ``[R, S]`` (``eplb_utils.generate_global_placement``, re-derived)."""
    groups = [list(g) for g in np.array_split(np.arange(num_experts), num_ranks)]
    for i in range(num_redundant):
        j = i % num_ranks + 1
        groups[-j].append((groups[-j][-1] + 1) % num_experts if groups[-j] else j)
    return np.array(groups, dtype=np.int64)


def table_to_phy2log(table: np.ndarray) -> np.ndarray:
    """``[L, R, S]`` per-rank expert table -> ``[L, R*S]`` phy2log."""
    t = np.asarray(table, dtype=np.int64)
    return t.reshape(t.shape[0], -1)


def slot_workload(loads: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Per-slot token counts ``[L, R, S]`` for a table (each replica gets an equal share), int64."""
    L, R, S = table.shape
    flat = table.reshape(L, -1)
    cnt = np.zeros_like(loads, dtype=np.float64)
    np.add.at(cnt, (np.repeat(np.arange(L), R * S), flat.ravel()), 1.0)
    share = np.take_along_axis(loads, flat, 1) / np.take_along_axis(cnt, flat, 1)
    return np.rint(share).astype(np.int64).reshape(L, R, S)


# ------------------------------------------------------------------------------------------------ runner


def _slot_bound(w: np.ndarray, slots: int, iters: int = 60) -> float:
    """Smallest makespan ``T`` with ``sum_e ceil(w_e / T) <= slots``: every replica share is at most the
    busiest rank's load, so expert ``e`` needs ``>= w_e / T`` replicas (a lower bound on the makespan)."""
    if slots <= 0 or w.max() <= 0:
        return 0.0
    lo, hi = 0.0, float(w.max())
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mid > 0 and np.ceil(w / mid).sum() <= slots:
            hi = mid
        else:
            lo = mid
    return hi


def hierarchical_bound(loads: np.ndarray, num_groups: int, num_nodes: int, num_ranks: int,
                       num_replicas: int) -> np.ndarray:
    """Per-layer upper bound on the balancedness of any hierarchical placement, ``[L]``.

    Under vLLM's hierarchical contract every replica of a group's experts sits on the group's node, every
    node holds ``num_groups / num_nodes`` groups and ``num_replicas / num_nodes`` slots.  Lower bounds on the
    busiest rank's load ``T``: ``node load / ranks per node`` for the busiest node (at least
    ``max(heaviest group, total / num_nodes)``), and the slot bound (``_slot_bound``) over the node's experts
    when one group per node fixes them (else over all experts and slots).  Returns ``(total / num_ranks) / T``.
    """
    num_layers, num_experts = loads.shape
    group_size = num_experts // num_groups
    per_node = num_groups // num_nodes
    rpn = num_ranks // num_nodes
    out = np.ones(num_layers)
    for layer in range(num_layers):
        w = loads[layer].astype(np.float64)
        gw = w.reshape(num_groups, group_size).sum(-1)
        total = gw.sum()
        if total <= 0:
            continue
        t = max(gw.max(), total / num_nodes) / rpn
        if per_node == 1:
            for g in range(num_groups):
                t = max(t, _slot_bound(w[g * group_size:(g + 1) * group_size], num_replicas // num_nodes))
        else:
            t = max(t, _slot_bound(w, num_replicas))
        out[layer] = (total / num_ranks) / t
    return out


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def _entry(loads: np.ndarray, phy2log: np.ndarray, num_ranks: int, ms: float, prev: np.ndarray | None) -> dict:
    bal = eplb.balancedness(loads, phy2log, num_ranks)
    out: dict[str, Any] = {"balancedness": round(float(bal.mean()), 6), "min_layer": round(float(bal.min()), 6),
                           "ms": round(ms, 2)}
    if prev is not None and prev.shape == phy2log.shape:
        moved = eplb.moved_slots(prev, phy2log)
        out["moved_mean"] = round(float(moved.mean()), 2)
        out["moved_total"] = int(moved.sum())
    return out


def run_case(
    loads: np.ndarray,
    num_ranks: int,
    num_nodes: int,
    num_groups: int,
    redundant: int,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    prev_loads: np.ndarray | None = None,
    drift_sigma: float = 0.3,
    migration_weight: float = 0.002,
    vllm_tree: Path | None = None,
    ascend_tree: Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """All requested policies on one load matrix; returns the JSON-able result dict. ``vllm_tree`` /
    ``ascend_tree``: the pinned trees (see :func:`baseline_trees`); None: their policies report an error."""
    num_layers, num_experts = loads.shape
    num_phy = num_experts + redundant
    if num_phy % num_ranks:
        raise ValueError(f"experts + redundant = {num_phy} is not a multiple of --num-ranks {num_ranks}")
    w = torch.from_numpy(np.ascontiguousarray(loads, dtype=np.float64))
    res: dict[str, Any] = {}
    # warm the numba kernels (compile or load cache) outside the timings
    _, compile_ms = _timed(lambda: eplb.rebalance_experts_migration_aware(
        torch.rand(1, 8, dtype=torch.float64), 16, 1, 1, 4, torch.arange(16).remainder(8).view(1, 16)))
    res["meta"] = {"layers": num_layers, "experts": num_experts, "num_ranks": num_ranks, "num_nodes": num_nodes,
                   "num_groups": num_groups, "redundant": redundant, "compile_ms": round(compile_ms, 1),
                   "migration_weight": migration_weight}
    prev = None
    if "ours_migration" in policies:
        pl = prev_loads if prev_loads is not None else drift(loads, drift_sigma, seed + 1)
        prev = eplb.rebalance_experts(torch.from_numpy(pl.astype(np.float64)), num_phy, 1, num_nodes,
                                      num_ranks)[0].numpy()
        prev_bal = eplb.balancedness(loads, prev, num_ranks)
        res["previous_placement"] = {"balancedness": round(float(prev_bal.mean()), 6),
                                     "source": "--prev-loads" if prev_loads is not None else f"drift {drift_sigma}"}
    hier = eplb._hierarchical(num_experts, num_groups, num_nodes)
    if hier:
        # vLLM's hierarchical contract: every replica of an expert stays on its group's node.  No placement
        # honouring it beats this bound.  Ours places globally (one group, what the type-4 vLLM-Ascend policy
        # computes on NPU), like vLLM-Ascend's policies, which never see groups/nodes.
        res["meta"]["constraint"] = "hierarchical: a group's replicas stay on its node (vllm_default)"
        res["hierarchical_bound"] = {"balancedness": round(float(hierarchical_bound(loads, num_groups, num_nodes,
                                                                                    num_ranks, num_phy).mean()), 6)}
    for name in policies:
        try:
            if name == "identity":
                if num_experts % num_ranks:
                    res[name] = {"error": f"{num_experts} experts not divisible by {num_ranks} ranks"}
                    continue
                p = eplb.identity_placement(num_layers, num_experts).numpy()
                res[name] = _entry(loads, p, num_ranks, 0.0, None)
            elif name == "vllm_default":
                pol = load_vllm_default(vllm_tree)
                out, ms = _timed(lambda pol=pol: pol.rebalance_experts(w.clone(), num_phy, num_groups, num_nodes,
                                                                       num_ranks))
                res[name] = _entry(loads, out[0].numpy(), num_ranks, ms, prev)
            elif name == "ours":  # one group: a global placement (ours has no hierarchical mode)
                out, ms = _timed(lambda: eplb.rebalance_experts(w, num_phy, 1, num_nodes, num_ranks))
                res[name] = _entry(loads, out[0].numpy(), num_ranks, ms, prev)
            elif name == "ours_migration":
                assert prev is not None
                out, ms = _timed(lambda: eplb.rebalance_experts_migration_aware(
                    w, num_phy, 1, num_nodes, num_ranks, torch.from_numpy(prev), migration_weight))
                res[name] = _entry(loads, out[0].numpy(), num_ranks, ms, prev)
            elif name.startswith("ascend_"):
                module, cls = {
                    "ascend_dynamic_ep": ("policy_dynamic_ep", "DynamicEplb"),
                    "ascend_dynamic_ep_v2": ("policy_dynamic_ep_v2", "DynamicEplbV2"),
                    "ascend_flashlb": ("policy_flashlb", "FlashLB"),
                }[name]
                klass = load_ascend_policy(ascend_tree, module, cls, vllm_tree)
                cfg_mod = sys.modules[klass.__module__]
                policy = klass(cfg_mod.DynamicConfig())
                table0 = np.broadcast_to(ascend_initial_table(num_experts, num_ranks, redundant),
                                         (num_layers, num_ranks, num_phy // num_ranks)).copy()
                work = slot_workload(loads, table0)
                if name == "ascend_flashlb":
                    policy.rebalance_experts(table0[:1].copy(), work[:1].copy())  # numba warm-up
                    policy = klass(cfg_mod.DynamicConfig())
                if name == "ascend_dynamic_ep_v2":
                    args = (torch.from_numpy(table0.copy()), torch.from_numpy(work.copy()))
                else:
                    args = (table0.copy(), work.copy())
                out, ms = _timed(lambda policy=policy, args=args: policy.rebalance_experts(*args))
                new = table_to_phy2log(np.asarray(out[2]))
                res[name] = _entry(loads, new, num_ranks, ms, None)
                res[name]["moved_vs_initial"] = int((new != table_to_phy2log(table0)).sum())
                if hier:
                    res[name]["constraint"] = "global (vLLM-Ascend policies ignore num_groups / num_nodes)"
            else:
                raise ValueError(f"unknown policy {name!r}; choose from {', '.join(ALL_POLICIES)}")
        except (FileNotFoundError, ImportError) as exc:
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
    if hier:
        for name in ("ours", "ours_migration"):
            if name in res and "error" not in res[name]:
                res[name]["constraint"] = "global (no hierarchical mode; as the vLLM-Ascend policies)"
    return res


SUITE = (
    # (label, loads kind, zipf, ranks, nodes, groups, redundant)
    ("zipf1.0_R32_X0", "zipf", 1.0, 32, 2, 1, 0),
    ("zipf1.0_R32_X32", "zipf", 1.0, 32, 2, 1, 32),
    ("zipf1.0_R128_X128", "zipf", 1.0, 128, 8, 1, 128),
    ("zipf0.5_R32_X32", "zipf", 0.5, 32, 2, 1, 32),
    ("zipf0.5_R128_X128", "zipf", 0.5, 128, 8, 1, 128),
    ("hot16_R128_X128", "hot", 0.0, 128, 8, 1, 128),
    ("zipf1.0_R128_X128_groups8_hier", "zipf", 1.0, 128, 8, 8, 128),
)


def baseline_trees(policies: tuple[str, ...], vllm_tree: str | None, ascend_tree: str | None,
                   ) -> tuple[Path | None, Path | None]:
    """The vLLM and vLLM-Ascend trees the requested upstream policies need (the workspace's by default, made
    from the pinned wheels when missing); a tree that cannot be had is None, with a one-line hint on stderr."""
    def get(key: str, explicit: str | None) -> Path | None:
        try:
            return upstream_tree(key, explicit)
        except UpstreamTreeError as exc:
            print(f"hint: {exc}", file=sys.stderr)
            return None

    # vLLM-Ascend's v2 policy imports vllm.logger, so it needs the vLLM tree too
    need_vllm = any(p in ("vllm_default", "ascend_dynamic_ep_v2") for p in policies)
    need_ascend = any(p.startswith("ascend_") for p in policies)
    return (get("vllm", vllm_tree) if need_vllm else None, get("vllm_ascend", ascend_tree) if need_ascend else None)


def run_suite(policies: tuple[str, ...], args: argparse.Namespace, vllm_tree: Path | None = None,
              ascend_tree: Path | None = None) -> dict[str, Any]:
    out = {}
    for label, kind, zipf, ranks, nodes, groups, red in SUITE:
        loads = synthetic_loads(zipf=zipf, seed=args.seed) if kind == "zipf" else hot_loads()
        pol = policies
        if "identity" in pol and red:
            pol = tuple(p for p in pol if p != "identity")
        out[label] = run_case(loads, ranks, nodes, groups, red, pol, None, args.drift, args.migration_weight,
                              vllm_tree, ascend_tree, args.seed)
        out[label]["meta"]["loads"] = f"{kind} zipf={zipf}" if kind == "zipf" else "hot16"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl.tools.bench.eplb", description=__doc__.splitlines()[0])
    ap.add_argument("--loads", help="CSV: one row per layer, one column per logical expert (token counts)")
    ap.add_argument("--prev-loads", help="CSV of the previous window (previous placement = ours on it)")
    ap.add_argument("--num-ranks", type=int)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--num-groups", type=int, default=1)
    ap.add_argument("--redundant", type=int, default=0)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=f"subset of {','.join(ALL_POLICIES)}")
    ap.add_argument("--migration-weight", type=float, default=0.002)
    ap.add_argument("--drift", type=float, default=0.3, help="log-normal sigma of the previous window's noise")
    ap.add_argument("--vllm-tree", help="vLLM source tree (default: the workspace's, fetched if missing)")
    ap.add_argument("--ascend-tree", help="vLLM-Ascend source tree (default: the workspace's, fetched if missing)")
    ap.add_argument("--suite", action="store_true", help="run the standard Qwen3-235B cases on synthetic loads")
    ap.add_argument("--write-synthetic", metavar="OUT.csv", help="write Zipf-like synthetic loads and exit")
    ap.add_argument("--layers", type=int, default=94)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per layer window (x topk selections)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    bad = [p for p in policies if p not in ALL_POLICIES]
    if bad:
        ap.error(f"unknown policies {bad}; choose from {','.join(ALL_POLICIES)}")
    if args.write_synthetic:
        write_csv(args.write_synthetic, synthetic_loads(args.layers, args.experts, args.zipf, args.tokens,
                                                        args.topk, args.seed))
        print(args.write_synthetic)
        return 0
    if args.suite:
        result = run_suite(policies, args, *baseline_trees(policies, args.vllm_tree, args.ascend_tree))
    else:
        if not args.loads or not args.num_ranks:
            ap.error("--loads and --num-ranks are required (or --suite / --write-synthetic)")
        loads = read_csv(args.loads)
        prev_loads = read_csv(args.prev_loads) if args.prev_loads else None
        vllm_tree, ascend_tree = baseline_trees(policies, args.vllm_tree, args.ascend_tree)
        result = run_case(loads, args.num_ranks, args.num_nodes, args.num_groups, args.redundant, policies,
                          prev_loads, args.drift, args.migration_weight, vllm_tree, ascend_tree, args.seed)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        cases = result if args.suite else {"case": result}
        for label, case in cases.items():
            print(f"== {label}: {case['meta']}")
            for name, v in case.items():
                if name != "meta":
                    print(f"  {name:22s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
