"""GroupedMLP weight1/weight2 (verl seam: ``qwen3_rl.grouped_mlp_weights`` weight-sync hook, converter flag)
executed on CPU: the patched ``scripts/converter_hf_to_mcore.py --moe_use_legacy_grouped_gemm`` (qwen3_rl imported
lazily, only with the flag) fills a real megatron-core ``GroupedMLP`` from a tiny random Qwen3-MoE, the checkpoint
view of it is the standard per-expert one, and the patched weight sync (``per_tensor_generator`` with the seam's
hooks; EP x ETP gathers simulated by threads for EP/ETP 2) gives back every HF tensor exactly. Without hooks,
TEGroupedMLP-style and dense states: byte-identical to pristine verl 0.6.1."""

from __future__ import annotations

import ast
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from qwen3_rl.moe.fused_experts import grouped_to_hf, hf_layer_experts_to_grouped
from qwen3_rl.moe.fused_experts_verl import (
    GroupedMLPGatherSync,
    grouped_mlp_weights_enabled,
    is_grouped_mlp_param,
)
from qwen3_rl.trainer.seam import WeightSyncHooks

from conftest import load_module

LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}
SCRIPT = "scripts/converter_hf_to_mcore.py"
MEGATRON_UTILS = "verl/utils/megatron_utils.py"


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def world(patched_imports: Path, pristine_workspace: Path, tmp_path_factory: pytest.TempPathFactory):
    """gloo world of 1 + megatron parallel state (TP=PP=EP=ETP=1); patched and pristine modules."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("fe_dist") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1)
    mods = {
        "script": load_module(patched_imports / "verl" / SCRIPT, "qwen3_rl_t_conv_patched"),
        "script0": load_module(pristine_workspace / "verl" / SCRIPT, "qwen3_rl_t_conv_pristine"),
        "mu0": load_module(pristine_workspace / "verl" / MEGATRON_UTILS, "qwen3_rl_t_mu_pristine"),
    }
    import verl.utils.megatron_utils as mu

    mods["mu"] = mu
    assert Path(mu.__file__).is_relative_to(patched_imports)
    yield mods
    mpu.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def _tiny_cfg(moe: bool):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    if moe:
        return Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                              decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])
    return Qwen3Config(**common, architectures=["Qwen3ForCausalLM"])


@pytest.fixture(scope="module")
def hf_moe(world):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(_tiny_cfg(True)).eval()


@pytest.fixture(scope="module")
def tf_configs(world, hf_moe):
    from verl.models.mcore import hf_to_mcore_config

    on = hf_to_mcore_config(hf_moe.config, torch.float32, moe_use_legacy_grouped_gemm=True)
    off = hf_to_mcore_config(hf_moe.config, torch.float32)
    on.use_cpu_initialization = True
    on.perform_initialization = False
    return on, off


# --------------------------------------------------------------------- megatron-shaped module skeletons
def _node(**children) -> nn.Module:
    m = nn.Module()
    for k, v in children.items():
        setattr(m, k, v)
    return m


def _p(*shape: int, tp_dim: int | None = None) -> nn.Parameter:
    """A zero parameter; ``tp_dim`` marks it TP-split as megatron's parallel linears do."""
    p = nn.Parameter(torch.zeros(*shape))
    if tp_dim is not None:
        p.tensor_model_parallel, p.partition_dim = True, tp_dim
    return p


def _attention(cfg) -> nn.Module:
    H, hd, nh, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    return _node(linear_qkv=_node(layer_norm_weight=_p(H), weight=_p((nh + 2 * kv) * hd, H, tp_dim=0)),
                 q_layernorm=_node(weight=_p(hd)), k_layernorm=_node(weight=_p(hd)),
                 linear_proj=_node(weight=_p(H, nh * hd, tp_dim=1)))


def _te_experts(cfg) -> nn.Module:
    """TEGroupedMLP parameter names: linear_fc1.weight{e} [2F, H], linear_fc2.weight{e} [H, F]."""
    E, F, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return _node(linear_fc1=_node(**{f"weight{e}": _p(2 * F, H, tp_dim=0) for e in range(E)}),
                 linear_fc2=_node(**{f"weight{e}": _p(H, F, tp_dim=1) for e in range(E)}))


def _grouped_experts(cfg, tf) -> nn.Module:
    """The real megatron-core 0.12.1 GroupedMLP (grouped_gemm's availability check lifted: CPU, no forward)."""
    import megatron.core.transformer.moe.grouped_gemm_util as gg
    from megatron.core.transformer.moe.experts import GroupedMLP

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gg, "assert_grouped_gemm_is_available", lambda: None)
        return GroupedMLP(cfg.num_experts, tf)


