"""``python -m qwen3_rl report``: verl step lines → table, PNG plots, published-figure comparison."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_rl.tools.report import PUBLISHED, parse_lines, parse_log, parse_value, resolve_setup
from qwen3_rl.tools.report.cli import compare, format_table
from qwen3_rl.tools.report.cli import main as report_main

REPO = Path(__file__).resolve().parents[3]


def _step_line(step: int) -> str:
    """One console line as verl 0.6.1's LocalLogger prints it (concat_dict_to_str, pprint reprs)."""
    gen = 2400.0 - 150.0 * step
    upd = 700.0 + 3.0 * step
    total = gen + 120.0 + 260.0 + upd + 95.0
    tokens = 512 * 16 * (7000 + 120 * step)
    items = [
        ("global_seqlen/mean", f"{7300.0 + step:.1f}"),
        ("actor/entropy", f"np.float32({0.61 - 0.01 * step})"),
        ("actor/pg_loss", f"np.float64({-0.002 * step})"),
        ("actor/pg_clipfrac", "0.0012"),
        ("actor/ppo_kl", "1.2e-05"),
        ("actor/grad_norm", f"{0.04 + 0.001 * step}"),
        ("actor/lr", "1e-06"),
        ("training/global_step", str(step)),
        ("training/epoch", "0"),
        ("critic/score/mean", f"np.float64({-0.41 + 0.08 * step})"),
        ("critic/score/max", "1.0"),
        ("critic/score/min", "-1.0"),
        ("critic/rewards/mean", f"np.float64({-0.41 + 0.08 * step})"),
        ("critic/advantages/mean", "np.float64(-1.3e-09)"),
        ("response_length/mean", f"{7000.0 + 120 * step}"),
        ("response_length/max", "32768.0"),
        ("response_length/min", "312.0"),
        ("response_length/clip_ratio", f"np.float64({0.05 - 0.004 * step})"),
        ("prompt_length/mean", "73.7"),
        ("timing_s/generate_sequences", f"{gen - 40.0}"),
        ("timing_s/reshard", "12.5"),
        ("timing_s/gen", f"{gen}"),
        ("timing_s/reward", "120.0"),
        ("timing_s/old_log_prob", "260.0"),
        ("timing_s/adv", "0.8"),
        ("timing_s/update_actor", f"{upd}"),
        ("timing_s/step", f"{total}"),
        ("timing_per_token_ms/gen", "0.0417"),
        ("perf/mfu/actor", "nan"),
        ("perf/total_num_tokens", str(tokens)),
        ("perf/time_per_step", f"{total}"),
        ("perf/throughput", f"{tokens / (total * 128)}"),
        ("response/aborted_ratio", "False"),
    ]
    return " - ".join([f"step:{step}"] + [f"{k}:{v}" for k, v in items])


def write_sample_log(path: Path, steps: int = 6) -> Path:
    """A recorded-style trainer stdout: Ray prefixes, progress bars and INFO lines between steps."""
    lines = ["(TaskRunner pid=41873) Training Progress:   0%|          | 0/100 [00:00<?, ?it/s]"]
    for s in range(1, steps + 1):
        lines.append(f"(WorkerDict pid=5521) INFO 03-01 10:0{s}:00 [vllm] Added request {s}.")
        lines.append(f"(TaskRunner pid=41873) {_step_line(s)}")
        lines.append(f"(TaskRunner pid=41873) Training Progress:   {s}%|          | {s}/100")
    path.write_text("\n".join(lines) + "\n")
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_parse_value_reprs():
    assert parse_value("np.float64(1.0)") == 1.0
    assert parse_value("np.float32(-0.5)") == -0.5
    assert parse_value("numpy.int64(3)") == 3.0
    assert parse_value("7") == 7.0
    assert parse_value("1e-06") == 1e-06
    assert parse_value("True") == 1.0 and parse_value("False") == 0.0
    assert math.isnan(parse_value("nan")) and parse_value("-inf") == -math.inf
    assert parse_value("tensor([1, 2])") is None and parse_value("abc") is None


