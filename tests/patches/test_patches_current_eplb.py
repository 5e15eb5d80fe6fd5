"""The current set's EPLB policy registry (``patches/current/vllm_ascend/0002-*eplb_policy_registry``), executed in
vLLM-Ascend 0.23.0.post1's real code: EPLB policy type 4 (``qwen3_rl.moe.eplb_ascend_policy``), registered by the
recipe's vLLM plugin, through ``EplbConfig``'s validator and ``PolicyFactory``, and its output through ``EplbWorker``.

As in ``test_patches_current_vllm.py``, each probe runs in a fresh interpreter of this venv whose path is the pinned
vLLM 0.23.0 and vLLM-Ascend 0.23.0.post1 trees (pristine, or patched by ``PIN_SET=current bash
apply_all_patches.sh``), torch_npu stood in by ``qwen3_rl.cpu_device`` (the device-kernel layer only). The plugin
is loaded the way vLLM loads it in every process: ``vllm.plugins.load_general_plugins()`` finds the
``vllm.general_plugins`` entry point ``qwen3_rl`` (``vllm_plugin.write_entry_point_metadata``) with
``VLLM_PLUGINS=qwen3_rl``; ``VLLM_PLUGINS=none`` loads nothing (nothing registered).

* validator (``ascend_config.py:883-884`` pristine): pristine refuses 4 also with the plugin loaded (the control);
  patched accepts 4 only with the plugin loaded, refuses an unregistered type with one line, accepts 0-3 either way,
  also through ``init_ascend_config`` from ``additional_config.eplb_config`` (the keys ``ROLLOUT_EPLB`` sets).
* factory (``policy_factory.py:15-35`` pristine): ``generate_policy(4)`` is the recipe's policy when patched and the
  plugin is loaded, ``RandomLoadBalance`` (upstream's fallback) otherwise.
* consumer: for types 0-4 on the same expert table and loads, ``EplbWorker.do_update`` (in a real one-rank
  vLLM EP group over gloo) takes the policy's output; type 4's tuple, placement and update info have the layout of
  types 0-3's, and ``check_expert_placement`` keeps type 4's placement; a registered policy that places two
  replicas of one expert on one rank is reverted by it (the control that "kept" can be false).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qwen3_rl.tools.pins import load_pins
from qwen3_rl.tools.upstream.download import fill_pristine
from qwen3_rl.vllm_plugin import write_entry_point_metadata

REPO = Path(__file__).resolve().parents[2]
CURRENT = load_pins(REPO / "pins.toml", "current")
KEYS = ("vllm", "vllm_ascend")
PATCH = "0002-vllm_ascend-feature-eplb_policy_registry.patch"
#: the types upstream's factory and validator know (policy_factory.py:20-26, ascend_config.py:883)
BUILT_IN = (0, 1, 2, 3)


#: ``vllm_ascend/_build_info.py`` as vLLM-Ascend 0.23.0.post1's ``setup.py`` (``gen_build_info``) writes it when it
#: installs for an A3 SOC; the sdist has none, and ``AscendConfig`` reads the device type from it (``utils.py:836``)
A3_BUILD_INFO = "# Auto-generated file\n__device_type__ = 'A3'\n"


@pytest.fixture(scope="module")
def current_trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"pristine": workspace, "patched": workspace}: clones of the current set's pinned vLLM and vLLM-Ascend trees,
    the patched one with ``patches/current/{vllm,vllm_ascend}`` applied by ``apply_all_patches.sh``; both with an A3
    build's ``_build_info.py``."""
    assert (REPO / "patches" / "current" / "vllm_ascend" / PATCH).is_file()
    pinned = fill_pristine(REPO / "pins.toml", [CURRENT.frameworks[k] for k in KEYS], pin_set="current")
    trees = {name: tmp_path_factory.mktemp(f"current_{name}") for name in ("pristine", "patched")}
    for ws in trees.values():
        for k in KEYS:
            subprocess.run(
                [
                    "git",
                    "clone",
                    "-q",
                    "--shared",
                    str(pinned / CURRENT.frameworks[k].dir),
                    str(ws / CURRENT.frameworks[k].dir),
                ],
                check=True,
                timeout=300,
            )
    env = {k: v for k, v in os.environ.items() if k != "QWEN3_RL_WORKSPACE"}
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "apply_all_patches.sh"),
            "--workspace",
            str(trees["patched"]),
            "--only",
            ",".join(KEYS),
        ],
        env={**env, "PIN_SET": "current"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert PATCH in proc.stdout, proc.stdout
    for ws in trees.values():
        (ws / CURRENT.frameworks["vllm_ascend"].dir / "vllm_ascend" / "_build_info.py").write_text(
            A3_BUILD_INFO
        )
    return trees


@pytest.fixture(scope="module")
def plugin_meta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose dist-info declares the recipe's ``vllm.general_plugins`` entry point."""
    meta = tmp_path_factory.mktemp("plugin_meta")
    write_entry_point_metadata(meta)
    return meta


def _probe(code: str, ws: Path, plugin_meta: Path | None, *args: str) -> dict:
    """``code`` in a fresh interpreter on the workspace's vLLM and vLLM-Ascend trees; with ``plugin_meta``, the
    recipe's plugin is what ``VLLM_PLUGINS`` selects, else no plugin. Returns the probe's ``RESULT`` line."""
    path = [REPO, ws / CURRENT.frameworks["vllm"].dir, ws / CURRENT.frameworks["vllm_ascend"].dir]
    path += [plugin_meta] if plugin_meta is not None else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=os.pathsep.join(map(str, path)),
        VLLM_PLUGINS="qwen3_rl" if plugin_meta else "none",
        VLLM_TARGET_DEVICE="cpu",
        DYNAMIC_EPLB="true",
    )  # DYNAMIC_EPLB: what ROLLOUT_EPLB sets for workers
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ws,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[-1][len("RESULT ") :])


