"""Engine-loop hook of the SAM sibling exchange (engine-step hook ``sam_sibling_exchange``, order 20, of the vLLM
seam; :mod:`qwen3_rl.vllm_plugin` builds it for an ``LLMEngine`` whose ``sam_config.group_exchange`` is on).

verl's sync SPMD rollout drives vLLM's in-process engine through ``LLM._run_engine``: every loop iteration
all-reduces "unfinished requests" over the vLLM DP group (``LLMEngine.has_unfinished_requests_dp``) and
then calls ``LLMEngine.step`` exactly once on every DP rank (a real step, or a dummy batch on a rank with
nothing to run). ``SiblingExchangeHook.after_step`` runs at the end of both kinds of step, so every DP
rank calls the exchange's collectives the same number of times, in the same order as vLLM's own
collectives on that group. Every ``sam_config.exchange_every`` steps it all-gathers each rank's message
(``SiblingExchange.pack``) over vLLM's gloo CPU group of the DP group (``get_dp_group().cpu_group``,
created once by vLLM; never device memory) and merges the other ranks' tokens into the drafter's shadow
strings. Tokens accepted in step t therefore reach the siblings' drafts proposed in step t + 1
(``--exchange-delay-steps 1`` in ``python -m qwen3_rl.tools.bench.drafters``).

Not built unless ``speculative_config.method == "sam"`` with ``sam_config.group_exchange=True`` (inert, one
attribute check per step, when built without it).
"""

from __future__ import annotations

from typing import Any

from qwen3_rl.compat.step_hook import EngineStepHookDefaults
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
from qwen3_rl.spec_decode.sibling_exchange import GlooAllGather


def exchange_enabled(vllm_config: Any) -> bool:
    """``speculative_config`` is SAM with ``sam_config.group_exchange`` on."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "sam":
        return False
    sc = getattr(spec, "drafter_config", None) or {}
    return bool(sc.get("group_exchange", False)) if isinstance(sc, dict) else bool(getattr(sc, "group_exchange",
                                                                                            False))


def find_sam_drafter(llm_engine: Any) -> SamRunnerDrafter | None:
    """The ``SamRunnerDrafter`` of the in-process engine's model runner (None if there is none)."""
    core = getattr(getattr(llm_engine, "engine_core", None), "engine_core", None)
    executor = getattr(core, "model_executor", None)
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    sam = getattr(getattr(runner, "drafter", None), "sam", None)
    return sam if isinstance(sam, SamRunnerDrafter) else None


def _dp_cpu_group() -> Any:
    from vllm.distributed.parallel_state import get_dp_group

    return get_dp_group().cpu_group


class SiblingExchangeHook(EngineStepHookDefaults):
    """Runs the sibling exchange after every engine step (see the module docstring).

    Args:
        llm_engine: the ``LLMEngine`` (vLLM v1, in-process engine core).
        group_factory: returns the CPU process group of this rank's DP group (tests pass their own).
    """

    def __init__(self, llm_engine: Any, group_factory: Any = None) -> None:
        self.llm_engine = llm_engine
        self.group_factory = group_factory or _dp_cpu_group
        self.steps = 0
        self.exchanges = 0
        self._sam: SamRunnerDrafter | None = None
        self._comm: GlooAllGather | None = None
        self._resolved = False

    def _resolve(self) -> None:
        self._resolved = True
        if not exchange_enabled(getattr(self.llm_engine, "vllm_config", None)):
            return
        sam = find_sam_drafter(self.llm_engine)
        if sam is None or sam.exchange is None:
            raise RuntimeError("sam_config.group_exchange=True needs vLLM's in-process engine with the SAM drafter "
                               "in this process (verl's sync SPMD rollout: LLM with the external launcher); no "
                               "SamRunnerDrafter was found under llm_engine.engine_core.engine_core")
        self._comm = GlooAllGather(self.group_factory())
        sam.exchange.rank = self._comm.rank
        self._sam = sam

    @property
    def enabled(self) -> bool:
        if not self._resolved:
            self._resolve()
        return self._sam is not None

    # -- engine-step hook interface (vllm.plugins.extensions.EngineStepHook; only after_step acts) --------------
    def after_step(self, request_outputs: list[Any] | None = None) -> list[Any]:
        """Called by ``LLMEngine.step`` after real and dummy steps on every DP rank; returns ``request_outputs``
        unchanged (``[]`` for None)."""
        outs = request_outputs if request_outputs is not None else []
        if not self._resolved:
            self._resolve()
        sam = self._sam
        if sam is None:
            return outs
        self.steps += 1
        if self.steps % sam.config.exchange_every:
            return outs
        assert self._comm is not None
        sam.exchange_round(self._comm)
        self.exchanges += 1
        return outs