def _model(cfg, mlp: Callable[[], nn.Module]) -> nn.Module:
    V, H = cfg.vocab_size, cfg.hidden_size
    layers = nn.ModuleList(_node(self_attention=_attention(cfg), **mlp()) for _ in range(cfg.num_hidden_layers))
    return _node(embedding=_node(word_embeddings=_node(weight=_p(V, H, tp_dim=0))),
                 decoder=_node(layers=layers, final_layernorm=_node(weight=_p(H))),
                 output_layer=_node(weight=_p(V, H, tp_dim=0)))


def _moe_model(cfg, experts: Callable[[], nn.Module]) -> nn.Module:
    E, H = cfg.num_experts, cfg.hidden_size
    return _model(cfg, lambda: dict(pre_mlp_layernorm=_node(weight=_p(H)),
                                    mlp=_node(router=_node(weight=_p(E, H)), experts=experts())))


def _grouped_hooks() -> WeightSyncHooks:
    """The seam's weight-sync hooks as a rollout config carrying ``qwen3_rl.grouped_mlp_weights.enable`` gives them."""
    hooks = WeightSyncHooks.from_rollout_config({"qwen3_rl": {"grouped_mlp_weights": {"enable": True}}})
    assert hooks is not None
    return hooks


def _sync(mu: ModuleType, model: nn.Module, hf_cfg, tf, converter,
          hooks: WeightSyncHooks | None = None) -> list[tuple[str, torch.Tensor]]:
    kw = {} if hooks is None else {"qwen3_rl_hooks": hooks}
    return list(mu.per_tensor_generator([model], hf_cfg, converter, tf, LAYER_NAME_MAPPING, **kw))


def _assert_same_stream(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (n, x), (_, y) in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), n


def _assert_is_hf(stream: list[tuple[str, torch.Tensor]], hf_sd: dict[str, torch.Tensor]) -> None:
    """The synced (name, tensor) pairs are exactly the HF state dict: every key once, every tensor equal."""
    names = [n for n, _ in stream]
    assert len(names) == len(set(names)) and set(names) == set(hf_sd)
    for n, t in stream:
        assert t.shape == hf_sd[n].shape and torch.equal(t, hf_sd[n]), n


# ------------------------------------------------------------------------------------- HF -> Megatron
@pytest.fixture(scope="module")
def converted(world, hf_moe, tf_configs):
    """Patched script (switch on: GroupedMLP) and pristine script (TEGroupedMLP) on the same HF model."""
    on, _ = tf_configs
    cfg = hf_moe.config
    grouped = _moe_model(cfg, lambda: _grouped_experts(cfg, on))
    te_ref = _moe_model(cfg, lambda: _te_experts(cfg))
    n_on = world["script"].convert_checkpoint_from_transformers_to_megatron(hf_moe, grouped, cfg,
                                                                            grouped_mlp_weights=True)
    n_ref = world["script0"].convert_checkpoint_from_transformers_to_megatron(hf_moe, te_ref, cfg)
    return grouped, te_ref, n_on, n_ref


def test_switch_follows_transformer_config(tf_configs) -> None:
    on, off = tf_configs
    assert on.moe_grouped_gemm and on.moe_use_legacy_grouped_gemm and grouped_mlp_weights_enabled(on)
    assert off.moe_grouped_gemm and not grouped_mlp_weights_enabled(off)  # verl's Qwen3-MoE default: TEGroupedMLP
    # MindSpeed's all-to-all overlap builds GroupedMLP experts too; the keys arrive through override dicts
    assert grouped_mlp_weights_enabled({"moe_grouped_gemm": True, "moe_alltoall_overlap_comm": True})
    assert not grouped_mlp_weights_enabled({"moe_alltoall_overlap_comm": True})  # needs grouped gemm
    assert not grouped_mlp_weights_enabled(None)
    assert is_grouped_mlp_param("decoder.layers.3.mlp.experts.weight1")
    assert not is_grouped_mlp_param("decoder.layers.3.mlp.experts.linear_fc1.weight1")
    assert not is_grouped_mlp_param("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight")


