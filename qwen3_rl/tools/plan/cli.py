"""``python -m qwen3_rl plan``: per-die memory plan of a rollout + actor layout.

Layout comes from explicit flags or from a train script (read by
``qwen3_rl.tools.launch.train_script.parse_train_script``); explicit flags win over the script.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from qwen3_rl.tools.plan.memory import (
    A3_DIE_HBM_GIB,
    A3_DIE_VISIBLE_GIB,
    HCCL_BUFFSIZE_MB_DEFAULT,
    VERL_ROLLOUT_DEFAULTS,
    VLLM_ASCEND_BLOCK_SIZE,
    DeviceBudget,
    RolloutLayout,
    TrainLayout,
    plan_rollout,
    plan_training,
)
from qwen3_rl.tools.plan.model import ModelSpec, PlanError, load_model_config

# verl Hydra key -> plan field (value type)
SCRIPT_KEYS: dict[str, tuple[str, type]] = {
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("rollout_tp", int),
    "actor_rollout_ref.rollout.expert_parallel_size": ("rollout_ep", int),
    "actor_rollout_ref.rollout.data_parallel_size": ("rollout_dp", int),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("gpu_memory_utilization", float),
    "actor_rollout_ref.rollout.max_num_batched_tokens": ("max_num_batched_tokens", int),
    "actor_rollout_ref.rollout.max_num_seqs": ("max_num_seqs", int),
    "data.max_prompt_length": ("max_prompt_length", int),
    "data.max_response_length": ("max_response_length", int),
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": ("actor_tp", int),
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": ("actor_pp", int),
    "actor_rollout_ref.actor.megatron.context_parallel_size": ("actor_cp", int),
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": ("actor_ep", int),
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": ("actor_etp", int),
    "actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage": (
        "actor_first_stage_layers",
        int,
    ),
    "actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage": (
        "actor_last_stage_layers",
        int,
    ),
    # verl's sync rollout passes engine_kwargs.vllm to vLLM as is: these win over the keys above
    "actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size": ("rollout_dp", int),
    "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel": ("rollout_ep_enabled", bool),
    "qwen3_rl.hdp.enable": ("actor_hdp", bool),
    "actor_rollout_ref.rollout.mode": ("rollout_mode", str),
    "actor_rollout_ref.rollout.agent.num_workers": ("agent_workers", int),
    "trainer.nnodes": ("nnodes", int),
    "trainer.n_gpus_per_node": ("n_gpus_per_node", int),
    # the fully-async setups' rollout pool (qwen3_rl.trainer.fully_async): its own dies, apart from the trainer's
    "rollout.nnodes": ("rollout_nnodes", int),
    "rollout.n_gpus_per_node": ("rollout_n_gpus_per_node", int),
}


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m qwen3_rl plan",
        description="Per-die memory plan: rollout weights / KV cache / concurrency and actor static memory.",
    )
    p.add_argument("--model-config", required=True, help="HF config.json (or model dir)")
    p.add_argument("--train-script", help="train script to read the layout from (flags override it)")
    r = p.add_argument_group("rollout (vLLM)")
    r.add_argument("--rollout-tp", type=int)
    r.add_argument("--rollout-ep", type=int, help="1 = off; else vLLM EP size (= TP×DP)")
    r.add_argument("--rollout-dp", type=int, help="vLLM data-parallel size inside one engine")
    r.add_argument("--max-model-len", type=int, help="default: max prompt + max response length")
    r.add_argument("--max-prompt-length", type=int)
    r.add_argument("--max-response-length", type=int)
    r.add_argument("--gpu-memory-utilization", type=float, help="verl default 0.5")
    r.add_argument("--max-num-batched-tokens", type=int, help="verl default 8192")
    r.add_argument("--max-num-seqs", type=int, help="verl default 1024")
    r.add_argument("--redundant-experts", type=int, default=0, help="EPLB redundant experts (whole EP group)")
    d = p.add_argument_group("device")
    d.add_argument("--hbm-gib", type=float, default=A3_DIE_HBM_GIB)
    d.add_argument("--visible-gib", type=float, default=A3_DIE_VISIBLE_GIB, help="torch-visible total")
    d.add_argument("--hccl-buffsize-mb", type=int, default=HCCL_BUFFSIZE_MB_DEFAULT,
                   help="HCCL_BUFFSIZE in MB (CANN default 200; internal/qwen3_235b_env.sh sets 512)")
    d.add_argument("--hccl-comms", type=int, help="override the rollout communicator count")
    d.add_argument("--activation-gib", type=float, help="override the activation-peak estimate")
    d.add_argument("--extra-reserved-gib", type=float, default=0.0, help="other memory held during rollout")
    d.add_argument("--block-size", type=int, default=VLLM_ASCEND_BLOCK_SIZE)
    t = p.add_argument_group("training (Megatron actor)")
    t.add_argument("--train-dies", type=int, help="actor world size (default nnodes × n_gpus_per_node)")
    t.add_argument("--nnodes", type=int)
    t.add_argument("--n-gpus-per-node", type=int)
    t.add_argument("--actor-tp", type=int)
    t.add_argument("--actor-pp", type=int)
    t.add_argument("--actor-cp", type=int)
    t.add_argument("--actor-ep", type=int)
    t.add_argument("--actor-etp", type=int, help="default: megatron's (= actor TP)")
    t.add_argument("--actor-first-stage-layers", type=int)
    t.add_argument("--actor-last-stage-layers", type=int)
    t.add_argument("--no-distributed-optimizer", action="store_true")
    t.add_argument("--actor-hdp", action="store_true", default=None,
                   help="qwen3_rl.hdp.enable: count the HCCL buffers of HDP's CP sub-groups")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _overrides_of(parsed: Any) -> dict[str, Any]:
    """Hydra overrides from what ``parse_train_script`` returns: a ``TrainCommand`` (its
    ``override_map()``), a mapping, a list of ``key=value`` strings, or an object with
    ``overrides`` of either kind."""
    if callable(getattr(parsed, "override_map", None)):
        parsed = parsed.override_map()
    for attr in ("overrides", "hydra_overrides"):
        if hasattr(parsed, attr):
            parsed = getattr(parsed, attr)
            break
    if isinstance(parsed, Mapping):
        return {str(k).lstrip("+~"): v for k, v in parsed.items()}
    if isinstance(parsed, Sequence) and not isinstance(parsed, str | bytes):
        out: dict[str, Any] = {}
        for item in parsed:
            if isinstance(item, str) and "=" in item:
                k, _, v = item.partition("=")
                out[k.strip().lstrip("+~")] = v.strip().strip("'\"")
        return out
    raise PlanError(f"parse_train_script returned {type(parsed).__name__}, expected overrides")


def _convert(raw: Any, typ: type) -> Any:
    """An override value (string from the command line, or already typed) as ``typ``."""
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ValueError(raw)
    if typ is int and isinstance(raw, str) and "." in raw:
        value = float(raw)
        if not value.is_integer():
            raise ValueError(raw)
        return int(value)
    return typ(raw)


def values_from_train_script(path: str) -> dict[str, Any]:
    """Read the layout fields of :data:`SCRIPT_KEYS` from a train script."""
    from qwen3_rl.tools.launch.train_script import parse_train_script

    try:
        overrides = _overrides_of(parse_train_script(path))
    except PlanError:
        raise
    except Exception as e:  # e.g. TrainScriptError: the parser's own errors become one line here
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PlanError(f"cannot read train script {path}: {first}") from None
    out: dict[str, Any] = {}
    for key, (name, typ) in SCRIPT_KEYS.items():
        if key not in overrides or overrides[key] in (None, "null", "None", ""):
            continue
        raw = overrides[key]
        try:
            out[name] = _convert(raw, typ)
        except (TypeError, ValueError):
            raise PlanError(f"{path}: {key}={raw!r}: expected {typ.__name__}") from None
    return out


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Merge: explicit flags > train script > verl defaults."""
    vals: dict[str, Any] = values_from_train_script(args.train_script) if args.train_script else {}
    for name in {n for n, _ in SCRIPT_KEYS.values()} | {"max_model_len", "train_dies"}:
        flag = getattr(args, name, None)
        if flag is not None:
            vals[name] = flag
    enabled = vals.pop("rollout_ep_enabled", None)
    if enabled is not None and args.rollout_ep is None:
        # vLLM's EP size is TP×DP once enable_expert_parallel is on
        vals["rollout_ep"] = (vals.get("rollout_tp") or 1) * (vals.get("rollout_dp") or 1) if enabled else 1
    return vals


