"""The verl seam (patches/verl/0014): patched verl imports without qwen3_rl, and with the group empty it is
upstream's config; the package validates the group into one dataclass per feature, defaults declared once."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from conftest import PINS, REPO, run_python

PROBE = r"""
import importlib.util, sys
# an editable install of the checkout (pip install -e) would put qwen3_rl back through its finder: drop it
sys.path[:] = [p for p in sys.path if "__editable__" not in str(p)]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") or "")
                    and "editable" not in getattr(f, "__name__", "")]
sys.path_importer_cache.clear()
assert importlib.util.find_spec("qwen3_rl") is None, f"qwen3_rl is on the path {sys.path}"
import verl.trainer.ppo.ray_trainer as rt
import verl.workers.rollout.vllm_rollout.vllm_rollout_spmd as spmd
from verl.utils.qwen3_rl_hooks import actor_hooks, rollout_hooks, trainer_hooks, weight_sync_hooks
from verl.workers.config import McoreActorConfig
from omegaconf import OmegaConf
assert trainer_hooks(OmegaConf.create({"qwen3_rl": {}})) is None and rollout_hooks({"qwen3_rl": {}}) is None
assert actor_hooks(OmegaConf.create({"qwen3_rl": {}})) is None
assert McoreActorConfig(use_dynamic_bsz=True, rollout_n=1, ppo_mini_batch_size=1).qwen3_rl == {}
# the weight-sync side: the hook factory with the group empty (its call sites: the static test below)
assert weight_sync_hooks(OmegaConf.create({"qwen3_rl": {}}), uses_bridge=True) is None
print("ok", rt.RayPPOTrainer.__name__, spmd.vLLMRollout.__name__,
      sorted(m for m in sys.modules if m.startswith("qwen3_rl")))
"""


def _probe(paths: tuple[Path | str, ...], cwd: Path):
    """The probe in a fresh interpreter whose environment holds only PATH, HOME, the vLLM CPU switches and
    PYTHONPATH = ``paths`` (nothing a test before may have exported)."""
    import os
    import subprocess
    import sys

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "VLLM_PLUGINS": "none", "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": os.pathsep.join(map(str, paths))}
    return subprocess.run([sys.executable, "-s", "-c", PROBE], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def _paths(ws: Path, pristine: Path) -> tuple[Path, ...]:
    """Patched verl; vLLM and Megatron from the pristine pins (their series are checked on their own)."""
    return (ws / PINS.frameworks["verl"].dir, pristine / PINS.frameworks["vllm"].dir,
            pristine / PINS.frameworks["megatron"].dir, ws / ".dist-info")


def test_patched_verl_imports_without_qwen3_rl(patched_imports: Path, pristine_workspace: Path, tmp_path: Path) -> None:
    """ray_trainer, the SPMD rollout and the hooks import from the patched tree in a process whose path has no
    qwen3_rl; the actor's hook object is None with the group empty. The Megatron actor and the mcore forward
    name nothing of the package, at module level or lazily (both import verl.utils.megatron_utils, whose
    weight-sync feature patch still imports the package at module level, so they are checked on their source)."""
    proc = _probe(_paths(patched_imports, pristine_workspace), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("ok RayPPOTrainer vLLMRollout []"), proc.stdout
    # positive control: the same probe sees the package when the checkout is on the path
    ctl = _probe((*_paths(patched_imports, pristine_workspace), REPO), tmp_path)
    assert ctl.returncode != 0 and "qwen3_rl is on the path" in ctl.stderr
    import ast

    for rel, hooks_import in (("verl/workers/actor/megatron_actor.py", True), ("verl/models/mcore/model_forward.py", False)):
        tree = ast.parse((patched_imports / PINS.frameworks["verl"].dir / rel).read_text())
        mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        mods += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in mods if m.split(".")[0] == "qwen3_rl"], (rel, mods)  # only through the hook object
        assert ("verl.utils.qwen3_rl_hooks" in mods) is hooks_import, rel


def test_weight_sync_side_imports_nothing_of_ours_at_module_level(patched_imports: Path) -> None:
    """The files of the weight-sync hook points (megatron_utils.per_tensor_generator, the converter script, the
    MoE loader fix) import qwen3_rl only inside functions (static: importing them needs megatron-core, which the
    probe above leaves out to stay fast; the loader fix is imported for real by tests/moe/test_moe_update_weights.py);
    positive control: a module-level import is found."""
    import ast

    def top_level(tree: ast.Module) -> list[str]:
        return [n.module or "" if isinstance(n, ast.ImportFrom) else n.names[0].name for n in tree.body
                if isinstance(n, ast.Import | ast.ImportFrom)]

    root = patched_imports / PINS.frameworks["verl"].dir
    for rel in ("verl/utils/megatron_utils.py", "scripts/converter_hf_to_mcore.py", "verl/utils/vllm/patch.py",
                "verl/utils/qwen3_rl_hooks.py"):
        text = (root / rel).read_text()
        mods = top_level(ast.parse(text))
        assert mods and not [m for m in mods if m.startswith("qwen3_rl")], rel
    assert "qwen3_rl" not in (root / "verl/utils/vllm/patch.py").read_text()  # the bug fix is self-contained
    assert top_level(ast.parse("import os\nfrom qwen3_rl.moe import x\n")) == ["os", "qwen3_rl.moe"]


def test_group_empty_config_equals_unseamed(patched_imports: Path, make_workspace, tmp_path: Path) -> None:
    """Both trainer configs composed from the patched tree, minus the qwen3_rl group (root and its rollout
    interpolation), equal those of the same series without the seam patch: with the group empty the seam
    adds nothing else. (The bug-fix and remaining feature patches add their own declared keys, e.g.
    rollout.npu_expandable_segments; pristine verl 0.6.1 lacks those.)"""
    import json
    import subprocess

    code = r"""
