"""MoE expert export on the current set: mbridge 0.15.1's all-gather against our all-to-allv, counted at torch.distributed.

    python -m qwen3_rl.tools.bench.moe_sync_verl091 [--runs 5] [--experts 8] [--layers 2] [--json]

Run it in the current set's training venv (``tests/setup_verl091_env.sh``: verl 0.9.1, megatron-core 0.16.1,
mbridge 0.15.1). verl 0.9.1 exports the actor's weights only through a Bridge
(``verl/workers/engine/megatron/transformer_impl.py:1033-1062``); with the current set's ``vanilla_mbridge=True``
that is ``mbridge.core.bridge.Bridge.export_weights`` (``mbridge/core/bridge.py:297-433``): per parameter two PP
object collectives (``all_gather_object``, ``broadcast_object_list``: ``mbridge/core/util.py:339-370``) and a PP
spec exchange plus ``broadcast`` (``:292-337``), then per routed-expert tensor (one local expert of one layer) one
``all_gather`` over the EP group (``bridge.py:364-372``) and, with ETP > 1, one more over ETP per gathered expert
(``:386-393``). Every rank gets all experts; verl's default ``naive`` sync hands the whole export to the rank's
colocated vLLM worker (``workers/engine_workers.py:786-806``, ``rollout/vllm_rollout/vllm_rollout.py:210-241``),
whose ``FusedMoE`` keeps only its EP rank's experts. Our path (:class:`qwen3_rl.moe.reshard_verl.MoEAlltoallvSync`)
exchanges each of those tensors with one ``all_to_all_single`` so each rank receives only the experts its vLLM EP
rank holds, then converts them with the same bridge's ``_weight_merge_across_tp`` / ``_weight_to_hf_format``.

Measured (2 gloo processes on this host, EP 2, the tiny Qwen3-MoE's shape of ``qwen3_rl.tools.tiny_model`` with
``--experts`` / ``--layers``, float32, vLLM layout TP 1 x DP 2 with expert parallel): mbridge's real
``export_weights`` on megatron-core's real GPTModel (device shims of ``qwen3_rl/cpu_device/megatron16_shims.py``)
and our exchange of the same expert parameters, every ``torch.distributed`` collective of this process counted by
:class:`CollectiveCounter` (the instrument: calls and bytes per op; "peer bytes" = bytes of the output that came
from other ranks, object collectives by their pickled size). Checked in each run: our tensors equal mbridge's of the
same HF names, and our names are exactly mbridge's experts that the rank's vLLM EP rank holds. Wall time: median
and [min, max] over ``--runs`` (first run not counted), ratio ours / mbridge's expert part (the EP all-gathers are
not separable in time from the rest of mbridge's loop, so mbridge's figure is the whole export's).

Layout figures (no run; :func:`layout_counts`, the same count model the test checks against the measured run): the
train scripts' layouts (``internal/lib/qwen3_235b_layout.sh``, ``internal/lib/qwen3_30b_a3b_layout.sh``, rollout
TP x DP = world with expert parallel), bf16, per rank and sync: expert collectives and the expert bytes received.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qwen3_rl.moe.reshard import MoEShape, RolloutLayout, TrainLayout, train_rank
from qwen3_rl.moe.reshard_verl import ExpertRouting

#: the recipe's MoE layouts (internal/lib/*_layout.sh) and Qwen3 shapes (HF config.json: num_hidden_layers,
#: num_experts, hidden_size, moe_intermediate_size), bf16
LAYOUTS: dict[str, tuple[MoEShape, TrainLayout, RolloutLayout]] = {
    "Qwen3-235B-A22B (train TP4 PP4 CP4 EP32 ETP1 / 128; vLLM TP4 DP32 EP128)": (
        MoEShape(94, 128, 4096, 1536),
        TrainLayout(tp=4, pp=4, ep=32, etp=1, world=128, cp=4),
        RolloutLayout(4, 32),
    ),
    "Qwen3-30B-A3B (train TP2 PP2 EP8 ETP1 / 32; vLLM TP2 DP16 EP32)": (
        MoEShape(48, 128, 2048, 768),
        TrainLayout(tp=2, pp=2, ep=8, etp=1, world=32),
        RolloutLayout(2, 16),
    ),
}

#: torch.distributed functions the instrument wraps (all mbridge's export and our exchange call)
_COUNTED = (
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "send",
    "recv",
    "barrier",
)


@dataclass
class OpCount:
    """One torch.distributed function: calls, output bytes (incl. this rank's own part), bytes from other ranks,
    wall seconds inside it."""

    calls: int = 0
    out_bytes: int = 0
    peer_bytes: int = 0
    seconds: float = 0.0


@dataclass
class CollectiveCounter:
    """The instrument: wraps ``torch.distributed``'s collectives in this process while :meth:`active` (only here,
    only for the measurement) and counts per function. Bytes of tensors: ``numel * element_size``."""

    ops: dict[str, OpCount] = field(default_factory=dict)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        dist = torch.distributed

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def counted(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            res = fn(*args, **kw)
            c = self.ops.setdefault(name, OpCount())
            c.seconds += time.perf_counter() - t0
            c.calls += 1
            group = kw.get("group")
            if name == "all_gather":
                out, inp = (kw.get("tensor_list"), kw.get("tensor")) if "tensor_list" in kw else args[:2]
                c.out_bytes += sum(nbytes(t) for t in out)
                c.peer_bytes += sum(nbytes(t) for t in out) - nbytes(inp)
            elif name == "all_to_all_single":
                out = kw.get("output", args[0] if args else None)
                osz = kw.get("output_split_sizes") or (args[2] if len(args) > 2 else None)
                me = dist.get_rank(group=group)
                row = out.numel() // max(1, len(osz)) if osz is None else None
                own = (osz[me] if osz else row) * out.element_size()
                c.out_bytes += nbytes(out)
                c.peer_bytes += nbytes(out) - own
            elif name == "broadcast":
                t = kw.get("tensor", args[0] if args else None)
                src = kw.get("src", args[1] if len(args) > 1 else None)
                c.out_bytes += nbytes(t)
                c.peer_bytes += 0 if src == dist.get_rank() else nbytes(t)
            elif name == "all_gather_object":
                objs = kw.get("object_list", args[0] if args else None)
                sizes = [len(pickle.dumps(o)) for o in objs]
                me = dist.get_rank(group=group)
                c.out_bytes += sum(sizes)
                c.peer_bytes += sum(sizes) - sizes[me]
            elif name == "broadcast_object_list":
                objs = kw.get("object_list", args[0] if args else None)
                size = sum(len(pickle.dumps(o)) for o in objs)
                src = kw.get("src", args[1] if len(args) > 1 else None)
                c.out_bytes += size
                c.peer_bytes += 0 if src == dist.get_rank() else size
            return res

        return counted

    @contextmanager
    def active(self) -> Iterator[CollectiveCounter]:
        dist = torch.distributed
        saved = {n: getattr(dist, n) for n in _COUNTED}
        try:
            for n, fn in saved.items():
                setattr(dist, n, self._wrap(n, fn))
            yield self
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {n: vars(c).copy() for n, c in sorted(self.ops.items())}


def expert_groups(train: TrainLayout) -> list[tuple[int, ...]]:
    """megatron's expert-tensor-and-model-parallel groups (etp fastest, then ep; one per expert-DP rank and stage)."""
    return [
        tuple(
            train_rank(train, etp_rank=t, ep_rank=e, edp_rank=d, pp_rank=p)
            for e in range(train.ep)
            for t in range(train.etp)
        )
        for p in range(train.pp)
        for d in range(train.edp)
    ]


