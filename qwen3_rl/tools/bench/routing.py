"""Server-mode routing replayed on a cluster layout: verl's least-assigned routing against the recipe's group
routing (:class:`qwen3_rl.rollout.server_routing.GroupRouter`), on the same requests.

``python -m qwen3_rl.tools.bench.routing --layout 32b [--json]`` (or ``--servers S --dp D ...``): a dataset of
``--dataset-prompts`` prompts (reference-like lengths, ``qwen3_rl.tools.sim.lengths.generate_lengths``) is read in
a fresh seeded order each epoch, ``--prompts`` prompts x ``n`` samples per step. As verl's agent loop does, each
step's batch is cut into ``--agent-workers`` contiguous pieces, each with its own router (its own
``AsyncLLMServerManager``, no shared state), and every request of a step is sent before any finishes. Reported
per policy, over the steps:

* ``sibling_same_engine``: share of sibling pairs (two samples of one prompt in a step) on one engine;
* ``load_spread_tokens``: max / mean response tokens per engine in a step (mean over steps; verl's per server:
  vLLM's own DP balancer inside a server is not replayed, so verl's figure is its best case there);
* ``history_any`` / ``history_share``: for a prompt's visit in a later epoch, the share of its requests whose
  engine served the prompt before (the SAM history on that engine has its earlier responses), and the mean share
  of the prompt's earlier responses that sit on the request's engine.

Lengths are drawn, not measured (docs/rollout_balancing.md); no timing is modelled, only placement.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from qwen3_rl.rollout.server_routing import GroupRouter, routing_metrics

#: cluster layouts in server mode (ROLLOUT_MODE=async): servers x vLLM DP ranks each, prompts x n per step
LAYOUTS = {
    "32b": {"servers": 4, "dp": 1, "prompts": 128, "n": 16},  # Qwen3-32B GRPO, 32 dies, TP8 engines
    "30b_a3b": {"servers": 1, "dp": 16, "prompts": 128, "n": 16},  # Qwen3-30B-A3B GRPO, 32 dies, TP2 x DP16
    "235b": {"servers": 1, "dp": 32, "prompts": 512, "n": 16},  # Qwen3-235B GRPO, 128 dies, TP4 x DP32
}


@dataclass(frozen=True)
class Result:
    """One policy's figures over the replay (see the module docstring)."""

    sibling_same_engine: float
    load_spread_tokens: float
    load_spread_tokens_max: float
    history_any: float
    history_share: float


