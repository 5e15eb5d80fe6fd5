"""FIA ``TND`` input alignment on CANN 8.5.0: what vLLM-Ascend 0.13.0 covers, and a config check.

Constraint: from CANN 8.5.0, ``npu_fused_infer_attention_score`` with ``input_layout="TND"``
rejects a call whose query row count T differs from the last element of ``actual_seq_lengths``
(cumulative query lengths): "When layout is TND, queryT(8) must be equal to the last element of
actualSequenceLengthQ(7)" (tiling check ``CheckFAISeqlenDataInTND``).

What the pinned vLLM-Ascend 0.13.0 already does (so no patch is shipped for
``bugfix-align_FIA_input_for_TND_layout``):

* eager FIA (``vllm_ascend/attention/attention_v1.py:590-591``): the query is cut to
  ``actual_seq_lengths_q[-1]`` rows before the call, so T always equals the last length;
* full-graph uniform decode (``vllm_ascend/worker/model_runner_v1.py:996-1017``): when a uniform
  decode batch is padded to a captured size, ``query_start_loc`` is extended with dummy requests of
  ``uniform_decode_query_len`` tokens each, so the last length equals the padded token count; vLLM
  0.13.0 rounds the captured sizes to multiples of that query length for FULL_DECODE_ONLY and
  FULL_AND_PIECEWISE (``vllm/v1/worker/gpu_model_runner.py:4901-4913``);
* draft-model graphs (``vllm_ascend/compilation/acl_graph.py:263-292``): lengths are interpolated up
  to the runtime shape before the update.

What it does not cover: ``cudagraph_mode=FULL`` (mixed prefill/decode batches captured as full
graphs; for those the pin pads T but leaves the last length at the real token count, and FULL
is not a "separate routine" mode so spec-decode sizes are not rounded either). Upstream fixed that
after the pin (vllm-ascend commit 2ee4f23f28, PR #6475, "Pads query_start_loc to satisfy FIA/TND
constraint"). The recipe therefore rolls out with FULL_DECODE_ONLY (or PIECEWISE / eager) and
refuses FULL: :func:`check_cudagraph_mode_for_tnd` is the check launchers and config code call.
"""

from __future__ import annotations

__all__ = ["TND_SAFE_CUDAGRAPH_MODES", "check_cudagraph_mode_for_tnd"]

#: vLLM ``CompilationConfig.cudagraph_mode`` names that keep FIA's TND inputs aligned in the pin.
#: FULL_AND_PIECEWISE is turned into PIECEWISE by vLLM-Ascend 0.13.0 (platform.py:236-237).
TND_SAFE_CUDAGRAPH_MODES = frozenset({"NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"})


def check_cudagraph_mode_for_tnd(cudagraph_mode: str | None) -> str | None:
    """Validate a rollout ``cudagraph_mode`` against the pin's FIA/TND coverage.

    Args:
        cudagraph_mode: the name given to vLLM (``compilation_config.cudagraph_mode``), any case,
            or ``None`` (vLLM's default, which vLLM-Ascend runs as PIECEWISE).

    Returns:
        The upper-cased mode (``None`` unchanged).

    Raises:
        ValueError: ``FULL`` (misaligned FIA inputs on CANN >= 8.5.0 with vLLM-Ascend 0.13.0) or a
            name vLLM does not know.
    """
    if cudagraph_mode is None:
        return None
    mode = str(cudagraph_mode).strip().upper()
    if mode == "FULL":
        raise ValueError(
            "cudagraph_mode=FULL replays mixed prefill/decode batches whose FIA TND inputs are not "
            "padded in vLLM-Ascend 0.13.0 (CANN 8.5.0 rejects queryT != last actual_seq_lengths); "
            "use FULL_DECODE_ONLY")
    if mode not in TND_SAFE_CUDAGRAPH_MODES:
        raise ValueError(f"unknown cudagraph_mode {cudagraph_mode!r}; expected one of "
                         f"{sorted(TND_SAFE_CUDAGRAPH_MODES | {'FULL'})}")
    return mode
