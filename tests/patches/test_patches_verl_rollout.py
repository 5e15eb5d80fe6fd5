"""verl patch 0013 (disable_gc switch): declared in Hydra, applied by the real SPMD rollout __init__.

The SPMD ``vLLMRollout.__init__`` of the patched tree runs on CPU with a stand-in ``vllm.LLM`` that
records its keyword arguments (everything else is the real code path: config dataclass, context
length checks, engine_kwargs handling, SamplingParams)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from qwen3_rl.rollout import gc_control


@pytest.fixture
def clean_hydra():
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def _compose(ws: Path, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ws / "verl" / "verl" / "trainer" / "config"), version_base=None):
        return compose(config_name="ppo_megatron_trainer", overrides=overrides)


NAME = "actor_rollout_ref.rollout.name=vllm"


def test_disable_gc_switch_is_declared(patched_imports: Path, clean_hydra: None) -> None:
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from qwen3_rl.trainer.seam import RecipeConfig, SeamConfigError

    on = _compose(patched_imports, ["+qwen3_rl.disable_gc.enable=true", NAME])
    OmegaConf.resolve(on)
    assert RecipeConfig.from_group(omega_conf_to_dataclass(on.actor_rollout_ref.rollout).qwen3_rl).disable_gc.enable
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    off = _compose(patched_imports, [NAME])
    OmegaConf.resolve(off)
    assert RecipeConfig.from_group(omega_conf_to_dataclass(off.actor_rollout_ref.rollout).qwen3_rl).disable_gc.enable \
        is False
    with pytest.raises(SeamConfigError, match="qwen3_rl.disable_gc.enable must be bool"):
        RecipeConfig.from_group({"disable_gc": {"enable": "true"}})


class _RecordingLLM:
    """Stands in for vllm.LLM in the rollout's constructor; keeps the engine arguments."""

    instances: list[_RecordingLLM] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        _RecordingLLM.instances.append(self)


def _init_rollout(monkeypatch: pytest.MonkeyPatch, **cfg):
    import torch
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout import vllm_rollout_spmd as spmd

    monkeypatch.setattr(spmd, "LLM", _RecordingLLM)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    config = RolloutConfig(name="vllm", prompt_length=8, response_length=16, tensor_model_parallel_size=1, **cfg)
    model_config = types.SimpleNamespace(
        local_path="/models/stand-in", tokenizer=types.SimpleNamespace(pad_token_id=0),
        hf_config=types.SimpleNamespace(max_position_embeddings=4096, rope_scaling=None),
        trust_remote_code=False, lora_rank=0,
    )
    monkeypatch.setattr(spmd, "omega_conf_to_dataclass", lambda c, dataclass_type=None: c, raising=False)
    import verl.workers.rollout.base as base

    monkeypatch.setattr(base, "omega_conf_to_dataclass", lambda c, dataclass_type=None: c)
    return spmd.vLLMRollout(config, model_config, device_mesh=None)


def test_spmd_rollout_applies_the_switch(patched_imports: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gc_control.set_decode_gc_disabled(False)
    try:
        rollout = _init_rollout(monkeypatch, qwen3_rl={"disable_gc": {"enable": True}},
                                engine_kwargs={"vllm": {"additional_config": {"qwen3_rl": {"x": 1}}}})
        assert gc_control.decode_gc_disabled() is True
        llm = _RecordingLLM.instances[-1]
        assert rollout.inference_engine is llm
        assert llm.kwargs["max_model_len"] == 24 and llm.kwargs["additional_config"] == {"qwen3_rl": {"x": 1}}
        _init_rollout(monkeypatch, qwen3_rl={"disable_gc": {"enable": False}})  # off again
        assert gc_control.decode_gc_disabled() is False
        assert _init_rollout(monkeypatch).qwen3_rl_hooks is None  # group empty: no hooks, nothing of ours runs
    finally:
        gc_control.set_decode_gc_disabled(False)


def test_plain_list_graph_sizes_reach_vllm(patched_imports: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl 0005: the dataclass holds a plain list; the pristine pin dropped it with a warning."""
    _init_rollout(monkeypatch, enforce_eager=False, cudagraph_capture_sizes=[8, 16, 32])
    cc = _RecordingLLM.instances[-1].kwargs["compilation_config"]
    assert list(cc.cudagraph_capture_sizes) == [8, 16, 32]
    _init_rollout(monkeypatch, enforce_eager=True, cudagraph_capture_sizes=[8, 16, 32])
    assert "compilation_config" not in _RecordingLLM.instances[-1].kwargs  # eager: no graphs


def test_switch_off_restores_upstream(patched_imports: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture, clean_hydra: None) -> None:
    """rollout.plain_list_capture_sizes=false: the patched vLLMRollout.__init__ drops the plain list with
    upstream's warning (vLLM's default sizes); true (default, declared in Hydra) passes it."""
    import logging

    from omegaconf import OmegaConf

    assert _compose(patched_imports, [NAME]).actor_rollout_ref.rollout.plain_list_capture_sizes is True
    with caplog.at_level(logging.WARNING):
        _init_rollout(monkeypatch, enforce_eager=False, cudagraph_capture_sizes=[8, 16, 32],
                      plain_list_capture_sizes=False)
    assert "compilation_config" not in _RecordingLLM.instances[-1].kwargs
    assert "cudagraph_capture_sizes must be a list, but got [8, 16, 32]" in caplog.text
    _init_rollout(monkeypatch, enforce_eager=False, cudagraph_capture_sizes=[8, 16, 32],
                  plain_list_capture_sizes=True)
    assert list(_RecordingLLM.instances[-1].kwargs["compilation_config"].cudagraph_capture_sizes) == [8, 16, 32]

    def sizes(value: object, **switch: object) -> object:
        """What the patched vLLMRollout.__init__ hands vLLM for cudagraph_capture_sizes=value (None: dropped)."""
        _init_rollout(monkeypatch, enforce_eager=False, cudagraph_capture_sizes=value, **switch)
        cc = _RecordingLLM.instances[-1].kwargs.get("compilation_config")
        return None if cc is None else list(cc.cudagraph_capture_sizes)

    # off = upstream's isinstance(..., ListConfig): a ListConfig still reaches vLLM, a tuple does not
    assert sizes(OmegaConf.create([8, 16]), plain_list_capture_sizes=False) == [8, 16]
    assert sizes((8,), plain_list_capture_sizes=False) is None
    # on: list, tuple and ListConfig, as ints
    assert sizes(OmegaConf.create([8, 16])) == [8, 16] and sizes(("8", 16)) == [8, 16]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert sizes("8,16") is None  # not a sequence: upstream's warning, vLLM's default sizes
    assert "cudagraph_capture_sizes must be a list, but got 8,16" in caplog.text
    with pytest.raises(TypeError, match="rollout.plain_list_capture_sizes must be a bool, got 'false'"):
        sizes([8], plain_list_capture_sizes="false")


def test_pristine_pin_drops_plain_list(pristine_workspace: Path) -> None:
    src = (pristine_workspace / "verl" / "verl" / "workers" / "rollout" / "vllm_rollout"
           / "vllm_rollout_spmd.py").read_text()
    assert "if isinstance(cudagraph_capture_sizes, ListConfig):" in src
