"""megatron 0001 (bugfix-state_ten_verification): optimizer states that are ``None``.

Optimizers may keep ``None`` for a state they do not use; MindSpeed's swap optimizer
(``mindspeed/core/optimizer/swap_optimizer/swap_optimizer.py:66,602`` at v2.2.0_core_r0.12.1)
stores ``max_exp_avg_sq = None`` for every parameter when ``amsgrad`` is off. Pristine
megatron-core 0.12.1 then crashes building the distributed optimizer's default
(``fully_sharded_model_space``) checkpoint on ``state_ten.dtype``
(``megatron/core/optimizer/distrib_optimizer.py:1325``) and on load on ``None.copy_``
(``distrib_optimizer.py:878``).

The tests execute the patched megatron code on a hand-built distributed optimizer (real
``DistributedOptimizer`` methods, attributes set by hand, 2 parameters of 6 and 4 elements) and
push the sharded state through megatron's own checkpoint pre/post-processing
(``save_preprocess`` / ``load_preprocess`` / ``merge``); only the file I/O of
``torch.distributed.checkpoint`` is replaced by an in-memory dict (it needs CUDA in 0.12.1).
"""

from __future__ import annotations

import copy
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import run_python

HERE = Path(__file__).resolve().parent


def adamw_with_states(seed: int, amsgrad_none: bool) -> tuple[list, Any, list]:
    """Model params (2x3, 4), an AdamW over flat fp32 main params of 6 and 4 elements with random ``exp_avg`` /
    ``exp_avg_sq`` (from ``seed``) and ``max_exp_avg_sq = None`` when ``amsgrad_none``: (model, optimizer, mains)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    model = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    inner = torch.optim.AdamW(
        [torch.nn.Parameter(torch.randn(6, generator=gen)), torch.nn.Parameter(torch.randn(4, generator=gen))]
    )
    mains = inner.param_groups[0]["params"]
    for main in mains:
        inner.state[main] = {
            "exp_avg": torch.randn(main.numel(), generator=gen),
            "exp_avg_sq": torch.rand(main.numel(), generator=gen),
        }
        if amsgrad_none:
            inner.state[main]["max_exp_avg_sq"] = None
    return model, inner, mains


def build_fake_dist_optimizer(seed: int, amsgrad_none: bool = True) -> tuple[Any, dict, list]:
    """A ``DistributedOptimizer`` with one fp32 bucket holding two params (shapes (2, 3) and (4,)).

    Main params are flat fp32 shards of 6 and 4 elements; each has ``exp_avg``/``exp_avg_sq``
    tensors (random, from ``seed``) and ``max_exp_avg_sq = None`` (as MindSpeed's swap optimizer
    stores it without amsgrad) when ``amsgrad_none``. The bucket's grad buffer has 12 elements,
    so the fully-sharded-bucket-space format also adds a 2-element padding entry.

    Returns (optimizer, model sharded state dict, main params). Imports megatron lazily.
    """
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    model, inner, mains = adamw_with_states(seed, amsgrad_none)

    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.ddp_config = SimpleNamespace(use_custom_fsdp=False)
    opt.config = SimpleNamespace(use_precision_aware_optimizer=False)
    opt.optimizer = inner
    opt.model_param_group_index_map = {model[0]: (0, 0), model[1]: (0, 1)}
    opt.gbuf_ranges = [{torch.float32: [{"param_map": {
        model[0]: {"param": Range(0, 6), "gbuf_local": Range(0, 6)},
        model[1]: {"param": Range(0, 4), "gbuf_local": Range(6, 10)},
    }}]}]
    opt.distributed_optimizer_instance_id = 0
    opt.data_parallel_group = None
    opt.data_parallel_group_idx = 0
    opt.per_bucket_numel = [{torch.float32: [12]}]
    opt.per_bucket_numel_unpadded = [{torch.float32: [10]}]
    opt.buffers = [SimpleNamespace(buckets=[SimpleNamespace(grad_data=torch.zeros(12))])]
    msd = {
        "w": ShardedTensor.from_rank_offsets("w", model[0], replica_id=(0, 0, 0)),
        "b": ShardedTensor.from_rank_offsets("b", model[1], replica_id=(0, 0, 0)),
    }
    return opt, msd, mains


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory):
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


def _ident(sh: Any) -> tuple:
    rng = getattr(sh, "flattened_range", None)
    return (sh.key, tuple(getattr(sh, "global_offset", ())),
            None if rng is None else (rng.start, rng.stop))


def _save(sharded: dict) -> tuple[dict, dict]:
    """megatron's save preprocessing; returns (in-memory 'disk' of sharded data, common dict)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    sharded_part, common = save_preprocess(sharded, validate_access_integrity=True)
    disk = {_ident(sh): copy.deepcopy(sh.data) for sh in nested_values(sharded_part)}
    return disk, copy.deepcopy(common)


