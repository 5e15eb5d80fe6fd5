"""Write a tiny verl Megatron actor checkpoint on CPU, the way verl 0.6.1's checkpoint manager lays it out, for
``python -m qwen3_rl eval merge`` to merge with verl's own model merger. Prints one JSON line.

    python tests/engine/merge_driver.py SPEC.json

SPEC: {"workspace": DIR, "model": tiny HF dir, "out": DIR}. Writes ``DIR/global_step_1/actor/``:

* ``dist_ckpt/``: ``{"model": model.sharded_state_dict()}`` saved by verl's ``save_dist_checkpointing``
  (``verl/utils/megatron/dist_checkpointing.py``, megatron-core's ``dist_checkpointing.save`` on gloo), the key
  verl's checkpoint manager uses for one model chunk (``megatron_checkpoint_manager.py`` ``generate_state_dict``);
  the model is built as verl's merger builds it (``hf_to_mcore_config`` + ``init_mcore_model`` through megatron's
  ``get_model``, ``megatron_model_merger.py`` ``_load_state_dicts``), megatron's random init, bf16;
* ``huggingface/``: the HF config and tokenizer (what rank 0 writes there);
* ``transformer_config.json``;
* and ``DIR/latest_checkpointed_iteration.txt`` = 1, as verl's trainer writes it.

Also ``DIR/reference.pt``: the model's own parameters by megatron name, to compare with the merged HF weights.
Result: {"params": n, "seconds": s}. Device-layer shims only (``qwen3_rl/cpu_device/megatron_shims.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workspace  # noqa: E402


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    t0 = time.perf_counter()
    workspace.activate(Path(spec["workspace"]))
    import megatron_shims

    megatron_shims.install()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_model import ModelType
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import AutoConfig, AutoTokenizer
    from verl.models.mcore import hf_to_mcore_config, init_mcore_model
    from verl.utils.megatron.dist_checkpointing import save_dist_checkpointing
    from verl.utils.megatron_utils import get_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(spec.get("port", 29611)))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)

    hf_config = AutoConfig.from_pretrained(spec["model"])
    tf_config = hf_to_mcore_config(hf_config, torch.bfloat16)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))

    def provider(pre_process, post_process):
        return init_mcore_model(tf_config, hf_config, pre_process, post_process,
                                share_embeddings_and_output_weights=tie, value=False)

    model = get_model(model_provider_func=provider, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=False,
                      transformer_config=tf_config)[0]
    actor = Path(spec["out"]) / "global_step_1" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    (actor / "dist_ckpt").mkdir()  # verl's get_dist_checkpoint_path makes it (megatron_utils.py:516-519)
    save_dist_checkpointing({"model": model.sharded_state_dict()}, str(actor / "dist_ckpt"), async_save=False)
    hf_dir = actor / "huggingface"
    hf_config.save_pretrained(hf_dir)
    AutoTokenizer.from_pretrained(spec["model"]).save_pretrained(hf_dir)
    (actor / "transformer_config.json").write_text(json.dumps(
        {k: v for k, v in vars(tf_config).items() if isinstance(v, int | float | str | bool | type(None))}, indent=1))
    (Path(spec["out"]) / "latest_checkpointed_iteration.txt").write_text("1")
    inner = model.module if hasattr(model, "module") else model
    ref = {k: v.detach().clone() for k, v in inner.state_dict().items() if isinstance(v, torch.Tensor)
           and not k.endswith("_extra_state")}
    torch.save(ref, Path(spec["out"]) / "reference.pt")
    dist.destroy_process_group()
    print("ENGINE_RESULT " + json.dumps({"params": len(ref), "seconds": time.perf_counter() - t0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
