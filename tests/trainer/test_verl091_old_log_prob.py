"""USE_CURRENT_LOG_PROB_AS_OLD on the current pin set (verl 0.9.1): the old-log-prob pass skipped through verl's
extension points (``qwen3_rl.trainer.verl091_old_log_prob``), checked on verl 0.9.1's own code on CPU.

``tests/helpers/verl091_old_log_prob_driver.py`` runs in the verl 0.9.1 venv on the pristine tree:

* per policy-loss mode (vanilla, gspo, geo_mean, cispo), verl's ``ppo_loss`` on a tiny next-token model: the loss and
  its gradients with ``old_log_probs`` from a separate no-grad forward (upstream's old-log-prob pass) equal
  ``on_policy_ppo_loss``'s (old = this forward's log-probs, detached) exactly; with ``old_log_probs`` = a
  ``ROLLOUT_MISMATCH`` stand-in of the rollout engine's log-probs (recomputed + Gaussian, std 0.05 nats: what
  ``bypass_mode`` puts there) they differ: the ratio is pi / pi_rollout, not 1;
* verl 0.9.1's Megatron engine (TP 1, float32, the engine driver's device layer and batch), one ``update_actor``
  step: upstream (``infer_batch`` for ``old_log_probs``, then ``train_mini_batch`` with ``ppo_loss``) and ours
  (``train_mini_batch`` on a batch without ``old_log_probs``, ``on_policy_ppo_loss``, ``calculate_entropy`` on) give
  the same parameters, loss and gradient norm, and the same ``actor/entropy`` (upstream: the trainer's ``agg_loss``
  of the pass's entropy; ours: the update's ``actor/entropy_loss``); ``infer_batch`` ran once upstream, never with
  ours;
* the recipe's trainer class (trainer mode ``qwen3_rl_sync``): ``_compute_old_log_prob`` with the switch on calls
  the worker group's ``compute_log_prob`` 0 times and returns the batch; off (positive control) it reaches the call
  (1); with it on, ``_update_actor`` sends ``calculate_entropy`` and logs ``actor/entropy`` (off: neither); the
  start-up check refuses two mini-batches, two epochs, ``bypass_mode`` and rollout log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_verl091_dry_run as base
import torch

from conftest import REPO, free_port
from helpers.current_verl import pristine_verl, run_in_venv

DRIVER = REPO / "tests" / "helpers" / "verl091_old_log_prob_driver.py"
ENGINE_PATH = [REPO / "tests" / "helpers" / "grouped_gemm_cpu", REPO / "qwen3_rl" / "cpu_device", REPO]
MODES = ["vanilla", "gspo", "geo_mean", "cispo"]
PARAM_ATOL = 1e-6  # the seed set's bound for the same comparison (tests/trainer/test_old_log_prob.py)


@pytest.fixture(scope="module")
def driver_out(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("olp") / "out.json"
    proc = run_in_venv([str(DRIVER), str(out)], path=[pristine_verl(), REPO], timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def engine_out(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from qwen3_rl.tools.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("olp_engine")
    model = make_tiny_model(tmp / "dense")
    res = {}
    for kind in ("upstream", "current"):
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": "1",
            "RANK": "0",
            "LOCAL_RANK": "0",
        }
        proc = run_in_venv(
            [str(DRIVER), "engine", str(model), str(tmp / f"{kind}.pt"), kind],
            path=[pristine_verl(), *ENGINE_PATH],
            timeout=900,
            env=env,
        )
        assert proc.returncode == 0, f"{kind}: {proc.stderr[-5000:]}"
        res[kind] = torch.load(tmp / f"{kind}.pt", weights_only=False)
    return res


@pytest.mark.parametrize("mode", MODES)
def test_current_log_prob_equals_recomputed_and_bypass_does_not(driver_out: dict, mode: str) -> None:
    r = driver_out["loss"][mode]
    assert driver_out["versions"]["verl"] == "0.9.1"
    assert r["current"] == r["recomputed"], r
    assert r["grad_diff_current"] == 0.0, r
    assert r["ratio_current_max_dev"] == 0.0 and r["ratio_recomputed_max_dev"] == 0.0, r
    assert r["grad_norm"] > 0.1, r  # the gradients compared are not zero
    # bypass_mode's old = the rollout's log-probs: ratio pi / pi_rollout != 1, another loss and gradient
    assert r["ratio_bypass_max_dev"] > 0.01, r
    assert abs(r["bypass"] - r["recomputed"]) > 1e-3 and r["grad_diff_bypass"] > 1e-4, r
    print(
        f"{mode}: loss recomputed {r['recomputed']:.9g} current {r['current']:.9g} (grad diff "
        f"{r['grad_diff_current']:.3g}); bypass {r['bypass']:.9g} (grad diff {r['grad_diff_bypass']:.3g}, "
        f"|ratio - 1| up to {r['ratio_bypass_max_dev']:.3g}; grad norm {r['grad_norm']:.3g})"
    )


def test_megatron_engine_step_same_without_the_old_log_prob_pass(engine_out: dict) -> None:
    up, cur = engine_out["upstream"], engine_out["current"]
    assert up["infer_calls"] == 1 and up["has_old_log_probs"], "positive control: upstream's pass ran"
    assert cur["infer_calls"] == 0 and not cur["has_old_log_probs"]
    names = list(up["params_before"])
    assert names == list(cur["params_before"])
    assert all(torch.equal(up["params_before"][k], cur["params_before"][k]) for k in names)
    moved = [k for k in names if not torch.equal(up["params_after"][k], up["params_before"][k])]
    assert moved == names, "the step moves every parameter"
    diff = max(float((up["params_after"][k] - cur["params_after"][k]).abs().max()) for k in names)
    assert diff <= PARAM_ATOL, diff
    for key in ("loss", "grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert up["metrics"][key] == cur["metrics"][key], (key, up["metrics"][key], cur["metrics"][key])
    print(
        f"{len(names)} parameters after one step: max |upstream - current| = {diff:.3g}; loss "
        f"{cur['metrics']['loss']}, grad_norm {cur['metrics']['grad_norm']}; infer_batch calls 1 vs 0"
    )


def test_entropy_metric_kept_without_the_old_log_prob_pass(engine_out: dict) -> None:
    """``actor/entropy`` with the switch (the training forward's ``actor/entropy_loss``, ``calculate_entropy`` on)
    equals the one upstream's trainer computes from its old-log-prob pass (``agg_loss`` of the pass's entropy)."""
    up, cur = engine_out["upstream"], engine_out["current"]
    assert "actor/entropy_loss" not in up["metrics"], "control: entropy_coeff 0 alone computes no entropy"
    assert "actor/entropy_loss" in cur["metrics"], sorted(cur["metrics"])
    assert up["actor/entropy"] > 0.1, up["actor/entropy"]  # the tiny model's entropy, nats per token
    # the same weights' forward (without grad in the pass, with it in the update) and the same aggregation: equal
    diff = abs(cur["actor/entropy"] - up["actor/entropy"])
    assert cur["actor/entropy"] == up["actor/entropy"], (up["actor/entropy"], cur["actor/entropy"])
    print(
        f"actor/entropy: old-log-prob pass {up['actor/entropy']!r}, training forward {cur['actor/entropy']!r} "
        f"(|diff| {diff:.3g})"
    )


def test_trainer_skips_compute_log_prob_only_with_the_switch(driver_out: dict) -> None:
    s = driver_out["skip"]
    assert s["mro"][:3] == ["SpecDecodeMetricsTrainer", "OnPolicyOldLogProbMixin", "PPOTrainerSync"], s["mro"]
    on, off = s["switch_True"], s["switch_False"]
    assert on == {
        "calls": 0,
        "reached": False,
        "same_batch": True,
        "extra_info": {},
        "loss_fn": "on_policy_ppo_loss",
        # the update's forward computes entropy and its actor/entropy_loss is logged as actor/entropy too
        "update_calculate_entropy": [True],
        "update_metrics": {
            "actor/pg_loss": 0.25,
            "actor/entropy_loss": 0.625,
            "actor/entropy": 0.625,
            "perf/mfu/actor": 0.0,
        },
    }, on
    assert off["calls"] == 1 and off["reached"], off  # positive control: upstream's pass
    assert off["extra_info"].get("compute_loss") is False, off
    # switch off: upstream's update (entropy_coeff 0) computes no entropy; its actor/entropy is the pass's
    assert off["update_calculate_entropy"] == [False] and "actor/entropy" not in off["update_metrics"], off
    assert s["switch_default"] is False
    want = {
        "two_mini_batches": "ppo_mini_batch_size=8 != data.train_batch_size=16",
        "two_epochs": "ppo_epochs=2",
        "bypass": "bypass_mode=True",
        "rollout_log_probs": "calculate_log_probs=True",
    }
    for case, text in want.items():
        assert s["refusals"][case] is not None and text in s["refusals"][case], (case, s["refusals"][case])


def test_driver_path_is_the_pristine_tree(driver_out: dict) -> None:
    assert Path(driver_out["verl_file"]).is_relative_to(pristine_verl()), driver_out["verl_file"]


#: the switch alone, and with SAM (both need trainer mode qwen3_rl_sync: the key once)
DRY_CASES = {
    "olp": {"USE_CURRENT_LOG_PROB_AS_OLD": "True"},
    "olp_sam": {"USE_CURRENT_LOG_PROB_AS_OLD": "True", "SAM_ENABLE": "True"},
}
OLP_KEYS = [
    "+qwen3_rl.old_log_prob.enable=True",
    "trainer.v1.trainer_mode=qwen3_rl_sync",
    "actor_rollout_ref.rollout.calculate_log_probs=False",
]


@pytest.fixture(scope="module")
def dry_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per case and GRPO setup on the current set (the switches that stop it there by default off, as in
    ``test_verl091_dry_run.py``'s positive control): the printed command, or the script's stderr; and the dry run of
    ``tests/helpers/verl091_dry_run_driver.py`` (verl 0.9.1's compose, ``validate_config``, dataclass conversions)."""
    from qwen3_rl.tools import features as F
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    reg = F.load_registry()
    dense = make_tiny_model(tmp_path_factory.mktemp("olp_dry_model") / "dense", TinySpec())
    cases, out = [], {"overrides": {}, "stops": {}}
    for setup in base.GRPO:
        model = dense if "tiny" in setup else None
        off = base._off_switches(reg, setup, model)
        for case, switches in DRY_CASES.items():
            name = f"{case}:{setup}"
            env = base._env(off | switches, model)
            base._render_case(out, cases, name, setup, env, model)
    out["dry"] = base._dry_run(cases, tmp_path_factory.mktemp("olp_dry"))
    return out


