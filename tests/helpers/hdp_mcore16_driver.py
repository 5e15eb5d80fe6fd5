"""Driver of ``tests/parallel/test_hdp_mcore16_gpt_model.py`` (runs in the current set's training venv,
``tests/setup_verl091_env.sh``): one training step of megatron-core 0.16.1's own ``GPTModel`` on 4 gloo ranks, with
upstream's ``hybrid_context_parallel`` off and on. Prints one ``JSON`` line (the parent collects the ranks').

``python hdp_mcore16_driver.py MODE[,MODE]``, run in turn in the same 4 processes (megatron's parallel state and the
model built afresh for each), MODE ``off`` (``initialize_model_parallel(context_parallel_size=2)``:
DP 2 x CP 2, megatron's no-pipelining schedule, every sequence split over the whole CP group by megatron's
``get_batch_on_this_cp_rank``) or ``hybrid`` (``initialize_model_parallel(hybrid_context_parallel=True)`` over the
same 4 ranks as one DP x CP domain, ``TransformerConfig(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=
BUDGET)``: megatron's ``get_forward_backward_func`` takes ``hybrid_context_parallel_forward_backward``
(``pipeline_parallel/schedules.py:615-616``), upstream's ``BalancedCPScheduler`` places the samples, each sample
is cut by ``get_batch_on_this_hybrid_cp_rank`` (``utils.py:2086-2132``) for its sub-group, ``PackedSeqParams``
carries ``cp_group`` / ``local_cp_size`` to RoPE (``gpt_model.py:368-373``) and core attention).
The hybrid model has ``context_parallel_size`` 1 (all of its CP is the per-sample sub-groups): RoPE uses the model's
CP group for a sample without one (``rotary_pos_embedding.py:199-204``), so with 2 a sample on one rank fails.

Upstream code that runs: megatron-core 0.16.1's GPTModel (Qwen3 shape: RMSNorm, q/k norm, GQA, SwiGLU, RoPE,
untied output), its DDP and ``finalize_model_grads`` (per-token loss: gradients over the DP x CP token count), its
schedules, its scheduler. Shims (device layer only): ``megatron16_shims`` (CPU Transformer Engine stand-ins, gloo,
CUDA calls); ``CpuCPAttention`` below stands in for TE's context-parallel flash attention (the CUDA kernel of
``TEDotProductAttention``; the stand-in of ``megatron16_te_cpu.py`` refuses CP): exact causal softmax attention of
the local query chunks against the key/value chunks all-gathered over the attention's CP group, the group chosen
as megatron's TE wrapper chooses it (``extensions/transformer_engine.py:1346-1363``: ``packed_seq_params.cp_group``
if given, none when ``local_cp_size == 1``, else the model's CP group); ``NoPinTorch``: pinned host memory needs a
CUDA allocator (``utils.py:2114-2117`` pins ``cu_seqlens``, ``models/common/embeddings/rope_utils.py:62`` its CP
index), so ``pin_memory`` is dropped in those two modules.
Mode ``hybrid-mindspeed``: the hybrid step with MindSpeed core_r0.16.0's ``TEDotProductAttention`` (the tree named by
``QWEN3_RL_MS16_TREE``) as core attention, with ``tests/helpers/mindspeed_shims.py`` (torch_npu stand-ins) plus,
here: ``npu_fusion_attention_sbh`` (MindSpeed's flash backend calls the kernel in layout SBH; the stand-in has TND),
MindSpeed's causal mask made on the CPU, and ``torch.npu.Stream`` / ``torch_npu.npu.Stream`` for two annotations.
Not used: ``HybridCPDataLoaderWrapper`` (its rerouting all-to-all of sample tensors); every rank builds every sample
from the same seed and keeps the ones the scheduler gives it, the schedule computed by the real
``BalancedCPScheduler.get_groups_and_subsamples`` on the wrapper's global ids (DP rank order).
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch

WORLD = 4
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 32, 4, 2, 8, 64, 2
#: sample lengths (tokens) per DP group of the plain run; multiples of 4 (2 x CP, megatron's CP chunking)
LENS = {0: [8, 12, 4, 16, 8], 1: [32, 8, 20, 12, 4]}
BUDGET = 24  # max_seqlen_per_dp_cp_rank: the 32-token sample needs 2 ranks


def sample(gid: int, n: int) -> dict[str, torch.Tensor]:
    """Sample ``gid`` of ``n`` tokens: tokens / labels / position_ids int64 [n], loss_mask float [n]."""
    g = torch.Generator().manual_seed(1000 + gid)
    return {
        "tokens": torch.randint(1, VOCAB, (n,), generator=g),
        "labels": torch.randint(1, VOCAB, (n,), generator=g),
        "loss_mask": torch.ones(n),
        "position_ids": torch.arange(n),
    }


def global_lens() -> list[int]:
    """Lengths by global id: DP rank 0's samples, then DP rank 1's (``HybridCPDataLoaderWrapper``'s offsets)."""
    return [n for dp in sorted(LENS) for n in LENS[dp]]


class NoPinTorch(types.ModuleType):
    """``torch`` for ``megatron.core.utils`` with ``pin_memory`` dropped from ``torch.tensor`` (no pinned host
    allocator without CUDA)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, **kwargs) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return torch.tensor(*args, **kwargs)


class _Gather(torch.autograd.Function):
    """All-gather over ``group`` along dim 0; backward: the all-reduced gradient's own slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous()
        torch.distributed.all_reduce(g, group=ctx.group)
        r = ctx.group.rank()
        return g[r * ctx.n : (r + 1) * ctx.n], None


def make_attention(counts: dict[int, int]):
    """The CP-capable core attention stand-in; ``counts[k]`` counts calls on a CP group of size k."""
    from megatron.core import parallel_state as mpu

    class CpuCPAttention(torch.nn.Module):
        """Causal GQA attention over megatron's CP layout (chunks r and 2k-1-r of 2k on rank r of k).
        q [s_local, b, np, hn], k/v [s_local, b, ng, hn] -> [s_local, b, np * hn]."""

        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            *,
            pg_collection=None,
            attention_dropout=None,
            softmax_scale=None,
            k_channels=None,
            v_channels=None,
            cp_comm_type="p2p",
            **kwargs,
        ):
            super().__init__()
            self.config = config
            self.scale = softmax_scale or (k_channels or config.kv_channels) ** -0.5
            self.model_cp_group = (
                pg_collection.cp if pg_collection is not None else mpu.get_context_parallel_group()
            )

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            **kwargs,
        ):
            group = self.model_cp_group
            if packed_seq_params is not None:
                assert packed_seq_params.qkv_format == "sbhd", packed_seq_params.qkv_format
                if packed_seq_params.cp_group is not None:
                    group = packed_seq_params.cp_group
                elif packed_seq_params.local_cp_size is not None:
                    assert packed_seq_params.local_cp_size == 1
                    group = None
            k_size = 1 if group is None else group.size()
            counts[k_size] = counts.get(k_size, 0) + 1
            s = query.shape[0]
            if k_size > 1:
                key, value = _Gather.apply(key, group), _Gather.apply(value, group)
                r, c = group.rank(), s // 2
                # rank j holds chunks j and 2k-1-j: reorder the gathered [k * s] rows into sequence order
                order = []
                for chunk in range(2 * k_size):
                    j = chunk if chunk < k_size else 2 * k_size - 1 - chunk
                    half = 0 if chunk < k_size else 1
                    order.append(torch.arange(j * s + half * c, j * s + (half + 1) * c))
                idx = torch.cat(order)
                key, value = key[idx], value[idx]
                q_pos = torch.cat(
                    [
                        torch.arange(r * c, (r + 1) * c),
                        torch.arange((2 * k_size - 1 - r) * c, (2 * k_size - r) * c),
                    ]
                )
            else:
                q_pos = torch.arange(s)
            kv_pos = torch.arange(key.shape[0])
            mask = kv_pos[None, :] <= q_pos[:, None]  # [s_local, s_full]
            rep = query.shape[2] // key.shape[2]
            outs = []
            for b in range(query.shape[1]):
                q = query[:, b].transpose(0, 1)  # [np, s_local, hn]
                k = key[:, b].repeat_interleave(rep, dim=1).transpose(0, 1)
                v = value[:, b].repeat_interleave(rep, dim=1).transpose(0, 1)
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.scale
                )
                outs.append(o.transpose(0, 1).reshape(s, -1))
            return torch.stack(outs, 1)

    return CpuCPAttention


