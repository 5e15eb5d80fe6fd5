"""vLLM general plugin of the recipe: fills the registries of the vLLM seam patch (``vllm/plugins/extensions.py``).

Declared in ``pyproject.toml`` as the ``vllm.general_plugins`` entry point ``qwen3_rl``; vLLM's
``load_general_plugins()`` calls :func:`register` once in every process that builds an engine, a worker or a
config (the seam's lookups load the plugins first). Upstream imports nothing of ours: without this package
installed (or with ``VLLM_PLUGINS`` not naming ``qwen3_rl``) the registries stay empty and patched vLLM /
vLLM-Ascend behave as pristine.

What it registers (each factory returns None, or an inert object, while its feature is off):

=====================================  ======  ===============================================================
point                                  order   object / when
=====================================  ======  ===============================================================
engine-step hook ``gc_guard``          10      :class:`~qwen3_rl.rollout.gc_control.GcStepHook`, always (the
                                               policy is switched per process later, by verl; off = no-op; in
                                               an engine core process: from ``additional_config``)
engine-step hook ``sam_sibling_exchange`` 20   :class:`~qwen3_rl.spec_decode.exchange_hook.SiblingExchangeHook`
                                               when ``sam_config.group_exchange`` is on, else None (refused in
                                               an engine core process)
engine-step hook ``rollout_rebalance`` 30      :class:`~qwen3_rl.rollout.vllm_engine_hook.VllmRebalanceHook`,
                                               always: verl configures it after the engine is built
                                               (``trainer.seam.configure_rollout_rebalance``); inert until then.
                                               Engine core process: ``CoreRebalanceHook`` when
                                               ``additional_config.qwen3_rl.rollout_rebalance.enable``, else None
drafter ``sam``                        -       :class:`~qwen3_rl.spec_decode.vllm_proposer.SamVllmProposer`
                                               (options key ``sam_config``), one per engine; on vLLM-Ascend its
                                               ``Proposer`` subclass ``ascend_adapter.SamAscendProposer``
factory ``spec_decode_gate``           -       vLLM-Ascend: ``BatchSizeGate`` when ``disable_by_batch_size`` is
                                               set (ngram/suffix; SAM gates itself), else None
factory ``ascend_eplb_policies``       -       vLLM-Ascend: ``{4: PackingAwareAscendPolicy}``
vLLM-Ascend ``register_eplb_policy``   -       vLLM-Ascend 0.23 (current set, patch ``vllm_ascend 0002
                                               eplb_policy_registry``): type 4, ``PackingAwareAscendPolicy``;
                                               registered also on a vLLM without the seam (vLLM 0.23)
factory ``ascend_moe_forward_impl``    -       vLLM-Ascend: the chunked-MoE-prefill wrapper when
                                               ``additional_config.moe_prefill_chunk_size`` > 0, else None
=====================================  ======  ===============================================================

The hooks of one engine run in ascending order at the seam's four points (``has_unfinished_requests``, around
``step``, on the engine-core outputs, on the request outputs); the SAM exchange therefore runs before the
rebalance round of the same step, on real and dummy steps alike.

Two engine loops build the hooks (:func:`qwen3_rl.compat.step_hook.is_engine_core` tells them apart): the in-process
``LLMEngine`` of verl's sync rollout, and the engine core process (``EngineCoreProc`` / ``DPEngineCoreProc``) that
``AsyncLLM`` drives in verl's servers, where the hooks' settings come from the engine's own ``additional_config``
(``{"qwen3_rl": {"disable_gc": ..., "rollout_rebalance": {...}}}``): verl's trainer does not reach that process.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINE_STEP_HOOKS",
    "ENTRY_POINT",
    "register",
    "register_ascend_eplb_policies",
    "write_entry_point_metadata",
]

logger = logging.getLogger(__name__)

#: the ``vllm.general_plugins`` entry point (name, object reference), as declared in pyproject.toml
ENTRY_POINT = ("qwen3_rl", "qwen3_rl.vllm_plugin:register")
#: distribution name of :func:`write_entry_point_metadata`'s metadata (not the package's own ``qwen3_rl``)
PLUGIN_DIST = "qwen3_rl_vllm_plugin"

#: attributes our factories set on ``LLMEngine`` so package code finds its hook (upstream names none of them)
REBALANCE_HOOK_ATTR = "qwen3_rl_rebalance_hook"
EXCHANGE_HOOK_ATTR = "qwen3_rl_sibling_exchange"


def gc_step_hook(engine: Any) -> Any:
    """``gc_guard``: Python gc off during each step while the per-process policy is on. In an engine core
    process (server mode) the policy is taken from the engine's ``additional_config`` here."""
    from qwen3_rl.compat.step_hook import is_engine_core
    from qwen3_rl.rollout.gc_control import GcStepHook, configure_from_vllm_config

    if is_engine_core(engine):
        configure_from_vllm_config(engine.vllm_config)
    return GcStepHook()


