"""The verl seam: the ``qwen3_rl`` config group, one typed dataclass per feature, and the hooks verl calls.

verl's seam patch (``patches/verl/0013-verl-feature-qwen3_rl_seam.patch``) adds a root config group
``qwen3_rl`` (empty by default; the rollout workers see it as ``actor_rollout_ref.rollout.qwen3_rl``) and
``verl/utils/qwen3_rl_hooks.py``, which imports this module only once the group holds a key. Every
section of the group is one feature; its dataclass below holds the feature's keys, types and defaults,
and nowhere else declares them (``features.toml`` maps each env var to ``qwen3_rl.<feature>.<key>`` and
takes the default from here, see :func:`feature_defaults`).

Hook points (called by verl's ``RayPPOTrainer`` / SPMD ``vLLMRollout`` and by our DAPO trainer):

* :class:`TrainerHooks`: ``before_generate`` / ``after_generate`` around each ``generate_sequences``,
  ``step_metrics`` once per step (data rebalance, spec-decode metrics);
* :class:`RolloutHooks`: ``engine_built`` after the ``vllm.LLM`` exists (gc policy, rollout rebalance),
  ``generate_kwargs`` for ``LLM.generate`` (progress bar), ``before_generate`` / ``after_generate``
  around it (spec-decode counters into the output's ``meta_info['metrics']``); in server mode
  ``worker_call`` around each call of a server's engine core to the hybrid worker (gc policy);
* :class:`WeightSyncHooks` (verl's Megatron ``rollout_mode`` -> ``per_tensor_generator``): ``expert_sync``
  claims the routed-expert tensors of the train -> rollout weight sync (GroupedMLP weights, all-to-allv).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from qwen3_rl.parallel.hdp import HDPConfig
from qwen3_rl.rollout.rebalance import RebalanceSettings

GROUP = "qwen3_rl"


class SeamConfigError(ValueError):
    """A bad ``qwen3_rl`` group: unknown feature or key, wrong type, or a value its feature refuses."""


@dataclass(frozen=True)
class ProgressBar:
    """``qwen3_rl.progress_bar``: a tqdm bar over each rollout's ``LLM.generate`` (TP rank 0 of each replica)."""

    enable: bool = False


@dataclass(frozen=True)
class DisableGc:
    """``qwen3_rl.disable_gc``: Python gc off during each vLLM engine step, on between steps (vLLM seam)."""

    enable: bool = False


@dataclass(frozen=True)
class DataRebalance:
    """``qwen3_rl.data_rebalance``: deal each prompt's n samples over the rollout DP ranks before
    generation, dataset order restored right after it (sync rollout only); ``by_key``: a prompt's samples go to
    ranks chosen by its group key instead of its batch position (its SAM history is where it runs again)."""

    enable: bool = False
    by_key: bool = False


@dataclass(frozen=True)
class SpecDecodeMetrics:
    """``qwen3_rl.spec_decode_metrics``: vLLM's spec-decode counters of each rollout as the step metrics
    ``rollout/spec_decode/*`` (acts only while a drafter is configured and vLLM's stat logging is on)."""

    enable: bool = False


@dataclass(frozen=True)
class ServerRouting:
    """``qwen3_rl.server_routing``: in verl's server rollout (``rollout.mode=async``), a prompt's samples go to
    one vLLM engine (a server, and with vLLM DP > 1 one of its DP ranks, which the request carries): siblings
    follow the first sample, whose engine is the prompt's rendezvous choice among the engines within ``slack``
    requests in flight of the least busy (:mod:`qwen3_rl.rollout.server_routing`); ``rollout/routing/*``."""

    enable: bool = False
    #: requests in flight a prompt's preferred engine may exceed the least busy one by and still get it
    slack: int = 0
    #: prompts remembered per agent-loop worker (least recently used forgotten first)
    max_prompts: int = 100_000

    def __post_init__(self) -> None:
        if self.max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1, got {self.max_prompts}")
        if self.slack < 0:
            raise ValueError(f"slack must be >= 0, got {self.slack}")


@dataclass(frozen=True)
class ServerAuth:
    """``qwen3_rl.server_auth``: each vLLM server of the server rollout requires an API key on every route of its
    HTTP endpoint but the liveness probe ``/health`` (vLLM's own ``--api-key`` check guards only ``/v1/*``; the
    recipe's middleware :class:`qwen3_rl.rollout.server_auth.KeyEveryRoute` the rest); the key is made in the
    server's process at start-up (``secrets.token_hex``, per server and run), never printed
    (:meth:`ServerHooks.printable`), and handed only to who asks the server actor for it. verl's own rollout calls
    the servers through Ray, not HTTP. On by default (a security fix: verl 0.6.1 serves the endpoint open on the
    node's address)."""

    enable: bool = True


@dataclass(frozen=True)
class ServerHttp:
    """``qwen3_rl.server_http``: where each vLLM server's HTTP endpoint listens (``host``): ``loopback``
    (127.0.0.1, the default: the rollout calls the servers through Ray, so only processes on the server's node
    need the port), ``node`` (the node's address, verl 0.6.1's own choice) or ``all`` (every interface)."""

    host: str = "loopback"

    def __post_init__(self) -> None:
        from qwen3_rl.rollout.server_auth import HOSTS

        if self.host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)}, got {self.host!r}")


