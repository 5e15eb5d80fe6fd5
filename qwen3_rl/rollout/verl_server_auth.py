"""``SERVER_API_KEY`` and ``SERVER_HTTP_HOST`` on the current set: verl 0.9.1's own vLLM server keyed on every route
and bound where asked, through verl's replica registry, without a verl patch.

verl 0.9.1's ``vLLMHttpServer`` (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``) serves vLLM 0.23's
OpenAI app with uvicorn on the node's address (``:179`` ``ray.util.get_node_ip_address()``, ``:533``
``run_uvicorn(app, args, self._server_address)``; ``verl/workers/rollout/utils.py:67-69`` ignores ``--host``) and
no key: every route, ``/pause``, ``/v1/completions``, ``/invocations``, ... answers anyone who reaches the node.
verl's own rollout calls the server actors through Ray (``llm_server.py:485``, ``router.py``), not HTTP.

How each part reaches verl's server (extension points only):

* the settings: the seam's ``qwen3_rl`` group (``server_auth.enable``, ``server_http.host``, validated by
  :class:`qwen3_rl.trainer.seam.RecipeConfig`) in ``rollout.custom`` (``RolloutConfig.custom``,
  ``verl/workers/config/rollout.py:233-234``), i.e. ``actor_rollout_ref.rollout.custom.qwen3_rl``;
* the class: :class:`KeyedvLLMReplica` (``vLLMReplica`` with ``server_class``, ``vllm_async_server.py:1334``, set to
  :class:`KeyedvLLMHttpServer` for the policy's replicas; the reward / teacher model replicas keep verl's server,
  their loops call it over HTTP without a key, ``experimental/reward_loop/reward_model.py:95-98``), put under
  ``"vllm"`` in verl's ``RolloutReplicaRegistry`` (``replica.py:312-330``) by :func:`register`;
* the key: made in the server actor's process at ``launch_server`` (``secrets.token_hex(32)``, per server and run)
  and set as that process's ``VLLM_API_KEY``, which vLLM's ``build_app`` reads for its own ``/v1`` check
  (``vllm/entrypoints/openai/api_server.py:257-261``) and :class:`~qwen3_rl.rollout.server_auth.KeyEveryRoute` for
  every other route but ``/health``. It is not put in the ``vllm serve`` arguments: verl prints them on replica 0
  (``vllm_async_server.py:458-459``). :meth:`KeyedvLLMHttpServer.api_key` hands it to whoever holds the actor;
* the middleware: ``middleware`` added to the engine kwargs in verl's ``_preprocess_engine_kwargs`` hook
  (``vllm_async_server.py:1134``), which verl turns into ``--middleware`` for vLLM (``api_server.py:287-296``);
* the bind: :meth:`KeyedvLLMHttpServer.run_server` lets verl's ``run_server`` bind
  :func:`~qwen3_rl.rollout.server_auth.http_address`'s address; the server keeps reporting the node's address
  (``get_server_address``): verl keys its router and Prometheus targets by it (``llm_server.py:485-510``), and two
  nodes' loopback servers could share a port. With ``loopback`` the reported address refuses connections.

A bad combination stops with one line: the key with verl's Prometheus scrape (``rollout.prometheus.enable``: it
reads ``/metrics`` without a key) and a host other than ``node`` with it (it scrapes the reported address).
"""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Mapping
from typing import Any

from qwen3_rl.rollout.server_auth import MIDDLEWARE, http_address
from qwen3_rl.trainer.seam import GROUP, RecipeConfig

#: the environment variable vLLM's ``build_app`` and ``KeyEveryRoute`` read the key from (in the server's process)
KEY_ENV = "VLLM_API_KEY"


def _field(node: Any, name: str) -> Any:
    """``node[name]`` for a mapping (dict, DictConfig), else ``node.name`` (verl's config dataclasses); None if absent."""
    if isinstance(node, Mapping):
        return node.get(name)
    return getattr(node, name, None)


def recipe_of(rollout_config: Any) -> RecipeConfig:
    """The seam's settings from ``rollout_config.custom[GROUP]`` (RolloutConfig, DictConfig or dict; none: the
    seam's defaults, key on and ``loopback``)."""
    custom = _field(rollout_config, "custom")
    return RecipeConfig.from_group((_field(custom, GROUP) if custom is not None else None) or {})