def layout_counts(shape: MoEShape, train: TrainLayout, rollout: RolloutLayout) -> dict[str, dict[str, int]]:
    """Per rank, one whole sync, routed experts only (max over ranks; every rank sees every layer through mbridge's
    PP broadcast): ``{"mbridge": {calls, out_bytes, peer_bytes}, "alltoallv": {...}}``.

    mbridge: per layer, local expert id and fc tensor one EP ``all_gather`` (output EP shards), with ETP > 1 also one
    ETP ``all_gather`` per gathered expert. Ours: one ``all_to_all_single`` per layer, local id and fc tensor, output
    the shards of the experts this rank's vLLM EP rank holds. Shard bytes: fc1 2F/ETP x H, fc2 H x F/ETP.
    """
    L, E, H, F, b = (
        shape.num_layers,
        shape.num_experts,
        shape.hidden_size,
        shape.moe_intermediate_size,
        shape.dtype_bytes,
    )
    ep, etp = train.ep, train.etp
    shard = (2 * F * H + H * F) // etp * b  # fc1 + fc2 shard bytes of one expert
    local = E // ep
    mb_calls = L * local * 2 * (1 + (ep if etp > 1 else 0))
    mb_out = L * local * ep * shard * (1 + (etp if etp > 1 else 0))
    mb_peer = L * local * ((ep - 1) * shard + ((ep * (etp - 1) * shard) if etp > 1 else 0))
    worst = {"calls": 0, "out_bytes": 0, "peer_bytes": 0}
    for ranks in expert_groups(train):
        for member in range(len(ranks)):
            r = ExpertRouting(E, ep, etp, ranks, member, rollout)
            shards = sum(len(src) for j in range(local) for _, src in r.received(j))
            own = sum(src.count(member) for j in range(local) for _, src in r.received(j))
            cur = {
                "calls": L * local * 2,
                "out_bytes": L * shards * shard,
                "peer_bytes": L * (shards - own) * shard,
            }
            worst = {k: max(worst[k], cur[k]) for k in worst}
    return {"mbridge": {"calls": mb_calls, "out_bytes": mb_out, "peer_bytes": mb_peer}, "alltoallv": worst}


