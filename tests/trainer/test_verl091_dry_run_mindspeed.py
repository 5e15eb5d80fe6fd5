"""MindSpeed switches on the current pin set: ``FUSED_ROPE`` (every GRPO setup) and ``MOE_ALLTOALL_OVERLAP`` +
``MOE_ZERO_MEMORY=level1`` + ``MOE_ZERO_MEMORY_NUM_LAYERS=1`` (with ``FUSED_ROPE``, the MoE setups) print verl 0.9.1's
``actor.megatron.override_transformer_config`` keys (features.toml) and pass verl 0.9.1's start-up checks.

Each case runs the train script in print mode with ``PIN_SET=current`` and the case's switches (the switches that stop
the setup by default there turned off, as in ``test_verl091_dry_run.py``'s positive control), checks the printed
keys, then runs the dry run of ``tests/helpers/verl091_dry_run_driver.py`` in the verl 0.9.1 venv on the command and
reads back the composed ``override_transformer_config`` of the actor and of the reference policy (which takes the
actor's, ``trainer/config/ref/megatron_ref.yaml:23``). What MindSpeed does with the keys is checked in
``test_verl091_mindspeed_engine.py`` (verl's repatch, the engine). Positive control of the key checks: the same
setups with the switches at their defaults print none of these keys.
"""

from __future__ import annotations

import pytest
import test_verl091_dry_run as base

from qwen3_rl.tools import features as F
from qwen3_rl.tools.launch.train_script import parse_train_script

from conftest import REPO

OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"
REF_OTC = "actor_rollout_ref.ref.megatron.override_transformer_config"
MOE_SETUPS = ["train_grpo_qwen3_235b_128die_true_weight.sh", "train_grpo_qwen3_30b_a3b_32die.sh"]
FUSED_ROPE = {"FUSED_ROPE": "True"}
MOE = {
    **FUSED_ROPE,
    "MOE_ALLTOALL_OVERLAP": "True",
    "MOE_ZERO_MEMORY": "level1",
    "MOE_ZERO_MEMORY_NUM_LAYERS": "1",
}
#: the keys each case's command must carry (override_transformer_config.<key>: value as composed)
ROPE_KEYS = {"position_embedding_type": "rope", "use_fused_rotary_pos_emb": True}
MOE_KEYS = {
    **ROPE_KEYS,
    "moe_alltoall_overlap_comm": True,
    "moe_token_dispatcher_type": "alltoall",
    "moe_zero_memory": "level1",
    "moe_zero_memory_num_layers": 1,
}
CASES = {
    **{f"rope:{s}": (s, FUSED_ROPE, ROPE_KEYS) for s in base.GRPO},
    **{f"moe:{s}": (s, MOE, MOE_KEYS) for s in MOE_SETUPS},
}


@pytest.fixture(scope="module")
def ms_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per case: the printed command's overrides (or the script's stderr if it stopped), the default command's, and
    the dry run."""
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    reg = F.load_registry()
    dense = make_tiny_model(tmp_path_factory.mktemp("dry_run_ms_model") / "dense", TinySpec())
    cases, out = [], {"overrides": {}, "default": {}, "stops": {}}
    for name, (setup, switches, _) in CASES.items():
        model = dense if "tiny" in setup else None
        off = base._off_switches(reg, setup, model)
        out["default"][name] = parse_train_script(
            REPO / "internal" / setup, env=base._env(off, model)
        ).overrides
        env = base._env(off | switches, model)
        base._render_case(out, cases, name, setup, env, model, report=[OTC, REF_OTC])
    out["dry"] = base._dry_run(cases, tmp_path_factory.mktemp("dry_run_ms"))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_mindspeed_switch_keys_pass_verl091_checks(ms_outcomes: dict, case: str) -> None:
    want = CASES[case][2]
    assert case not in ms_outcomes["stops"], ms_outcomes["stops"].get(case)
    keys = {f"{OTC}.{k}" for k in want}  # the setups set others there too (recompute, pipeline stages)
    printed = [o for o in ms_outcomes["overrides"][case] if o.lstrip("+").partition("=")[0] in keys]
    assert sorted(printed) == sorted(f"+{OTC}.{k}={str(v)}" for k, v in want.items()), printed
    # positive control: none of them with the switches at their defaults
    default = [o for o in ms_outcomes["default"][case] if o.lstrip("+").partition("=")[0] in keys]
    assert default == [], default
    r = ms_outcomes["dry"][case]
    assert r["ok"], f"{case}: {r['stage']}: {r['error']}"
    for key in (OTC, REF_OTC):
        got = r["facts"]["keys"][key]
        assert {k: got.get(k) for k in want} == want, (key, got)
    print(f"{case}: clean, {len(printed)} keys in actor and ref override_transformer_config")
