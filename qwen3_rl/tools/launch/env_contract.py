"""Environment contract: what the pinned verl / vLLM / vLLM-Ascend refuse at start-up, checked before launch.

Each :class:`Rule` is one ``assert`` / ``raise`` of the pinned upstream that is reached from ``LLM(...)``
construction, weight loading, ``sleep`` or ``wake_up`` in verl's SPMD vLLM rollout and that depends on an
environment variable (or on an engine key the train scripts set). It names the variable or key, when it
applies (e.g. sleep mode on = ``rollout.free_cache_engine=True``, which verl passes to
``LLM(enable_sleep_mode=...)``), the upstream lines (``file:line`` inside the package tree of the pinned
release) and a short anchor text those lines contain; ``tests/tools/launch/test_env_contract.py`` checks every anchor
against the pristine pinned sources, so a pin bump that moves or drops the code fails the test.

:func:`check_env` evaluates the rules on an environment (the one the Ray workers get: the launcher's
environment with the train command's ``ray_kwargs.ray_init.runtime_env.env_vars`` on top) and an
:class:`EngineContext` (what the rules depend on, read from the train command's Hydra overrides by
:meth:`EngineContext.from_overrides`). :func:`resolve_launch_env` builds the launcher's environment by
sourcing the env file(s) in bash exactly as ``ray_start_npu.sh`` does, the user's exports taking
precedence wherever the files use ``${VAR:-default}``.

Limits: only what the override map shows is known (an ``additional_config`` given as one dict literal
is not looked into); verl's own ``PPO_RAY_RUNTIME_ENV`` defaults are not overlaid (none of them is a
variable of these rules).

Pin sets: :data:`RULES` is the seed set's contract (verl 0.6.1 / vLLM 0.13 / vLLM-Ascend 0.13);
:data:`CURRENT_RULES` the current set's (verl 0.9.1 / vLLM 0.23.0 / vLLM-Ascend 0.23.0.post1), where verl runs
vLLM only as its HTTP server replicas, so "reached" means that server's engine construction, ``sleep`` /
``wake_up`` and weight sync. :data:`SEED_RULE_FATE` says for every seed rule whether it holds there, changed
or is gone. :data:`RULES_BY_SET` maps a pin set to its rules; :meth:`EngineContext.from_overrides` reads the
context with the set's own verl defaults (``pin_set=``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

CONTRACT_CHECK = "env-contract"
R = "actor_rollout_ref.rollout."
VLLM_KW = R + "engine_kwargs.vllm."
ADDITIONAL = VLLM_KW + "additional_config."
RUNTIME_ENV = "ray_kwargs.ray_init.runtime_env.env_vars."
REPO = Path(__file__).resolve().parents[3]
DEFAULT_NPU_ENV = REPO / "internal" / "npu_env.sh"

# verl 0.6.1 rollout defaults (verl/trainer/config/rollout/rollout.yaml) for keys a command may omit
VERL_DEFAULTS = {"free_cache_engine": True, "enforce_eager": False, "max_num_batched_tokens": 8192,
                 "max_num_seqs": 1024, "enable_chunked_prefill": True, "tensor_model_parallel_size": 2}
# verl 0.9.1's (the current set) where they differ or are new: workers/config/rollout.py:268 (enable_sleep_mode),
# trainer/config/rollout/rollout.yaml:84 (max_num_seqs), :282 (checkpoint_engine.backend)
CURRENT_VERL_DEFAULTS = {"enable_sleep_mode": True, "free_cache_engine": True, "max_num_seqs": 256,
                         "checkpoint_backend": "naive"}


class EnvResolveError(RuntimeError):
    """The env file(s) could not be sourced (one-line message)."""


@dataclass(frozen=True)
class UpstreamRef:
    """Lines ``start``-``end`` of ``path`` (inside the package tree) of pinned framework ``framework``
    (a pins.toml key), which contain ``anchor``."""

    framework: str
    path: str
    start: int
    end: int
    anchor: str

    def cite(self) -> str:
        lines = str(self.start) if self.start == self.end else f"{self.start}-{self.end}"
        return f"{self.path}:{lines}"


@dataclass(frozen=True)
class EngineContext:
    """What the rules depend on: the rollout engine's configuration as verl will pass it to ``LLM(...)``.

    Attributes:
        sleep_mode: ``rollout.free_cache_engine`` (verl: ``LLM(enable_sleep_mode=...)``).
        enforce_eager: ``rollout.enforce_eager``.
        cudagraph_mode: ``engine_kwargs.vllm.compilation_config.cudagraph_mode`` if given (upper case).
        tensor_parallel_size: rollout TP.
        moe: the model has routed experts.
        expert_parallel: ``engine_kwargs.vllm.enable_expert_parallel``.
        capture_sizes: graph capture sizes given explicitly (``None``: vLLM's default list).
        max_model_len: what verl passes (``rollout.max_model_len`` or prompt + response length).
        max_num_batched_tokens, max_num_seqs, chunked_prefill: the scheduler keys verl passes.
        additional_config: vLLM ``additional_config`` keys, dotted (``eplb_config.dynamic_eplb``).
        runtime_env: the command's Ray runtime-env variables (they override the node's environment).
        free_cache_engine: ``rollout.free_cache_engine`` (current set only: verl sleeps / wakes the engine only with
            it; the seed reading leaves it at True, its ``sleep_mode`` is this key).
        max_position_embeddings: the model's (config.json), when known (current set: verl's default
            ``max_model_len`` and its upper bound).
        checkpoint_backend: ``rollout.checkpoint_engine.backend`` (current set; ``delta_sharded`` syncs weights
            through vLLM's ``start_weight_update``).
        rollout_profiler: rollout profiling with the torch / npu tool on (current set: verl then passes vLLM a
            torch ``profiler_config``).
    """

    sleep_mode: bool = True
    enforce_eager: bool = False
    cudagraph_mode: str | None = None
    tensor_parallel_size: int = 1
    moe: bool = False
    expert_parallel: bool = False
    capture_sizes: tuple[int, ...] | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    chunked_prefill: bool = True
    additional_config: Mapping[str, str] = field(default_factory=dict)
    runtime_env: Mapping[str, str] = field(default_factory=dict)
    free_cache_engine: bool = True
    max_position_embeddings: int | None = None
    checkpoint_backend: str = "naive"
    rollout_profiler: bool = False

    @property
    def graph_mode(self) -> bool:
        """ACL graphs on: not eager and no explicit ``cudagraph_mode=NONE``."""
        return not self.enforce_eager and self.cudagraph_mode != "NONE"

    def eplb_key(self, key: str) -> str | None:
        """An EPLB key as vLLM-Ascend reads it: ``eplb_config.<key>`` when an ``eplb_config`` is given
        (it replaces the top-level keys, vllm_ascend/ascend_config.py:75-77), else the top-level key."""
        if any(k.startswith("eplb_config.") for k in self.additional_config):
            return self.additional_config.get(f"eplb_config.{key}")
        return self.additional_config.get(key)

    @classmethod
    def from_overrides(cls, vals: Mapping[str, str], model_config: Mapping[str, Any] | None = None,
                       pin_set: str = "seed") -> EngineContext:
        """Read the context from a train command's override map (``TrainCommand.override_map()``).

        ``model_config`` (the model's config.json) tells whether the model has experts; without it the
        presence of ``engine_kwargs.vllm.enable_expert_parallel`` (emitted by the MoE layout only) does.
        ``pin_set="current"``: verl 0.9.1's keys and defaults (:meth:`_from_overrides_current`).
        """
        if pin_set == "current":
            return cls._from_overrides_current(vals, model_config)
        def get(key: str, default: Any) -> Any:
            raw = vals.get(R + key)
            return default if raw is None or raw in ("null", "None", "") else raw

        prompt = _int(vals.get("data.max_prompt_length"))
        response = _int(vals.get("data.max_response_length"))
        max_model_len = _int(get("max_model_len", None))
        if max_model_len is None and prompt is not None and response is not None:
            max_model_len = prompt + response
        sizes_raw = vals.get(VLLM_KW + "compilation_config.cudagraph_capture_sizes") or get("cudagraph_capture_sizes", None)
        mode = vals.get(VLLM_KW + "compilation_config.cudagraph_mode")
        if model_config is not None:
            moe = bool(model_config.get("num_experts") or model_config.get("n_routed_experts"))
        else:
            moe = VLLM_KW + "enable_expert_parallel" in vals
        return cls(
            sleep_mode=_bool(get("free_cache_engine", VERL_DEFAULTS["free_cache_engine"])),
            enforce_eager=_bool(get("enforce_eager", VERL_DEFAULTS["enforce_eager"])),
            cudagraph_mode=mode.strip("'\"").upper() if mode else None,
            tensor_parallel_size=_int(get("tensor_model_parallel_size", None))
            or VERL_DEFAULTS["tensor_model_parallel_size"],
            moe=moe,
            expert_parallel=_bool(vals.get(VLLM_KW + "enable_expert_parallel", "False")),
            capture_sizes=_int_list(sizes_raw),
            max_model_len=max_model_len,
            max_num_batched_tokens=_int(get("max_num_batched_tokens", None)) or VERL_DEFAULTS["max_num_batched_tokens"],
            max_num_seqs=_int(get("max_num_seqs", None)) or VERL_DEFAULTS["max_num_seqs"],
            chunked_prefill=_bool(get("enable_chunked_prefill", VERL_DEFAULTS["enable_chunked_prefill"])),
            additional_config={k.removeprefix(ADDITIONAL): _unquote(v) for k, v in vals.items()
                               if k.startswith(ADDITIONAL)},
            runtime_env={k.removeprefix(RUNTIME_ENV): _unquote(v) for k, v in vals.items()
                         if k.startswith(RUNTIME_ENV)},
        )


    @classmethod
    def _from_overrides_current(cls, vals: Mapping[str, str], model_config: Mapping[str, Any] | None) -> EngineContext:
        """The current set's reading: vLLM's sleep mode is ``rollout.enable_sleep_mode`` (verl 0.9.1
        vllm_async_server.py:337, default True at workers/config/rollout.py:268), sleep / wake-up cycles need
        ``rollout.free_cache_engine`` as well (vllm_async_server.py:853-854), ``max_model_len`` defaults to the
        model's ``max_position_embeddings`` (vllm_async_server.py:1104-1105), ``max_num_seqs`` to 256
        (trainer/config/rollout/rollout.yaml:84)."""
        seed = cls.from_overrides(vals, model_config)

        def get(key: str) -> str | None:
            raw = vals.get(R + key)
            return None if raw is None or raw in ("null", "None", "") else raw

        mpe = _int((model_config or {}).get("max_position_embeddings"))
        explicit_len = _int(get("max_model_len"))
        tool = _unquote(get("profiler.tool") or vals.get("global_profiler.tool") or "")
        enable = get("profiler.enable") or vals.get("actor_rollout_ref.actor.profiler.enable") or "False"
        return replace(
            seed,
            sleep_mode=_bool(get("enable_sleep_mode") or CURRENT_VERL_DEFAULTS["enable_sleep_mode"]),
            free_cache_engine=_bool(get("free_cache_engine") or CURRENT_VERL_DEFAULTS["free_cache_engine"]),
            max_model_len=explicit_len if explicit_len is not None else mpe,
            max_num_seqs=_int(get("max_num_seqs")) or CURRENT_VERL_DEFAULTS["max_num_seqs"],
            max_position_embeddings=mpe,
            checkpoint_backend=_unquote(get("checkpoint_engine.backend") or CURRENT_VERL_DEFAULTS["checkpoint_backend"]),
            rollout_profiler=tool in ("torch", "npu") and _bool(enable),
        )


def _unquote(raw: str) -> str:
    return raw.strip().strip("'\"")


def _bool(raw: Any) -> bool:
    return str(raw).strip().strip("'\"").lower() in ("true", "1", "yes")


def _int(raw: Any) -> int | None:
    try:
        return int(str(raw).strip().strip("'\""))
    except (TypeError, ValueError):
        return None


def _int_list(raw: str | None) -> tuple[int, ...] | None:
    if raw is None or raw.strip() in ("", "null", "None"):
        return None
    items = [p.strip() for p in raw.strip().strip("[]").split(",") if p.strip()]
    vals = [_int(p) for p in items]
    return tuple(v for v in vals if v is not None)


# --- how upstream parses the variables ------------------------------------------------------------
def _env_int(env: Mapping[str, str], name: str, default: int) -> int | None:
    """``int(os.getenv(name, default))`` as vLLM-Ascend's envs.py reads it; None if it would raise."""
    try:
        return int(env.get(name, str(default)))
    except ValueError:
        return None


def _shown(env: Mapping[str, str], name: str, default: str) -> str:
    return f"{name}={env[name]}" if name in env else f"{name} unset (default {default})"


def _flashcomm1(env: Mapping[str, str]) -> str | None:
    """The variable that turns FlashComm v1 on (vllm_ascend/utils.py:748-753), shown, or None."""
    for name in ("VLLM_ASCEND_ENABLE_FLASHCOMM1", "VLLM_ASCEND_ENABLE_FLASHCOMM"):
        if _env_int(env, name, 0) != 0:
            return f"{name}={env[name]}"
    return None


# --- the rules ---------------------------------------------------------------------------------------
Check = Callable[[Mapping[str, str], EngineContext], "str | None"]


@dataclass(frozen=True)
class Rule:
    """One start-up constraint of the pinned upstream.

    Attributes:
        id: stable name, shown as ``env-contract[<id>]``.
        subject: the environment variable (upper case) or engine key it is about.
        breaking: the values that break it (for the docs table).
        condition: when it applies (for the docs table).
        explanation: what upstream does, completing "<VAR>=<value> ..." in the error line.
        refs: upstream lines; the first is the one the error cites.
        applies: whether the rule applies to a context.
        check: returns the offending setting as shown in the error (``VAR=value``) or None.
    """

    id: str
    subject: str
    breaking: str
    condition: str
    explanation: str
    refs: tuple[UpstreamRef, ...]
    applies: Callable[[EngineContext], bool]
    check: Check

    @property
    def is_env(self) -> bool:
        return self.subject.isupper()


@dataclass(frozen=True)
class Violation:
    """A rule broken by an environment: ``shown`` is the offending setting (``VAR=value``)."""

    rule: Rule
    shown: str

    def message(self) -> str:
        return f"{self.shown} {self.rule.explanation} ({self.rule.refs[0].cite()})"

    def line(self) -> str:
        """``env-contract[<id>]: <VAR>=<value> <explanation> (<file:line>)``."""
        return f"{CONTRACT_CHECK}[{self.rule.id}]: {self.message()}"


VA, VL, VE = "vllm_ascend", "vllm", "verl"
SPMD = "verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py"
# verl turns vLLM's sleep mode on with rollout.free_cache_engine (default True, verl/workers/config/rollout.py:137)
SLEEP_MODE_REF = UpstreamRef(VE, SPMD, 233, 233, "enable_sleep_mode=config.free_cache_engine")
FREE_CACHE_DEFAULT_REF = UpstreamRef(VE, "verl/workers/config/rollout.py", 137, 137, "free_cache_engine: bool = True")
SLEEP = "sleep mode on (rollout.free_cache_engine=True, verl's default and every setup's)"


def _expandable(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    conf = env.get("PYTORCH_NPU_ALLOC_CONF", "")
    return f"PYTORCH_NPU_ALLOC_CONF={conf}" if "expandable_segments:True" in conf else None


def _nz(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return None if _env_int(env, "VLLM_ASCEND_ENABLE_NZ", 1) == 0 else _shown(env, "VLLM_ASCEND_ENABLE_NZ", "1")


def _launch_blocking(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return "ASCEND_LAUNCH_BLOCKING=1" if env.get("ASCEND_LAUNCH_BLOCKING", "0") == "1" else None


def _dynamic_eplb(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    if env.get("DYNAMIC_EPLB", "false").lower() in ("true", "1"):
        return None
    return _shown(env, "DYNAMIC_EPLB", "false")


def _expert_map_record(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return None if env.get("EXPERT_MAP_RECORD", "false") == "true" else _shown(env, "EXPERT_MAP_RECORD", "false")


def _graph_sizes_need_tp(on: str | None, ctx: EngineContext) -> str | None:
    """FlashComm v1 (``on``: how it is switched on, None = off) with capture sizes of which none is a multiple of the
    rollout TP (sizes above ``max_num_batched_tokens`` are dropped first)."""
    tp = ctx.tensor_parallel_size
    sizes = [s for s in ctx.capture_sizes or () if s <= ctx.max_num_batched_tokens]
    if on is None or any(s % tp == 0 for s in sizes):
        return None
    return f"{on} with cudagraph_capture_sizes {sizes} (none a multiple of rollout TP {tp})"


def _flashcomm1_graph_sizes(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return _graph_sizes_need_tp(_flashcomm1(env), ctx)


def _flashcomm2(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    size = _env_int(env, "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE", 0)
    tp = ctx.tensor_parallel_size
    if not size or (size < tp and tp % size == 0):
        return None
    return f"VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE={size} with rollout TP {tp}"


def _msmonitor(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    if env.get("VLLM_TORCH_PROFILER_DIR") and _env_int(env, "MSMONITOR_USE_DAEMON", 0):
        return f"MSMONITOR_USE_DAEMON={env['MSMONITOR_USE_DAEMON']} with VLLM_TORCH_PROFILER_DIR set"
    return None


def _tokens_vs_len(ctx: EngineContext) -> str | None:
    if ctx.max_model_len is None or ctx.max_num_batched_tokens >= ctx.max_model_len:
        return None
    return f"rollout.max_num_batched_tokens={ctx.max_num_batched_tokens} < max_model_len {ctx.max_model_len}"


def _tokens_vs_seqs(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    if ctx.max_num_batched_tokens >= ctx.max_num_seqs:
        return None
    return f"rollout.max_num_batched_tokens={ctx.max_num_batched_tokens} < rollout.max_num_seqs {ctx.max_num_seqs}"


RULES: tuple[Rule, ...] = (
    Rule("camem-expandable-segments", "PYTORCH_NPU_ALLOC_CONF", "contains `expandable_segments:True`", SLEEP,
         "is refused by vLLM-Ascend when sleep mode is on",
         (UpstreamRef(VA, "vllm_ascend/device_allocator/camem.py", 145, 149, "expandable_segments:True"),
          SLEEP_MODE_REF, FREE_CACHE_DEFAULT_REF),
         lambda ctx: ctx.sleep_mode, _expandable),
    Rule("nz-wake-up", "VLLM_ASCEND_ENABLE_NZ", "anything but `0` (unset = 1)", SLEEP,
         "is refused by vLLM-Ascend's NPUWorker.wake_up when sleep mode is on; set VLLM_ASCEND_ENABLE_NZ=0",
         (UpstreamRef(VA, "vllm_ascend/worker/worker.py", 181, 184, "if envs_ascend.VLLM_ASCEND_ENABLE_NZ:"),
          UpstreamRef(VA, "vllm_ascend/envs.py", 122, 123, 'os.getenv("VLLM_ASCEND_ENABLE_NZ", 1)'),
          SLEEP_MODE_REF),
         lambda ctx: ctx.sleep_mode, _nz),
    Rule("aclgraph-launch-blocking", "ASCEND_LAUNCH_BLOCKING", "`1`",
         "ACL graphs on (rollout.enforce_eager=False, every setup's default)",
         "is refused by vLLM-Ascend with ACL graphs on (rollout.enforce_eager=False)",
         (UpstreamRef(VA, "vllm_ascend/platform.py", 304, 311, 'os.environ.get("ASCEND_LAUNCH_BLOCKING", "0") == "1"'),),
         lambda ctx: ctx.graph_mode, _launch_blocking),
    Rule("dynamic-eplb-env", "DYNAMIC_EPLB", "not `true`/`1` (unset = false)",
         "additional_config eplb_config.dynamic_eplb=True (ROLLOUT_EPLB=True)",
         "is refused by vLLM-Ascend with additional_config eplb_config.dynamic_eplb=True",
         (UpstreamRef(VA, "vllm_ascend/eplb/core/eplb_utils.py", 144, 147, "DYNAMIC_EPLB"),
          UpstreamRef(VA, "vllm_ascend/worker/model_runner_v1.py", 300, 302, "check_dynamic_eplb"),
          UpstreamRef(VA, "vllm_ascend/envs.py", 128, 129, 'os.getenv("DYNAMIC_EPLB", "false").lower()')),
         lambda ctx: _bool(ctx.eplb_key("dynamic_eplb")), _dynamic_eplb),
    Rule("expert-map-record-env", "EXPERT_MAP_RECORD", "not exactly `true`",
         "additional_config eplb_config.expert_map_record_path set",
         "is refused by vLLM-Ascend with additional_config eplb_config.expert_map_record_path set",
         (UpstreamRef(VA, "vllm_ascend/eplb/core/eplb_utils.py", 181, 184, 'os.getenv("EXPERT_MAP_RECORD", "false")'),
          UpstreamRef(VA, "vllm_ascend/worker/model_runner_v1.py", 300, 304, "check_expert_map_record_path")),
         lambda ctx: bool(ctx.eplb_key("expert_map_record_path")), _expert_map_record),
    Rule("flashcomm1-tp", "VLLM_ASCEND_ENABLE_FLASHCOMM1", "non-zero (also the older VLLM_ASCEND_ENABLE_FLASHCOMM)",
         "rollout TP 1",
         "is refused by vLLM-Ascend with rollout TP 1 (FlashComm v1 is sequence parallelism over TP)",
         (UpstreamRef(VA, "vllm_ascend/utils.py", 768, 769, "tensor_parallel_size > 1"),
          UpstreamRef(VA, "vllm_ascend/utils.py", 748, 753, "VLLM_ASCEND_ENABLE_FLASHCOMM1")),
         lambda ctx: ctx.tensor_parallel_size <= 1, lambda env, ctx: _flashcomm1(env)),
    Rule("flashcomm1-moe-ep", "VLLM_ASCEND_ENABLE_FLASHCOMM1", "non-zero (also VLLM_ASCEND_ENABLE_FLASHCOMM)",
         "MoE model without engine_kwargs.vllm.enable_expert_parallel=True (ROLLOUT_ENABLE_EP=False)",
         "is refused by vLLM-Ascend for a MoE model without enable_expert_parallel=True",
         (UpstreamRef(VA, "vllm_ascend/utils.py", 771, 774, "requires enable_expert_parallel=True for MoE models"),),
         lambda ctx: ctx.moe and not ctx.expert_parallel, lambda env, ctx: _flashcomm1(env)),
    Rule("flashcomm1-graph-sizes", "VLLM_ASCEND_ENABLE_FLASHCOMM1", "non-zero (also VLLM_ASCEND_ENABLE_FLASHCOMM)",
         "rollout TP > 1, not eager, explicit graph capture sizes none of which TP divides",
         "is refused by vLLM-Ascend (its sequence-parallel graphs need capture sizes that TP divides)",
         (UpstreamRef(VA, "vllm_ascend/platform.py", 222, 230, "assert sp_aclgraph_sizes"),),
         lambda ctx: ctx.tensor_parallel_size > 1 and not ctx.enforce_eager and ctx.capture_sizes is not None,
         _flashcomm1_graph_sizes),
    Rule("flashcomm2-oproj-tp", "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE", "> 0 and not a proper divisor of rollout TP",
         "always (read when vLLM-Ascend builds its config)",
         "is refused by vLLM-Ascend: it must be smaller than and divide the rollout TP",
         (UpstreamRef(VA, "vllm_ascend/utils.py", 1038, 1045, "flashcomm2_oproj_tensor_parallel_size"),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 128, 130, "get_flashcomm2_config_and_validate")),
         lambda ctx: True, _flashcomm2),
    Rule("msmonitor-profiler", "MSMONITOR_USE_DAEMON", "non-zero while `VLLM_TORCH_PROFILER_DIR` is set",
         "always (NPUWorker start-up)",
         "is refused by vLLM-Ascend's NPUWorker",
         (UpstreamRef(VA, "vllm_ascend/worker/worker.py", 500, 504,
                      "MSMONITOR_USE_DAEMON and VLLM_TORCH_PROFILER_DIR cannot be both set"),
          UpstreamRef(VA, "vllm_ascend/worker/worker.py", 147, 147, "self._init_profiler()")),
         lambda ctx: True, _msmonitor),
    Rule("verl-batched-tokens-chunked", "rollout.max_num_batched_tokens", "< max_model_len",
         "chunked prefill on (rollout.enable_chunked_prefill=True)",
         "is refused by verl's vLLM rollout with chunked prefill on",
         (UpstreamRef(VE, SPMD, 197, 201, "max_num_batched_tokens < max_model_len and self.config.enable_chunked_prefill"),),
         lambda ctx: ctx.chunked_prefill, lambda env, ctx: _tokens_vs_len(ctx)),
    Rule("vllm-batched-tokens-unchunked", "rollout.max_num_batched_tokens", "< max_model_len",
         "chunked prefill off (rollout.enable_chunked_prefill=False)",
         "is refused by vLLM's scheduler config without chunked prefill",
         (UpstreamRef(VL, "vllm/config/scheduler.py", 251, 262, "self.max_num_batched_tokens < max_model_len"),),
         lambda ctx: not ctx.chunked_prefill, lambda env, ctx: _tokens_vs_len(ctx)),
    Rule("vllm-batched-tokens-seqs", "rollout.max_num_batched_tokens", "< rollout.max_num_seqs", "always",
         "is refused by vLLM's scheduler config",
         (UpstreamRef(VL, "vllm/config/scheduler.py", 264, 269, "self.max_num_batched_tokens < self.max_num_seqs"),),
         lambda ctx: True, _tokens_vs_seqs),
)

# the two values the shipped env files were fixed to because of these rules: variable -> (what, rule id)
FIXED_VALUES = {"PYTORCH_NPU_ALLOC_CONF": ("left unset (internal/qwen3_235b_env.sh used to set "
                                           "`expandable_segments:True`)", "camem-expandable-segments"),
                "VLLM_ASCEND_ENABLE_NZ": ("`0` in internal/npu_env.sh, every setup (unset it is 1)", "nz-wake-up")}


# --- the current pin set (verl 0.9.1 / vLLM 0.23.0 / vLLM-Ascend 0.23.0.post1) ------------------------------------
SERVER = "verl/workers/rollout/vllm_rollout/vllm_async_server.py"
CURRENT_SLEEP_MODE_REF = UpstreamRef(VE, SERVER, 337, 337, '"enable_sleep_mode": self.config.enable_sleep_mode')
CURRENT_SLEEP_DEFAULT_REF = UpstreamRef(VE, "verl/workers/config/rollout.py", 268, 268, "enable_sleep_mode: bool = True")
CURRENT_SLEEP = "vLLM sleep mode on (rollout.enable_sleep_mode=True, verl 0.9.1's default and every setup's)"


def _additional_or_env(env: Mapping[str, str], ctx: EngineContext, key: str, var: str, default: int
                       ) -> tuple[int | None, str]:
    """A vLLM-Ascend 0.23 setting read by ``AscendConfig._get_config_value`` (ascend_config.py:354-365): the
    ``additional_config`` key when given, else the variable (``default`` when unset). Returns (value, shown);
    value None when it is not an integer (envs.py's ``int(...)`` would raise)."""
    if key in ctx.additional_config:
        raw = ctx.additional_config[key]
        val = 1 if raw.lower() == "true" else 0 if raw.lower() == "false" else _int(raw)
        return val, f"additional_config {key}={raw}"
    return _env_int(env, var, default), _shown(env, var, str(default))


def _on(val_shown: tuple[int | None, str]) -> str | None:
    val, shown = val_shown
    return None if val == 0 else shown


def _nz_wake_up_current(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return _on(_additional_or_env(env, ctx, "weight_nz_mode", "VLLM_ASCEND_ENABLE_NZ", 1))


def _flashcomm1_current(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    """FlashComm v1 on in vLLM-Ascend 0.23 (utils.py:916-922): ``additional_config enable_flashcomm1`` or
    ``VLLM_ASCEND_ENABLE_FLASHCOMM1`` (the older ``VLLM_ASCEND_ENABLE_FLASHCOMM`` is no longer read)."""
    return _on(_additional_or_env(env, ctx, "enable_flashcomm1", "VLLM_ASCEND_ENABLE_FLASHCOMM1", 0))


def _flashcomm1_graph_sizes_current(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return _graph_sizes_need_tp(_flashcomm1_current(env, ctx), ctx)


def _flashcomm2_current(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    size, shown = _additional_or_env(env, ctx, "enable_flashcomm2_parallel_size",
                                     "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE", 0)
    tp = ctx.tensor_parallel_size
    if size is not None and (size <= 0 or (size < tp and tp % size == 0)):
        return None
    return f"{shown} with rollout TP {tp}"


def _msmonitor_current(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return _on(_additional_or_env(env, ctx, "msmonitor_use_daemon", "MSMONITOR_USE_DAEMON", 0))


def _eplb_current(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    if env.get("DYNAMIC_EPLB", "false").lower() in ("true", "1") or env.get("EXPERT_MAP_RECORD", "false") == "true":
        return None
    return f"{_shown(env, 'DYNAMIC_EPLB', 'false')} and {_shown(env, 'EXPERT_MAP_RECORD', 'false')}"


def _eplb_on_current(ctx: EngineContext) -> bool:
    """vLLM-Ascend 0.23 reads EPLB only from ``additional_config eplb_config`` (ascend_config.py:49-50; top-level
    keys are no longer read); a record path turns dynamic EPLB on (ascend_config.py:873-874)."""
    cfg = ctx.additional_config
    return _bool(cfg.get("eplb_config.dynamic_eplb", "False")) or bool(cfg.get("eplb_config.expert_map_record_path"))


def _nz_weight_update(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return None if _env_int(env, "VLLM_ASCEND_ENABLE_NZ", 1) == 0 else _shown(env, "VLLM_ASCEND_ENABLE_NZ", "1")


def _fused_mc2_hierarchy(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return _on(_additional_or_env(env, ctx, "enable_fused_mc2", "VLLM_ASCEND_ENABLE_FUSED_MC2", 0))


def _balance_scheduling(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    return _on(_additional_or_env(env, ctx, "enable_balance_scheduling", "VLLM_ASCEND_BALANCE_SCHEDULING", 0))


def _max_model_len_vs_positions(env: Mapping[str, str], ctx: EngineContext) -> str | None:
    mpe, length = ctx.max_position_embeddings, ctx.max_model_len
    if mpe is None or length is None or length <= mpe:
        return None
    return f"rollout.max_model_len={length} > the model's max_position_embeddings {mpe}"


CURRENT_RULES: tuple[Rule, ...] = (
    Rule("camem-expandable-segments", "PYTORCH_NPU_ALLOC_CONF", "contains `expandable_segments:True`", CURRENT_SLEEP,
         "is refused by vLLM-Ascend when sleep mode is on",
         (UpstreamRef(VA, "vllm_ascend/device_allocator/camem.py", 152, 157, "expandable_segments:True"),
          UpstreamRef(VA, "vllm_ascend/worker/worker.py", 681, 683, "CaMemAllocator.get_instance()"),
          CURRENT_SLEEP_MODE_REF, CURRENT_SLEEP_DEFAULT_REF),
         lambda ctx: ctx.sleep_mode, _expandable),
    Rule("nz-wake-up", "VLLM_ASCEND_ENABLE_NZ", "anything but `0` (unset = 1); `additional_config weight_nz_mode` "
         "wins when given", CURRENT_SLEEP + " and rollout.free_cache_engine=True (verl sleeps the engine)",
         "is refused by vLLM-Ascend's NPUWorker.wake_up when sleep mode is on; set VLLM_ASCEND_ENABLE_NZ=0",
         (UpstreamRef(VA, "vllm_ascend/worker/worker.py", 241, 247, "nz_mode = get_ascend_config().weight_nz_mode"),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 249, 254, '"VLLM_ASCEND_ENABLE_NZ"'),
          UpstreamRef(VA, "vllm_ascend/envs.py", 92, 92, 'os.getenv("VLLM_ASCEND_ENABLE_NZ", 1)'),
          UpstreamRef(VE, SERVER, 853, 854, "not self.config.free_cache_engine"),
          UpstreamRef(VL, "vllm/v1/executor/abstract.py", 331, 334, "if not self.is_sleeping:")),
         lambda ctx: ctx.sleep_mode and ctx.free_cache_engine, _nz_wake_up_current),
    Rule("nz-weight-update", "VLLM_ASCEND_ENABLE_NZ", "anything but `0` (unset = 1; `weight_nz_mode` does not help)",
         "rollout.checkpoint_engine.backend=delta_sharded (weights synced through vLLM's start_weight_update)",
         "is refused by vLLM-Ascend's NPUWorker.start_weight_update (delta_sharded weight sync)",
         (UpstreamRef(VA, "vllm_ascend/worker/worker.py", 295, 301, "if envs_ascend.VLLM_ASCEND_ENABLE_NZ:"),
          UpstreamRef(VA, "vllm_ascend/worker/worker.py", 312, 312, "self._check_nz_disabled()"),
          UpstreamRef(VE, "verl/workers/rollout/vllm_rollout/vllm_rollout.py", 287, 287,
                      '_execute_method("start_weight_update")'),
          UpstreamRef(VE, SERVER, 1141, 1142, '== "delta_sharded"')),
         lambda ctx: ctx.checkpoint_backend == "delta_sharded", _nz_weight_update),
    Rule("aclgraph-launch-blocking", "ASCEND_LAUNCH_BLOCKING", "`1`",
         "ACL graphs on (rollout.enforce_eager=False, every setup's default)",
         "is refused by vLLM-Ascend with ACL graphs on (rollout.enforce_eager=False)",
         (UpstreamRef(VA, "vllm_ascend/platform.py", 647, 652, 'os.environ.get("ASCEND_LAUNCH_BLOCKING", "0") == "1"'),),
         lambda ctx: ctx.graph_mode, _launch_blocking),
    Rule("dynamic-eplb-env", "DYNAMIC_EPLB", "not `true`/`1` while `EXPERT_MAP_RECORD` is not exactly `true` "
         "(unset = false)",
         "additional_config eplb_config.dynamic_eplb=True (ROLLOUT_EPLB=True) or eplb_config.expert_map_record_path set",
         "is refused by vLLM-Ascend with dynamic EPLB on (eplb_config.dynamic_eplb or expert_map_record_path); "
         "set DYNAMIC_EPLB=true",
         (UpstreamRef(VA, "vllm_ascend/ascend_config.py", 885, 889, 'os.getenv("DYNAMIC_EPLB", "false").lower()'),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 873, 874, 'self.config["dynamic_eplb"] = True'),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 49, 50, 'additional_config.get("eplb_config", {})')),
         _eplb_on_current, _eplb_current),
    Rule("flashcomm1-tp", "VLLM_ASCEND_ENABLE_FLASHCOMM1", "non-zero; `additional_config enable_flashcomm1` wins "
         "when given", "rollout TP 1",
         "is refused by vLLM-Ascend with rollout TP 1 (FlashComm v1 is sequence parallelism over TP)",
         (UpstreamRef(VA, "vllm_ascend/platform.py", 763, 766, "Flash Comm v1 is only supported when tp_size > 1."),
          UpstreamRef(VA, "vllm_ascend/utils.py", 916, 920, '"enable_flashcomm1" in additional_config'),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 84, 89, '"VLLM_ASCEND_ENABLE_FLASHCOMM1"')),
         lambda ctx: ctx.tensor_parallel_size <= 1, _flashcomm1_current),
    Rule("flashcomm1-moe-ep", "VLLM_ASCEND_ENABLE_FLASHCOMM1", "non-zero (or `additional_config enable_flashcomm1`)",
         "MoE model without engine_kwargs.vllm.enable_expert_parallel=True (ROLLOUT_ENABLE_EP=False)",
         "is refused by vLLM-Ascend for a MoE model without enable_expert_parallel=True",
         (UpstreamRef(VA, "vllm_ascend/platform.py", 768, 770, "requires enable_expert_parallel=True for MoE models"),),
         lambda ctx: ctx.moe and not ctx.expert_parallel, _flashcomm1_current),
    Rule("flashcomm1-graph-sizes", "VLLM_ASCEND_ENABLE_FLASHCOMM1", "non-zero (or `additional_config "
         "enable_flashcomm1`)", "rollout TP > 1, ACL graphs on, explicit graph capture sizes none of which TP divides",
         "is refused by vLLM-Ascend (its sequence-parallel graphs need capture sizes that TP divides)",
         (UpstreamRef(VA, "vllm_ascend/platform.py", 550, 561, "assert sp_aclgraph_sizes"),),
         lambda ctx: ctx.tensor_parallel_size > 1 and ctx.graph_mode and ctx.capture_sizes is not None,
         _flashcomm1_graph_sizes_current),
    Rule("flashcomm2-oproj-tp", "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE", "> 0 and not a proper divisor of rollout TP "
         "(`additional_config enable_flashcomm2_parallel_size` wins when given)",
         "always (read when vLLM-Ascend builds its config)",
         "is refused by vLLM-Ascend: it must be smaller than and divide the rollout TP",
         (UpstreamRef(VA, "vllm_ascend/utils.py", 1326, 1335, "global_tp_size <= flashcomm2_oproj_tp_size"),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 191, 196, '"VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE"'),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 241, 241, "get_flashcomm2_config_and_validate")),
         lambda ctx: True, _flashcomm2_current),
    Rule("msmonitor-profiler", "MSMONITOR_USE_DAEMON", "non-zero (`additional_config msmonitor_use_daemon` wins when "
         "given)", "rollout profiling on with the torch / npu tool (verl passes vLLM a torch profiler_config)",
         "is refused by vLLM-Ascend's torch-profiler wrapper when rollout profiling starts",
         (UpstreamRef(VA, "vllm_ascend/profiler/torch_npu_profiler.py", 43, 47,
                      "MSMONITOR_USE_DAEMON and torch profiler cannot be both enabled"),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 197, 202, '"MSMONITOR_USE_DAEMON"'),
          UpstreamRef(VE, SERVER, 355, 366, "if self._should_profile():"),
          UpstreamRef(VE, "verl/utils/profiler/config.py", 517, 519, '"profiler": "torch"')),
         lambda ctx: ctx.rollout_profiler, _msmonitor_current),
    Rule("vllm-batched-tokens-seqs", "rollout.max_num_batched_tokens", "< rollout.max_num_seqs (verl 0.9.1 default 256)",
         "always", "is refused by vLLM's scheduler config",
         (UpstreamRef(VL, "vllm/config/scheduler.py", 273, 278, "if self.max_num_batched_tokens < self.max_num_seqs:"),
          UpstreamRef(VE, "verl/trainer/config/rollout/rollout.yaml", 84, 84, "max_num_seqs: 256")),
         lambda ctx: True, _tokens_vs_seqs),
    Rule("verl-max-model-len", "rollout.max_model_len", "> the model's max_position_embeddings",
         "the model's config.json known (unset: verl 0.9.1 uses max_position_embeddings)",
         "is refused by verl's vLLM server",
         (UpstreamRef(VE, SERVER, 1107, 1110, "if self.config.max_model_len > max_position_embeddings:"),
          UpstreamRef(VE, SERVER, 1104, 1105, "self.config.max_model_len = max_position_embeddings")),
         lambda ctx: ctx.max_position_embeddings is not None, _max_model_len_vs_positions),
    Rule("fused-mc2-hierarchy", "VLLM_ASCEND_ENABLE_FUSED_MC2", "non-zero (`additional_config enable_fused_mc2` "
         "wins when given)", "additional_config enable_mc2_hierarchy_comm=True",
         "is refused by vLLM-Ascend with additional_config enable_mc2_hierarchy_comm=True",
         (UpstreamRef(VA, "vllm_ascend/platform.py", 792, 796, "enable_mc2_hierarchy_comm and ascend_config.enable_fused_mc2"),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 173, 178, '"VLLM_ASCEND_ENABLE_FUSED_MC2"'),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 298, 298, '"enable_mc2_hierarchy_comm", False')),
         lambda ctx: _bool(ctx.additional_config.get("enable_mc2_hierarchy_comm", "False")), _fused_mc2_hierarchy),
    Rule("balance-scheduling-profiling-chunk", "VLLM_ASCEND_BALANCE_SCHEDULING", "non-zero "
         "(`additional_config enable_balance_scheduling` wins when given)",
         "additional_config profiling_chunk_config.enabled=True",
         "is refused by vLLM-Ascend with additional_config profiling_chunk_config.enabled=True",
         (UpstreamRef(VA, "vllm_ascend/ascend_config.py", 90, 94, "self.profiling_chunk_config.enabled and self.enable"),
          UpstreamRef(VA, "vllm_ascend/ascend_config.py", 78, 83, '"VLLM_ASCEND_BALANCE_SCHEDULING"')),
         lambda ctx: _bool(ctx.additional_config.get("profiling_chunk_config.enabled", "False")), _balance_scheduling),
)

#: every seed rule in the current set: (status, what changed). ``holds``: same subject and condition, new lines;
#: ``changed``: same subject, different reading or condition; ``gone``: not reached from verl 0.9.1's server.
SEED_RULE_FATE: dict[str, tuple[str, str]] = {
    "camem-expandable-segments": ("holds", "sleep mode is now `rollout.enable_sleep_mode` (verl 0.9.1), not "
                                           "free_cache_engine; with it off vLLM-Ascend sets the value itself"),
    "nz-wake-up": ("changed", "wake_up reads `weight_nz_mode` (additional_config, else VLLM_ASCEND_ENABLE_NZ); "
                              "reached only when verl sleeps the engine (free_cache_engine)"),
    "aclgraph-launch-blocking": ("holds", "moved in platform.py"),
    "dynamic-eplb-env": ("changed", "one assert for both variables: DYNAMIC_EPLB true/1 or EXPERT_MAP_RECORD=true; "
                                    "EPLB keys only under additional_config eplb_config"),
    "expert-map-record-env": ("changed", "merged into `dynamic-eplb-env` (a record path turns dynamic EPLB on)"),
    "flashcomm1-tp": ("changed", "additional_config enable_flashcomm1 wins; VLLM_ASCEND_ENABLE_FLASHCOMM no longer read"),
    "flashcomm1-moe-ep": ("changed", "as flashcomm1-tp"),
    "flashcomm1-graph-sizes": ("changed", "as flashcomm1-tp; also needs cudagraph_mode not NONE"),
    "flashcomm2-oproj-tp": ("changed", "additional_config enable_flashcomm2_parallel_size wins"),
    "msmonitor-profiler": ("changed", "refused when the torch profiler starts (vLLM 0.23 profiler_config); "
                                      "VLLM_TORCH_PROFILER_DIR is no longer read"),
    "verl-batched-tokens-chunked": ("gone", "verl 0.9.1's server has no such check"),
    "vllm-batched-tokens-unchunked": ("gone", "verl 0.9.1 raises max_num_batched_tokens to max_model_len first "
                                              "(vllm_async_server.py:1113-1119)"),
    "vllm-batched-tokens-seqs": ("holds", "moved in vllm/config/scheduler.py; verl's max_num_seqs default is 256"),
}

#: pin set -> its rules
RULES_BY_SET: dict[str, tuple[Rule, ...]] = {"seed": RULES, "current": CURRENT_RULES}


def rules_for(pin_set: str) -> tuple[Rule, ...]:
    """The contract of ``pin_set`` (KeyError for a set without one)."""
    return RULES_BY_SET[pin_set]


def worker_env(env: Mapping[str, str], context: EngineContext) -> dict[str, str]:
    """The environment a Ray worker sees: ``env`` with the command's runtime-env variables on top."""
    return {**env, **context.runtime_env}


def check_env(env: Mapping[str, str], context: EngineContext,
              rules: tuple[Rule, ...] = RULES) -> list[Violation]:
    """Every rule that applies to ``context`` and that ``env`` (+ the runtime-env variables) breaks."""
    full = worker_env(env, context)
    out: list[Violation] = []
    for rule in rules:
        if not rule.applies(context):
            continue
        shown = rule.check(full, context)
        if shown:
            out.append(Violation(rule, shown))
    return out


def rule(rule_id: str, pin_set: str = "seed") -> Rule:
    """The rule with this id in ``pin_set``'s contract (KeyError if none)."""
    for r in rules_for(pin_set):
        if r.id == rule_id:
            return r
    raise KeyError(rule_id)


# --- the launcher's environment ----------------------------------------------------------------------
_RESOLVE = r"""set -euo pipefail
if [[ -n "$1" ]]; then
  set -a
  # shellcheck source=/dev/null
  source "$1"
  set +a
fi
if [[ -n "$2" ]]; then
  # shellcheck source=/dev/null
  source "$2" --check=warn 2>/dev/null
fi
env -0
"""


def resolve_launch_env(env: Mapping[str, str] | None = None, env_script: str | os.PathLike[str] | None = None,
                       npu_env: str | os.PathLike[str] | None = DEFAULT_NPU_ENV, timeout_s: float = 60.0) -> dict[str, str]:
    """The environment after the launcher's sourcing steps, computed by bash itself.

    ``ray_start_npu.sh`` sources ``env_script`` with ``set -a`` and then ``npu_env`` (``--check=warn``
    here: a missing CANN is preflight's ``[cann]`` finding, not a resolution error) under
    ``set -euo pipefail``; this runs the same in a fresh bash started with ``env`` and returns its
    ``env -0``.

    Raises:
        EnvResolveError: a file is missing or sourcing it fails (its stderr's last line).
    """
    for f in (env_script, npu_env):
        if f and not Path(f).is_file():
            raise EnvResolveError(f"env file not found: {f}")
    run_env = dict(os.environ if env is None else env)
    run_env.setdefault("PATH", os.defpath)
    cmd = ["bash", "-c", _RESOLVE, "_", str(env_script or ""), str(npu_env or "")]
    try:
        proc = subprocess.run(cmd, env=run_env, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise EnvResolveError(f"sourcing the env file(s) did not finish within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        files = " and ".join(str(f) for f in (env_script, npu_env) if f)
        raise EnvResolveError(f"sourcing {files} failed: {lines[-1] if lines else f'exit code {proc.returncode}'}")
    out: dict[str, str] = {}
    for item in proc.stdout.split(b"\0"):
        if item:
            key, _, value = item.decode(errors="replace").partition("=")
            out[key] = value
    for key in ("_", "SHLVL", "PWD", "OLDPWD"):
        if key in run_env:
            out[key] = run_env[key]
        else:
            out.pop(key, None)
    return out


# --- docs ----------------------------------------------------------------------------------------------
def markdown_table(pin_set: str = "seed") -> str:
    """The contract of ``pin_set`` as a Markdown table (docs/environment.md's generated:env-contract section;
    ``current``: generated:env-contract-current, with the seed rules' fate)."""
    rows = ["| rule | variable / engine key | breaks when | applies when | upstream (pinned) |",
            "|---|---|---|---|---|"]
    if pin_set != "seed":
        return _markdown_current(rows)
    for r in RULES:
        cites = ", ".join(f"`{ref.cite()}`" for ref in r.refs)
        rows.append(f"| `{r.id}` | `{r.subject}` | {r.breaking} | {r.condition} | {cites} |")
    fixed = "; ".join(f"`{var}` {what}, rule `{rid}`" for var, (what, rid) in FIXED_VALUES.items())
    return "\n".join(rows) + f"\n\nFixed in the shipped env files: {fixed}."


def _markdown_current(rows: list[str]) -> str:
    for r in CURRENT_RULES:
        cites = ", ".join(f"`{ref.cite()}`" for ref in r.refs)
        rows.append(f"| `{r.id}` | `{r.subject}` | {r.breaking} | {r.condition} | {cites} |")
    fate = ["| seed rule | in the current set | what changed |", "|---|---|---|"]
    fate += [f"| `{rid}` | {status} | {note} |" for rid, (status, note) in SEED_RULE_FATE.items()]
    return ("\n".join(rows) + "\n\nThe seed rules in the current set (upstream lines above):\n\n" + "\n".join(fate)
            + "\n\nFixed in the shipped env files: `VLLM_ASCEND_ENABLE_NZ` `0` in internal/npu_env.sh (both sets), "
              "rules `nz-wake-up` and `nz-weight-update`.")
