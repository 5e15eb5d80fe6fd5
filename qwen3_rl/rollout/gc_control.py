"""Python garbage collection off during each vLLM engine step (engine-step hook ``gc_guard`` of the vLLM seam).

Why: during long decodes (34K tokens) every engine step allocates many short-lived Python objects
(request outputs, scheduler bookkeeping). CPython's generational collector then runs at arbitrary
points of a step and stalls the host thread that feeds the NPU; the decode becomes host bound.
Switching the collector off for the duration of one ``llm_engine.step()`` and back on between
steps moves collection to step boundaries, where it does not delay the device queue.

How it is switched (default: off):

* The policy lives in this module, per process. It is off until someone calls
  :func:`set_decode_gc_disabled` with ``True``.
* :class:`GcStepHook`, registered by :mod:`qwen3_rl.vllm_plugin` as the engine-step hook ``gc_guard``, wraps
  each ``LLMEngine.step()`` in :func:`engine_step_gc_guard`, which does nothing while the policy is off.
* The verl side turns it on from its Hydra config: the rollout worker, in the process that owns
  the ``vllm.LLM`` object, calls ``configure_from_rollout_config(config)`` (or
  ``set_decode_gc_disabled(bool(...))`` directly) before generating. The config key is
  :data:`CONFIG_KEY` under the rollout config, i.e.
  ``actor_rollout_ref.rollout.disable_gc_in_engine_step`` (bool, default ``false``).
* Server mode (``AsyncLLM``, engine core in its own process): vLLM's engine core process builds the same hook
  (``EngineCoreProc.step_hooks``) around each loop step; the policy there comes from the engine's own config,
  ``additional_config = {"qwen3_rl": {"disable_gc": true}}`` (:data:`ENGINE_CONFIG_KEY`; verl's server adds it
  through the verl seam's ``server_args`` when ``qwen3_rl.disable_gc.enable`` is on), read by
  :func:`configure_from_vllm_config` when the hook is built in that process. It covers the engine core's loop
  (scheduling, output handling, and the model step when the executor runs in that process).
* verl's hybrid workers, which run the model for a server's engine core behind verl's ZeroMQ executor
  (``vLLMAsyncRollout``), wrap each ``execute_model`` / ``sample_tokens`` call in :func:`gc_disabled` through the
  verl seam (``RolloutHooks.worker_call``) when their rollout config's ``qwen3_rl.disable_gc.enable`` is on.

* Current pin set (vLLM 0.23, no seam patch): the engine step is bracketed through upstream's own extension
  points, ``scheduler_cls`` (:class:`GcStepBracket` from ``Scheduler.schedule()`` to the end of
  ``update_from_output()``, in the process that runs the scheduler: the in-process engine or the engine core
  process) and ``worker_cls`` (each ``execute_model`` / ``sample_tokens`` / ``execute_dummy_batch`` of a worker
  process); both read ``additional_config = {"qwen3_rl": {"disable_gc": true}}`` in their process
  (:mod:`qwen3_rl.rollout.gc_scheduler`, :mod:`qwen3_rl.rollout.gc_worker`).

The guard restores exactly what it found: whether the collector was enabled and the three
generation thresholds, also when the step raises. It never calls ``gc.collect`` itself.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from qwen3_rl.compat.step_hook import EngineStepHookDefaults

__all__ = [
    "CONFIG_KEY",
    "GcState",
    "GcStepBracket",
    "GcStepHook",
    "ENGINE_CONFIG_KEY",
    "configure_from_rollout_config",
    "configure_from_vllm_config",
    "decode_gc_disabled",
    "engine_step_gc_guard",
    "gc_disabled",
    "set_decode_gc_disabled",
]

#: Key of the switch inside verl's rollout config (``actor_rollout_ref.rollout.<CONFIG_KEY>``).
CONFIG_KEY = "disable_gc_in_engine_step"

#: Key of vLLM's ``additional_config`` holding ``{"disable_gc": bool}`` for an engine core process.
ENGINE_CONFIG_KEY = "qwen3_rl"

_lock = threading.Lock()
_disabled = False


@dataclass(frozen=True)
class GcState:
    """Snapshot of the collector's process-wide state.

    Attributes:
        enabled: ``gc.isenabled()``.
        thresholds: ``gc.get_threshold()``, the allocation counts (objects) that trigger a
            collection of generations 0, 1 and 2.
    """

    enabled: bool
    thresholds: tuple[int, ...]

    @classmethod
    def capture(cls) -> GcState:
        """Read the current state of :mod:`gc`."""
        return cls(enabled=gc.isenabled(), thresholds=tuple(gc.get_threshold()))

    def restore(self) -> None:
        """Put :mod:`gc` back into this state (thresholds first, then enabled / disabled)."""
        gc.set_threshold(*self.thresholds)
        if self.enabled:
            gc.enable()
        else:
            gc.disable()


def set_decode_gc_disabled(disabled: bool) -> None:
    """Switch the policy for this process: ``True`` = collector off during each engine step."""
    global _disabled
    if not isinstance(disabled, bool):
        raise TypeError(f"set_decode_gc_disabled expects a bool, got {type(disabled).__name__}")
    with _lock:
        _disabled = disabled


def decode_gc_disabled() -> bool:
    """Whether the patched engine loop currently disables the collector around each step."""
    return _disabled


def configure_from_rollout_config(rollout_config: Mapping[str, object] | None) -> bool:
    """Apply the switch found in verl's rollout config; returns the resulting policy.

    Args:
        rollout_config: the ``actor_rollout_ref.rollout`` mapping (a dict or an OmegaConf
            DictConfig). A missing key means ``False``; a non-bool value is an error rather than
            a silent truthiness test (``"false"`` would otherwise switch the feature on).
    """
    value = False if rollout_config is None else rollout_config.get(CONFIG_KEY, False)
    if value is None:
        value = False
    if not isinstance(value, bool):
        raise TypeError(f"rollout.{CONFIG_KEY} must be a bool, got {value!r}")
    set_decode_gc_disabled(value)
    return value


def configure_from_vllm_config(vllm_config: object, *, keep_if_absent: bool = False) -> bool:
    """Apply ``additional_config[ENGINE_CONFIG_KEY]["disable_gc"]`` of a vLLM config in this process (the engine
    core process of server mode); returns the resulting policy. Absent = off, or with ``keep_if_absent`` the
    process's policy unchanged (vLLM 0.23's scheduler / worker classes, :mod:`qwen3_rl.rollout.gc_scheduler`: in
    an in-process engine verl may have set it); a non-bool value is an error."""
    extra = getattr(vllm_config, "additional_config", None)
    section = extra.get(ENGINE_CONFIG_KEY) if isinstance(extra, Mapping) else None
    if keep_if_absent and not (isinstance(section, Mapping) and "disable_gc" in section):
        return _disabled
    value = section.get("disable_gc", False) if isinstance(section, Mapping) else False
    if not isinstance(value, bool):
        raise TypeError(f"additional_config.{ENGINE_CONFIG_KEY}.disable_gc must be a bool, got {value!r}")
    set_decode_gc_disabled(value)
    return value


def _capture_and_disable() -> GcState:
    """The collector's state, then the collector off; off before the snapshot object is allocated, so that this
    allocation cannot start a collection at the step's begin."""
    enabled = gc.isenabled()
    gc.disable()
    return GcState(enabled=enabled, thresholds=tuple(gc.get_threshold()))