def sibling_exchange_step_hook(engine: Any) -> Any:
    """``sam_sibling_exchange``: the SAM sibling exchange between DP ranks, or None when it is off."""
    from qwen3_rl.compat.step_hook import is_engine_core
    from qwen3_rl.spec_decode.exchange_hook import SiblingExchangeHook, exchange_enabled

    if not exchange_enabled(getattr(engine, "vllm_config", None)):
        return None
    if is_engine_core(engine):
        raise RuntimeError(
            "sam_config.group_exchange needs verl's sync rollout (the in-process LLMEngine); in "
            "server mode a prompt's samples share one engine through SERVER_ROUTING instead"
        )
    hook = SiblingExchangeHook(engine)
    setattr(engine, EXCHANGE_HOOK_ATTR, hook)
    return hook


def rebalance_step_hook(engine: Any) -> Any:
    """``rollout_rebalance``: the rebalance hook of an ``LLMEngine`` (inert until verl configures it); in an
    engine core process (server mode) the engine-core variant when its ``additional_config`` switches it on,
    else none."""
    from qwen3_rl.compat.step_hook import is_engine_core
    from qwen3_rl.rollout.vllm_engine_hook import CoreRebalanceHook, VllmRebalanceHook, core_settings

    if is_engine_core(engine):
        settings = core_settings(getattr(engine, "vllm_config", None))
        if settings is None or not settings.enable:
            return None
        hook = CoreRebalanceHook(engine)
        setattr(engine, REBALANCE_HOOK_ATTR, hook)
        return hook

    hook = VllmRebalanceHook(engine)
    setattr(engine, REBALANCE_HOOK_ATTR, hook)
    return hook


#: (name, factory, order) of the engine-step hooks, in the order the engine runs them
ENGINE_STEP_HOOKS = (
    ("gc_guard", gc_step_hook, 10),
    ("sam_sibling_exchange", sibling_exchange_step_hook, 20),
    ("rollout_rebalance", rebalance_step_hook, 30),
)


def build_sam_drafter(vllm_config: Any, runner: Any) -> Any:
    """The ``sam`` drafter of one model runner, built once per engine by ``GPUModelRunner.__init__``: the
    ``Proposer`` subclass on vLLM-Ascend's ``NPUModelRunner``, else the plain vLLM drafter."""
    if type(runner).__module__.split(".")[0] == "vllm_ascend":
        from qwen3_rl.spec_decode.ascend_adapter import SamAscendProposer

        return SamAscendProposer(vllm_config, runner)
    from qwen3_rl.spec_decode.vllm_proposer import SamVllmProposer

    return SamVllmProposer(vllm_config, runner)


def _check_sam_input(cls: type, kwargs: Any) -> None:
    from qwen3_rl.spec_decode.config import check_sam_keys

    check_sam_keys(cls, kwargs)


