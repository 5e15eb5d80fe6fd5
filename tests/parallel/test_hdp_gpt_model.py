"""HDP in a real Megatron model: one training step with HDP on equals the same step with HDP off, 4 gloo ranks.

Layout: world 4 = DP 2 x CP 2 (CP groups [0, 1] and [2, 3]), TP = PP = 1. The model is megatron-core 0.12.1's own
``GPTModel`` (patched tree) in the Qwen3 shape (RMSNorm, q/k norm, GQA, SwiGLU, RoPE, untied output layer) built
from megatron's Transformer Engine layer spec with the repo's CPU Transformer Engine stand-ins
(``qwen3_rl/cpu_device/megatron_shims.py``); its core attention is MindSpeed's ``MindSpeedCPDotProductAttention``
(pinned MindSpeed tree with the series, as MindSpeed registers it for ``TEDotProductAttention``) and RoPE goes
through MindSpeed's ``apply_rotary_pos_emb`` (as MindSpeed's fused-RoPE feature registers it), with the NPU kernels
stood in by ``tests/helpers/mindspeed_shims.py``. The step is megatron's no-pipelining schedule
(``get_forward_backward_func``) over megatron's ``DistributedDataParallel`` (gradient all-reduce over DP x CP in
``finalize_model_grads``), the forward is verl's patched ``model_forward`` (``packing=None``: verl's
``preprocess_packed_seqs`` over the whole CP group; HDP: the seam's ``HDPPacking``), micro-batches from
``HDPRuntime.plan`` / ``split``.

The two DP groups hold sequences of unequal lengths: DP group 0 only short ones (HDP: 1 micro-batch, every
sequence on one rank, padded to the world's count with a filler micro-batch), DP group 1 one sequence that needs
both CP ranks (ring of 2) beside sequences on single ranks, over 2 micro-batches. HDP off: one micro-batch per DP
group holding all its sequences on the whole CP group (upstream ring attention and RoPE), so its loss is the
token-mean over the DP group's mini-batch, the quantity HDP's loss scale keeps. Checked: each DP group's loss and
every parameter's reduced gradient (``main_grad``) agree between the two runs; positive controls: the HDP run took
the HDP path (sub-group rings and rings of one counted in MindSpeed's attention), and without HDP's loss scale the
gradients differ.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import PINS, REPO, free_port
from helpers.mindspeed_tree import patched_mindspeed_tree

WORLD, CP = 4, 2
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 32, 4, 2, 8, 64, 2
SEQ = 32  # row length (right-padded)
TOKEN_BUDGET = 24  # HDP tokens per rank per micro-batch
# valid tokens of each row, per DP group: group 0 short, group 1 one sequence over the budget of one rank
LENS = {0: [5, 9, 3, 6, 7], 1: [29, 7, 18, 13, 4]}
# float32 model (the TE stand-ins compute RMSNorm in float32): the two runs reduce the same sums in different
# orders and packings, so they agree to float32 rounding
GRAD_RTOL, GRAD_ATOL, LOSS_RTOL = 1e-4, 1e-6, 1e-5


def make_batch(dp: int) -> dict[str, torch.Tensor]:
    """Rows of DP group ``dp``: input_ids / labels [n, SEQ] int64, attention_mask [n, SEQ] bool (right-padded)."""
    g = torch.Generator().manual_seed(100 + dp)
    n = len(LENS[dp])
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    mask = torch.zeros(n, SEQ, dtype=torch.bool)
    for i, s in enumerate(LENS[dp]):
        mask[i, :s] = True
    return {"input_ids": ids * mask, "labels": labels * mask, "attention_mask": mask}


def _worker(rank: int, port: int, roots: list[str], q) -> None:
    """One gloo rank: build the model, run the step HDP off, HDP on, HDP on without its loss scale."""
    sys.path[:0] = roots
    import megatron_shims

    megatron_shims.install()
    # verl before the MindSpeed stand-ins: accelerate (imported by verl) probes find_spec("torch_npu")
    from verl.models.mcore.model_forward import model_forward_gen

    from helpers import mindspeed_shims

    mindspeed_shims.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        q.put((rank, _run_rank(rank, model_forward_gen())))
    except BaseException:  # report to the parent instead of hanging it
        import traceback

        q.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _run_rank(rank: int, model_forward) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import attention as megatron_attention
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tensordict import TensorDict

    mpu.initialize_model_parallel(context_parallel_size=CP)
    import mindspeed.args_utils as ms_args

    args = ms_args.get_mindspeed_args(get_defaults=True)  # MindSpeed's defaults: megatron_cp_algo, causal
    args.use_flash_attn, args.attention_mask_on_cpu = True, True
    ms_args._MINDSPEED_ARGS = args
    from mindspeed.core.context_parallel import utils as cp_utils
    from mindspeed.core.context_parallel.adaptor import MindSpeedCPDotProductAttention
    from mindspeed.core.context_parallel.model_parallel_utils import (
        initialize_context_parallel_group_for_double_ring,
    )
    from mindspeed.core.fusions import fused_rope
    from mindspeed.core.transformer.transformer_config import transformer_config_post_init_wrapper

    from qwen3_rl.parallel import hdp_wiring
    from qwen3_rl.parallel.hdp import HDPConfig
    from qwen3_rl.parallel.hdp_runtime import HDPPacking, HDPRuntime

    # what MindSpeed's adaptor does for this configuration: its ring windows over the CP group (megatron's
    # initialize_model_parallel wrapper), its arguments on TransformerConfig, its RoPE in megatron's attention
    # (mindspeed/features_manager/fusions/fused_rope.py registers it for rope_utils.apply_rotary_pos_emb, which
    # attention.py binds at import) and its CP attention for TEDotProductAttention
    # (features_manager/context_parallel/context_parallel_feature.py)
    initialize_context_parallel_group_for_double_ring(1, 1, CP, {})
    TransformerConfig.__post_init__ = transformer_config_post_init_wrapper(TransformerConfig.__post_init__)
    megatron_attention.apply_rotary_pos_emb = fused_rope.apply_rotary_pos_emb
    calls = {"ring": 0, "local": 0}
    hdp_attention = hdp_wiring.hdp_attention

    def counted_hdp_attention(q, k, v, mb, ring_fn, local_fn):
        def ring(*a):
            calls["ring"] += 1
            return ring_fn(*a)

        def local(*a):
            calls["local"] += 1
            return local_fn(*a)

        return hdp_attention(q, k, v, mb, ring, local)

    hdp_wiring.hdp_attention = counted_hdp_attention  # the patched forward imports it at call time
    merges = {"n": 0}
    unfused = cp_utils.forward_update_without_fused

    def counted_merge(*a, **kw):
        merges["n"] += 1
        return unfused(*a, **kw)

    cp_utils.forward_update_without_fused = counted_merge

    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-6,
        qk_layernorm=True, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, context_parallel_size=CP, attention_dropout=0.0, hidden_dropout=0.0,
        init_method_std=0.2, params_dtype=torch.float32)
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    spec.submodules.self_attention.submodules.core_attention = MindSpeedCPDotProductAttention
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=2 * SEQ, position_embedding_type="rope",
                     rotary_base=1_000_000, share_embeddings_and_output_weights=False)
    assert isinstance(model.decoder.layers[0].self_attention.core_attention, MindSpeedCPDotProductAttention)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    ddp.broadcast_params()
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync

    dp = mpu.get_data_parallel_rank()
    cp_rank = mpu.get_context_parallel_rank()
    b = make_batch(dp)
    n_tokens = int(b["attention_mask"].sum())
    runtime = HDPRuntime.from_megatron(HDPConfig(enable=True, token_budget=TOKEN_BUDGET), mpu, TOKEN_BUDGET)

    def logits_processor(logits, label):  # [1, T, V], [1, T] -> per-token cross entropy [1, T]
        return {"ce": -torch.log_softmax(logits.float(), -1).gather(-1, label.unsqueeze(-1)).squeeze(-1)}

    def step(mode: str) -> dict:
        """One training step's forward/backward/gradient reduction; returns loss, gradients, micro-batch count."""
        ddp.zero_grad_buffer()
        if mode == "off":
            items = [(b["input_ids"], b["labels"], b["attention_mask"], b["attention_mask"], None, 1.0,
                      [cp_rank == 0] * len(LENS[dp]))]
        else:
            plan = runtime.plan(b["attention_mask"], b["attention_mask"])
            td = TensorDict({**b, "loss_mask": b["attention_mask"].clone()}, batch_size=[len(LENS[dp])])
            items = []
            for rows, mb in runtime.split(td, plan, mask_keys=("loss_mask",)):
                owned = [s.seq != hdp_wiring.FILLER and s.ring_index == 0 for s in mb.segments]
                scale = mb.loss_scale if mode == "on" else 1.0
                items.append((rows["input_ids"], rows["labels"], rows["attention_mask"], rows["loss_mask"],
                              HDPPacking(mb), scale, owned))
        it = iter(items)

        def forward_step(data_iterator, mdl):
            ids, labels, attn, loss_mask, packing, scale, owned = next(data_iterator)
            pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
            out = model_forward(mdl, ids, attn, pos, {}, logits_processor=logits_processor,
                                logits_processor_args={"label": labels}, packing=packing)
            ce = out["ce"]  # [n, SEQ], whole sequences (gathered over the block / CP group)

            def loss_func(_):
                m = loss_mask.float()
                mean = (ce * m).sum() / m.sum().clamp(min=1.0)
                owned_sum = (ce.detach() * m)[torch.tensor(owned, dtype=torch.bool)].sum()
                return mean * scale, {"owned_sum": owned_sum}

            return ce, loss_func

        losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=it, model=[ddp],
                                             num_microbatches=len(items), seq_length=SEQ, micro_batch_size=1,
                                             forward_only=False)
        total = torch.stack([x["owned_sum"] for x in losses]).sum().reshape(1)
        dist.all_reduce(total, group=mpu.get_context_parallel_group())
        grads = {name: p.main_grad.detach().clone().numpy() for name, p in ddp.module.named_parameters()}
        return {"loss": float(total) / n_tokens, "grads": grads, "num_micro_batches": len(items)}

    res = {"dp": dp, "cp_rank": cp_rank}
    for mode in ("off", "on", "on-unscaled"):
        before = dict(calls)
        merges_before = merges["n"]
        t0 = time.perf_counter()
        res[mode] = step(mode)
        res[mode]["seconds"] = time.perf_counter() - t0
        res[mode]["hdp_calls"] = {k: calls[k] - before[k] for k in calls}
        res[mode]["ring_merges"] = merges["n"] - merges_before
    return res