@pytest.mark.parametrize("case", list(DRY_CASES))
@pytest.mark.parametrize("setup", base.GRPO)
def test_switch_keys_on_the_current_set_pass_verl091_checks(
    dry_outcomes: dict, setup: str, case: str
) -> None:
    name = f"{case}:{setup}"
    assert name not in dry_outcomes["stops"], dry_outcomes["stops"].get(name)
    overrides = dry_outcomes["overrides"][name]
    for want in OLP_KEYS:
        assert overrides.count(want) == 1, (want, overrides)
    assert len([o for o in overrides if o.startswith("trainer.v1.trainer_mode=")]) == 1, overrides
    r = dry_outcomes["dry"][name]
    assert r["ok"], f"{name}: {r['stage']}: {r['error']}"


def test_switch_keys_absent_with_the_switch_off(tmp_path: Path) -> None:
    """Positive control of the key checks: the tiny setup's default command on the current set has none of them."""
    from qwen3_rl.tools.launch.train_script import parse_train_script

    cmd = parse_train_script(REPO / "internal" / "train_grpo_tiny_cpu.sh", env=base._env(model=tmp_path))
    assert not [o for o in cmd.overrides if o in OLP_KEYS or o.lstrip("+").startswith("qwen3_rl.")], (
        cmd.overrides
    )
