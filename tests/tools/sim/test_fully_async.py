"""The fully-async trainer model (``qwen3_rl.tools.sim.fully_async``) on hand-checkable cases, its published
trainer seconds, the KV bound against the memory plan, and ``simulate rollout --trainer fully-async``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from qwen3_rl.tools.plan import RolloutLayout, load_model_config, plan_rollout
from qwen3_rl.tools.sim.fully_async import (
    AsyncConfig,
    TrainCost,
    kv_tokens_per_rank,
    simulate_fully_async,
)
from qwen3_rl.tools.sim.lengths import Lengths
from qwen3_rl.tools.sim.simulate import SimConfig, SimError, StepModel, main, simulate

REPO = Path(__file__).resolve().parents[3]
P, N = 8, 4  # 8 prompts x 4 samples = 32 samples
EQUAL = Lengths(P, N, np.full(P * N, 8, dtype=np.int64), np.full(P * N, 64, dtype=np.int64))  # no tail
NO_PREFILL = StepModel(per_prefill_ktok_ms=0.0)


def _cfg(**kw: object) -> AsyncConfig:
    """8 rollout dies (2 ranks x 8 slots = 16 samples at once) and 8 train dies, no KV bound, free weight sync."""
    base = dict(rollout_dies=8, train_dies=8, max_num_seqs=8, staleness=0.0, weight_sync_s=0.0, kv_tokens=0,
                mini_batch_prompts=P, require_batches=1, trigger_sync_steps=1)  # one update per batch
    return AsyncConfig(**{**base, **kw})  # type: ignore[arg-type]


def _train(update_s: float) -> TrainCost:
    """``update_s`` per batch of P prompts at 16 dies: 2 x update_s on the 8 train dies."""
    return TrainCost(update_s, 0.0, 0.0, gbs_prompts=P, ref_dies=16)


def test_published_trainer_seconds() -> None:
    """Defaults are [ref 002 §1.3]'s 235B figures: training 797.93 s, the rest of the step 7833.16 - 6638.49 -
    797.93 s, old log-probs at verl's 53.92 / 113.81 of training; linear in prompts and inverse in dies."""
    c = TrainCost()
    assert (c.update_s, c.gbs_prompts, c.ref_dies) == (797.93, 512, 128)
    assert c.other_s == pytest.approx(396.74)
    assert c.old_log_prob_s == pytest.approx(797.93 * 53.92 / 113.81)
    assert c.seconds(512, 128) == pytest.approx(797.93 + 396.74)
    assert c.seconds(256, 64, old_log_prob=True) == pytest.approx(797.93 + 396.74 + c.old_log_prob_s)


def test_zero_tail_gain_is_the_resource_ratio() -> None:
    """Equal lengths, free training: the sync rollout on 16 dies has no idle rank, the fully-async Rollouter on 8
    of them runs the same full batches twice as often, so the gain per sample is 8 / 16 at every staleness."""
    m16 = simulate(EQUAL, SimConfig(dp=4, max_num_seqs=8)).makespan_s
    m8 = simulate(EQUAL, SimConfig(dp=2, max_num_seqs=8)).makespan_s
    assert m8 == pytest.approx(2 * m16)
    for s in (0.0, 0.5, 1.0):
        res = simulate_fully_async(EQUAL, _cfg(staleness=s), StepModel(), _train(0.0))
        assert (m16 / (P * N)) / res.time_per_sample_s == pytest.approx(8 / 16)
        assert res.samples_per_sync == P * N


def test_staleness_zero_is_sync_like_and_the_weight_sync_adds_its_time() -> None:
    """Staleness 0, one update per batch: generate the batch, train it, sync, repeat. Each period is the rollout
    makespan on the Rollouter's dies + the training + the weight sync, and nothing trained is stale."""
    m8 = simulate(EQUAL, SimConfig(dp=2, max_num_seqs=8)).makespan_s
    for w in (0.0, 7.0):
        res = simulate_fully_async(EQUAL, _cfg(weight_sync_s=w), StepModel(), _train(100.0))
        assert res.period_s == pytest.approx(m8 + 200.0 + w)
        assert res.time_per_sample_s == pytest.approx((m8 + 200.0 + w) / (P * N))
        assert res.stale_share == 0.0 and res.partial_share == 0.0 and res.max_version_span == 0


def test_overlap_is_the_slower_side_plus_the_pause() -> None:
    """Staleness 1: the Rollouter works on the next batch while the Trainer trains. Trainer-bound, each period is
    training + weight sync, every trained prompt was started under the previous policy and the Rollouter idles;
    Rollouter-bound (no prefill cost, free sync), each period is the rollout of one batch."""
    m8 = simulate(EQUAL, SimConfig(dp=2, max_num_seqs=8, step=NO_PREFILL)).makespan_s
    for w in (0.0, 7.0):
        res = simulate_fully_async(EQUAL, _cfg(staleness=1.0, weight_sync_s=w), NO_PREFILL, _train(100.0))
        assert res.period_s == pytest.approx(200.0 + w)
        assert res.stale_share == 1.0 and res.trainer_idle_share == pytest.approx(w / (200.0 + w))
        assert res.rollouter_idle_share > 0.9
    fast = simulate_fully_async(EQUAL, _cfg(staleness=1.0), NO_PREFILL, _train(0.5))
    assert fast.period_s == pytest.approx(m8)
    assert fast.rollouter_idle_share == pytest.approx(0.0, abs=1e-9)


