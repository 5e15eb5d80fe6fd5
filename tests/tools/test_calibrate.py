"""``python -m qwen3_rl calibrate`` without an engine: the plan it reads from a setup (the rollout engine's
arguments, dummy weights, SAM at k_max padded; the grid), its one-line errors, and the launcher step
``launch calibrate`` (``SAM_CALIBRATE``). The measurement itself runs in tests/engine/test_engine_calibrate.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_rl.tools.calibrate import (
    CalibrateError,
    default_out,
    engine_for_vllm,
    inversions,
    main,
    plan_from_command,
)
from qwen3_rl.tools.launch.cli import calibrate_wanted, cmd_calibrate
from qwen3_rl.tools.launch.train_script import parse_train_script

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "internal" / "train_grpo_tiny_cpu.sh"
A3B = REPO / "internal" / "train_grpo_qwen3_30b_a3b_32die.sh"
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("SAM_", "MODEL_PATH"))}


def test_plan_of_the_tiny_setup() -> None:
    plan = plan_from_command(parse_train_script(TINY, env={**CLEAN, "MODEL_PATH": "/m/qwen3_tiny"}),
                             batch="1,4", ks="0,1,3", ctx="32,128", steps=3)
    e = plan.engine
    assert plan.shape == "qwen3_tiny-tp1" and (plan.batch, plan.ks, plan.ctx) == ((1, 4), (0, 1, 3), (32, 128))
    assert e["load_format"] == "dummy" and e["dtype"] == "float32" and e["enforce_eager"] is True
    assert e["compilation_config"] == {"custom_ops": ["none"]}  # the setup's own engine option
    assert e["speculative_config"] == {"method": "sam", "num_speculative_tokens": 3,
                                       "sam_config": {"pad_drafts": True}}
    assert e["max_model_len"] == 128 + plan.decode_tokens and e["max_num_batched_tokens"] >= 4 * 4
    assert plan.cells() == 4 and plan.engine_steps() == 4 * 3 * 3 * (1 + 1)  # cells x rounds x ks x (warm-up + 1)


def test_plan_of_a_cluster_setup_follows_its_rollout_layout() -> None:
    env = {**CLEAN, "SAM_ENABLE": "True", "SAM_ADAPTIVE_K": "True", "SAM_K_MAX": "7"}
    plan = plan_from_command(parse_train_script(A3B, env=env))
    e = plan.engine
    assert e["tensor_parallel_size"] == 2 and e["enable_expert_parallel"] is True and e["enforce_eager"] is False
    assert "data_parallel_size" not in e  # one engine: one DP rank
    assert e["compilation_config"]["cudagraph_capture_sizes"][-1] == 256
    assert plan.ks == (0, 1, 3, 7) and plan.batch == (1, 8, 32, 128, 256) and plan.ctx == (1024,)
    assert e["max_num_batched_tokens"] == 3072 and e["dtype"] == "bfloat16"  # the setup's budget fits 256 x 8


def test_bad_grids_and_setups_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cmd = parse_train_script(TINY, env={**CLEAN, "MODEL_PATH": "/m/x"})
    with pytest.raises(CalibrateError, match="needs k = 0"):
        plan_from_command(cmd, ks="1,3")
    with pytest.raises(CalibrateError, match="comma-separated integers"):
        plan_from_command(cmd, batch="1,x")
    assert main(["--setup", str(tmp_path / "none.sh")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: calibrate:") and "not found" in err[0]


def test_help_says_how_long_and_where(capsys: pytest.CaptureFixture[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "qwen3_rl", "calibrate", "--help"], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert "A3" in out and "10-20 s" in out and "SAM_COST_TABLE" in out and "--out" in out
    assert default_out("internal/train_grpo_tiny_cpu.sh").name == "verify_cost_grpo_tiny_cpu.json"
    assert main(["--setup", str(TINY), "--k", "0,2", "--dry-run"]) == 0
    assert '"load_format": "dummy"' in capsys.readouterr().out


def test_launcher_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch calibrate`` (ray_start_npu.sh, head): SAM_COST_TABLE=calibrate runs the command and hands its table
    on; any other value (a file, empty) runs nothing."""
    assert calibrate_wanted({"SAM_COST_TABLE": "calibrate"}) and not calibrate_wanted({"SAM_COST_TABLE": "/t.json"})
    assert not calibrate_wanted({})
    env_out = tmp_path / "cal.env"
    args = ["--train-script", str(TINY), "--out", str(tmp_path / "t.json"), "--env-out", str(env_out)]
    ran = []

    def fake_run(cmd, **kw):  # noqa: ANN001, ANN003
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("SAM_COST_TABLE", "/t.json")
    assert cmd_calibrate(args) == 0 and env_out.read_bytes() == b"" and ran == []  # a table given: nothing to do
    monkeypatch.setenv("SAM_COST_TABLE", "calibrate")
    assert cmd_calibrate(args) == 0
    assert ran == [[sys.executable, "-m", "qwen3_rl", "calibrate", "--setup", str(TINY), "--out",
                    str(tmp_path / "t.json")]]
    assert env_out.read_bytes() == f"SAM_COST_TABLE={tmp_path / 't.json'}\0".encode()


