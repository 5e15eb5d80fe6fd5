"""Real torch.compile for the rollout although MindSpeed replaced it (verl patch 0004: the patched tree's
``verl/utils/torch_compile.py`` and its two call sites in ``verl/workers/megatron_workers.py``), with MindSpeed's
replacement simulated on CPU."""

from __future__ import annotations

import inspect
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

REAL = torch.compile


def dummy_compile(*args, **kwargs):
    """Same behaviour as MindSpeed's ``dummy_compile``: returns the function uncompiled."""
    if args and callable(args[0]):
        return args[0]
    return lambda fn: fn


dummy_compile.__module__ = "mindspeed.core.megatron_basic.requirements_basic"


@pytest.fixture
def tc(patched_imports: Path) -> types.ModuleType:
    """``verl.utils.torch_compile`` of the patched verl tree."""
    import verl.utils.torch_compile as module

    assert str(patched_imports) in module.__file__
    return module


@pytest.fixture
def mindspeed_replaced(tc, monkeypatch):
    """torch.compile replaced as MindSpeed's adaptor does; nothing remembered by the module."""
    monkeypatch.setattr(tc, "_remembered", None)
    monkeypatch.setattr(torch, "compile", dummy_compile)
    return monkeypatch


def test_real_detection(tc) -> None:
    assert tc.is_real_torch_compile(REAL) and not tc.is_real_torch_compile(dummy_compile)
    assert not tc.is_real_torch_compile(None)


def test_context_restores_real_then_dummy_also_on_exception(tc, mindspeed_replaced) -> None:
    mindspeed_replaced.setattr(tc, "_remembered", REAL)  # as remember_real_torch_compile() before MindSpeed
    with tc.real_torch_compile() as fn:
        assert torch.compile is REAL and fn is REAL
    assert torch.compile is dummy_compile
    with pytest.raises(RuntimeError, match="boom"), tc.real_torch_compile():
        assert torch.compile is REAL
        raise RuntimeError("boom")
    assert torch.compile is dummy_compile


def test_remember_only_records_the_real_one(tc, mindspeed_replaced) -> None:
    assert tc.remember_real_torch_compile() is None  # already replaced: nothing to record
    mindspeed_replaced.setattr(torch, "compile", REAL)
    assert tc.remember_real_torch_compile() is REAL
    mindspeed_replaced.setattr(torch, "compile", dummy_compile)
    assert tc.find_real_torch_compile() is REAL


def test_fallback_to_mindspeed_record_and_not_found(tc, mindspeed_replaced, caplog) -> None:
    # nothing remembered and no MindSpeed loaded: warn, keep the dummy
    mindspeed_replaced.delitem(sys.modules, "mindspeed.patch_utils", raising=False)
    with caplog.at_level(logging.WARNING), tc.real_torch_compile() as fn:
        assert fn is dummy_compile and torch.compile is dummy_compile
    assert "original was not found" in caplog.text
    # MindSpeed's own record of the original (MindSpeedPatchesManager.patches_info[...].orig_func)
    patch = types.SimpleNamespace(orig_func=REAL, final_patch_func=dummy_compile)
    fake = types.ModuleType("mindspeed.patch_utils")
    fake.MindSpeedPatchesManager = types.SimpleNamespace(patches_info={"torch.compile": patch})
    mindspeed_replaced.setitem(sys.modules, "mindspeed.patch_utils", fake)
    with tc.real_torch_compile():
        assert torch.compile is REAL
    assert torch.compile is dummy_compile


def test_noop_when_not_replaced(tc) -> None:
    with tc.real_torch_compile() as fn:
        assert fn is REAL and torch.compile is REAL
    assert torch.compile is REAL


