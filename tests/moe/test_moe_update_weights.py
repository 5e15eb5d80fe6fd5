"""verl bug fix 0006 (self-contained in verl/utils/vllm/patch.py): train->rollout weight sync into vLLM-Ascend's
transposed fused-MoE weights.

What runs for real (patched trees via ``patched_imports``):

* vLLM 0.13's ``FusedMoE.weight_loader`` / ``_load_w13`` / ``_load_w2`` / ``determine_expert_map``,
  ``UnquantizedFusedMoEMethod.create_weights``, ``Qwen3MoeForCausalLM.load_weights`` (HF names ->
  ``make_expert_params_mapping`` -> the experts' ``weight_loader``);
* verl's patched ``patch_vllm_moe_model_weight_loader`` (and its helpers ``_moe_expert_weight_loader``,
  ``_restore_moe_kernel_layout``, ``_moe_expert_shapes``, ``_moe_method_transposes``) and
  ``vLLMRollout.update_weights``.

What is built by hand, and why:

* ``FusedMoE`` and the models are made with ``object.__new__`` (their ``__init__`` needs a device-
  inferring ``VllmConfig`` and initialised parallel groups) and given only what the code under test
  reads: ``quant_config`` (None), ``quant_method``, ``_expert_map`` (from vLLM's own
  ``determine_expert_map``), ``moe_config.is_act_and_mul`` / ``has_bias``, ``moe_parallel_config``
  (``tp_rank`` / ``tp_size``: the ``tp_rank`` property reads it), ``local_num_experts``,
  ``hidden_size``, ``intermediate_size_per_partition``; the models get ``config.num_experts``,
  ``num_redundant_experts``, ``quant_config`` and ``layers[i].mlp.experts``.
* vLLM-Ascend cannot be imported on CPU (``fused_moe.py`` evaluates ``torch.npu.Event`` at import and
  imports ``torch_npu``), so ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading``
  (``vllm_ascend/ops/fused_moe/fused_moe.py:79-88``: ``transpose(1, 2).contiguous()`` into new
  Parameters; the NZ cast is skipped, RL refuses NZ) and ``NPUWorker.wake_up``'s re-view
  (``vllm_ascend/worker/worker.py:187-207``) are replicated below, in a stand-in subclass of vLLM's
  real ``UnquantizedFusedMoEMethod`` with the Ascend class name.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# The fix lives in the patched verl tree itself (verl/utils/vllm/patch.py, self-contained: no qwen3_rl import);
# its helpers are exercised directly from there.


@pytest.fixture(scope="module")
def vp(patched_imports: Path) -> types.ModuleType:
    """The patched ``verl.utils.vllm.patch`` (bug fix 0006 applied), with vLLM 0.13 from the patched workspace."""
    import verl.utils.vllm.patch as vp

    assert Path(vp.__file__).is_relative_to(patched_imports)
    assert "qwen3_rl" not in Path(vp.__file__).read_text()  # upstreamable as it is: nothing of ours imported
    return vp


def _dims(e: int, h: int, f: int, act_and_mul: bool = True) -> types.SimpleNamespace:
    return types.SimpleNamespace(local_num_experts=e, hidden_size=h, intermediate_size_per_partition=f,
                                 moe_config=types.SimpleNamespace(is_act_and_mul=act_and_mul))


class UnquantizedFusedMoEMethod:  # noqa: N801 - stand-in names as in vLLM / vLLM-Ascend
    pass


class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    pass


def _is_fix_loader(vp: types.ModuleType, loader: object) -> bool:
    """The layout-aware loader the fix returns (a closure of ``_moe_expert_weight_loader``)."""
    return getattr(loader, "__qualname__", "") == f"{vp._moe_expert_weight_loader.__name__}.<locals>.weight_loader"


def test_shapes_and_kinds(vp) -> None:
    d = _dims(3, 8, 5)
    assert vp._moe_expert_shapes(d, "w13_weight") == ((3, 10, 8), (3, 8, 10))
    assert vp._moe_expert_shapes(d, "w2_weight") == ((3, 8, 5), (3, 5, 8))
    assert vp._moe_expert_shapes(_dims(3, 8, 5, act_and_mul=False), "w13_weight")[0] == (3, 5, 8)
    for other in ("w13_weight_scale", "w2_bias", "w13_input_scale", "weight"):
        assert vp._moe_expert_shapes(d, other) is None


def test_layout_decision_and_refusals(vp) -> None:
    """What the fix's loader hands vLLM's loader: the vLLM-layout view of a transposed weight, anything else as is."""
    seen: list[torch.Tensor] = []
    layer = _dims(2, 8, 3)
    layer.quant_method = AscendUnquantizedFusedMoEMethod()
    layer.weight_loader = lambda param, *a, **k: seen.append(param) or True
    loader = vp._moe_expert_weight_loader(layer)
    assert _is_fix_loader(vp, loader)

    def target(shape: tuple[int, ...], name: str) -> torch.Tensor:
        seen.clear()
        param = torch.zeros(shape)
        assert loader(param, torch.zeros(1), f"experts.{name}", "w1", 0, return_success=True) is True
        return seen[0]

    assert target((2, 6, 8), "w13_weight").shape == (2, 6, 8)  # vLLM layout: unchanged
    t = target((2, 8, 6), "w13_weight")  # transposed: vLLM's view of the same storage
    assert t.shape == (2, 6, 8) and not t.is_contiguous()
    assert target((2, 8, 3), "w2_weight").shape == (2, 8, 3)
    assert target((2, 3, 8), "w2_weight").shape == (2, 8, 3)
    assert target((4, 12), "w13_bias").shape == (4, 12)  # not a weight: untouched
    with pytest.raises(ValueError, match="neither"):
        target((2, 6, 9), "w13_weight")
    with pytest.raises(ValueError, match="neither"):
        target((4, 8, 3), "w2_weight")  # expert count off (e.g. not the local count)
    # a shape fitting both layouts (2F == H, F == H) is the transposed one: what the transposing method keeps
    for dims, name in ((_dims(2, 8, 4), "w13_weight"), (_dims(2, 8, 8), "w2_weight")):
        dims.quant_method, dims.weight_loader = layer.quant_method, layer.weight_loader
        loader = vp._moe_expert_weight_loader(dims)
        seen.clear()
        param = torch.arange(128.0).view(2, 8, 8)
        loader(param, torch.zeros(1), f"experts.{name}", "w1", 0)
        assert torch.equal(seen[0], param.transpose(1, 2))


def test_method_transposes_by_class_name(vp) -> None:
    class MyAscendSubclass(AscendUnquantizedFusedMoEMethod):
        pass

    class Fp8MoEMethod:
        pass

    assert vp._moe_method_transposes(UnquantizedFusedMoEMethod()) is False
    assert vp._moe_method_transposes(AscendUnquantizedFusedMoEMethod()) is True
    assert vp._moe_method_transposes(MyAscendSubclass()) is True
    assert vp._moe_method_transposes(Fp8MoEMethod()) is False
    assert vp._moe_method_transposes(None) is False


# ----------------------------------------------------------------------------------------------
# Real vLLM 0.13 FusedMoE loader
# ----------------------------------------------------------------------------------------------


@dataclass
class Vllm:
    FusedMoE: type
    Unquantized: type
    Ascend: type
    determine_expert_map: object


@pytest.fixture(scope="module")
def vllm(patched_imports: Path) -> Vllm:
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE, determine_expert_map
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    assert Path(sys.modules[FusedMoE.__module__].__file__).is_relative_to(patched_imports)

    class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
        """Stand-in: vLLM-Ascend 0.13's class name; process_weights_after_loading replicated."""

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # vllm_ascend/ops/fused_moe/fused_moe.py:82-88 (NZ cast at :90-92 skipped)
            w13 = self._maybe_pad_weight(layer.w13_weight.data).transpose(1, 2).contiguous()
            layer.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
            w2 = self._maybe_pad_weight(layer.w2_weight.data).transpose(1, 2).contiguous()
            layer.w2_weight = torch.nn.Parameter(w2, requires_grad=False)

    return Vllm(FusedMoE, UnquantizedFusedMoEMethod, AscendUnquantizedFusedMoEMethod, determine_expert_map)