# --------------------------------------------------------------------------------------------- validator, factory

_VALIDATE = """
import json, sys
from qwen3_rl.cpu_device.npu import stand_in
stand_in.install()
from vllm.config import DeviceConfig, VllmConfig
from vllm.plugins import load_general_plugins
load_general_plugins()  # as vLLM's EngineArgs, engine core and workers do first
from vllm_ascend.ascend_config import EplbConfig, init_ascend_config
from vllm_ascend.eplb.core.policy.policy_factory import PolicyFactory

def outcome(build):
    try:
        build()
        return "ok"
    except ValueError as e:
        return f"ValueError: {e}"

res = {"file": sys.modules["vllm_ascend.ascend_config"].__file__, "config": {}, "ascend_config": {},
       "plugin_loaded": "qwen3_rl.vllm_plugin" in sys.modules}
for t in (0, 1, 2, 3, 4, 7):
    res["config"][str(t)] = outcome(lambda: EplbConfig({"dynamic_eplb": True, "eplb_policy_type": t}))
for t in (4, 7):
    # the keys ROLLOUT_EPLB sets (features.toml), as vLLM-Ascend's platform reads them
    eplb = {"dynamic_eplb": True, "eplb_policy_type": t, "num_redundant_experts": 8,
            "expert_heat_collection_interval": 400, "algorithm_execution_interval": 30}
    def build():
        cfg = init_ascend_config(VllmConfig(device_config=DeviceConfig(device="cpu"),
                                            additional_config={"eplb_config": eplb}))
        assert cfg.eplb_config.eplb_policy_type == t and cfg.eplb_config.dynamic_eplb
    res["ascend_config"][str(t)] = outcome(build)
policy = PolicyFactory.generate_policy(4)
res["policy_4"] = f"{type(policy).__module__}.{type(policy).__name__}"
print("RESULT", json.dumps(res))
"""

_OURS = "qwen3_rl.moe.eplb_ascend_policy.PackingAwareAscendPolicy"
_FALLBACK = "vllm_ascend.eplb.core.policy.policy_random.RandomLoadBalance"
_PRISTINE_REFUSAL = "ValueError: eplb_policy_type must in [0, 1, 2, 3]"