def test_parse_sample_log(tmp_path):
    log = parse_log(write_sample_log(tmp_path / "train.log"))
    assert sorted(log.steps) == [1, 2, 3, 4, 5, 6]
    assert log.steps[3]["critic/score/mean"] == pytest.approx(-0.41 + 0.24)
    assert log.steps[2]["actor/entropy"] == pytest.approx(0.59)
    assert log.steps[1]["response/aborted_ratio"] == 0.0
    assert math.isnan(log.steps[1]["perf/mfu/actor"])
    assert log.steps[6]["perf/total_num_tokens"] == 512 * 16 * (7000 + 720)
    assert len(log.steps[1]) == 33 and log.skipped_values == 0
    xs, ys = log.series("timing_s/gen")
    assert xs == [1, 2, 3, 4, 5, 6] and ys[0] == 2250.0


def test_parse_reference_document_format():
    """The wrapped, elided form [ref 004 §2.4] shows."""
    lines = [  # trailing blanks as in [ref 004 §2.4]
        "step:1 - actor/grad_norm:0.04106094129383564 - ",
        "……",
        "critic/rewards/mean:-0.4141845703125 -",
        "response_length/mean:7385.140625 - ",
        "……",
        "timing_s/generate_sequences:1081.803466796875 - ",
        "timing_s/step:1738.0274970199998 - ",
        "……",
        "perf/throughput:69.3938963605546 ",
        "……",
    ]
    log = parse_lines(lines)
    assert list(log.steps) == [1]
    m = log.steps[1]
    assert m["actor/grad_norm"] == pytest.approx(0.04106094129383564)
    assert m["critic/rewards/mean"] == pytest.approx(-0.4141845703125)
    assert m["perf/throughput"] == pytest.approx(69.3938963605546)
    assert len(m) == 6


def test_parse_ignores_lookalikes_and_keeps_last_of_repeated_step():
    lines = [
        "global_step:5 - foo:1",  # not a step line
        "saving checkpoint at step:3 of 10",  # "step:3" not followed by a separator
        "step:2 - a:1.0 - b:np.float64(2.0) - c:<object>",
        "step:2 - a:5.0",  # resumed run logs step 2 again
    ]
    log = parse_lines(lines)
    assert list(log.steps) == [2] and log.steps[2] == {"a": 5.0}
    assert log.repeated_steps == [2] and log.skipped_values == 1


def test_table_and_comparison(tmp_path):
    log = parse_log(write_sample_log(tmp_path / "train.log"))
    table = format_table(log, ["critic/score/mean", "perf/throughput", "timing_s/step", "not/present"])
    rows = table.splitlines()
    assert len(rows) == 7 and rows[0].split() == ["step", "score/mean", "throughput", "t/step"]
    assert rows[1].split()[0] == "1" and "not/present" not in table
    cmp = {r["key"]: r for r in compare(log, PUBLISHED["235b-grpo"][1])}
    thr = cmp["perf/throughput"]
    step1 = log.steps[1]["perf/throughput"]
    assert thr["measured"] == step1 and thr["measured_how"] == "step 1"
    assert thr["ratio"] == pytest.approx(step1 / 120.0) and thr["meets"] is (step1 >= 120.0)
    assert thr["best"] == max(log.series("perf/throughput")[1])
    gen = cmp["timing_s/gen"]  # a run average in the slides → compared with the log's mean
    assert gen["measured"] == pytest.approx(sum(log.series("timing_s/gen")[1]) / 6)
    assert gen["meets"] is True  # 1875 s mean < 6638.49 s
    assert cmp["response_length/mean"]["meets"] is None  # no better direction