@dataclass(frozen=True)
class Setup:
    """One rank's MoE layout: ``E`` global experts, hidden ``H``, expert FFN ``F`` (full)."""

    E: int = 4
    H: int = 8
    F: int = 6
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def f_tp(self) -> int:
        return self.F // self.tp_size


def make_layer(v: Vllm, s: Setup, ascend: bool) -> torch.nn.Module:
    """A vLLM ``FusedMoE`` (``object.__new__``) with real ``create_weights`` params, vLLM layout."""
    cfg = types.SimpleNamespace(is_act_and_mul=True, has_bias=False)
    method = object.__new__(v.Ascend if ascend else v.Unquantized)
    torch.nn.Module.__init__(method)  # a CustomOp, i.e. an nn.Module (a submodule of the layer)
    method.moe = cfg
    layer = object.__new__(v.FusedMoE)
    torch.nn.Module.__init__(layer)
    if s.ep_size > 1:
        local, expert_map, _ = v.determine_expert_map(s.ep_size, s.ep_rank, s.E)
    else:
        local, expert_map = s.E, None
    layer.quant_config = None
    layer.quant_method = method
    layer._expert_map = expert_map
    layer.moe_config = cfg
    layer.moe_parallel_config = types.SimpleNamespace(tp_rank=s.tp_rank, tp_size=s.tp_size)
    layer.local_num_experts = local
    layer.global_num_experts = s.E
    layer.hidden_size = s.H
    layer.intermediate_size_per_partition = s.f_tp
    method.create_weights(layer, num_experts=local, hidden_size=s.H, intermediate_size_per_partition=s.f_tp,
                          params_dtype=torch.float64, weight_loader=layer.weight_loader)
    layer.w13_weight.data.zero_()
    layer.w2_weight.data.zero_()
    return layer