def test_pristine_refuses_type_4_even_with_the_plugin(
    current_trees: dict[str, Path], plugin_meta: Path
) -> None:
    """The control: vLLM-Ascend 0.23.0.post1 as pinned refuses type 4 in its validator and falls back to
    RandomLoadBalance in its factory, although the plugin is loaded (it finds no registry there)."""
    res = _probe(_VALIDATE, current_trees["pristine"], plugin_meta)
    assert str(current_trees["pristine"]) in res["file"]
    assert res["plugin_loaded"] is True
    assert {t: res["config"][str(t)] for t in BUILT_IN} == dict.fromkeys(BUILT_IN, "ok")
    assert res["config"]["4"] == res["config"]["7"] == _PRISTINE_REFUSAL
    assert res["ascend_config"] == {"4": _PRISTINE_REFUSAL, "7": _PRISTINE_REFUSAL}
    assert res["policy_4"] == _FALLBACK


def test_patched_accepts_type_4_only_when_the_plugin_registered_it(
    current_trees: dict[str, Path], plugin_meta: Path
) -> None:
    unregistered = _probe(_VALIDATE, current_trees["patched"], None)
    assert str(current_trees["patched"]) in unregistered["file"]
    assert unregistered["plugin_loaded"] is False
    assert {t: unregistered["config"][str(t)] for t in BUILT_IN} == dict.fromkeys(BUILT_IN, "ok")
    for t in ("4", "7"):
        msg = unregistered["config"][t]
        assert msg == (f"{_PRISTINE_REFUSAL} or a type a vLLM plugin registered (registered: none); got {t}")
        assert unregistered["ascend_config"][t] == msg
    assert unregistered["policy_4"] == _FALLBACK  # nothing registered: upstream's fallback, as pristine

    registered = _probe(_VALIDATE, current_trees["patched"], plugin_meta)
    assert registered["plugin_loaded"] is True
    assert {t: registered["config"][str(t)] for t in (*BUILT_IN, 4)} == dict.fromkeys((*BUILT_IN, 4), "ok")
    assert registered["ascend_config"]["4"] == "ok"
    refusal = registered["config"]["7"]
    assert refusal == f"{_PRISTINE_REFUSAL} or a type a vLLM plugin registered (registered: [4]); got 7"
    assert "\n" not in refusal and registered["ascend_config"]["7"] == refusal
    assert registered["policy_4"] == _OURS


# ---------------------------------------------------------------------------------- the policies' output, consumed

