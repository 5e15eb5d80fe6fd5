"""vLLM's spec-decode counters per rollout as verl step metrics (qwen3_rl.spec_decode.metrics, verl 0013).

* the pure module: counts from ``LLM.get_metrics()`` items, deltas, sums, step metrics, stats-off warning;
* the names and types against vLLM 0.13's own ``SpecDecodingProm`` + ``get_metrics_snapshot`` (patched tree);
* the patched ``vLLMRollout.generate_sequences`` (stand-in LLM) puts the counts into ``meta_info``;
* the patched ``DataProto.concat`` sums them; the patched ``RayPPOTrainer.fit`` and our DAPO ``fit``
  (fake worker groups, CPU) log them in verl's console step line, which ``python -m qwen3_rl report`` reads.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest

from qwen3_rl.compat.meta_info import merge_meta_value
from qwen3_rl.spec_decode import metrics as sdm

SAM_ROLLOUT = {"engine_kwargs": {"vllm": {"speculative_config": {"method": "sam", "num_speculative_tokens": 3}}}}


def _counter(name: str, value: int, engine: str = "0"):
    return types.SimpleNamespace(name=name, labels={"engine": engine}, value=value)


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdm, "_warned", set())


# ---- pure module ------------------------------------------------------------------------------------------
def test_read_counters_sums_engines_and_ignores_others() -> None:
    metrics = [_counter("vllm:spec_decode_num_drafts", 4, "0"), _counter("vllm:spec_decode_num_drafts", 6, "1"),
               _counter("vllm:spec_decode_num_draft_tokens", 30), _counter("vllm:spec_decode_num_accepted_tokens", 12),
               _counter("vllm:prompt_tokens", 999),
               types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={}, values=[5, 4, 3])]
    assert sdm.read_counters(metrics) == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12}
    # no drafter registered: zeros, all three keys
    assert sdm.read_counters([_counter("vllm:prompt_tokens", 1)]) == dict.fromkeys(sdm.COUNTERS.values(), 0)


def test_delta_merge_and_step_metrics() -> None:
    before = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12}
    after = {"num_drafts": 14, "num_draft_tokens": 42, "num_accepted_tokens": 21}
    d = sdm.counter_delta(before, after)
    assert d == {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 9}
    # a counter that went down was reset (a new engine): what it shows accrued since
    assert sdm.counter_delta(after, before) == before
    a, b = {"num_drafts": 1, "num_draft_tokens": 3}, {"num_drafts": 2, "num_accepted_tokens": 1}
    assert sdm.merge_counts(a, b) == {"num_drafts": 3, "num_draft_tokens": 3, "num_accepted_tokens": 1}
    assert a == {"num_drafts": 1, "num_draft_tokens": 3} and sdm.merge_counts(None, b) == b
    m = sdm.step_metrics(d)
    assert m == {"rollout/spec_decode/num_drafts": 4, "rollout/spec_decode/draft_tokens": 12,
                 "rollout/spec_decode/accepted_tokens": 9, "rollout/spec_decode/acceptance_rate": 0.75,
                 "rollout/spec_decode/mean_acceptance_length": 1 + 9 / 4}
    # nothing drafted: the counts, no rate (a 0/0 is not a rate)
    assert sdm.step_metrics(dict.fromkeys(sdm.COUNTERS.values(), 0)) == {
        "rollout/spec_decode/num_drafts": 0, "rollout/spec_decode/draft_tokens": 0,
        "rollout/spec_decode/accepted_tokens": 0}
    assert sdm.step_metrics(None) == {} and sdm.step_metrics({}) == {}


def test_pop_and_add_counts() -> None:
    meta = {"timing": {"x": 1.0}, sdm.META_KEY: {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3}}
    assert sdm.pop_step_metrics(meta)["rollout/spec_decode/acceptance_rate"] == 0.5
    assert meta == {"timing": {"x": 1.0}}
    assert sdm.pop_step_metrics(meta) == {}
    into: dict[str, int] = {}
    for k in (1, 2):
        sdm.add_counts(into, {sdm.META_KEY: {"num_drafts": k, "num_draft_tokens": 3 * k, "num_accepted_tokens": k}})
    sdm.add_counts(into, {})
    assert into == {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 3}


def test_concat_merge_rule_sums_counts() -> None:
    a = {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 2}
    b = {"num_drafts": 5, "num_draft_tokens": 15, "num_accepted_tokens": 0}
    assert merge_meta_value(sdm.META_KEY, a, b) == {"num_drafts": 6, "num_draft_tokens": 18, "num_accepted_tokens": 2}
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'other'"):
        merge_meta_value("other", a, b)


class _StandInLLM:
    """``vllm.LLM`` as the probe uses it: ``llm_engine.log_stats`` and ``get_metrics()`` (asserts with stats off,
    as vllm/v1/engine/llm_engine.py:354 does); ``generate`` adds to the counters."""

    def __init__(self, log_stats: bool = True) -> None:
        self.llm_engine = types.SimpleNamespace(log_stats=log_stats)
        self.log_stats = log_stats
        self.counts = {"vllm:spec_decode_num_drafts": 100, "vllm:spec_decode_num_draft_tokens": 300,
                       "vllm:spec_decode_num_accepted_tokens": 120}
        self.get_metrics_calls = 0

    def get_metrics(self):
        self.get_metrics_calls += 1
        assert self.log_stats, "Stat logging disabled"
        return [_counter(k, v) for k, v in self.counts.items()]

    def drafted(self, drafts: int, tokens: int, accepted: int) -> None:
        for k, v in zip(sdm.COUNTERS, (drafts, tokens, accepted), strict=True):
            self.counts[k] += v


def test_probe_counts_one_call_only_with_a_drafter(fresh_warnings: None) -> None:
    llm = _StandInLLM()
    probe = sdm.RolloutProbe(SAM_ROLLOUT, llm)
    llm.drafted(8, 24, 10)
    assert probe.finish() == {"num_drafts": 8, "num_draft_tokens": 24, "num_accepted_tokens": 10}
    # no drafter: nothing read, nothing reported
    llm = _StandInLLM()
    assert sdm.RolloutProbe({"engine_kwargs": {"vllm": {}}}, llm).finish() == {} and llm.get_metrics_calls == 0


def test_probe_with_stats_off_reports_nothing_and_warns_once(fresh_warnings: None,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=sdm.__name__)
    for _ in range(3):
        assert sdm.RolloutProbe(SAM_ROLLOUT, _StandInLLM(log_stats=False)).finish() == {}
    # an engine without the log_stats attribute: get_metrics' own assertion is caught
    llm = _StandInLLM(log_stats=False)
    llm.llm_engine = None
    with pytest.raises(AssertionError):
        llm.get_metrics()
    assert sdm.read_llm_counters(llm) is None
    warnings = [r for r in caplog.records if r.name == sdm.__name__]
    assert len(warnings) == 1 and "disable_log_stats=False" in warnings[0].getMessage()


# ---- against vLLM 0.13's own counters ---------------------------------------------------------------------
def test_names_and_types_match_vllms_counters(patched_imports: Path) -> None:
    """vLLM's SpecDecodingProm (two engines) observed, read back through vLLM's get_metrics_snapshot."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    unregister_vllm_metrics()
    try:
        prom = SpecDecodingProm(types.SimpleNamespace(num_speculative_tokens=3), ["model_name", "engine"],
                                {0: ["m", "0"], 1: ["m", "1"]})
        before = sdm.read_counters(get_metrics_snapshot())
        for engine, (tokens, accepted) in enumerate([(3, 2), (3, 0), (2, 1)]):
            st = SpecDecodingStats.new(3)
            st.observe_draft(tokens, accepted)
            prom.observe(st, engine_idx=engine % 2)
        snap = get_metrics_snapshot()
        ours = [m for m in snap if m.name in sdm.COUNTERS]
        assert {m.name for m in ours} == set(sdm.COUNTERS) and all(isinstance(m, Counter) for m in ours)
        assert len(ours) == 6  # one per engine label
        delta = sdm.counter_delta(before, sdm.read_counters(snap))
        assert delta == {"num_drafts": 3, "num_draft_tokens": 8, "num_accepted_tokens": 3}
    finally:
        unregister_vllm_metrics()


