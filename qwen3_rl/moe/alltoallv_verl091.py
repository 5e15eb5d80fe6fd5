"""``qwen3_rl.moe_alltoallv`` on the current set (verl 0.9.1, mbridge 0.15.1): a plug-in, no verl patch.

verl 0.9.1's Megatron engine exports the actor's weights only through its Bridge; with ``vanilla_mbridge=True``
that is ``Bridge.export_weights`` (``workers/engine/megatron/transformer_impl.py:1041-1042``), which all-gathers
every routed-expert tensor over the EP group (``mbridge/core/bridge.py:364-372``), so each rank converts all E
experts while its colocated vLLM worker keeps E / EP_vllm of them.

Plug-in: importing this module (verl's own hook ``actor_rollout_ref.model.external_lib``,
``verl/workers/config/model.py`` -> ``import_external_libs``) registers :class:`AlltoallvQwen3MoeBridge` for
``qwen3_moe`` in mbridge's model registry (``mbridge/core/bridge.py:961-982``, read by ``AutoBridge.from_config``,
``auto_bridge.py:47-48``). Its ``export_weights`` is mbridge's unless the call comes from the worker's colocated
weight sync (``ActorRolloutRefWorker.update_weights``, ``workers/engine_workers.py:725-806``, found on the call
stack) with ``actor_rollout_ref.qwen3_rl.moe_alltoallv.enable=True``. Then mbridge's own loop exports everything
but the routed experts, and each expert tensor goes through one ``all_to_all_single``
(:class:`qwen3_rl.moe.reshard_verl.MoEAlltoallvSync`) so each rank gets only the experts of its vLLM EP rank,
merged and converted by the same bridge's ``_weight_merge_across_tp`` / ``_weight_to_hf_format``.

Trainer rank -> vLLM EP rank, from verl's objects: in the naive sync each trainer rank hands its export to its
``ServerAdapter`` (``worker.rollout``), which sends it over ZMQ to the vLLM worker of replica ``replica_rank`` whose
local weight-sync rank is ``rollout_rank % RAY_LOCAL_WORLD_SIZE`` on node ``node_rank``
(``rollout/vllm_rollout/vllm_rollout.py:81-83, 131-133``). That vLLM worker's local rank is
``dp_local_rank * TP + tp_rank`` (``vllm_rollout/utils.py:47-70``), its DP rank ``node_rank * dp_local +
dp_local_rank`` (``vllm_async_server.py:388-396``, dp_local = GPUs per node / TP), and vLLM's EP rank is
``dp_rank * TP + tp_rank`` over EP = TP * DP (``enable_expert_parallel = expert_parallel_size > 1``,
``vllm_async_server.py:402``). Each rank's EP rank is gathered over megatron's expert group, so the routing uses
what every member's adapter says.

Refused, one line naming the setting (ValueError at the first sync): a checkpoint engine other than ``naive``
(others ship rank 0's whole export, ``hccl_checkpoint_engine.py:247-253``), EPLB / non-linear expert placement,
no colocated rollout on the worker, PD disaggregation, rollout PP > 1, vLLM expert parallel off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from qwen3_rl.moe.reshard import RolloutLayout
from qwen3_rl.moe.reshard_verl import ExpertRouting, MoEAlltoallvSync, _get, _non_linear_placement

#: the switch inside the worker's config (``actor_rollout_ref``), set by features.toml MOE_ALLTOALLV
SWITCH_PATH = ("qwen3_rl", "moe_alltoallv", "enable")
#: mbridge's test for a routed-expert tensor (``bridge.py:364``)
_EXPERT_KEY = ".mlp.experts.linear_fc"


@dataclass(frozen=True)
class SyncContext:
    """The colocated weight sync this export feeds: the worker (``ActorRolloutRefWorker``) and the sync mode it
    resolved (``effective_mode``, ``engine_workers.py:766``)."""

    worker: Any
    mode: str


def find_sync_context(frame: FrameType | None = None) -> SyncContext | None:
    """The innermost ``verl.workers.engine_workers`` ``update_weights`` frame on the call stack, or None."""
    f = frame or sys._getframe(1)
    while f is not None:
        if (
            f.f_code.co_name == "update_weights"
            and f.f_globals.get("__name__") == "verl.workers.engine_workers"
        ):
            worker = f.f_locals.get("self")
            if worker is not None:
                return SyncContext(worker, str(f.f_locals.get("effective_mode", "")))
        f = f.f_back
    return None


def switch_enabled(worker: Any) -> bool:
    node = getattr(worker, "config", None)
    for key in SWITCH_PATH:
        node = _get(node, key, None)
    return bool(node)


def vllm_ep_rank(adapter: Any, tp: int, local_world_size: int) -> int:
    """vLLM EP rank of the vLLM worker that ``adapter`` (verl's vLLM ``ServerAdapter``) feeds (module docstring)."""
    local = int(adapter.rollout_rank) % local_world_size  # the ZMQ handle's rank (vllm_rollout.py:131-133)
    dp_local_rank, tp_rank = divmod(local, tp)  # vllm_rollout/utils.py:69-70, inverted
    dp_rank = (
        int(adapter.node_rank) * (local_world_size // tp) + dp_local_rank
    )  # vllm_async_server.py:388-396
    return dp_rank * tp + tp_rank


def sync_problems(ctx: SyncContext) -> list[str]:
    """Why the all-to-allv cannot feed this sync (empty: it can)."""
    cfg = _get(ctx.worker.config, "rollout", None)
    out = []
    if ctx.mode != "naive":
        out.append(
            f"actor_rollout_ref.rollout.checkpoint_engine.backend={ctx.mode} (only naive feeds each rank's "
            "export to the vLLM worker on its own device)"
        )
    if getattr(ctx.worker, "rollout", None) is None:
        out.append(
            "no colocated rollout on this worker (actor_rollout_ref.hybrid_engine / a separate rollout pool)"
        )
    if _get(cfg, "name", "vllm") != "vllm":
        out.append(f"actor_rollout_ref.rollout.name={_get(cfg, 'name')}")
    moved = _non_linear_placement(_get(_get(cfg, "engine_kwargs", None), "vllm", None))
    if moved:
        out.append(f"actor_rollout_ref.rollout.{moved} (EPLB / non-linear expert placement)")
    if _get(_get(cfg, "disaggregation", None), "enabled", False):
        out.append("actor_rollout_ref.rollout.disaggregation.enabled=True")
    if int(_get(cfg, "pipeline_model_parallel_size", 1)) != 1:
        out.append(
            f"actor_rollout_ref.rollout.pipeline_model_parallel_size={_get(cfg, 'pipeline_model_parallel_size')}"
        )
    if int(_get(cfg, "expert_parallel_size", 1)) <= 1:
        out.append(
            "actor_rollout_ref.rollout.expert_parallel_size<=1 (vLLM expert parallel off: every rank needs "
            "every expert)"
        )
    return out


def build_sync(ctx: SyncContext, mpu: Any, num_experts: int) -> MoEAlltoallvSync:
    """The expert exchange of this rank (collective: one ``all_gather_object`` over the expert group); ``mpu`` is
    ``megatron.core.parallel_state``.

    Raises ValueError (one line) for :func:`sync_problems` or an unexpected megatron expert rank order.
    """
    problems = sync_problems(ctx)
    if problems:
        raise ValueError("qwen3_rl.moe_alltoallv refused: " + "; ".join(problems))
    cfg = ctx.worker.config.rollout
    tp, dp = int(cfg.tensor_model_parallel_size), int(cfg.data_parallel_size)
    lws = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", tp * dp))
    mine = vllm_ep_rank(ctx.worker.rollout, tp, lws)
    dist = torch.distributed
    group = mpu.get_expert_tensor_and_model_parallel_group()
    ranks: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(ranks, mine, group=group)
    etp, ep = mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_model_parallel_world_size()
    member = dist.get_rank(group=group)
    if member != mpu.get_expert_tensor_parallel_rank() + etp * mpu.get_expert_model_parallel_rank():
        raise ValueError(
            f"qwen3_rl.moe_alltoallv refused: expert group member {member} is not etp_rank + ETP*ep_rank"
        )
    routing = ExpertRouting(
        int(num_experts), ep, etp, tuple(int(r) for r in ranks), member, RolloutLayout(tp, dp)
    )
    return MoEAlltoallvSync(routing, group)


class _WithoutRoutedExperts:
    """A model chunk as mbridge's export loop sees it, minus the routed-expert parameters (the rest delegated)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def named_parameters(self, *args: Any, **kw: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in self._model.named_parameters(*args, **kw) if _EXPERT_KEY not in n)

    def state_dict(self, *args: Any, **kw: Any) -> dict[str, Any]:
        return {k: v for k, v in self._model.state_dict(*args, **kw).items() if _EXPERT_KEY not in k}


def export_routed_experts(
    bridge: Any,
    models: list[torch.nn.Module],
    sync: MoEAlltoallvSync,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) of the routed experts this rank's vLLM EP rank holds, every layer of every PP stage.

    Per expert tensor (mbridge's order over PP stages): mbridge's PP broadcast (``broadcast_str_from_megatron_pp`` /
    ``broadcast_from_megatron_pp``, ``mbridge/core/util.py:292-370``), then :meth:`MoEAlltoallvSync.sync_params`.
    """
    from mbridge.core.util import broadcast_from_megatron_pp, broadcast_str_from_megatron_pp

    mpu = bridge.mpu
    local: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    names = []
    for vpp, model in enumerate(models):
        to_global = bridge._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        for n, p in model.named_parameters():
            if _EXPERT_KEY in n:
                if not sync.handles(to_global[n]):
                    raise ValueError(
                        f"qwen3_rl.moe_alltoallv refused: expert weight {n} is not linear_fc[12].weightJ"
                    )
                local[(vpp, n)] = (to_global[n], p)
                names.append((mpu.pp_rank, vpp, n))
    all_pp: list[Any] = [None] * mpu.pp_size
    torch.distributed.all_gather_object(all_pp, names, group=mpu.pp_group)

    def convert(n: str, params: list[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
        return bridge._weight_to_hf_format(n, params[0] if len(params) == 1 else params)

    for pp, vpp, n in sum(all_pp, []):
        name, param = local[(vpp, n)] if pp == mpu.pp_rank else (None, None)
        name = broadcast_str_from_megatron_pp(name)
        tensor = broadcast_from_megatron_pp(param)

        def merge(te_name: str, shards: list[torch.Tensor], ref: torch.Tensor = tensor) -> Any:
            return bridge._weight_merge_across_tp(te_name, shards, ref)

        yield from sync.sync_params(name, tensor, merge, convert)


def _alltoallv_export(
    bridge: Any, models: list[torch.nn.Module], sync: MoEAlltoallvSync, upstream: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    from mbridge.core.util import unwrap_model

    chunks = [unwrap_model(m) for m in models]
    yield from upstream([_WithoutRoutedExperts(m) for m in chunks])
    yield from export_routed_experts(bridge, chunks, sync)


def register() -> type:
    """Register :class:`AlltoallvQwen3MoeBridge` (a subclass of the bridge mbridge registered for ``qwen3_moe``) in
    mbridge's registry; idempotent. Returns the class."""
    from mbridge.core import bridge as mb

    base = mb._MODEL_REGISTRY["qwen3_moe"]
    if getattr(base, "_qwen3_rl_alltoallv", False):
        return base

    class AlltoallvQwen3MoeBridge(base):  # type: ignore[misc, valid-type]
        """mbridge's Qwen3-MoE bridge; ``export_weights`` as the module docstring says."""

        _qwen3_rl_alltoallv = True

        def export_weights(self, models: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
            ctx = find_sync_context()
            if ctx is None or not switch_enabled(ctx.worker):
                return super().export_weights(models)
            from megatron.core import parallel_state

            sync = build_sync(ctx, parallel_state, self.config.num_moe_experts)
            return _alltoallv_export(self, models, sync, super().export_weights)

    mb._MODEL_REGISTRY["qwen3_moe"] = AlltoallvQwen3MoeBridge
    return AlltoallvQwen3MoeBridge


class _RegisterAfterMbridge(importlib.abc.MetaPathFinder):
    """Registers the bridge right after ``import mbridge`` runs (whoever imports it: verl's
    ``verl/models/mcore/mbridge.py`` applies its patch first), so importing this module imports neither mbridge nor
    megatron (MindSpeed's adaptor must come before megatron in the NPU engine)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "mbridge":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# imported through verl's external_lib hook: register now if mbridge is loaded, else right after it is
if "mbridge" in sys.modules:
    register()
elif not any(isinstance(f, _RegisterAfterMbridge) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterMbridge())
