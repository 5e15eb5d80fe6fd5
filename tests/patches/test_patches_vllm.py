"""vLLM: the gc_guard engine-step hook (seam patch 0003 + ``qwen3_rl.rollout.gc_control``) and bug fix 0001
rope_registry.

* gc_guard: vLLM's own ``LLM._run_engine`` drives the patched ``LLMEngine.step`` (the engine made with
  ``object.__new__``; its hooks built by the seam from the plugin's entry point, its ``_step`` body a stand-in).
  The collector must be off inside each step while the policy is on, untouched while it is off, and its
  enabled state and thresholds must come back exactly, also when a step raises.
* 0001: a planted ``flash_attn`` whose Triton rotary module does not import (as a CUDA build does
  on an NPU host) breaks RoPE construction in the pristine pin and not in the patched tree.
"""

from __future__ import annotations

import ast
import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from qwen3_rl.rollout import gc_control
from qwen3_rl.rollout.gc_control import (
    CONFIG_KEY,
    ENGINE_CONFIG_KEY,
    GcState,
    GcStepHook,
    configure_from_rollout_config,
    configure_from_vllm_config,
    decode_gc_disabled,
    engine_step_gc_guard,
    set_decode_gc_disabled,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gc_sandbox() -> Iterator[None]:
    """Restore the process' gc state and our policy after a test that changes them."""
    saved = GcState.capture()
    policy = decode_gc_disabled()
    try:
        yield
    finally:
        saved.restore()
        set_decode_gc_disabled(policy)


# ---------------------------------------------------------------- 0001: policy object (no vllm)

def test_policy_is_off_by_default_and_guard_is_a_noop(gc_sandbox: None) -> None:
    assert decode_gc_disabled() is False
    gc.enable()
    gc.set_threshold(700, 10, 10)
    with engine_step_gc_guard() as switched:
        assert switched is False
        assert gc.isenabled()
        gc.set_threshold(5, 5, 5)  # a no-op guard must not restore anything either
    assert gc.get_threshold() == (5, 5, 5)


def test_guard_restores_enabled_state_and_thresholds_exactly(gc_sandbox: None) -> None:
    set_decode_gc_disabled(True)
    for enabled_before in (True, False):
        (gc.enable if enabled_before else gc.disable)()
        gc.set_threshold(1234, 7, 3)
        with engine_step_gc_guard() as switched:
            assert switched is True
            assert not gc.isenabled()
            gc.set_threshold(1, 1, 1)
        assert gc.isenabled() is enabled_before
        assert gc.get_threshold() == (1234, 7, 3)


def test_guard_restores_when_body_raises(gc_sandbox: None) -> None:
    set_decode_gc_disabled(True)
    gc.enable()
    gc.set_threshold(900, 11, 12)
    with pytest.raises(KeyError, match="boom"), engine_step_gc_guard():
        gc.set_threshold(2, 2, 2)
        raise KeyError("boom")
    assert gc.isenabled()
    assert gc.get_threshold() == (900, 11, 12)


def test_configure_from_rollout_config(gc_sandbox: None) -> None:
    from omegaconf import OmegaConf

    assert configure_from_rollout_config(OmegaConf.create({CONFIG_KEY: True})) is True
    assert decode_gc_disabled() is True
    assert configure_from_rollout_config({}) is False
    assert decode_gc_disabled() is False
    assert configure_from_rollout_config(None) is False
    with pytest.raises(TypeError, match=CONFIG_KEY):
        configure_from_rollout_config({CONFIG_KEY: "true"})
    with pytest.raises(TypeError):
        set_decode_gc_disabled(1)  # type: ignore[arg-type]


def test_configure_from_vllm_config(gc_sandbox: None) -> None:
    # server mode: the engine core process takes the policy from vLLM's additional_config
    def cfg(extra: object) -> SimpleNamespace:
        return SimpleNamespace(additional_config=extra)

    assert configure_from_vllm_config(cfg({ENGINE_CONFIG_KEY: {"disable_gc": True}, "other": 1})) is True
    assert decode_gc_disabled() is True
    for extra in ({}, None, {ENGINE_CONFIG_KEY: {}}, {"other": {"disable_gc": True}}):
        set_decode_gc_disabled(True)
        assert configure_from_vllm_config(cfg(extra)) is False and decode_gc_disabled() is False
    with pytest.raises(TypeError, match="disable_gc"):
        configure_from_vllm_config(cfg({ENGINE_CONFIG_KEY: {"disable_gc": "true"}}))


def test_plugin_factories_in_the_engine_core(gc_sandbox: None) -> None:
    # the factories tell the two engine loops apart: an engine core (scheduler, no output processor) gets gc_guard
    # with its config's policy, no rollout_rebalance hook, and refuses the sibling exchange; an LLMEngine keeps
    # its hooks and its policy
    from qwen3_rl.compat.step_hook import is_engine_core
    from qwen3_rl.vllm_plugin import gc_step_hook, rebalance_step_hook, sibling_exchange_step_hook

    def spec(exchange: bool) -> SimpleNamespace:
        return SimpleNamespace(method="sam", drafter_config={"group_exchange": exchange})

    core = SimpleNamespace(scheduler=object(), vllm_config=SimpleNamespace(
        additional_config={ENGINE_CONFIG_KEY: {"disable_gc": True}}, speculative_config=spec(False)))
    llm_engine = SimpleNamespace(output_processor=object(), vllm_config=SimpleNamespace(
        additional_config={ENGINE_CONFIG_KEY: {"disable_gc": False}}, speculative_config=None))
    assert is_engine_core(core) and not is_engine_core(llm_engine)
    assert isinstance(gc_step_hook(core), GcStepHook) and decode_gc_disabled() is True
    assert isinstance(gc_step_hook(llm_engine), GcStepHook) and decode_gc_disabled() is True  # not read there
    assert rebalance_step_hook(core) is None and rebalance_step_hook(llm_engine) is not None
    assert sibling_exchange_step_hook(core) is None
    core.vllm_config.speculative_config = spec(True)
    with pytest.raises(RuntimeError, match="SERVER_ROUTING"):
        sibling_exchange_step_hook(core)


# ------------------------------------- gc_guard: LLM._run_engine -> the patched LLMEngine.step, executed

@dataclass
class _Out:
    request_id: str
    finished: bool


class _StandInEngine:
    """The part of ``LLMEngine`` that ``LLM._run_engine(use_tqdm=False)`` uses.

    Each step finishes one request (ids given out of order, so the sort is exercised) and records
    the collector's state seen inside the step and between steps.
    """

    def __init__(self, ids: list[int], raise_at: int | None = None) -> None:
        self.pending = list(ids)
        self.raise_at = raise_at
        self.inside: list[tuple[bool, tuple[int, ...]]] = []
        self.between: list[bool] = []

    def get_num_unfinished_requests(self) -> int:
        return len(self.pending)

    def has_unfinished_requests(self) -> bool:
        self.between.append(gc.isenabled())
        return bool(self.pending)

    def _step(self) -> list[_Out]:
        self.inside.append((gc.isenabled(), tuple(gc.get_threshold())))
        if self.raise_at is not None and len(self.inside) == self.raise_at:
            raise RuntimeError("step failed")
        gc.set_threshold(3, 3, 3)  # something inside the step changes thresholds
        return [_Out(str(self.pending.pop(0)), True), _Out("999", False)]


def _llm_with(stand_in: _StandInEngine):
    """An ``LLM`` around a patched ``LLMEngine`` whose hooks the seam builds and whose step body is the
    stand-in's."""
    from vllm.entrypoints.llm import LLM
    from vllm.plugins.extensions import build_engine_step_hooks
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = object.__new__(LLMEngine)
    engine.vllm_config = None  # the SAM exchange factory: no speculative config -> no hook
    engine.step_hooks = build_engine_step_hooks(engine)
    assert any(isinstance(h, GcStepHook) for h in engine.step_hooks)
    engine.get_num_unfinished_requests = stand_in.get_num_unfinished_requests
    engine.has_unfinished_requests = stand_in.has_unfinished_requests
    engine._step = stand_in._step
    llm = object.__new__(LLM)
    llm.llm_engine = engine
    return llm


def test_patched_run_engine_gc_off_in_steps_and_restored(patched_imports: Path,
                                                         gc_sandbox: None) -> None:
    import vllm.entrypoints.llm as llm_mod
    import vllm.v1.engine.llm_engine as engine_mod

    assert str(patched_imports) in llm_mod.__file__ and str(patched_imports) in engine_mod.__file__

    # policy off (default): nothing changes, the step's own threshold change stays
    gc.enable()
    gc.set_threshold(1111, 22, 33)
    engine = _StandInEngine([2, 0, 1])
    outs = _llm_with(engine)._run_engine(use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert [e for e, _ in engine.inside] == [True, True, True]
    assert gc.get_threshold() == (3, 3, 3)

    # policy on: off inside every step, on between steps, thresholds back exactly afterwards
    set_decode_gc_disabled(True)
    gc.set_threshold(1111, 22, 33)
    engine = _StandInEngine([5, 3, 4])
    outs = _llm_with(engine)._run_engine(use_tqdm=False)
    assert [o.request_id for o in outs] == ["3", "4", "5"]
    assert [e for e, _ in engine.inside] == [False, False, False]
    assert engine.inside[0][1] == (1111, 22, 33)
    assert engine.inside[1][1] == (1111, 22, 33)  # restored between steps, not only at the end
    assert engine.between == [True, True, True, True]
    assert gc.isenabled()
    assert gc.get_threshold() == (1111, 22, 33)

    # a collector the caller had disabled stays disabled
    gc.disable()
    _llm_with(_StandInEngine([0]))._run_engine(use_tqdm=False)
    assert not gc.isenabled()


def test_patched_run_engine_restores_when_step_raises(patched_imports: Path, gc_sandbox: None) -> None:
    set_decode_gc_disabled(True)
    gc.enable()
    gc.set_threshold(4321, 9, 8)
    engine = _StandInEngine([0, 1, 2], raise_at=2)
    with pytest.raises(RuntimeError, match="step failed"):
        _llm_with(engine)._run_engine(use_tqdm=False)
    assert [e for e, _ in engine.inside] == [False, False]
    assert gc.isenabled()
    assert gc.get_threshold() == (4321, 9, 8)


def test_pristine_run_engine_has_no_gc_control(pristine_workspace: Path) -> None:
    """What the hook adds is absent upstream (checked, not assumed)."""
    src = (pristine_workspace / "vllm/vllm/entrypoints/llm.py").read_text()
    assert "step_outputs = self.llm_engine.step()" in src
    assert "gc.disable" not in src and "import gc" not in src
    assert "step_hooks" not in (pristine_workspace / "vllm/vllm/v1/engine/llm_engine.py").read_text()


# ------------------------------------------------------------------------ 0001: rope_registry

def _plant_flash_attn(root: Path, rotary_body: str) -> Path:
    """A ``flash_attn`` package under ``root`` whose ``ops/triton/rotary.py`` holds rotary_body."""
    pkg = root / "flash_attn"
    (pkg / "ops" / "triton").mkdir(parents=True)
    for d in (pkg, pkg / "ops", pkg / "ops" / "triton"):
        (d / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "rotary.py").write_text(textwrap.dedent(rotary_body))
    return root


_BROKEN = 'raise ImportError("libcudart.so.12: cannot open shared object file")\n'


def _forget_flash_attn() -> None:
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def test_patched_rope_on_rocm_treats_a_broken_build_as_absent(patched_imports: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The patched ``ApplyRotaryEmb.__init__`` on a stand-in ROCm platform (``current_platform.is_rocm``
    answers True): a build that does not import is treated as absent, a working one is used."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import common

    assert str(patched_imports) in common.__file__
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    monkeypatch.setattr(common.current_platform, "is_rocm", lambda: True)
    broken = _plant_flash_attn(tmp_path / "broken", _BROKEN)
    working = _plant_flash_attn(tmp_path / "working", "def apply_rotary(x, cos, sin, interleaved=False):\n"
                                                      "    return ('flash', x)\n")
    monkeypatch.syspath_prepend(str(broken))
    _forget_flash_attn()
    with set_current_vllm_config(config):
        assert common.ApplyRotaryEmb(is_neox_style=True).apply_rotary_emb_flash_attn is None
    _forget_flash_attn()
    monkeypatch.syspath_prepend(str(working))
    with set_current_vllm_config(config):
        fn = common.ApplyRotaryEmb(is_neox_style=True).apply_rotary_emb_flash_attn
    assert fn is not None and fn(1, None, None) == ("flash", 1)
    _forget_flash_attn()


_ROPE_PROBE = """
import torch
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    rope = get_rope(head_size=16, max_position=64, is_neox_style=True,
                    rope_parameters={"rope_theta": 10000.0}, dtype=torch.float32)
print("BUILT", rope.apply_rotary_emb.apply_rotary_emb_flash_attn)
"""


def test_pristine_rope_construction_fails_with_unusable_flash_attn(pristine_workspace: Path,
                                                                   tmp_path: Path) -> None:
    """The bug exists in the pin: RoPE construction imports a broken flash_attn and dies."""
    fake = _plant_flash_attn(tmp_path / "fake", _BROKEN)
    env = dict(os.environ, VLLM_PLUGINS="none", VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([str(pristine_workspace / "vllm"), str(fake)]))
    proc = subprocess.run([sys.executable, "-c", _ROPE_PROBE], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "ImportError: libcudart.so.12" in proc.stderr
    assert "flash_attn/ops/triton/rotary.py" in proc.stderr


def test_patched_rope_builds_with_unusable_flash_attn(patched_imports: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.syspath_prepend(str(_plant_flash_attn(tmp_path / "fake", _BROKEN)))
    _forget_flash_attn()
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import common, get_rope

    assert str(patched_imports) in common.__file__
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(head_size=16, max_position=64, is_neox_style=True,
                        rope_parameters={"rope_theta": 10000.0}, dtype=torch.float32)
        apply = common.ApplyRotaryEmb(is_neox_style=True)
    assert rope.apply_rotary_emb.apply_rotary_emb_flash_attn is None
    assert apply.apply_rotary_emb_flash_attn is None
    assert "flash_attn.ops.triton.rotary" not in sys.modules  # never imported off ROCm
    # the native rotary path still computes: x [seq, heads, head], cos/sin [seq, head // 2]
    x = torch.randn(5, 2, 16)
    cos, sin = torch.ones(5, 8), torch.zeros(5, 8)
    torch.testing.assert_close(apply.forward_native(x, cos, sin), x)
    _forget_flash_attn()


def test_rope_patch_replaces_the_unguarded_import(pristine_workspace: Path,
                                                  patched_workspace: Path) -> None:
    rel = "vllm/vllm/model_executor/layers/rotary_embedding/common.py"

    def init_imports(path: Path) -> list[str]:
        tree = ast.parse(path.read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ApplyRotaryEmb")
        init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        return [n.module or "" for n in ast.walk(init) if isinstance(n, ast.ImportFrom)]

    assert init_imports(pristine_workspace / rel) == ["flash_attn.ops.triton.rotary"]
    # the same import, now only on ROCm and inside a try (a broken build is absent); nothing of ours imported
    assert init_imports(patched_workspace / rel) == ["flash_attn.ops.triton.rotary"]
    text = (patched_workspace / rel).read_text()
    assert 'if current_platform.is_rocm() and find_spec("flash_attn") is not None:' in text
    assert "qwen3_rl" not in text
    assert gc_control.__name__ == "qwen3_rl.rollout.gc_control"
