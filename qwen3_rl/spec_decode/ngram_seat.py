"""SAM in the seat of vLLM 0.23's model-free n-gram drafter: the part shared by the vLLM-CPU seat
(``custom_class_worker.SamNgramSeat`` over vLLM's ``NgramProposer``) and the vLLM-Ascend one
(``ascend023_worker.SamAscendNgramSeat`` over ``AscendNgramProposer``).

Both runners call their n-gram drafter after the step's bookkeeping as
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=)`` (vLLM 0.23
``gpu_model_runner.py:4820-4832``; vLLM-Ascend 0.23 ``model_runner_v1.py:1681-1683``); the seat answers with the seed
set's :class:`~qwen3_rl.spec_decode.vllm_proposer.SamVllmProposer` over the runner's persistent batch. Options, the
batch-size threshold included, come from ``additional_config["qwen3_rl"]["sam_config"]``
(:func:`~qwen3_rl.spec_decode.custom_class_proposer.config_from_vllm_config`,
:func:`~qwen3_rl.spec_decode.custom_class_proposer.gate_from_vllm_config`). No vLLM import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qwen3_rl.spec_decode.custom_class_proposer import config_from_vllm_config, gate_from_vllm_config
from qwen3_rl.spec_decode.vllm_proposer import SamVllmProposer


class NgramSeatMixin(SamVllmProposer):
    """SAM drafter of one vLLM 0.23 model runner, in the n-gram drafter's seat; put it first in the bases, before the
    platform's n-gram proposer class, whose ``__init__`` is not run (it would compile n-gram kernels never called).

    Args:
        vllm_config: engine config; k = ``speculative_config.num_speculative_tokens``, options (and
            ``disable_by_batch_size``) in ``additional_config["qwen3_rl"]["sam_config"]``.
        runner: the model runner; its ``input_batch`` and ``requests`` are read, never written.
    """

    def __init__(self, vllm_config: Any, runner: Any) -> None:
        SamVllmProposer.__init__(
            self,
            vllm_config,
            runner,
            config=config_from_vllm_config(vllm_config),
            gate=gate_from_vllm_config(vllm_config),
        )

    def propose(  # type: ignore[override]
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: Any = None,
        token_ids_cpu: Any = None,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """The n-gram call: drafts per batch row (all empty while the batch-size gate has drafting off).

        Args:
            sampled_token_ids: per batch row, the tokens accepted this step (empty: no draft for the row).
            num_tokens_no_spec, token_ids_cpu, slot_mappings: unused (read from the runner's ``input_batch``).
        Returns:
            one list of <= k token ids per batch row.
        """
        return SamVllmProposer.propose(self, None, sampled_token_ids)
