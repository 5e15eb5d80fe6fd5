"""The current set's HF -> megatron-core 0.16.1 path for the tiny Qwen3-MoE (verl 0.9.1's Megatron engine with
``vanilla_mbridge=True``, mbridge 0.15.1), its logits, and a dist-checkpoint save and load of the model, in one gloo
process on a verl tree first on ``PYTHONPATH``.

    python tests/helpers/verl091_mbridge_driver.py mcore HF_DIR WORK_DIR OUT.pt
    python tests/helpers/verl091_mbridge_driver.py hf HF_DIR OUT.pt

The model is built and filled as the engine does (``verl/workers/engine/megatron/transformer_impl.py``): the bridge
from the HF config with the trainer's default ``override_transformer_config`` (``:328-333``,
``trainer/config/_generated_ppo_megatron_trainer.yaml:68-74``), ``make_megatron_module`` (``:485``; forward only,
no DDP, float32), then ``bridge.load_weights(module, HF_DIR)`` (``:504-505``) into parameters first set to NaN.
Logits of HF_DIR/tokens.pt ([b, s] int64, all attended) through verl's packed ``model_forward_gen`` (thd). The
``hf`` mode: HF transformers' logits of the same files (float32) in this venv (transformers 5), in a process
without the device shims (under the seed CUDA_CALLS shim, transformers 5.10.4 leaves its RoPE ``inv_freq``
uninitialised: zeros or garbage, seen here).

Dist checkpoint, two expert layouts of the same mbridge-built model:

* ``te``: the model above (mbridge's ``moe_grouped_gemm=True``: ``TEGroupedMLP``), saved as verl's converter saves
  (``dist_checkpointing.save(model.sharded_state_dict(), ...)``, ``scripts/converter_hf_to_mcore.py:623``);
* ``legacy``: the bridge with ``moe_use_legacy_grouped_gemm=True`` (megatron's ``GroupedMLP``, the layout
  MindSpeed's all-to-all overlap uses; mbridge has no HF name map for it, so its parameters are seeded random).

For each: every parameter set to NaN, then a bare ``dist_checkpointing.load`` of the sharded state dict (verl's load
before the fix: its result dropped) and, after another NaN fill, ``verl.utils.model.load_mcore_dist_weights`` (the
engine's load with ``use_dist_checkpointing``, ``transformer_impl.py:499-502``); the parameters still NaN and those
not equal to the saved ones are listed. The sharded state dict's ``ShardedTensorFactory`` entries (merged into new
tensors on load) are listed with whether the tensors their build splits off share the parameter's storage.

Device shims: ``qwen3_rl/cpu_device/megatron16_shims.py`` (``qwen3_rl/cpu_device`` must be on ``PYTHONPATH``);
``grouped_gemm`` is the PyTorch stand-in of ``tests/helpers/grouped_gemm_cpu`` (GroupedMLP's constructor asserts
the package). OUT.pt (mcore): {"param_names", "nan_after_hf_load", "logits" [b, s, V], "megatron_core",
"mbridge", "<layout>": {"experts", "factories", "factories_alias", "bare": {"nan", "differ"},
"verl": {"nan", "differ"}, "logits_after_verl_load" (te only)}, "stand_in_groups"}; (hf): {"logits" [b, s, V], "transformers"}.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.argv[1] == "mcore":
    from qwen3_rl.cpu_device import megatron16_shims

    megatron16_shims.install()  # before megatron is imported

import torch  # noqa: E402

#: verl 0.9.1's trainer default ``actor.megatron.override_transformer_config`` (the yaml cited above)
OVERRIDE = {
    "recompute_granularity": None,
    "recompute_modules": ["core_attn"],
    "recompute_method": None,
    "recompute_num_layers": None,
    "attention_backend": "flash",
}


def build(hf_config, legacy: bool) -> tuple[object, list[torch.nn.Module]]:  # noqa: ANN001 (a transformers PretrainedConfig)
    """The engine's ``_build_tf_config`` (vanilla mbridge branch) + ``_build_megatron_module`` without the load:
    (the mbridge bridge, [the GPTModel])."""
    from verl.models.mcore.mbridge import AutoBridge
    from verl.utils.megatron_utils import (
        McoreModuleWrapperConfig,
        make_megatron_module,
        mapping_string_to_attn_backend,
    )

    bridge = AutoBridge.from_config(hf_config, dtype=torch.float32)
    bridge.set_extra_args(
        **mapping_string_to_attn_backend(dict(OVERRIDE)),
        **({"moe_use_legacy_grouped_gemm": True} if legacy else {}),
    )
    tf = bridge.config
    tf.fp16 = tf.bf16 = False
    module, _ = make_megatron_module(
        McoreModuleWrapperConfig(is_value_model=False, wrap_with_ddp=False), tf, hf_config, bridge=bridge
    )
    return bridge, module


def fill_nan(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))


def compare(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    params = dict(model.named_parameters())
    return {
        "nan": sorted(k for k, v in params.items() if torch.isnan(v).any()),
        "differ": sorted(k for k, v in params.items() if not torch.equal(v, saved[k])),
    }


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] ids -> [b, s, V] float32 logits through verl's packed forward."""
    from verl.models.mcore.model_forward import model_forward_gen

    attn = torch.ones_like(tokens, dtype=torch.bool)
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        return model_forward_gen()(model, tokens, attn, pos, {}).float()


