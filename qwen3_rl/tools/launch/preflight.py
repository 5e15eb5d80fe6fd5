"""``python -m qwen3_rl preflight TRAIN_SCRIPT``: catch launch mistakes before Ray starts.

Reads the train script through :func:`qwen3_rl.tools.launch.train_script.parse_train_script` (the final
verl command with every default resolved), then checks, all at once:

* node: NPUs visible (``npu-smi info -m``), CANN sourced, pinned trees present and every patch
  applied (``apply_all_patches.sh --status``); on the current set, MindSpeed's adaptor imports the way verl 0.9.1
  imports it (:mod:`qwen3_rl.tools.launch.mindspeed_check`: else verl trains without MindSpeed, silently);
* files: model path has ``config.json`` and weights (or the Megatron dist checkpoint when that is
  what is loaded), train/val parquet files carry verl's columns;
* layout: world size = nnodes × NPUs, actor TP×PP×CP divides the world and the expert layout
  (EP×ETP×PP) too, EP divides the experts, TP divides heads and KV heads, layers split over PP,
  rollout TP×DP = world;
* batches: the sizes verl and Megatron divide really divide;
* features: the requires / excludes rules of ``features.toml`` on the final command (extra Hydra arguments
  included), one ``error: [feature] ...`` line per broken rule;
* rollout log-probs: with the rollout's log-probs in the loss (``async_training.use_rollout_log_probs`` or
  ``algorithm.rollout_correction.rollout_is``), sampling that makes them not the behaviour policy's (temperature
  other than 1, top-p below 1, top-k) is an error;
* SAM cost table (``SAM_COST_TABLE``): the file exists and parses as a cost table for the longest draft;
* lengths: prompt + response fits the model's context (and the dynamic-batch token budget);
* environment contract (:mod:`qwen3_rl.tools.launch.env_contract`): the environment the Ray workers will get
  -- the user's, then the launcher's env file(s) sourced by bash exactly as ``ray_start_npu.sh`` does
  (``--env-script`` with ``set -a``, then ``--npu-env``), then the command's Ray runtime-env variables --
  and the engine keys, against what the pinned verl / vLLM / vLLM-Ascend refuse at start-up, sleep or
  wake-up (the rules of the pin set ``PIN_SET`` selects: seed or current). One line per broken rule:
  ``error: env-contract[<id>]: VAR=value ... (file:line)``.
  ``--env-only`` runs just this check (the launcher runs it even with ``--no-preflight``).

Each problem is one line; the command exits 1 when any error is found. Warnings (e.g. very low KV
concurrency from the per-die memory planner ``qwen3_rl.tools.plan``) do not fail the check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen3_rl.tools.launch.env_contract import (
    CONTRACT_CHECK,
    DEFAULT_NPU_ENV,
    RULES_BY_SET,
    EngineContext,
    EnvResolveError,
    check_env,
    resolve_launch_env,
    rules_for,
)
from qwen3_rl.tools.launch.npu_smi import NpuSmiError, parse_chip_map, run_npu_smi
from qwen3_rl.tools.launch.train_script import TrainCommand, TrainScriptError, parse_train_script
from qwen3_rl.tools.pins import PinError, resolve_pin_set

REPO = Path(__file__).resolve().parents[3]

# columns verl's RLHFDataset (prompt key) and reward managers (data_source, reward_model) read
REQUIRED_COLUMNS = ("data_source", "reward_model")
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt")
LOW_KV_CONCURRENCY = 8  # warn when a rollout engine fits fewer full-length sequences than this

A = "actor_rollout_ref.actor."
M = A + "megatron."
R = "actor_rollout_ref.rollout."


@dataclass(frozen=True)
class Finding:
    """One preflight result line: ``level`` is ``error`` or ``warning``; ``check`` names the group."""

    level: str
    check: str
    message: str

    def line(self) -> str:
        if self.check.startswith(CONTRACT_CHECK + "["):  # env-contract[<rule id>]: names the rule itself
            return f"{self.level}: {self.check}: {self.message}"
        return f"{self.level}: [{self.check}] {self.message}"


def _err(check: str, msg: str) -> Finding:
    return Finding("error", check, msg)


def _warn(check: str, msg: str) -> Finding:
    return Finding("warning", check, msg)


def _get_int(vals: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    raw = vals.get(key)
    if raw is None or raw in ("null", "None", ""):
        return default
    return int(raw)


def _get_bool(vals: Mapping[str, str], key: str, default: bool) -> bool:
    raw = vals.get(key)
    if raw is None:
        return default
    return raw.strip().lower() in ("true", "1", "yes")


def hydra_list(raw: str | None) -> list[str]:
    """``"[a,'b']"`` or ``"a"`` -> ``["a", "b"]`` (Hydra list-or-scalar override values)."""
    if raw is None or raw in ("", "null", "None"):
        return []
    s = raw.strip()
    if s.startswith("[") and s.endswith("]"):
        s = s[1:-1]
    return [p.strip().strip("'\"") for p in s.split(",") if p.strip()]


# --- layout / batch / length checks: pure functions of the override map and the model config ----
def is_fully_async(vals: Mapping[str, str]) -> bool:
    """The command runs the fully-async trainer (``qwen3_rl.trainer.fully_async``): separate trainer
    (``trainer.*``) and rollout (``rollout.nnodes`` x ``rollout.n_gpus_per_node``) pools."""
    return any(k.startswith("async_training.") for k in vals) or "rollout.n_gpus_per_node" in vals


def check_world(vals: Mapping[str, str], nnodes: int | None, npus_per_node: int | None) -> list[Finding]:
    """trainer.nnodes × n_gpus_per_node must equal the launcher's nodes × NPUs; with the fully-async trainer the
    trainer's and the rollout's pools together (the same nodes)."""
    t_nodes, t_npus = _get_int(vals, "trainer.nnodes"), _get_int(vals, "trainer.n_gpus_per_node")
    if t_nodes is None or t_npus is None:
        return [_err("world", "train script sets no trainer.nnodes / trainer.n_gpus_per_node")]
    what = ""
    if is_fully_async(vals):
        r_nodes, r_npus = _get_int(vals, "rollout.nnodes", 1) or 1, _get_int(vals, "rollout.n_gpus_per_node", 0) or 0
        if r_nodes != t_nodes:
            return [_err("world", f"fully async: trainer on {t_nodes} node(s), rollout on {r_nodes}: the launcher "
                                  "starts one node count for both")]
        what = f" (trainer {t_npus} + rollout {r_npus})"
        t_npus += r_npus
    out = []
    if nnodes is not None and npus_per_node is not None and (t_nodes, t_npus) != (nnodes, npus_per_node):
        out.append(_err("world", f"train script wants {t_nodes} nodes x {t_npus} NPUs{what} = {t_nodes * t_npus}, "
                                 f"the launcher has {nnodes} x {npus_per_node} = {nnodes * npus_per_node}"))
    return out


def world_size(vals: Mapping[str, str]) -> int:
    return (_get_int(vals, "trainer.nnodes", 1) or 1) * (_get_int(vals, "trainer.n_gpus_per_node", 1) or 1)


def check_layout(vals: Mapping[str, str], cfg: Mapping[str, Any] | None) -> list[Finding]:
    """Actor (Megatron) and rollout (vLLM) parallel sizes against the world and the model shape."""
    out: list[Finding] = []
    world = world_size(vals)
    tp, pp, cp = (_get_int(vals, M + k, 1) or 1 for k in
                  ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    ep = _get_int(vals, M + "expert_model_parallel_size", 1) or 1
    etp = _get_int(vals, M + "expert_tensor_parallel_size") or tp
    mp = tp * pp * cp
    if world % mp:
        out.append(_err("layout", f"actor TP{tp} x PP{pp} x CP{cp} = {mp} does not divide the world size {world}"))
    if world % (ep * etp * pp):
        out.append(_err("layout", f"actor EP{ep} x ETP{etp} x PP{pp} = {ep * etp * pp} does not divide the world "
                                  f"size {world} (megatron expert data parallel)"))
    rtp = _get_int(vals, R + "tensor_model_parallel_size", 1) or 1
    rdp = _get_int(vals, R + "engine_kwargs.vllm.data_parallel_size")
    if is_fully_async(vals):  # the rollout has its own pool
        world = (_get_int(vals, "rollout.nnodes", 1) or 1) * (_get_int(vals, "rollout.n_gpus_per_node", 1) or 1)
    if world % rtp:
        out.append(_err("layout", f"rollout TP{rtp} does not divide the world size {world}"))
    elif rdp is not None and rdp > 1 and rtp * rdp != world:  # vLLM DP 1: independent TP engines (verl's DP)
        out.append(_err("layout", f"rollout TP{rtp} x DP{rdp} = {rtp * rdp} != world size {world} "
                                  "(sync rollout puts one rank on every die)"))
    if cfg is None:
        return out
    heads = int(cfg.get("num_attention_heads", 0) or 0)
    kv = int(cfg.get("num_key_value_heads", heads) or heads)
    experts = int(cfg.get("num_experts", 0) or 0)
    layers = int(cfg.get("num_hidden_layers", 0) or 0)
    if heads and heads % tp:
        out.append(_err("layout", f"actor TP{tp} does not divide the {heads} attention heads"))
    if kv and kv % tp:
        out.append(_err("layout", f"actor TP{tp} does not divide the {kv} KV heads (megatron num_query_groups)"))
    if kv and (kv % rtp if kv >= rtp else rtp % kv):
        out.append(_err("layout", f"rollout TP{rtp} and the {kv} KV heads: one must divide the other (vLLM)"))
    if experts and experts % ep:
        out.append(_err("layout", f"actor EP{ep} does not divide the {experts} experts"))
    if not experts and ep > 1:
        out.append(_err("layout", f"actor EP{ep} > 1 but the model has no experts"))
    first = _get_int(vals, M + "override_transformer_config.num_layers_in_first_pipeline_stage")
    last = _get_int(vals, M + "override_transformer_config.num_layers_in_last_pipeline_stage")
    if layers and pp > 1:
        if first is None and last is None:
            if layers % pp:
                out.append(_err("layout", f"{layers} layers do not split evenly over PP{pp}; set "
                                          "override_transformer_config.num_layers_in_first/last_pipeline_stage "
                                          "(megatron/core/transformer/transformer_block.py asserts it)"))
        else:
            stages = pp - (first is not None) - (last is not None)
            rest = layers - (first or 0) - (last or 0)
            if rest < 0 or (stages == 0 and rest) or (stages and rest % stages):
                out.append(_err("layout", f"first/last stage layers {first}/{last} leave {rest} of {layers} "
                                          f"layers for {stages} middle stage(s)"))
    return out


def check_batches(vals: Mapping[str, str], pin_set: str = "seed") -> list[Finding]:
    """Batch sizes that verl's trainer and Megatron workers divide.

    The fully-async command on a non-seed pin set runs verl 0.9.1's own fully-async trainer, whose rollouter asserts
    ``data.train_batch_size`` 0 and ``data.gen_batch_size`` 1 (prompts one at a time,
    ``experimental/fully_async_policy/fully_async_rollouter.py:350-352``) and hands the trainer
    ``async_training.require_batches`` x ``ppo_mini_batch_size`` prompts per update (``:424``): that product is the
    batch the divisibility rules below check there."""
    out: list[Finding] = []
    world = world_size(vals)
    gbs = _get_int(vals, "data.train_batch_size")
    n = _get_int(vals, R + "n", 1) or 1
    mini = _get_int(vals, A + "ppo_mini_batch_size")
    if gbs is None:
        return [_err("batch", "data.train_batch_size is not set")]
    if is_fully_async(vals) and pin_set != "seed":
        gen = _get_int(vals, "data.gen_batch_size")
        if gbs != 0:
            out.append(_err("batch", f"fully async on pin set {pin_set}: data.train_batch_size {gbs} must be 0 (verl's "
                                     "rollouter asserts it, fully_async_rollouter.py:351; an update takes "
                                     "async_training.require_batches x ppo_mini_batch_size prompts)"))
        if gen != 1:
            out.append(_err("batch", f"fully async on pin set {pin_set}: data.gen_batch_size {gen} must be 1 (verl's "
                                     "rollouter asserts it, fully_async_rollouter.py:352)"))
        if mini is None:
            return out + [_err("batch", "actor_rollout_ref.actor.ppo_mini_batch_size is not set")]
        gbs = (_get_int(vals, "async_training.require_batches", 1) or 1) * mini  # the prompts of one update
    elif is_fully_async(vals):  # qwen3_rl.trainer.fully_async: one dataloader batch per actor update
        req = _get_int(vals, "async_training.require_batches", 1) or 1
        if mini is not None and gbs != req * mini:
            out.append(_err("batch", f"fully async: data.train_batch_size {gbs} must be async_training."
                                     f"require_batches {req} x ppo_mini_batch_size {mini} = {req * mini}"))
    tp, pp, cp = (_get_int(vals, M + k, 1) or 1 for k in
                  ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else None
    if mini is not None:
        if mini > gbs or gbs % mini:
            out.append(_err("batch", f"data.train_batch_size {gbs} is not a multiple of ppo_mini_batch_size {mini}"))
        if dp and (mini * n) % dp:
            out.append(_err("batch", f"ppo_mini_batch_size {mini} x n {n} = {mini * n} does not divide over the "
                                     f"actor's {dp} data-parallel ranks"))
        micro = _get_int(vals, A + "ppo_micro_batch_size_per_gpu")
        dyn = _get_bool(vals, A + "use_dynamic_bsz", False)
        if dp and micro and not dyn and (mini * n) % dp == 0 and ((mini * n) // dp) % micro:
            out.append(_err("batch", f"per-rank mini-batch {(mini * n) // dp} is not a multiple of "
                                     f"ppo_micro_batch_size_per_gpu {micro}"))
    if (gbs * n) % world:
        out.append(_err("batch", f"train_batch_size {gbs} x n {n} = {gbs * n} does not split over the {world} "
                                 "ranks the rollout batch is dispatched to"))
    gen = _get_int(vals, "data.gen_batch_size")
    if gen is not None and gen < gbs and not is_fully_async(vals):
        out.append(_err("batch", f"data.gen_batch_size {gen} < train_batch_size {gbs}"))
    return out


def check_lengths(vals: Mapping[str, str], cfg: Mapping[str, Any] | None) -> list[Finding]:
    """Prompt + response against the model context and the dynamic-batch token budget."""
    out: list[Finding] = []
    p = _get_int(vals, "data.max_prompt_length")
    r = _get_int(vals, "data.max_response_length")
    if p is None or r is None:
        return [_err("length", "data.max_prompt_length / data.max_response_length not set")]
    total = p + r
    ctx = int(cfg.get("max_position_embeddings", 0) or 0) if cfg else 0
    if ctx and total > ctx:
        out.append(_err("length", f"prompt {p} + response {r} = {total} > the model's max_position_embeddings {ctx}"))
    mml = _get_int(vals, R + "max_model_len")
    if mml is not None and mml < total:
        out.append(_err("length", f"rollout.max_model_len {mml} < prompt + response {total}"))
    if _get_bool(vals, A + "use_dynamic_bsz", False):
        budget = _get_int(vals, A + "ppo_max_token_len_per_gpu")
        if budget is not None and budget < total:
            out.append(_err("length", f"ppo_max_token_len_per_gpu {budget} < prompt + response {total}: one "
                                      "sequence would not fit a micro-batch"))
    # max_num_batched_tokens against max_model_len / max_num_seqs: env-contract rules (verl and vLLM refuse it)
    return out


def check_feature_rules(vals: Mapping[str, str], setup: str | None = None, pin_set: str = "seed") -> list[Finding]:
    """The requires / excludes rules of the feature registry (``features.toml``) on the final command, hand-written
    Hydra arguments included (the train script checks the same rules on its env vars before it prints anything):
    each switch's value is read back from the keys it sets on ``pin_set`` (its ``current.sets`` there when declared;
    :func:`qwen3_rl.tools.features.values_from_overrides`).
    ``setup``: the train script's file name (its switches and defaults; None = every switch)."""
    from qwen3_rl.tools.features import FeatureError, check_command

    try:
        return [_err("feature", msg) for msg in check_command(vals, setup, pin_set=pin_set)]
    except FeatureError as exc:
        return [_err("feature", f"features.toml: {exc}")]


