"""The current set's trainer side with MindSpeed: verl 0.9.1's NPU Megatron engine (``MindspeedEngineWithLMHead``,
``verl/workers/engine/mindspeed/transformer_impl.py``) with MindSpeed core_r0.16.0's adaptor applied the way verl
applies it on an NPU, megatron-core 0.16.1, mbridge 0.15.1, TP 2 over gloo on CPU (issue 44/45: "nothing public
shows a Bridge running with MindSpeed core_r0.16.0").

``tests/helpers/verl091_mindspeed_driver.py`` (docstring: how verl applies MindSpeed, file:line; every stand-in and
why) runs in the verl 0.9.1 venv with the pinned MindSpeed tree (verified archive, ``patches/current/mindspeed``
applied) on ``PYTHONPATH``:

* ``adaptor``: ``import verl.workers.engine`` with the stand-ins and no other change: what the adaptor's import
  raised is recorded (the finding: MindSpeed's patch pass looks up every patched name on every loaded module,
  ``mindspeed/patch_utils.py:126-128``, and transformers 5's alias modules import their targets on any lookup,
  ``transformers/__init__.py:803-847``; without torchvision that raises, and verl's ``except ImportError: repatch =
  None``, ``transformer_impl.py:18-21``, turns it into an NPU engine with no MindSpeed patch, silently);
* ``engine``: the same with transformers' alias modules out of ``sys.modules`` when the adaptor is imported, then
  ``import verl.workers.engine`` (MindSpeed's adaptor, then Megatron), ``VERL_ENGINE_DEVICE=npu``, and the engine
  check of ``test_verl091_megatron_engine.py`` (its driver's ``engine_main``: ``TrainingWorker``, ``infer_batch``,
  ``train_mini_batch`` with ``ppo_loss``, ``get_per_tensor_param``).

The MindSpeed switches (features.toml ``FUSED_ROPE``, ``MOE_ALLTOALL_OVERLAP``, ``MOE_ZERO_MEMORY``,
``MOE_ZERO_MEMORY_NUM_LAYERS``): their current-set keys (``override_transformer_config``, rendered from features.toml)
reach MindSpeed through verl's own ``repatch`` (``transformer_impl.py:40-53``). The engine runs with ``FUSED_ROPE``'s
keys: MindSpeed's RoPE kernel (stand-in counted) runs and the log-probs still equal HF's. ``repatch`` mode (one
process, no engine) runs verl's ``_mindspeed_repatch`` on the actor's engine config per case and reads what MindSpeed's
runtime then sees: its args, megatron's MoE layer / shared-expert forward, the RoPE kernel in megatron's
``apply_rotary_pos_emb``, the TransformerConfig mbridge builds (fields, per-layer zero-memory choice). Positive
control: switches off, none of it; negative controls: the overlap without ``moe_token_dispatcher_type`` leaves
megatron's MoE layer, the fused RoPE without ``position_embedding_type`` is refused by MindSpeed.

Checked: the engine is verl's NPU class, MindSpeed's patches are applied (count printed, megatron's among them) and
in force (positive control: megatron's Transformer Engine classes are MindSpeed's, and MindSpeed's replacements ran:
the torch_npu kernels only they call, ``npu_rms_norm`` and ``npu_fusion_attention``, were called; without MindSpeed
the model's layers are the CPU TE stand-ins, which call none); log-probs equal HF transformers'; one step moves every
parameter and lowers the PPO loss; the rollout export is the engine's TP shards under HF names.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from qwen3_rl.tools import features as F

from conftest import REPO, free_port
from helpers.current_set import MINDSPEED, apply, series
from helpers.current_verl import pristine_verl, run_in_venv
from helpers.mindspeed_tree import pinned_mindspeed_workspace

LOGP_ATOL = 1e-5  # as the plain engine check: float32 log-probs of the same weights in two implementations
TP = 2
DRIVER = REPO / "tests" / "helpers" / "verl091_mindspeed_driver.py"
HF_DRIVER = REPO / "tests" / "helpers" / "verl091_engine_driver.py"
PATH = [REPO / "tests" / "helpers" / "grouped_gemm_cpu", REPO / "qwen3_rl" / "cpu_device", REPO]
OTC = "+actor_rollout_ref.actor.megatron.override_transformer_config."
MOE_SETUP = "train_dapo_tiny_cpu.sh"  # a MoE setup: every one of the four switches applies
FUSED_ROPE = {"FUSED_ROPE": "True"}
MOE = {"MOE_ALLTOALL_OVERLAP": "True", "MOE_ZERO_MEMORY": "level1", "MOE_ZERO_MEMORY_NUM_LAYERS": "1"}
#: MindSpeed's args with every switch on (MOE_ZERO_MEMORY_NUM_LAYERS=1)
ON_ARGS = {
    "use_fused_rotary_pos_emb": True,
    "position_embedding_type": "rope",
    "moe_alltoall_overlap_comm": True,
    "moe_token_dispatcher_type": "alltoall",
    "moe_zero_memory": "level1",
    "moe_zero_memory_num_layers": 1,
}


def switch_keys(switches: dict[str, str]) -> list[str]:
    """The ``override_transformer_config`` overrides features.toml renders for ``switches`` on the current set."""
    reg = F.load_registry()
    values = F.resolve(reg, MOE_SETUP, {"PIN_SET": "current", **switches}, {}, None, "current")
    return [o for o in F.render(reg, values, "current") if o.startswith(OTC)]


def _plain_check():
    """``test_verl091_megatron_engine`` (its layout maps and PPO loss), imported by path (tests/ has no packages)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "verl091_engine_check", REPO / "tests" / "trainer" / "test_verl091_megatron_engine.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ms_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MindSpeed core_r0.16.0 from the verified archive with the current series applied."""
    ws = pinned_mindspeed_workspace(tmp_path_factory.mktemp("ms16"), MINDSPEED)
    tree = ws / MINDSPEED.dir
    apply(tree, series("mindspeed"))
    return tree


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen3_rl.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "dense")