def build_plan(spec: ModelSpec, vals: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Assemble rollout and (when an actor layout is known) training plans."""
    if vals.get("rollout_tp") is None:
        raise PlanError("rollout TP unknown: give --rollout-tp or a --train-script that sets it")
    max_len = vals.get("max_model_len")
    if max_len is None:
        if vals.get("max_prompt_length") is None or vals.get("max_response_length") is None:
            raise PlanError("max model length unknown: give --max-model-len or prompt and response lengths")
        max_len = vals["max_prompt_length"] + vals["max_response_length"]
    lay = RolloutLayout(
        tp=vals["rollout_tp"],
        ep=vals.get("rollout_ep") or 1,
        dp=vals.get("rollout_dp") or 1,
        max_model_len=max_len,
        gpu_memory_utilization=vals.get(
            "gpu_memory_utilization", VERL_ROLLOUT_DEFAULTS["gpu_memory_utilization"]
        ),
        max_num_batched_tokens=vals.get(
            "max_num_batched_tokens", VERL_ROLLOUT_DEFAULTS["max_num_batched_tokens"]
        ),
        max_num_seqs=vals.get("max_num_seqs", VERL_ROLLOUT_DEFAULTS["max_num_seqs"]),
        redundant_experts=args.redundant_experts,
    )
    dev = DeviceBudget(
        hbm_gib=args.hbm_gib,
        visible_gib=args.visible_gib,
        hccl_buffsize_mb=args.hccl_buffsize_mb,
        hccl_comms=args.hccl_comms,
        activation_gib=args.activation_gib,
        extra_reserved_gib=args.extra_reserved_gib,
        block_size=args.block_size,
    )
    plan: dict[str, Any] = {
        "model": {
            "name": spec.name,
            "total_params": spec.total_params(),
            "layers": spec.num_layers,
            "moe": spec.is_moe,
        },
        "rollout": plan_rollout(spec, lay, dev),
        "training": None,
    }
    plan["rollout"]["mode"] = rollout_mode_plan(vals)
    world = vals.get("train_dies")
    if world is None and vals.get("nnodes") and vals.get("n_gpus_per_node"):
        world = vals["nnodes"] * vals["n_gpus_per_node"]
    if vals.get("actor_tp") is not None:
        if world is None:
            raise PlanError("actor world size unknown: give --train-dies or --nnodes and --n-gpus-per-node")
        tl = TrainLayout(
            world=world,
            tp=vals["actor_tp"],
            pp=vals.get("actor_pp") or 1,
            cp=vals.get("actor_cp") or 1,
            ep=vals.get("actor_ep") or 1,
            etp=vals.get("actor_etp"),
            first_stage_layers=vals.get("actor_first_stage_layers"),
            last_stage_layers=vals.get("actor_last_stage_layers"),
            distributed_optimizer=not args.no_distributed_optimizer,
            hdp=bool(vals.get("actor_hdp")),
        )
        plan["training"] = plan_training(spec, tl, args.hccl_buffsize_mb)
    return plan


def rollout_mode_plan(vals: Mapping[str, Any]) -> dict[str, Any]:
    """The rollout mode and what it starts: ``sync`` (verl's SPMD engines inside the workers) or ``async`` (server
    mode: one vLLM server per replica of TP x DP dies, verl/experimental/agent_loop/agent_loop.py:665-679, and the
    agent-loop workers that send the requests). The servers run on the rollout pool's dies in a fully-async setup
    (``rollout.nnodes`` x ``rollout.n_gpus_per_node``), else on the trainer's. ``servers`` is None while the world size
    is unknown."""
    mode = str(vals.get("rollout_mode") or "sync")
    out: dict[str, Any] = {"mode": mode}
    if mode != "async":
        return out
    if vals.get("rollout_nnodes") and vals.get("rollout_n_gpus_per_node"):
        world = vals["rollout_nnodes"] * vals["rollout_n_gpus_per_node"]
    else:
        world = vals.get("train_dies")
        if world is None and vals.get("nnodes") and vals.get("n_gpus_per_node"):
            world = vals["nnodes"] * vals["n_gpus_per_node"]
    replica = (vals.get("rollout_tp") or 1) * (vals.get("rollout_dp") or 1)
    out.update(replica_dies=replica, servers=None if world is None else world // replica,
               agent_workers=vals.get("agent_workers", 8))
    return out


def format_plan(plan: Mapping[str, Any]) -> str:
    """Human-readable summary of :func:`build_plan`'s result."""
    r = plan["rollout"]
    lay, dev, res = r["layout"], r["device"], r["reserved"]
    pin_set = plan.get("pin_set", "seed")
    lines = [
        f"pin set: {pin_set}" + ("" if pin_set == "seed" else
                                 " (the memory model's vLLM-Ascend constants are read from the seed set's 0.13)"),
        f"model: {plan['model']['name']}  params {plan['model']['total_params'] / 1e9:.2f} B",
        f"rollout TP{lay['tp']} EP{lay['ep']} DP{lay['dp']}  max_model_len {lay['max_model_len']}  "
        f"gpu_memory_utilization {lay['gpu_memory_utilization']}",
        f"  weights per die       {r['weights_gib_per_die']:.3f} GiB ({r['weights_params_per_die'] / 1e9:.3f} B params)",
        f"  KV per token per die  {r['kv_bytes_per_token_per_die']} B ({r['kv_heads_per_die']} KV head(s)/die)",
        f"  KV per sequence       {r['kv_gib_per_seq']:.3f} GiB",
        f"  device                {dev['hbm_gib']:.2f} GiB HBM, {dev['visible_gib']:.2f} visible, "
        f"requested {dev['requested_gib']:.2f}, headroom {dev['headroom_gib']:.2f} (graph capture)",
        f"  reserved              activation {res['activation_gib']:.2f}"
        f"{' (estimate)' if res['activation_estimated'] else ''}, HCCL {res['hccl_gib']:.2f} "
        f"({res['hccl_comms']} comms × 2 × {res['hccl_buffsize_mb']} MB), extra {res['extra_gib']:.2f}",
        f"  KV budget             {r['kv_budget_gib']:.2f} GiB = {r['num_blocks']} blocks of {r['block_size']} tokens",
        f"  max concurrent seqs   {r['max_concurrent_seqs']} at full length "
        f"(max_num_seqs {lay['max_num_seqs']})",
    ]
    m = r.get("mode") or {"mode": "sync"}
    if m["mode"] == "async":
        servers = "?" if m["servers"] is None else m["servers"]
        lines.append(f"  mode                  async: {servers} vLLM server(s) of {m['replica_dies']} dies, "
                     f"{m['agent_workers']} agent-loop workers (memory per die as in sync mode)")
    else:
        lines.append("  mode                  sync: SPMD engines in the worker processes")
    t = plan.get("training")
    if t:
        tl = t["layout"]
        moe = f" EP{tl['ep']} ETP{tl['etp']}" if tl["expert_dp"] is not None else ""
        edp = f", expert DP {tl['expert_dp']}" if tl["expert_dp"] is not None else ""
        lines += [
            f"actor TP{tl['tp']} PP{tl['pp']} CP{tl['cp']}{moe} on {tl['world']} dies "
            f"(DP {tl['dp']}{edp}), stages {t['stage_layers']}",
            f"  params per die        {t['params_per_die'] / 1e9:.3f} B ({t['params_gib']:.2f} GiB bf16)",
            f"  grads {t['grads_gib']:.2f} GiB  optimizer {t['optimizer_gib']:.2f} GiB  "
            f"static total {t['static_gib']:.2f} GiB",
        ]
        if t.get("hdp"):
            h = t["hdp"]
            lines.append(f"  HDP sub-groups        HCCL {h['hccl_gib']:.2f} GiB ({h['hccl_comms_per_die']} comms × 2 × "
                         f"{h['hccl_buffsize_mb']} MB)")
    else:
        lines.append("actor: no layout given (--actor-tp ...), training estimate skipped")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: returns 0 on success, 1 on a plan error (one line on stderr), 2 on usage errors."""
    from qwen3_rl.tools.pins import PinError, resolve_pin_set

    args = _build_parser().parse_args(argv)
    try:
        pin_set = resolve_pin_set()
        spec = load_model_config(args.model_config)
        plan = build_plan(spec, _resolve(args), args)
    except (PlanError, PinError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    plan["pin_set"] = pin_set
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