@dataclass(frozen=True)
class OldLogProb:
    """``qwen3_rl.old_log_prob``: on-policy update without the old-log-prob forward; the Megatron actor takes
    its own current log-prob (detached) as pi_old (:mod:`qwen3_rl.trainer.old_log_prob`)."""

    enable: bool = False


# ---- weight-sync features (train -> rollout; :class:`WeightSyncHooks` at the end of this module) -----------


@dataclass(frozen=True)
class GroupedMlpWeights:
    """``qwen3_rl.grouped_mlp_weights``: the weight sync streams megatron-core GroupedMLP experts
    (``experts.weight1`` / ``weight2``: MindSpeed's all-to-all overlap, ``moe_use_legacy_grouped_gemm``) as
    per-expert HF tensors (:mod:`qwen3_rl.moe.fused_experts_verl`); acts only on a model with that layout."""

    enable: bool = False


@dataclass(frozen=True)
class MoeAlltoallv:
    """``qwen3_rl.moe_alltoallv``: routed experts go to the rollout with one all-to-allv per expert tensor,
    each rank receiving only the experts its vLLM EP rank holds (:mod:`qwen3_rl.moe.reshard_verl`; needs
    vLLM expert parallel, sync SPMD rollout, rollout world = training world)."""

    enable: bool = False


#: feature name (the group's section) -> its dataclass; ``rollout_rebalance`` is the coordinator's own settings,
#: ``hdp`` the actor's HDP settings (:class:`qwen3_rl.parallel.hdp.HDPConfig`)
FEATURES: dict[str, type] = {
    "progress_bar": ProgressBar,
    "disable_gc": DisableGc,
    "data_rebalance": DataRebalance,
    "rollout_rebalance": RebalanceSettings,
    "spec_decode_metrics": SpecDecodeMetrics,
    "server_routing": ServerRouting,
    "server_auth": ServerAuth,
    "server_http": ServerHttp,
    "old_log_prob": OldLogProb,
    "hdp": HDPConfig,
    # weight sync
    "grouped_mlp_weights": GroupedMlpWeights,
    "moe_alltoallv": MoeAlltoallv,
}


@dataclass(frozen=True)
class RecipeConfig:
    """The validated ``qwen3_rl`` group: one dataclass per feature (missing sections take their defaults)."""

    progress_bar: ProgressBar = field(default_factory=ProgressBar)
    disable_gc: DisableGc = field(default_factory=DisableGc)
    data_rebalance: DataRebalance = field(default_factory=DataRebalance)
    rollout_rebalance: RebalanceSettings = field(default_factory=RebalanceSettings)
    spec_decode_metrics: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)
    server_routing: ServerRouting = field(default_factory=ServerRouting)
    server_auth: ServerAuth = field(default_factory=ServerAuth)
    server_http: ServerHttp = field(default_factory=ServerHttp)
    old_log_prob: OldLogProb = field(default_factory=OldLogProb)
    hdp: HDPConfig = field(default_factory=HDPConfig)
    # weight sync
    grouped_mlp_weights: GroupedMlpWeights = field(default_factory=GroupedMlpWeights)
    moe_alltoallv: MoeAlltoallv = field(default_factory=MoeAlltoallv)

    @classmethod
    def from_group(cls, group: Any) -> RecipeConfig:
        """Validate a ``qwen3_rl`` group (dict, OmegaConf DictConfig or None).

        Raises:
            SeamConfigError: one line naming the key (``qwen3_rl.<feature>.<key>``) for an unknown
                feature or key, a value of the wrong type, or one the feature's checks refuse.
        """
        raw = _plain(group)
        if not isinstance(raw, Mapping):
            raise SeamConfigError(f"{GROUP} must be a mapping of features, got {raw!r}")
        out: dict[str, Any] = {}
        for name, section in raw.items():
            if name not in FEATURES:
                raise SeamConfigError(f"{GROUP}.{name}: unknown feature (known: {', '.join(FEATURES)})")
            out[name] = _build(FEATURES[name], f"{GROUP}.{name}", section)
        return cls(**out)


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain Python (other values unchanged)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        return value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return {} if value is None else value