def test_preflight_names_an_unreplaced_calibrate() -> None:
    from qwen3_rl.tools.launch.preflight import check_sam_cost_table

    sc = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config."
    (f,) = check_sam_cost_table({sc + "method": "sam", sc + "sam_config.cost_table": "calibrate"})
    assert "replaced by the launcher" in str(f) and "python -m qwen3_rl calibrate" in str(f)


def _grid_rows(ms: dict[tuple[int, int, int], float]) -> list[dict]:
    return [{"model": "m", "B": b, "k": k, "ctx": c, "step_ms": t} for (b, k, c), t in ms.items()]


def test_inversions_flag_a_row_cheaper_than_fewer_query_tokens() -> None:
    """A monotone grid has none; a longer draft at half the time of k = 0, or B = 4 at half of B = 1, is flagged
    against the dearest row with fewer query tokens; small noise within the tolerance is not."""
    clean = {(b, k, c): 1.0 + 0.1 * b + 0.05 * k + 0.01 * c for b in (1, 4) for k in (0, 1, 3) for c in (32, 128)}
    assert inversions(_grid_rows(clean)) == []
    noisy = dict(clean)
    noisy[(4, 1, 32)] = clean[(4, 0, 32)] * 0.9  # 10 % cheaper: within the 25 % tolerance
    assert inversions(_grid_rows(noisy)) == []
    bad = dict(clean)
    bad[(1, 3, 128)] = clean[(1, 1, 128)] / 2
    bad[(4, 0, 32)] = clean[(1, 0, 32)] * 0.6
    found = inversions(_grid_rows(bad))
    assert [(f["row"], f["than"]) for f in found] == [((1, 3, 128), (1, 1, 128)), ((4, 0, 32), (1, 0, 32))]
    assert found[0]["ratio"] == 0.5 and found[1]["ratio"] == 0.6
    assert inversions(_grid_rows(bad), tol=0.45) == [found[0]]  # 0.5 < 0.55, 0.6 is not


def test_engine_for_vllm_023_seats_sam_through_extension_points() -> None:
    """The seed set's vLLM keeps ``method="sam"``; vLLM 0.23 (no such method) gets the ``ngram`` seat and
    ``SamNPUWorker`` on the NPU platform, ``custom_class`` and ``SamCPUWorker`` elsewhere, with the options in
    ``additional_config`` (the measurement on vLLM-Ascend 0.23: tests/engine_current/test_current_ascend_sam.py)."""
    plan = plan_from_command(parse_train_script(TINY, env={**CLEAN, "MODEL_PATH": "/m/qwen3_tiny"}), ks="0,1,3")
    e = plan.engine
    assert engine_for_vllm(e, "0.13.0", "npu") == e
    npu = engine_for_vllm(e, "0.23.0", "npu")
    assert npu["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert npu["worker_cls"] == "qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker"
    assert npu["additional_config"] == {"qwen3_rl": {"sam_config": {"pad_drafts": True}}}
    cpu = engine_for_vllm(e, "0.23.0+cpu", "cpu")
    assert cpu["speculative_config"]["method"] == "custom_class" and cpu["worker_cls"].endswith("SamCPUWorker")
    assert {k: v for k, v in npu.items() if k not in ("speculative_config", "worker_cls", "additional_config")} == {
        k: v for k, v in e.items() if k != "speculative_config"}
    assert e["speculative_config"]["method"] == "sam"  # the plan is untouched