@pytest.fixture(scope="module")
def adaptor(ms_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("adaptor") / "adaptor.json"
    proc = run_in_venv(
        [str(DRIVER), "adaptor", str(out)], path=[pristine_verl(), ms_tree, *PATH], timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def run(ms_tree: Path, tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("engine")
    tree = pristine_verl()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(TP),
        "LOCAL_RANK": "0",
    }

    keys = switch_keys(FUSED_ROPE)
    assert len(keys) == 2, keys

    def rank(r: int):
        return run_in_venv(
            [str(DRIVER), "engine", str(tiny_dense), str(out), *keys],
            path=[tree, ms_tree, *PATH],
            timeout=900,
            env={**env, "RANK": str(r)},
        )

    with ThreadPoolExecutor(TP) as pool:
        procs = list(pool.map(rank, range(TP)))
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"engine rank {r} (exit {proc.returncode}):\n{proc.stderr[-5000:]}"
    proc = run_in_venv([str(HF_DRIVER), "hf", str(tiny_dense), str(out)], path=[tree, REPO], timeout=600)
    assert proc.returncode == 0, f"hf (exit {proc.returncode}):\n{proc.stderr[-5000:]}"
    return {
        "mindspeed": json.loads((out / "mindspeed.json").read_text()),
        "kernels": json.loads((out / "kernels.json").read_text()),
        "switch_args": json.loads((out / "switch_args.json").read_text()),
        "engine": torch.load(out / "engine.pt", weights_only=False),
        "shards": [torch.load(out / f"params_rank{r}.pt") for r in range(TP)],
        "hf": torch.load(out / "hf.pt", weights_only=False),
    }


@pytest.fixture(scope="module")
def repatch(ms_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """verl's ``_mindspeed_repatch`` per case in one process (driver ``repatch`` mode): {case: what MindSpeed sees}."""
    tmp = tmp_path_factory.mktemp("repatch")
    on = switch_keys({**FUSED_ROPE, **MOE})
    cases = [
        {"name": "off", "overrides": switch_keys({})},
        {"name": "no_dispatcher", "overrides": [k for k in on if "moe_token_dispatcher_type" not in k]},
        {
            "name": "no_position_type",
            "overrides": [k for k in switch_keys(FUSED_ROPE) if "position_embedding" not in k],
        },
        {"name": "on", "overrides": on},
    ]
    assert cases[0]["overrides"] == [] and len(on) == 6 and all(len(c["overrides"]) for c in cases[1:]), cases
    (tmp / "cases.json").write_text(json.dumps(cases))
    proc = run_in_venv(
        [str(DRIVER), "repatch", str(tmp / "cases.json"), str(tmp / "out.json")],
        path=[pristine_verl(), ms_tree, *PATH],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {c["name"]: c for c in json.loads((tmp / "out.json").read_text())}


def test_switches_reach_mindspeed_through_verls_repatch(repatch: dict[str, dict]) -> None:
    on, off = repatch["on"], repatch["off"]
    print(f"\non: {on['args']}\n  {on['classes']}\n  level1 layers: {on['only_recompute_activation']}")
    assert on["override"] == ON_ARGS and on["args"] == ON_ARGS and on["config"] == ON_ARGS, on
    assert on["classes"] == {
        "MoELayer": "mindspeed.core.transformer.moe.moe_feature.adaptor.MindSpeedAlltoAllOverlapMoeLayerAdaptor",
        "SharedExpertMLP.forward": (
            "mindspeed.core.transformer.moe.moe_feature.overlap.experts.zero_memory_shared_expert_mlp_forward"
        ),
        "MLP.__init__": "mindspeed.core.transformer.moe.moe_feature.overlap.moe_common.mlp_init",
    }, on["classes"]
    # MindSpeed's RoPE kernel ran (same result as the unfused path of the "off" case)
    assert on["rope_kernel_calls"] == 1 and on["rope_equal_to_first"] is True, on
    # MOE_ZERO_MEMORY_NUM_LAYERS=1: the first layer of the stage keeps the full level1 (False), the rest only the
    # activation's recompute
    assert on["only_recompute_activation"] == [False, True, True, True], on
    # positive control: the switches off
    print(f"off: {off['args']}\n  {off['classes']}")
    assert off["override"] == {} and off["args"]["use_fused_rotary_pos_emb"] is False, off
    assert (
        off["args"]["moe_alltoall_overlap_comm"] is False and off["args"]["moe_zero_memory"] == "disable"
    ), off
    assert off["args"]["moe_zero_memory_num_layers"] is None, off
    assert not any(v.startswith("mindspeed.") for v in off["classes"].values()), off["classes"]
    assert off["rope_kernel_calls"] == 0 and off["only_recompute_activation"] == [False] * 4, off


def test_negative_controls_dispatcher_and_position_type_are_needed(repatch: dict[str, dict]) -> None:
    """Why the current set's keys are these: without ``moe_token_dispatcher_type`` (no MindSpeed arg under verl,
    ``args`` "<absent>") the overlap leaves megatron's MoE layer; without ``position_embedding_type`` MindSpeed
    refuses the TransformerConfig with the fused RoPE on."""
    nd = repatch["no_dispatcher"]
    assert (
        nd["args"]["moe_alltoall_overlap_comm"] is True
        and nd["args"]["moe_token_dispatcher_type"] == "<absent>"
    )
    assert nd["classes"]["MoELayer"] == "megatron.core.transformer.moe.moe_layer.MoELayer", nd["classes"]
    npt = repatch["no_position_type"]
    print(f"\nno position_embedding_type: {npt.get('tf_config_error')}")
    assert npt["args"]["use_fused_rotary_pos_emb"] is True
    assert "position_embedding_type" in npt.get("tf_config_error", ""), npt


def test_without_torchvision_verl_keeps_its_npu_engine_without_mindspeed_silently(adaptor: dict) -> None:
    """The finding: MindSpeed's first patch pass dies in its module scan on a transformers 5 alias module; verl
    swallows the ImportError and keeps its NPU engine class with no MindSpeed patch in force."""
    err = adaptor["error"]
    assert err is not None and err["type"] == "ModuleNotFoundError" and "torchvision" in err["message"], err
    frames = err["frames"]
    verl = [f for f in frames if "verl/workers/engine/mindspeed/transformer_impl.py:" in f]
    scan = [f for f in frames if f.endswith(" apply_patch") and "mindspeed/patch_utils.py:" in f]
    alias = [f for f in frames if "transformers/__init__.py:" in f and f.endswith(" _getattr")]
    print(f"\nadaptor import: {err['type']}: {err['message']}\n  {verl} -> {scan} -> {alias}")
    assert verl and scan and alias, frames
    assert (
        adaptor["engine_class"] == "verl.workers.engine.mindspeed.transformer_impl.MindspeedEngineWithLMHead"
    )
    assert adaptor["repatch_is_none"] is True  # transformer_impl.py:18-21: the engine will not repatch either
    # nothing applied: the pre-patch pass stopped at its first patch; megatron's were never registered
    assert adaptor["registered"] and adaptor["applied"] == [] and adaptor["megatron_applied"] == []
    print(f"megatron's TE classes then: {adaptor['te_classes']}")
    assert not any(c.startswith("mindspeed.") for c in adaptor["te_classes"].values())


def test_it_is_verl_091s_npu_engine_with_mindspeed_applied(run: dict, ms_tree: Path) -> None:
    ms, eng = run["mindspeed"], run["engine"]
    assert (
        eng["engine_class"]
        == ms["engine_class"]
        == ("verl.workers.engine.mindspeed.transformer_impl.MindspeedEngineWithLMHead")
    )
    assert {k: eng["versions"][k] for k in ("verl", "megatron-core", "mbridge")} == {
        "verl": "0.9.1",
        "megatron-core": "0.16.1",
        "mbridge": "0.15.1",
    }
    assert Path(ms["mindspeed_file"]).resolve().is_relative_to(ms_tree.resolve())
    assert ms["repatch_is_none"] is False and ms["adaptor_in_sys_modules"]
    print(
        f"\nMindSpeed core_r0.16.0: {len(ms['applied'])} patches applied ({len(ms['registered'])} registered), "
        f"{len(ms['megatron_applied'])} of them on megatron-core; transformers aliases hidden: {ms['aliases_hidden']}"
    )
    assert set(ms["applied"]) == set(ms["registered"]) and len(ms["megatron_applied"]) > 20
    # positive control: the classes mbridge's TE spec builds are MindSpeed's (unpatched: the CPU stand-ins)
    for name, cls in ms["te_classes"].items():
        assert cls.startswith("mindspeed.te.pytorch."), (name, cls)
    # ... and they ran: the torch_npu kernels MindSpeed's TE norm-linear and flash attention call (rank 0's counts)
    print(f"torch_npu kernel stand-ins called: {run['kernels']}")
    assert run["kernels"].get("npu_rms_norm", 0) > 0 and run["kernels"].get("npu_fusion_attention", 0) > 0
    # FUSED_ROPE's keys: MindSpeed's args after the engine's repatch, and its RoPE kernel ran in the engine
    assert run["switch_args"]["use_fused_rotary_pos_emb"] is True, run["switch_args"]
    assert run["switch_args"]["position_embedding_type"] == "rope", run["switch_args"]
    assert run["kernels"].get("npu_rotary_position_embedding", 0) > 0, run["kernels"]


def test_log_probs_equal_hf_transformers(run: dict) -> None:
    eng, hf = run["engine"], run["hf"]
    mask = eng["batch"]["response_mask"].bool()
    diff = float((eng["logp_before"] - hf["logp_hf"])[mask].abs().max())
    print(f"\nverl 0.9.1 NPU engine + MindSpeed (TP {TP}) vs transformers: max |log-prob diff| = {diff:.2e}")
    assert mask.sum() == 10 and bool((hf["logp_hf"][mask] < 0).all())
    torch.testing.assert_close(eng["logp_before"][mask], hf["logp_hf"][mask], rtol=0, atol=LOGP_ATOL)


def test_one_step_changes_every_weight_and_lowers_the_loss(run: dict) -> None:
    check = _plain_check()
    eng = run["engine"]
    mask = eng["batch"]["response_mask"].bool()
    before = check.full_params([s["params_before"] for s in run["shards"]])
    after = check.full_params([s["params_after"] for s in run["shards"]])
    moved = {k: float((after[k] - before[k]).abs().max()) for k in before}
    old, adv = eng["logp_before"], eng["batch"]["advantages"]
    print(
        f"\nloss {eng['loss_before']:.6f} -> {eng['loss_after']:.6f}; "
        f"{sum(v > 0 for v in moved.values())} of {len(moved)} parameters moved"
    )
    assert len(moved) == 19 and all(v > 0 for v in moved.values()), moved
    assert eng["loss_before"] == pytest.approx(check.ppo_loss(old, old, adv, mask), abs=1e-6)
    assert eng["loss_after"] == pytest.approx(check.ppo_loss(eng["logp_after"], old, adv, mask), abs=1e-6)
    assert eng["loss_after"] < eng["loss_before"] - 0.01


def test_rollout_export_is_the_engines_tp_shards(run: dict, tiny_dense: Path) -> None:
    check = _plain_check()
    eng, hf = run["engine"], run["hf"]
    files, after = hf["file_tensors"], eng["export_after"]
    assert sorted(eng["export_before"]) == sorted(files)
    assert all(torch.equal(eng["export_before"][k], files[k]) for k in files)
    cfg = json.loads((tiny_dense / "config.json").read_text())
    engine_hf = check.to_hf(check.full_params([s["params_after"] for s in run["shards"]]), cfg)
    assert sorted(engine_hf) == sorted(after) == sorted(files)
    differ = sorted(k for k in after if not torch.equal(after[k], engine_hf[k]))
    print(
        f"\nexport after the step: {len(after) - len(differ)} of {len(after)} HF tensors = the engine's TP shards"
    )
    assert differ == []
    assert hf["missing"] == [] and hf["unexpected"] == []
