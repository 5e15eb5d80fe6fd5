"""vLLM 0.13 drafter for ``speculative_config={"method": "sam", ...}`` (the "sam" entry of vLLM's drafter
registry, ``vllm.plugins.extensions``, registered by :mod:`qwen3_rl.vllm_plugin`).

vLLM's ``GPUModelRunner.__init__`` builds the registered drafter of ``speculative_config.method``; that
constructor runs in every engine that builds a runner: vLLM's GPU runner, vLLM-CPU's ``CPUModelRunner`` and
vLLM-Ascend's ``NPUModelRunner`` (which keeps it: one build per engine; there the class is the ``Proposer``
subclass ``ascend_adapter.SamAscendProposer``). ``propose_draft_token_ids`` calls :meth:`SamVllmProposer.propose`.

Like vLLM's ``NgramProposer`` it drafts on the host from the runner's persistent batch
(``input_batch.token_ids_cpu`` up to ``num_tokens_no_spec``), after ``_bookkeeping_sync`` has
appended this step's accepted tokens. The logic is ``SamRunnerDrafter``'s; the batch-size threshold
(``speculative_config.disable_by_batch_size``) is applied here by a ``BatchSizeGate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qwen3_rl.spec_decode.bs_threshold import BatchSizeGate, propose_or_skip
from qwen3_rl.spec_decode.config import config_from_vllm_config
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
from qwen3_rl.spec_decode.sam import SamConfig


class SamVllmProposer:
    """SAM drafter behind vLLM's model-free drafter shape (``NgramProposer``-like).

    Args:
        vllm_config: engine config; ``speculative_config.method`` must be "sam" (validated again).
        runner: the model runner that owns this drafter; its ``input_batch`` and ``requests`` are
            read at each step, never written.
        config: the drafter's config when it comes from elsewhere (vLLM-Ascend 0.23's worker:
            ``additional_config``); None = from ``speculative_config`` (method "sam").
        gate: the batch-size gate when it comes from elsewhere (vLLM 0.23's seats: ``sam_config``); None = from
            ``speculative_config.disable_by_batch_size``.
    """

    name = "sam"

    def __init__(
        self,
        vllm_config: Any,
        runner: Any,
        config: SamConfig | None = None,
        gate: BatchSizeGate | None = None,
    ) -> None:
        if config is None:
            config = config_from_vllm_config(vllm_config)
        self.vllm_config = vllm_config
        self.runner = runner
        self.k = config.num_speculative_tokens
        self.gate = gate if gate is not None else BatchSizeGate.from_vllm_config(vllm_config)
        # builds the drafter and compiles its kernels, as vLLM's NgramProposer does in its constructor
        self.sam = SamRunnerDrafter(config, vllm_config.model_config.max_model_len)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load (vLLM's GPU runner calls this after loading the target model)."""

    def dummy_run(self, *args: Any, **kwargs: Any) -> None:
        """Nothing runs on the device (vLLM-Ascend's ``NPUModelRunner._dummy_run`` calls this)."""

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