import json, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
out = {}
for name in ("ppo_trainer", "ppo_megatron_trainer"):
    with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
        cfg = compose(config_name=name)
    OmegaConf.resolve(cfg)
    out[name] = OmegaConf.to_container(cfg)
print(json.dumps(out))
"""
    ws = make_workspace("verl")
    tree = ws / PINS.frameworks["verl"].dir
    series = sorted((REPO / "patches" / "verl").glob("*.patch"))
    seam = [p for p in series if "qwen3_rl_seam" in p.name]
    assert len(seam) == 1
    for p in series:
        if p not in seam:
            subprocess.run(["git", "apply", str(p)], cwd=tree, check=True)

    def composed(root: Path) -> dict:
        d = root / "verl" / "trainer" / "config"
        proc = run_python(code, str(d), path=(root,), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    patched, unseamed = composed(patched_imports / PINS.frameworks["verl"].dir), composed(tree)
    for name in ("ppo_trainer", "ppo_megatron_trainer"):
        p = patched[name]
        assert p.pop("qwen3_rl") == {} and p["actor_rollout_ref"]["rollout"].pop("qwen3_rl") == {}
        assert p["actor_rollout_ref"]["actor"].pop("qwen3_rl") == {}
        assert p == unseamed[name], name
    from verl.workers.config import RolloutConfig

    assert RolloutConfig(name="vllm").qwen3_rl == {}


def test_actor_hooks_only_for_actor_features(patched_imports: Path) -> None:
    """The Megatron actor's hook object exists only while the group enables an actor feature: with other
    features on (or actor features set off) it is None and the actor runs upstream's code paths; the
    group reaches the actor as ``actor_rollout_ref.actor.qwen3_rl`` (an interpolation of the root group)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.qwen3_rl_hooks import actor_hooks

    from qwen3_rl.trainer.seam import ActorHooks, SeamConfigError

    d = patched_imports / PINS.frameworks["verl"].dir / "verl" / "trainer" / "config"
    with initialize_config_dir(config_dir=str(d), version_base=None):
        cfg = compose(config_name="ppo_megatron_trainer", overrides=[
            "+qwen3_rl.progress_bar.enable=True", "+qwen3_rl.old_log_prob.enable=False",
            "+qwen3_rl.hdp.enable=False", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.n=1"])
    actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor_cfg.qwen3_rl["progress_bar"] == {"enable": True}
    assert actor_hooks(actor_cfg) is None  # a group without an actor feature on: upstream's actor
    cfg.qwen3_rl.hdp.enable = True
    on = actor_hooks(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor))
    assert isinstance(on, ActorHooks) and on.recipe.hdp.enable and not on.use_current_log_prob
    OmegaConf.set_struct(cfg, False)
    cfg.qwen3_rl.hdp.token_budget = "many"
    with pytest.raises(SeamConfigError, match="qwen3_rl.hdp.token_budget must be int"):
        actor_hooks(OmegaConf.to_container(cfg.actor_rollout_ref.actor, resolve=True))


def test_each_default_declared_once() -> None:
    """features.toml declares no default for a key of the qwen3_rl group (it comes from the dataclass), and
    the registry's default of each such switch is the dataclass field's."""
    from qwen3_rl.tools.features import FeatureError, load_registry
    from qwen3_rl.trainer.seam import FEATURES, feature_defaults

    raw = tomllib.loads((REPO / "features.toml").read_text())["feature"]
    reg = load_registry()
    defaults = feature_defaults()
    seen = 0
    for env, f in raw.items():
        keys = [s["key"].lstrip("+") for s in f.get("sets", []) if s["value"] == "{value}"]
        sets = f.get("sets", [])
        if len(sets) == 1 and sets[0]["value"] == "True" and sets[0].get("when") == {env: "True"}:
            keys.append(sets[0]["key"].lstrip("+"))  # the enable key set only while the switch is on (HDP_ENABLE)
        seam = [k for k in keys if k.startswith("qwen3_rl.")]
        if not seam:
            continue
        seen += 1
        assert "default" not in f, env
        want = defaults[seam[0]][0]
        assert reg.features[env].default == (("True" if want else "False") if isinstance(want, bool) else str(want))
    assert seen >= 8
    assert reg.features["ROLLOUT_REBALANCE_INTERVAL_STEPS"].default == "32"
    assert reg.features["HDP_ENABLE"].default == "False" and "default" not in raw["HDP_ENABLE"]
    # declaring a default again is refused
    bad = (REPO / "features.toml").read_text().replace(
        '[feature.ROLLOUT_REBALANCE_INTERVAL_STEPS]\n', '[feature.ROLLOUT_REBALANCE_INTERVAL_STEPS]\ndefault = 16\n')
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(bad)
    with pytest.raises(FeatureError, match="declared in qwen3_rl.trainer.seam"):
        load_registry(fh.name)
    bad = (REPO / "features.toml").read_text().replace('[feature.HDP_ENABLE]\n', '[feature.HDP_ENABLE]\ndefault = false\n')
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(bad)
    with pytest.raises(FeatureError, match="HDP_ENABLE: sets qwen3_rl.hdp.enable, whose default is declared"):
        load_registry(fh.name)
    # every dataclass field is a plain typed value with a default
    for cls in FEATURES.values():
        assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(cls)), cls


def test_group_validation_one_line() -> None:
    from qwen3_rl.trainer.seam import RecipeConfig, SeamConfigError

    rc = RecipeConfig.from_group({"rollout_rebalance": {"enable": True, "interval_steps": 8, "timeout_s": 5}})
    assert (rc.rollout_rebalance.interval_steps, rc.rollout_rebalance.timeout_s, rc.rollout_rebalance.max_moves) == (
        8, 5.0, 128)
    assert RecipeConfig.from_group(None) == RecipeConfig()
    for bad, msg in (({"nope": {}}, "qwen3_rl.nope: unknown feature"),
                     ({"data_rebalance": {"enabled": True}}, "qwen3_rl.data_rebalance.enabled: unknown key"),
                     ({"rollout_rebalance": {"max_moves": True}}, "qwen3_rl.rollout_rebalance.max_moves must be int"),
                     ({"rollout_rebalance": {"interval_steps": 0}}, "qwen3_rl.rollout_rebalance: interval_steps")):
        with pytest.raises(SeamConfigError, match=msg) as err:
            RecipeConfig.from_group(bad)
        assert "\n" not in str(err.value)