def checkpoint_round_trip(module: list[torch.nn.Module], ckpt: Path) -> dict:
    """Save ``module[0]``'s sharded state dict to ``ckpt``, load it back both ways; what came back."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.serialization import StrictHandling
    from verl.utils.model import load_mcore_dist_weights

    model = module[0]
    saved = {k: v.detach().clone() for k, v in model.named_parameters()}
    sharded = model.sharded_state_dict()
    factories = sorted(k for k, v in sharded.items() if isinstance(v, ShardedTensorFactory))
    alias = {}
    for k in factories:
        f = sharded[k]
        alias[k] = all(
            t.data.untyped_storage().data_ptr() == f.data.untyped_storage().data_ptr()
            for t in nested_values({"built": f.build()})
        )
    ckpt.mkdir(parents=True)
    dist_checkpointing.save(sharded, str(ckpt), sharded_strategy=None, async_sharded_save=False)
    fill_nan(model)
    dist_checkpointing.load(model.sharded_state_dict(), str(ckpt), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    bare = compare(model, saved)
    fill_nan(model)
    load_mcore_dist_weights(module, str(ckpt), is_value_model=False)
    experts = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")})
    return {
        "experts": experts,
        "factories": factories,
        "factories_alias": alias,
        "bare": bare,
        "verl": compare(model, saved),
    }


def stand_in_groups(config) -> dict[str, str]:  # noqa: ANN001 (the model's TransformerConfig)
    """The TE stand-in's row linear built with parallel_state's TP group and with another group of the same ranks:
    {"default": "built", "other": the error's class name}."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.extensions.transformer_engine import TERowParallelLinear

    out = {}
    for name, group in (("default", mpu.get_tensor_model_parallel_group()), ("other", dist.new_group([0]))):
        try:
            TERowParallelLinear(
                8,
                8,
                config=config,
                init_method=torch.nn.init.zeros_,
                bias=False,
                input_is_parallel=True,
                skip_bias_add=False,
                is_expert=False,
                tp_group=group,
            )
            out[name] = "built"
        except NotImplementedError as e:
            out[name] = type(e).__name__
    return out


def hf_main(hf_dir: Path, out: str) -> int:
    """HF transformers' float32 logits of HF_DIR/tokens.pt ([b, s, V])."""
    import importlib.metadata as md

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.load(hf_dir / "tokens.pt")).logits.float()
    torch.save({"logits": logits, "transformers": md.version("transformers")}, out)
    return 0


def main() -> int:
    if sys.argv[1] == "hf":
        return hf_main(Path(sys.argv[2]), sys.argv[3])
    hf_dir, work, out = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    import importlib.metadata as md

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import AutoConfig

    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)  # the engine's set_random_seed (transformer_impl.py:195)
    hf_config = AutoConfig.from_pretrained(str(hf_dir))
    tokens = torch.load(hf_dir / "tokens.pt")
    res: dict = {"megatron_core": md.version("megatron-core"), "mbridge": md.version("mbridge")}

    bridge, module = build(hf_config, legacy=False)
    fill_nan(module[0])
    bridge.load_weights(module, str(hf_dir))
    res["param_names"] = [k for k, _ in module[0].named_parameters()]
    res["nan_after_hf_load"] = [k for k, v in module[0].named_parameters() if torch.isnan(v).any()]
    res["logits"] = logits_of(module[0], tokens)
    res["te"] = checkpoint_round_trip(module, work / "te")
    res["te"]["logits_after_verl_load"] = logits_of(module[0], tokens)

    _, legacy = build(hf_config, legacy=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in legacy[0].parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    res["legacy"] = checkpoint_round_trip(legacy, work / "legacy")
    res["stand_in_groups"] = stand_in_groups(legacy[0].config)
    torch.save(res, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
