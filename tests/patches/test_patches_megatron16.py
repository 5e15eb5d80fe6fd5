"""The current set's megatron-core 0.16.1: patch 0001 (optimizer states that are ``None``) executed in the real
0.16.1 code with its positive control, and the seed-set fixes 0003 and 0004 shown unneeded on the pristine 0.16.1 tree.

0001. MindSpeed core_r0.16.0's swap optimizer still keeps ``max_exp_avg_sq = None`` without amsgrad
(``mindspeed/core/optimizer/swap_optimizer/swap_optimizer.py:619``). verl 0.9.1 saves the distributed optimizer as
``dp_reshardable`` on megatron-core >= 0.14 (``verl/utils/checkpoint/megatron_checkpoint_manager.py:454``), whose
save reads ``None.shape`` (``megatron/core/optimizer/distrib_optimizer.py:1669``) and whose load calls
``None.copy_`` (``:940``); ``optim_state_to_sharding_state`` (``dist_checkpointing/optimizer.py:141``) fails the same
way for a non-distributed optimizer. (0.12.1's default ``fully_sharded_model_space`` cannot be saved at all in
0.16.1: ``ShardedTensor.flattened_range is not supported``, ``dist_checkpointing/mapping.py:133-134``.)
The tests run the real ``DistributedOptimizer`` methods on a hand-built optimizer (attributes set by hand, real AdamW
state) through megatron's own ``save_preprocess`` / ``load_preprocess`` / ``merge``; only the file I/O of
``torch.distributed.checkpoint`` is an in-memory dict.

0003 / 0004: the pristine 0.16.1 writer writes a bucket with this torch (``serialization_format`` passed,
``filesystem_async.py:373-376``), and a checkpoint whose metadata lost megatron's extra attributes (torch >= 2.9's
``FileSystemWriter.finish``) still loads (``mcore_data`` is no longer written; ``all_local_plans`` is read with a
default, ``strategies/torch.py:677``).
"""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_patches_megatron import _assert_same_states, _load, _save, _write_bucket, adamw_with_states

from conftest import run_python
from helpers.current_set import DEVICE_SHIMS, patched_megatron, pristine_megatron

HERE = Path(__file__).resolve().parent


def build_dist_optimizer_016(seed: int, amsgrad_none: bool = True) -> tuple[Any, dict, list]:
    """A megatron-core 0.16.1 ``DistributedOptimizer`` with one fp32 bucket holding two params ((2, 3) and (4,)).

    Main params are flat fp32 shards of 6 and 4 elements with random ``exp_avg``/``exp_avg_sq`` (from ``seed``) and
    ``max_exp_avg_sq = None`` when ``amsgrad_none`` (MindSpeed's swap optimizer without amsgrad). The second param
    starts at element 8 of the 12-element bucket, so the dp_reshardable format adds a 2-element padding entry between
    them. A world of one DP rank. Returns (optimizer, model sharded state dict, main params); imports megatron lazily."""
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    model, inner, mains = adamw_with_states(seed, amsgrad_none)

    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
    opt.config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    opt.optimizer = inner
    opt.model_param_group_index_map = {model[0]: (0, 0), model[1]: (0, 1)}
    opt.gbuf_ranges = [{torch.float32: [{"param_map": {
        model[0]: {"param": Range(0, 6), "gbuf_local": Range(0, 6)},
        model[1]: {"param": Range(0, 4), "gbuf_local": Range(8, 12)},
    }}]}]
    opt.distributed_optimizer_instance_id = 0
    opt.data_parallel_group = SimpleNamespace(rank=lambda: 0, size=lambda: 1)
    opt.data_parallel_group_idx = 0
    opt.per_bucket_numel = [{torch.float32: [12]}]
    opt.per_bucket_numel_unpadded = [{torch.float32: [12]}]
    opt.buffers = [SimpleNamespace(buckets=[SimpleNamespace(grad_data=torch.zeros(12), numel_unpadded=12)])]
    msd = {
        "w": ShardedTensor.from_rank_offsets("w", model[0], replica_id=(0, 0, 0)),
        "b": ShardedTensor.from_rank_offsets("b", model[1], replica_id=(0, 0, 0)),
    }
    return opt, msd, mains