def replay(servers: int, dp: int, prompts: int, n: int, agent_workers: int, dataset_prompts: int, epochs: int,
           slack: int, seed: int = 0) -> dict[str, Result]:
    """Replay ``epochs`` epochs; returns ``{"verl": Result, "group": Result}``."""
    from qwen3_rl.tools.sim.lengths import generate_lengths

    if dataset_prompts % prompts:
        raise ValueError(f"--dataset-prompts {dataset_prompts} must be a multiple of --prompts {prompts}")
    if (prompts * n) % agent_workers:
        raise ValueError(f"prompts x n = {prompts * n} must split evenly over {agent_workers} agent-loop workers")
    lengths = generate_lengths(dataset_prompts, n, seed=seed).response_len.reshape(dataset_prompts, n)
    ids = np.random.default_rng(seed + 1).integers(1, 150_000, size=(dataset_prompts, 8))
    routers = [GroupRouter(servers, dp=dp, slack=slack) for _ in range(agent_workers)]
    # policy -> prompt -> responses per engine (the previous epoch's visit)
    held: dict[str, dict[int, dict[int, int]]] = {"verl": {}, "group": {}}
    stats: dict[str, dict[str, list[float]]] = {p: defaultdict(list) for p in held}
    rng = np.random.default_rng(seed + 2)
    for _epoch in range(epochs):
        order = rng.permutation(dataset_prompts)
        for start in range(0, dataset_prompts, prompts):
            batch = [(int(p), s) for p in order[start:start + prompts] for s in range(n)]
            piece = len(batch) // agent_workers
            now: dict[str, dict[int, dict[int, int]]] = {"verl": defaultdict(dict), "group": defaultdict(dict)}
            counts: dict[str, int] = {}
            for w, router in enumerate(routers):
                mine = batch[w * piece:(w + 1) * piece]
                placed = []
                for p, s in mine:
                    rid = f"{_epoch}-{p}-{s}"
                    target = router.choose(rid, ids[p].tolist())
                    placed.append((rid, p, s, target, router.verl_engine(rid)))
                for rid, p, s, target, verl in placed:
                    router.done(rid, int(lengths[p, s]))
                    for pol, eng in (("group", target), ("verl", verl)):
                        prev = held[pol].get(p)
                        if prev is not None:
                            stats[pol]["history_any"].append(float(prev.get(eng, 0) > 0))
                            stats[pol]["history_share"].append(prev.get(eng, 0) / sum(prev.values()))
                        now[pol][p][eng] = now[pol][p].get(eng, 0) + 1
                for k, v in router.take_counts().items():
                    counts[k] = counts.get(k, 0) + v
            m = routing_metrics(counts)
            stats["group"]["sibling_same_engine"].append(m["rollout/routing/sibling_same_engine"])
            stats["verl"]["sibling_same_engine"].append(m["rollout/routing/verl_sibling_same_engine"])
            stats["group"]["load_spread_tokens"].append(m["rollout/routing/load_spread_tokens"])
            stats["verl"]["load_spread_tokens"].append(m["rollout/routing/verl_load_spread_tokens"])
            for pol in held:
                held[pol].update(now[pol])
    return {pol: Result(float(np.mean(s["sibling_same_engine"])), float(np.mean(s["load_spread_tokens"])),
                        float(np.max(s["load_spread_tokens"])), float(np.mean(s["history_any"] or [0.0])),
                        float(np.mean(s["history_share"] or [0.0]))) for pol, s in stats.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl.tools.bench.routing", description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), help="a cluster layout's servers, DP and batch")
    ap.add_argument("--servers", type=int)
    ap.add_argument("--dp", type=int, help="vLLM DP ranks per server")
    ap.add_argument("--prompts", type=int, help="prompts per step")
    ap.add_argument("--n", type=int, help="samples per prompt")
    ap.add_argument("--agent-workers", type=int, default=8, help="verl's rollout.agent.num_workers (default 8)")
    ap.add_argument("--dataset-prompts", type=int, help="prompts in the dataset (default 4 steps' worth)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--slack", type=int, default=0, help="server_routing.slack (requests; default 0 as the seam's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    base = dict(LAYOUTS[a.layout]) if a.layout else {}
    for k in ("servers", "dp", "prompts", "n"):
        if getattr(a, k) is not None:
            base[k] = getattr(a, k)
    missing = [k for k in ("servers", "dp", "prompts", "n") if k not in base]
    if missing:
        print(f"error: give --layout or --{' --'.join(missing)}", file=sys.stderr)
        return 2
    dataset = a.dataset_prompts or 4 * base["prompts"]
    try:
        res = replay(base["servers"], base["dp"], base["prompts"], base["n"], a.agent_workers, dataset, a.epochs,
                     a.slack, a.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = {"layout": {**base, "agent_workers": a.agent_workers, "dataset_prompts": dataset, "epochs": a.epochs,
                      "slack": a.slack}, **{pol: r.__dict__ for pol, r in res.items()}}
    if a.json:
        print(json.dumps(doc, indent=1))
        return 0
    lay = doc["layout"]
    print(f"{lay['servers']} server(s) x DP {lay['dp']}, {lay['prompts']} prompts x {lay['n']}, "
          f"{lay['agent_workers']} agent-loop workers, {dataset} prompts x {a.epochs} epochs, slack {a.slack}")
    print(f"{'policy':8} {'siblings on one engine':>23} {'token spread mean/max':>22} {'history: any / share':>21}")
    for pol, r in res.items():
        print(f"{pol:8} {r.sibling_same_engine:23.3f} {r.load_spread_tokens:>13.3f} / {r.load_spread_tokens_max:.3f} "
              f"{r.history_any:>12.3f} / {r.history_share:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