def fc1_tp1(cls: type) -> type:
    """The stand-in fused norm + fc1 with 0.16.1's SwiGLU ``stride=2`` (``transformer/mlp.py:107-109``) accepted at
    TP 1, where the stride (the interleave of [gate, up] over TP shards) changes nothing (the stand-in of
    ``megatron16_te_cpu.py`` now takes it too, as a parameter tag)."""
    from megatron.core import parallel_state as mpu

    class Fc1(cls):
        def __init__(self, *args, stride: int = 1, **kwargs) -> None:
            assert stride == 1 or mpu.get_tensor_model_parallel_world_size() == 1
            super().__init__(*args, **kwargs)

    return Fc1


def npu_fusion_attention_sbh(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    **kw: object,
) -> tuple:
    """``torch_npu.npu_fusion_attention`` for layout ``SBH`` (MindSpeed's flash-attention backend,
    ``mindspeed/te/pytorch/attention/dot_product_attention/backend.py:90``), one batch row at a time through the
    TND stand-in of ``tests/helpers/mindspeed_shims.py``: q [S, B, N*D], k/v [S, B, Nkv*D] -> ([S, B, N*D], ...).
    Causal ``sparse_mode`` 2 (top-left) is the stand-in's 3 (bottom-right) for square q/k."""
    from helpers import mindspeed_shims

    if input_layout != "SBH":
        return mindspeed_shims.npu_fusion_attention(query, key, value, head_num, input_layout, **kw)
    s, b, h = query.shape
    d = h // head_num
    assert key.shape[0] == s and kw.get("actual_seq_qlen") is None
    if kw.get("sparse_mode") == 2:
        kw["sparse_mode"] = 3
    kw.update(actual_seq_qlen=[s], actual_seq_kvlen=[s])
    outs = [
        mindspeed_shims.npu_fusion_attention(
            query[:, i].reshape(s, head_num, d),
            key[:, i].reshape(s, -1, d),
            value[:, i].reshape(s, -1, d),
            head_num,
            "TND",
            **kw,
        )[0].reshape(s, h)
        for i in range(b)
    ]
    return (torch.stack(outs, 1),)


