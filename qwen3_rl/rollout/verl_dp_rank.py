"""The vLLM DP rank per request on the current set (verl 0.9.1, server mode), chosen by the group router, without a
verl patch.

verl 0.9.1's server (``vLLMHttpServer.generate``, ``verl/workers/rollout/vllm_rollout/vllm_async_server.py:558-568``)
takes no DP rank and calls vLLM's ``AsyncLLM.generate`` without one (``:667-673``); vLLM 0.23 takes
``data_parallel_rank`` there (``vllm/v1/engine/async_llm.py:538``) and checks it against the engine's DP size
(``vllm/v1/engine/input_processor.py:259-267``). Two pieces carry the router's choice to it:

* :class:`RankedServerHandle`: what :class:`~qwen3_rl.rollout.verl_router.GroupRoutingBalancer` returns as the
  server's handle when the servers have more than one DP rank. verl's client calls only ``server.generate.remote``
  on it (``llm_server.py:150-159``); the handle adds ``data_parallel_rank=<rank>``.
* :class:`DpRankServerMixin`: a base of the recipe's server (``KeyedvLLMHttpServer``, registered by
  ``qwen3_rl.rollout.verl_server_auth.register``). Its ``generate`` takes ``data_parallel_rank``, keeps it in a
  context variable for that request's task and calls verl's ``generate``, whose call of ``self.engine.generate``
  goes through :class:`RankedEngine`, which adds the rank (none given: vLLM's own choice, as verl's server).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

__all__ = ["DpRankServerMixin", "RankedEngine", "RankedServerHandle"]

#: the DP rank of the request whose ``generate`` runs in this task (None: vLLM chooses)
_RANK: ContextVar[int | None] = ContextVar("qwen3_rl_dp_rank", default=None)


class _RankedMethod:
    """``handle.generate`` with ``data_parallel_rank`` added to every ``.remote(...)`` call."""

    def __init__(self, method: Any, rank: int) -> None:
        self._method, self._rank = method, rank

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.remote(*args, data_parallel_rank=self._rank, **kwargs)


class RankedServerHandle:
    """A server's Ray actor handle and the DP rank a request goes to inside it (picklable: it crosses the balancer
    actor's RPC).

    Args:
        handle: the server's actor handle (verl's ``vLLMHttpServer`` with :class:`DpRankServerMixin`).
        rank: vLLM DP rank in ``[0, rollout.data_parallel_size)``.
    """

    def __init__(self, handle: Any, rank: int) -> None:
        self.handle, self.rank = handle, rank

    @property
    def generate(self) -> _RankedMethod:
        return _RankedMethod(self.handle.generate, self.rank)


class RankedEngine:
    """vLLM's engine client (``AsyncLLM``) whose ``generate`` gets the current request's DP rank; every other
    attribute is the engine's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_engine"], name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        rank = _RANK.get()
        if rank is not None:
            kwargs["data_parallel_rank"] = rank
        return self._engine.generate(*args, **kwargs)


class DpRankServerMixin:
    """Put before verl's ``vLLMHttpServer`` in a server's bases: ``generate(..., data_parallel_rank=r)`` sends the
    request to vLLM DP rank ``r`` (None or absent: vLLM's own choice)."""

    engine: Any

    async def generate(self, *args: Any, data_parallel_rank: int | None = None, **kwargs: Any) -> Any:
        if data_parallel_rank is not None and not isinstance(self.engine, RankedEngine):
            self.engine = RankedEngine(self.engine)
        token = _RANK.set(data_parallel_rank)
        try:
            return await super().generate(*args, **kwargs)  # type: ignore[misc]
        finally:
            _RANK.reset(token)