@pytest.fixture(scope="module")
def patched16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The megatron-core 0.16.1 tree with patches/current/megatron applied."""
    return patched_megatron(tmp_path_factory.mktemp("m16"))


@pytest.fixture(scope="module")
def on_path16(patched16: Path):
    """The patched 0.16.1 tree first on sys.path for this module. Megatron modules other tests imported (the seed
    set's 0.12.1) are set aside meanwhile and put back afterwards, so other modules keep the objects they hold."""
    import sys

    def take() -> dict:
        return {m: sys.modules.pop(m) for m in list(sys.modules) if m == "megatron" or m.startswith("megatron.")}

    before = take()
    sys.path.insert(0, str(patched16))
    yield patched16
    sys.path.remove(str(patched16))
    take()
    sys.modules.update(before)


@pytest.fixture(scope="module")
def gloo(on_path16: Path, tmp_path_factory: pytest.TempPathFactory):
    """A one-rank gloo process group (the checkpoint validation all-gathers metadata)."""
    import torch.distributed as dist

    created = False
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        created = True
    yield
    if created:
        dist.destroy_process_group()


def _dp_reshardable(opt: Any, msd: dict, is_loading: bool = False) -> dict:
    """The optimizer's dp_reshardable parameter state, as ``sharded_state_dict`` builds it for verl 0.9.1."""
    return opt.sharded_param_state_dp_reshardable(msd, is_loading=is_loading)


def test_megatron16_is_the_tree_under_test(on_path16: Path) -> None:
    from megatron.core import package_info

    assert package_info.__version__ == "0.16.1"
    assert Path(package_info.__file__).is_relative_to(on_path16)


def test_dp_reshardable_roundtrip_keeps_none_states(on_path16: Path, gloo: None) -> None:
    import torch
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    src, src_msd, src_mains = build_dist_optimizer_016(seed=2)
    state = _dp_reshardable(src, src_msd)
    bucket = state[0][torch.float32][0]
    assert type(bucket) is list and len(bucket) == 3  # two params and the 2-element padding between them
    for entry in (bucket[0], bucket[2]):
        assert isinstance(entry["max_exp_avg_sq"], LocalNonpersistentObject)
        assert entry["max_exp_avg_sq"].unwrap() is None
    assert bucket[1]["padding"].unwrap() is True
    assert "max_exp_avg_sq" not in bucket[1]  # padding only mirrors tensor states
    disk, common = _save({"param_state": state})
    tensors = [k for k in disk if ".bucket_idx_0." in k[0]]
    assert len(tensors) == 9 and not any("max_exp_avg_sq" in k[0] for k in disk)  # 3 entries x 3 tensors

    dst, dst_msd, dst_mains = build_dist_optimizer_016(seed=3)
    loaded = _load({"param_state": _dp_reshardable(dst, dst_msd, is_loading=True)}, disk, common)
    with torch.no_grad():  # as megatron's load_state_dict calls it; the loader itself is not decorated
        dst.load_parameter_state_from_dp_reshardable(loaded["param_state"])
    _assert_same_states(src_mains, src, dst_mains, dst)


def test_dp_reshardable_unchanged_when_no_none(on_path16: Path, gloo: None) -> None:
    """Without None entries the patched code saves and restores exactly what upstream does."""
    import torch

    src, src_msd, src_mains = build_dist_optimizer_016(seed=4, amsgrad_none=False)
    state = _dp_reshardable(src, src_msd)
    disk, common = _save({"param_state": copy.copy(state)})
    assert len([k for k in disk if ".bucket_idx_0." in k[0]]) == 9
    dst, dst_msd, dst_mains = build_dist_optimizer_016(seed=5, amsgrad_none=False)
    loaded = _load({"param_state": _dp_reshardable(dst, dst_msd, is_loading=True)}, disk, common)
    with torch.no_grad():  # as megatron's load_state_dict calls it; the loader itself is not decorated
        dst.load_parameter_state_from_dp_reshardable(loaded["param_state"])
    _assert_same_states(src_mains, src, dst_mains, dst)


def test_one_sided_none_is_refused_not_dropped(on_path16: Path) -> None:
    import torch

    opt, _, mains = build_dist_optimizer_016(seed=6)
    model_param = next(iter(opt.model_param_group_index_map))
    before = mains[0].detach().clone()
    good = {"param": torch.ones(6), "exp_avg": torch.ones(6), "exp_avg_sq": torch.ones(6)}
    match = r"None on one side only.*'max_exp_avg_sq': \('{}', '{}'\)"
    with torch.no_grad():
        with pytest.raises(ValueError, match=match.format("NoneType", "Tensor")):
            opt._set_main_param_and_optimizer_states(model_param, {**good, "max_exp_avg_sq": torch.ones(6)})
        assert torch.equal(mains[0], before)  # refused before anything was copied
        opt.optimizer.state[mains[0]]["max_exp_avg_sq"] = torch.zeros(6)
        with pytest.raises(ValueError, match=match.format("Tensor", "NoneType")):
            opt._set_main_param_and_optimizer_states(model_param, {**good, "max_exp_avg_sq": None})
        assert torch.equal(mains[0], before)
        opt.optimizer.state[mains[0]]["max_exp_avg_sq"] = None
        opt._set_main_param_and_optimizer_states(model_param, good)
    assert torch.equal(mains[0], torch.ones(6))
    assert opt.optimizer.state[mains[0]]["max_exp_avg_sq"] is None


def test_optim_state_to_sharding_state_keeps_none(on_path16: Path) -> None:
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
    from megatron.core.dist_checkpointing.optimizer import optim_state_to_sharding_state

    w = torch.zeros(2, 3)
    sharded_w = ShardedTensor.from_rank_offsets("w", w, replica_id=0)
    exp_avg = torch.arange(6.0).reshape(2, 3)
    osd = {
        "state": {0: {"exp_avg": exp_avg, "max_exp_avg_sq": None, "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    optim_state_to_sharding_state(osd, {0: sharded_w}, exclude_keys=("step",))
    entry = osd["state"][0]
    assert list(entry) == ["exp_avg", "max_exp_avg_sq"]
    assert entry["exp_avg"].data is exp_avg and entry["exp_avg"].key == "optimizer.state.exp_avg.w"
    assert isinstance(entry["max_exp_avg_sq"], LocalNonpersistentObject)
    assert entry["max_exp_avg_sq"].unwrap() is None


_PRISTINE = """
import json, sys, traceback
sys.path[:0] = [TREE, HERE, TESTS]
import torch
from test_patches_megatron16 import build_dist_optimizer_016
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.optimizer import optim_state_to_sharding_state


def save():
    opt, msd, _ = build_dist_optimizer_016(seed=0)
    opt.sharded_param_state_dp_reshardable(msd)


def load():
    opt, _, _ = build_dist_optimizer_016(seed=0)
    model_param = next(iter(opt.model_param_group_index_map))
    with torch.no_grad():
        opt._set_main_param_and_optimizer_states(model_param, {"param": torch.ones(6), "exp_avg": torch.ones(6),
                                                               "exp_avg_sq": torch.ones(6), "max_exp_avg_sq": None})


def sharding():
    w = torch.zeros(2, 3)
    optim_state_to_sharding_state({"state": {0: {"max_exp_avg_sq": None}}, "param_groups": [{"params": [0]}]},
                                  {0: ShardedTensor.from_rank_offsets("w", w, replica_id=0)})


out = {}
for fn in (save, load, sharding):
    try:
        fn()
        out[fn.__name__] = None
    except Exception as e:
        out[fn.__name__] = [f"{type(e).__name__}: {e}", traceback.extract_tb(e.__traceback__)[-1].filename]
print("RESULT " + json.dumps(out))
"""


def test_pristine_megatron16_crashes_on_none_state() -> None:
    """Positive control: the same calls on the pristine 0.16.1 tree fail on the None state (one interpreter)."""
    import json

    prelude = f"TREE, HERE, TESTS = {str(pristine_megatron())!r}, {str(HERE)!r}, {str(HERE.parent)!r}\n"
    proc = run_python(prelude + textwrap.dedent(_PRISTINE))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    assert got["save"][0] == "AttributeError: 'NoneType' object has no attribute 'shape'", got
    assert got["save"][1].endswith("megatron/core/optimizer/distrib_optimizer.py"), got
    assert got["load"][0] == "AttributeError: 'NoneType' object has no attribute 'copy_'", got
    assert got["load"][1].endswith("megatron/core/optimizer/distrib_optimizer.py"), got
    assert got["sharding"][0].startswith("AttributeError: 'NoneType' object has no attribute"), got


# ---- 0003 (fixed upstream) and 0004 (obsolete) on the pristine 0.16.1 tree -----------------------------------------
def test_pristine_megatron16_writer_passes_serialization_format() -> None:
    """0003 is not needed: the pristine 0.16.1 writer writes a tensor bucket with this torch (whose ``_write_item``
    requires ``serialization_format``) and the bytes load back equal."""
    import inspect

    from torch.distributed.checkpoint.filesystem import _write_item

    assert "serialization_format" in inspect.signature(_write_item).parameters
    proc = _write_bucket(pristine_megatron())
    assert proc.returncode == 0 and "WROTE" in proc.stdout, proc.stderr[-2000:]


_LOSSY_FINISH = """
import dataclasses, os, pickle, sys
sys.path.insert(0, sys.argv[1])
sys.modules["qwen3_rl"] = None
DEVICE_SHIMS
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
out = sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + out + "/store", rank=0, world_size=1)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mtorch

def finish_like_torch_29(self, metadata, results):  # pickles dataclasses.replace(metadata), pytorch #162948
    storage_md = {}
    for wr_list in results:
        storage_md.update({wr.index: wr.storage_data for wr in wr_list})
    metadata.storage_data = storage_md
    with open(self.metadata_path, "wb") as f:
        pickle.dump(dataclasses.replace(metadata), f)

FileSystemWriter.finish = finish_like_torch_29
w = torch.arange(12.0).reshape(3, 4)
# a state that megatron reformulates on save (a flattened 2-D tensor keyed with ShardedTensorFactory would set
# mcore_data in 0.12.1); in 0.16.1 nothing is kept in the metadata object any more
path = os.path.join(out, "ckpt")
os.makedirs(path)
dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)}, path)
md = pickle.load(open(os.path.join(path, ".metadata"), "rb"))
print("ATTRS", sorted(k for k in vars(md) if k not in {f.name for f in dataclasses.fields(Metadata)}))
back = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)}, path)
meta = mtorch.TorchDistLoadShardedStrategy().load_tensors_metadata(path)
print("LOADED", torch.equal(back["w"], w), sorted(meta))
"""


def test_pristine_megatron16_loads_without_extra_metadata_attributes(tmp_path: Path) -> None:
    """0004 is obsolete: with torch 2.9's lossy ``finish`` (only Metadata's declared fields pickled) the pristine
    0.16.1 save writes no extra attribute megatron would need, and the checkpoint and its tensor metadata load."""
    proc = run_python(_LOSSY_FINISH.replace("DEVICE_SHIMS\n", DEVICE_SHIMS), str(pristine_megatron()),
                      str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ATTRS []" in proc.stdout and "LOADED True ['w']" in proc.stdout, proc.stdout