def _validate_sam(spec: Any) -> None:
    from qwen3_rl.spec_decode.config import validate_sam_speculative_config

    validate_sam_speculative_config(spec)


def _eplb_policies() -> dict[int, type]:
    from qwen3_rl.moe.eplb_ascend_policy import extra_policies

    return extra_policies()


def _moe_forward_impl(layer: Any, vllm_config: Any) -> Any:
    from qwen3_rl.moe.chunking import forward_impl_hook

    return forward_impl_hook(layer, vllm_config)


def _spec_decode_gate(vllm_config: Any) -> Any:
    from qwen3_rl.spec_decode.bs_threshold import gate_factory

    return gate_factory(vllm_config)


def register_ascend_eplb_policies() -> bool:
    """Our EPLB policy types in vLLM-Ascend's own registry (``vllm_ascend.eplb.core.policy.policy_abstract
    .register_eplb_policy``, added by the current set's patch ``vllm_ascend 0002 eplb_policy_registry``).
    Returns False, registering nothing, without vLLM-Ascend or on one without that registry (the seed set's 0.13
    asks the seam's ``ascend_eplb_policies`` factory instead)."""
    if importlib.util.find_spec("vllm_ascend") is None:
        return False
    from vllm_ascend.eplb.core.policy import policy_abstract

    register_policy = getattr(policy_abstract, "register_eplb_policy", None)
    if register_policy is None:
        return False
    from qwen3_rl.moe.eplb_ascend_policy import extra_policies

    for policy_type, policy_class in extra_policies().items():
        register_policy(policy_type, policy_class)
    return True


#: The vLLM release the seam patch (patches/vllm/0003) is made for: without the seam there, the patch is missing.
SEAM_VLLM = "0.13."


def register() -> None:
    """Entry point ``vllm.general_plugins: qwen3_rl``. Idempotent (registries are keyed by name). On a vLLM
    without the seam patch it registers the EPLB policies with a vLLM-Ascend that has their registry, logs one
    line and registers nothing else."""
    register_ascend_eplb_policies()
    try:
        from vllm.plugins import extensions
    except ImportError:
        import vllm

        version = getattr(vllm, "__version__", "")
        if version.startswith(SEAM_VLLM):
            logger.warning(
                "qwen3_rl: this vLLM has no vllm.plugins.extensions (recipe seam patch not applied); "
                "the recipe's rollout features are unavailable"
            )
        else:  # the current set: SAM and gc control come as worker_cls / scheduler_cls, no seam (docs/sam_decoding.md)
            logger.debug("qwen3_rl: vLLM %s has no seam; features through worker_cls / scheduler_cls", version)
        return
    for name, factory, order in ENGINE_STEP_HOOKS:
        extensions.register_engine_step_hook(name, factory, order)
    extensions.register_drafter(
        extensions.DrafterSpec(
            method="sam",
            build=build_sam_drafter,
            options_key="sam_config",
            check_input=_check_sam_input,
            validate=_validate_sam,
        )
    )
    extensions.register_factory("spec_decode_gate", _spec_decode_gate)
    extensions.register_factory("ascend_eplb_policies", _eplb_policies)
    extensions.register_factory("ascend_moe_forward_impl", _moe_forward_impl)


def write_entry_point_metadata(meta_dir: Path) -> Path:
    """Write a minimal distribution (``<meta_dir>/qwen3_rl_vllm_plugin-0.dist-info``) that declares
    :data:`ENTRY_POINT`, for processes whose ``qwen3_rl`` comes from a source checkout on ``PYTHONPATH`` rather
    than an installed package (the CPU profile's trees, the tests): with ``meta_dir`` on the path, vLLM's
    ``load_general_plugins()`` finds the plugin. Returns the dist-info folder."""
    d = Path(meta_dir) / f"{PLUGIN_DIST}-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_DIST}\nVersion: 0\n")
    name, ref = ENTRY_POINT
    (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{name} = {ref}\n")
    return d