# ---- the patched rollout: counts into meta_info ---------------------------------------------------------
class _GeneratingLLM(_StandInLLM):
    def generate(self, prompts, sampling_params, lora_request, use_tqdm):
        self.drafted(len(prompts), 3 * len(prompts), len(prompts) + 1)
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[7, 8])]) for _ in prompts]


def _spmd_generate(engine_kwargs: dict, llm: _StandInLLM):
    import torch
    from verl import DataProto
    from verl.utils.qwen3_rl_hooks import rollout_hooks
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMRollout
    from vllm import SamplingParams

    rollout = object.__new__(vLLMRollout)  # skip __init__: it builds a real vllm.LLM
    rollout.config = RolloutConfig(name="vllm", response_length=4, prompt_length=3, engine_kwargs=engine_kwargs,
                                   qwen3_rl={"spec_decode_metrics": {"enable": True}})
    rollout.qwen3_rl_hooks = rollout_hooks(rollout.config)  # what __init__ sets once the engine is built
    rollout.pad_token_id = 0
    rollout.lora_kwargs = {}
    rollout.sampling_params = SamplingParams(max_tokens=4)
    rollout.inference_engine = llm
    prompts = DataProto.from_dict(
        tensors={"input_ids": torch.tensor([[0, 5, 6], [4, 5, 6]]),
                 "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
                 "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]])},
        meta_info={"eos_token_id": 2},
    )
    return rollout.generate_sequences(prompts)


def test_patched_rollout_reports_its_counts(patched_imports: Path, fresh_warnings: None) -> None:
    out = _spmd_generate(SAM_ROLLOUT["engine_kwargs"], _GeneratingLLM())
    assert out.meta_info == {"metrics": {f"{sdm.META_KEY}/num_drafts": 2, f"{sdm.META_KEY}/num_draft_tokens": 6,
                                         f"{sdm.META_KEY}/num_accepted_tokens": 3}}
    assert out.batch["responses"].tolist() == [[7, 8, 0, 0]] * 2
    # no drafter: upstream's output (no meta_info), no counters read
    llm = _GeneratingLLM()
    assert _spmd_generate({"vllm": {}}, llm).meta_info == {} and llm.get_metrics_calls == 0
    # drafter with stats off: generation unaffected, nothing reported
    assert _spmd_generate(SAM_ROLLOUT["engine_kwargs"], _GeneratingLLM(log_stats=False)).meta_info == {}


def test_patched_concat_sums_worker_counts(patched_imports: Path) -> None:
    import torch
    from verl import DataProto

    from qwen3_rl.trainer.seam import pop_rollout_counts

    parts = [DataProto.from_dict(tensors={"x": torch.zeros(2, 1)},
                                 meta_info={"timing": {"generate_sequences": 1.0 + r},
                                            "metrics": _prefixed({"num_drafts": r + 1, "num_draft_tokens": 3 * (r + 1),
                                                                  "num_accepted_tokens": r})})
             for r in range(4)]
    merged = DataProto.concat(parts)  # verl's per-worker metrics channel lists them; the trainer hook sums
    assert pop_rollout_counts(merged.meta_info) == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 6}
    assert "metrics" not in merged.meta_info
    assert merged.meta_info["timing"] == {"generate_sequences": 4.0}
    assert parts[0].meta_info["metrics"][f"{sdm.META_KEY}/num_drafts"] == 1  # inputs untouched


