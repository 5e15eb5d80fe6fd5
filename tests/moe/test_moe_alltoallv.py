"""qwen3_rl.moe_alltoallv (verl seam, weight-sync hook): train -> rollout MoE weight sync with one all-to-allv per
expert tensor.

(a) qwen3_rl.moe.reshard_verl: config parsing, validation errors, routing (every rank receives every ETP shard of
    exactly the experts its vLLM EP rank holds, once), the exchange itself with an in-process all_to_all_single;
(b) the PATCHED verl per_tensor_generator EXECUTED in 4 spawned processes over a real gloo group with megatron-core's
    real parallel state (EP2xETP2, EP2 with two expert-DP replicas, EP4) on a tiny Qwen3-MoE-shaped model, in the
    TEGroupedMLP and GroupedMLP layouts, the hooks built from a rollout config carrying the qwen3_rl group: no hooks
    = pristine verl 0.6.1 output (all experts), moe_alltoallv on = that output restricted to the rank's vLLM experts,
    equal to the true HF weights, no EP/ETP all-gather;
(c) the 235B train command with MOE_ALLTOALLV=True passes patched verl's Hydra config, and the patched
    ActorRolloutRefWorker.rollout_mode hands the seam's weight-sync hooks (vLLM layout inside) to
    per_tensor_generator, and nothing while the feature is off.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from qwen3_rl.moe.reshard import RolloutLayout, rollout_expert_range
from qwen3_rl.moe.reshard_verl import (
    ExpertRouting,
    MoEAlltoallvSync,
    alltoallv_rollout_layout,
    expert_ids_of,
    rollout_layout_from_config,
    sync_receive_counts,
)
from qwen3_rl.trainer.seam import SeamConfigError, WeightSyncHooks

from conftest import free_port, load_module

REPO = Path(__file__).resolve().parents[2]
INTERNAL = REPO / "internal"
LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}


def _rollout_cfg(tp: int = 4, group: dict | None = None, **vllm):
    return OmegaConf.create({"name": "vllm", "mode": "sync", "tensor_model_parallel_size": tp,
                             "data_parallel_size": 1, "expert_parallel_size": 1,
                             "pipeline_model_parallel_size": 1, "engine_kwargs": {"vllm": vllm},
                             "qwen3_rl": group or {}})


A2A_ON = {"moe_alltoallv": {"enable": True}}


# ---------------------------------------------------------------------------------------------- (a) unit
def test_rollout_layout_and_weight_sync_hooks(patched_imports: Path) -> None:
    cfg = _rollout_cfg(data_parallel_size=32, enable_expert_parallel=True)
    assert rollout_layout_from_config(cfg) == RolloutLayout(tp=4, dp=32, expert_parallel=True)
    assert rollout_layout_from_config(_rollout_cfg()) == RolloutLayout(tp=4, dp=1, expert_parallel=False)
    assert alltoallv_rollout_layout(cfg) == RolloutLayout(4, 32, True)
    # off (group empty, feature off, or only other features on): no hooks, per_tensor_generator runs as upstream
    from verl.utils.qwen3_rl_hooks import weight_sync_hooks

    assert WeightSyncHooks.from_rollout_config(cfg) is None and weight_sync_hooks(cfg, uses_bridge=True) is None
    for group in ({"moe_alltoallv": {"enable": False}}, {"disable_gc": {"enable": True}}):
        c = OmegaConf.merge(cfg, {"qwen3_rl": group})
        assert WeightSyncHooks.from_rollout_config(c, uses_bridge=True) is None and weight_sync_hooks(c) is None
    on = OmegaConf.merge(cfg, {"qwen3_rl": A2A_ON})
    hooks = weight_sync_hooks(on)
    assert isinstance(hooks, WeightSyncHooks) and hooks.rollout_layout == RolloutLayout(4, 32, True)
    with pytest.raises(SeamConfigError, match="qwen3_rl.moe_alltoallv needs rollout expert parallel"):
        weight_sync_hooks(_rollout_cfg(group=A2A_ON, data_parallel_size=32))
    with pytest.raises(SeamConfigError, match="^qwen3_rl.moe_alltoallv needs verl's own weight export.*use_mbridge=False"):
        weight_sync_hooks(on, uses_bridge=True)
    with pytest.raises(SeamConfigError, match="qwen3_rl.moe_alltoallv.enable must be bool"):
        weight_sync_hooks(OmegaConf.merge(cfg, {"qwen3_rl": {"moe_alltoallv": {"enable": "yes"}}}))
    with pytest.raises(ValueError, match="mode=sync"):
        rollout_layout_from_config(OmegaConf.merge(cfg, {"mode": "async"}))
    with pytest.raises(ValueError, match="data_parallel_size=1"):
        rollout_layout_from_config(OmegaConf.merge(cfg, {"data_parallel_size": 32}))
    with pytest.raises(ValueError, match="must be a bool"):
        rollout_layout_from_config(_rollout_cfg(enable_expert_parallel="True"))
    # vLLM / vLLM-Ascend settings that move experts away from the linear placement (e.g. ROLLOUT_EPLB)
    for moved, key in (({"enable_eplb": True}, "enable_eplb"),
                       ({"expert_placement_strategy": "round_robin"}, "expert_placement_strategy"),
                       ({"additional_config": {"eplb_config": {"dynamic_eplb": True}}}, "eplb_config.dynamic_eplb"),
                       ({"additional_config": {"eplb_config": {"num_redundant_experts": 128}}}, "num_redundant"),
                       ({"additional_config": {"expert_map_path": "/x.json"}}, "additional_config.expert_map_path"),
                       ({"additional_config": {"mix_placement": True}}, "mix_placement")):
        with pytest.raises(ValueError, match=key):
            rollout_layout_from_config(_rollout_cfg(data_parallel_size=32, enable_expert_parallel=True, **moved))
    # the vLLM default placement passes
    assert rollout_layout_from_config(_rollout_cfg(expert_placement_strategy="linear")).tp == 4


def test_routing_validation_errors() -> None:
    ep4 = RolloutLayout(tp=2, dp=2)
    with pytest.raises(ValueError, match="vLLM expert parallel"):
        ExpertRouting(8, 2, 2, (0, 1, 2, 3), 0, RolloutLayout(2, 2, expert_parallel=False))
    with pytest.raises(ValueError, match="multiple of megatron EP"):
        ExpertRouting(7, 2, 2, (0, 1, 2, 3), 0, ep4)
    with pytest.raises(ValueError, match="vLLM EP=4 > num_experts=2"):
        ExpertRouting(2, 2, 2, (0, 1, 2, 3), 0, ep4)
    with pytest.raises(ValueError, match="expected EP\\*ETP=4"):
        ExpertRouting(8, 2, 2, (0, 1), 0, ep4)
    with pytest.raises(ValueError, match="outside the rollout world"):
        ExpertRouting(8, 2, 2, (4, 5, 6, 7), 0, ep4)


class _FakeMpu:
    def __init__(self, ep: int, etp: int, ep_rank: int, etp_rank: int) -> None:
        self.ep, self.etp, self.ep_rank, self.etp_rank = ep, etp, ep_rank, etp_rank

    def get_expert_model_parallel_world_size(self) -> int:
        return self.ep

    def get_expert_tensor_parallel_world_size(self) -> int:
        return self.etp

    def get_expert_model_parallel_rank(self) -> int:
        return self.ep_rank

    def get_expert_tensor_parallel_rank(self) -> int:
        return self.etp_rank

    def get_expert_tensor_and_model_parallel_group(self) -> str:
        return "group"


def _fake_dist(world: int, rank: int, ranks: list[int]) -> types.SimpleNamespace:
    return types.SimpleNamespace(get_world_size=lambda group=None: world,
                                 get_rank=lambda group=None: ranks.index(rank) if group else rank,
                                 get_process_group_ranks=lambda group: ranks)


def test_from_megatron_checks_world_and_rank_order() -> None:
    ranks = [4, 5, 6, 7]
    sync = MoEAlltoallvSync.from_megatron(_FakeMpu(2, 2, 1, 0), 8, RolloutLayout(2, 4), dist=_fake_dist(8, 6, ranks))
    r = sync.routing
    assert (r.member, r.rank, r.group_ranks, r.num_local_experts) == (2, 6, (4, 5, 6, 7), 4)
    assert list(r.held_experts()) == [6]  # vLLM EP8 over 8 experts
    with pytest.raises(ValueError, match="rollout TP\\*DP=4 != world size 8"):
        MoEAlltoallvSync.from_megatron(_FakeMpu(2, 2, 1, 0), 8, RolloutLayout(2, 2), dist=_fake_dist(8, 6, ranks))
    with pytest.raises(ValueError, match="unexpected megatron expert rank order"):  # ep fastest would be member 1
        MoEAlltoallvSync.from_megatron(_FakeMpu(2, 2, 0, 1), 8, RolloutLayout(2, 4), dist=_fake_dist(8, 6, ranks))
    assert sync.handles("decoder.layers.3.mlp.experts.linear_fc1.weight2")
    assert sync.handles("decoder.layers.3.mlp.experts.linear_fc2.weight0")
    assert not sync.handles("decoder.layers.3.mlp.experts.weight1")  # GroupedMLP only when the model has it
    assert not sync.handles("decoder.layers.3.mlp.shared_experts.linear_fc1.weight")
    assert not sync.handles("decoder.layers.3.mlp.linear_fc1.weight")
    grouped = MoEAlltoallvSync(r, None, grouped_mlp=True)
    assert grouped.handles("decoder.layers.3.mlp.experts.weight1") and grouped.handles("decoder.layers.0.mlp.experts.weight2")
    with pytest.raises(ValueError, match="not a routed-expert weight name"):
        list(sync.sync_params("decoder.layers.3.mlp.router.weight", torch.zeros(1), lambda n, s: s, lambda n, p: ([], [])))


def _expert_grid_groups(world: int, ep: int, etp: int) -> list[tuple[int, ...]]:
    """megatron-core's expert-tensor-and-model-parallel groups (PP=1): blocks of EP*ETP consecutive ranks."""
    return [tuple(range(g, g + ep * etp)) for g in range(0, world, ep * etp)]


