"""SAM on vLLM-Ascend 0.23.0.post1 without a patch: a worker class (``worker_cls``, vLLM's extension point) seats our
drafter in the place vLLM-Ascend's runner built for the model-free n-gram method.

    LLM(..., worker_cls="qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        additional_config={"qwen3_rl": {"sam_config": {"group_mode": True}}})   # {} = SAM per request

Why this works on the pristine tree (vLLM-Ascend 0.23.0.post1, file:line):

* ``NPUPlatform.check_and_update_config`` fills ``parallel_config.worker_cls`` only when it is "auto"
  (``vllm_ascend/platform.py:659-669``), so our class is the worker. That branch also sets
  ``all2all_backend = "flashinfer_all2allv"`` when sequence parallelism is off, which an explicit worker class skips
  (it matters for expert-parallel all-to-all only).
* ``NPUWorker.init_device`` builds ``NPUModelRunner`` (``worker/worker.py:505-520``), whose ``_set_up_drafter``
  builds the drafter of the method through ``get_spec_decode_method`` (``model_runner_v1.py:618-651``,
  ``spec_decode/__init__.py:34-55``: no custom class there) and the rejection sampler. The drafter is read from
  ``self.drafter`` at each use, so replacing it after ``init_device`` and before ``load_model`` is enough:
  ``load_model`` (``model_runner_v1.py:3744-3749``), ``_dummy_run`` -> ``dummy_run`` (``:3643-3644``), and
  ``propose_draft_token_ids``, which calls ``drafter.propose(valid_sampled_token_ids)`` for an
  ``AscendNgramProposer`` instance (``:1681-1683``), after ``_bookkeeping_sync`` appended this step's accepted tokens
  to ``input_batch.token_ids_cpu`` / ``num_tokens_no_spec`` (``:2646-2760``, the host path, ``:2505-2521``).
  The method stays "ngram" in every other check (scheduler, padded-batch choice, attention state), which is what a
  host drafter needs.

:class:`SamAscendNgramSeat` is therefore an ``AscendNgramProposer`` subclass whose ``propose`` is the seed set's
:class:`~qwen3_rl.spec_decode.vllm_proposer.SamVllmProposer` (``SamRunnerDrafter`` over the runner's persistent batch,
batch-size gate): request ids, prompt lengths and live requests come from the runner, so group mode, its
finished-response cache and history work as on the seed set. SAM options come from
``additional_config["qwen3_rl"]["sam_config"]`` as with vLLM 0.23's ``custom_class``
(:func:`~qwen3_rl.spec_decode.custom_class_proposer.config_from_vllm_config`), the batch-size threshold too
(``sam_config.disable_by_batch_size``); without a ``sam_config`` key the
worker leaves vLLM-Ascend's n-gram drafter alone.

Importing this module needs vLLM-Ascend 0.23 (it subclasses its worker and n-gram proposer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_ascend.spec_decode.ngram_proposer import AscendNgramProposer
from vllm_ascend.worker.worker import NPUWorker

from qwen3_rl.moe import chunking_ascend023
from qwen3_rl.rollout.gc_worker import GcStepWorkerMixin
from qwen3_rl.spec_decode.custom_class_proposer import ADDITIONAL_CONFIG_KEY, sam_requested
from qwen3_rl.spec_decode.ngram_seat import NgramSeatMixin

#: the speculative method whose drafter seat SAM takes (model-free, drafted on the host after bookkeeping)
SEAT_METHOD = "ngram"


class SamAscendNgramSeat(NgramSeatMixin, AscendNgramProposer):
    """SAM drafter of one vLLM-Ascend 0.23 ``NPUModelRunner``, in the n-gram drafter's seat
    (``ngram_seat.NgramSeatMixin``: ``propose`` answers ``model_runner_v1.py:1683``; ``AscendNgramProposer.__init__``
    is not run). The runner reads nothing of the drafter but the mixin's methods."""


class SamNPUWorker(GcStepWorkerMixin, NPUWorker):
    """vLLM-Ascend's ``NPUWorker`` that seats :class:`SamAscendNgramSeat` in its runner when ``sam_config`` is given;
    it also carries the gc guard of ``qwen3_rl.rollout.gc_worker`` and chunked MoE prefill
    (``additional_config.moe_prefill_chunk_size``) (one engine takes one ``worker_cls``)."""

    def init_device(self) -> None:
        super().init_device()
        if sam_requested(self.vllm_config):
            self._seat_sam()

    def load_model(self) -> None:
        """Upstream's load, then chunked MoE prefill on the loaded model when ``additional_config`` asks for it
        (:func:`qwen3_rl.moe.chunking_ascend023.install`; before the profile run, which then measures it)."""
        super().load_model()
        chunking_ascend023.install(self.model_runner.get_model(), self.vllm_config)

    def _seat_sam(self) -> None:
        spec = self.vllm_config.speculative_config
        method = getattr(spec, "method", None)
        if method != SEAT_METHOD:
            raise ValueError(
                f"additional_config.qwen3_rl.sam_config on vLLM-Ascend 0.23 drafts in the seat of "
                f"speculative_config.method={SEAT_METHOD!r} (model-free, host-side); got {method!r}"
            )
        runner = self.model_runner
        if not isinstance(getattr(runner, "drafter", None), AscendNgramProposer):
            # the model runner v2, or a pipeline stage that is not the last: no n-gram seat to take
            raise ValueError(f"no n-gram drafter in {type(runner).__name__} to replace with SAM")
        runner.drafter = SamAscendNgramSeat(self.vllm_config, runner)

    def sam_reconfigure(self, sam_config: Mapping[str, Any]) -> str:
        """Replace the SAM drafter with a fresh one built from ``sam_config`` (e.g. between rollouts; held automata
        and caches are dropped). Call between ``generate`` calls: ``llm.collective_rpc("sam_reconfigure",
        args=(cfg,))``. Returns the drafter's class name."""
        extra = dict(self.vllm_config.additional_config or {})
        extra[ADDITIONAL_CONFIG_KEY] = {
            **dict(extra.get(ADDITIONAL_CONFIG_KEY) or {}),
            "sam_config": dict(sam_config),
        }
        self.vllm_config.additional_config = extra
        self._seat_sam()
        return type(self.model_runner.drafter).__name__