def _check_type(key: str, value: Any, typ: Any) -> Any:
    """``value`` as ``typ`` (bool, int, float, str, or one of them ``| None``); anything else is a one-line
    SeamConfigError."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(typ)) == 2:  # ``X | None``: None, or an X
        return None if value is None else _check_type(key, value, args[0])
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif typ is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - the dataclasses above use these four only
        raise SeamConfigError(f"{key}: unsupported declared type {typ!r}")
    if not ok:
        raise SeamConfigError(f"{key} must be {typ.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _build(cls: type, prefix: str, section: Any) -> Any:
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise SeamConfigError(f"{prefix} must be a mapping of keys, got {section!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in section.items():
        if key not in names:
            raise SeamConfigError(f"{prefix}.{key}: unknown key (known: {', '.join(names)})")
        kwargs[key] = _check_type(f"{prefix}.{key}", value, hints[key])
    try:
        return cls(**kwargs)
    except ValueError as e:  # the feature's own checks (__post_init__)
        raise SeamConfigError(f"{prefix}: {e}") from e


def feature_defaults() -> dict[str, Any]:
    """Every key of the group with its default and type: ``{"qwen3_rl.<feature>.<key>": (default, type)}``
    (the registry's defaults for keys in the group come from here)."""
    out: dict[str, Any] = {}
    for name, cls in FEATURES.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out[f"{GROUP}.{name}.{f.name}"] = (default, hints[f.name])
    return out


def group_of(config: Any) -> Any:
    """The ``qwen3_rl`` group of a config node (trainer root or rollout config; dict, DictConfig or dataclass)."""
    getter = getattr(config, "get", None)
    return getter(GROUP, None) if callable(getter) else getattr(config, GROUP, None)


# ---- trainer side ------------------------------------------------------------------------------------


class TrainerHooks:
    """Called by ``RayPPOTrainer.fit`` / ``_validate`` and :mod:`qwen3_rl.trainer.dapo` around the rollout."""

    def __init__(self, config: Any, recipe: RecipeConfig) -> None:
        self.config = config
        self.recipe = recipe

    @classmethod
    def from_trainer_config(cls, config: Any) -> TrainerHooks:
        """Validate the trainer config's ``qwen3_rl`` group (in the driver, before any worker starts).

        Raises:
            SeamConfigError: a bad group; OldLogProbConfigError: ``old_log_prob`` on for an off-policy update.
        """
        recipe = RecipeConfig.from_group(group_of(config))
        if recipe.old_log_prob.enable:
            from qwen3_rl.trainer.old_log_prob import check_on_policy

            check_on_policy(config)
        return cls(config, recipe)

    def skip_old_log_prob(self, batch: Any) -> bool:
        """Before the old-log-prob pass (``compute_log_prob``): True when the actor takes its own current
        log-prob as pi_old (``old_log_prob``); the batch then gets what that pass carried
        (``meta_info['temperature']``) and the trainer skips the pass."""
        if not self.recipe.old_log_prob.enable:
            return False
        from qwen3_rl.trainer.old_log_prob import prepare_batch_without_old_log_prob

        prepare_batch_without_old_log_prob(batch.meta_info, self.config)
        return True

    def before_generate(self, trainer: Any, batch: Any, n: int = 1) -> tuple[Any, Any]:
        """Before ``generate_sequences``: returns ``(batch_for_generation, state for after_generate)``.

        ``batch``: ``num_prompts * n`` rows, samples of a prompt adjacent (``n=1``: validation batches)."""
        if not self.recipe.data_rebalance.enable:
            return batch, None
        from qwen3_rl.rollout.data_rebalance import permute_for_rollout_on

        return permute_for_rollout_on(self.config, trainer.actor_rollout_wg, batch, n=n,
                                      async_mode=bool(getattr(trainer, "async_rollout_mode", False)),
                                      by_key=self.recipe.data_rebalance.by_key)

    def after_generate(self, trainer: Any, output: Any, state: Any,
                       counts: MutableMapping[str, int] | None = None) -> Any:
        """After ``generate_sequences``: the output back in dataset order; the rollout's spec-decode counts
        moved from its ``meta_info`` into ``counts`` (None: dropped, e.g. validation)."""
        from qwen3_rl.spec_decode.metrics import merge_counts

        popped = pop_rollout_counts(output.meta_info)
        if counts is not None and popped:
            counts.update(merge_counts(counts, popped))
        if state is None:
            return output
        from qwen3_rl.rollout.data_rebalance import restore_after_rollout

        return restore_after_rollout(output, state)

    def step_metrics(self, counts: Mapping[str, int]) -> dict[str, float]:
        """The step's ``rollout/spec_decode/*`` (and, with server routing, ``rollout/routing/*``) metrics from
        the counts summed over its generation batches."""
        out: dict[str, float] = {}
        if self.recipe.spec_decode_metrics.enable:
            from qwen3_rl.spec_decode.metrics import step_metrics

            out.update(step_metrics({k: v for k, v in counts.items() if not k.startswith("routing_")}))
        if self.recipe.server_routing.enable:
            from qwen3_rl.rollout.server_routing import routing_metrics

            out.update(routing_metrics(counts))
        return out


# ---- rollout side ------------------------------------------------------------------------------------


class RolloutHooks:
    """Called by verl's SPMD ``vLLMRollout`` (in the rollout worker process that owns the ``vllm.LLM``)."""

    def __init__(self, rollout_config: Any, recipe: RecipeConfig) -> None:
        self.config = rollout_config
        self.recipe = recipe

    @classmethod
    def from_rollout_config(cls, rollout_config: Any) -> RolloutHooks:
        """Validate ``actor_rollout_ref.rollout.qwen3_rl`` (RolloutConfig dataclass, DictConfig or dict)."""
        return cls(rollout_config, RecipeConfig.from_group(group_of(rollout_config)))

    def engine_built(self, llm: Any) -> None:
        """Right after the ``vllm.LLM`` is built: the gc policy of the engine step and rollout rebalance."""
        from qwen3_rl.rollout.gc_control import set_decode_gc_disabled

        set_decode_gc_disabled(self.recipe.disable_gc.enable)
        if self.recipe.rollout_rebalance.enable:
            from qwen3_rl.rollout.migration import apply_rebalance_settings

            apply_rebalance_settings(self.recipe.rollout_rebalance, llm)

    def worker_call(self, worker: Any, method: Any) -> Any:
        """Server rollout, in the hybrid worker (``vLLMAsyncRollout``, verl's ZeroMQ executor): the context of one
        call ``method`` (a name, or a pickled callable) of the server's engine core to ``worker`` (vLLM's
        ``WorkerWrapperBase``). ``disable_gc``: the collector off during the model's steps (``execute_model`` /
        ``sample_tokens``), as ``gc_guard`` does in the engine core process."""
        from contextlib import nullcontext

        if self.recipe.disable_gc.enable and method in MODEL_STEP_METHODS:
            from qwen3_rl.rollout.gc_control import gc_disabled

            return gc_disabled()
        return nullcontext()

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``LLM.generate`` (``use_tqdm``: the bar on TP rank 0 of each replica)."""
        from qwen3_rl.compat.rollout_progress import rollout_use_tqdm

        tp = _get(self.config, "tensor_model_parallel_size", 1)
        return {"use_tqdm": rollout_use_tqdm(self.recipe.progress_bar.enable, tp)}

    def before_generate(self, llm: Any) -> Any:
        """Before ``LLM.generate``: the spec-decode probe (None when the feature is off)."""
        if not self.recipe.spec_decode_metrics.enable:
            return None
        from qwen3_rl.spec_decode.metrics import RolloutProbe

        return RolloutProbe(self.config, llm)

    def after_generate(self, llm: Any, state: Any) -> dict[str, Any]:
        """After ``LLM.generate``: the ``meta_info`` of the rollout's output (the spec-decode counts of the
        call as ``metrics`` entries, which ``DataProto.concat`` lists per worker)."""
        if state is None:
            return {}
        from qwen3_rl.spec_decode.metrics import META_KEY

        counts = state.finish()
        # verl's per-worker metrics channel: DataProto.concat lists each collected worker's value per key
        return {"metrics": {f"{META_KEY}/{k}": v for k, v in counts.items()}} if counts else {}


#: the calls of vLLM's engine core to its executor's workers that run the model (``vllm/v1/executor/abstract.py``)
MODEL_STEP_METHODS = ("execute_model", "sample_tokens")


# ---- server rollout (verl's agent loop over vLLM servers, rollout.mode=async) ------------------------------


class ServerHooks:
    """Called by verl's server rollout (``verl/experimental/agent_loop/agent_loop.py``):

    * ``AsyncLLMServerManager`` (one per agent-loop worker): :meth:`route` for each request and
      :meth:`request_done` when its answer is back;
    * ``vLLMHttpServerBase`` (each server actor): :meth:`server_args` / :meth:`printable` at start-up and
      :meth:`request_kwargs` per request (the vLLM DP rank the route chose);
    * ``AgentLoopWorker.generate_sequences``: :meth:`worker_meta`, the worker's routing counts of the call;
    * ``AgentLoopManager.generate_sequences`` (the trainer's process): :meth:`before_generate` /
      :meth:`after_generate` around the call: the servers' spec-decode counter deltas and the workers'
      routing counts as ``meta_info['metrics']`` entries, which the trainer hooks turn into step metrics.
    """

    def __init__(self, rollout_config: Any, recipe: RecipeConfig) -> None:
        self.config = rollout_config
        self.recipe = recipe
        self.router: Any = None
        self.api_key: str | None = None

    @classmethod
    def from_rollout_config(cls, rollout_config: Any) -> ServerHooks:
        """Validate ``actor_rollout_ref.rollout.qwen3_rl`` (DictConfig, dict or RolloutConfig)."""
        return cls(rollout_config, RecipeConfig.from_group(group_of(rollout_config)))

    # -- in each vLLM server actor (vLLMHttpServerBase.launch_server) --

    def server_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """The server's ``vllm serve`` arguments (name -> value), with the recipe's additions (server_auth: a new
        ``api_key``, kept as :attr:`api_key` in this process, and the ``middleware`` that keys every route but
        ``/health`` with it; disable_gc: ``additional_config.qwen3_rl.disable_gc``,
        which the ``gc_guard`` hook reads in the server's engine core processes; rollout_rebalance: its settings as
        ``additional_config.qwen3_rl.rollout_rebalance``, which the ``rollout_rebalance`` hook of each DP engine
        core reads, :func:`qwen3_rl.rollout.vllm_engine_hook.core_settings`)."""
        out = dict(args)
        engine: dict[str, Any] = {}
        if self.recipe.disable_gc.enable:
            engine["disable_gc"] = True
        if self.recipe.rollout_rebalance.enable:
            from qwen3_rl.rollout.vllm_engine_hook import CORE_SETTINGS_KEY

            engine[CORE_SETTINGS_KEY] = dataclasses.asdict(self.recipe.rollout_rebalance)
        if engine:
            from qwen3_rl.rollout.gc_control import ENGINE_CONFIG_KEY

            extra = _plain(out.get("additional_config"))  # verl json-dumps a dict argument (verl patch 0010)
            if isinstance(extra, str):
                import json

                extra = json.loads(extra)
            extra = dict(extra)
            extra[ENGINE_CONFIG_KEY] = {**dict(extra.get(ENGINE_CONFIG_KEY) or {}), **engine}
            out["additional_config"] = extra
        if self.recipe.server_auth.enable:
            import secrets

            # hex: a url-safe token starts with "-" once in 64 and verl hands it to vLLM's argparse as
            # "--api_key <key>", which then reads it as an option ("expected at least one argument")
            self.api_key = secrets.token_hex(32)
            out["api_key"] = self.api_key
            from qwen3_rl.rollout.server_auth import MIDDLEWARE

            # vLLM's own key check guards only /v1/*: this one every route but the liveness probe
            out["middleware"] = MIDDLEWARE
        return out

    def http_address(self, node_address: str) -> tuple[str, str]:
        """(address the server's HTTP endpoint binds, address it reports) for ``server_http.host``;
        ``node_address``: the node's address verl found (verl patch 0017, ``vLLMHttpServerBase.run_server``)."""
        from qwen3_rl.rollout.server_auth import http_address

        return http_address(self.recipe.server_http.host, node_address)

    def printable(self, server_args: list[str]) -> list[str]:
        """``server_args`` as verl prints them: the value after ``--api_key`` masked."""
        out = list(server_args)
        for i, a in enumerate(out[:-1]):
            if a in ("--api_key", "--api-key"):
                out[i + 1] = "***"
        return out

    # -- in each agent-loop worker --

    def route(self, manager: Any, request_id: str, prompt_ids: Any,
              sampling_params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The server (Ray actor handle) for one request and its sampling parameters: verl's own choice and the
        parameters unchanged unless ``server_routing`` is on; then the group router's engine, the vLLM DP rank
        added under :data:`DP_RANK_KEY` (a new dict: verl shares one dict between a batch's requests)."""
        if not self.recipe.server_routing.enable:
            return manager._choose_server(request_id), sampling_params
        if self.router is None:
            from qwen3_rl.rollout.server_routing import GroupRouter

            # one order every worker agrees on (each manager shuffles its own list): by Ray actor id
            self._handles = sorted(manager.server_handles, key=_actor_key)
            cfg = self.recipe.server_routing
            self.router = GroupRouter(len(self._handles), dp=server_dp_size(self.config), slack=cfg.slack,
                                      max_keys=cfg.max_prompts)
        # a resumed partial rollout (fully async) sends its prompt plus its response so far and says where its
        # prompt ends: routed by the prompt, it stays on its siblings' engine
        from qwen3_rl.spec_decode.runner_drafter import GROUP_PROMPT_LEN_KEY

        group_len = sampling_params.get(GROUP_PROMPT_LEN_KEY)
        if group_len is None:
            target = self.router.choose(request_id, prompt_ids)
        else:
            target = self.router.choose(request_id, list(prompt_ids)[:int(group_len)], resumed=True)
        return self._handles[target // self.router.dp], {**sampling_params, DP_RANK_KEY: target % self.router.dp}

    def request_kwargs(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
        """In the server, per request: the keyword arguments for ``AsyncLLM.generate`` the route added
        (``data_parallel_rank``), popped from ``sampling_params`` before verl builds vLLM's ``SamplingParams``."""
        rank = sampling_params.pop(DP_RANK_KEY, None)
        return {} if rank is None else {"data_parallel_rank": int(rank)}

    def request_done(self, request_id: str, output: Any) -> None:
        """A request's answer is back (``output.token_ids``: its response tokens)."""
        if self.router is not None:
            self.router.done(request_id, len(getattr(output, "token_ids", None) or ()))

    def worker_meta(self) -> dict[str, Any]:
        """The agent-loop worker's routing counts since its last call ({} without routing), for its output's
        ``meta_info`` (popped again by :meth:`after_generate` before verl concatenates the outputs)."""
        if self.router is None:
            return {}
        return {ROUTING_META_KEY: self.router.take_counts()}

    # -- in the trainer's process (AgentLoopManager) --

    def before_generate(self, server_handles: list[Any]) -> Any:
        """Before the call: the servers' spec-decode counters (None while the feature or the drafter is off)."""
        if not self.recipe.spec_decode_metrics.enable:
            return None
        from qwen3_rl.spec_decode.requests import speculative_method

        if speculative_method(self.config) is None:
            return None
        return _read_server_counters(server_handles)

    def after_generate(self, server_handles: list[Any], state: Any, outputs: list[Any]) -> dict[str, Any]:
        """After the call, before verl concatenates the workers' ``outputs`` (each one's routing counts are
        popped from its ``meta_info``): entries for the output's ``meta_info['metrics']``."""
        from qwen3_rl.spec_decode.metrics import META_KEY, counter_delta, merge_counts

        counts: dict[str, int] = {}
        for out in outputs:
            counts = merge_counts(counts, out.meta_info.pop(ROUTING_META_KEY, None))
        if state is not None:
            after = _read_server_counters(server_handles)
            for name, before in state.items():
                counts = merge_counts(counts, counter_delta(before, after.get(name, {})))
        return {f"{META_KEY}/{k}": v for k, v in counts.items()}


#: an agent-loop worker's output ``meta_info`` key of its routing counts (popped before verl's concat)
ROUTING_META_KEY = "qwen3_rl_routing"
#: the sampling-parameter key that carries the routed vLLM DP rank from the agent loop to the server
DP_RANK_KEY = "qwen3_rl_dp_rank"


def server_dp_size(rollout_config: Any) -> int:
    """vLLM DP ranks inside one server of verl's server rollout: ``rollout.data_parallel_size`` when expert
    parallel is on (verl's server starts vLLM DP only then, ``vllm_async_server.py:251-271``), else 1."""
    if int(_get(rollout_config, "expert_parallel_size", 1) or 1) > 1:
        return int(_get(rollout_config, "data_parallel_size", 1) or 1)
    return 1


def _actor_key(handle: Any) -> str:
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else repr(handle)


def _server_counters(server: Any) -> dict[str, int]:
    """Inside a vLLM server actor (``__ray_call__``): its engines' spec-decode counters, from vLLM's
    Prometheus registry in that process (the ``AsyncLLM`` lives there; {} counts with stats off)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    from qwen3_rl.spec_decode.metrics import read_counters

    return read_counters(get_metrics_snapshot())


def _read_server_counters(server_handles: list[Any]) -> dict[str, dict[str, int]]:
    import ray

    counts = ray.get([h.__ray_call__.remote(_server_counters) for h in server_handles])
    return {_actor_key(h): c for h, c in zip(server_handles, counts, strict=True)}


# ---- actor side (verl's Megatron actor, MegatronPPOActor) ------------------------------------------------


class ActorHooks:
    """Called by verl's ``MegatronPPOActor`` (in the actor worker process) while the actor's group
    ``actor_rollout_ref.actor.qwen3_rl`` enables an actor feature (``old_log_prob``, ``hdp``).

    Hook points: ``actor_built`` (end of ``__init__``), ``minibatch_keys`` (``make_minibatch_iterator``),
    ``micro_batches`` / ``assemble`` (``forward_backward_batch`` / ``compute_log_prob``: the feature's own
    micro-batching, e.g. HDP), ``calculate_entropy`` / ``entropy_metric_only`` (the training forward),
    ``old_log_prob_for_loss`` / ``policy_loss`` / ``scale_loss`` (the loss function).
    """

    def __init__(self, actor_config: Any, recipe: RecipeConfig) -> None:
        from qwen3_rl.trainer.old_log_prob import training_entropy

        self.config = actor_config
        self.recipe = recipe
        self.use_current_log_prob = recipe.old_log_prob.enable
        self.entropy_plan = training_entropy(_get(actor_config, "entropy_coeff", 0.0), self.use_current_log_prob)
        self.hdp: Any = None  # HDPRuntime once actor_built ran with hdp.enable

    @classmethod
    def from_actor_config(cls, actor_config: Any) -> ActorHooks | None:
        """Validate ``actor_rollout_ref.actor.qwen3_rl``; None when it enables no actor feature (the actor then
        runs upstream's code paths)."""
        recipe = RecipeConfig.from_group(group_of(actor_config))
        if not (recipe.old_log_prob.enable or recipe.hdp.enable):
            return None
        return cls(actor_config, recipe)

    def actor_built(self, actor: Any, mpu: Any, device: Any) -> None:
        """End of ``MegatronPPOActor.__init__`` (collective with HDP: every rank builds its sub-groups).

        Args:
            actor: the actor (``loss_agg_mode``, ``use_fused_kernels``, ``use_dynamic_bsz`` are checked).
            mpu: Megatron's ``parallel_state`` as the actor module holds it.
            device: where the micro-batch-count all-reduce runs (``get_device_id()``).
        """
        if not self.recipe.hdp.enable:
            return
        from qwen3_rl.parallel.hdp_runtime import HDPRuntime, check_supported

        check_supported(self.config.loss_agg_mode, actor.use_fused_kernels,
                        mpu.get_virtual_pipeline_model_parallel_world_size(), self.config.use_dynamic_bsz)
        self.hdp = HDPRuntime.from_megatron(self.recipe.hdp, mpu, self.config.ppo_max_token_len_per_gpu,
                                            device=device)

    def minibatch_keys(self, data: Any, select_keys: list[str]) -> list[str]:
        """The batch keys the update reads: without ``old_log_probs`` under ``old_log_prob`` (after checking
        that this rank makes one optimizer step on ``data``)."""
        if not self.use_current_log_prob:
            return select_keys
        from qwen3_rl.trainer.old_log_prob import check_single_update

        check_single_update(len(data), self.config.ppo_mini_batch_size, self.config.ppo_epochs)
        return [k for k in select_keys if k != "old_log_probs"]

    def calculate_entropy(self, upstream: bool) -> bool:
        """Whether the training forward computes entropy (upstream: ``entropy_coeff != 0``; also for the
        ``actor/entropy`` metric the skipped old-log-prob pass reported)."""
        return upstream or self.entropy_plan.calculate

    def entropy_metric_only(self) -> bool:
        """The training forward's entropy is only a metric: computed without autograd (no saved softmax)."""
        return self.entropy_plan.detached

    def old_log_prob_for_loss(self, log_prob: Any, micro_batch: Any) -> Any:
        """pi_old [batch, response_len] for the policy loss (``log_prob.detach()`` under ``old_log_prob``)."""
        from qwen3_rl.trainer.old_log_prob import old_log_prob_for_loss

        return old_log_prob_for_loss(log_prob, micro_batch, self.use_current_log_prob)

    def policy_loss(self, pg_loss: Any, entropy_loss: Any, entropy_coeff: float, stats: dict[str, Any]) -> Any:
        """``pg_loss - entropy_coeff * entropy_loss`` when the bonus is in the loss, else ``pg_loss``; records
        ``actor/entropy`` in ``stats`` under ``old_log_prob``."""
        from qwen3_rl.trainer.old_log_prob import policy_loss_with_entropy

        return policy_loss_with_entropy(pg_loss, entropy_loss, entropy_coeff, self.entropy_plan, stats)

    def micro_batches(self, mini_batch: Any, forward_only: bool, use_dynamic_bsz: bool) -> tuple[list, Any] | None:
        """This rank's own micro-batches of ``mini_batch`` (HDP), or None (upstream's micro-batching).

        Returns:
            ``(items, step)``: items ``(rows, packing)`` for the schedule's batch iterator (``packing``: the
            mcore forward's ``packing`` argument and the loss function's ``meta_info['qwen3_rl']``), ``step``
            for :meth:`assemble` (``step.indices``: the rows of each micro-batch).
        """
        if self.hdp is None or not use_dynamic_bsz:
            return None
        from qwen3_rl.parallel.hdp_runtime import HDPPacking

        step = self.hdp.plan(mini_batch.batch["attention_mask"],
                             None if forward_only else mini_batch.batch["response_mask"])
        return [(rows, HDPPacking(mb)) for rows, mb in self.hdp.split(mini_batch.batch, step)], step

    def scale_loss(self, loss: Any, packing: Any) -> tuple[Any, bool]:
        """A micro-batch's loss under the feature's micro-batching: ``(loss * its scale, keep its statistics)``
        (HDP: token-mean over the CP group's mini-batch; a filler-only micro-batch has no statistics)."""
        return loss * packing.loss_scale, not packing.is_filler

    def assemble(self, rows: Any, step: Any, batch_size: int) -> Any:
        """Rows [n, ...] of this rank's micro-batches (schedule order) -> [batch_size, ...] in batch order."""
        return self.hdp.assemble(rows, step, batch_size)


def pop_rollout_counts(meta_info: MutableMapping[str, Any]) -> dict[str, int]:
    """Remove the rollouts' spec-decode counts from a generation output's ``meta_info['metrics']`` (one value
    per collected rollout worker = per vLLM engine, listed by ``DataProto.concat``) and return their sums."""
    from qwen3_rl.spec_decode.metrics import META_KEY

    metrics = meta_info.get("metrics")
    if not isinstance(metrics, MutableMapping):
        return {}
    prefix = META_KEY + "/"
    out: dict[str, int] = {}
    for key in [k for k in metrics if str(k).startswith(prefix)]:
        value = metrics.pop(key)
        out[key[len(prefix):]] = int(sum(value)) if isinstance(value, list | tuple) else int(value)
    if not metrics:
        meta_info.pop("metrics")
    return out


def _get(obj: Any, key: str, default: Any) -> Any:
    getter = getattr(obj, "get", None)
    return getter(key, default) if callable(getter) else getattr(obj, key, default)


# ---- weight-sync side (Megatron worker -> rollout) -------------------------------------------------------


class WeightSyncHooks:
    """Handed by verl's Megatron ``ActorRolloutRefWorker.rollout_mode`` to ``per_tensor_generator`` (built only
    when a weight-sync feature is on: :func:`from_rollout_config` returns None otherwise)."""

    def __init__(self, rollout_config: Any, recipe: RecipeConfig) -> None:
        self.config = rollout_config
        self.recipe = recipe
        self.rollout_layout: Any = None
        if recipe.moe_alltoallv.enable:  # checked here, in the worker, before any tensor is streamed
            from qwen3_rl.moe.reshard_verl import alltoallv_rollout_layout

            try:
                self.rollout_layout = alltoallv_rollout_layout(rollout_config)
            except ValueError as e:
                raise SeamConfigError(str(e)) from e

    @classmethod
    def from_rollout_config(cls, rollout_config: Any, uses_bridge: bool = False) -> WeightSyncHooks | None:
        """Validate ``actor_rollout_ref.rollout.qwen3_rl``; None when no weight-sync feature is on.

        uses_bridge: the worker exports through mbridge, which never calls ``per_tensor_generator``: a
        weight-sync feature on is then refused (SeamConfigError) instead of silently doing nothing.
        """
        recipe = RecipeConfig.from_group(group_of(rollout_config))
        on = [name for name in ("grouped_mlp_weights", "moe_alltoallv") if getattr(recipe, name).enable]
        if not on:
            return None
        if uses_bridge:
            raise SeamConfigError(
                f"{GROUP}.{on[0]} needs verl's own weight export (per_tensor_generator): set "
                "actor_rollout_ref.actor.megatron.use_mbridge=False")
        return cls(rollout_config, recipe)

    def expert_sync(self, mpu: Any, transformer_config: Any) -> Any:
        """``per_tensor_generator``'s routed-expert path on this rank, or None (upstream's EP/ETP all-gather).

        mpu: ``megatron.core.parallel_state``; transformer_config: the actor's TransformerConfig. Returns an
        object with ``handles(name) -> bool`` and ``sync_params(name, tensor, tp_concat, convert)`` yielding
        HF ``(name, tensor)`` pairs: :class:`qwen3_rl.moe.reshard_verl.MoEAlltoallvSync` (moe_alltoallv, either
        expert layout) or :class:`qwen3_rl.moe.fused_experts_verl.GroupedMLPGatherSync` (grouped_mlp_weights
        on a model with GroupedMLP experts); None for a dense model. Collective over megatron's expert groups.
        """
        from qwen3_rl.moe.fused_experts_verl import grouped_mlp_weights_enabled

        if not getattr(transformer_config, "num_moe_experts", None):  # dense model: no routed experts to claim
            return None
        grouped = grouped_mlp_weights_enabled(transformer_config)
        if self.recipe.moe_alltoallv.enable:
            from qwen3_rl.moe.reshard_verl import MoEAlltoallvSync

            return MoEAlltoallvSync.from_megatron(mpu, transformer_config.num_moe_experts, self.rollout_layout,
                                                  grouped)
        if self.recipe.grouped_mlp_weights.enable and grouped:
            from qwen3_rl.moe.fused_experts_verl import GroupedMLPGatherSync

            return GroupedMLPGatherSync.from_megatron(mpu, transformer_config.num_moe_experts)
        return None


# ---- config readers of the features (a feature module never imports the seam; the seam imports them) -----


def data_rebalance_enabled(config: Any) -> bool:
    """``qwen3_rl.data_rebalance.enable`` of the trainer config (validated here)."""
    return RecipeConfig.from_group(group_of(config)).data_rebalance.enable


def permute_for_rollout(
    config: Any, worker_group: Any, batch: Any, *, n: int = 1, async_mode: bool = False
) -> tuple[Any, Any]:
    """Before ``generate_sequences``: deal the repeated batch over the rollout DP pieces if switched on.

    Args:
        config: trainer config (reads ``qwen3_rl.data_rebalance.enable`` and, as fallback, sizes).
        worker_group: ``actor_rollout_wg`` (gives the dispatch DP size, see :func:`rollout_dp_size`).
        batch: the generation batch, ``num_prompts * n`` rows, samples of a prompt adjacent.
        n: samples per prompt (only checks that rows are whole groups; 1 skips the check, e.g. for a
            validation batch padded to the worker count).
        async_mode: the trainer's ``async_rollout_mode``; data rebalance needs the sync rollout.

    Returns:
        ``(batch_for_generation, perm)``; ``perm`` is None (batch returned as is) when the switch is off.

    Raises:
        DataRebalanceError: switch on in async mode (requests go to DP ranks by load there, so a batch
        order has no effect), or the batch size is not a multiple of the rollout DP size (verl's
        ``DataProto.chunk`` would refuse it too; the message names both numbers).
    """
    if not data_rebalance_enabled(config):
        return batch, None
    from qwen3_rl.rollout.data_rebalance import permute_for_rollout_on

    return permute_for_rollout_on(config, worker_group, batch, n=n, async_mode=async_mode)


def settings_from_rollout_config(rollout_cfg: Any) -> tuple[RebalanceSettings, int]:
    """``(RebalanceSettings, max_moves)`` from ``actor_rollout_ref.rollout`` (dataclass, DictConfig or dict): its
    ``qwen3_rl.rollout_rebalance`` section, validated here (defaults: the dataclass).

    A plain mapping without the group may give the section as flat keys (``rollout_rebalance`` = ``enable``,
    ``rollout_rebalance_<key>`` = ``<key>``), as the engine drivers do; the same validation applies."""
    group = group_of(rollout_cfg)
    if not group and isinstance(rollout_cfg, dict):
        flat = {("enable" if k == "rollout_rebalance" else k[len("rollout_rebalance_"):]): v
                for k, v in rollout_cfg.items() if k == "rollout_rebalance" or k.startswith("rollout_rebalance_")}
        group = {"rollout_rebalance": flat} if flat else None
    settings = RecipeConfig.from_group(group).rollout_rebalance
    return settings, settings.max_moves


def configure_rollout_rebalance(rollout_cfg: Any, llm: Any) -> RebalanceSettings:
    """Apply ``rollout.qwen3_rl.rollout_rebalance`` to a freshly built ``vllm.LLM``.

    Off (default): returns the settings, touches nothing. On: the engine must carry the engine-loop
    hook (``LLMEngine.<ENGINE_HOOK_ATTR>``, installed by a vLLM patch that calls
    :class:`RebalanceCoordinator` every step); without it this raises instead of silently running an
    unbalanced rollout. The settings are handed to the hook's ``configure(settings, max_moves)``.
    """
    from qwen3_rl.rollout.migration import apply_rebalance_settings

    settings, _ = settings_from_rollout_config(rollout_cfg)
    return apply_rebalance_settings(settings, llm)
