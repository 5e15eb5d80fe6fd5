"""vLLM-Ascend 0.13 ``Proposer`` for ``speculative_config={"method": "sam", ...}``.

Returned by ``vllm_ascend.spec_decode.get_spec_decode_method("sam", ...)`` (vllm_ascend patch 0003);
modelled on vLLM-Ascend's own n-gram adapter (``vllm_ascend/spec_decode/ngram_proposer.py``): no
model, no dummy run, drafts from the runner's CPU token buffers in ``generate_token_ids``, called
by ``NPUModelRunner.propose_draft_token_ids`` with ``valid_sampled_token_ids`` (per batch row the
tokens accepted this step, empty for partial prefills). The logic lives in ``SamRunnerDrafter``.

Importing this module needs vLLM-Ascend (it subclasses its ``Proposer``); only the patched
``get_spec_decode_method`` imports it.
"""

from __future__ import annotations

from typing import Any

from vllm_ascend.spec_decode.interface import Proposer

from qwen3_rl.spec_decode.config import config_from_vllm_config
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter


class SamAscendProposer(Proposer):
    """SAM drafter behind vLLM-Ascend's ``Proposer`` interface.

    Args:
        vllm_config: engine config; ``speculative_config.method`` must be "sam" (validated again).
        device: the runner's device (unused: drafting runs on the host).
        runner: the ``NPUModelRunner``; its ``input_batch`` and ``requests`` are read, never written.
        sam: a ``SamRunnerDrafter`` already built for this engine (``NPUModelRunner._set_up_drafter`` hands over
            the one ``GPUModelRunner.__init__`` built through vllm patch 0003); None builds one.
    """

    name = "sam"

    def __init__(self, vllm_config: Any, device: Any = None, runner: Any = None,
                 sam: SamRunnerDrafter | None = None) -> None:
        super().__init__(vllm_config, device, runner)
        config = config_from_vllm_config(vllm_config)
        self.vllm_config = vllm_config
        self.device = device
        self.runner = runner
        self.k = config.num_speculative_tokens
        # builds the drafter and compiles its kernels (the first decode step compiles nothing), unless the engine
        # already holds one (vLLM's constructor builds it first: one build and warm-up per engine)
        self.sam = sam if sam is not None else SamRunnerDrafter(config, vllm_config.model_config.max_model_len)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load."""

    def dummy_run(self, num_tokens: int, with_prefill: bool = False, in_graph_capturing: bool = False,
                  num_reqs: int = 0, num_tokens_across_dp: Any = None, aclgraph_runtime_mode: Any = None,
                  batch_descriptor: Any = None, dummy_compute_logits: Any = None, is_profile: bool = False
                  ) -> None:
        """Nothing runs on the device."""

    def observe(self, valid_sampled_token_ids: list[list[int]], scheduler_output: Any = None) -> None:
        """Feed this step's accepted tokens without drafting (batch-size threshold: drafting off)."""
        self.sam.observe(self.runner.input_batch, getattr(self.runner, "requests", None), scheduler_output)

    def generate_token_ids(self, valid_sampled_token_ids: list[list[int]], sampling_metadata: Any = None,
                           scheduler_output: Any = None, spec_decode_metadata: Any = None, positions: Any = None,
                           num_scheduled_tokens: Any = None, hidden_states: Any = None,
                           aux_hidden_states: Any = None) -> list[list[int]]:
        """Drafts per batch row (lists of <= k token ids) after feeding this step's accepted tokens."""
        return self.sam.step(self.runner.input_batch, valid_sampled_token_ids,
                             getattr(self.runner, "requests", None), scheduler_output)