def _load(sharded: dict, disk: dict, common: dict) -> dict:
    """megatron's load pre/post-processing with ``disk`` standing in for the storage reader."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedBase
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    sharded, nonpersistent, _ = load_preprocess(sharded)
    loaded = dict_list_map_inplace(
        lambda x: copy.deepcopy(disk[_ident(x)]) if isinstance(x, ShardedBase) else x, sharded
    )
    state = copy.deepcopy(common)
    merge(state, nonpersistent)
    merge(state, loaded)
    return state


def _assert_same_states(src_mains: list, src_opt: Any, dst_mains: list, dst_opt: Any) -> None:
    import torch

    for a, b in zip(src_mains, dst_mains, strict=True):
        assert torch.equal(a, b)
        src, dst = src_opt.optimizer.state[a], dst_opt.optimizer.state[b]
        assert type(dst) is type(src) and list(dst) == list(src)
        for key, val in src.items():
            if val is None:
                assert dst[key] is None, key
            else:
                assert dst[key] is not val and torch.equal(dst[key], val), key


def test_model_space_sharding_keeps_none_states(patched_imports: Path) -> None:
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    opt, msd, mains = build_fake_dist_optimizer(seed=0)
    state = opt.sharded_param_state_fs_model_space(msd)

    assert type(state) is dict and sorted(state) == [0, 1]
    for idx, main in enumerate(mains):
        entry = state[idx]
        assert type(entry) is dict
        assert list(entry) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "fp32_param"]
        none_entry = entry["max_exp_avg_sq"]
        assert isinstance(none_entry, LocalNonpersistentObject) and none_entry.unwrap() is None
        for key in ("exp_avg", "exp_avg_sq"):
            sh = entry[key]
            assert isinstance(sh, ShardedTensor)
            assert sh.data is opt.optimizer.state[main][key]  # the live tensor, not a copy
            assert sh.key == f"optimizer.state.{key}.{'wb'[idx]}"
            assert sh.dtype == torch.float32 and sh.flattened_range == slice(0, main.numel())
        assert entry["fp32_param"].data is main
    # the optimizer's own state is untouched: None stays None
    assert all(opt.optimizer.state[m]["max_exp_avg_sq"] is None for m in mains)


def test_model_space_checkpoint_roundtrip_restores_every_state(patched_imports: Path, gloo: None) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    src, src_msd, src_mains = build_fake_dist_optimizer(seed=0)
    disk, common = _save({"param_state": src.sharded_param_state_fs_model_space(src_msd)})
    # 2 params x (exp_avg, exp_avg_sq, fp32_param) are stored; the None entries are not
    assert len(disk) == 6
    assert not any(k[0].startswith("optimizer.state.max_exp_avg_sq") for k in disk)
    assert all(v is not None for v in nested_values(common))

    dst, dst_msd, dst_mains = build_fake_dist_optimizer(seed=1)
    loaded = _load({"param_state": dst.sharded_param_state_fs_model_space(dst_msd, is_loading=True)},
                   disk, common)
    assert type(loaded["param_state"]) is dict
    assert loaded["param_state"][0]["max_exp_avg_sq"] is None
    dst.load_parameter_state_from_fs_model_space(loaded["param_state"])
    _assert_same_states(src_mains, src, dst_mains, dst)


def test_bucket_space_checkpoint_roundtrip_keeps_lists_and_none(patched_imports: Path, gloo: None) -> None:
    import torch
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    src, src_msd, src_mains = build_fake_dist_optimizer(seed=2)
    state = src.sharded_param_state_fs_bucket_space(src_msd)
    bucket = state[0][next(iter(state[0]))][0]
    assert type(bucket) is list and len(bucket) == 3  # two params + the 2-element tail padding
    for entry in bucket[:2]:
        assert isinstance(entry["max_exp_avg_sq"], LocalNonpersistentObject)
        assert entry["max_exp_avg_sq"].unwrap() is None
    assert "max_exp_avg_sq" not in bucket[2]  # padding only mirrors tensor states
    disk, common = _save({"param_state": state})

    dst, dst_msd, dst_mains = build_fake_dist_optimizer(seed=3)
    loaded = _load({"param_state": dst.sharded_param_state_fs_bucket_space(dst_msd, is_loading=True)},
                   disk, common)
    with torch.no_grad():  # unlike the model-space loader, this one is not decorated with no_grad
        dst.load_parameter_state_from_fs_bucket_space(loaded["param_state"])
    _assert_same_states(src_mains, src, dst_mains, dst)


def test_tensor_states_unchanged_when_no_none(patched_imports: Path, gloo: None) -> None:
    """Without None entries the patched code builds and restores exactly what upstream does."""
    src, src_msd, src_mains = build_fake_dist_optimizer(seed=4, amsgrad_none=False)
    state = src.sharded_param_state_fs_model_space(src_msd)
    assert [list(v) for v in state.values()] == [["exp_avg", "exp_avg_sq", "fp32_param"]] * 2
    disk, common = _save({"param_state": state})
    dst, dst_msd, dst_mains = build_fake_dist_optimizer(seed=5, amsgrad_none=False)
    loaded = _load({"param_state": dst.sharded_param_state_fs_model_space(dst_msd, is_loading=True)},
                   disk, common)
    dst.load_parameter_state_from_fs_model_space(loaded["param_state"])
    _assert_same_states(src_mains, src, dst_mains, dst)


def test_one_sided_none_is_refused_not_dropped(patched_imports: Path) -> None:
    import torch

    opt, _, mains = build_fake_dist_optimizer(seed=6)
    model_param = next(iter(opt.model_param_group_index_map))
    before = mains[0].detach().clone()
    good = {"param": torch.ones(6), "exp_avg": torch.ones(6), "exp_avg_sq": torch.ones(6)}
    match = r"None on one side only.*'max_exp_avg_sq': \('{}', '{}'\)"
    with torch.no_grad():
        # checkpoint holds a state the optimizer keeps as None: refusing beats silently losing it
        with pytest.raises(ValueError, match=match.format("NoneType", "Tensor")):
            opt._set_main_param_and_optimizer_states(model_param, {**good, "max_exp_avg_sq": torch.ones(6)})
        assert torch.equal(mains[0], before)  # refused before anything was copied
        # checkpoint lacks a state the optimizer has: refused too (no stale state kept silently)
        opt.optimizer.state[mains[0]]["max_exp_avg_sq"] = torch.zeros(6)
        with pytest.raises(ValueError, match=match.format("Tensor", "NoneType")):
            opt._set_main_param_and_optimizer_states(model_param, {**good, "max_exp_avg_sq": None})
        assert torch.equal(mains[0], before)
        # None in the optimizer and absent from the loaded dict (dp_zero layout): loads, None kept
        opt.optimizer.state[mains[0]]["max_exp_avg_sq"] = None
        opt._set_main_param_and_optimizer_states(model_param, good)
    assert torch.equal(mains[0], torch.ones(6))
    assert torch.equal(opt.optimizer.state[mains[0]]["exp_avg"], torch.ones(6))
    assert opt.optimizer.state[mains[0]]["max_exp_avg_sq"] is None


def test_optim_state_to_sharding_state_keeps_none(patched_imports: Path) -> None:
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
    assert type(osd["state"]) is dict and list(entry) == ["exp_avg", "max_exp_avg_sq"]
    assert entry["exp_avg"].data is exp_avg and entry["exp_avg"].key == "optimizer.state.exp_avg.w"
    assert isinstance(entry["max_exp_avg_sq"], LocalNonpersistentObject)
    assert entry["max_exp_avg_sq"].unwrap() is None


def test_pristine_megatron_crashes_on_none_state(pristine_workspace: Path) -> None:
    """The bug exists in the pinned megatron-core 0.12.1: same optimizer, pristine tree."""
    tree = pristine_workspace / "Megatron-LM"
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(tree)!r}, {str(HERE)!r}, {str(HERE.parent)!r}]
        from test_patches_megatron import build_fake_dist_optimizer
        opt, msd, _ = build_fake_dist_optimizer(seed=0)
        opt.sharded_param_state_fs_model_space(msd)
    """)
    proc = run_python(code)
    assert proc.returncode != 0
    assert "AttributeError: 'NoneType' object has no attribute 'dtype'" in proc.stderr, proc.stderr[-2000:]
    assert "distrib_optimizer.py" in proc.stderr