def check_combination(rollout_config: Any) -> None:
    """Stop with one line when the settings cannot hold with verl's own HTTP clients of the policy servers."""
    recipe = recipe_of(rollout_config)
    prometheus = _field(rollout_config, "prometheus")
    scraped = bool(prometheus is not None and _field(prometheus, "enable"))
    if scraped and recipe.server_auth.enable:
        raise ValueError(
            "current set: SERVER_API_KEY=True with rollout.prometheus.enable: verl's Prometheus scrapes "
            "the servers' /metrics without a key; turn one off"
        )
    if scraped and recipe.server_http.host != "node":
        raise ValueError(
            f"current set: SERVER_HTTP_HOST={recipe.server_http.host} with rollout.prometheus.enable: "
            "verl's Prometheus scrapes the servers at the node's address; use node"
        )


@functools.cache
def _server_class() -> type:
    """:class:`KeyedvLLMHttpServer`, made on first use (verl 0.9.1 and vLLM are imported only then)."""
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    from qwen3_rl.rollout.verl_dp_rank import DpRankServerMixin

    class KeyedvLLMHttpServer(DpRankServerMixin, vLLMHttpServer):
        """verl's vLLM server with the recipe's key on every route but ``/health`` and its endpoint bound on
        ``server_http.host``'s address (module docstring); ``generate`` takes the group router's vLLM DP rank
        (:class:`~qwen3_rl.rollout.verl_dp_rank.DpRankServerMixin`)."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self._qwen3_rl = recipe_of(self.config)
            self._api_key: str | None = None

        async def launch_server(self, *args: Any, **kwargs: Any) -> None:
            if self._qwen3_rl.server_auth.enable:
                self._api_key = secrets.token_hex(32)
                os.environ[KEY_ENV] = self._api_key  # this process and its engine children only
            await super().launch_server(*args, **kwargs)

        def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
            super()._preprocess_engine_kwargs(engine_kwargs)
            if self._qwen3_rl.server_auth.enable:
                have = engine_kwargs.get("middleware") or []
                have = [have] if isinstance(have, str) else list(have)
                engine_kwargs["middleware"] = [*have, MIDDLEWARE] if MIDDLEWARE not in have else have

        async def run_server(self, args: Any) -> None:
            reported = self._server_address
            self._server_address = http_address(self._qwen3_rl.server_http.host, reported)[0]
            try:
                await super().run_server(args)  # verl binds uvicorn on self._server_address (:533)
            finally:
                self._server_address = reported

        def api_key(self) -> str | None:
            """The server's key (None with ``server_auth`` off)."""
            return self._api_key

        def spec_decode_counts(self) -> dict[str, int]:
            """vLLM's spec-decode counters of this server's engines now, cumulative since its start and summed
            over its engines (``{"num_drafts", "num_draft_tokens", "num_accepted_tokens"}``; 0 without a drafter
            or with ``rollout.disable_log_stats``): read from the Prometheus registry of this process, where
            ``AsyncLLM``'s stat logger counts them (the numbers ``/metrics`` serves). The trainer's side, one
            step's difference over the servers into ``rollout/spec_decode/*``: ``qwen3_rl.trainer.verl091_spec_metrics``."""
            from vllm.v1.metrics.reader import get_metrics_snapshot

            from qwen3_rl.spec_decode.metrics import read_counters

            return read_counters(get_metrics_snapshot())

    return KeyedvLLMHttpServer


@functools.cache
def replica_class() -> type:
    """:class:`KeyedvLLMReplica`: verl 0.9.1's ``vLLMReplica`` whose policy servers are ``KeyedvLLMHttpServer``."""
    import ray
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    server = ray.remote(_server_class())

    class KeyedvLLMReplica(vLLMReplica):
        """verl's vLLM replica; the policy's replicas start the keyed, bound server (module docstring)."""

        def __init__(
            self, replica_rank: int, config: Any, model_config: Any, *args: Any, **kwargs: Any
        ) -> None:
            super().__init__(replica_rank, config, model_config, *args, **kwargs)
            if not (self.is_reward_model or self.is_teacher_model):
                check_combination(self.config)
                self.server_class = server

    return KeyedvLLMReplica


def register() -> None:
    """Put :func:`replica_class` under ``"vllm"`` in verl 0.9.1's ``RolloutReplicaRegistry``, in the process that
    builds the replicas (the trainer's ``LLMServerManager``); and the recipe's trainer mode (``qwen3_rl_sync``:
    the servers' spec-decode counters in the step metrics, ``qwen3_rl.trainer.verl091_spec_metrics``) in verl's
    trainer registry, which the trainer's process reads (``main_ppo.py:139-141``)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from qwen3_rl.trainer import verl091_spec_metrics

    RolloutReplicaRegistry.register("vllm", replica_class)
    verl091_spec_metrics.register()
