"""Per-die memory plan: rollout (vLLM / vLLM-Ascend 0.13) weights, KV cache and concurrency, and
the static training memory of the Megatron actor (megatron-core 0.12.1, distributed optimizer).

All byte figures are per die (one NPU). ``GiB`` = 2**30 bytes. Derivations and the sources of every
constant are in ``docs/memory_plan.md``; upstream references are to the pinned trees.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from qwen3_rl.tools.plan.model import ModelSpec, PlanError

GIB = 1 << 30
MIB = 1 << 20

# --- device and runtime constants (sources in docs/memory_plan.md) ----------------------------
A3_DIE_HBM_GIB = 64.0
"""Nominal HBM of one Atlas A3 die (npu-smi shows 65536 MB on 64 GB Ascend dies)."""
A3_DIE_VISIBLE_GIB = 60.96
"""What ``torch.npu.mem_get_info()`` reports as total on a 64 GiB die: torch_npu's OOM text
"60.96 GiB total capacity" (vllm-project/vllm-omni#1199) and vLLM-Ascend's "Free memory on device
(60.6/60.96 GiB)" (vllm-project/vllm-ascend#10700). The other 3.04 GiB are held by driver/firmware."""
VLLM_ASCEND_BLOCK_SIZE = 128
"""KV block size forced by vLLM-Ascend (vllm_ascend/utils.py:1090, refresh_block_size)."""
VLLM_VOCAB_PADDING = 64
"""vLLM pads the vocabulary to a multiple of 64 before the TP split
(vllm/model_executor/layers/vocab_parallel_embedding.py:28)."""
HCCL_BUFFSIZE_MB_DEFAULT = 200
"""CANN default of HCCL_BUFFSIZE; each communicator holds 2 × HCCL_BUFFSIZE (send + receive) —
CANN 8.5 HCCL user guide, "HCCL_BUFFSIZE"."""
VERL_ROLLOUT_DEFAULTS = {
    "gpu_memory_utilization": 0.5,
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 1024,
}
"""verl 0.6.1 rollout defaults (verl/trainer/config/rollout/rollout.yaml)."""
SAMPLER_BYTES_PER_LOGIT = 14
"""Dummy sampler run of the profile pass: bf16 logits (2) + fp32 logits (4) + probs (4) + one fp32
work copy for top-k/top-p (4), per (request, vocab) element — an estimate."""


@dataclass(frozen=True)
class RolloutLayout:
    """vLLM layout of one rollout engine as verl starts it.

    ``dp`` is vLLM's own data-parallel size (verl passes it only with expert parallel on,
    verl/workers/rollout/vllm_rollout/vllm_async_server.py:249-264). ``ep`` is 1 (off) or the
    vLLM expert-parallel size, which vLLM fixes at ``tp × dp`` (vllm/model_executor/layers/fused_moe/
    config.py:919-960).
    """

    tp: int
    ep: int = 1
    dp: int = 1
    max_model_len: int = 32768
    gpu_memory_utilization: float = VERL_ROLLOUT_DEFAULTS["gpu_memory_utilization"]
    max_num_batched_tokens: int = VERL_ROLLOUT_DEFAULTS["max_num_batched_tokens"]
    max_num_seqs: int = VERL_ROLLOUT_DEFAULTS["max_num_seqs"]
    redundant_experts: int = 0  # EPLB redundant experts added over the whole EP group
    kv_dtype_bytes: int = 2
    weight_dtype_bytes: int = 2


@dataclass(frozen=True)
class DeviceBudget:
    """Device memory model. ``activation_gib`` None means "estimate from the layout"."""

    hbm_gib: float = A3_DIE_HBM_GIB
    visible_gib: float = A3_DIE_VISIBLE_GIB
    hccl_buffsize_mb: int = HCCL_BUFFSIZE_MB_DEFAULT
    hccl_comms: int | None = None  # None: count the communicators the rollout uses
    activation_gib: float | None = None
    extra_reserved_gib: float = 0.0  # e.g. trainer state kept on the die during rollout
    block_size: int = VLLM_ASCEND_BLOCK_SIZE


def _check_positive(**values: int | float) -> None:
    for name, v in values.items():
        if v is None or v <= 0:
            raise PlanError(f"{name} must be > 0, got {v}")


def kv_heads_per_rank(total_kv_heads: int, tp: int) -> int:
    """KV heads each TP rank stores; with TP > KV heads vLLM replicates heads (one per rank).

    Mirrors vllm/model_executor/models/qwen3_moe.py:236-244 (and qwen3.py): TP must divide the KV
    heads, or the KV heads must divide TP.
    """
    if total_kv_heads >= tp:
        if total_kv_heads % tp:
            raise PlanError(f"rollout TP {tp} does not divide the {total_kv_heads} KV heads")
        return total_kv_heads // tp
    if tp % total_kv_heads:
        raise PlanError(f"rollout TP {tp} is not a multiple of the {total_kv_heads} KV heads")
    return 1


def validate_rollout(spec: ModelSpec, lay: RolloutLayout) -> None:
    """Raise :class:`PlanError` for layouts vLLM would refuse."""
    _check_positive(rollout_tp=lay.tp, rollout_ep=lay.ep, rollout_dp=lay.dp, max_model_len=lay.max_model_len)
    _check_positive(max_num_batched_tokens=lay.max_num_batched_tokens, max_num_seqs=lay.max_num_seqs)
    if not 0 < lay.gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization must be in (0, 1], got {lay.gpu_memory_utilization}")
    if spec.num_heads % lay.tp:
        raise PlanError(f"rollout TP {lay.tp} does not divide the {spec.num_heads} attention heads")
    kv_heads_per_rank(spec.num_kv_heads, lay.tp)
    if lay.ep > 1:
        if not spec.is_moe:
            raise PlanError("rollout EP > 1 needs a MoE model (config has no num_experts)")
        if lay.ep != lay.tp * lay.dp:
            raise PlanError(
                f"vLLM's expert-parallel size is TP×DP = {lay.tp * lay.dp}; got --rollout-ep {lay.ep}"
            )
        if (spec.num_experts + lay.redundant_experts) % lay.ep:
            raise PlanError(
                f"{spec.num_experts} experts + {lay.redundant_experts} redundant do not split over EP {lay.ep}"
            )
    elif spec.is_moe and spec.moe_intermediate_size % (lay.tp * lay.dp):
        raise PlanError(
            f"moe_intermediate_size {spec.moe_intermediate_size} does not split over TP×DP {lay.tp * lay.dp}"
        )


def rollout_weight_params(spec: ModelSpec, lay: RolloutLayout) -> dict[str, int]:
    """Parameters held by one rollout die, by part (element counts).

    * attention: q and o split by TP (``Hq/TP`` heads); k and v hold ``kv_heads_per_rank`` heads
      (replicated when TP > KV heads); q_norm/k_norm and the layer norms are replicated.
    * dense MLP: gate/up/down split by TP.
    * experts: with EP each die holds ``(E + redundant)/EP`` whole experts; without EP vLLM
      shards every expert's intermediate dimension over TP×DP (fused_moe/config.py:919-945).
    * router: replicated.
    * embedding and LM head: vocab padded to 64 then split by TP (VocabParallelEmbedding /
      ParallelLMHead); counted once when tied.
    """
    validate_rollout(spec, lay)
    h, d = spec.hidden_size, spec.head_dim
    q_local = spec.num_heads // lay.tp
    kv_local = kv_heads_per_rank(spec.num_kv_heads, lay.tp)
    attn = h * d * (2 * q_local + 2 * kv_local) + 2 * d
    norms = spec.layer_norm_params()
    dense_mlp = 3 * h * spec.intermediate_size // lay.tp if spec.num_dense_layers else 0
    if spec.is_moe:
        if lay.ep > 1:
            experts = (spec.num_experts + lay.redundant_experts) // lay.ep * spec.expert_params()
        else:
            experts = spec.num_experts * spec.expert_params() // (lay.tp * lay.dp)
        router = spec.router_params()
    else:
        experts = router = 0
    vocab_local = math.ceil(math.ceil(spec.vocab_size / VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING / lay.tp)
    emb = vocab_local * h
    return {
        "attention": spec.num_layers * attn,
        "layer_norms": spec.num_layers * norms + h,
        "dense_mlp": spec.num_dense_layers * dense_mlp,
        "experts": spec.num_sparse_layers * experts,
        "router": spec.num_sparse_layers * router,
        "embedding": emb,
        "lm_head": 0 if spec.tie_word_embeddings else emb,
    }


def kv_bytes_per_token(spec: ModelSpec, lay: RolloutLayout) -> int:
    """KV bytes one token occupies on one die: ``layers × 2 (K,V) × kv_heads_per_rank × head_dim × bytes``."""
    return (
        spec.num_layers
        * 2
        * kv_heads_per_rank(spec.num_kv_heads, lay.tp)
        * spec.head_dim
        * lay.kv_dtype_bytes
    )


def rollout_hccl_comms(lay: RolloutLayout) -> int:
    """Communicators that carry device collectives during rollout (each costs 2 × HCCL_BUFFSIZE).

    TP (size TP) if TP > 1; DP (size DP) if DP > 1; with EP on, vLLM's EP group
    (vllm/distributed/parallel_state.py:1408) and vLLM-Ascend's MC2 dispatch/combine group
    (vllm_ascend/distributed/parallel_state.py:99), both of size TP×DP.
    """
    n = int(lay.tp > 1) + int(lay.dp > 1)
    if lay.ep > 1:
        n += 2
    return n


def activation_peak_bytes(spec: ModelSpec, lay: RolloutLayout) -> dict[str, int]:
    """Estimate of the torch activation peak of vLLM's profile run (``max_num_batched_tokens``
    dummy tokens, then a dummy sampler run over ``max_num_seqs`` requests), bf16.

    Per layer at T tokens: hidden + residual ``2·T·h·2``; attention ``T·(2·Hq_l + 2·Hkv_l)·d·2``;
    dense MLP ``T·3·I/TP·2``; MoE with balanced routing: each die receives ``T·k/TP`` token-expert
    pairs with EP (``T·k`` without, on ``I_moe/(TP·DP)`` slices), each pair holding input, gate/up,
    activation and output ``(2h + 3·I_loc)·2`` bytes, plus fp32 router logits ``T·E·4``.
    Sampler: ``max_num_seqs × V × SAMPLER_BYTES_PER_LOGIT``. Peak = max(layer, sampler).
    """
    t = lay.max_num_batched_tokens
    h, d = spec.hidden_size, spec.head_dim
    q_local = spec.num_heads // lay.tp
    kv_local = kv_heads_per_rank(spec.num_kv_heads, lay.tp)
    hidden = 2 * t * h * 2
    attention = t * (2 * q_local + 2 * kv_local) * d * 2
    dense = t * 3 * (spec.intermediate_size // lay.tp) * 2 if spec.num_dense_layers else 0
    moe = 0
    if spec.is_moe:
        if lay.ep > 1:
            pairs, i_loc = t * spec.num_experts_per_tok // lay.tp, spec.moe_intermediate_size
        else:
            pairs, i_loc = t * spec.num_experts_per_tok, spec.moe_intermediate_size // (lay.tp * lay.dp)
        moe = pairs * (2 * h + 3 * i_loc) * 2 + t * spec.num_experts * 4
    layer = hidden + max(attention, dense, moe)
    sampler = lay.max_num_seqs * spec.vocab_size * SAMPLER_BYTES_PER_LOGIT
    return {
        "layer_bytes": layer,
        "sampler_bytes": sampler,
        "peak_bytes": max(layer, sampler),
    }


def plan_rollout(spec: ModelSpec, lay: RolloutLayout, dev: DeviceBudget | None = None) -> dict:
    """Rollout memory plan for one die. Returns a JSON-ready dict (see docs/memory_plan.md).

    KV budget follows vLLM-Ascend 0.13's worker (vllm_ascend/worker/worker.py:269-311):
    ``visible_total × gpu_memory_utilization − torch peak (weights + activations) − non-torch``.
    Graph-capture memory is taken after the KV cache and is NOT in that budget in 0.13.0; it must
    fit in ``visible_total × (1 − utilization)``, reported as ``headroom_gib``.
    """
    dev = dev or DeviceBudget()
    _check_positive(visible_gib=dev.visible_gib, block_size=dev.block_size)
    parts = rollout_weight_params(spec, lay)
    weight_bytes = sum(parts.values()) * lay.weight_dtype_bytes
    kv_tok = kv_bytes_per_token(spec, lay)
    kv_seq = kv_tok * lay.max_model_len
    act = activation_peak_bytes(spec, lay)
    act_bytes = act["peak_bytes"] if dev.activation_gib is None else int(dev.activation_gib * GIB)
    comms = rollout_hccl_comms(lay) if dev.hccl_comms is None else dev.hccl_comms
    hccl_bytes = comms * 2 * dev.hccl_buffsize_mb * MIB
    visible = dev.visible_gib * GIB
    requested = visible * lay.gpu_memory_utilization
    extra = dev.extra_reserved_gib * GIB
    kv_budget = max(0.0, requested - weight_bytes - act_bytes - hccl_bytes - extra)
    block_bytes = dev.block_size * kv_tok
    num_blocks = int(kv_budget // block_bytes)
    blocks_per_seq = math.ceil(lay.max_model_len / dev.block_size)
    max_concurrent = num_blocks // blocks_per_seq
    return {
        "layout": asdict(lay),
        "weights_params_per_die": sum(parts.values()),
        "weights_bytes_per_die": weight_bytes,
        "weights_gib_per_die": weight_bytes / GIB,
        "weights_gib_by_part": {k: v * lay.weight_dtype_bytes / GIB for k, v in parts.items()},
        "kv_heads_per_die": kv_heads_per_rank(spec.num_kv_heads, lay.tp),
        "kv_bytes_per_token_per_die": kv_tok,
        "kv_bytes_per_seq": kv_seq,
        "kv_gib_per_seq": kv_seq / GIB,
        "device": {
            "hbm_gib": dev.hbm_gib,
            "visible_gib": dev.visible_gib,
            "driver_reserved_gib": dev.hbm_gib - dev.visible_gib,
            "requested_gib": requested / GIB,
            "headroom_gib": (visible - requested) / GIB,
        },
        "reserved": {
            "activation_gib": act_bytes / GIB,
            "activation_estimated": dev.activation_gib is None,
            "activation_layer_gib": act["layer_bytes"] / GIB,
            "activation_sampler_gib": act["sampler_bytes"] / GIB,
            "hccl_comms": comms,
            "hccl_buffsize_mb": dev.hccl_buffsize_mb,
            "hccl_gib": hccl_bytes / GIB,
            "extra_gib": dev.extra_reserved_gib,
        },
        "kv_budget_gib": kv_budget / GIB,
        "block_size": dev.block_size,
        "num_blocks": num_blocks,
        "kv_cache_tokens": num_blocks * dev.block_size,
        "blocks_per_seq": blocks_per_seq,
        "max_concurrent_seqs": max_concurrent,
        "max_concurrent_seqs_capped": min(max_concurrent, lay.max_num_seqs),
    }


# --- training ----------------------------------------------------------------------------------
def hdp_hccl_comms(cp: int) -> int:
    """HDP process groups (``qwen3_rl.hdp.enable``) per die that carry traffic, so hold an HCCL communicator.

    ``qwen3_rl.parallel.hdp_wiring.HDPProcessGroups`` gives every aligned block of ``k`` ranks of a CP group of
    ``cp`` ranks its own group, except the whole group (k = cp), which reuses Megatron's CP group. A die is in one
    block of each size. HCCL creates a group's communicator, with its 2 × HCCL_BUFFSIZE buffer, at the first
    collective on it; blocks of 2 .. cp/2 carry ring attention and the output gathers, a block of 1 (a DP
    sequence, a ring of one) carries nothing (MindSpeed's RingP2P sends only to other ring members,
    mindspeed/core/context_parallel/ring_context_parallel/ring_context_parallel.py:1001-1008). So: one
    communicator per block size 2 .. cp/2 = log2(cp) - 1 (0 for cp <= 2).
    """
    if cp < 1 or cp & (cp - 1):
        raise PlanError(f"HDP needs a power-of-two context parallel size, got CP{cp}")
    return max(0, cp.bit_length() - 2)


@dataclass(frozen=True)
class TrainLayout:
    """Megatron actor layout. ``etp`` None = megatron-core's default (= TP,
    megatron/core/model_parallel_config.py:355). ``first_stage_layers`` / ``last_stage_layers`` are
    megatron's ``num_layers_in_first/last_pipeline_stage`` (uneven pipeline). ``hdp``: the actor's
    ``qwen3_rl.hdp.enable`` (its sub-groups' HCCL buffers are counted, see :func:`hdp_hccl_comms`)."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    distributed_optimizer: bool = True
    grad_fp32: bool = True
    hdp: bool = False


def pipeline_stage_layers(num_layers: int, lay: TrainLayout) -> list[int]:
    """Layers per pipeline stage, as megatron-core assigns them."""
    pp = lay.pp
    if pp == 1:
        return [num_layers]
    first, last = lay.first_stage_layers, lay.last_stage_layers
    if first is None and last is None:
        if num_layers % pp:
            raise PlanError(
                f"{num_layers} layers do not split evenly over PP={pp}; give --actor-first-stage-layers/"
                "--actor-last-stage-layers (megatron's num_layers_in_first/last_pipeline_stage)"
            )
        return [num_layers // pp] * pp
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages and rest % middle_stages):
        raise PlanError(
            f"first/last stage layers {first}/{last} leave {rest} layers for {middle_stages} stages"
        )
    mid = [rest // middle_stages] * middle_stages if middle_stages else []
    return ([first] if first is not None else []) + mid + ([last] if last is not None else [])


def plan_training(spec: ModelSpec, lay: TrainLayout, hccl_buffsize_mb: int = HCCL_BUFFSIZE_MB_DEFAULT) -> dict:
    """Static memory (parameters, gradients, optimizer states) of the actor on its heaviest die, and with
    ``lay.hdp`` the HCCL buffers of HDP's sub-groups (``hdp``: communicators × 2 × ``hccl_buffsize_mb``).

    Bytes per parameter with megatron's distributed optimizer and verl's DDP settings
    (``grad_reduce_in_fp32=True``, verl/utils/megatron_utils.py:141): bf16 param 2 + fp32 main
    grad 4 + (fp32 main param 4 + Adam m 4 + v 4) / d, where d is the optimizer's shard group:
    DP×CP for dense parameters (megatron/core/distributed/distributed_data_parallel.py:281) and
    the expert data-parallel size ``world / (ETP·EP·PP)`` for experts (parallel_state.py:696-702).
    This is the Megatron docs' "6 + 12/d" (docs/source/api-guide/dist_optimizer.md).
    Activations are not included: they depend on micro-batch tokens and recompute settings.
    """
    _check_positive(world=lay.world, actor_tp=lay.tp, actor_pp=lay.pp, actor_cp=lay.cp, actor_ep=lay.ep)
    etp = lay.tp if lay.etp is None else lay.etp
    _check_positive(actor_etp=etp)
    if lay.world % (lay.tp * lay.pp * lay.cp):
        raise PlanError(f"world {lay.world} is not divisible by TP×PP×CP = {lay.tp * lay.pp * lay.cp}")
    dp = lay.world // (lay.tp * lay.pp * lay.cp)
    expert_group = etp * lay.ep * lay.pp
    if spec.is_moe and lay.world % expert_group:
        raise PlanError(
            f"world {lay.world} is not divisible by ETP×EP×PP = {expert_group} (megatron expert layout); "
            "set --actor-etp (megatron's default ETP is TP)"
        )
    edp = lay.world // expert_group if spec.is_moe else None
    if spec.num_heads % lay.tp or spec.num_kv_heads % lay.tp:
        raise PlanError(
            f"actor TP {lay.tp} must divide the {spec.num_heads} heads and {spec.num_kv_heads} KV heads"
        )
    if lay.ep > 1 and (not spec.is_moe or spec.num_experts % lay.ep):
        raise PlanError(f"actor EP {lay.ep} does not divide the model's {spec.num_experts} experts")
    stages = pipeline_stage_layers(spec.num_layers, lay)
    h = spec.hidden_size
    vocab_local = math.ceil(spec.vocab_size / lay.tp)
    sparse = set(spec.sparse_layers)
    per_stage = []
    start = 0
    for s, n_layers in enumerate(stages):
        idx = range(start, start + n_layers)
        start += n_layers
        n_sparse = sum(1 for i in idx if i in sparse)
        dense = n_layers * (spec.attention_params() // lay.tp + spec.layer_norm_params())
        dense += (n_layers - n_sparse) * spec.dense_mlp_params() // lay.tp
        dense += n_sparse * spec.router_params()
        if s == 0:
            dense += vocab_local * h
        if s == len(stages) - 1:
            dense += h + (0 if spec.tie_word_embeddings and len(stages) == 1 else vocab_local * h)
        experts = n_sparse * (spec.num_experts // lay.ep) * spec.expert_params() // etp if spec.is_moe else 0
        per_stage.append((dense, experts))
    dense_p, expert_p = max(per_stage, key=lambda de: de[0] + de[1])
    grad_b = 4 if lay.grad_fp32 else 2
    shard_dense = dp * lay.cp if lay.distributed_optimizer else 1
    shard_expert = (edp or 1) if lay.distributed_optimizer else 1
    params_b = 2 * (dense_p + expert_p)
    grads_b = grad_b * (dense_p + expert_p)
    optim_b = 12 * dense_p / shard_dense + 12 * expert_p / shard_expert
    hdp = None
    if lay.hdp:
        if lay.cp < 2:
            raise PlanError(f"actor HDP needs context parallel size >= 2, got CP{lay.cp}")
        comms = hdp_hccl_comms(lay.cp)
        hdp = {"hccl_comms_per_die": comms, "hccl_buffsize_mb": hccl_buffsize_mb,
               "hccl_gib": comms * 2 * hccl_buffsize_mb * MIB / GIB}
    return {
        "layout": {**asdict(lay), "etp": etp if spec.is_moe else None, "dp": dp, "expert_dp": edp},
        "stage_layers": stages,
        "params_per_die": dense_p + expert_p,
        "dense_params_per_die": dense_p,
        "expert_params_per_die": expert_p,
        "params_gib": params_b / GIB,
        "grads_gib": grads_b / GIB,
        "optimizer_gib": optim_b / GIB,
        "static_gib": (params_b + grads_b + optim_b) / GIB,
        "bytes_per_param_dense": 2 + grad_b + 12 / shard_dense,
        "bytes_per_param_expert": 2 + grad_b + 12 / shard_expert if spec.is_moe else None,
        "hdp": hdp,
    }