def _run(megatron: Path, mindspeed: Path, verl: Path) -> list[tuple[int, object]]:
    import torch.multiprocessing as mp

    roots = [str(mindspeed), str(megatron), str(verl), str(REPO), str(REPO / "qwen3_rl" / "cpu_device"),
             str(REPO / "tests"), str(Path(__file__).resolve().parent)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, roots, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        return sorted((q.get(timeout=300) for _ in range(WORLD)), key=lambda x: x[0])
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_hdp_step_equals_cp_step_in_megatron_gpt_model(patched_workspace: Path,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny Qwen3 GPTModel with MindSpeed's ring attention on DP 2 x CP 2: the HDP step's per-DP-group loss and
    reduced gradients equal those of the plain CP step (tolerances above), on unequal sequence lengths."""
    mindspeed = patched_mindspeed_tree(tmp_path_factory.mktemp("ms_ws"))
    got = _run(patched_workspace / PINS.frameworks["megatron"].dir, mindspeed,
               patched_workspace / PINS.frameworks["verl"].dir)
    for rank, res in got:
        assert isinstance(res, dict), f"rank {rank} failed:\n{res}"
    ranks = {rank: res for rank, res in got}
    # layout: DP group 0 one micro-batch off, HDP padded to the world's 2 (filler); DP group 1 two
    assert [ranks[r]["off"]["num_micro_batches"] for r in range(WORLD)] == [1, 1, 1, 1]
    assert [ranks[r]["on"]["num_micro_batches"] for r in range(WORLD)] == [2, 2, 2, 2]
    # HDP off ran upstream's ring over the whole CP group, HDP on the per-block path: DP group 1 has a ring of 2
    # (the sequence of 29 tokens), both groups have rings of one
    for r in range(WORLD):
        assert ranks[r]["off"]["hdp_calls"] == {"ring": 0, "local": 0} and ranks[r]["off"]["ring_merges"] > 0
        assert ranks[r]["on"]["hdp_calls"]["local"] > 0
    assert all(ranks[r]["on"]["hdp_calls"]["ring"] > 0 and ranks[r]["on"]["ring_merges"] > 0 for r in (2, 3))
    assert all(ranks[r]["on"]["hdp_calls"]["ring"] == 0 for r in (0, 1))

    worst: dict[str, float] = {"loss": 0.0, "grad": 0.0, "unscaled": 0.0}
    for r in range(WORLD):
        off, on, unscaled = ranks[r]["off"], ranks[r]["on"], ranks[r]["on-unscaled"]
        assert off["loss"] > 0
        assert on["loss"] == pytest.approx(off["loss"], rel=LOSS_RTOL), (r, on["loss"], off["loss"])
        worst["loss"] = max(worst["loss"], abs(on["loss"] - off["loss"]) / off["loss"])
        assert off["grads"].keys() == on["grads"].keys() and len(off["grads"]) > 10
        for name, g_off in off["grads"].items():
            a, e = torch.from_numpy(on["grads"][name]), torch.from_numpy(g_off)
            assert e.abs().max() > 0, f"{name}: zero gradient"
            torch.testing.assert_close(a, e, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"rank {r} {name}")
            scale = float(e.abs().max())  # per tensor: largest deviation over the largest gradient entry
            worst["grad"] = max(worst["grad"], float((a - e).abs().max()) / scale)
            u = torch.from_numpy(unscaled["grads"][name])
            worst["unscaled"] = max(worst["unscaled"], float((u - e).abs().max()) / scale)
        # every rank holds the same reduced gradients
        for name, g in off["grads"].items():
            assert torch.equal(torch.from_numpy(g), torch.from_numpy(ranks[0]["off"]["grads"][name]))
    # positive control: without HDP's loss scale the same step's gradients are wrong
    assert worst["unscaled"] > 100 * GRAD_RTOL, worst
    print(f"\nHDP vs CP: loss rel diff {worst['loss']:.2e}, grad max|diff|/max|grad| {worst['grad']:.2e} "
          f"(unscaled control {worst['unscaled']:.2e}); losses "
          f"{[round(ranks[r]['off']['loss'], 6) for r in (0, 2)]}; step s off/on "
          f"{ranks[0]['off']['seconds']:.2f}/{ranks[0]['on']['seconds']:.2f}")
