"""Chunked MoE in prefill (qwen3_rl.moe.chunking, the ``ascend_moe_forward_impl`` point of the vLLM-Ascend seam).

* plan / run logic: equal chunk counts across ranks, exact coverage, outputs equal to the unchunked
  forward of a toy MoE on CPU (hypothesis), validation errors, the memory model's figures.
* the PATCHED vLLM-Ascend 0.13 code: the patched ``vllm_ascend/ops/fused_moe/fused_moe.py`` is imported for
  real (torch_npu, ``torch.npu`` and ``vllm_ascend.utils`` stood in) in two gloo processes; the layer's hook
  comes from the seam's ``build_from_factory("ascend_moe_forward_impl", ...)`` as in ``AscendFusedMoE.__init__``
  (the plugin's factory), and the real ``AscendFusedMoE.forward_impl`` (seam + the upstream body) runs with the
  real ``PrepareAndFinalizeWithAll2All`` and a toy expert method that dispatches/combines rows with real
  ``all_to_all_single`` across the two ranks.
* the train script's switch composed with the patched verl config lands in
  ``engine_kwargs.vllm.additional_config``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # worker mode (python tests/moe/test_moe_chunking.py --worker ...)
    sys.path.insert(0, str(REPO))
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from qwen3_rl.moe.chunking import (  # noqa: E402
    CONFIG_KEY,
    QWEN3_235B,
    MoeShape,
    chunk_plan_for_step,
    forward_in_chunks,
    moe_prefill_chunk_size_from_config,
    moe_routed_peak_bytes,
    plan_chunks,
    qwen3_235b_prefill_peak,
    run_chunked,
)

from conftest import free_port  # noqa: E402

SCRIPT_235B = REPO / "internal" / "train_grpo_qwen3_235b_128die_true_weight.sh"
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
KEY = "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.moe_prefill_chunk_size"


# ---- toy MoE (CPU, float64): per-token routing, so chunking must not change the result ---------------

def _toy_weights(num_experts: int, hidden: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, hidden, hidden, generator=g, dtype=torch.float64) / hidden**0.5


def _route(router_logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.to(torch.float64), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _toy_moe(x: torch.Tensor, router_logits: torch.Tensor, w: torch.Tensor, topk: int) -> torch.Tensor:
    """[n, H], [n, E] -> [n, H]: sum_k weight_k * tanh(x @ W[id_k]), row by row (no cross-row effects)."""
    weights, ids = _route(router_logits, topk)
    out = torch.zeros_like(x)
    for k in range(topk):
        for e in ids[:, k].unique().tolist():
            rows = ids[:, k] == e
            out[rows] += weights[rows, k, None] * torch.tanh(x[rows] @ w[e])
    return out


# ---- plan_chunks -----------------------------------------------------------------------------------

def test_plan_examples() -> None:
    assert plan_chunks(10, 10, 4) == [(0, 3), (3, 6), (6, 10)]  # balanced, each <= 4
    assert plan_chunks(10, 10, 10) == [(0, 10)]
    assert plan_chunks(10, 10, 100) == [(0, 10)]
    assert plan_chunks(0, 0, 5) == [(0, 0)]  # nothing anywhere: one (empty) call, as upstream
    # a rank with fewer rows than the DP maximum runs as many chunks, some empty
    assert plan_chunks(2, 20, 8) == [(0, 0), (0, 1), (1, 2)]
    assert plan_chunks(0, 20, 8) == [(0, 0)] * 3
    # aligned to the TP size: every chunk but the last splits evenly over 4 TP ranks
    assert plan_chunks(34816, 34816, 4096, align=4) == [(i * 8704 // 9 * 4, (i + 1) * 8704 // 9 * 4)
                                                        for i in range(9)]
    assert plan_chunks(10, 10, 3, align=4) == [(0, 4), (4, 8), (8, 10)]  # chunk rounded up to 4 rows


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((10, 10, 0), {}, "chunk_tokens must be >= 1"),
    ((10, 10, -4), {}, "chunk_tokens must be >= 1"),
    ((-1, 10, 4), {}, "num_tokens_local must be >= 0"),
    ((10, -1, 4), {}, "max_tokens_across_dp must be >= 0"),
    ((10, 10, 4), {"align": 0}, "align must be >= 1"),
])
def test_plan_rejects_bad_values(args, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        plan_chunks(*args, **kwargs)


@pytest.mark.parametrize("bad", [4.0, "4", True, None])
def test_plan_rejects_non_int(bad) -> None:
    with pytest.raises(TypeError, match="chunk_tokens must be an int"):
        plan_chunks(10, 10, bad)


@settings(max_examples=300, deadline=None)
@given(local=st.lists(st.integers(0, 5000), min_size=1, max_size=16), chunk=st.integers(1, 3000),
       align=st.sampled_from([1, 2, 4, 8]))
def test_plan_equal_counts_across_ranks_and_exact_cover(local, chunk, align) -> None:
    """Every DP rank plans with its own rows and the shared DP maximum: same chunk count everywhere,
    contiguous exact cover of the local rows, each chunk <= chunk size rounded up to ``align``."""
    global_max = max(local)
    plans = [plan_chunks(n, global_max, chunk, align=align) for n in local]
    assert len({len(p) for p in plans}) == 1
    cap = -(-chunk // align) * align
    for n, plan in zip(local, plans, strict=True):
        assert plan[0][0] == 0 and plan[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(plan, plan[1:], strict=False))
        sizes = [e - s for s, e in plan]
        assert min(sizes) >= 0 and max(sizes) <= cap
        # all but the last non-empty chunk are whole multiples of align (even TP split)
        nonempty = [i for i, size in enumerate(sizes) if size]
        assert all(sizes[i] % align == 0 for i in nonempty[:-1])
    # as few chunks as the size allows: one chunk fewer would need a chunk above the cap
    assert len(plans[0]) == max(1, math.ceil(math.ceil(global_max / align) / (cap // align)))


# ---- chunk_plan_for_step: when the patched forward chunks -------------------------------------------

class _CommType:  # stands in for vllm_ascend's MoECommType members (an Enum: .name)
    def __init__(self, name: str) -> None:
        self.name = name


def test_step_decision() -> None:
    a2a = _CommType("ALLTOALL")
    kw = {"max_tokens_across_dp": 9000, "comm_type": a2a, "sp_enabled": False}
    assert chunk_plan_for_step(9000, 0, **kw) is None  # switch off
    assert chunk_plan_for_step(9000, 9000, **kw) is None  # not above the chunk size
    assert chunk_plan_for_step(256, 4096, **dict(kw, max_tokens_across_dp=256)) is None  # decode-sized
    for other in ("MC2", "FUSED_MC2", "ALLGATHER"):
        assert chunk_plan_for_step(9000, 4096, **dict(kw, comm_type=_CommType(other))) is None
    assert chunk_plan_for_step(9000, 4096, **dict(kw, comm_type=None)) is None
    assert chunk_plan_for_step(9000, 4096, **dict(kw, sp_enabled=True)) is None
    plan = chunk_plan_for_step(9000, 4096, **kw, tp_size=4)
    assert plan == plan_chunks(9000, 9000, 4096, align=4) and len(plan) == 3
    assert chunk_plan_for_step(9000, 4096, **dict(kw, comm_type="ALLTOALL")) == plan_chunks(9000, 9000, 4096)
    # the DP maximum decides, not the local rows: a short rank still chunks as often as the longest
    assert len(chunk_plan_for_step(100, 4096, **kw)) == 3
    # no DP metadata (DP 1): the local rows are the global rows
    assert len(chunk_plan_for_step(9000, 4096, **dict(kw, max_tokens_across_dp=None))) == 3


def test_step_decision_ascend023() -> None:
    """vLLM-Ascend 0.23 (chunking_ascend023.step_plan): ALLTOALL as on 0.13; ALLGATHER only without DP and PCP
    (nothing gathered); MC2 / FUSED_MC2 / sequence parallel never. The engine run is
    tests/engine_current/test_current_ascend_engine.py."""
    from qwen3_rl.moe.chunking_ascend023 import install, step_plan

    kw = {"max_tokens_across_dp": 9000, "sp_enabled": False, "tp_size": 1, "dp_size": 1, "pcp_size": 1}
    want = plan_chunks(9000, 9000, 4096)
    for name in ("ALLTOALL", "ALLGATHER"):
        assert step_plan(9000, 4096, comm_type=_CommType(name), **kw) == want
        assert step_plan(9000, 4096, comm_type=_CommType(name), **dict(kw, sp_enabled=True)) is None
        assert step_plan(4096, 4096, comm_type=_CommType(name), **dict(kw, max_tokens_across_dp=4096)) is None
    assert step_plan(9000, 4096, comm_type=_CommType("ALLTOALL"), **dict(kw, dp_size=2)) == want
    for extra in ({"dp_size": 2}, {"pcp_size": 2}):
        assert step_plan(9000, 4096, comm_type=_CommType("ALLGATHER"), **dict(kw, **extra)) is None
    for other in ("MC2", "FUSED_MC2"):
        assert step_plan(9000, 4096, comm_type=_CommType(other), **kw) is None
    # switch off: nothing is looked at or wrapped; refused keys are refused before vLLM-Ascend is imported
    assert install(None, types.SimpleNamespace(additional_config={CONFIG_KEY: 0})) == 0
    with pytest.raises(ValueError, match="multistream_overlap_gate"):
        install(None, types.SimpleNamespace(additional_config={CONFIG_KEY: 8, "multistream_overlap_gate": True}))


# ---- forward_in_chunks / run_chunked -------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 60), chunk=st.integers(1, 25), topk=st.integers(1, 3), seed=st.integers(0, 9))
def test_run_chunked_equals_unchunked_toy_moe(rows, chunk, topk, seed) -> None:
    hidden, experts = 8, 5
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    logits = torch.randn(rows, experts, generator=g, dtype=torch.float64)
    w = _toy_weights(experts, hidden, seed)
    calls: list[int] = []

    def fn(h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return _toy_moe(h, r, w, topk)

    plan = plan_chunks(rows, rows, chunk)
    out = run_chunked(fn, x, logits, plan)
    assert calls == [e - s for s, e in plan]
    assert out.shape == (rows, hidden) and out.dtype == torch.float64
    torch.testing.assert_close(out, _toy_moe(x, logits, w, topk), rtol=1e-12, atol=1e-12)


def test_forward_in_chunks_results_and_errors() -> None:
    x = torch.arange(12.0).view(6, 2)
    logits = torch.zeros(6, 3)
    results = []

    def fn(h, r):
        res = types.SimpleNamespace(routed_out=h * 2, tag=len(results))
        results.append(res)
        return res

    out, first, last = forward_in_chunks(fn, x, logits, [(0, 2), (2, 2), (2, 6)],
                                         routed_out_of=lambda res: res.routed_out)
    torch.testing.assert_close(out, x * 2)
    assert (first.tag, last.tag, len(results)) == (0, 2, 3)  # the empty chunk ran too
    with pytest.raises(ValueError, match="covers 4 rows, the input has 6"):
        run_chunked(lambda h, r: h, x, logits, [(0, 4)])
    with pytest.raises(ValueError, match="not contiguous"):
        run_chunked(lambda h, r: h, x, logits, [(0, 2), (3, 6)])
    with pytest.raises(ValueError, match="empty chunk plan"):
        run_chunked(lambda h, r: h, x, logits, [])
    with pytest.raises(ValueError, match="router_logits 5"):
        run_chunked(lambda h, r: h, x, logits[:5], [(0, 6)])
    with pytest.raises(ValueError, match=r"chunk 0 \(0, 3\): forward returned \(2, 2\), expected 3 rows"):
        run_chunked(lambda h, r: h[:2], x, logits, [(0, 3), (3, 6)])


# ---- config key --------------------------------------------------------------------------------------

def test_hook_with_events_merges_chunk_results() -> None:
    """``return_with_event`` (the shared-experts path, ``shared_forward_impl``): one ``[N, H]`` routed output, the
    first chunk's ``before_dispatch_evt`` and the last chunk's ``before_gmm2_evt`` / ``before_combine_evt`` (fields of
    vLLM-Ascend 0.23's ``FusedMoEResult``); a forward without a plan is the body's own result (positive control)."""
    import dataclasses

    from qwen3_rl.moe.chunking import ChunkedForwardImpl

    @dataclasses.dataclass
    class Result:  # vLLM-Ascend 0.23's FusedMoEResult fields (ops/fused_moe/fused_moe.py:70-76)
        routed_out: torch.Tensor
        before_dispatch_evt: object = None
        before_gmm2_evt: object = None
        before_combine_evt: object = None
        swiglu_limit: float = 0.0

    class Fixed(ChunkedForwardImpl):
        def __init__(self, plan) -> None:  # noqa: ANN001
            super().__init__(4)
            self.fixed = plan

        def plan(self, rows: int):  # noqa: ANN202
            return self.fixed

    calls = []

    def body(h: torch.Tensor, r: torch.Tensor, with_event: bool):  # noqa: ANN202
        i = len(calls)
        calls.append((h.shape[0], with_event))
        out = h * 2 + r.sum(-1, keepdim=True)
        return Result(out, f"dispatch{i}", f"gmm2{i}", f"combine{i}", 1.5) if with_event else out

    h, r = torch.randn(10, 3), torch.randn(10, 5)
    want = h * 2 + r.sum(-1, keepdim=True)
    res = Fixed([(0, 4), (4, 8), (8, 10)])(body, h, r, True)
    assert calls == [(4, True), (4, True), (2, True)]
    assert torch.equal(res.routed_out, want)
    assert (res.before_dispatch_evt, res.before_gmm2_evt, res.before_combine_evt, res.swiglu_limit) == (
        "dispatch0", "gmm22", "combine2", 1.5)
    calls.clear()
    assert torch.equal(Fixed([(0, 4), (4, 10)])(body, h, r, False), want) and calls == [(4, False), (6, False)]
    calls.clear()
    one = Fixed(None)(body, h, r, True)
    assert calls == [(10, True)] and one.before_gmm2_evt == "gmm20" and torch.equal(one.routed_out, want)


def test_config_key_parsing() -> None:
    assert CONFIG_KEY == "moe_prefill_chunk_size"
    for config, want in [(None, 0), ({}, 0), ({CONFIG_KEY: None}, 0), ({CONFIG_KEY: 0}, 0),
                         ({CONFIG_KEY: 4096}, 4096), ({CONFIG_KEY: "2048"}, 2048), ({CONFIG_KEY: 512.0}, 512),
                         ({CONFIG_KEY: 0, "multistream_overlap_gate": True}, 0)]:
        assert moe_prefill_chunk_size_from_config(config) == want, config
    for bad, err in [(-1, ValueError), ("-5", ValueError), ("lots", TypeError), (1.5, TypeError),
                     (True, TypeError), ([4096], TypeError)]:
        with pytest.raises(err, match=CONFIG_KEY):
            moe_prefill_chunk_size_from_config({CONFIG_KEY: bad})
    for key in ("multistream_overlap_gate", "recompute_scheduler_enable"):
        with pytest.raises(ValueError, match=f"cannot be combined with {key}"):
            moe_prefill_chunk_size_from_config({CONFIG_KEY: 4096, key: True})


# ---- memory model --------------------------------------------------------------------------------------

def test_memory_model_qwen3_235b_figures() -> None:
    h, f, k, b, t = 4096, 1536, 8, 2, 4
    assert (QWEN3_235B.hidden, QWEN3_235B.ffn, QWEN3_235B.topk, QWEN3_235B.dtype_bytes, QWEN3_235B.tp) == (
        h, f, k, b, t)
    n = 34816 // t
    # balanced, one expert per rank: the combine all-to-all stage (received + expert out + back) dominates
    assert moe_routed_peak_bytes(34816, QWEN3_235B) == 3 * n * k * h * b == 1_711_276_032
    res = qwen3_235b_prefill_peak(34816, 4096)
    # by hand: 34816 rows = 8704 units of TP 4 rows, 4096 rows = 1024 units -> ceil(8704 / 1024) = 9 chunks;
    # 8704 = 9 * 967 + 1 spread evenly -> eight chunks of 967 units, one of 968 = 3872 rows
    assert (res["chunks"], res["largest_chunk"]) == (9, 3872)
    # the largest chunk's combine stage (3 * 968 rows/rank * top-8 of H, bf16) + its [3872, H] output copy
    assert res["peak_bytes_chunked"] == 3 * 968 * 8 * 4096 * 2 + 3872 * 4096 * 2 == 222_035_968
    assert res["peak_bytes_unchunked"] == 1_711_276_032
    # 1_711_276_032 / 2**30 = 1.5938, 222_035_968 / 2**30 = 0.2068, difference 1.3870
    assert (res["peak_gib_unchunked"], res["peak_gib_chunked"], res["saved_gib"]) == (1.594, 0.207, 1.387)
    off = qwen3_235b_prefill_peak(34816)  # chunk size 0: one chunk, the unchunked figure
    assert (off["chunks"], off["largest_chunk"], off["peak_bytes_chunked"]) == (1, 34816, 1_711_276_032)
    assert qwen3_235b_prefill_peak(2048, 4096)["chunks"] == 1  # not above the size: unchanged
    # a wide FFN makes the gate_up stage dominate; >1 local expert adds the expert-order copies
    wide = MoeShape(hidden=16, ffn=100, topk=2)
    assert moe_routed_peak_bytes(10, wide) == 20 * (16 + 300) * 2
    multi = MoeShape(hidden=16, ffn=4, topk=2, local_experts=2)
    assert moe_routed_peak_bytes(10, multi) == (3 * 20 + 20) * 16 * 2
    # a hot rank receiving twice its share
    assert moe_routed_peak_bytes(34816, QWEN3_235B, imbalance=2.0) == (2 * 2 * n * k + n * k) * h * b
    with pytest.raises(ValueError, match="imbalance"):
        moe_routed_peak_bytes(10, QWEN3_235B, imbalance=0)


# ---- the switch: train script -> additional_config -> the plugin's factory --------------------------------

def _hook_chunk(additional_config) -> int:
    """Chunk size of the hook the plugin's ``ascend_moe_forward_impl`` factory builds (0: no hook)."""
    from qwen3_rl.vllm_plugin import _moe_forward_impl

    hook = _moe_forward_impl(None, types.SimpleNamespace(additional_config=additional_config))
    return 0 if hook is None else hook.chunk_tokens


def test_train_switch_reaches_the_forward_hook(rollout_engine_kwargs) -> None:
    from qwen3_rl.tools.launch import TrainScriptError, parse_train_script

    def _engine_kwargs(**env: str) -> dict:
        return rollout_engine_kwargs(SCRIPT_235B, dict(BASE_ENV, **env))[0]

    kwargs = _engine_kwargs(MOE_PREFILL_CHUNK_SIZE="4096")
    add = kwargs["additional_config"]
    assert dict(add) == {"moe_prefill_chunk_size": 4096}
    assert _hook_chunk(add) == 4096
    # with EPLB on both sets of keys share additional_config
    both = _engine_kwargs(MOE_PREFILL_CHUNK_SIZE="2048", ROLLOUT_EPLB="True")["additional_config"]
    assert both["moe_prefill_chunk_size"] == 2048 and both["eplb_config"]["eplb_policy_type"] == 4
    assert _hook_chunk(both) == 2048
    # default 0: no key at all -> no hook, the upstream forward alone
    off = _engine_kwargs()
    assert "additional_config" not in off
    assert _hook_chunk(off.get("additional_config")) == 0
    assert _hook_chunk({"moe_prefill_chunk_size": 0}) == 0
    # the factory refuses what the package refuses (when the layers are built)
    with pytest.raises(ValueError, match="must be >= 0"):
        _hook_chunk({"moe_prefill_chunk_size": -8})
    with pytest.raises(ValueError, match="multistream_overlap_gate"):
        _hook_chunk({"moe_prefill_chunk_size": 1024, "multistream_overlap_gate": True})
    # script side: only for values > 0, only the MoE setups, integers only
    assert not any(o.startswith(KEY) for o in parse_train_script(SCRIPT_235B, env=BASE_ENV).overrides)
    assert f"{KEY}=100" in parse_train_script(SCRIPT_235B, env=dict(BASE_ENV, MOE_PREFILL_CHUNK_SIZE="0100")).overrides
    dense = REPO / "internal" / "train_grpo_qwen3_32b_32die_true_weight.sh"
    assert not any(o.startswith(KEY) for o in
                   parse_train_script(dense, env=dict(BASE_ENV, MOE_PREFILL_CHUNK_SIZE="4096")).overrides)
    for bad in ("abc", "-1", "4k", "1.5"):
        with pytest.raises(TrainScriptError, match=f"error: MOE_PREFILL_CHUNK_SIZE='{bad}': expected an integer >= 0$"):
            parse_train_script(SCRIPT_235B, env=dict(BASE_ENV, MOE_PREFILL_CHUNK_SIZE=bad))


# ---- patched vLLM-Ascend: AscendFusedMoE.forward_impl on two gloo ranks -----------------------------------

HIDDEN, EXPERTS, TOPK = 8, 4, 2


class _Any:
    """Stand-in for any torch_npu / vllm_ascend.utils name the imported modules bind at import time."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs) -> _Any:
        return _Any()

    def __getattr__(self, name: str) -> _Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


def _stub_module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)

    def getattr_(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Any()

    mod.__getattr__ = getattr_  # type: ignore[method-assign]
    sys.modules[name] = mod
    return mod


def _import_patched_fused_moe(ws: Path):
    """Import the patched ``vllm_ascend.ops.fused_moe.fused_moe`` (and, for real, the modules it uses:
    ascend_config, ascend_forward_context, prepare_finalize, moe_comm_method, token_dispatcher, ...) on
    CPU: vllm first (its imports probe for torch_npu), then torch_npu, ``torch.npu`` (Event/Stream type
    annotations) and ``vllm_ascend.utils`` stood in; ``vllm_ascend.ops/__init__`` (custom-op
    registration) is skipped."""
    for root in (ws / "vllm-ascend", ws / "vllm"):
        sys.path.insert(0, str(root))
    import vllm.model_executor.layers.fused_moe.layer  # noqa: F401
    import vllm.model_executor.layers.fused_moe.shared_fused_moe  # noqa: F401
    import vllm.model_executor.layers.linear  # noqa: F401

    _stub_module("torch_npu")
    _stub_module("vllm_ascend.utils", enable_sp=lambda *a, **k: False, vllm_version_is=lambda v: v == "0.13.0",
                 get_flashcomm2_config_and_validate=lambda a, v: 0)
    ops = types.ModuleType("vllm_ascend.ops")
    ops.__path__ = [str(ws / "vllm-ascend" / "vllm_ascend" / "ops")]
    sys.modules["vllm_ascend.ops"] = ops
    torch.npu = types.SimpleNamespace(Event=type("Event", (), {}), Stream=type("Stream", (), {}))
    import vllm_ascend.ops.fused_moe.fused_moe as fm

    return fm


class _ToyExpertMethod:
    """Stand-in for the layer's quant_method (NPU grouped matmuls): ``apply`` routes the rows it gets
    (top-k of softmax), dispatches each (row, k) to the rank owning the expert with real
    ``all_to_all_single`` over the EP group, runs the experts there, combines back. Counts its calls."""

    def __init__(self, w: torch.Tensor, world: int, result_cls) -> None:
        self.w, self.world, self.result_cls = w, world, result_cls
        self.rows: list[int] = []

    def apply(self, layer, x, router_logits, top_k, **kwargs):
        import torch.distributed as dist

        call = len(self.rows)
        self.rows.append(x.shape[0])
        weights, ids = _route(router_logits, top_k)
        per_rank = EXPERTS // self.world
        owner = (ids // per_rank).flatten()
        order = torch.argsort(owner, stable=True)
        send = x.repeat_interleave(top_k, 0)[order]
        send_ids = ids.flatten()[order]
        send_counts = torch.bincount(owner, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        s, r = send_counts.tolist(), recv_counts.tolist()
        recv = x.new_empty((sum(r), x.shape[1]))
        dist.all_to_all_single(recv, send, r, s)
        recv_ids = send_ids.new_empty(sum(r))
        dist.all_to_all_single(recv_ids, send_ids, r, s)
        out = torch.empty_like(recv)
        for e in recv_ids.unique().tolist():
            m = recv_ids == e
            out[m] = torch.tanh(recv[m] @ self.w[e])
        back = torch.empty_like(send)
        dist.all_to_all_single(back, out, s, r)
        unperm = torch.empty_like(back)
        unperm[order] = back
        routed = (unperm.view(x.shape[0], top_k, -1) * weights[..., None]).sum(1)
        return self.result_cls(routed_out=routed, before_dispatch_evt=("dispatch", call),
                               before_combine_evt=("combine", call))


def _worker(rank: int, world: int, port: int, ws: Path) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    fm = _import_patched_fused_moe(ws)
    import vllm.distributed
    import vllm.forward_context
    from vllm_ascend.ascend_forward_context import MoECommType

    from qwen3_rl.vllm_plugin import register

    register()  # what the entry point does (VLLM_PLUGINS names no plugin in this worker)
    from vllm_ascend.ops.fused_moe.moe_comm_method import AlltoAllCommImpl, FusedExpertsResult
    from vllm_ascend.ops.fused_moe.prepare_finalize import PrepareAndFinalizeWithAll2All, QuantType

    w = _toy_weights(EXPERTS, HIDDEN)
    ctx = types.SimpleNamespace()
    tp = types.SimpleNamespace(world_size=1)
    fm.get_forward_context = lambda: ctx  # the names the patched module calls
    fm.get_tp_group = lambda: tp
    vllm.forward_context.get_forward_context = lambda: ctx  # and those the hook calls
    vllm.distributed.get_tp_group = lambda: tp

    def layer_with(chunk: int, tp_size: int):
        experts = _ToyExpertMethod(w, world, FusedExpertsResult)
        layer = fm.AscendFusedMoE.__new__(fm.AscendFusedMoE)
        torch.nn.Module.__init__(layer)
        for name, value in dict(
                quant_method=experts, multistream_overlap_gate=False, enable_shared_expert_dp=False,
                quant_type=QuantType.NONE, top_k=TOPK, renormalize=True, use_grouped_topk=False,
                global_num_experts=EXPERTS, _expert_map=None, topk_group=None, num_expert_group=None,
                custom_routing_function=None, scoring_func="softmax", routed_scaling_factor=1.0,
                e_score_correction_bias=None, activation="silu", apply_router_weight_on_input=False,
                log2phy=None, global_redundant_expert_num=0, dynamic_eplb=False, reduce_results=True).items():
            setattr(layer, name, value)
        # as AscendFusedMoE.__init__ (seam): the plugin's hook when the chunk size is > 0, else None
        layer.forward_impl_hook = fm.build_from_factory(
            "ascend_moe_forward_impl", layer,
            types.SimpleNamespace(additional_config={"moe_prefill_chunk_size": chunk} if chunk else {}))
        assert (layer.forward_impl_hook is None) == (chunk == 0)
        pf = PrepareAndFinalizeWithAll2All.__new__(PrepareAndFinalizeWithAll2All)
        pf.moe_config = types.SimpleNamespace(tp_group=types.SimpleNamespace(device_group=dist.group.WORLD))
        pf.multistream_overlap_gate = False
        pf.tp_size, pf.tp_rank = tp_size, (rank if tp_size > 1 else 0)
        comm = AlltoAllCommImpl.__new__(AlltoAllCommImpl)
        comm.prepare_finalize = pf
        return layer, experts, comm

    def run(name, rows, max_rows, chunk, tp_size=1, comm_type=MoECommType.ALLTOALL, with_event=False,
            seed=None):
        g = torch.Generator().manual_seed(seed if seed is not None else 100 + rank)
        x = torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64)
        logits = torch.randn(rows, EXPERTS, generator=g, dtype=torch.float64)
        layer, experts, comm = layer_with(chunk, tp_size)
        tp.world_size = tp_size
        ctx.__dict__.update(in_profile_run=False, moe_comm_type=comm_type, moe_comm_method=comm,
                            sp_enabled=False, max_tokens_across_dp=max_rows)
        res = layer.forward_impl(x, logits, return_with_event=with_event)
        out = res.routed_out if with_event else res
        rec = {"calls": len(experts.rows), "rows": experts.rows, "shape": list(out.shape),
               "err": float((out - _toy_moe(x, logits, w, TOPK)).abs().max()) if rows else 0.0}
        if with_event:
            rec.update(type=type(res).__name__, events=[res.before_dispatch_evt, res.before_combine_evt])
        results[name] = rec

    results: dict = {}
    mine = (37, 23)[rank]  # DP ranks with different rows (not padded): the plan uses the DP maximum 37
    run("dp_unchunked", mine, 37, 0)
    run("dp_chunked", mine, 37, 8)
    run("dp_events", mine, 37, 8, with_event=True)
    run("dp_empty_rank", (20, 0)[rank], 20, 8)
    run("tp2_chunked", 30, 30, 8, tp_size=2, seed=7)  # TP 2: same rows on both, split, real all_gather
    run("small_step", 6, 6, 8)
    run("mc2_step", mine, 37, 8, comm_type=MoECommType.MC2)
    dist.destroy_process_group()
    return results


def test_patched_forward_impl_chunks_on_two_ranks(patched_workspace: Path) -> None:
    """The real patched forward_impl on 2 gloo ranks (EP over both): chunked output equals the toy MoE
    and the unchunked run; every rank issues the same number of dispatch/combine rounds."""
    port = free_port()
    env = dict(os.environ, VLLM_PLUGINS="none", VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(rank), "2", str(port),
                               str(patched_workspace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=REPO) for rank in range(2)]
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    r0, r1 = outs
    for name in r0:
        assert r0[name]["calls"] == r1[name]["calls"], name  # equal collective rounds on both ranks
        assert r0[name]["err"] < 1e-12 and r1[name]["err"] < 1e-12, (name, r0[name], r1[name])
    # unchunked: one round; chunked: ceil(37 / 8) = 5 rounds on both ranks, balanced rows
    assert (r0["dp_unchunked"]["rows"], r1["dp_unchunked"]["rows"]) == ([37], [23])
    assert r0["dp_chunked"]["rows"] == [7, 7, 8, 7, 8] and r1["dp_chunked"]["rows"] == [4, 5, 4, 5, 5]
    assert r0["dp_chunked"]["shape"] == [37, HIDDEN] and r1["dp_chunked"]["shape"] == [23, HIDDEN]
    # events: FusedMoEResult with the first chunk's dispatch event and the last chunk's combine event
    assert r0["dp_events"]["type"] == "FusedMoEResult"
    assert r0["dp_events"]["events"] == [["dispatch", 0], ["combine", 4]]
    # a rank with no rows runs the same 3 rounds; upstream's prepare pads each empty chunk to 1 row
    assert r0["dp_empty_rank"]["rows"] == [6, 7, 7] and r1["dp_empty_rank"]["rows"] == [1, 1, 1]
    assert r1["dp_empty_rank"]["shape"] == [0, HIDDEN]
    # TP 2: 15 units of 2 rows in 4 chunks (6, 8, 8, 8 rows) -> each TP rank routes half; finalize all-gathers
    assert r0["tp2_chunked"]["rows"] == r1["tp2_chunked"]["rows"] == [3, 4, 4, 4] and r0["tp2_chunked"]["shape"] == [30, HIDDEN]
    # not chunked: at most the chunk size, or not the all-to-all comm type (decode's MC2)
    assert r0["small_step"]["calls"] == 1 and r0["mc2_step"]["rows"] == [37]


def test_patched_forward_keeps_upstream_body(patched_workspace: Path, pristine_workspace: Path) -> None:
    """The renamed ``_forward_impl_body`` is the pinned ``forward_impl`` body statement for statement,
    and AscendSharedFusedMoE still enters through the (patched) ``AscendFusedMoE.forward_impl``."""
    import ast

    def method(path: Path, cls: str, name: str) -> ast.FunctionDef:
        tree = ast.parse(path.read_text())
        klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)

    rel = Path("vllm-ascend/vllm_ascend/ops/fused_moe/fused_moe.py")
    pristine = method(pristine_workspace / rel, "AscendFusedMoE", "forward_impl")
    body = method(patched_workspace / rel, "AscendFusedMoE", "_forward_impl_body")
    assert "qwen3_rl" not in (patched_workspace / rel).read_text()
    assert [ast.dump(s) for s in body.body] == [ast.dump(s) for s in pristine.body]
    assert ast.dump(body.args) == ast.dump(pristine.args)
    shared = ast.unparse(method(patched_workspace / rel, "AscendSharedFusedMoE", "forward_impl"))
    assert "AscendFusedMoE.forward_impl(" in shared


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    print(json.dumps(_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))))
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without interpreter teardown: gloo's threads can still be winding down after
    # destroy_process_group, and a C++ thread destroyed at exit aborts the process ("terminate called
    # without an active exception", seen once in CI after all results were printed)
    os._exit(0)
