"""``qwen3_rl.tools.bench.hdp_mcore``: ours against megatron-core 0.16.1's hybrid context parallel.

The probes run in the current set's training venv (``tests/setup_verl091_env.sh``: megatron-core 0.16.1 and verl 0.9.1
installed, reached as ``tests/patches/test_patches_verl091.py`` reaches verl 0.9.1, ``helpers.current_verl``); a
missing venv fails. Upstream's ``BalancedCPScheduler`` and verl's partitioners are the installed ones, called for real.
No ratio between the packers is asserted: the bench prints them.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from qwen3_rl.parallel import hdp
from qwen3_rl.tools.bench.hdp_mcore import Packing, check_ours, check_upstream

from conftest import REPO
from helpers.current_verl import run_in_venv

# A small reference-like step (12 prompts x 4 samples) on DP 2 x CP 4, budget 9216 (CP sizes 1-4 all used).
PROBE = textwrap.dedent("""
    import json
    from qwen3_rl.parallel import hdp
    from qwen3_rl.tools.bench import hdp_mcore as b

    sched, version = b.load_upstream()
    verl = b.load_verl()
    cm = hdp.CostModel()
    lens = b.batch_lengths(3, prompts=12, n=4)
    split = b.dp_split(lens, 2, verl)
    up = b.pack_upstream(lens, 8, 9216, cm, sched)
    ours = b.pack_ours(lens, split, 4, 9216, cm)
    verl_cp = b.pack_verl_cp(lens, split, 4, 9216, cm, verl)
    out = {"version": version, "verl": verl.version, "lens": lens, "split": split,
           "groups": up.extra["groups"], "tokens": {
               "upstream": b.check_upstream(lens, up, 9216), "ours": b.check_ours(lens, split, ours, 9216),
               "verl CP": b.check_verl_cp(lens, verl_cp, 4, 9216)},
           "ours_rank_tokens": [a.rank_tokens for a in ours.extra["assignments"]],
           "ours_sizes": sorted({p.block_size for a in ours.extra["assignments"] for p in a.placements}),
           "up_passes": up.passes, "up_barriers": up.barriers}
    print("JSON" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def probe() -> dict:
    proc = run_in_venv(["-W", "ignore", "-c", PROBE], [REPO], timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("JSON"))
    return json.loads(line[4:])


def test_both_packers_place_every_sequence_once_within_budget(probe: dict) -> None:
    """Upstream's real schedule and ours on the same 48 sequences: each placed exactly once, no rank over the
    budget in a pass, the same token total (the batch's) for both; checked again here from the raw schedules."""
    assert probe["version"] == "0.16.1" and probe["verl"] == "0.9.1"
    lens, total = probe["lens"], sum(probe["lens"])
    assert len(lens) == 48
    assert probe["tokens"] == {"upstream": total, "ours": total, "verl CP": total}
    seen = []
    for group in probe["groups"]:
        assert len(group) == 8
        holders: dict[int, int] = {}
        for ids in group:
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        assert all(-(-lens[i] // k) <= 9216 for i, k in holders.items())
        seen += list(holders)
    assert sorted(seen) == list(range(48))
    assert sorted(i for part in probe["split"] for i in part) == list(range(48))
    assert all(t <= 9216 for rows in probe["ours_rank_tokens"] for row in rows for t in row)
    # the sample makes both use more than one CP size (sequences over 9216 tokens exist)
    assert max(lens) > 9216 and probe["ours_sizes"][0] == 1 and probe["ours_sizes"][-1] > 1
    assert len({sum(i in ids for ids in g) for g in probe["groups"] for ids in g for i in ids}) > 1


def test_checks_catch_a_broken_schedule(probe: dict) -> None:
    """Positive control: the invariant checks fail on a schedule with a sample dropped, repeated or over budget."""
    lens, groups = probe["lens"], probe["groups"]

    def up(gs: list) -> Packing:
        return Packing("upstream", [], [], [], 0.0, {"groups": gs})

    assert check_upstream(lens, up(groups), 9216) == sum(lens)
    dropped = [[[i for i in ids if i != 0] for ids in g] for g in groups]
    with pytest.raises(AssertionError, match="left out or repeated"):
        check_upstream(lens, up(dropped), 9216)
    repeated = [g for g in groups] + [[[0]] + [[] for _ in range(7)]]
    with pytest.raises(AssertionError):
        check_upstream(lens, up(repeated), 9216)
    longest = max(range(len(lens)), key=lens.__getitem__)
    alone = [[[i for i in ids if i != longest] for ids in g] for g in groups] + [
        [[longest]] + [[] for _ in range(7)]
    ]
    with pytest.raises(AssertionError, match="on 1 ranks"):
        check_upstream(lens, up(alone), 9216)

    split = probe["split"]
    assigns = [hdp.assign_hdp([lens[i] for i in ids], 4, 9216) for ids in split]
    ours = Packing("ours", [], [], [], 0.0, {"assignments": assigns})
    assert check_ours(lens, split, ours, 9216) == sum(lens)
    with pytest.raises(AssertionError, match="left out or repeated"):
        check_ours(lens, [split[0], split[1][:-1] + [split[0][0]]], ours, 9216)
    with pytest.raises(AssertionError, match="over the budget"):
        check_ours(lens, split, ours, max(lens) // 8)


def test_upstream_lockstep_and_barrier_costs(probe: dict) -> None:
    """The step models on upstream's real schedule: lockstep = sum over passes of the slowest rank, free = sum over
    groups of the busiest rank's group total; a missing pass costs 0."""
    p = Packing("upstream", probe["up_passes"], probe["up_barriers"], [], 0.0)
    start, free, lock = 0, 0.0, 0.0
    for end in probe["up_barriers"]:
        rows = probe["up_passes"][start:end]
        free += max(sum(r[k] for r in rows) for k in range(8))
        lock += sum(max(r) for r in rows)
        start = end
    assert p.free() == pytest.approx(free) and p.lockstep() == pytest.approx(lock)
    assert p.lockstep() >= p.free() > 0


def test_cli_table_has_the_rows_it_claims() -> None:
    """The command prints one row per (budget, packer) for the budgets asked (verl CP only with ``--verl-cp``),
    and its JSON the same rows."""
    argv = [
        "-W",
        "ignore",
        "-m",
        "qwen3_rl.tools.bench.hdp_mcore",
        "--seeds",
        "0,1",
        "--budgets",
        "34816,9216",
        "--prompts",
        "8",
        "--n",
        "4",
        "--verl-cp",
    ]
    proc = run_in_venv(argv, [REPO], timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [x for x in proc.stdout.splitlines() if x.startswith("| 34816 |") or x.startswith("| 9216 |")]
    assert [tuple(c.strip() for c in r.split("|")[1:3]) for r in rows] == [
        (b, p) for b in ("34816", "9216") for p in ("verl CP", "ours", "upstream")
    ]
    assert all(len(r.split("|")) == 11 for r in rows)
    assert "megatron-core 0.16.1, verl 0.9.1; DP 2 x CP 4, 32 sequences per step, seeds 0,1" in proc.stdout
    js = run_in_venv([*argv[:-1], "--json"], [REPO], timeout=600, cwd=REPO)  # without --verl-cp
    assert js.returncode == 0, js.stderr[-3000:]
    res = json.loads(js.stdout)
    assert [(r["budget"], r["packer"]) for r in res["rows"]] == [
        (b, p) for b in (34816, 9216) for p in ("ours", "upstream")
    ]
    for r in res["rows"]:
        for key in ("balance", "lockstep", "free", "step_s", "passes", "plan_ms"):
            assert r[key]["min"] <= r[key]["mean"] <= r[key]["max"]
    # the seconds' anchor: the reference's update_actor time ([ref 002 §1.3])
    assert res["meta"]["step_s_anchor"]["seconds"] == pytest.approx(797.93)
    assert res["meta"]["step_s_anchor"]["all_cp_units"] > 0
