"""The fully-async weight sync on a MoE server with vLLM DP 2 x EP 2 (marker ``fully_async``), on vLLM 0.13.0's
real CPU engine in verl's server layout (``async_sync_driver.py``): two DP engine cores, each driving its rollout
worker (our ``WeightReceivingRollout``, a process of its own) through verl's ZeroMQ executor; the tiny Qwen3-MoE
with expert parallel (shims.py EP_DISPATCH_COMBINE, MOE_EXPERT_MAP); the fully-async server's pause (abort) and
resume (``PartialServerMixin``) on the ``AsyncLLM``; the trainer's broadcast over the stateless gloo group.

Two syncs with partial rollout, checked:

* the run finishes: both syncs end within the bound, every request aborted at a sync is resumed under the new
  version and reaches its full length;
* each worker's checksums of every tensor equal the trainer's, and after the last sync the workers' parameters
  are the last version's exactly (and not the initial ones);
* no model step of any worker, real or dummy, runs between the pause's return and the end of the sync: the pause
  waits until the DP engine cores have stopped stepping. Control: the same run with the pause not waiting for
  them sees the cores' dummy steps (MoE forwards with the expert-parallel collectives) inside that window,
  while a worker's event loop is held by the weight receive (the condition of the hang on HCCL, where a
  broadcast waits for every rank).

The sync and pause times are printed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_core_loop import core_env

from conftest import run_engine

pytestmark = pytest.mark.fully_async

MAX_LEN = 64
PROMPTS = [[(13 * i + k) % 300 + 10 for k in range(6)] for i in range(8)]
SYNCS = 2
SYNC_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def dp_sync_runs(engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    runs = {}
    for name, extra in (("fixed", {}), ("control", {"no_idle_wait": True})):
        tmp = tmp_path_factory.mktemp(f"dp-sync-{name}")
        spec = {"workspace": str(engine_ws), "model": str(tiny_models["moe"]), "prompts": PROMPTS,
                "probe_dir": str(tmp), "dp": 2, "syncs": SYNCS, "max_model_len": MAX_LEN, "steps_before_sync": 12,
                "sync_timeout_s": SYNC_TIMEOUT_S, **extra}
        runs[name] = run_engine(spec, tmp, env=core_env(engine_ws), driver="async_sync_driver.py")
    return runs


def steps_in_sync_windows(run: dict) -> list[dict]:
    """The workers' model steps (real or dummy) that ran, at least in part, between a pause's return and the end
    of that sync (or its timeout)."""
    out = []
    for s in run["syncs"]:
        end = s.get("synced_at", s["paused_at"] + s["weight_sync_s"])
        out += [st for st in run["steps"] if st["t1"] > s["paused_at"] and st["t0"] < end]
    return out


def test_dp2_ep2_weight_sync_with_partial_rollout(dp_sync_runs: dict) -> None:
    run = dp_sync_runs["fixed"]
    syncs = run["syncs"]
    print("DP 2 x EP 2 syncs: " + "; ".join(
        f"v{s['version']}: pause {s['pause_s']:.3f} s ({s['aborted']} aborted), weight sync {s['weight_sync_s']:.3f}"
        f" s, resume {s.get('resume_s', 0):.3f} s" for s in syncs) + f"; driver run {run['seconds']:.0f} s")
    assert [s["version"] for s in syncs] == list(range(1, SYNCS + 1)) and not any(s["timed_out"] for s in syncs)
    assert sum(s["aborted"] for s in syncs) > 0, syncs
    for s in syncs:
        assert all(got == s["sent"] for got in s["received"]) and len(s["received"]) == 2, s["version"]
    for prompt, sample in zip(PROMPTS, run["samples"], strict=True):
        assert len(sample["tokens"]) == MAX_LEN - len(prompt), sample["segments"]
    resumed = [smp["segments"] for smp in run["samples"] if any(seg[2] for seg in smp["segments"])]
    assert resumed and all(seg[-1][2] is False and seg[-1][0] > seg[0][0] for seg in resumed), resumed
    assert len(run["expected_digest"]) == 3 and run["digests"] == [run["expected_digest"]] * 2
    assert all(run["expected_digest"][n] != run["initial_digest"][n] for n in run["expected_digest"])
    assert {st["kind"] for st in run["steps"]} >= {"model"} and {st["dp_rank"] for st in run["steps"]} == {0, 1}
    inside = steps_in_sync_windows(run)
    assert not inside, f"model steps ran while the weights were being synced: {inside[:5]}"


def test_control_pause_without_the_wait_lets_dummy_steps_into_the_sync(dp_sync_runs: dict) -> None:
    run = dp_sync_runs["control"]
    inside = steps_in_sync_windows(run)
    kinds = sorted({st["kind"] for st in inside})
    print(f"control (no wait for the DP engine cores): {len(inside)} worker steps inside the sync windows {kinds}; "
          f"syncs {[(s['version'], round(s['weight_sync_s'], 3), s['timed_out']) for s in run['syncs']]}")
    assert inside and "dummy" in kinds, run["syncs"]
