"""vLLM 0.13 drafter for ``speculative_config={"method": "sam", ...}`` (built by vllm patch 0003).

vLLM's ``GPUModelRunner.__init__`` picks the drafter from ``speculative_config.method``
(``vllm/v1/worker/gpu_model_runner.py:383-405``) and raises for a method it does not know. That
constructor runs in every engine that builds a runner: vLLM's GPU runner, vLLM-CPU's
``CPUModelRunner`` and vLLM-Ascend's ``NPUModelRunner`` (``vllm_ascend/worker/model_runner_v1.py:205``,
which then replaces the drafter with its own adapter, ``ascend_adapter.SamAscendProposer``). vllm
patch 0003 adds a ``"sam"`` branch there that builds this class, and routes ``"sam"`` in
``GPUModelRunner.propose_draft_token_ids`` to :meth:`SamVllmProposer.propose`.

Like vLLM's ``NgramProposer`` it drafts on the host from the runner's persistent batch
(``input_batch.token_ids_cpu`` up to ``num_tokens_no_spec``), after ``_bookkeeping_sync`` has
appended this step's accepted tokens. The logic is ``SamRunnerDrafter``'s, shared with the Ascend
adapter; the batch-size threshold (``speculative_config.disable_by_batch_size``) is the same
``BatchSizeGate`` vllm_ascend patch 0002 puts into the NPU runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qwen3_rl.spec_decode.bs_threshold import BatchSizeGate, propose_or_skip
from qwen3_rl.spec_decode.config import config_from_vllm_config
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter


class SamVllmProposer:
    """SAM drafter behind vLLM's model-free drafter shape (``NgramProposer``-like).

    Args:
        vllm_config: engine config; ``speculative_config.method`` must be "sam" (validated again).
        runner: the model runner that owns this drafter; its ``input_batch`` and ``requests`` are
            read at each step, never written.
    """

    name = "sam"

    def __init__(self, vllm_config: Any, runner: Any) -> None:
        config = config_from_vllm_config(vllm_config)
        self.vllm_config = vllm_config
        self.runner = runner
        self.k = config.num_speculative_tokens
        self.gate = BatchSizeGate.from_vllm_config(vllm_config)
        # builds the drafter and compiles its kernels, as vLLM's NgramProposer does in its constructor
        self.sam = SamRunnerDrafter(config, vllm_config.model_config.max_model_len)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load (vLLM's GPU runner calls this after loading the target model)."""

    def propose(self, scheduler_output: Any, valid_sampled_token_ids: Sequence[Sequence[int]]
                ) -> list[list[int]]:
        """Drafts per batch row (lists of <= k token ids) for this step.

        Args:
            scheduler_output: this step's ``SchedulerOutput`` (finished / new requests).
            valid_sampled_token_ids: per batch row, the tokens accepted this step (empty for rows
                that sampled nothing, e.g. partial prefills).
        Returns:
            one list per batch row; all empty while the batch-size threshold has drafting off
            (the automata are still fed, so nothing is lost when drafting resumes).
        """
        runner = self.runner
        batch = runner.input_batch
        live = getattr(runner, "requests", None)
        return propose_or_skip(
            self.gate, self, batch.num_reqs, list(valid_sampled_token_ids), scheduler_output,
            lambda: self.sam.step(batch, valid_sampled_token_ids, live, scheduler_output))

    def observe(self, valid_sampled_token_ids: Sequence[Sequence[int]], scheduler_output: Any = None) -> None:
        """Feed this step's accepted tokens without drafting (called by the gate while drafting is off)."""
        self.sam.observe(self.runner.input_batch, getattr(self.runner, "requests", None), scheduler_output)
