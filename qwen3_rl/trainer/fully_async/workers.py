"""The trainer's pool: verl's Megatron actor worker (role ``actor``, no rollout; ``ref`` colocated when the KL
needs it) plus the weight export to the rollout's pool (:mod:`.weight_sync`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron.core import parallel_state as mpu
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.megatron_utils import per_tensor_generator
from verl.workers.megatron_workers import ActorRolloutRefWorker

from qwen3_rl.trainer.fully_async.weight_sync import TensorSpec, bound_socket, make_group, send, specs_of


class TrainerWorker(ActorRolloutRefWorker):
    """verl's Megatron ``ActorRolloutRefWorker`` as a trainer-only worker with weight export."""

    def __init__(self, config: Any, role: str, **kwargs: Any) -> None:
        super().__init__(config, role, **kwargs)
        if self._is_actor and not self._is_rollout:
            # verl normalises the mini-batch (prompts -> samples per DP rank) only when the actor also rolls out
            n, dp = int(self.config.rollout.n), mpu.get_data_parallel_world_size()
            self.config.actor.ppo_mini_batch_size = self.config.actor.ppo_mini_batch_size * n // dp
        self._q3_group: Any = None
        self._q3_listen_fd: int | None = None  # the store's socket, bound by qwen3_rl_sync_address

    def _export(self):
        """The actor's weights as ``(HF name, tensor)``, one at a time (collective over the trainer's ranks)."""
        from verl.utils.qwen3_rl_hooks import weight_sync_hooks

        if self.bridge is not None:
            return self.bridge.export_weights(self.actor.actor_module)
        hooks = weight_sync_hooks(self.config.rollout, uses_bridge=False)
        return per_tensor_generator(self.actor.actor_module, self.actor_model_config, self.weight_converter,
                                    self.tf_config, self.layer_name_mapping,
                                    **({} if hooks is None else {"qwen3_rl_hooks": hooks}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def qwen3_rl_sync_address(self) -> tuple[str, int] | None:
        """Rank 0: its node's address and the port of the weight-sync group's store, bound here (port 0: the
        system's choice) and held until the store serves on it (:meth:`qwen3_rl_join_group`), so no other process
        can take it in between."""
        if self.rank != 0:
            return None
        import ray

        host = ray.util.get_node_ip_address().strip("[]")
        self._q3_listen_fd, port = bound_socket()
        return host, port

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def qwen3_rl_sync_device(self) -> str | None:
        """Rank 0: the device its weights live on (verl's device name in this process, which holds the device)."""
        from verl.utils.device import get_device_name

        return get_device_name() if self.rank == 0 else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def qwen3_rl_join_group(self, host: str, port: int, world: int, backend: str) -> None:
        """Rank 0 joins the weight-sync group as its root (the other trainer ranks are not in it); its store
        serves on the socket :meth:`qwen3_rl_sync_address` bound."""
        if self.rank == 0:
            self._q3_group = make_group(host, port, 0, world, backend, listen_fd=self._q3_listen_fd)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def qwen3_rl_export_specs(self) -> list[TensorSpec]:
        """Names, shapes and dtypes of the export (every rank runs the export; rank 0's list is the plan)."""
        return specs_of(self._export())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def qwen3_rl_send_weights(self, specs: Sequence[TensorSpec], buckets: Sequence[Sequence[int]]
                              ) -> list[tuple[int, int]]:
        """Export and broadcast (rank 0, on the sync group's device) the weights; returns rank 0's per-tensor
        :func:`~.weight_sync.byte_checksum` ([] elsewhere)."""
        named = self._export()
        if self.rank != 0:
            for _ in named:  # the other ranks take part in the export's own collectives
                pass
            return []
        return send(self._q3_group, named, specs, buckets)