def _run_patched_generate_sequences(tc, monkeypatch, rollout_config) -> list:
    """EXECUTE the patched ActorRolloutRefWorker.generate_sequences on a stand-in worker with MindSpeed's
    dummy installed; returns the torch.compile the rollout saw."""
    import verl.workers.megatron_workers as mw
    from verl import DataProto

    assert tc._remembered is REAL  # recorded when the patched module was imported (before MindSpeed)
    monkeypatch.setattr(torch, "compile", dummy_compile)
    monkeypatch.setattr(mw, "aggressive_empty_cache", lambda **_: None)  # device memory calls, none on CPU
    seen = []

    class Rollout:
        def generate_sequences(self, prompts):
            seen.append(torch.compile)
            return DataProto.from_dict(tensors={"responses": torch.ones(len(prompts), 2, dtype=torch.long)})

    worker = types.SimpleNamespace(
        _is_rollout=True, _is_actor=False, _is_offload_optimizer=False, generation_config=None,
        config=types.SimpleNamespace(rollout=rollout_config),
        tokenizer=types.SimpleNamespace(eos_token_id=1, pad_token_id=0), rollout=Rollout())
    prompts = DataProto.from_dict(tensors={"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    out = mw.ActorRolloutRefWorker.generate_sequences(worker, prompts)
    assert torch.compile is dummy_compile  # the training side keeps MindSpeed's choice
    assert out.batch["responses"].shape == (2, 2) and "timing" in out.meta_info
    return seen


def test_patched_megatron_worker_generate_sequences(tc, monkeypatch) -> None:
    """EXECUTE the patched ActorRolloutRefWorker.generate_sequences on a stand-in worker: the rollout
    sees the real torch.compile, the training side gets MindSpeed's dummy back."""
    import verl.workers.megatron_workers as mw
    from omegaconf import OmegaConf

    assert _run_patched_generate_sequences(tc, monkeypatch, OmegaConf.create({"real_torch_compile": True})) == [REAL]
    assert _run_patched_generate_sequences(tc, monkeypatch, OmegaConf.create({})) == [REAL]  # missing key: on
    # rollout engine creation runs in the same context (vLLM calls torch.compile while building the model)
    src = inspect.getsource(mw.ActorRolloutRefWorker._build_rollout)
    assert "with rollout_torch_compile(rollout_config):" in src
    assert src.index("with rollout_torch_compile(rollout_config):") < src.index("get_rollout_class(rollout_config.name")


def test_switch_off_restores_upstream(tc, monkeypatch) -> None:
    """rollout.real_torch_compile=false (declared in verl's RolloutConfig): the patched generate_sequences
    leaves MindSpeed's dummy in place, as the pristine pin does."""
    from omegaconf import OmegaConf
    from verl.workers.config import RolloutConfig

    assert RolloutConfig(name="vllm").real_torch_compile is True
    assert RolloutConfig(name="vllm", real_torch_compile=False).real_torch_compile is False
    off = OmegaConf.create({"real_torch_compile": False})
    assert _run_patched_generate_sequences(tc, monkeypatch, off) == [dummy_compile]
    # the dataclass form _build_rollout passes behaves the same
    with tc.rollout_torch_compile(RolloutConfig(name="vllm", real_torch_compile=False)) as fn:
        assert fn is dummy_compile and torch.compile is dummy_compile
    with tc.rollout_torch_compile(RolloutConfig(name="vllm")) as fn:
        assert fn is REAL and torch.compile is REAL
    assert torch.compile is dummy_compile


def test_rollout_torch_compile_switch(tc, mindspeed_replaced) -> None:
    mindspeed_replaced.setattr(tc, "_remembered", REAL)
    with tc.rollout_torch_compile({"real_torch_compile": False}) as fn:
        assert fn is dummy_compile and torch.compile is dummy_compile
    with tc.rollout_torch_compile(None) as fn:
        assert fn is REAL and torch.compile is REAL
    assert torch.compile is dummy_compile
    with pytest.raises(TypeError, match="rollout.real_torch_compile must be a bool, got 0"), \
            tc.rollout_torch_compile({"real_torch_compile": 0}):
        pass