def _prefixed(counts: dict[str, int]) -> dict[str, int]:
    """Counts as the seam's rollout hook puts them into meta_info['metrics']."""
    return {f"{sdm.META_KEY}/{k}": v for k, v in counts.items()}


# ---- the patched trainers: counts -> the step line -> report -----------------------------------------------
def _piece_counts(piece: int, call: int) -> dict[str, int]:
    return {"num_drafts": 10 * (piece + 1) + call, "num_draft_tokens": 30 * (piece + 1), "num_accepted_tokens": 7 * piece}


def _drafting_wg():
    """test_rollout_integration's fake rollout group, each DP worker's output carrying its engine's counts
    (as the patched rollout does), joined by verl's DataProto.concat (as verl's collect does)."""
    from test_rollout_integration import _FakeActorRolloutWG
    from verl import DataProto

    class DraftingWG(_FakeActorRolloutWG):
        calls = 0

        def generate_sequences(self, batch):
            out = super().generate_sequences(batch)
            parts = out.chunk(max(self.mesh) + 1)
            for piece, p in enumerate(parts):
                p.meta_info = {**p.meta_info, "metrics": _prefixed(_piece_counts(piece, self.calls))}
            self.calls += 1
            return DataProto.concat(parts)

    return DraftingWG()


def _step_metrics_from_stdout(text: str) -> dict[int, dict[str, float]]:
    from qwen3_rl.tools.report import parse_lines

    return parse_lines(text.splitlines()).steps