def mindspeed_attention(counts: dict[int, int]) -> type:
    """MindSpeed core_r0.16.0's ``TEDotProductAttention`` (what it registers at model CP size 1,
    ``features_manager/megatron_basic/transformer_engine_basic.py:62``); ``counts[k]`` counts calls handed a sample of
    ``local_cp_size`` k."""
    from mindspeed.te.pytorch.attention.dot_product_attention.dot_product_attention import (
        TEDotProductAttention,
    )

    class Counted(TEDotProductAttention):
        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: object = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: object = None,
        ) -> torch.Tensor:
            """MindSpeed's forward, counted; q/k/v [s_local, b, heads, head_dim] -> [s_local, b, heads * head_dim]."""
            k = (
                1
                if packed_seq_params is None or packed_seq_params.local_cp_size is None
                else int(packed_seq_params.local_cp_size)
            )
            counts[k] = counts.get(k, 0) + 1
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )

    return Counted


def worker(rank: int, port: int, modes: list[str], q) -> None:
    """One gloo rank: for each of ``modes`` in turn, megatron's parallel state set up afresh, build the model and run
    one step; put ``{mode: results}`` on ``q``."""
    from qwen3_rl.cpu_device import megatron16_shims

    # the model is built on megatron's local norm spec, whose choice `import apex` flips to FusedLayerNorm (no
    # RMSNorm without MindSpeed's norm patch); this driver's optimizer is not under test: no FUSED_ADAM
    megatron16_shims.install(fused_adam=False)
    if "hybrid-mindspeed" in modes:
        sys.path.append(os.environ["QWEN3_RL_MS16_TREE"])
        from helpers import mindspeed_shims

        mindspeed_shims.install()
        sys.modules["torch_npu"].npu_fusion_attention = npu_fusion_attention_sbh
        # annotations only (``dot_product_attention.py:162, 257``, evaluated at definition); CP streams unused
        torch.npu.Stream = type("Stream", (), {})
        sys.modules["torch_npu"].npu = types.SimpleNamespace(Stream=torch.npu.Stream)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from megatron.core import parallel_state as mpu

        out = {}
        for mode in modes:
            mpu.destroy_model_parallel()
            out[mode] = run_rank(rank, mode)
        q.put((rank, out))
    except BaseException:  # report to the parent instead of hanging it
        import traceback

        q.put((rank, traceback.format_exc()))
        raise
    finally:
        torch.distributed.destroy_process_group()