def test_partial_rollout_resumes_with_a_recompute() -> None:
    """A sync that finds requests running pauses them (partial) and they resume with their context prefilled
    again: with a prefill cost the period grows; without it the same run is faster."""
    rng = np.random.default_rng(0)
    tail = Lengths(P, N, np.full(P * N, 8, dtype=np.int64), rng.integers(16, 400, P * N).astype(np.int64))
    cfg = _cfg(staleness=1.0, weight_sync_s=1.0)
    free = simulate_fully_async(tail, cfg, NO_PREFILL, _train(2.0))
    paid = simulate_fully_async(tail, cfg, StepModel(per_prefill_ktok_ms=5000.0), _train(2.0))
    kept = simulate_fully_async(tail, replace(cfg, recompute_on_resume=False), StepModel(per_prefill_ktok_ms=5000.0),
                                _train(2.0))
    assert free.partial_share > 0 and paid.partial_share > 0
    assert paid.period_s > kept.period_s >= free.period_s


def test_kv_budget_matches_the_memory_plan_and_bounds_admission() -> None:
    """The KV budget per rollout rank equals ``plan``'s for the 235B config at EP 128 / 64 / 32 (within 0.5 %). A
    budget of four finished requests per rank: the eight admitted ones outgrow it, the latest are preempted and
    recomputed, so the same batch takes longer; a prompt larger than the budget is an error."""
    spec = load_model_config(REPO / "tests" / "data" / "qwen3_235b_a22b_config.json")
    for dies in (128, 64, 32):
        lay = RolloutLayout(tp=4, ep=dies, dp=dies // 4, max_model_len=32768, gpu_memory_utilization=0.87,
                            max_num_seqs=256)
        assert kv_tokens_per_rank(dies) == pytest.approx(plan_rollout(spec, lay)["kv_cache_tokens"], rel=5e-3)
    with pytest.raises(SimError, match="does not fit"):
        kv_tokens_per_rank(8)
    roomy = simulate_fully_async(EQUAL, _cfg(), StepModel(), _train(0.0))
    tight = simulate_fully_async(EQUAL, _cfg(kv_tokens=4 * 72), StepModel(), _train(0.0))  # 4 requests of 72 tokens
    assert roomy.preemptions == 0 < tight.preemptions
    assert tight.period_s > 1.2 * roomy.period_s
    with pytest.raises(SimError, match="KV budget"):
        simulate_fully_async(EQUAL, _cfg(kv_tokens=4), StepModel(), _train(0.0))


def test_bad_async_configs() -> None:
    for kw, word in (({"rollout_dies": 6}, "multiple"), ({"staleness": -0.1}, "staleness"),
                     ({"train_dies": 0}, "train-dies"), ({"weight_sync_s": float("nan")}, "weight-sync")):
        with pytest.raises(SimError, match=word):
            _cfg(**kw)


def _gen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    out = tmp_path / "len.jsonl"
    assert main(["gen-lengths", "--out", str(out), "--num-prompts", "16", "--n", "4", "--seed", "2"]) == 0
    capsys.readouterr()
    return out


def test_cli_json_keys_and_split_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--trainer fully-async --json``: every synchronous row and every fully-async row carries
    ``time_per_sample_s`` and ``gain_vs_sync_default`` (the synchronous default's gain is 1); the synchronous
    rows are the rollout makespan plus the trainer seconds at all dies; the sweep lists each split."""
    lens = _gen(tmp_path, capsys)
    argv = ["rollout", "--lengths", str(lens), "--dp", "4", "--max-num-seqs", "16", "--policy", "default,both",
            "--drafting", "none,sam_group_exchange+history+adaptive", "--trainer", "fully-async",
            "--rollout-dies", "8", "--train-dies", "8", "--staleness", "1", "--split-sweep", "4,12",
            "--kv-tokens-per-rank", "0", "--mini-batch-prompts", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    train = TrainCost().seconds(16, 16)
    rows = out["results"]
    assert rows["default"]["gain_vs_sync_default"] == pytest.approx(1.0)
    assert rows["default"]["time_per_sample_s"] == pytest.approx((rows["default"]["makespan_s"] + train) / 64)
    assert rows["both+sam_group_exchange+history+adaptive"]["gain_vs_sync_default"] > 1.0
    tr = out["trainer"]
    assert (tr["total_dies"], tr["rollout_dies"], tr["train_dies"], tr["staleness"]) == (16, 8, 8, 1.0)
    ref = tr["sync_default_time_per_sample_s"]
    assert ref == pytest.approx(rows["default"]["time_per_sample_s"])
    for name in ("fully-async", "fully-async+sam_group_exchange+history+adaptive"):
        row = tr["fully_async"][name]
        assert row["gain_vs_sync_default"] == pytest.approx(ref / row["time_per_sample_s"])
    drafted = tr["fully_async"]["fully-async+sam_group_exchange+history+adaptive"]
    assert 0.0 <= drafted["history_coverage"] <= 1.0 and drafted["engine_steps_per_k"]
    assert [x["rollout_dies"] for x in tr["split_sweep"]["none"]] == [4, 12]


def test_cli_text_and_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lens = _gen(tmp_path, capsys)
    base = ["rollout", "--lengths", str(lens), "--dp", "4", "--max-num-seqs", "16", "--trainer", "fully-async",
            "--kv-tokens-per-rank", "0", "--mini-batch-prompts", "4"]
    assert main(base) == 0
    text = capsys.readouterr().out
    assert "sync default" in text and "fully-async " in text and "s/sample" in text
    for bad, word in ((["--rollout-dies", "8", "--train-dies", "4"], "same total dies"),
                      (["--split-sweep", "16"], "--split-sweep"), (["--staleness", "-1"], "staleness"),
                      (["--kv-tokens-per-rank", "-1", "--rollout-dies", "8"], "kv-tokens")):
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err
        assert word in err and len(err.strip().splitlines()) == 1
