"""vLLM 0.23 workers (``worker_cls``, upstream's extension point) that hand their model runner to our SAM drafter, so
that SAM sees request ids, prompt lengths and the live requests: group mode, its finished-response cache and history
then work as through the seed set's seam. Two drafter seats, both without a patch:

    LLM(..., worker_cls="qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker",
        speculative_config={"method": "custom_class", "model": ".../SamCustomClassProposer", ...},
        additional_config={"qwen3_rl": {"sam_config": {"group_mode": True}}})
    LLM(..., worker_cls="qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        additional_config={"qwen3_rl": {"sam_config": {"group_mode": True}}})

``custom_class``: the worker runs vLLM's own ``init_device`` (which builds the runner, and the runner the proposer),
then calls ``drafter.bind_runner(model_runner)``. ``ngram``: the worker replaces the runner's ``NgramProposer``
(``gpu_model_runner.py:562-565``) with :class:`SamNgramSeat`, which the runner calls as it calls n-gram
(``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=)`` after bookkeeping,
``gpu_model_runner.py:4820-4832``, under ``isinstance(drafter, NgramProposer)``). The n-gram seat is the one
vLLM-Ascend 0.23's worker uses (``ascend023_worker.SamNPUWorker``), so the train scripts' engine settings are the same
on the CPU profile and on NPUs; ``rollout_worker.SamWorker`` picks this class or that one in the worker's process.
Only the CPU worker is provided and run here; the same mixins on ``vllm.v1.worker.gpu_worker.Worker`` are the GPU one
(not run: no GPU).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.worker.cpu_worker import CPUWorker

from qwen3_rl.rollout.gc_worker import GcStepWorkerMixin
from qwen3_rl.spec_decode.custom_class_proposer import sam_requested
from qwen3_rl.spec_decode.ngram_seat import NgramSeatMixin

#: the speculative method whose drafter seat SAM takes (model-free, drafted on the host after bookkeeping)
SEAT_METHOD = "ngram"
#: the method whose proposer the worker binds to its runner instead
CUSTOM_CLASS_METHOD = "custom_class"


class SamNgramSeat(NgramSeatMixin, NgramProposer):
    """SAM drafter of one vLLM 0.23 ``GPUModelRunner`` (vLLM-CPU's ``CPUModelRunner``), in the n-gram drafter's seat
    (``ngram_seat.NgramSeatMixin``; ``NgramProposer.__init__`` is not run)."""


class BindsDrafterMixin:
    """After ``init_device``: with ``sam_config`` and method ``ngram``, seat :class:`SamNgramSeat` in the runner;
    otherwise give the runner's drafter its runner if it asks for one (``bind_runner``: the ``custom_class``
    proposer). ``sam_config`` with another method stops with one line."""

    model_runner: Any
    vllm_config: Any

    def init_device(self) -> None:
        super().init_device()  # type: ignore[misc]
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        method = getattr(self.vllm_config.speculative_config, "method", None)
        if sam_requested(self.vllm_config) and method not in (SEAT_METHOD, CUSTOM_CLASS_METHOD):
            raise ValueError(
                f"additional_config.qwen3_rl.sam_config drafts in the seat of speculative_config.method="
                f"{SEAT_METHOD!r} (or {CUSTOM_CLASS_METHOD!r} with SamCustomClassProposer); got {method!r}"
            )
        if sam_requested(self.vllm_config) and method == SEAT_METHOD:
            if type(drafter) is not NgramProposer:
                # a pipeline stage that is not the last: no drafter to replace
                raise ValueError(f"no n-gram drafter in {type(runner).__name__} to replace with SAM")
            runner.drafter = SamNgramSeat(self.vllm_config, runner)
            return
        bind = getattr(drafter, "bind_runner", None)
        if callable(bind):
            bind(runner)


class SamCPUWorker(BindsDrafterMixin, GcStepWorkerMixin, CPUWorker):
    """vLLM-CPU's ``CPUWorker`` that seats or binds the SAM drafter; it also carries the gc guard of
    ``qwen3_rl.rollout.gc_worker`` (``additional_config.qwen3_rl.disable_gc``; inert while that is off), since one
    engine takes one ``worker_cls``."""