def check_spec_decode_requests(vals: Mapping[str, str]) -> list[Finding]:
    """A drafter whose every rollout request vLLM 0.13 would leave undrafted (``vllm/v1/spec_decode/utils.py:9-17``:
    penalties, ``min_p``): a warning per setting. Requests with log-probs (``calculate_log_probs``) are drafted
    with vllm 0004, in both rollout modes."""
    from qwen3_rl.spec_decode.requests import unsupported_reasons

    method = vals.get(R + "engine_kwargs.vllm.speculative_config.method")
    if not method:
        return []
    out = []
    sampling = {k: vals[R + k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")
                if R + k in vals}
    for why in unsupported_reasons(sampling):
        out.append(_warn("spec-decode", f"speculative_config.method={method} drafts nothing: every rollout request "
                                        f"has {why} (vllm/v1/spec_decode/utils.py:9-17)"))
    return out


def check_rollout_log_probs(vals: Mapping[str, str], pin_set: str = "seed") -> list[Finding]:
    """The rollout's log-probs stand for the behaviour policy (as the old log-probs, or as pi_rollout in the rollout
    correction): vLLM returns them raw, before temperature / top-p / top-k, so any of those changes the sampling
    policy away from them (one error naming the settings). The old-log-prob key is the pin set's: seed
    ``async_training.use_rollout_log_probs``; current ``algorithm.rollout_correction.bypass_mode`` (verl 0.9.1,
    USE_ROLLOUT_LOG_PROBS's ``current.sets`` in features.toml)."""
    from qwen3_rl.trainer.fully_async.settings import behaviour_log_prob_problems

    old_key = "async_training.use_rollout_log_probs" if pin_set == "seed" else "algorithm.rollout_correction.bypass_mode"
    as_old = _get_bool(vals, old_key, False)
    corr = (vals.get("algorithm.rollout_correction.rollout_is") or "null").strip("'\"")
    if not as_old and corr in ("null", "None", "~", ""):
        return []
    use = f"{old_key}=True" if as_old else f"algorithm.rollout_correction.rollout_is={corr}"
    bad = behaviour_log_prob_problems(float(vals.get(R + "temperature", "1.0")), float(vals.get(R + "top_p", "1.0")),
                                      _get_int(vals, R + "top_k", -1))
    if not bad:
        return []
    return [_err("rollout-log-probs", f"{', '.join(bad)} with {use}: vLLM's log-probs are taken before temperature / "
                                      "top-p / top-k, so they are not the sampling policy's (set temperature 1, "
                                      "top_p 1, top_k -1, or turn USE_ROLLOUT_LOG_PROBS / ROLLOUT_CORRECTION off)")]


def check_server_mode(vals: Mapping[str, str]) -> list[Finding]:
    """Server-mode rollout (``rollout.mode=async``, verl's agent loop over vLLM servers): what verl 0.6.1 needs of
    the command that the sync rollout does not (one error each)."""
    if (vals.get(R + "mode") or "sync").strip("'\"") != "async":
        return []
    out = []
    if not _get_bool(vals, "data.return_raw_chat", False):
        out.append(_err("server-mode", "rollout.mode=async needs data.return_raw_chat=True: the agent loop builds each "
                                       "request from the chat messages (verl/experimental/agent_loop/"
                                       "single_turn_agent_loop.py:38 reads raw_prompt, which verl/utils/dataset/"
                                       "rl_dataset.py:434-435 fills only then); ROLLOUT_MODE=async sets it"))
    workers = _get_int(vals, R + "agent.num_workers", 8) or 8
    rows = (_get_int(vals, "data.train_batch_size", 0) or 0) * (_get_int(vals, R + "n", 1) or 1)
    if rows and rows % workers:
        out.append(_err("server-mode", f"rollout.mode=async splits each generation batch of {rows} rows (prompts x n) "
                                       f"over rollout.agent.num_workers={workers} agent-loop workers in equal pieces "
                                       "(verl/protocol.py:895-898 DataProto.chunk asserts it): use a worker count that "
                                       "divides it (ROLLOUT_AGENT_WORKERS)"))
    return out


def check_sam_cost_table(vals: Mapping[str, str]) -> list[Finding]:
    """``sam_config.cost_table`` (``SAM_COST_TABLE``): the file must exist, parse as a cost table naming one shape
    (``FILE@SHAPE`` when it holds several) and measure drafts as long as ``num_speculative_tokens``; one error line
    otherwise (the engine would refuse it at start-up). The table is read by the runtime's own loader (numpy, numba):
    a launcher python without them gets a warning instead, and the engine checks the table at start-up."""
    sc = R + "engine_kwargs.vllm.speculative_config."
    spec = (vals.get(sc + "sam_config.cost_table") or "").strip().strip("'\"")
    if not spec or vals.get(sc + "method") != "sam":
        return []
    if spec == "calibrate":
        return [_err("spec-decode", "SAM_COST_TABLE=calibrate is replaced by the launcher (ray_start_npu.sh, head) "
                                    "with the table it measures first; without the launcher run python -m qwen3_rl "
                                    "calibrate --setup SCRIPT and give SAM_COST_TABLE=<that file>")]
    try:
        from qwen3_rl.spec_decode.cost_table import CostTableError, load_cost_table
    except ImportError as exc:  # tooling does not need the runtime stack (a bare launcher host)
        return [_warn("spec-decode", f"sam_config.cost_table: {spec} not checked here ({exc}); the engine checks it "
                                     "at start-up")]
    try:
        table = load_cost_table(spec)
    except CostTableError as exc:
        return [_err("spec-decode", f"sam_config.cost_table: {exc}")]
    k = _get_int(vals, sc + "num_speculative_tokens", 0) or 0
    if k > table.k_max:
        return [_err("spec-decode", f"sam_config.cost_table: {spec} measures k <= {table.k_max}, below "
                                    f"num_speculative_tokens = {k} (the longest draft)")]
    return []


def check_kv_concurrency(vals: Mapping[str, str], cfg: Mapping[str, Any] | None) -> list[Finding]:
    """Warn when the per-die memory plan leaves room for very few full-length sequences."""
    if not cfg:
        return []
    from qwen3_rl.tools.plan.memory import RolloutLayout, plan_rollout
    from qwen3_rl.tools.plan.model import PlanError, model_spec_from_dict

    try:
        spec = model_spec_from_dict(cfg, source="config.json")
        rtp = _get_int(vals, R + "tensor_model_parallel_size", 1) or 1
        rdp = _get_int(vals, R + "engine_kwargs.vllm.data_parallel_size") or 1
        ep = rtp * rdp if _get_bool(vals, R + "engine_kwargs.vllm.enable_expert_parallel", False) else 1
        p = _get_int(vals, "data.max_prompt_length", 0) or 0
        r = _get_int(vals, "data.max_response_length", 0) or 0
        lay = RolloutLayout(tp=rtp, ep=ep, dp=rdp, max_model_len=p + r,
                            gpu_memory_utilization=float(vals.get(R + "gpu_memory_utilization", "0.5")),
                            max_num_batched_tokens=_get_int(vals, R + "max_num_batched_tokens", 8192) or 8192,
                            max_num_seqs=_get_int(vals, R + "max_num_seqs", 1024) or 1024)
        plan = plan_rollout(spec, lay)
    except (PlanError, ValueError, KeyError) as exc:
        return [_warn("memory", f"memory plan not computed: {str(exc).splitlines()[0]}")]
    conc = plan["max_concurrent_seqs"]
    if conc < LOW_KV_CONCURRENCY:
        return [_warn("memory", f"KV cache fits only {conc} sequences of {p + r} tokens per rollout engine "
                                f"(KV budget {plan['kv_budget_gib']:.1f} GiB/die; see python -m qwen3_rl plan)")]
    return []


def check_contract(cmd: TrainCommand, cfg: Mapping[str, Any] | None, pin_set: str = "seed") -> list[Finding]:
    """The environment contract of ``pin_set`` on the command's environment and engine keys (one error per broken
    rule; a set without a contract is one warning)."""
    if pin_set not in RULES_BY_SET:
        return [_warn(CONTRACT_CHECK, f"pin set {pin_set}: no environment contract for this set; not checked")]
    ctx = EngineContext.from_overrides(cmd.override_map(), cfg, pin_set=pin_set)
    return [_err(f"{CONTRACT_CHECK}[{v.rule.id}]", v.message())
            for v in check_env(cmd.env, ctx, rules_for(pin_set))]


# --- file checks ---------------------------------------------------------------------------------
def load_config(model_path: str | None) -> dict[str, Any] | None:
    if not model_path:
        return None
    f = Path(model_path) / "config.json"
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def check_model(vals: Mapping[str, str]) -> list[Finding]:
    """Model directory: config.json always; HF weights or the dist checkpoint, whichever is loaded."""
    out: list[Finding] = []
    path = vals.get("actor_rollout_ref.model.path")
    if not path:
        return [_err("model", "actor_rollout_ref.model.path is not set")]
    p = Path(path)
    if not p.is_dir():
        return [_err("model", f"model path {p} does not exist")]
    cfg = p / "config.json"
    if not cfg.is_file():
        out.append(_err("model", f"{cfg} is missing"))
    elif load_config(path) is None:
        out.append(_err("model", f"{cfg} is not valid JSON"))
    load_weight = _get_bool(vals, A + "load_weight", True)
    dist = _get_bool(vals, M + "use_dist_checkpointing", False)
    if load_weight and dist:
        d = vals.get(M + "dist_checkpointing_path")
        if not d or not Path(d).is_dir() or not any(Path(d).iterdir()):
            out.append(_err("model", f"use_dist_checkpointing=True but the dist checkpoint {d} is missing or empty"))
    elif load_weight and not any(next(p.glob(g), None) for g in WEIGHT_GLOBS):
        out.append(_err("model", f"no weights (*.safetensors / *.bin) in {p} and actor.load_weight is on"))
    return out


def check_datasets(vals: Mapping[str, str]) -> list[Finding]:
    """Train / val parquet files exist and have verl's columns."""
    out: list[Finding] = []
    prompt_key = vals.get("data.prompt_key", "prompt")
    files = [("data.train_files", f) for f in hydra_list(vals.get("data.train_files"))]
    files += [("data.val_files", f) for f in hydra_list(vals.get("data.val_files"))]
    if not any(k == "data.train_files" for k, _ in files):
        out.append(_err("data", "data.train_files is not set"))
    for key, f in files:
        path = Path(f)
        if not path.is_file():
            out.append(_err("data", f"{key}: {path} not found"))
            continue
        try:
            import pyarrow.parquet as pq
        except ImportError:  # a python without the runtime stack (a dry run on a login node): the file only
            out.append(_warn("data", f"{key}: {path} exists; its columns are not checked (no pyarrow in "
                                     f"{sys.executable})"))
            continue
        try:
            names = set(pq.read_schema(path).names)
        except Exception as exc:  # pyarrow raises several types for a non-parquet file
            out.append(_err("data", f"{key}: {path} is not a readable parquet file ({type(exc).__name__})"))
            continue
        missing = [c for c in (prompt_key, *REQUIRED_COLUMNS) if c not in names]
        if missing:
            out.append(_err("data", f"{key}: {path} lacks verl column(s) {', '.join(missing)} "
                                    f"(has {', '.join(sorted(names))}); see python -m qwen3_rl data prepare"))
    return out


# --- node checks ---------------------------------------------------------------------------------
def check_npus(npus_per_node: int) -> list[Finding]:
    """``npu-smi info -m`` lists at least ``npus_per_node`` compute dies."""
    try:
        chips = parse_chip_map(run_npu_smi("info", "-m"))
    except NpuSmiError as exc:
        return [_err("npu", str(exc))]
    if len(chips) < npus_per_node:
        return [_err("npu", f"npu-smi shows {len(chips)} NPU dies, the launch needs {npus_per_node} per node")]
    return []


def check_cann(env: Mapping[str, str]) -> list[Finding]:
    """CANN's set_env.sh exports ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME; both unset = not sourced."""
    for key in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        val = env.get(key)
        if val:
            if not Path(val).is_dir():
                return [_err("cann", f"{key}={val} does not exist")]
            return []
    return [_err("cann", "CANN is not sourced (ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME unset); "
                         "source internal/npu_env.sh or the toolkit's set_env.sh")]


def check_patches(workspace: str | None, only: str | None = None, timeout_s: float = 300.0,
                  pin_set: str = "seed") -> list[Finding]:
    """Every pinned tree present and every patch applied, from ``apply_all_patches.sh --status`` (of ``pin_set``)."""
    cmd = ["bash", str(REPO / "apply_all_patches.sh"), "--status", "--pin-set", pin_set]
    if workspace:
        cmd += ["--workspace", workspace]
    if only:
        cmd += ["--only", only]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return [_err("patches", f"apply_all_patches.sh --status did not finish within {timeout_s:.0f} s")]
    rows = [ln.split(None, 2) for ln in proc.stdout.splitlines() if ln.strip()]
    states: dict[str, list[str]] = {}
    for row in rows:
        if len(row) >= 2 and row[0].endswith(".patch"):
            state = row[1] if row[1] != "not" else "not applied"
            if row[1] == "no":
                state = "no tree"
            states.setdefault(state, []).append(row[0])
    out: list[Finding] = []
    if states.get("no tree"):
        out.append(_err("patches", f"pinned source trees missing for {len(states['no tree'])} patch(es) "
                                   "(run download_frameworks_source_code.sh, then build_project.sh)"))
    for state, names in states.items():
        if state in ("applied", "no tree"):
            continue
        out.append(_err("patches", f"{len(names)} patch(es) {state}: {', '.join(names)} "
                                   "(run bash apply_all_patches.sh)"))
    if proc.returncode != 0 and not out:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        out.append(_err("patches", f"apply_all_patches.sh --status failed: {last}"))
    return out


def mindspeed_finding(result: Mapping[str, Any]) -> list[Finding]:
    """One ``[mindspeed]`` error from :func:`qwen3_rl.tools.launch.mindspeed_check.probe`'s result, none when ok."""
    if result.get("ok"):
        return []
    missing = f"missing module {result['missing']!r}: " if result.get("missing") else ""
    return [_err("mindspeed", f"{missing}importing mindspeed.megatron_adaptor as verl 0.9.1 does raises "
                              f"{result.get('error')}; verl would train without MindSpeed, silently "
                              "(verl/workers/engine/mindspeed/transformer_impl.py:18-21)")]


def check_mindspeed(env: Mapping[str, str], cmd: list[str] | None = None, timeout_s: float = 600.0) -> list[Finding]:
    """:mod:`qwen3_rl.tools.launch.mindspeed_check` in a fresh process (``cmd``; default this Python with ``-m``) in
    the launch environment ``env``; its last stdout line is the probe's JSON."""
    cmd = cmd or [sys.executable, "-m", "qwen3_rl.tools.launch.mindspeed_check"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=dict(env),
                              cwd=REPO)
    except subprocess.TimeoutExpired:
        return [_err("mindspeed", f"the MindSpeed import check did not finish within {timeout_s:.0f} s")]
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return [_err("mindspeed", f"the MindSpeed import check failed (exit {proc.returncode}): {last}")]
    return mindspeed_finding(result)


def run_preflight(train_script: str, env_script: str | None = None, nnodes: int | None = None,
                  npus_per_node: int | None = None, role: str = "head", workspace: str | None = None,
                  extra_args: list[str] | None = None, node_checks: bool = True,
                  env: Mapping[str, str] | None = None, patch_only: str | None = None,
                  npu_env: str | os.PathLike[str] | None = DEFAULT_NPU_ENV, env_only: bool = False) -> list[Finding]:
    """All checks; returns findings (errors and warnings) in a stable order.

    The train script is read in the environment the launcher would give it: ``env`` (default: this
    process's) with ``env_script`` and then ``npu_env`` sourced by bash (``npu_env=None``: not sourced).
    ``env_only``: only the environment contract.
    """
    env = dict(os.environ if env is None else env)
    if nnodes is not None:
        env["NNODES"] = str(nnodes)
    if npus_per_node is not None:
        env["NPUS_PER_NODE"] = str(npus_per_node)
    try:
        env = resolve_launch_env(env, env_script, npu_env)
    except EnvResolveError as exc:
        return [_err("env", str(exc))]
    try:
        pin_set = resolve_pin_set(env=env)
    except PinError as exc:
        return [_err("pin-set", str(exc))]
    try:
        cmd = parse_train_script(train_script, env=env, extra_args=extra_args)
    except TrainScriptError as exc:
        return [_err("script", str(exc))]
    vals = cmd.override_map()
    cfg = load_config(vals.get("actor_rollout_ref.model.path"))
    contract = check_contract(cmd, cfg, pin_set)
    if env_only:
        return contract
    findings: list[Finding] = []
    if node_checks:
        findings += check_npus(npus_per_node or _get_int(vals, "trainer.n_gpus_per_node", 16) or 16)
        findings += check_cann(env)
        findings += check_patches(workspace, patch_only, pin_set=pin_set)
        if pin_set == "current":
            findings += check_mindspeed(env)
    findings += contract
    findings += check_model(vals)
    if role == "head":
        findings += check_datasets(vals)
    try:
        findings += check_world(vals, nnodes, npus_per_node)
        findings += check_layout(vals, cfg)
        findings += check_batches(vals, pin_set)
        findings += check_lengths(vals, cfg)
        findings += check_feature_rules(vals, Path(train_script).name, pin_set)
        findings += check_spec_decode_requests(vals)
        findings += check_rollout_log_probs(vals, pin_set)
        findings += check_sam_cost_table(vals)
        findings += check_server_mode(vals)
    except ValueError as exc:
        findings.append(_err("script", f"non-integer size in the train command: {str(exc).splitlines()[0]}"))
    findings += check_kv_concurrency(vals, cfg)
    return findings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl preflight", description=__doc__.split("\n")[0])
    ap.add_argument("train_script")
    ap.add_argument("--env-script", help="env script sourced (set -a) before the train script, like the launcher's "
                                         "ENV_SCRIPT")
    ap.add_argument("--npu-env", default=os.environ.get("NPU_ENV_SCRIPT") or str(DEFAULT_NPU_ENV),
                    help="the launcher's CANN/HCCL/vLLM env file, sourced after --env-script ('' = none) "
                         "[NPU_ENV_SCRIPT; default internal/npu_env.sh]")
    ap.add_argument("--env-only", action="store_true",
                    help="only the environment contract (the env vars and engine keys pinned upstream refuses)")
    ap.add_argument("--nnodes", type=int, help="nodes the launcher will start (default: the script's)")
    ap.add_argument("--npus-per-node", type=int, help="NPU dies per node (default: the script's)")
    ap.add_argument("--role", choices=("head", "worker"), default="head",
                    help="worker: skip the dataset check (only the driver on the head reads it)")
    ap.add_argument("--workspace", help="upstream workspace for the patch status (default: apply_all_patches.sh's)")
    ap.add_argument("--only", help="frameworks whose patch status is checked (default: all pinned)")
    ap.add_argument("--no-node-checks", action="store_true",
                    help="skip npu-smi / CANN / patch checks (config and files only)")
    ap.add_argument("--json", action="store_true", help="print findings as JSON")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides passed to the train script")
    a = ap.parse_intermixed_args(argv)
    findings = run_preflight(a.train_script, a.env_script, a.nnodes, a.npus_per_node, a.role, a.workspace,
                             a.overrides, node_checks=not a.no_node_checks, patch_only=a.only,
                             npu_env=a.npu_env or None, env_only=a.env_only)
    errors = [f for f in findings if f.level == "error"]
    if a.json:
        print(json.dumps([f.__dict__ for f in findings], indent=1))
    else:
        for f in findings:
            print(f.line(), file=sys.stderr if f.level == "error" else sys.stdout)
        try:
            pin_set = resolve_pin_set()
        except PinError:  # reported as the [pin-set] error above
            pin_set = "seed"
        print(f"preflight{' (environment contract only)' if a.env_only else ''}"
              f"{'' if pin_set == 'seed' else f' (pin set {pin_set})'}: {len(errors)} error(s), "
              f"{len(findings) - len(errors)} warning(s)"
              f"{'' if errors else ' - OK'}")
    return 1 if errors else 0
