"""Expandable-segments hot swap for the device caching allocator (CUDA and Ascend NPU).

verl switches the allocator's ``expandable_segments`` off before vLLM wakes up (vLLM's sleep-mode
memory pool -- ``CuMemAllocator`` / vLLM-Ascend's ``CaMemAllocator`` -- does not work with
expandable segments) and back on for training, through ``verl.utils.device.set_expandable_segments``.
In verl 0.6.1 that function only acts when CUDA is available, so on NPU the swap silently does
nothing: training runs without virtual-memory segments (more fragmentation) and the only other
way to get them, ``PYTORCH_NPU_ALLOC_CONF=expandable_segments:True``, is refused by
vLLM-Ascend's ``CaMemAllocator``. This module applies the setting on NPU too.

Off switch (default on): ``actor_rollout_ref.rollout.npu_expandable_segments=false`` restores
upstream's CUDA-only swap: the NPU allocator is never touched (CUDA keeps being switched, as
upstream does). verl's ``set_expandable_segments`` is a free function called from the workers and
sharding managers, so the switch is a per-process policy here, set once by the patched
``ActorRolloutRefWorker.__init__`` (Megatron and FSDP) through :func:`configure_from_rollout_config`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from qwen3_rl.compat.switches import read_switch

logger = logging.getLogger(__name__)

#: Key of the switch inside verl's rollout config (``actor_rollout_ref.rollout.<CONFIG_KEY>``).
CONFIG_KEY = "npu_expandable_segments"

_warned: set[str] = set()
_npu_enabled = True


def set_npu_switch(enabled: bool) -> None:
    """This process's policy: True = the swap reaches the NPU allocator (the fix), False = upstream's no-op."""
    global _npu_enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_npu_switch expects a bool, got {type(enabled).__name__}")
    _npu_enabled = enabled


def configure_from_rollout_config(rollout_config: Mapping[str, object] | None) -> bool:
    """Set the policy from ``rollout.npu_expandable_segments`` (missing = True); returns it."""
    enabled = read_switch(rollout_config, CONFIG_KEY, True)
    set_npu_switch(enabled)
    return enabled


def allocator_setting(enable: bool) -> str:
    """The allocator-settings string, e.g. ``"expandable_segments:True"``."""
    return f"expandable_segments:{bool(enable)}"


def _set_fn(torch_module: Any, device: str) -> Any:
    """``torch.<device>.memory._set_allocator_settings`` or None if this torch(-npu) lacks it."""
    ns = getattr(torch_module, device, None)
    mem = getattr(ns, "memory", None) if ns is not None else None
    return getattr(mem, "_set_allocator_settings", None) if mem is not None else None


def set_expandable_segments(enable: bool, device: str, torch_module: ModuleType | Any | None = None) -> bool:
    """Switch expandable segments of the ``device`` caching allocator on or off.

    Args:
        enable: True to enable (training), False to disable (before vLLM allocates/wakes up).
        device: ``"cuda"``, ``"npu"`` or anything else (e.g. ``"cpu"``: nothing to do).
        torch_module: the ``torch`` module (default: import it); tests pass a stand-in.

    Returns:
        True if the setting was applied, False if there is no such allocator here (CPU, or a
        torch-npu without ``_set_allocator_settings``: warned once), or if the device is the NPU and
        the switch is off (upstream verl 0.6.1 leaves the NPU allocator alone).
    """
    if device not in ("cuda", "npu"):
        return False
    if device == "npu" and not _npu_enabled:
        return False
    if torch_module is None:
        import torch as torch_module
    fn = _set_fn(torch_module, device)
    if fn is None:
        if device not in _warned:
            _warned.add(device)
            logger.warning("torch.%s.memory._set_allocator_settings is missing: expandable segments "
                           "cannot be switched at run time on this %s build", device, device)
        return False
    fn(allocator_setting(enable))
    return True
