"""The rollout pool: verl's standalone vLLM servers (``AgentLoopManager(config, worker_group=None)`` ->
``RolloutReplica.init_standalone``) with what the fully-async trainer needs added by subclassing verl's public
classes (no verl patch):

* :class:`PartialServerMixin` on verl's ``vLLMHttpServerBase``: each request is tagged with the weight version it
  ran under and whether it was aborted; ``qwen3_rl_pause`` stops new requests, aborts the running ones (partial
  rollout) or lets them finish, and clears the prefix cache (its KV came from the old weights);
  ``qwen3_rl_resume`` sets the new version and lets requests in again;
* :class:`WeightReceiverMixin` on verl's ``vLLMAsyncRollout`` (the process holding the vLLM worker): joins the
  weight-sync group and loads the broadcast tensors through verl's ``update_weights``;
* :class:`PartialvLLMReplica`, :class:`PartialAgentLoopManager`: the replica and manager that use them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorkerBase
from verl.single_controller.ray import RayClassWithInitArgs
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.vllm_rollout import vLLMAsyncRollout
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServerBase, vLLMReplica

from qwen3_rl.spec_decode.runner_drafter import GROUP_PROMPT_LEN_KEY
from qwen3_rl.trainer.fully_async.weight_sync import TensorSpec, byte_checksum, make_group, receive

#: seconds a pause waits for vLLM's DP engine cores to stop stepping once no request runs
DP_IDLE_TIMEOUT_S = 120.0


class PartialTokenOutput(TokenOutput):
    """verl's token output plus the fully-async tags."""

    #: the request was aborted at a weight sync (its tokens so far are ``token_ids``)
    aborted: bool = False
    #: the weight version the request ran under
    param_version: int = 0


