"""Load a converted Megatron checkpoint as verl's Megatron actor does, in one gloo process; its logits.

    python tests/helpers/actor_load_driver.py HF_DIR CKPT_DIR OUT.pt [--moe_use_legacy_grouped_gemm]

On the environment's RANK / WORLD_SIZE / MASTER_* (world 1), device shims from ``QWEN3_RL_CPU_SHIMS=1``
(``qwen3_rl/cpu_device/sitecustomize.py``). The model ``ActorRolloutRefWorker._build_model_optimizer`` builds for
the actor (``hf_to_mcore_config`` -> ``init_mcore_model`` via verl's ``get_model``; float32 here, not DDP-wrapped),
every parameter set to NaN, is loaded from CKPT_DIR twice: first by a bare ``dist_checkpointing.load`` of its
sharded state dict (what verl 0.6.1's ``load_mcore_dist_weights`` did), recording the parameters still NaN, then by
``verl.utils.model.load_mcore_dist_weights`` (the actor's load with ``megatron.use_dist_checkpointing=True``).
Logits of the ids in HF_DIR/tokens.pt ([b, s] int64, all attended) through verl's packed ``model_forward``.

OUT.pt: {"logits": [b, s, V] float32, "experts": expert module class names, "nan_after_bare_load": [names],
"nan_after_verl_load": [names]}.
"""

from __future__ import annotations

import sys


def main() -> int:
    hf_dir, ckpt, out = sys.argv[1:4]
    flags = [a for a in sys.argv[4:] if a == "--moe_use_legacy_grouped_gemm"]

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import StrictHandling
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import AutoConfig
    from verl.models.mcore import hf_to_mcore_config, init_mcore_model
    from verl.models.mcore.model_forward import model_forward_gen
    from verl.utils.megatron_utils import get_model
    from verl.utils.model import load_mcore_dist_weights

    dist.init_process_group("gloo")
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    tf = hf_to_mcore_config(hf_config, torch.float32, **({"moe_use_legacy_grouped_gemm": True} if flags else {}))

    def provider(pre_process, post_process):
        return init_mcore_model(tf, hf_config, pre_process, post_process, share_embeddings_and_output_weights=False,
                                value=False)

    model = get_model(provider, ModelType.encoder_or_decoder, wrap_with_ddp=False, transformer_config=tf)

    def nan_params() -> list[str]:
        return [k for k, v in model[0].named_parameters() if torch.isnan(v).any()]

    with torch.no_grad():
        for p in model[0].parameters():
            p.fill_(float("nan"))
    dist_checkpointing.load(model[0].sharded_state_dict(), ckpt, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    nan_bare = nan_params()
    load_mcore_dist_weights(model, ckpt, is_value_model=False)
    nan_verl = nan_params()
    model[0].eval()
    tokens = torch.load(f"{hf_dir}/tokens.pt")
    attn = torch.ones_like(tokens, dtype=torch.bool)
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = model_forward_gen()(model[0], tokens, attn, pos, {})
    experts = sorted({type(m).__name__ for n, m in model[0].named_modules() if n.endswith("mlp.experts")})
    torch.save({"logits": logits.float(), "experts": experts, "nan_after_bare_load": nan_bare,
                "nan_after_verl_load": nan_verl}, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