def test_converter_script_fills_grouped_mlp_exactly(world, hf_moe, converted) -> None:
    grouped, te_ref, n_on, n_ref = converted
    cfg, sd = hf_moe.config, hf_moe.state_dict()
    assert n_on == n_ref == hf_moe.num_parameters()  # the script's numel accounting still closes
    g_sd, ref_sd = grouped.state_dict(), te_ref.state_dict()
    experts = [k for k in g_sd if ".mlp.experts." in k]
    assert sorted(experts) == sorted(f"decoder.layers.{i}.mlp.experts.weight{w}"
                                     for i in range(cfg.num_hidden_layers) for w in (1, 2))
    for k in g_sd.keys() - set(experts):  # attention, norms, router, embeddings: as the pristine script
        assert torch.equal(g_sd[k], ref_sd[k]), k
    E = cfg.num_experts
    for i in range(cfg.num_hidden_layers):
        ex = grouped.decoder.layers[i].mlp.experts
        w1, w2 = hf_layer_experts_to_grouped(sd, i, range(E))
        assert torch.equal(ex.weight1, w1) and torch.equal(ex.weight2, w2)
        gates, ups, downs = grouped_to_hf(ex.weight1.detach(), ex.weight2.detach(), E)
        for e in range(E):
            p = f"model.layers.{i}.mlp.experts.{e}"
            assert torch.equal(gates[e], sd[f"{p}.gate_proj.weight"]) and torch.equal(ups[e], sd[f"{p}.up_proj.weight"])
            assert torch.equal(downs[e], sd[f"{p}.down_proj.weight"])


