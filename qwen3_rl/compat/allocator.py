"""Expandable-segments hot swap for the device caching allocator (CUDA and Ascend NPU).

verl switches the allocator's ``expandable_segments`` off before vLLM wakes up (vLLM's sleep-mode
memory pool -- ``CuMemAllocator`` / vLLM-Ascend's ``CaMemAllocator`` -- does not work with
expandable segments) and back on for training, through ``verl.utils.device.set_expandable_segments``.
In verl 0.6.1 that function only acts when CUDA is available, so on NPU the swap silently does
nothing: training runs without virtual-memory segments (more fragmentation) and the only other
way to get them, ``PYTORCH_NPU_ALLOC_CONF=expandable_segments:True``, is refused by
vLLM-Ascend's ``CaMemAllocator``. This module applies the setting on NPU too.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

_warned: set[str] = set()


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
        torch-npu without ``_set_allocator_settings``: warned once).
    """
    if device not in ("cuda", "npu"):
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
