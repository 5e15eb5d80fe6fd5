"""SAM and gc control on the current pin set: the GRPO setups' commands with ``SAM_*`` / ``DISABLE_GC_IN_ENGINE_STEP``
on carry verl 0.9.1's ``rollout.engine_kwargs.vllm`` keys (features.toml ``current.sets``) and pass verl 0.9.1's
start-up checks.

Each case runs the train script in print mode with ``PIN_SET=current`` and the case's switches (the switches that
stop the setup by default there turned off, as in ``test_verl091_dry_run.py``'s positive control), checks the
keys in the printed command, then runs the dry run of ``tests/helpers/verl091_dry_run_driver.py`` in the verl 0.9.1
venv on it (Hydra compose of ``ppo_megatron_trainer.yaml``, ``auto_set_device``, ``validate_config``, the V1
trainer's dataclass conversions; the tiny setup's model too). What the keys do in the engine is checked where an
engine runs: ``tests/engine_verl091/test_verl091_vllm_server.py`` starts verl 0.9.1's server from the same
command's keys.

Cases: ``sam`` (SAM group mode + history 4 + gc control), ``sam_adaptive`` (adaptive k, k <= 15, a cost table
file), ``gc_only`` (gc control without SAM: the worker key once, no SAM key).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_verl091_dry_run as base

from qwen3_rl.tools import features as F
from qwen3_rl.tools.launch.train_script import parse_train_script

from conftest import REPO

#: SAM and gc control on, per case (the cost table's path is added to ``sam_adaptive``)
SAM_CASES = {
    "sam": {
        "SAM_ENABLE": "True",
        "SAM_GROUP": "True",
        "SAM_HISTORY": "4",
        "DISABLE_GC_IN_ENGINE_STEP": "True",
    },
    "sam_adaptive": {"SAM_ENABLE": "True", "SAM_GROUP": "True", "SAM_ADAPTIVE_K": "True", "SAM_K_MAX": "15"},
    "gc_only": {"DISABLE_GC_IN_ENGINE_STEP": "True"},
}
EK = "+actor_rollout_ref.rollout.engine_kwargs.vllm."
WORKER = EK + "worker_cls=qwen3_rl.spec_decode.rollout_worker.SamWorker"
SCHEDULER = EK + "scheduler_cls=qwen3_rl.rollout.gc_scheduler.GcStepScheduler"
#: overrides each case's command must carry (an entry ending in "=" is a key whose value is the case's own)
SAM_KEYS = {
    "sam": [
        WORKER,
        EK + "speculative_config.method=ngram",
        EK + "speculative_config.num_speculative_tokens=3",
        EK + "additional_config.qwen3_rl.sam_config.group_mode=True",
        EK + "additional_config.qwen3_rl.sam_config.history_responses=4",
        EK + "additional_config.qwen3_rl.sam_config.history_max_bytes=0",
        EK + "additional_config.qwen3_rl.sam_config.history_drafters=",
        SCHEDULER,
        EK + "additional_config.qwen3_rl.disable_gc=True",
        "actor_rollout_ref.rollout.disable_log_stats=False",
    ],
    "sam_adaptive": [
        WORKER,
        EK + "speculative_config.method=ngram",
        EK + "speculative_config.num_speculative_tokens=15",
        EK + "additional_config.qwen3_rl.sam_config.group_mode=True",
        EK + "additional_config.qwen3_rl.sam_config.adaptive_k=True",
        EK + "additional_config.qwen3_rl.sam_config.cost_table=",
    ],
    "gc_only": [WORKER, SCHEDULER, EK + "additional_config.qwen3_rl.disable_gc=True"],
}


@pytest.fixture(scope="module")
def sam_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per case and GRPO setup: the printed command (or the script's stderr if it stopped) and its dry run."""
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    reg = F.load_registry()
    dense = make_tiny_model(tmp_path_factory.mktemp("dry_run_sam_model") / "dense", TinySpec())
    table = tmp_path_factory.mktemp("cost_table") / "verify_cost.json"
    table.write_text("[]")  # read by the engine's drafter, not by verl's start-up checks
    cases, out = [], {"overrides": {}, "stops": {}, "off": {}}
    for setup in base.GRPO:
        model = dense if "tiny" in setup else None
        stops = base._expected_stops(setup, base._env(model=model))
        off = {n: base._off_value(reg.features[n]) for n in stops}
        out["off"][setup] = off
        for case, switches in SAM_CASES.items():
            name = f"{case}:{setup}"
            extra = dict(switches, **({"SAM_COST_TABLE": str(table)} if case == "sam_adaptive" else {}))
            env = base._env(off | extra, model)
            base._render_case(out, cases, name, setup, env, model)
    out["dry"] = base._dry_run(cases, tmp_path_factory.mktemp("dry_run_sam"))
    return out


@pytest.mark.parametrize("case", list(SAM_CASES))
@pytest.mark.parametrize("setup", base.GRPO)
def test_sam_and_gc_switches_reach_verl091_keys_and_pass_its_checks(
    sam_outcomes: dict, setup: str, case: str
) -> None:
    name = f"{case}:{setup}"
    assert name not in sam_outcomes["stops"], sam_outcomes["stops"].get(name)
    overrides = sam_outcomes["overrides"][name]
    for want in SAM_KEYS[case]:
        hit = [o for o in overrides if (o.startswith(want) if want.endswith("=") else o == want)]
        assert len(hit) == 1, (want, overrides)
    # one worker_cls whatever the switches; no SAM key while SAM is off; no key of the seed set's verl seam
    assert len([o for o in overrides if o.startswith(EK + "worker_cls=")]) == 1, overrides
    if case == "gc_only":
        assert not [o for o in overrides if "speculative_config" in o or "sam_config" in o], overrides
    assert not [o for o in overrides if o.lstrip("+").startswith("qwen3_rl.")], overrides
    r = sam_outcomes["dry"][name]
    assert r["ok"], f"{name} (with {sam_outcomes['off'][setup]}): {r['stage']}: {r['error']}"
    print(f"{name}: clean, {len([o for o in overrides if o.startswith(EK)])} engine_kwargs.vllm keys")


def test_sam_keys_absent_with_the_switches_off(tmp_path: Path) -> None:
    """Positive control of the key checks: the tiny setup's default command on the current set has no SAM / gc key
    (its layout's own ``engine_kwargs.vllm.compilation_config`` stays)."""
    cmd = parse_train_script(REPO / "internal" / "train_grpo_tiny_cpu.sh", env=base._env(model=tmp_path))
    ours = ("worker_cls=", "scheduler_cls=", "speculative_config.", "additional_config.qwen3_rl.")
    assert not [o for o in cmd.overrides if o.startswith(tuple(EK + k for k in ours))], cmd.overrides
    assert "actor_rollout_ref.rollout.disable_log_stats=False" not in cmd.overrides
