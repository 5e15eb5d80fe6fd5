"""The "sam" drafter on vLLM-Ascend 0.13: :class:`SamVllmProposer` behind vLLM-Ascend's ``Proposer`` interface.

Built once per engine by ``GPUModelRunner.__init__`` from vLLM's drafter registry (the plugin's
``build_sam_drafter`` picks this class when the runner is vLLM-Ascend's ``NPUModelRunner``); the vLLM-Ascend
seam patch keeps that drafter in ``NPUModelRunner._set_up_drafter`` (no second build and warm-up) and calls
:meth:`SamVllmProposer.propose` after ``_bookkeeping_sync``, like its n-gram adapter. Drafting, the batch-size
gate and the automata are :class:`SamVllmProposer`'s; this class only adds the ``Proposer`` base (vLLM-Ascend's
runner calls ``load_model`` / ``dummy_run`` on it) and ``generate_token_ids``.

Importing this module needs vLLM-Ascend (it subclasses its ``Proposer``); only the plugin's factory imports it,
on an Ascend runner.
"""

from __future__ import annotations

from typing import Any

from vllm_ascend.spec_decode.interface import Proposer

from qwen3_rl.spec_decode.vllm_proposer import SamVllmProposer


class SamAscendProposer(SamVllmProposer, Proposer):
    """SAM drafter of one ``NPUModelRunner``.

    Args:
        vllm_config: engine config; ``speculative_config.method`` must be "sam" (validated again).
        runner: the ``NPUModelRunner``; its ``input_batch`` and ``requests`` are read, never written.
    """

    def __init__(self, vllm_config: Any, runner: Any) -> None:
        Proposer.__init__(self, vllm_config, getattr(runner, "device", None), runner)
        SamVllmProposer.__init__(self, vllm_config, runner)

    def generate_token_ids(self, valid_sampled_token_ids: list[list[int]], sampling_metadata: Any = None,
                           scheduler_output: Any = None, *args: Any, **kwargs: Any) -> list[list[int]]:
        """vLLM-Ascend's drafter call: :meth:`propose` (drafts per batch row, lists of <= k token ids)."""
        return self.propose(scheduler_output, valid_sampled_token_ids)