# ---- 0003: torch's serialization_format for the async checkpoint writer -----------------------------------------
_WRITE_BUCKET = """
import io, multiprocessing as mp, sys, tempfile
sys.path.insert(0, TREE)
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
item = WriteItem(index=MetadataIndex("w"), type=WriteItemType.TENSOR,
                 tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=t.shape),
                                             properties=TensorProperties.create_from_tensor(t), size=t.shape))
path = tempfile.mktemp()
results, count = mp.SimpleQueue(), mp.JoinableQueue()
count.put(0)
writer = FileSystemWriterAsync(tempfile.mkdtemp())
transforms = [writer.transforms] if hasattr(writer, "transforms") else []  # as the writer builds it (:174)
FileSystemWriterAsync.write_preloaded_data(transforms, 0, (path, "k", ([], [(item, t)])), results, count, False)
idx, out = results.get()
if isinstance(out, Exception):
    raise out
(res,) = out
data = open(path, "rb").read()[res.storage_data.offset: res.storage_data.offset + res.storage_data.length]
assert torch.equal(torch.load(io.BytesIO(data)), t)
print("WROTE", res.storage_data.length)
"""


def _write_bucket(tree: Path) -> subprocess.CompletedProcess[str]:
    return run_python(f"TREE = {str(tree)!r}\n" + _WRITE_BUCKET)


def test_async_writer_passes_serialization_format(patched_workspace: Path) -> None:
    """0003: the patched writer writes a tensor bucket with this torch; the bytes load back equal."""
    proc = _write_bucket(patched_workspace / "Megatron-LM")
    assert proc.returncode == 0 and "WROTE" in proc.stdout, proc.stderr[-2000:]


def test_pristine_async_writer_fails_on_this_torch(pristine_workspace: Path) -> None:
    """The pinned megatron-core 0.12.1 calls _write_item without the format torch now requires."""
    import inspect

    from torch.distributed.checkpoint.filesystem import _write_item

    assert "serialization_format" in inspect.signature(_write_item).parameters  # this venv's torch requires it
    proc = _write_bucket(pristine_workspace / "Megatron-LM")
    assert proc.returncode != 0
    assert "serialization_format" in proc.stderr, proc.stderr[-2000:]