def test_saved_checkpoint_view_is_per_expert_hf(world, hf_moe, converted) -> None:
    """What the script hands to dist_checkpointing.save for the experts (GroupedMLP.sharded_state_dict, built):
    the SequentialMLP-compatible tensors experts.linear_fc1.weight [E, 2F, H] / linear_fc2.weight [E, H, F]."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    grouped = converted[0]
    cfg, sd = hf_moe.config, hf_moe.state_dict()
    for i in range(cfg.num_hidden_layers):
        prefix = f"decoder.layers.{i}.mlp."
        ssd = grouped.decoder.layers[i].mlp.experts.sharded_state_dict(prefix=prefix)
        full: dict[str, torch.Tensor] = {}
        for name in ("weight1", "weight2"):
            factory = ssd[f"{prefix}{name}"]
            assert isinstance(factory, ShardedTensorFactory)
            built = factory.build()
            for sh in built if isinstance(built, list) else [built]:
                assert isinstance(sh, ShardedTensor)
                buf = full.setdefault(sh.key, torch.full(sh.global_shape, float("nan")))
                idx = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.local_shape, strict=True))
                buf[idx] = sh.data.view(sh.local_shape)
        fc1, fc2 = full[f"{prefix}experts.linear_fc1.weight"], full[f"{prefix}experts.linear_fc2.weight"]
        for e in range(cfg.num_experts):
            p = f"model.layers.{i}.mlp.experts.{e}"
            assert torch.equal(fc1[e], torch.cat([sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"]]))
            assert torch.equal(fc2[e], sd[f"{p}.down_proj.weight"])


def test_converter_script_switch_off_and_dense_paths_unchanged(world, hf_moe, converted) -> None:
    cfg = hf_moe.config
    te = _moe_model(cfg, lambda: _te_experts(cfg))
    n = world["script"].convert_checkpoint_from_transformers_to_megatron(hf_moe, te, cfg)  # switch default: off
    assert n == converted[3]
    ref_sd = converted[1].state_dict()
    te_sd = te.state_dict()
    assert te_sd.keys() == ref_sd.keys()
    for k, v in te_sd.items():
        assert torch.equal(v, ref_sd[k]), k
    # the other converters (dense loader call, Qwen2.5-VL, DeepSeek-V3, test_conversion) are the pristine code
    trees = {k: ast.parse(Path(world[k].__file__).read_text()) for k in ("script", "script0")}
    funcs = {k: {f.name: f for f in t.body if isinstance(f, ast.FunctionDef)} for k, t in trees.items()}
    assert funcs["script"].keys() == funcs["script0"].keys()
    changed = {n for n in funcs["script0"] if ast.dump(funcs["script"][n]) != ast.dump(funcs["script0"][n])}
    assert changed == {"_init_args", "convert_checkpoint_from_transformers_to_megatron", "convert_hf_to_mcore"}
    # nothing of the recipe at module level: the package is imported inside the flag's branch only
    top = [ast.dump(n) for n in trees["script"].body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert top and not any("qwen3_rl" in d for d in top)
    lazy = [n for n in ast.walk(funcs["script"]["convert_checkpoint_from_transformers_to_megatron"])
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("qwen3_rl")]
    assert [n.module for n in lazy] == ["qwen3_rl.moe.fused_experts_verl"]

    def dense_branch(f: ast.FunctionDef) -> str:
        calls = [ast.dump(c) for c in ast.walk(f) if isinstance(c, ast.Call)
                 and getattr(c.func, "id", "") == "load_state_dict_to_megatron_gptmodel"]
        assert len(calls) == 1
        return calls[0]

    assert dense_branch(funcs["script"]["convert_hf_to_mcore"]) == dense_branch(funcs["script0"]["convert_hf_to_mcore"])


def test_converter_script_cli_flag(world, monkeypatch) -> None:
    script = world["script"]
    monkeypatch.setattr(sys, "argv", ["x", "--hf_model_path", "a", "--output_path", "b"])
    assert script._init_args().moe_use_legacy_grouped_gemm is False
    monkeypatch.setattr(sys, "argv", ["x", "--hf_model_path", "a", "--output_path", "b", "--moe_use_legacy_grouped_gemm"])
    assert script._init_args().moe_use_legacy_grouped_gemm is True


# ------------------------------------------------------------------------------------- Megatron -> HF
def test_weight_sync_grouped_mlp_full_model_exact(world, hf_moe, tf_configs, converted) -> None:
    """Real patched per_tensor_generator (EP=ETP=1) on the GroupedMLP model the patched script filled."""
    from verl.models.mcore.weight_converter import McoreToHFWeightConverterQwen2Moe

    on, off = tf_configs
    conv = McoreToHFWeightConverterQwen2Moe(hf_moe.config, off)  # as get_mcore_weight_converter: no overrides
    stream = _sync(world["mu"], converted[0], hf_moe.config, on, conv, _grouped_hooks())
    _assert_is_hf(stream, hf_moe.state_dict())
    # positive control: without the hook the GroupedMLP weights take upstream's dense path and fail there
    with pytest.raises(NotImplementedError):
        _sync(world["mu"], converted[0], hf_moe.config, on, conv)
    # the same model's stream with the TEGroupedMLP layout from pristine verl: same names, order and tensors
    _assert_same_stream(stream, _sync(world["mu0"], converted[1], hf_moe.config, off, conv))


@pytest.mark.parametrize("switch", [False, True])
def test_weight_sync_te_layout_byte_identical_to_pristine(world, hf_moe, tf_configs, converted, switch) -> None:
    from verl.models.mcore.weight_converter import McoreToHFWeightConverterQwen2Moe

    on, off = tf_configs
    conv = McoreToHFWeightConverterQwen2Moe(hf_moe.config, off)
    te = converted[1]
    got = _sync(world["mu"], te, hf_moe.config, on if switch else off, conv, _grouped_hooks() if switch else None)
    _assert_same_stream(got, _sync(world["mu0"], te, hf_moe.config, off, conv))
    _assert_is_hf(got, hf_moe.state_dict())


@pytest.mark.parametrize("switch", [False, True])
def test_weight_sync_dense_qwen3_byte_identical_to_pristine(world, switch) -> None:
    from transformers import Qwen3ForCausalLM
    from verl.models.mcore import hf_to_mcore_config
    from verl.models.mcore.weight_converter import McoreToHFWeightConverterDense

    torch.manual_seed(1)
    hf = Qwen3ForCausalLM(_tiny_cfg(False)).eval()
    cfg, sd = hf.config, hf.state_dict()
    H = cfg.hidden_size
    over = {"moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True} if switch else {}
    tf = hf_to_mcore_config(cfg, torch.float32, **over)
    assert grouped_mlp_weights_enabled(tf) is switch
    model = _model(cfg, lambda: dict(mlp=_node(linear_fc1=_node(layer_norm_weight=_p(H),
                                                                weight=_p(2 * cfg.intermediate_size, H, tp_dim=0)),
                                                linear_fc2=_node(weight=_p(H, cfg.intermediate_size, tp_dim=1)))))
    with torch.no_grad():  # megatron layout of a dense Qwen3 (as verl's loader writes it)
        model.embedding.word_embeddings.weight.copy_(sd["model.embed_tokens.weight"])
        model.output_layer.weight.copy_(sd["lm_head.weight"])
        model.decoder.final_layernorm.weight.copy_(sd["model.norm.weight"])
        kv, hd = cfg.num_key_value_heads, cfg.head_dim
        for i, layer in enumerate(model.decoder.layers):
            p = f"model.layers.{i}."
            q = sd[p + "self_attn.q_proj.weight"].view(kv, -1, H)
            k, v = (sd[p + f"self_attn.{x}_proj.weight"].view(kv, hd, H) for x in "kv")
            layer.self_attention.linear_qkv.weight.copy_(torch.cat([q, k, v], 1).view(-1, H))
            layer.self_attention.linear_qkv.layer_norm_weight.copy_(sd[p + "input_layernorm.weight"])
            layer.self_attention.q_layernorm.weight.copy_(sd[p + "self_attn.q_norm.weight"])
            layer.self_attention.k_layernorm.weight.copy_(sd[p + "self_attn.k_norm.weight"])
            layer.self_attention.linear_proj.weight.copy_(sd[p + "self_attn.o_proj.weight"])
            layer.mlp.linear_fc1.layer_norm_weight.copy_(sd[p + "post_attention_layernorm.weight"])
            layer.mlp.linear_fc1.weight.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            layer.mlp.linear_fc2.weight.copy_(sd[p + "mlp.down_proj.weight"])
    conv = McoreToHFWeightConverterDense(cfg, tf)
    got = _sync(world["mu"], model, cfg, tf, conv, _grouped_hooks() if switch else None)
    _assert_same_stream(got, _sync(world["mu0"], model, cfg, tf, conv))
    _assert_is_hf(got, sd)


class _ThreadGroups:
    """In-process stand-in for torch.distributed.all_gather over the EP and expert-TP groups of an
    EP x ETP grid, one thread per rank (every rank must issue the same gathers in the same order)."""

    def __init__(self, ep: int, etp: int) -> None:
        self.ep, self.etp = ep, etp
        self._groups: dict[tuple[str, int], tuple[threading.Barrier, list]] = {}
        for t in range(etp):
            self._groups["ep", t] = (threading.Barrier(ep, timeout=30), [None] * ep)
        for r in range(ep):
            self._groups["etp", r] = (threading.Barrier(etp, timeout=30), [None] * etp)

    def gather(self, kind: str, group: int, me: int) -> Callable[[torch.Tensor], list[torch.Tensor]]:
        barrier, slots = self._groups[kind, group]

        def fn(t: torch.Tensor) -> list[torch.Tensor]:
            slots[me] = t.clone()
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        return fn


@pytest.mark.parametrize("ep,etp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_weight_sync_ep_etp_gather_exact(world, hf_moe, tf_configs, ep: int, etp: int) -> None:
    """Each EP x ETP rank holds its GroupedMLP slice; the package's sync (with verl's default_tp_concat_fn and
    McoreToHFWeightConverterQwen2Moe, as the patch binds them) yields, on every rank, all HF expert tensors
    exactly, in verl's EP order (local expert e, then EP rank r: global id r * E_local + e)."""
    from verl.models.mcore.weight_converter import McoreToHFWeightConverterQwen2Moe

    cfg, sd = hf_moe.config, hf_moe.state_dict()
    conv = McoreToHFWeightConverterQwen2Moe(cfg, tf_configs[1])
    E = cfg.num_experts
    El = E // ep
    groups = _ThreadGroups(ep, etp)
    results: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
    errors: list[BaseException] = []

    def rank(r: int, t: int) -> None:
        try:
            out: list[tuple[str, torch.Tensor]] = []
            for i in range(cfg.num_hidden_layers):
                w1, w2 = hf_layer_experts_to_grouped(sd, i, range(r * El, (r + 1) * El), etp, t)
                sync = GroupedMLPGatherSync(E, ep, gather_ep=groups.gather("ep", t, r),
                                            gather_etp=groups.gather("etp", r, t))
                for w, tensor in ((1, w1), (2, w2)):
                    assert sync.handles(f"decoder.layers.{i}.mlp.experts.weight{w}")
                    out += sync.sync_params(
                        f"decoder.layers.{i}.mlp.experts.weight{w}", tensor,
                        tp_concat=lambda n, s, x=tensor: world["mu"].default_tp_concat_fn(
                            LAYER_NAME_MAPPING, n, x, s, cfg, cfg, True),
                        convert=conv.convert_param)
            results[r, t] = out
        except BaseException as exc:  # noqa: B036 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r, t)) for r in range(ep) for t in range(etp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    first = results[0, 0]
    expected_order = [f"model.layers.{i}.mlp.experts.{r * El + e}.{p}_proj.weight"
                      for i in range(cfg.num_hidden_layers)
                      for w, projs in ((1, ("gate", "up")), (2, ("down",)))
                      for e in range(El) for r in range(ep) for p in projs]
    assert [n for n, _ in first] == expected_order
    _assert_is_hf(first, {k: v for k, v in sd.items() if ".mlp.experts." in k})
    for key, other in results.items():
        _assert_same_stream(other, first)
        assert key in results
