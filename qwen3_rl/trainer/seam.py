"""The verl seam: the ``qwen3_rl`` config group, one typed dataclass per feature, and the hooks verl calls.

verl's seam patch (``patches/verl/0014-verl-feature-qwen3_rl_seam.patch``) adds a root config group
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
  around it (spec-decode counters into the output's ``meta_info['metrics']``);
* :class:`WeightSyncHooks` (verl's Megatron ``rollout_mode`` -> ``per_tensor_generator``): ``expert_sync``
  claims the routed-expert tensors of the train -> rollout weight sync (GroupedMLP weights, all-to-allv).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

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
    generation, dataset order restored right after it (sync rollout only)."""

    enable: bool = False


@dataclass(frozen=True)
class SpecDecodeMetrics:
    """``qwen3_rl.spec_decode_metrics``: vLLM's spec-decode counters of each rollout as the step metrics
    ``rollout/spec_decode/*`` (acts only while a drafter is configured and vLLM's stat logging is on)."""

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


#: feature name (the group's section) -> its dataclass; ``rollout_rebalance`` is the coordinator's own settings
FEATURES: dict[str, type] = {
    "progress_bar": ProgressBar,
    "disable_gc": DisableGc,
    "data_rebalance": DataRebalance,
    "rollout_rebalance": RebalanceSettings,
    "spec_decode_metrics": SpecDecodeMetrics,
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
    """``value`` as ``typ`` (bool, int, float, str); anything else is a one-line SeamConfigError."""
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
        """Validate the trainer config's ``qwen3_rl`` group (in the driver, before any worker starts)."""
        return cls(config, RecipeConfig.from_group(group_of(config)))

    def before_generate(self, trainer: Any, batch: Any, n: int = 1) -> tuple[Any, Any]:
        """Before ``generate_sequences``: returns ``(batch_for_generation, state for after_generate)``.

        ``batch``: ``num_prompts * n`` rows, samples of a prompt adjacent (``n=1``: validation batches)."""
        if not self.recipe.data_rebalance.enable:
            return batch, None
        from qwen3_rl.rollout.data_rebalance import permute_for_rollout_on

        return permute_for_rollout_on(self.config, trainer.actor_rollout_wg, batch, n=n,
                                      async_mode=bool(getattr(trainer, "async_rollout_mode", False)))

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
        """The step's ``rollout/spec_decode/*`` metrics from the counts summed over its generation batches."""
        if not self.recipe.spec_decode_metrics.enable:
            return {}
        from qwen3_rl.spec_decode.metrics import step_metrics

        return step_metrics(counts)


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