@contextmanager
def gc_disabled() -> Iterator[bool]:
    """The collector off for the body (yields True); its enabled state and thresholds restored on exit, also when
    the body raises. Unconditional: the caller holds the policy (verl's hybrid worker in server mode, whose
    rollout config says it, :meth:`qwen3_rl.trainer.seam.RolloutHooks.worker_call`)."""
    saved = _capture_and_disable()
    try:
        yield True
    finally:
        saved.restore()


@contextmanager
def engine_step_gc_guard() -> Iterator[bool]:
    """Context manager around one engine step; yields whether the collector was switched off.

    While the policy is off this is a no-op (yields ``False``) and touches nothing. While it is
    on, the collector is disabled for the body and the previous enabled state and thresholds are
    restored on exit, including when the body raises.
    """
    if not _disabled:
        yield False
        return
    with gc_disabled():
        yield True


class GcStepBracket:
    """The collector off from :meth:`open` to :meth:`close`, for a step whose begin and end are two separate calls
    (vLLM 0.23's ``Scheduler.schedule()`` and ``update_from_output()``, :mod:`qwen3_rl.rollout.gc_scheduler`).

    :meth:`open` does nothing while the policy is off, or while the bracket is already open (a second ``schedule()``
    before an ``update_from_output()``, vLLM's batch queue); :meth:`close` restores the state :meth:`open` found
    (enabled flag and thresholds) and does nothing when the bracket is not open. Never calls ``gc.collect``.
    """

    def __init__(self) -> None:
        self._saved: GcState | None = None

    @property
    def is_open(self) -> bool:
        """Whether the collector is held off by this bracket."""
        return self._saved is not None

    def open(self) -> bool:
        """Begin of a step: collector off if the policy is on; returns whether the bracket is open."""
        if self._saved is None and _disabled:
            self._saved = _capture_and_disable()
        return self._saved is not None

    def close(self) -> None:
        """End of a step: the state found by :meth:`open` back (nothing if not open)."""
        saved, self._saved = self._saved, None
        if saved is not None:
            saved.restore()


class GcStepHook(EngineStepHookDefaults):
    """Engine-step hook (``vllm.plugins.extensions.EngineStepHook`` interface, vLLM seam patch) whose
    ``step_context`` is :func:`engine_step_gc_guard`; every other call leaves the step unchanged. The policy is
    read at each step, so verl may switch it after the engine is built."""

    def step_context(self) -> AbstractContextManager[bool]:
        return engine_step_gc_guard()
