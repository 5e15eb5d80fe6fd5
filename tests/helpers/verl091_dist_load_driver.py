"""verl 0.9.1's ``load_mcore_dist_weights`` (the Megatron engine's load with ``use_dist_checkpointing``,
``verl/workers/engine/megatron/transformer_impl.py:500``) on a megatron-core 0.16.1 MoE model, in one gloo process,
on a verl tree first on ``PYTHONPATH``.

    python tests/helpers/verl091_dist_load_driver.py CKPT_DIR OUT.json PREFIX

A 2-layer ``GPTModel`` (megatron's local layer spec, 4 experts, top-2, hidden 16) built by megatron-core's own code
with ``moe_grouped_gemm`` + ``moe_use_legacy_grouped_gemm`` (the experts are ``GroupedMLP``, whose weight1 / weight2
are saved through ``ShardedTensorFactory``: ``megatron/core/transformer/moe/experts.py:473``) and
``use_cpu_initialization``; every parameter set from a seeded generator; its ``sharded_state_dict(prefix=PREFIX)``
saved by ``dist_checkpointing.save``. Then every parameter is set to NaN and loaded back by
``verl.utils.model.load_mcore_dist_weights([model], CKPT_DIR, prefix=PREFIX)``.
One device-layer shim, the repo's ``CUDA_CALLS`` (``qwen3_rl/cpu_device/megatron_shims.py``: ``torch.cuda``'s device
calls act on the CPU): megatron's checkpoint writer syncs the device (``dist_checkpointing/strategies/
filesystem_async.py:230``) and all-reduces its failure flag on ``torch.cuda.current_device()``
(``state_dict_saver.py:252``); this torch has no CUDA. OUT.json: {"experts": expert module class names, "params": count, "nan": [parameters still NaN],
"differ": [parameters not equal to the saved values]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    ckpt, out_path, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from verl.utils.model import load_mcore_dist_weights

    from qwen3_rl.cpu_device import megatron_shims

    megatron_shims._cuda_calls()  # the CUDA_CALLS shim alone (see above)
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(1, 1)
    tf = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                           num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
                           moe_use_legacy_grouped_gemm=True, add_bias_linear=False, gated_linear_unit=True,
                           activation_func=torch.nn.functional.silu, use_cpu_initialization=True,
                           params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=True)
    model = GPTModel(tf, spec, vocab_size=64, max_sequence_length=16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    saved = {k: v.detach().clone() for k, v in model.named_parameters()}
    Path(ckpt).mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(prefix=prefix), ckpt)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_mcore_dist_weights([model], ckpt, is_value_model=False, prefix=prefix)
    params = dict(model.named_parameters())
    experts = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")})
    result = {"experts": experts, "params": len(params),
              "nan": sorted(k for k, v in params.items() if torch.isnan(v).any()),
              "differ": sorted(k for k, v in params.items() if not torch.equal(v, saved[k]))}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