@pytest.mark.parametrize("world,ep,etp,E,tp", [(4, 2, 2, 6, 2), (8, 2, 1, 8, 4), (8, 4, 2, 12, 2), (6, 3, 1, 9, 3),
                                               (128, 32, 1, 128, 4)])
def test_routing_receives_exactly_the_held_experts(world: int, ep: int, etp: int, E: int, tp: int) -> None:
    """Over all local expert ids, every rank receives every ETP shard of exactly the experts its vLLM EP rank holds
    (each once, from the member that holds it); the 235B layout (train EP32 -> vLLM EP128) receives 1 of 128."""
    rollout = RolloutLayout(tp=tp, dp=world // tp)
    for ranks in _expert_grid_groups(world, ep, etp):
        for member, g in enumerate(ranks):
            r = ExpertRouting(E, ep, etp, ranks, member, rollout)
            got: dict[int, list[int]] = {}
            for j in range(E // ep):
                for expert, sources in r.received(j):
                    assert expert % (E // ep) == j and expert not in got
                    assert sources == [etp * (expert // (E // ep)) + t for t in range(etp)]  # holders, etp order
                    got[expert] = sources
            assert sorted(got) == list(rollout_expert_range(E, world, g)) == list(r.held_experts())
            upstream, ours = sync_receive_counts(r)
            assert (upstream, ours) == (E * etp, etp * len(r.held_experts()))
            inp, out = r.split_sizes(0, 10)
            assert set(inp) <= {0, 10} and set(out) <= {0, 10}


class _ThreadAllToAll:
    """In-process all_to_all_single over one group of threads (member index = thread index)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list[list[torch.Tensor] | None] = [None] * n

    def for_member(self, me: int):
        def a2a(out, inp, output_split_sizes, input_split_sizes, group=None):
            assert out.numel() == sum(output_split_sizes) and inp.numel() == sum(input_split_sizes)
            self.slots[me] = list(torch.split(inp.clone(), input_split_sizes))
            self.barrier.wait()
            out.copy_(torch.cat([self.slots[s][me] for s in range(self.n)]))
            self.barrier.wait()

        return a2a


def test_exchange_delivers_true_shards_in_process() -> None:
    """MoEAlltoallvSync.exchange on an EP2 x ETP2 group (ranks 4..7 of world 8, vLLM EP8, 12 experts): each member
    gets the true ETP shards of its vLLM experts; the per-tensor sync yields them converted, nothing else."""
    ep, etp, E, F, H = 2, 2, 12, 4, 3
    ranks, rollout = (4, 5, 6, 7), RolloutLayout(tp=2, dp=4)
    full = {e: torch.arange(2 * F * H, dtype=torch.float32).view(2 * F, H) + 100 * e for e in range(E)}

    def shard(e: int, t: int) -> torch.Tensor:  # megatron fc1 ETP shard [gate_t; up_t]
        f = F // etp
        return torch.cat([full[e][t * f:(t + 1) * f], full[e][F + t * f:F + (t + 1) * f]])

    a2a = _ThreadAllToAll(4)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(member: int) -> None:
        try:
            sync = MoEAlltoallvSync(ExpertRouting(E, ep, etp, ranks, member, rollout), None,
                                    all_to_all_single=a2a.for_member(member))
            t, k = member % etp, member // etp
            out = []
            for j in range(E // ep):
                def concat(name, shards):
                    gates, ups = zip(*(s.chunk(2) for s in shards), strict=True)
                    return torch.cat([*gates, *ups])

                out += sync.sync_params(f"decoder.layers.0.mlp.experts.linear_fc1.weight{j}",
                                        shard(k * (E // ep) + j, t), concat, lambda n, p: ([n], p))
            results[member] = out
        except BaseException as exc:  # noqa: B036 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    for member, out in results.items():
        want = list(rollout_expert_range(E, 8, ranks[member]))
        got = [int(n.rsplit("weight", 1)[1]) for n, _ in out]
        assert sorted(got) == want and len(got) == len(want)
        for n, tensor in out:
            assert torch.equal(tensor, full[int(n.rsplit("weight", 1)[1])]), n


# ------------------------------------------------------------------- (b) patched per_tensor_generator (gloo)
_GLOO_CASES = [  # (EP, ETP, experts, vLLM TP, vLLM DP); world 4, megatron TP=PP=1
    (2, 2, 6, 2, 2),  # one EP x ETP group; vLLM EP4 holds 2, 2, 1, 1 experts
    (2, 1, 4, 1, 4),  # two expert-DP replicas (groups {0,1}, {2,3}); vLLM EP4 holds 1 each
    (4, 1, 8, 2, 2),  # EP4: vLLM EP4 holds 2 each, from other ranks only (no expert stays local)
]
_LAYERS, _H, _F = 2, 16, 4
_PRISTINE_ALIAS = "qwen3_rl_t_a2a_mu_pristine"


def _hf_config(E: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=32, hidden_size=_H, intermediate_size=32, num_hidden_layers=_LAYERS,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False,
                          moe_intermediate_size=_F, num_experts=E, num_experts_per_tok=2, decoder_sparse_step=1,
                          mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])


def _hf_experts(E: int) -> dict[str, torch.Tensor]:
    """True HF expert weights, identical on every rank: model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight."""
    g = torch.Generator().manual_seed(7)
    sd = {}
    for i in range(_LAYERS):
        for e in range(E):
            p = f"model.layers.{i}.mlp.experts.{e}."
            sd[p + "gate_proj.weight"] = torch.randn(_F, _H, generator=g)
            sd[p + "up_proj.weight"] = torch.randn(_F, _H, generator=g)
            sd[p + "down_proj.weight"] = torch.randn(_H, _F, generator=g)
    return sd


def _node(**children) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in children.items():
        setattr(m, k, v)
    return m


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.clone(), requires_grad=False)


def _model(cfg, experts) -> torch.nn.Module:
    """megatron GPTModel parameter names of a Qwen3-MoE (TP=1), random non-expert weights (same on all ranks),
    ``experts(layer)`` -> the experts module of this rank."""
    g = torch.Generator().manual_seed(3)
    H, hd, nh, kv, E, V = _H, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_experts, 32

    def rnd(*shape: int, tp_dim: int | None = None) -> torch.nn.Parameter:
        p = _param(torch.randn(*shape, generator=g))
        if tp_dim is not None:  # megatron's parallel linears mark their weights (verl's TP path keys on it)
            p.tensor_model_parallel, p.partition_dim = True, tp_dim
        return p

    layers = torch.nn.ModuleList(
        _node(self_attention=_node(linear_qkv=_node(layer_norm_weight=rnd(H),
                                                    weight=rnd((nh + 2 * kv) * hd, H, tp_dim=0)),
                                   q_layernorm=_node(weight=rnd(hd)), k_layernorm=_node(weight=rnd(hd)),
                                   linear_proj=_node(weight=rnd(H, nh * hd, tp_dim=1))),
              pre_mlp_layernorm=_node(weight=rnd(H)),
              mlp=_node(router=_node(weight=rnd(E, H)), experts=experts(i)))
        for i in range(_LAYERS))
    return _node(embedding=_node(word_embeddings=_node(weight=rnd(V, H, tp_dim=0))),
                 decoder=_node(layers=layers, final_layernorm=_node(weight=rnd(H))),
                 output_layer=_node(weight=rnd(V, H, tp_dim=0)))


def _te_experts(sd, layer: int, experts: range, etp: int, t: int) -> torch.nn.Module:
    """TEGroupedMLP of one rank: linear_fc1.weight{j} = [gate_t; up_t] [2F/ETP, H], linear_fc2.weight{j} [H, F/ETP]."""
    f = _F // etp
    sl = slice(t * f, (t + 1) * f)
    p = f"model.layers.{layer}.mlp.experts."
    fc1 = {f"weight{j}": _param(torch.cat([sd[f"{p}{e}.gate_proj.weight"][sl], sd[f"{p}{e}.up_proj.weight"][sl]]))
           for j, e in enumerate(experts)}
    fc2 = {f"weight{j}": _param(sd[f"{p}{e}.down_proj.weight"][:, sl]) for j, e in enumerate(experts)}
    return _node(linear_fc1=_node(**fc1), linear_fc2=_node(**fc2))


def _grouped_experts(sd, layer: int, experts: range, etp: int, t: int) -> torch.nn.Module:
    from qwen3_rl.moe.fused_experts import hf_layer_experts_to_grouped

    w1, w2 = hf_layer_experts_to_grouped(sd, layer, experts, etp, t)
    return _node(weight1=_param(w1), weight2=_param(w2))


def _same(a: list, b: list) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True))


def _gloo_case(rank: int, world: int, case: tuple[int, int, int, int, int], mu, mu0, calls: dict[str, int]):
    """One layout on this rank (megatron parallel state initialised by the caller); returns a summary."""
    from megatron.core import parallel_state as mpu
    from verl.models.mcore import hf_to_mcore_config
    from verl.models.mcore.weight_converter import McoreToHFWeightConverterQwen2Moe

    ep, etp, E, vtp, vdp = case
    cfg, sd = _hf_config(E), _hf_experts(E)
    tf = hf_to_mcore_config(cfg, torch.float32)
    tf_grouped = hf_to_mcore_config(cfg, torch.float32, moe_use_legacy_grouped_gemm=True)
    conv = McoreToHFWeightConverterQwen2Moe(cfg, tf)
    ep_r, t = mpu.get_expert_model_parallel_rank(), mpu.get_expert_tensor_parallel_rank()
    mine = range(ep_r * (E // ep), (ep_r + 1) * (E // ep))
    te = _model(cfg, lambda i: _te_experts(sd, i, mine, etp, t))
    grouped = _model(cfg, lambda i: _grouped_experts(sd, i, mine, etp, t))
    layout = RolloutLayout(tp=vtp, dp=vdp)
    # the seam's weight-sync hooks, built from rollout configs carrying the qwen3_rl group (as rollout_mode does)
    a2a_hooks = WeightSyncHooks.from_rollout_config(
        _rollout_cfg(tp=vtp, group=A2A_ON, data_parallel_size=vdp, enable_expert_parallel=True))
    grouped_hooks = WeightSyncHooks.from_rollout_config(
        _rollout_cfg(tp=vtp, group={"grouped_mlp_weights": {"enable": True}}, data_parallel_size=vdp,
                     enable_expert_parallel=True))
    assert a2a_hooks.rollout_layout == layout
    # grouped_mlp_weights claims nothing on a TEGroupedMLP model (verl's own EP path stays)
    assert grouped_hooks.expert_sync(mpu, tf) is None

    def run(gen, model, tfc, **kw):
        before = dict(calls)
        out = list(gen([model], cfg, conv, tfc, LAYER_NAME_MAPPING, **kw))
        return out, {k: calls[k] - before[k] for k in calls}

    pristine, _ = run(mu0.per_tensor_generator, te, tf)
    off, off_calls = run(mu.per_tensor_generator, te, tf)
    off_none, _ = run(mu.per_tensor_generator, te, tf, qwen3_rl_hooks=None)
    on, on_calls = run(mu.per_tensor_generator, te, tf, qwen3_rl_hooks=a2a_hooks)
    g_off, _ = run(mu.per_tensor_generator, grouped, tf_grouped, qwen3_rl_hooks=grouped_hooks)
    g_on, g_calls = run(mu.per_tensor_generator, grouped, tf_grouped, qwen3_rl_hooks=a2a_hooks)
    held = set(rollout_expert_range(E, world, rank))
    # switch off: the pristine verl 0.6.1 stream (every expert of every layer on every rank)
    assert _same(off, pristine) and _same(off_none, pristine), "no hooks differs from pristine verl"
    assert sorted({e for e in expert_ids_of([n for n, _ in off]) if e is not None}) == list(range(E))
    # switch on: the same stream with the other ranks' experts left out, in the same order
    keep = [x for x, e in zip(off, expert_ids_of([n for n, _ in off]), strict=True) if e is None or e in held]
    assert _same(on, keep), "switch on is not the upstream stream restricted to the held experts"
    got = {n: x for n, x in on if ".mlp.experts." in n}
    want = {n: x for n, x in sd.items() if int(n.split(".")[5]) in held}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    # GroupedMLP layout: grouped_mlp_weights = the all-gather stream of every expert (= the TE one); moe_alltoallv
    # = the TE switch-on stream exactly
    assert _same(g_off, off), "GroupedMLP all-gather stream differs from the TEGroupedMLP one"
    g_keep = [x for x, e in zip(g_off, expert_ids_of([n for n, _ in g_off]), strict=True) if e is None or e in held]
    assert _same(g_on, g_keep) and _same(g_on, on), "GroupedMLP switch on"
    # communication: no EP/ETP all-gather with the switch on (TP=PP=1: nothing else gathers);
    # one all-to-allv per expert tensor, receiving the ETP shards of the held experts only
    n_tensors = _LAYERS * 2 * (E // ep)
    shard_numel = 2 * _F * _H // etp + _H * _F // etp  # fc1 + fc2 shard, per expert and layer
    assert on_calls["all_gather"] == 0 and g_calls["all_gather"] == 0, (on_calls, g_calls)
    assert on_calls["a2a"] == g_calls["a2a"] == n_tensors
    assert on_calls["a2a_numel"] == g_calls["a2a_numel"] == _LAYERS * len(held) * etp * shard_numel
    assert off_calls["a2a"] == 0 and off_calls["all_gather"] > 0
    return len(held), len(got), on_calls["a2a_numel"], len(off), len(on)


_INHERITED_GROUPS: list = []  # forked ranks: process groups inherited from the parent, never destroyed here


def _gloo_worker(rank: int, world: int, port: int, pristine_utils: str, results) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu0

    # A forked rank inherits the parent's megatron globals. megatron-core 0.12.1's destroy_model_parallel does
    # not reset every group global (e.g. _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO), so when an earlier
    # test of this pytest process initialised megatron, initialize_model_parallel here would drop the parent's
    # gloo group and its destructor would join threads that do not exist after fork (hang). Keep such objects
    # alive instead (the forked child leaves with os._exit, no destructors run).
    for name, value in list(vars(mpu0).items()):
        if isinstance(value, dist.ProcessGroup):
            _INHERITED_GROUPS.append(value)
            setattr(mpu0, name, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        import verl.utils.megatron_utils as mu
        from megatron.core import parallel_state as mpu

        mu0 = sys.modules.get(_PRISTINE_ALIAS) or load_module(Path(pristine_utils), _PRISTINE_ALIAS)  # forked: loaded
        calls = {"a2a": 0, "a2a_numel": 0, "all_gather": 0}
        real_a2a, real_ag = dist.all_to_all_single, dist.all_gather

        def a2a(out, inp, *args, **kwargs):
            calls["a2a"] += 1
            calls["a2a_numel"] += out.numel()
            return real_a2a(out, inp, *args, **kwargs)

        def all_gather(out, inp, *args, **kwargs):
            calls["all_gather"] += 1
            return real_ag(out, inp, *args, **kwargs)

        dist.all_to_all_single, dist.all_gather = a2a, all_gather
        summary = []
        for case in _GLOO_CASES:
            ep, etp = case[:2]
            mpu.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
            try:
                summary.append(_gloo_case(rank, world, case, mu, mu0, calls))
            finally:
                mpu.destroy_model_parallel()
        results[rank] = summary
    finally:
        dist.destroy_process_group()


def test_patched_per_tensor_generator_gloo_4_ranks(patched_imports: Path, pristine_workspace: Path) -> None:
    # import the patched verl / megatron (and pristine megatron_utils) once here; the 4 forked ranks inherit them
    import megatron.core.parallel_state  # noqa: F401
    import torch.multiprocessing as mp
    import verl.models.mcore.weight_converter  # noqa: F401
    import verl.utils.megatron_utils as mu

    assert Path(mu.__file__).is_relative_to(patched_imports)
    pristine_utils = str(pristine_workspace / "verl" / "verl" / "utils" / "megatron_utils.py")
    if _PRISTINE_ALIAS not in sys.modules:
        load_module(Path(pristine_utils), _PRISTINE_ALIAS)
    port = free_port()
    world = 4
    with mp.Manager() as manager:
        results = manager.dict()
        ctx = mp.start_processes(_gloo_worker, args=(world, port, pristine_utils, results), nprocs=world,
                                 join=False, start_method="fork")
        deadline = time.monotonic() + 300
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                pytest.fail("gloo ranks did not finish within 300 s (hang)")
        res = dict(results)
    assert sorted(res) == list(range(world))
    for rank, summary in res.items():
        assert len(summary) == len(_GLOO_CASES)
        for (_, _, E, _, _), (n_held, n_expert_tensors, numel, n_off, n_on) in zip(_GLOO_CASES, summary,
                                                                                   strict=True):
            assert n_held == len(rollout_expert_range(E, world, rank)) >= 1
            assert n_expert_tensors == _LAYERS * 3 * n_held  # gate, up, down per held expert and layer
            assert n_off - n_on == _LAYERS * 3 * (E - n_held)
            assert numel == _LAYERS * n_held * 3 * _F * _H  # every held expert's weights once, nothing more


# ------------------------------------------------------------------------------ (c) train script -> worker
def test_train_script_switch_reaches_the_worker(patched_imports: Path, monkeypatch) -> None:
    import asyncio

    import verl.workers.megatron_workers as mw
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from qwen3_rl.tools.launch import parse_train_script

    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"

    def composed(script: str, extra: dict[str, str], *more: str):
        cmd = parse_train_script(INTERNAL / script, env={**env, **extra})
        assert cmd.config_name == "ppo_megatron_trainer"
        with initialize_config_dir(config_dir=str(verl_config_dir), version_base=None):
            return cmd, compose(config_name=cmd.config_name, overrides=[*cmd.overrides, *more])

    moe = "train_grpo_qwen3_235b_128die_true_weight.sh"
    cmd_off, cfg_off = composed(moe, {})
    assert "+qwen3_rl.moe_alltoallv.enable=False" in cmd_off.overrides
    cmd_on, cfg_on = composed(moe, {"MOE_ALLTOALLV": "True"})
    assert "+qwen3_rl.moe_alltoallv.enable=True" in cmd_on.overrides
    # the workers read the group through the rollout's interpolation of the root group
    assert cfg_on.actor_rollout_ref.rollout.qwen3_rl.moe_alltoallv.enable is True
    assert cfg_off.actor_rollout_ref.rollout.qwen3_rl.moe_alltoallv.enable is False
    rollout = omega_conf_to_dataclass(cfg_on.actor_rollout_ref.rollout)
    assert isinstance(rollout, RolloutConfig) and rollout.qwen3_rl["moe_alltoallv"] == {"enable": True}
    with pytest.raises(ConfigCompositionException):  # the old actor key is gone (declared keys only)
        composed(moe, {}, "actor_rollout_ref.actor.moe_alltoallv=True")
    with pytest.raises(SeamConfigError, match="qwen3_rl.moe_alltoalv: unknown feature"):  # a typo stops in one line
        WeightSyncHooks.from_rollout_config(composed(moe, {}, "+qwen3_rl.moe_alltoalv.enable=True")[1]
                                            .actor_rollout_ref.rollout)
    with pytest.raises(Exception, match="error: MOE_ALLTOALLV=.true.: expected one of True, False"):
        parse_train_script(INTERNAL / moe, env={**env, "MOE_ALLTOALLV": "true"})
    dense = parse_train_script(INTERNAL / "train_grpo_qwen3_32b_32die_true_weight.sh", env=env)
    assert not any("moe_alltoallv" in o for o in dense.overrides)

    # EXECUTE the patched rollout_mode on a stand-in worker with the composed config: what reaches the generator
    seen: list[dict] = []

    def fake_generator(*args, **kwargs):
        seen.append(kwargs)
        yield from ()

    class Rollout:
        async def resume(self, tags):
            pass

        async def update_weights(self, weights):
            list(weights)

    monkeypatch.setattr(mw, "per_tensor_generator", fake_generator)
    monkeypatch.setattr(mw, "aggressive_empty_cache", lambda **_: None)
    monkeypatch.setattr(mw, "set_expandable_segments", lambda _: None)
    monkeypatch.setattr(mw, "get_torch_device", lambda: types.SimpleNamespace(
        get_rng_state=lambda: None, set_rng_state=lambda _: None))
    with initialize_config_dir(config_dir=str(verl_config_dir), version_base=None):
        cfg_empty = compose(config_name="ppo_megatron_trainer")  # the group empty: nothing of ours is built
    assert cfg_empty.actor_rollout_ref.rollout.qwen3_rl == {}
    for cfg in (cfg_empty, cfg_off, cfg_on):
        worker = types.SimpleNamespace(
            config=cfg.actor_rollout_ref, _is_offload_param=False, bridge=None, rollout=Rollout(),
            actor=types.SimpleNamespace(actor_module=[]), actor_model_config=None, weight_converter=None,
            tf_config=None, layer_name_mapping={}, gen_random_states=None)
        asyncio.run(mw.ActorRolloutRefWorker.rollout_mode(worker))
    assert seen[0] == seen[1] == {}  # group empty / feature off: the upstream call, no extra argument
    (hooks,) = seen[2].values()
    assert isinstance(hooks, WeightSyncHooks) and hooks.rollout_layout == RolloutLayout(tp=4, dp=32,
                                                                                        expert_parallel=True)
    # mbridge export with the feature on is refused at the weight sync (it never calls per_tensor_generator)
    bridged = types.SimpleNamespace(**{**vars(worker), "bridge": object()})
    with pytest.raises(SeamConfigError, match="use_mbridge=False"):
        asyncio.run(mw.ActorRolloutRefWorker.rollout_mode(bridged))
    # refused combinations: the train script stops before anything loads ...
    with pytest.raises(Exception, match="MOE_ALLTOALLV=True excludes ROLLOUT_EPLB=True"):
        parse_train_script(INTERNAL / moe, env={**env, "MOE_ALLTOALLV": "True", "ROLLOUT_EPLB": "True"})
    with pytest.raises(Exception, match="MOE_ALLTOALLV=True requires ROLLOUT_ENABLE_EP=True"):
        parse_train_script(INTERNAL / moe, env={**env, "MOE_ALLTOALLV": "True", "ROLLOUT_ENABLE_EP": "False"})
    # ... and a hand-written command gets the reason at the weight sync
    eplb_key = "+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config.dynamic_eplb=True"
    _, cfg_eplb = composed(moe, {"MOE_ALLTOALLV": "True"}, eplb_key)
    worker.config = cfg_eplb.actor_rollout_ref
    with pytest.raises(ValueError, match="eplb_config.dynamic_eplb"):
        asyncio.run(mw.ActorRolloutRefWorker.rollout_mode(worker))
    _, cfg_no_ep = composed(moe, {"MOE_ALLTOALLV": "True"},
                            "++actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel=False")
    worker.config = cfg_no_ep.actor_rollout_ref
    with pytest.raises(ValueError, match="needs rollout expert parallel"):
        asyncio.run(mw.ActorRolloutRefWorker.rollout_mode(worker))