# ---------------------------------------------------------------------------------------- measured (2 gloo ranks)
def _build(num_experts: int, num_layers: int) -> tuple[Any, list[torch.nn.Module]]:
    """mbridge's bridge and megatron module of the tiny Qwen3-MoE shape (random init), as verl's engine builds them
    (``transformer_impl.py`` vanilla-mbridge branch; forward-only wrapper, float32)."""
    from transformers import Qwen3MoeConfig
    from verl.models.mcore.mbridge import AutoBridge
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module

    from qwen3_rl.tools.tiny_model import TinySpec

    s = TinySpec(moe=True, num_experts=num_experts, num_layers=num_layers)
    hf = Qwen3MoeConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate_size,
        num_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.moe_intermediate_size,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        max_position_embeddings=s.max_position_embeddings,
        torch_dtype="float32",
    )
    bridge = AutoBridge.from_config(hf, dtype=torch.float32)
    tf = bridge.config
    tf.fp16 = tf.bf16 = False
    module, _ = make_megatron_module(
        McoreModuleWrapperConfig(is_value_model=False, wrap_with_ddp=False), tf, hf, bridge=bridge
    )
    return bridge, module


def _ours(bridge: Any, module: list[torch.nn.Module], sync: Any) -> dict[str, torch.Tensor]:
    """Our exchange of every routed-expert parameter of the rank's model (global layer names, local expert ids as
    mbridge streams them), converted by the bridge's own merge / HF conversion."""
    out: dict[str, torch.Tensor] = {}
    model = module[0]
    to_global = bridge._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)

    def convert(n: str, params: list[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
        return bridge._weight_to_hf_format(n, params[0] if len(params) == 1 else params)

    for name, param in model.named_parameters():
        if ".mlp.experts.linear_fc" not in name:
            continue
        gname = to_global[name]

        def merge(n: str, shards: list[torch.Tensor], p: torch.Tensor = param) -> torch.Tensor:
            return bridge._weight_merge_across_tp(n, shards, p)

        for hf_name, t in sync.sync_params(gname, param.data, merge, convert):
            out[hf_name] = t.clone()
    return out


def _worker(
    rank: int, world: int, ep: int, port: int, num_experts: int, num_layers: int, runs: int, out_dir: str
) -> None:
    """One gloo rank (megatron EP ``ep``, expert-DP world / ep; vLLM TP 1 x DP world): build, then ``runs + 1``
    times mbridge's export and our exchange, each under the instrument."""
    import qwen3_rl

    sys.path.insert(0, str(Path(qwen3_rl.__file__).parent / "cpu_device"))  # the shims' post_import needs it
    from qwen3_rl.cpu_device import megatron16_shims

    megatron16_shims.install()  # before megatron is imported
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from qwen3_rl.moe.reshard_verl import MoEAlltoallvSync, expert_ids_of

    mpu.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    bridge, module = _build(num_experts, num_layers)
    rollout = RolloutLayout(tp=1, dp=world)
    res: dict[str, Any] = {"runs": []}
    for _ in range(runs + 1):
        theirs_c, ours_c = CollectiveCounter(), CollectiveCounter()
        torch.distributed.barrier()
        with theirs_c.active():
            t0 = time.perf_counter()
            theirs = {n: t.clone() for n, t in bridge.export_weights(module)}
            t_theirs = time.perf_counter() - t0
        torch.distributed.barrier()
        with ours_c.active():
            t0 = time.perf_counter()
            sync = MoEAlltoallvSync.from_megatron(mpu, num_experts, rollout)
            ours = _ours(bridge, module, sync)
            t_ours = time.perf_counter() - t0
        held = set(range(rank * num_experts // world, (rank + 1) * num_experts // world))
        theirs_experts = sorted(
            n for n, e in zip(theirs, expert_ids_of(list(theirs)), strict=True) if e is not None
        )
        res["runs"].append(
            {
                "mbridge": theirs_c.as_dict(),
                "alltoallv": ours_c.as_dict(),
                "t_mbridge": t_theirs,
                "t_alltoallv": t_ours,
                "names_equal": sorted(ours)
                == [
                    n for n, e in zip(theirs_experts, expert_ids_of(theirs_experts), strict=True) if e in held
                ],
                "tensors_equal": all(torch.equal(t, theirs[n]) for n, t in ours.items()),
                "n_mbridge_experts": len(theirs_experts),
                "n_alltoallv": len(ours),
            }
        )
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def measure(
    num_experts: int = 8,
    num_layers: int = 2,
    runs: int = 3,
    world: int = 2,
    ep: int = 2,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Spawn ``world`` gloo processes (megatron EP ``ep``); each rank's result dict (see :func:`_worker`)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(
            _worker,
            args=(world, ep, port, num_experts, num_layers, runs, d),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"bench ranks still running after {timeout_s} s")
        return [torch.load(Path(d) / f"rank{r}.pt") for r in range(world)]


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms [{min(xs) * 1e3:.2f}, {max(xs) * 1e3:.2f}]"


def tiny_counts(num_experts: int, num_layers: int, world: int, ep: int) -> dict[str, dict[str, int]]:
    """:func:`layout_counts` of the measured run (tiny shape H 64, F 32, float32)."""
    from qwen3_rl.tools.tiny_model import TinySpec

    s = TinySpec(moe=True)
    shape = MoEShape(num_layers, num_experts, s.hidden_size, s.moe_intermediate_size, 4)
    return layout_counts(shape, TrainLayout(tp=1, pp=1, ep=ep, etp=1, world=world), RolloutLayout(1, world))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs after one warm-up")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--world", type=int, default=2, help="gloo processes (vLLM EP = world)")
    ap.add_argument("--ep", type=int, default=2, help="megatron expert parallel size (divides world)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    layouts = {k: layout_counts(*v) for k, v in LAYOUTS.items()}
    ranks = measure(a.experts, a.layers, a.runs, a.world, a.ep)
    pred = tiny_counts(a.experts, a.layers, a.world, a.ep)
    if a.json:
        print(json.dumps({"layouts": layouts, "measured": ranks, "count_model": pred}, default=str))
        return 0
    print(
        "per rank and sync, routed experts, bf16 (count model, checked against the measured run by the test):"
    )
    for k, v in layouts.items():
        m, o = v["mbridge"], v["alltoallv"]
        print(
            f"  {k}\n    mbridge all_gather: {m['calls']} calls, {m['out_bytes']:,} B out, {m['peer_bytes']:,} B from"
            f" peers\n    ours all_to_all_single: {o['calls']} calls, {o['out_bytes']:,} B out, {o['peer_bytes']:,}"
            f" B from peers (out ratio {o['out_bytes'] / m['out_bytes']:.4f}, peer ratio "
            f"{o['peer_bytes'] / m['peer_bytes']:.4f})"
        )
    print(
        f"measured: {a.world} gloo ranks, megatron EP {a.ep}, vLLM EP {a.world}, {a.experts} experts x {a.layers}"
        f" layers, float32, {a.runs} timed runs after a warm-up; count model: {pred}"
    )
    for r, res in enumerate(ranks):
        last, timed = res["runs"][-1], res["runs"][1:]
        print(
            f"  rank {r}: names equal {all(x['names_equal'] for x in res['runs'])}, tensors equal "
            f"{all(x['tensors_equal'] for x in res['runs'])} ({last['n_alltoallv']} of {last['n_mbridge_experts']}"
            " expert tensors)"
        )
        for path in ("mbridge", "alltoallv"):
            ops = ", ".join(
                f"{n} {c['calls']}x {c['out_bytes']:,} B out {c['peer_bytes']:,} B peers"
                for n, c in last[path].items()
            )
            print(f"    {path}: {ops}")
        ag = [x["mbridge"]["all_gather"]["seconds"] for x in timed]
        a2a = [x["alltoallv"]["all_to_all_single"]["seconds"] for x in timed]
        tm, to = [x["t_mbridge"] for x in timed], [x["t_alltoallv"] for x in timed]
        print(
            f"    in the expert collectives: mbridge all_gather {_spread(ag)}, ours all_to_all_single {_spread(a2a)},"
            f" median ratio {statistics.median(a2a) / statistics.median(ag):.3f}"
        )
        print(
            f"    whole call: mbridge export_weights {_spread(tm)} (all parameters); ours {_spread(to)} (experts only)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