class PartialServerMixin:
    """Token-in-token-out generation that can be paused (and its running requests aborted) at a weight sync."""

    def _q3_state(self) -> None:
        if not hasattr(self, "_q3_running"):
            self._q3_running = asyncio.Event()
            self._q3_running.set()
            self._q3_inflight: set[str] = set()
            self._q3_version = 0

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None) -> PartialTokenOutput:
        """One request; returns its tokens, whether it was aborted, and the weight version it ran under."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if image_data:
            raise ValueError("fully async: multi-modal prompts are not supported")
        self._q3_state()
        while not self._q3_running.is_set():
            await self._q3_running.wait()
        version = self._q3_version
        vllm_id = f"{request_id}-{uuid4().hex[:8]}"
        self._q3_inflight.add(vllm_id)  # no await since the wait: a pause sees this request
        try:
            hooks = getattr(self, "qwen3_rl_hooks", None)
            engine_kwargs = {} if hooks is None else hooks.request_kwargs(sampling_params)
            want_lp = bool(sampling_params.pop("logprobs", False))
            group_len = sampling_params.pop(GROUP_PROMPT_LEN_KEY, None)
            if group_len is not None:  # a resumed request: the drafter keeps it in its siblings' group
                sampling_params["extra_args"] = {**(sampling_params.get("extra_args") or {}),
                                                 GROUP_PROMPT_LEN_KEY: int(group_len)}
            sampling_params.setdefault("repetition_penalty", self.config.get("repetition_penalty", 1.0))
            params = SamplingParams(max_tokens=self.config.max_model_len - len(prompt_ids),
                                    logprobs=0 if want_lp else None, **sampling_params)
            final = None
            async for out in self.engine.generate(prompt=TokensPrompt(prompt_token_ids=prompt_ids),
                                                  sampling_params=params, request_id=vllm_id, **engine_kwargs):
                final = out
        finally:
            self._q3_inflight.discard(vllm_id)
        assert final is not None
        c = final.outputs[0]
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)] if want_lp else None
        return PartialTokenOutput(token_ids=list(c.token_ids), log_probs=lps, aborted=c.finish_reason == "abort",
                                  param_version=version)

    async def qwen3_rl_pause(self, abort: bool) -> int:
        """Stop new requests; abort the running ones (``abort``) or let them finish; wait until none runs and
        vLLM's DP engine cores have stopped stepping (:meth:`_q3_wait_engines_idle`); clear the prefix cache.
        Returns the number of requests aborted (0 on a server without an engine: the other nodes of a
        multi-node replica)."""
        self._q3_state()
        if getattr(self, "engine", None) is None:
            return 0
        self._q3_running.clear()
        aborted: set[str] = set()
        while self._q3_inflight:
            if abort:
                ids = [i for i in self._q3_inflight if i not in aborted]
                if ids:
                    await self.engine.abort(ids)
                    aborted.update(ids)
            await asyncio.sleep(0.02)
        await self._q3_wait_engines_idle()
        await self.engine.reset_prefix_cache()
        return len(aborted)

    async def _q3_wait_engines_idle(self) -> None:
        """Wait until vLLM's DP engine cores have stopped stepping (at most ``DP_IDLE_TIMEOUT_S``). With DP > 1
        they go on running dummy batches, each with the MoE layers' expert-parallel collectives, after the last
        request has ended, until an all-reduce every 32 steps finds all ranks idle (vLLM 0.13
        ``DPEngineCoreProc.run_busy_loop``); a weight receive started meanwhile holds its worker's event loop
        (verl's ZeroMQ executor calls) while another worker waits for it in such a step. vLLM's front end learns
        that the wave ended from its DP coordinator (``dp_engines_running``, what vLLM's own
        ``wait_for_requests_to_drain`` reads); without DP it is always False."""
        core = self.engine.engine_core
        t0 = time.monotonic()
        while core.dp_engines_running():
            if time.monotonic() - t0 > DP_IDLE_TIMEOUT_S:
                raise RuntimeError(f"fully async: vLLM's DP engine cores still run {DP_IDLE_TIMEOUT_S:.0f} s after "
                                   "the last request ended: no weight sync while they step")
            await asyncio.sleep(0.01)

    async def qwen3_rl_resume(self, version: int) -> None:
        """Let requests in again, tagged with weight version ``version``."""
        self._q3_state()
        self._q3_version = int(version)
        self._q3_running.set()


@ray.remote(num_cpus=1)
class PartialvLLMServer(PartialServerMixin, vLLMHttpServerBase):
    """verl's vLLM server actor with pause / abort / resume."""


class WeightReceiverMixin:
    """On the rollout worker: receive the trainer's broadcast and load it into the vLLM model."""

    def qwen3_rl_join_group(self, host: str, port: int, rank: int, world: int, backend: str) -> None:
        self._q3_group = make_group(host, port, rank, world, backend)

    async def qwen3_rl_receive(self, specs: Sequence[TensorSpec], buckets: Sequence[Sequence[int]]
                               ) -> list[tuple[int, int]]:
        """Receive one sync (on the sync group's device) and load it (verl's ``update_weights``); returns each
        tensor's :func:`~.weight_sync.byte_checksum`."""
        sums: list[tuple[int, int]] = []

        def tensors():
            for name, t in receive(self._q3_group, specs, buckets):
                sums.append(byte_checksum(t))
                yield name, t

        await self.update_weights(tensors())
        return sums


class WeightReceivingRollout(WeightReceiverMixin, vLLMAsyncRollout):
    """verl's server-mode rollout worker that also receives weights."""


_receiver_actor_cls = ray.remote(WeightReceivingRollout)


class PartialvLLMReplica(vLLMReplica):
    """verl's vLLM replica with the pausable server and the weight-receiving workers; ``device_name``: the
    accelerator resource its workers ask Ray for (``trainer.device``: ``npu`` / ``cuda``)."""

    def __init__(self, *args: Any, device_name: str = "cuda", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = PartialvLLMServer
        self.device_name = device_name

    async def init_standalone(self) -> None:
        """verl's standalone start-up, with the workers' device passed on: verl 0.6.1's own
        (``RolloutReplica.init_standalone``) builds its worker group with the default ``cuda``, i.e. Ray resource
        ``GPU``, which an Ascend node (and the CPU profile, which advertises ``NPU``) does not have."""
        from verl.single_controller.ray import RayWorkerGroup
        from verl.trainer.ppo.ray_trainer import ResourcePoolManager
        from verl.workers.rollout.replica import RolloutMode

        self.rollout_mode = RolloutMode.STANDALONE
        name = f"fully_async_rollout_pool_{self.replica_rank}"
        mgr = ResourcePoolManager(resource_pool_spec={name: [self.gpus_per_node] * self.nnodes}, mapping=None)
        mgr.create_resource_pool()
        self.resource_pool = mgr.resource_pool_dict[name]
        group = RayWorkerGroup(resource_pool=self.resource_pool, ray_cls_with_init=self.get_ray_class_with_init_args(),
                               bin_pack=False, name_prefix=f"fully_async_rollout_{self.replica_rank}",
                               device_name=self.device_name)
        self.workers = group.workers
        await self.launch_servers()

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        return RayClassWithInitArgs(cls=_receiver_actor_cls, config=self.config, model_config=self.model_config,
                                    device_mesh=None)


@ray.remote
class PartialAgentLoopWorker(AgentLoopWorkerBase):
    """verl's agent-loop worker with the partial-rollout agent loop registered in its process."""

    def __init__(self, config: Any, server_handles: list[Any], reward_router_address: str | None = None) -> None:
        import qwen3_rl.trainer.fully_async.agent_loop  # noqa: F401  (registers qwen3_rl_partial)

        super().__init__(config, server_handles, reward_router_address)


class PartialAgentLoopManager(AgentLoopManager):
    """verl's agent-loop manager on standalone servers (``config.trainer`` sizes = the rollout pool's)."""

    def __init__(self, config: Any) -> None:
        import functools

        self.rollout_replica_class = functools.partial(PartialvLLMReplica, device_name=str(config.trainer.device))
        self.agent_loop_workers_class = PartialAgentLoopWorker
        super().__init__(config, worker_group=None)

    @property
    def servers(self) -> list[Any]:
        return [s for r in self.rollout_replicas for s in r.servers]

    @property
    def workers(self) -> list[Any]:
        """The rollout worker actors (one per rollout process), in replica order."""
        return [w for r in self.rollout_replicas for w in r.workers]

    def pause(self, abort: bool) -> int:
        """Pause every server (abort the running requests when ``abort``); the number aborted."""
        return int(sum(ray.get([s.qwen3_rl_pause.remote(abort) for s in self.servers])))

    def resume(self, version: int) -> None:
        ray.get([s.qwen3_rl_resume.remote(version) for s in self.servers])