_CONSUME = """
import json, socket, sys
import numpy as np
import torch
from qwen3_rl.cpu_device.npu import stand_in
stand_in.install()
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_ascend.eplb.core.eplb_worker import EplbWorker
from vllm_ascend.eplb.core.policy.policy_abstract import EplbPolicy, register_eplb_policy
from vllm_ascend.eplb.core.policy.policy_factory import PolicyFactory

class TwoOnOneRank(EplbPolicy):
    # an invalid placement: rank 0's redundant slot gets a second replica of its first expert
    def rebalance_experts(self, current_expert_table, expert_workload):
        new = current_expert_table.clone()
        new[:, 0, -1] = new[:, 0, 0]
        return 1, list(range(new.shape[0])), new

register_eplb_policy(9, TwoOnOneRank)

# a real one-rank vLLM EP group (gloo): EplbWorker takes its rank from get_ep_group()
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig(enable_expert_parallel=True))
with set_current_vllm_config(cfg):
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{port}")
    parallel_state.initialize_model_parallel(1, 1, backend="gloo")

# 3 MoE layers, 8 ranks x 5 slots: experts 4r..4r+3 on rank r plus one redundant replica of a neighbour's expert;
# tokens per slot from Zipf-like expert loads split over an expert's replicas
L, R, S, E = 3, 8, 5, 32
table = torch.empty(L, R, S, dtype=torch.int64)
for layer in range(L):
    for r in range(R):
        table[layer, r, :4] = torch.arange(4 * r, 4 * r + 4)
        table[layer, r, 4] = (4 * (r + 1) + (r + layer) % 4) % E
g = torch.Generator().manual_seed(0)
hot = (1.0 / torch.arange(1, E + 1, dtype=torch.float64))[torch.randperm(E, generator=g)]
work = torch.empty(L, R, S, dtype=torch.int64)
for layer in range(L):
    replicas = torch.bincount(table[layer].reshape(-1), minlength=E)
    work[layer] = (10000 * hot[table[layer]] / replicas[table[layer]]).long() + 1
to_global = EplbWorker.local2global  # staticmethod-like: self is not used

res = {}
for t in (0, 1, 2, 3, 4, 9):
    policy = PolicyFactory.generate_policy(t)
    load = work.unsqueeze(0) if t == 3 else work  # FlashLB (multi-stage) takes [stages, L, R, S]
    out = policy.rebalance_experts(table.clone(), load.clone())
    new = out[2] if torch.is_tensor(out[2]) else torch.tensor(np.asarray(out[2]))
    worker = EplbWorker({"expert_maps": to_global(None, table), "moe_load": load.clone()}, t)
    packed = worker.do_update()
    maps = worker.shared_dict["expert_maps"]
    hotness = worker._calculate_hotness(table.numpy(), work)
    res[str(t)] = {
        "policy": type(policy).__name__, "out_len": len(out), "changed": int(out[0]), "shape": list(new.shape),
        "kept": bool(torch.equal(maps, to_global(None, new.long()))),
        "moved": bool(not torch.equal(maps, to_global(None, table))),
        "maps_shape": list(maps.shape), "packed_len": len(packed),
        "entry_types": sorted({tuple(type(x).__name__ for x in e) for e in packed}),
        "map_row": sorted({len(e[2]) for e in packed}), "log2phy_row": sorted({len(e[3]) for e in packed}),
        "layers": [e[4] for e in packed],
        "imbalance_before": float(worker._compute_imbalance(table.numpy(), hotness)[0]),
        "imbalance_after": float(worker._compute_imbalance(worker.global2local(maps, S).numpy(), hotness)[0]),
    }
print("RESULT", json.dumps(res))
"""


def test_type_4_output_is_consumed_by_eplb_worker_like_types_0_to_3(
    current_trees: dict[str, Path], plugin_meta: Path
) -> None:
    res = _probe(_CONSUME, current_trees["patched"], plugin_meta)
    names = {t: res[str(t)]["policy"] for t in (0, 1, 2, 3, 4, 9)}
    assert names == {
        0: "RandomLoadBalance",
        1: "DefaultEplb",
        2: "SwiftBalanceEplb",
        3: "FlashLB",
        4: "PackingAwareAscendPolicy",
        9: "TwoOnOneRank",
    }
    layout = (
        "out_len",
        "shape",
        "maps_shape",
        "packed_len",
        "entry_types",
        "map_row",
        "log2phy_row",
        "layers",
    )
    ours = {k: res["4"][k] for k in layout}
    assert ours == {
        "out_len": 3,
        "shape": [3, 8, 5],
        "maps_shape": [3, 8, 32],
        "packed_len": 3,
        "entry_types": [["list", "list", "list", "list", "int"]],
        "map_row": [32],
        "log2phy_row": [32],
        "layers": [0, 1, 2],
    }
    for t in BUILT_IN:
        assert {k: res[str(t)][k] for k in layout} == ours, t
    # type 4's placement passes EplbWorker.check_expert_placement unchanged and is a new one
    assert res["4"]["changed"] == 1 and res["4"]["kept"] is True and res["4"]["moved"] is True
    # control: an invalid placement is reverted by the same check (kept false, the old maps stay)
    assert res["9"]["kept"] is False and res["9"]["moved"] is False
    for t in (*BUILT_IN, 4):
        r = res[str(t)]
        print(
            f"type {t} {r['policy']}: imbalance (max/mean rank load) {r['imbalance_before']:.3f} -> "
            f"{r['imbalance_after']:.3f}, placement kept {r['kept']}"
        )
