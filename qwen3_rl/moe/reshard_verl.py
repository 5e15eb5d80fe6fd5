"""verl wiring of the MoE all-to-allv weight sync (``qwen3_rl.moe_alltoallv``), run through verl's seam.

verl 0.6.1 streams the actor's weights to the colocated vLLM rollout tensor by tensor
(``verl/utils/megatron_utils.py:per_tensor_generator``). For every routed-expert tensor (one local expert of
one layer, ``linear_fc1.weight{j}`` [2F/ETP, H] or ``linear_fc2.weight{j}`` [H, F/ETP]) it all-gathers over the
expert-parallel group and then over the expert-tensor-parallel group, so **every** rank receives all
``EP * ETP`` shards and converts all EP experts, although with vLLM expert parallel each rank's
``FusedMoE`` keeps only the ``E / EP_vllm`` experts of its own EP rank and drops the rest
(``vllm/model_executor/layers/fused_moe/layer.py`` ``weight_loader``: experts outside ``expert_map`` return).

With ``qwen3_rl.moe_alltoallv.enable`` (the seam's weight-sync hook, :class:`qwen3_rl.trainer.seam.WeightSyncHooks`,
hands :class:`MoEAlltoallvSync` to ``per_tensor_generator`` as its ``expert_sync``) the same tensor is exchanged with ONE ``torch.distributed.all_to_all_single`` over
megatron's expert-tensor-and-model-parallel group (EP x ETP ranks, etp fastest): each member sends its shard
only to the members whose vLLM EP rank holds that expert (:func:`qwen3_rl.moe.reshard.expert_group_exchange`),
so every rank receives exactly the ETP shards of its own experts, each once, and converts only those. The
received shards go through verl's own ``default_tp_concat_fn`` and ``weight_converter.convert_param`` (bound by
the patch), so the rollout gets the same (name, tensor) pairs as with the upstream all-gather, minus the
experts it would have dropped.

Layouts (see :mod:`qwen3_rl.moe.reshard`): the vLLM EP rank of a rollout rank is its global torch rank. That
holds for verl's sync SPMD rollout (the recipe's mode, docs/rollout_mode.md): vLLM's external launcher sets
``data_parallel_rank = RANK // TP`` (``vllm/config/parallel.py:510-523``) and ``FusedMoEParallelConfig`` uses
``ep_rank = dp_rank * TP + tp_rank``. The GroupedMLP layout (``experts.weight1`` / ``weight2``, :mod:`qwen3_rl.moe.fused_experts_verl`)
is cut into the same per-expert tensors first (:func:`qwen3_rl.moe.fused_experts.grouped_to_te_experts`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qwen3_rl.moe.fused_experts import grouped_to_te_experts
from qwen3_rl.moe.reshard import GroupExchange, RolloutLayout, expert_group_exchange, rollout_expert_range

__all__ = [
    "ExpertRouting",
    "expert_ids_of",
    "MoEAlltoallvSync",
    "alltoallv_rollout_layout",
    "rollout_layout_from_config",
    "sync_receive_counts",
]

#: TEGroupedMLP per-expert weight as verl streams it (PP-normalised): ``...mlp.experts.linear_fc1.weight3``
_TE_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12])\.weight(?P<j>\d+)$")
#: GroupedMLP (megatron-core legacy / MindSpeed overlap): all local experts of a layer in ``...mlp.experts.weight1`` / ``weight2``
_GROUPED_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?decoder\.layers\.\d+\.mlp\.experts)\.weight(?P<which>[12])$")

TpConcat = Callable[[str, list[torch.Tensor]], "torch.Tensor | list[torch.Tensor]"]
Convert = Callable[[str, list[torch.Tensor]], tuple[list[str], list[torch.Tensor]]]


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        value = cfg.get(key, default)
        return default if value is None else value
    value = getattr(cfg, key, default)
    return default if value is None else value


def rollout_layout_from_config(rollout_cfg: Any) -> RolloutLayout:
    """vLLM layout of verl's rollout config (``actor_rollout_ref.rollout``, DictConfig or RolloutConfig).

    Sync SPMD mode (the only one supported): TP = ``tensor_model_parallel_size``, DP =
    ``engine_kwargs.vllm.data_parallel_size`` (default 1), expert parallel = ``engine_kwargs.vllm.
    enable_expert_parallel`` (default False): what ``vLLMRollout`` hands to ``vllm.LLM``; verl's own
    ``rollout.data_parallel_size`` / ``expert_parallel_size`` must stay 1 there (docs/rollout_mode.md).
    Raises ValueError for another rollout name or mode, verl-level DP/EP, or rollout pipeline parallel.
    """
    name, mode = _get(rollout_cfg, "name", "vllm"), _get(rollout_cfg, "mode", "sync")
    if name != "vllm" or mode != "sync":
        raise ValueError(
            f"qwen3_rl.moe_alltoallv supports rollout.name=vllm with rollout.mode=sync (got {name}/{mode}): the "
            "all-to-allv routing assumes the vLLM EP rank equals the torch rank, checked only for the SPMD rollout"
        )
    tp = int(_get(rollout_cfg, "tensor_model_parallel_size", 1))
    verl_dp = int(_get(rollout_cfg, "data_parallel_size", 1))
    verl_ep = int(_get(rollout_cfg, "expert_parallel_size", 1))
    pp = int(_get(rollout_cfg, "pipeline_model_parallel_size", 1))
    if verl_dp != 1 or verl_ep != 1 or pp != 1:
        raise ValueError(
            "qwen3_rl.moe_alltoallv in sync mode needs rollout.data_parallel_size=1, rollout.expert_parallel_size=1 and "
            f"rollout.pipeline_model_parallel_size=1 (got {verl_dp}, {verl_ep}, {pp}); vLLM's DP and expert "
            "parallel go through rollout.engine_kwargs.vllm.data_parallel_size / enable_expert_parallel"
        )
    vllm_kw = _get(_get(rollout_cfg, "engine_kwargs", None), "vllm", None)
    moved = _non_linear_placement(vllm_kw)
    if moved:
        raise ValueError(
            f"qwen3_rl.moe_alltoallv routes every expert to the vLLM EP rank of vLLM's linear placement, but {moved} "
            "places experts elsewhere (redundant / moving experts): turn one of them off"
        )
    dp = _get(vllm_kw, "data_parallel_size", 1)
    ep_on = _get(vllm_kw, "enable_expert_parallel", False)
    if not isinstance(ep_on, bool):
        raise ValueError(f"rollout.engine_kwargs.vllm.enable_expert_parallel must be a bool, got {ep_on!r}")
    return RolloutLayout(tp=tp, dp=int(dp), expert_parallel=ep_on)


def _non_linear_placement(vllm_kw: Any) -> str:
    """Name of the vLLM / vLLM-Ascend engine setting that makes the expert placement non-linear, or ''.

    vLLM 0.13: ``enable_eplb``, ``expert_placement_strategy`` != linear (``config/parallel.py:120``);
    vLLM-Ascend 0.13 (``ascend_config.py:62-69, 156-162``; ``eplb/core/eplb_utils.py:59-100``):
    ``additional_config.expert_map_path`` / ``expert_map_record_path`` / ``dynamic_eplb`` /
    ``init_redundancy_expert`` / ``mix_placement`` and their ``additional_config.eplb_config`` forms (the
    recipe's ROLLOUT_EPLB sets these). Without them vLLM-Ascend's placement (``generate_global_placement``:
    ``np.array_split``) is vLLM's linear one.
    """
    if _get(vllm_kw, "enable_eplb", False):
        return "engine_kwargs.vllm.enable_eplb"
    strategy = _get(vllm_kw, "expert_placement_strategy", "linear")
    if strategy != "linear":
        return f"engine_kwargs.vllm.expert_placement_strategy={strategy}"
    add = _get(vllm_kw, "additional_config", None)
    for where, cfg, keys in (
        ("additional_config", add,
         ("expert_map_path", "expert_map_record_path", "dynamic_eplb", "init_redundancy_expert", "mix_placement")),
        ("additional_config.eplb_config", _get(add, "eplb_config", None),
         ("expert_map_path", "expert_map_record_path", "dynamic_eplb", "num_redundant_experts")),
    ):
        for key in keys:
            if _get(cfg, key, None):
                return f"engine_kwargs.vllm.{where}.{key}"
    return ""


def alltoallv_rollout_layout(rollout_cfg: Any) -> RolloutLayout:
    """The vLLM layout ``qwen3_rl.moe_alltoallv`` routes the experts to (:func:`rollout_layout_from_config`).

    Raises ValueError for everything :func:`rollout_layout_from_config` refuses and when vLLM expert
    parallel is off (then every rollout rank needs every expert and the upstream all-gather is already exact).
    """
    layout = rollout_layout_from_config(rollout_cfg)
    if not layout.expert_parallel:
        raise ValueError(
            "qwen3_rl.moe_alltoallv needs rollout expert parallel (rollout.engine_kwargs.vllm.enable_expert_parallel="
            "True): without it every rollout rank holds every expert and the upstream all-gather is already exact"
        )
    return layout


@dataclass(frozen=True)
class ExpertRouting:
    """Who sends which expert shard to whom inside one expert-tensor-and-model-parallel group (pure).

    num_experts: routed experts E of a layer; ep / etp: megatron's expert model / tensor parallel sizes;
    group_ranks: global ranks of the group, member order (etp fastest); member: this rank's index in it;
    rollout: the vLLM layout (expert parallel on, world = training world).
    """

    num_experts: int
    ep: int
    etp: int
    group_ranks: tuple[int, ...]
    member: int
    rollout: RolloutLayout

    def __post_init__(self) -> None:
        if not self.rollout.expert_parallel:
            raise ValueError("qwen3_rl.moe_alltoallv needs vLLM expert parallel (enable_expert_parallel=True)")
        if self.num_experts < 1 or self.num_experts % self.ep:
            raise ValueError(f"num_experts={self.num_experts} must be a positive multiple of megatron EP={self.ep}")
        if self.rollout.ep > self.num_experts:
            raise ValueError(f"vLLM EP={self.rollout.ep} > num_experts={self.num_experts}: some ranks hold no expert")
        if len(self.group_ranks) != self.ep * self.etp:
            raise ValueError(f"group has {len(self.group_ranks)} ranks, expected EP*ETP={self.ep * self.etp}")
        if not 0 <= self.member < len(self.group_ranks):
            raise ValueError(f"member {self.member} outside the group of {len(self.group_ranks)}")
        bad = [g for g in self.group_ranks if not 0 <= g < self.rollout.world]
        if bad:
            raise ValueError(f"group ranks {bad} outside the rollout world TP*DP={self.rollout.world}")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep

    @property
    def rank(self) -> int:
        """This rank's global rank = its vLLM EP rank (sync SPMD rollout)."""
        return self.group_ranks[self.member]

    def held_experts(self) -> range:
        """Experts this rank's vLLM ``FusedMoE`` holds (linear placement, ``determine_expert_map``)."""
        return rollout_expert_range(self.num_experts, self.rollout.ep, self.rank)

    def exchange(self, local_expert_id: int) -> GroupExchange:
        return _exchange(self.num_experts, self.ep, self.etp, local_expert_id, self.group_ranks, self.rollout)

    def received(self, local_expert_id: int) -> list[tuple[int, list[int]]]:
        """[(global expert, source members in etp order)] this rank receives for ``local_expert_id``, in the
        order of ``all_to_all_single``'s output chunks (source member order: expert, then etp shard)."""
        out: dict[int, list[int]] = {}
        for src, expert, t in self.exchange(local_expert_id).recv_from[self.member]:
            shards = out.setdefault(expert, [])
            if t != len(shards):
                raise AssertionError(f"expert {expert}: shard {t} out of order")  # by construction of the plan
            shards.append(src)
        return list(out.items())

    def split_sizes(self, local_expert_id: int, numel: int) -> tuple[list[int], list[int]]:
        """(input_split_sizes, output_split_sizes) of ``all_to_all_single`` for a shard of ``numel`` elements."""
        return self.exchange(local_expert_id).split_sizes(self.member, numel)


@functools.lru_cache(maxsize=4096)
def _exchange(num_experts: int, ep: int, etp: int, j: int, ranks: tuple[int, ...], rollout: RolloutLayout):
    return expert_group_exchange(num_experts, ep, etp, j, ranks, rollout)


def sync_receive_counts(routing: ExpertRouting) -> tuple[int, int]:
    """Expert shards this rank receives per layer and per fc tensor kind, summed over the local expert ids:
    (upstream EP + ETP all-gather: E/EP * EP * ETP, all-to-allv: ETP * experts it holds)."""
    upstream = routing.num_local_experts * routing.ep * routing.etp
    ours = sum(len(src) for j in range(routing.num_local_experts) for _, src in routing.received(j))
    return upstream, ours


class MoEAlltoallvSync:
    """The switch-on expert path of ``per_tensor_generator`` on one rank (collective over the group).

    ``handles(name)``: a routed-expert tensor this object syncs (TEGroupedMLP ``linear_fc{1,2}.weight{j}``;
    GroupedMLP ``experts.weight{1,2}`` when ``grouped_mlp``). ``sync_params`` yields the HF (name, tensor) pairs
    of the experts this rank's vLLM EP rank holds. Every member of the group must call it for the same tensor.
    """

    def __init__(self, routing: ExpertRouting, group: Any, grouped_mlp: bool = False,
                 all_to_all_single: Callable[..., Any] | None = None) -> None:
        self.routing = routing
        self.group = group
        self.grouped_mlp = grouped_mlp
        self._a2a = all_to_all_single or torch.distributed.all_to_all_single

    @classmethod
    def from_megatron(cls, mpu: Any, num_experts: int, rollout: RolloutLayout, grouped_mlp: bool = False,
                      dist: Any = None) -> MoEAlltoallvSync:
        """From megatron-core's parallel state (``megatron.core.parallel_state``) and torch.distributed.

        Checks: rollout world (TP * DP) == torch world (colocated), this rank's member index in
        ``get_expert_tensor_and_model_parallel_group()`` == etp_rank + ETP * ep_rank (megatron's 'tp-ep' order).
        """
        dist = dist or torch.distributed
        world = dist.get_world_size()
        if rollout.world != world:
            raise ValueError(
                f"qwen3_rl.moe_alltoallv: rollout TP*DP={rollout.world} != world size {world}: the all-to-allv "
                "routing needs every training rank to be one vLLM EP rank (colocated hybrid engine)"
            )
        ep = mpu.get_expert_model_parallel_world_size()
        etp = mpu.get_expert_tensor_parallel_world_size()
        group = mpu.get_expert_tensor_and_model_parallel_group()
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
        member = dist.get_rank(group=group)
        expected = mpu.get_expert_tensor_parallel_rank() + etp * mpu.get_expert_model_parallel_rank()
        if member != expected or ranks[member] != dist.get_rank():
            raise ValueError(
                f"expert-tensor-and-model-parallel group member {member} (ranks {ranks}) is not etp_rank + "
                f"ETP * ep_rank = {expected}: unexpected megatron expert rank order"
            )
        routing = ExpertRouting(int(num_experts), ep, etp, ranks, member, rollout)
        return cls(routing, group, grouped_mlp)

    # ------------------------------------------------------------------------------------------ dispatch
    def handles(self, name: str) -> bool:
        if _TE_NAME.match(name):
            return True
        return self.grouped_mlp and _GROUPED_NAME.match(name) is not None

    def exchange(self, shard: torch.Tensor, local_expert_id: int) -> list[tuple[int, list[torch.Tensor]]]:
        """One ``all_to_all_single``: this rank's ETP shard of local expert ``local_expert_id`` goes to the
        members holding that expert in vLLM; returns [(global expert, [ETP shards, etp order])] received.

        shard: [2F/ETP, H] (fc1) or [H, F/ETP] (fc2), identical shape on every member (megatron layout).
        Received shards are views of one receive buffer (``received * numel`` elements).
        """
        r = self.routing
        flat = shard.contiguous().view(-1)
        numel = flat.numel()
        inp, out = r.split_sizes(local_expert_id, numel)
        n_dst = sum(1 for x in inp if x)
        send = flat if n_dst == 1 else (flat.repeat(n_dst) if n_dst else flat[:0])
        recv = torch.empty(sum(out), dtype=shard.dtype, device=shard.device)
        self._a2a(recv, send, output_split_sizes=out, input_split_sizes=inp, group=self.group)
        result, pos = [], 0
        for expert, sources in r.received(local_expert_id):
            shards = []
            for _ in sources:
                shards.append(recv[pos : pos + numel].view(shard.shape))
                pos += numel
            result.append((expert, shards))
        if pos != recv.numel():
            raise AssertionError(f"received {recv.numel()} elements, routing accounts for {pos}")
        return result

    def sync_params(self, name: str, tensor: torch.Tensor, tp_concat: TpConcat,
                    convert: Convert) -> Iterator[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs of the experts this rank holds in vLLM, for one streamed expert tensor.

        name: PP-normalised megatron name (``handles(name)``); tensor: this rank's tensor after verl's PP
        broadcast. Order: for each local expert id (GroupedMLP: e = 0..E_local-1), the received experts by
        global id -- the upstream order with the experts of other vLLM ranks left out.
        ``tp_concat(te_name, etp_shards)`` / ``convert(te_name, params)``: verl's ``default_tp_concat_fn`` /
        ``weight_converter.convert_param`` bound to their other arguments.
        """
        m = _TE_NAME.match(name)
        if m is not None:
            yield from self._yield(m.group("prefix"), int(m.group("j")), tensor, tp_concat, convert)
            return
        g = _GROUPED_NAME.match(name) if self.grouped_mlp else None
        if g is None:
            raise ValueError(f"not a routed-expert weight name: {name}")
        which = int(g.group("which"))
        prefix = f"{g.group('prefix')}.linear_fc{which}"
        for j, block in enumerate(grouped_to_te_experts(tensor, which, self.routing.num_local_experts)):
            yield from self._yield(prefix, j, block, tp_concat, convert)

    def _yield(self, prefix: str, j: int, shard: torch.Tensor, tp_concat: TpConcat,
               convert: Convert) -> Iterator[tuple[str, torch.Tensor]]:
        if not 0 <= j < self.routing.num_local_experts:
            raise ValueError(f"{prefix}.weight{j}: local expert id outside [0, {self.routing.num_local_experts})")
        for expert, shards in self.exchange(shard, j):
            te_name = f"{prefix}.weight{expert}"
            merged = tp_concat(te_name, shards)
            params = merged if isinstance(merged, list) else [merged]
            names, tensors = convert(te_name, params)
            yield from zip(names, [t.detach() for t in tensors], strict=True)


def expert_ids_of(names: Sequence[str]) -> list[int | None]:
    """Global expert id of each HF name (``model.layers.L.mlp.experts.{e}.*``), None for other weights."""
    pat = re.compile(r"\.mlp\.experts\.(\d+)\.")
    return [int(m.group(1)) if (m := pat.search(n)) else None for n in names]