def hf_experts(s: Setup, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """HF per-expert tensors: gate/up ``[F, H]``, down ``[H, F]`` (float64)."""
    g = torch.Generator().manual_seed(seed)
    return {e: {"gate_proj": torch.randn(s.F, s.H, generator=g, dtype=torch.float64),
                "up_proj": torch.randn(s.F, s.H, generator=g, dtype=torch.float64),
                "down_proj": torch.randn(s.H, s.F, generator=g, dtype=torch.float64)}
            for e in range(s.E)}


def local_experts(s: Setup) -> list[int]:
    """Global ids of this rank's experts, in local order (vLLM's linear placement)."""
    per = s.E // s.ep_size
    return list(range(s.ep_rank * per, (s.ep_rank + 1) * per))


def expected_vllm_layout(s: Setup, hf: dict[int, dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference: this rank's ``w13`` ``[E_l, 2F_tp, H]`` and ``w2`` ``[E_l, H, F_tp]``."""
    rows = slice(s.tp_rank * s.f_tp, (s.tp_rank + 1) * s.f_tp)
    w13 = torch.stack([torch.cat([hf[e]["gate_proj"][rows], hf[e]["up_proj"][rows]]) for e in local_experts(s)])
    w2 = torch.stack([hf[e]["down_proj"][:, rows] for e in local_experts(s)])
    return w13, w2


def load_direct(layer: torch.nn.Module, hf: dict[int, dict[str, torch.Tensor]]) -> list[bool]:
    """Load every HF expert tensor through each param's ``weight_loader`` like vLLM's model loaders."""
    out = []
    for e, t in hf.items():
        for hf_name, pname, shard in (("gate_proj", "w13_weight", "w1"), ("up_proj", "w13_weight", "w3"),
                                      ("down_proj", "w2_weight", "w2")):
            p = getattr(layer, pname)
            out.append(p.weight_loader(p, t[hf_name], f"experts.{pname}", shard_id=shard, expert_id=e,
                                       return_success=True))
    return out


def ascend_after_init(v: Vllm, s: Setup, seed: int = 0) -> torch.nn.Module:
    """An Ascend layer as the engine leaves it: initial vLLM load, then the Ascend transpose."""
    layer = make_layer(v, s, ascend=True)
    load_direct(layer, hf_experts(s, seed))
    layer.quant_method.process_weights_after_loading(layer)
    w13, w2 = expected_vllm_layout(s, hf_experts(s, seed))
    assert torch.equal(layer.w13_weight, w13.transpose(1, 2)) and torch.equal(layer.w2_weight, w2.transpose(1, 2))
    assert not hasattr(layer.w13_weight, "weight_loader")  # the new Parameters lost it (the bug's root)
    return layer


def wake_up_views(layer: torch.nn.Module, hidden_size: int) -> None:
    """Replica of vLLM-Ascend 0.13 ``NPUWorker.wake_up`` (worker.py:189-207) for one layer."""
    if layer.w2_weight.shape[2] == hidden_size:
        layer.w2_weight = torch.nn.Parameter(layer.w2_weight.transpose(1, 2), requires_grad=False)
    if layer.w13_weight.shape[1] == hidden_size:
        layer.w13_weight = torch.nn.Parameter(layer.w13_weight.transpose(1, 2), requires_grad=False)


# --- (a) the bug, with vLLM's real loader --------------------------------------------------------


def test_bug_upstream_loader_on_transposed_params_raises(vllm: Vllm) -> None:
    s = Setup(E=4, H=8, F=6)
    layer = ascend_after_init(vllm, s)
    for p in (layer.w13_weight, layer.w2_weight):  # what pristine verl's patch.py does
        p.weight_loader = layer.weight_loader
    with pytest.raises(RuntimeError):
        load_direct(layer, hf_experts(s, seed=1))
    # is_transposed (GPTQ convention) flips the shard dim but expects the loaded tensor transposed too
    layer = ascend_after_init(vllm, Setup(E=4, H=8, F=6, tp_size=2, tp_rank=1))
    for p in (layer.w13_weight, layer.w2_weight):
        p.weight_loader, p.is_transposed = layer.weight_loader, True
    with pytest.raises(RuntimeError):
        load_direct(layer, hf_experts(Setup(E=4, H=8, F=6, tp_size=2, tp_rank=1), seed=1))


@pytest.mark.parametrize("s", [Setup(E=2, H=8, F=4), Setup(E=2, H=8, F=16, tp_size=2, tp_rank=1)],
                         ids=["w13_2F_eq_H", "w2_Ftp_eq_H"])
def test_bug_ambiguous_shape_loads_silently_wrong(vllm: Vllm, s: Setup) -> None:
    layer = ascend_after_init(vllm, s)
    for p in (layer.w13_weight, layer.w2_weight):
        p.weight_loader = layer.weight_loader
    hf = hf_experts(s, seed=1)
    kind = "w13" if 2 * s.f_tp == s.H else "w2"
    if kind == "w13":  # w2 is unambiguous here and raises: load only gate/up
        for e, t in hf.items():
            for name, shard in (("gate_proj", "w1"), ("up_proj", "w3")):
                layer.weight_loader(layer.w13_weight, t[name], "experts.w13_weight", shard_id=shard, expert_id=e)
    else:
        for e, t in hf.items():
            layer.weight_loader(layer.w2_weight, t["down_proj"], "experts.w2_weight", shard_id="w2", expert_id=e)
    w13, w2 = expected_vllm_layout(s, hf)
    got, want = ((layer.w13_weight, w13) if kind == "w13" else (layer.w2_weight, w2))
    assert not torch.equal(got, want.transpose(1, 2))  # no error, but the kernel tensor is wrong
    assert torch.equal(got, want)  # ... it holds the vLLM layout where the kernel reads the transposed one


def test_bug_wake_up_views_leave_wrong_kernel_shape(vllm: Vllm, vp) -> None:
    """free_cache_engine=True: after wake-up the upstream loader fits, but the kernel tensor has vLLM's shape."""
    s = Setup(E=4, H=8, F=6)
    layer = ascend_after_init(vllm, s)
    wake_up_views(layer, s.H)
    for p in (layer.w13_weight, layer.w2_weight):
        p.weight_loader = layer.weight_loader
    load_direct(layer, hf_experts(s, seed=1))
    vllm_shape, transposed_shape = vp._moe_expert_shapes(layer, "w13_weight")
    assert tuple(layer.w13_weight.shape) == vllm_shape != transposed_shape
    assert not layer.w13_weight.is_contiguous()  # npu_grouped_matmul (need_trans=False) wants [E, H, 2F]


# --- (b) the fix -----------------------------------------------------------------------------------

FIX_SETUPS = {
    "tp1": Setup(E=4, H=8, F=6),
    "tp2_rank0": Setup(E=4, H=8, F=6, tp_size=2, tp_rank=0),
    "tp2_rank1": Setup(E=4, H=8, F=6, tp_size=2, tp_rank=1),
    "ep2_rank0": Setup(E=4, H=8, F=6, ep_size=2, ep_rank=0),
    "ep2_rank1": Setup(E=4, H=8, F=6, ep_size=2, ep_rank=1),
    "ambiguous_w13": Setup(E=2, H=8, F=4),
    "ambiguous_w2_tp2": Setup(E=2, H=8, F=16, tp_size=2, tp_rank=1),
}


@pytest.mark.parametrize("wake_up", [False, True], ids=["no_wake_up", "after_wake_up"])
@pytest.mark.parametrize("name", list(FIX_SETUPS))
def test_fix_loader_gives_transposed_vllm_weights(vllm: Vllm, vp, name: str, wake_up: bool) -> None:
    s = FIX_SETUPS[name]
    layer = ascend_after_init(vllm, s)
    ptr13, ptr2 = layer.w13_weight.data_ptr(), layer.w2_weight.data_ptr()
    if wake_up:
        wake_up_views(layer, s.H)
    loader = vp._moe_expert_weight_loader(layer)
    assert _is_fix_loader(vp, loader)
    # kernel layout restored in place, contiguous, same memory (no copy)
    assert layer.w13_weight.is_contiguous() and layer.w2_weight.is_contiguous()
    assert (layer.w13_weight.data_ptr(), layer.w2_weight.data_ptr()) == (ptr13, ptr2)
    assert tuple(layer.w13_weight.shape) == vp._moe_expert_shapes(layer, "w13_weight")[1]
    for p in (layer.w13_weight, layer.w2_weight):
        p.weight_loader = loader
    hf = hf_experts(s, seed=7)
    ok = load_direct(layer, hf)
    # vLLM's reference: the same HF tensors through the real upstream loader into a vLLM-layout layer
    ref = make_layer(vllm, s, ascend=False)
    assert load_direct(ref, hf) == ok
    w13, w2 = expected_vllm_layout(s, hf)
    assert torch.equal(ref.w13_weight, w13) and torch.equal(ref.w2_weight, w2)
    assert torch.equal(layer.w13_weight, ref.w13_weight.transpose(1, 2))
    assert torch.equal(layer.w2_weight, ref.w2_weight.transpose(1, 2))
    # EP: exactly the non-local experts were skipped (loader returned False), as vLLM does
    per_expert = [all(ok[3 * i: 3 * i + 3]) for i in range(s.E)]
    assert [e for e in range(s.E) if per_expert[e]] == local_experts(s)
    assert not any(ok[3 * i] for i in range(s.E) if i not in local_experts(s))


def test_fix_delegates_vllm_layout_and_non_weights(vllm: Vllm, vp) -> None:
    """Ascend method but params still in vLLM layout (before processing): loaded as vLLM does."""
    s = Setup(E=4, H=8, F=6, tp_size=2, tp_rank=1)
    layer = make_layer(vllm, s, ascend=True)
    loader = vp._moe_expert_weight_loader(layer)
    assert _is_fix_loader(vp, loader)
    for p in (layer.w13_weight, layer.w2_weight):
        p.weight_loader = loader
    hf = hf_experts(s, seed=3)
    load_direct(layer, hf)
    w13, w2 = expected_vllm_layout(s, hf)
    assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)
    seen = []
    layer.weight_loader = lambda *a, **k: seen.append((a, k)) or True  # the loader the fix wraps
    wrapper = vp._moe_expert_weight_loader(layer)
    bias = torch.zeros(4, 12)
    assert wrapper(bias, torch.ones(6), "experts.w13_bias", "w1", 0, return_success=True) is True
    assert seen[0][0][0] is bias  # not a weight: handed over untouched


def test_fix_refuses_a_param_of_unknown_shape(vllm: Vllm, vp) -> None:
    s = Setup(E=4, H=8, F=6)
    layer = ascend_after_init(vllm, s)
    loader = vp._moe_expert_weight_loader(layer)
    wrong = torch.nn.Parameter(torch.zeros(4, 8, 7, dtype=torch.float64), requires_grad=False)
    with pytest.raises(ValueError, match="neither"):
        loader(wrong, torch.zeros(6, 8), "experts.w13_weight", "w1", 0)
    layer.w13_weight = torch.nn.Parameter(torch.zeros(4, 12, 9).transpose(1, 2), requires_grad=False)
    with pytest.raises(ValueError, match="transposed view"):
        vp._restore_moe_kernel_layout(layer)


# --- (c) GPU vLLM layout unchanged --------------------------------------------------------------


def test_gpu_layout_gets_the_plain_upstream_loader(vllm: Vllm, vp) -> None:
    s = Setup(E=4, H=8, F=6, tp_size=2, tp_rank=0)
    layer = make_layer(vllm, s, ascend=False)
    before = (layer.w13_weight, layer.w2_weight)
    loader = vp._moe_expert_weight_loader(layer)
    assert loader == layer.weight_loader and not _is_fix_loader(vp, loader)
    assert layer.w13_weight is before[0] and layer.w2_weight is before[1]  # same Parameter objects


# ----------------------------------------------------------------------------------------------
# The patched verl path, end to end: update_weights -> patch_vllm_moe_model_weight_loader ->
# Qwen3MoeForCausalLM.load_weights (real) -> experts' weight_loader
# ----------------------------------------------------------------------------------------------


def make_qwen3_moe(v: Vllm, s: Setup, ascend: bool, n_layers: int = 2, wake_up: bool = False):
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeModel

    inner = object.__new__(Qwen3MoeModel)
    torch.nn.Module.__init__(inner)
    inner.config = types.SimpleNamespace(num_experts=s.E)
    inner.num_redundant_experts = 0
    inner.quant_config = None
    layers = []
    for i in range(n_layers):
        experts = ascend_after_init(v, s, seed=100 + i) if ascend else make_layer(v, s, ascend=False)
        if wake_up:
            wake_up_views(experts, s.H)
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.experts = experts
        layers.append(block)
    inner.layers = torch.nn.ModuleList(layers)
    model = object.__new__(Qwen3MoeForCausalLM)
    torch.nn.Module.__init__(model)
    model.model = inner
    return model


def hf_stream(s: Setup, n_layers: int, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """What verl's weight sync yields for the experts: ``model.layers.L.mlp.experts.e.*_proj.weight``."""
    for layer_idx in range(n_layers):
        for e, t in hf_experts(s, seed + layer_idx).items():
            for proj, w in t.items():
                yield f"model.layers.{layer_idx}.mlp.experts.{e}.{proj}.weight", w


def run_update_weights(model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Execute the patched ``vLLMRollout.update_weights`` (object.__new__: __init__ builds a vllm.LLM)."""
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMRollout

    rollout = object.__new__(vLLMRollout)
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
    executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=worker))
    rollout.inference_engine = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_executor=executor))
    asyncio.run(rollout.update_weights(weights))


@pytest.mark.parametrize("name,wake_up", [("tp2_rank1", True), ("ep2_rank1", False), ("ambiguous_w13", True)])
def test_patched_verl_update_weights_on_ascend_layout(vllm: Vllm, vp, name: str, wake_up: bool) -> None:
    s, n_layers = FIX_SETUPS[name], 2
    model = make_qwen3_moe(vllm, s, ascend=True, n_layers=n_layers, wake_up=wake_up)
    run_update_weights(model, hf_stream(s, n_layers, seed=50))
    for i in range(n_layers):
        experts = model.model.layers[i].mlp.experts
        w13, w2 = expected_vllm_layout(s, hf_experts(s, 50 + i))
        assert experts.w13_weight.is_contiguous()
        assert torch.equal(experts.w13_weight, w13.transpose(1, 2))
        assert torch.equal(experts.w2_weight, w2.transpose(1, 2))
        assert _is_fix_loader(vp, experts.w2_weight.weight_loader)
    # a second step (weights trained further) loads again in place
    run_update_weights(model, hf_stream(s, n_layers, seed=60))
    w13, w2 = expected_vllm_layout(s, hf_experts(s, 61))
    assert torch.equal(model.model.layers[1].mlp.experts.w13_weight, w13.transpose(1, 2))


def test_patched_verl_gpu_layout_unchanged(vllm: Vllm) -> None:
    from verl.utils.vllm.patch import patch_vllm_moe_model_weight_loader

    s, n_layers = Setup(E=4, H=8, F=6, tp_size=2, tp_rank=1), 2
    model = make_qwen3_moe(vllm, s, ascend=False, n_layers=n_layers)
    params = [(m.mlp.experts.w13_weight, m.mlp.experts.w2_weight) for m in model.model.layers]
    patch_vllm_moe_model_weight_loader(model)
    for m, (w13p, w2p) in zip(model.model.layers, params, strict=True):
        assert m.mlp.experts.w13_weight is w13p and m.mlp.experts.w2_weight is w2p
        # the same bound upstream method verl 0.6.1 attaches
        assert w13p.weight_loader == m.mlp.experts.weight_loader
        assert w13p.weight_loader.__func__ is vllm.FusedMoE.weight_loader
    loaded = model.load_weights(hf_stream(s, n_layers, seed=70))
    assert len(loaded) == n_layers * 2
    for i, m in enumerate(model.model.layers):
        w13, w2 = expected_vllm_layout(s, hf_experts(s, 70 + i))
        assert torch.equal(m.mlp.experts.w13_weight, w13) and torch.equal(m.mlp.experts.w2_weight, w2)


def test_patched_verl_leaves_dense_models_alone(vllm: Vllm) -> None:
    from verl.utils.vllm.patch import patch_vllm_moe_model_weight_loader
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    model = object.__new__(Qwen3ForCausalLM)
    torch.nn.Module.__init__(model)
    model.model = torch.nn.Module()
    model.model.w = torch.nn.Parameter(torch.ones(2))
    patch_vllm_moe_model_weight_loader(model)
    assert not hasattr(model.model.w, "weight_loader")