def test_report_cli_plots(tmp_path, capsys):
    log_path = write_sample_log(tmp_path / "train.log")
    out_dir = tmp_path / "plots"
    assert report_main([str(log_path), "--plot", str(out_dir), "--setup", "235b-grpo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("6 steps, 33 metrics")
    assert "perf/throughput: published 120 tokens/s/die" in out
    for name in ("reward", "response_length", "throughput", "timing"):
        png = out_dir / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 10_000, name
        w, h = _png_size(png)
        assert w >= 700 and h >= 400
        assert f"plot {name}: {png}" in out


def test_report_cli_json_and_alias(tmp_path, capsys):
    log_path = write_sample_log(tmp_path / "train.log", steps=3)
    assert (
        report_main(
            [str(log_path), "--json", "--setup", "internal/train_dapo_qwen3_32b_32die_true_weight.sh"]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["setup"] == "32b-dapo" and doc["num_steps"] == 3
    (row,) = doc["comparison"]
    assert row["key"] == "timing_s/generate_sequences" and row["published"] == 4562.0
    assert row["measured"] == pytest.approx(2250.0 - 40.0) and row["meets"] is True
    assert doc["steps"]["2"]["timing_s/update_actor"] == 706.0
    assert doc["plots"] == {}


def test_published_table_matches_seed():
    figs = {k: {f.key: f.value for f in v[1]} for k, v in PUBLISHED.items()}
    assert figs["235b-grpo"]["perf/throughput"] == 120
    assert figs["235b-dapo"]["perf/time_per_step"] == 6620
    assert [figs[f"32b-grpo{s}"]["timing_s/generate_sequences"] for s in ("", "-sam", "-sam-npugraph")] == [
        2444,
        2106,
        1621,
    ]
    assert [figs[f"32b-dapo{s}"]["timing_s/generate_sequences"] for s in ("", "-sam", "-sam-npugraph")] == [
        4562,
        4109,
        3261,
    ]
    assert resolve_setup("train_grpo_qwen3_235b_128die_true_weight.sh") == "235b-grpo"


@pytest.mark.parametrize(
    "content, extra, message",
    [
        (None, [], "log not found"),
        ("INFO starting\nno metrics here\n", [], "no verl step lines"),
        ("step:1 - a:1\n", ["--setup", "70b-ppo"], "unknown setup '70b-ppo'"),
    ],
)
def test_report_errors_one_line(tmp_path, capsys, content, extra, message):
    p = tmp_path / "train.log"
    if content is not None:
        p.write_text(content)
    assert report_main([str(p), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_dispatcher_report(tmp_path):
    log_path = write_sample_log(tmp_path / "train.log", steps=2)
    res = subprocess.run(
        [sys.executable, "-m", "qwen3_rl", "report", str(log_path)], capture_output=True, text=True, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    assert "resp_len/mean" in res.stdout and "t/generate_sequences" in res.stdout


def test_spec_decode_columns_when_the_log_carries_them(tmp_path, capsys):
    """verl 0013's rollout/spec_decode/* items (SAM on): the table shows drafted tokens and the acceptance
    rate, plus one summary line; logs without them show neither."""
    spec = {
        1: "rollout/spec_decode/num_drafts:1200 - rollout/spec_decode/draft_tokens:3400 - "
        "rollout/spec_decode/accepted_tokens:1700 - rollout/spec_decode/acceptance_rate:0.5 - "
        "rollout/spec_decode/mean_acceptance_length:2.4166666666666665",
        2: "rollout/spec_decode/num_drafts:0 - rollout/spec_decode/draft_tokens:0 - "
        "rollout/spec_decode/accepted_tokens:0",
        3: "rollout/spec_decode/num_drafts:900 - rollout/spec_decode/draft_tokens:2600 - "
        "rollout/spec_decode/accepted_tokens:780 - rollout/spec_decode/acceptance_rate:np.float64(0.3)",
    }
    p = tmp_path / "train.log"
    p.write_text("\n".join(f"(TaskRunner pid=1) {_step_line(s)} - {spec[s]}" for s in (1, 2, 3)) + "\n")
    assert report_main([str(p)]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out[1].split()
    assert head[-2:] == ["sd/draft_tokens", "sd/acceptance_rate"]
    rows = [r.split() for r in out[2:5]]
    assert [r[-2:] for r in rows] == [["3400.0", "0.5"], ["0", "-"], ["2600.0", "0.3"]]
    assert out[5] == (
        "speculative decoding: drafted in 2 of 3 steps that logged spec-decode counters, "
        "acceptance rate 0.413 over the log"
    )  # (1700 + 780) / (3400 + 2600) = 0.4133
    assert report_main([str(write_sample_log(tmp_path / "plain.log", steps=2))]) == 0
    plain = capsys.readouterr().out
    assert "sd/" not in plain and "speculative decoding" not in plain


def test_plots_val_accuracy_sam_and_integer_step_ticks(tmp_path):
    """A run with validation before step 1 (step 0) and after step 3, SAM counters, testing and checkpoint timers:
    val_accuracy.png and sam_acceptance.png are drawn; every plot's x ticks are whole steps; the timing plot stacks
    validation and checkpoint above the step total, not inside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qwen3_rl.tools.report import plots

    lines = ["step:0 - val-core/openai/gsm8k/acc/mean@1:0.125"]
    for s in (1, 2, 3):
        val = " - val-core/openai/gsm8k/acc/mean@1:0.5" if s == 3 else ""
        lines.append(
            f"step:{s} - critic/score/mean:{0.1 * s} - response_length/mean:12.0 - timing_s/gen:2.0"
            f" - timing_s/update_actor:5.0 - timing_s/step:8.0 - timing_s/save_checkpoint:3.0"
            f" - rollout/spec_decode/acceptance_rate:{0.2 * s}{val}"
        )
    log = parse_lines(lines)
    ticks: dict[str, list[float]] = {}
    real_savefig = plt.Figure.savefig

    def savefig(fig, out, *a, **k):
        ax = fig.axes[0]
        ticks[Path(out).stem] = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        if Path(out).stem == "timing":
            tops = sorted({round(p.get_y() + p.get_height(), 6) for p in ax.patches})
            ticks["timing_tops"] = tops
        return real_savefig(fig, out, *a, **k)

    plt.Figure.savefig = savefig
    try:
        made = plots.write_plots(log, tmp_path)
    finally:
        plt.Figure.savefig = real_savefig
    assert {"val_accuracy", "sam_acceptance", "timing", "reward"} <= set(made)
    for name in ("val_accuracy", "sam_acceptance", "timing", "reward"):
        assert ticks[name] and all(float(t).is_integer() for t in ticks[name]), (name, ticks[name])
    # gen 2 + update 5 + other 1 = the step total 8; the checkpoint (3 s) sits on top of it: 11
    assert ticks["timing_tops"][-1] == pytest.approx(11.0) and 8.0 in ticks["timing_tops"]


def test_progress_lines(tmp_path):
    """``report LOG --follow PID``: one line per step, "step N of M" with the step time and its stages, the
    validation accuracy where a step has it; returns once PID is gone."""
    from qwen3_rl.tools.report.progress import follow, step_line

    assert (
        step_line(2, 6, {"timing_s/step": 21.04, "timing_s/gen": 2.0, "timing_s/update_actor": 13.2})
        == "[ray_start_npu] progress: step 2 of 6: 21.0 s (gen 2.0 s, update_actor 13.2 s)"
    )
    assert (
        step_line(
            3,
            6,
            {
                "timing_s/step": 5.0,
                "rollout/spec_decode/draft_tokens": 961.0,
                "rollout/spec_decode/accepted_tokens": 678.0,
            },
        )
        == "[ray_start_npu] progress: step 3 of 6: 5.0 s (); drafted 961, accepted 678 tokens"
    )
    assert (
        step_line(0, 6, {"val-core/x/acc/mean@1": 0.25})
        == "[ray_start_npu] progress: validation before step 1 of 6; val-core/x/acc/mean@1 0.250"
    )
    log = tmp_path / "train.log"
    log.write_text(
        "(TaskRunner pid=1) Total training steps: 2\nstep:1 - timing_s/step:3.0\nstep:2 - timing_s/step:4.0\n"
    )
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import io

    out = io.StringIO()
    assert follow(log, dead.pid, poll_s=0.01, out=out) == 2
    assert out.getvalue().splitlines() == [
        "[ray_start_npu] progress: step 1 of 2: 3.0 s ()",
        "[ray_start_npu] progress: step 2 of 2: 4.0 s ()",
    ]
    # the launcher appends every run to the same log: from the byte where this run began, only its own steps
    # and its own total count (the earlier run's "Total training steps: 2" and step 1-2 lines are not read)
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("(TaskRunner pid=9) Total training steps: 5\nstep:3 - timing_s/step:6.0\n")
    out = io.StringIO()
    assert follow(log, dead.pid, poll_s=0.01, out=out, start=start) == 1
    assert out.getvalue().splitlines() == ["[ray_start_npu] progress: step 3 of 5: 6.0 s ()"]
    # positive control: from byte 0 the stale lines come back
    out = io.StringIO()
    assert follow(log, dead.pid, poll_s=0.01, out=out) == 3


def test_routing_summary(tmp_path):
    """Server-mode routing metrics (SERVER_ROUTING) in the text report: ours against verl's replayed routing;
    a log without them has no such line."""
    from qwen3_rl.tools.report.cli import routing_summary
    from qwen3_rl.tools.report.parse import parse_lines

    lines = [
        "step:1 - rollout/routing/sibling_same_engine:1.0 - rollout/routing/verl_sibling_same_engine:0.4 - "
        "rollout/routing/load_spread_tokens:1.2 - rollout/routing/verl_load_spread_tokens:1.0",
        "step:2 - rollout/routing/sibling_same_engine:1.0 - rollout/routing/verl_sibling_same_engine:0.5 - "
        "rollout/routing/load_spread_tokens:1.1 - rollout/routing/verl_load_spread_tokens:1.1",
    ]
    assert routing_summary(parse_lines(lines)) == (
        "server routing over 2 steps: siblings on one engine 1.000 "
        "(verl's routing 0.45), token spread 1.150 (verl's 1.05)"
    )
    assert routing_summary(parse_lines(["step:1 - timing_s/step:3.0"])) is None


#: verl 0.9.1's fully-async trainer: each weight version (the logged step) on up to three console lines of
#: ``concat_dict_to_str`` (verl/utils/logger/aggregate_logger.py:26-32): the rollouter's timing
#: (experimental/fully_async_policy/fully_async_trainer.py:783-786), the validation (:829-830) and the trainer's
#: aggregated metrics (:806-809), with Ray's coloured actor prefix; the keys and their order as a tiny current-set run
#: printed them (shortened). The first run stopped after its step 0 and was started again into the same log.
_FA = "\x1b[36m(FullyAsyncTrainer pid={pid})\x1b[0m "


def _fa_timing(pid: int, step: int, util: float) -> str:
    return (
        f"{_FA.format(pid=pid)}step:{step} - fully_async/rollouter/active_time:22.169585704803467 - "
        f"fully_async/rollouter/version_time:34.99261116981506 - fully_async/rollouter/idle_ratio:0 - "
        f"fully_async/rollouter/step_generated_samples:32 - dynamic_resource/rollout_resource_utilization:{util}"
    )


def _fa_val(pid: int, step: int, acc: float) -> str:
    return (
        f"{_FA.format(pid=pid)}step:{step} - rollouter/validate_time:3.1041835679934593 - "
        f"val-aux/openai/gsm8k/reward/mean@1:np.float64({acc}) - val-aux/openai/gsm8k/score/mean@1:np.float64({acc})"
        f" - val-core/openai/gsm8k/acc/mean@1:np.float64({acc}) - val-aux/num_turns/min:np.int32(2) - "
        "val-aux/num_turns/max:np.int32(2) - val-aux/num_turns/mean:np.float64(2.0)"
    )


def _fa_train(pid: int, step: int, score: float, util: float) -> str:
    return (
        f"{_FA.format(pid=pid)}step:{step} - training/global_step:{step - 1}.0 - training/epoch:0.0 - "
        f"fully_async/count/current_param_version:{max(step - 2, 0)}.0 - actor/pg_loss:-0.14122671267250553 - "
        f"actor/grad_norm:0.43146333462542447 - actor/lr:0.0005 - critic/score/mean:{score} - "
        f"critic/rewards/mean:{score} - response_length/mean:11.65625 - response_length/clip_ratio:0.0 - "
        "timing_s/gen:1.4961988840004778 - timing_s/update_actor:1.6812940960007836 - "
        "timing_s/timing_s/param_sync:6.218145291997644 - timing_s/step:10.662188249996689 - "
        "perf/time_per_step:10.662188249996689 - perf/throughput:596.6880203978743 - "
        f"dynamic_resource/rollout_resource_utilization:{util} - dynamic_resource/resource_utilization:0.44"
    )


FULLY_ASYNC_LOG = [
    _fa_timing(8569, 0, 0.0),
    "\x1b[36m(FullyAsyncRollouter pid=8870)\x1b[0m test_gen_batch meta info: {'validate': True, 'global_steps': 0}",
    _fa_val(8569, 0, 0.03125),
    _fa_timing(15122, 0, 0.0),  # the job started again into the same log
    _fa_val(15122, 0, 0.046875),
    "\x1b[36m(FullyAsyncTrainer pid=15122)\x1b[0m [FullyAsyncTrainer] global_steps: 1 local_trigger_step: 1",
    _fa_timing(15122, 1, 0.5),
    _fa_timing(15122, 2, 0.632),
    _fa_train(15122, 2, 0.1171875, 0.6),
    _fa_timing(15122, 3, 0.0176),
    _fa_val(15122, 3, 0.625),
    _fa_train(15122, 3, 0.4140625, 0.609),
]


def test_fully_async_lines_of_a_step_merge_and_validation_shows(tmp_path, capsys):
    """verl 0.9.1's fully-async log: a step's timing, validation and training lines are one record (the training
    line's value wins for the key two of them carry); the rerun's step 0 replaces the stopped run's (positive control:
    a line that repeats its step's keys is not merged); the table shows the validation accuracy at steps 0 and 3,
    the val_accuracy plot draws both points, the JSON counts the merged lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qwen3_rl.tools.report import plots

    log = parse_lines(FULLY_ASYNC_LOG)
    acc = "val-core/openai/gsm8k/acc/mean@1"
    assert sorted(log.steps) == [0, 1, 2, 3]
    assert log.repeated_steps == [0] and log.merged_lines == 5
    assert log.series(acc) == ([0, 3], [0.046875, 0.625])
    assert log.series("critic/score/mean") == ([2, 3], [0.1171875, 0.4140625])
    s3 = log.steps[3]
    assert s3["fully_async/rollouter/step_generated_samples"] == 32 and s3["rollouter/validate_time"] > 0
    assert s3["dynamic_resource/rollout_resource_utilization"] == 0.609  # the later (training) line's
    assert "critic/score/mean" not in log.steps[1] and acc not in log.steps[1]

    path = tmp_path / "fully_async.log"
    path.write_text("\n".join(FULLY_ASYNC_LOG) + "\n")
    assert report_main([str(path), "--plot", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    rows = out.splitlines()
    head = rows[1].split()
    assert head[0] == "step" and head[-1] == "val/openai/gsm8k/acc/mean@1", head
    table = {r.split()[0]: r.split() for r in rows[2:6]}
    assert table["0"][-1] == "0.04688" and table["3"][-1] == "0.625" and table["2"][-1] == "-", table
    assert table["3"][head.index("score/mean")] == "0.4141", table
    assert "note: steps logged again (a resumed or rerun job; the last kept): [0]" in out

    drawn: dict[str, list] = {}
    real_savefig = plt.Figure.savefig

    def savefig(fig, out_path, *a, **k):
        drawn[Path(out_path).stem] = [
            (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()
        ]
        return real_savefig(fig, out_path, *a, **k)

    plt.Figure.savefig = savefig
    try:
        made = plots.write_plots(log, tmp_path / "plots2")
    finally:
        plt.Figure.savefig = real_savefig
    assert (tmp_path / "plots" / "val_accuracy.png").is_file() and "val_accuracy" in made
    assert drawn["val_accuracy"] == [([0, 3], [0.046875, 0.625])], drawn["val_accuracy"]

    assert report_main([str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["merged_lines"] == 5 and doc["repeated_steps"] == [0]
    assert doc["steps"]["3"][acc] == 0.625 and doc["steps"]["3"]["critic/score/mean"] == 0.4140625
