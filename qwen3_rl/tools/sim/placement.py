"""Data rebalance's two placements replayed over epochs: the load imbalance each gives and the SAM history coverage.

``python -m qwen3_rl simulate placement --lengths F --dp D [--steps-per-epoch S --epochs E --seed N]``

The dataset is ``S`` copies of the file's batch (``P`` prompts of ``n`` samples, each copy its own prompts with their
own random 64-bit group keys and the file's lengths); every epoch shuffles it and cuts it into ``S`` steps of ``P``
prompts. Each step is placed over ``D`` ranks three ways: verl's contiguous chunks, data rebalance by batch position
(``rebalance_permutation``: row i on rank i mod D) and by group key (``keyed_rank_of_rows``). Per step and placement:

* load imbalance: the largest rank's decode tokens (sum of its rows' response lengths) over the mean rank's;
* history coverage (from the second epoch on): the share of a prompt's samples that run on a rank that ran one of
  the prompt's samples at its previous visit (where its SAM history is, with the sibling exchange: all of it);
* home share (by key): rows on their home rank.

``--lengths`` takes a lengths file (``simulate gen-lengths``) or a rollouts file with ``response_ids``
(``../shared/bench/rollouts_dev.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from qwen3_rl.rollout.data_rebalance import contiguous_rank_of_rows, keyed_rank_of_rows, rank_of_rows
from qwen3_rl.tools.sim.lengths import Lengths, LengthsError, load_lengths

PLACEMENTS = ("contiguous", "position", "key")


def load_any(path: str | Path) -> Lengths:
    """A lengths file, or a rollouts file (``prompt_id``, ``sample_id``, ``prompt_ids``, ``response_ids``) read as
    one (rows ordered by prompt then sample; every prompt must have the same number of samples)."""
    p = Path(path)
    if not p.is_file():
        raise LengthsError(f"lengths file not found: {p}")
    with open(p, encoding="utf-8") as f:
        first = json.loads(f.readline())
    if "response_len" in first:
        return load_lengths(p)
    recs = sorted((json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()),
                  key=lambda d: (d["prompt_id"], d["sample_id"]))
    per: dict[int, int] = {}
    for d in recs:
        per[d["prompt_id"]] = per.get(d["prompt_id"], 0) + 1
    ns = set(per.values())
    if len(ns) != 1:
        raise LengthsError(f"{p}: prompts have different sample counts {sorted(ns)}")
    n = ns.pop()
    return Lengths(len(per), n, np.asarray([len(d["prompt_ids"]) for d in recs], np.int64),
                   np.asarray([max(1, len(d["response_ids"])) for d in recs], np.int64))


def replay(lengths: Lengths, dp: int, steps_per_epoch: int = 4, epochs: int = 3, seed: int = 0) -> dict:
    """The placements over ``epochs`` epochs of ``steps_per_epoch`` steps (module docstring). Returns, per placement,
    ``imbalance`` (mean and max over steps of max rank load / mean rank load), ``coverage`` (mean over the visits
    after the first epoch) and, for "key", ``home`` (share of rows on their home rank)."""
    p, n = lengths.num_prompts, lengths.n
    if (p * n) % dp:
        raise LengthsError(f"a step of {p} x {n} rows is not a multiple of --dp {dp}")
    rng = np.random.default_rng(seed)
    total = p * steps_per_epoch
    keys = rng.integers(0, np.iinfo(np.int64).max, total, dtype=np.int64).astype(np.uint64)
    resp = np.tile(lengths.response_len.reshape(p, n), (steps_per_epoch, 1))  # [total, n]
    last: dict[str, list[set[int] | None]] = {pl: [None] * total for pl in PLACEMENTS}
    imb: dict[str, list[float]] = {pl: [] for pl in PLACEMENTS}
    cov: dict[str, list[float]] = {pl: [] for pl in PLACEMENTS}
    home: list[float] = []
    for _ in range(epochs):
        order = rng.permutation(total)
        for s in range(steps_per_epoch):
            ids = order[s * p:(s + 1) * p]
            tokens = resp[ids].reshape(-1)
            ranks = {"contiguous": contiguous_rank_of_rows(p * n, dp), "position": rank_of_rows(p * n, dp)}
            ranks["key"], at_home = keyed_rank_of_rows(keys[ids], n, dp)
            home.append(float(at_home.mean()))
            for pl, r in ranks.items():
                load = np.bincount(r, weights=tokens, minlength=dp)
                imb[pl].append(float(load.max() / load.mean()))
                rr = r.reshape(p, n)
                for j, q in enumerate(ids):
                    prev = last[pl][q]
                    if prev is not None:
                        cov[pl].append(float(np.mean([x in prev for x in rr[j].tolist()])))
                    last[pl][q] = set(rr[j].tolist())
    out = {pl: {"imbalance_mean": float(np.mean(imb[pl])), "imbalance_max": float(np.max(imb[pl])),
                "coverage": float(np.mean(cov[pl])) if cov[pl] else None} for pl in PLACEMENTS}
    out["key"]["home"] = float(np.mean(home))
    return {"dp": dp, "prompts_per_step": p, "n": n, "steps_per_epoch": steps_per_epoch, "epochs": epochs,
            "seed": seed, "placements": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl simulate placement", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", required=True, help="lengths file (simulate gen-lengths) or rollouts file")
    ap.add_argument("--dp", type=int, required=True, help="rollout DP ranks")
    ap.add_argument("--steps-per-epoch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    try:
        if a.dp < 1 or a.steps_per_epoch < 1 or a.epochs < 2:
            raise LengthsError("--dp >= 1, --steps-per-epoch >= 1 and --epochs >= 2 are required")
        res = replay(load_any(a.lengths), a.dp, a.steps_per_epoch, a.epochs, a.seed)
    except LengthsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{res['prompts_per_step']} prompts x {res['n']} samples per step over {res['dp']} ranks, "
          f"{res['steps_per_epoch']} steps per epoch, {res['epochs']} epochs")
    print("placement   imbalance mean / max   history coverage")
    for pl, r in res["placements"].items():
        extra = f"  (rows on their home rank {r['home']:.3f})" if "home" in r else ""
        print(f"{pl:<11} {r['imbalance_mean']:.4f} / {r['imbalance_max']:.4f}      {r['coverage']:.3f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