def run_rank(rank: int, mode: str) -> dict:
    """One step: loss sums per global sample id (this rank's tokens), reduced gradients, attention group sizes."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as mpu
    from megatron.core import utils as mutils
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    mutils.torch = rope_utils.torch = NoPinTorch("torch")
    hybrid = mode in ("hybrid", "hybrid-mindspeed")
    if hybrid:
        mpu.initialize_model_parallel(hybrid_context_parallel=True)
    else:
        mpu.initialize_model_parallel(context_parallel_size=2)
    counts: dict[int, int] = {}
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        qk_layernorm=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        context_parallel_size=1 if hybrid else 2,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=0.2,
        params_dtype=torch.float32,
        calculate_per_token_loss=True,
        hybrid_context_parallel=hybrid,
        max_seqlen_per_dp_cp_rank=BUDGET if hybrid else None,
    )
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    if mode == "hybrid-mindspeed":
        config.use_flash_attn, config.attention_mask_type = True, "causal"  # MindSpeed's config fields
        from mindspeed.core.transformer.flash_attention.generate_mask import generate_mask

        # MindSpeed's compressed causal mask, made on the CPU (``generate_mask.py:62`` puts it on the NPU)
        generate_mask.generate_attention_mask(config, True, "cpu")
        spec.submodules.self_attention.submodules.core_attention = mindspeed_attention(counts)
    else:
        spec.submodules.self_attention.submodules.core_attention = make_attention(counts)
    spec.submodules.mlp.submodules.linear_fc1 = fc1_tp1(spec.submodules.mlp.submodules.linear_fc1)
    model = GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=1_000_000,
        share_embeddings_and_output_weights=False,
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    ddp.broadcast_params()
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    ddp.zero_grad_buffer()

    lens = global_lens()
    loss_sums: dict[int, float] = {}
    local_cp_sizes: dict[int, int] = {}

    def forward_step(data_iterator, mdl):
        s = next(data_iterator)
        gid = int(s.pop("gid"))
        if hybrid:
            k = int(s.pop("local_cp_size"))
            local_cp_sizes[gid] = k
            batch, psp = mutils.get_batch_on_this_hybrid_cp_rank(s, k)
        else:
            batch = mutils.get_batch_on_this_cp_rank({key: v[None] for key, v in s.items()})
            psp = None
        ce = mdl(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=psp)
        mask = batch["loss_mask"].float()

        def loss_func(out):
            total = (out.float() * mask).sum()
            loss_sums[gid] = loss_sums.get(gid, 0.0) + float(total.detach())
            return total, mask.sum().to(torch.int), {"lm loss": total.detach()}

        return ce, loss_func

    if hybrid:
        sched = BalancedCPScheduler(BUDGET, mpu.get_data_parallel_group(with_context_parallel=True))
        _, groups = sched.get_groups_and_subsamples(list(enumerate(lens)), config)
        hdp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
        mine = {g for group in groups for g in group[hdp_rank]}
        batch = {g: {**sample(g, lens[g]), "gid": torch.tensor(g)} for g in mine}
        data = iter([(batch, groups)])
        n_mb = sum(len(group[hdp_rank]) for group in groups)
        schedule = [[list(ids) for ids in group] for group in groups]
    else:
        dp = mpu.get_data_parallel_rank()
        base = sum(len(LENS[d]) for d in range(dp))
        data = iter([{**sample(base + i, n), "gid": torch.tensor(base + i)} for i, n in enumerate(LENS[dp])])
        n_mb = len(LENS[dp])
        schedule = None
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[ddp],
        num_microbatches=n_mb,
        seq_length=max(lens),
        micro_batch_size=1,
        forward_only=False,
    )
    grads = {name: p.main_grad.detach().clone().tolist() for name, p in ddp.module.named_parameters()}
    return {
        "loss_sums": loss_sums,
        "grads": grads,
        "attention_group_sizes": counts,
        "local_cp_sizes": local_cp_sizes,
        "schedule": schedule,
        "num_micro_batches": n_mb,
        "fb_func": get_forward_backward_func().__name__,
    }


def main() -> None:
    import torch.multiprocessing as mp

    modes = sys.argv[1].split(",")
    assert set(modes) <= {"off", "hybrid", "hybrid-mindspeed"}, modes
    from ports import free_port

    port = free_port()  # tests/helpers/ports.py: outside the ephemeral range
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, modes, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = sorted((q.get(timeout=240) for _ in range(WORLD)), key=lambda x: x[0])
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    print("JSON" + json.dumps({"modes": modes, "lens": global_lens(), "ranks": [res for _, res in got]}))


if __name__ == "__main__":
    main()