def test_grpo_fit_logs_spec_decode_metrics(patched_imports: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("tensordict")
    from test_rollout_integration import _grpo_trainer

    from qwen3_rl.tools.report.cli import format_table, spec_decode_summary

    t = _grpo_trainer(patched_imports, data_rebalance=True, n=4, train=[[10, 11, 12, 13], [14, 15, 16, 17]],
                      val=[[20, 21, 22]], extra=["+qwen3_rl.spec_decode_metrics.enable=true"])
    t.actor_rollout_wg = _drafting_wg()
    t.train_dataset = None  # fit reads it between steps (on_batch_end hook)
    t.fit()
    steps = _step_metrics_from_stdout(capsys.readouterr().out)
    assert sorted(steps) == [0, 1, 2]  # step 0: the validation before training
    # calls: 0 = validation (its counts reach no step line), 1 and 2 = the two training steps
    assert not any(k.startswith(sdm.PREFIX) for k in steps.pop(0))
    for step in (1, 2):
        want = sdm.step_metrics({k: sum(_piece_counts(p, step)[k] for p in range(4)) for k in sdm.COUNTERS.values()})
        got = {k: v for k, v in steps[step].items() if k.startswith(sdm.PREFIX)}
        assert got == pytest.approx(want), step
    assert steps[1]["rollout/spec_decode/draft_tokens"] == 300 and steps[1]["rollout/spec_decode/accepted_tokens"] == 42
    # the counts did not leak into the trained batch
    assert all("metrics" not in b.meta_info for b in t.actor_rollout_wg.updated)
    # report: the acceptance-rate column and the summary line
    from qwen3_rl.tools.report import parse_lines

    log = parse_lines([f"step:{s} - " + " - ".join(f"{k}:{v}" for k, v in m.items()) for s, m in steps.items()])
    table = format_table(log, ["critic/score/mean", "rollout/spec_decode/acceptance_rate"]).splitlines()
    assert table[0].split() == ["step", "score/mean", "sd/acceptance_rate"] and table[1].split()[-1] == "0.14"
    assert spec_decode_summary(log) == ("speculative decoding: drafted in 2 of 2 steps that logged spec-decode "
                                        "counters, acceptance rate 0.140 over the log")


def test_grpo_fit_without_counts_logs_none(patched_imports: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("tensordict")
    from test_rollout_integration import _grpo_trainer

    t = _grpo_trainer(patched_imports, data_rebalance=False, n=2, train=[[1, 2, 3, 4]], val=None)
    t.fit()
    (metrics,) = _step_metrics_from_stdout(capsys.readouterr().out).values()
    assert "timing_s/gen" in metrics and not any(k.startswith(sdm.PREFIX) for k in metrics)


def test_dapo_fit_sums_a_steps_generation_batches(patched_imports: Path, capsys: pytest.CaptureFixture) -> None:
    import torch
    from test_rollout_integration import RESP_LEN, _batch_dict, _Pool

    from qwen3_rl.trainer.dapo import make_dapo_trainer_class

    from helpers.dapo_probe import make_probe_trainer

    cls = make_dapo_trainer_class()

    def reward_fn(data, return_dict=False):  # prompts 1 and 3 informative (mixed rewards), 0 and 2 not
        resp = data.batch["responses"]
        acc = [float(int(p) % 2 == 1 and int(row) % 2 == 0) for p, row in zip(resp[:, 0], resp[:, 2], strict=True)]
        r = torch.zeros(len(data), RESP_LEN)
        r[:, -1] = torch.tensor(acc)
        return {"reward_tensor": r, "reward_extra_info": {"acc": acc}}

    t = make_probe_trainer(cls, n=4, resp_len=RESP_LEN, actor_rollout_wg=_drafting_wg(), reward_fn=reward_fn,
                           resource_pool_manager=_Pool(), qwen3_rl={"spec_decode_metrics": {"enable": True}},
                           train_dataloader=[_batch_dict([0, 1]), _batch_dict([2, 3])])  # one informative group per batch
    t.fit()
    assert t.actor_rollout_wg.calls == 2
    (metrics,) = _step_metrics_from_stdout(capsys.readouterr().out).values()
    total = {k: sum(_piece_counts(p, c)[k] for p in range(4) for c in range(2)) for k in sdm.COUNTERS.values()}
    got = {k: v for k, v in metrics.items() if k.startswith(sdm.PREFIX)}
    assert got == pytest.approx(sdm.step_metrics(total))
    assert got["rollout/spec_decode/num_drafts"] == 2 * 100 + 4  # both generation batches of the one step
