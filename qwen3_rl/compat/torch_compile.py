"""The real ``torch.compile`` for the rollout engine in a process where MindSpeed replaced it.

MindSpeed v2.2.0_core_r0.12.1 registers, when ``mindspeed.megatron_adaptor`` is imported, the patch
``torch.compile -> dummy_compile`` (``mindspeed/features_manager/megatron_basic/requirements_basic.py``
``te_adaptation``; ``dummy_compile`` in ``mindspeed/core/megatron_basic/requirements_basic.py`` returns
the function unchanged), applied by ``MindSpeedPatchesManager`` (``mindspeed/patch_utils.py``) to
``torch`` and to every module in ``sys.modules`` holding the same object. That avoids compile failures on
the training side, but verl's hybrid worker (``verl/workers/megatron_workers.py`` imports the adaptor at
module top) builds the vLLM rollout in the same process: vLLM 0.13's
``TorchCompileWithNoGuardsWrapper`` (``vllm/compilation/wrapper.py``) then gets the dummy, so the model
is never compiled (no piecewise graphs / fusion passes for vLLM-Ascend's graph mode).

:func:`real_torch_compile` puts the real ``torch.compile`` back for the rollout's engine creation and
generation and restores whatever was there afterwards (also on exception), so the training side keeps
MindSpeed's choice. The real function is found, in order: ``torch.compile`` itself if it is torch's own;
the one :func:`remember_real_torch_compile` recorded before MindSpeed was imported; MindSpeed's own
record of the original (``MindSpeedPatchesManager.patches_info["torch.compile"].orig_func``).
With nothing replaced the context does nothing (GPU, or MindSpeed absent).

Off switch (default on): ``actor_rollout_ref.rollout.real_torch_compile=false`` makes
:func:`rollout_torch_compile` (what the patched worker calls) a no-op, i.e. upstream's behaviour: the
rollout engine is built and generates with whatever ``torch.compile`` is (MindSpeed's dummy).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from qwen3_rl.compat.switches import read_switch

logger = logging.getLogger(__name__)

#: Key of the switch inside verl's rollout config (``actor_rollout_ref.rollout.<CONFIG_KEY>``).
CONFIG_KEY = "real_torch_compile"

_remembered: Callable[..., Any] | None = None


def is_real_torch_compile(fn: Any) -> bool:
    """Whether ``fn`` is torch's own ``torch.compile`` (defined in ``torch/__init__.py``)."""
    return callable(fn) and getattr(fn, "__module__", None) == "torch" and getattr(fn, "__name__", None) == "compile"


def remember_real_torch_compile() -> Callable[..., Any] | None:
    """Record ``torch.compile`` now if it is the real one (call before MindSpeed's adaptor is imported).

    Returns:
        The recorded function, or None if ``torch.compile`` was already replaced.
    """
    global _remembered
    import torch

    if is_real_torch_compile(torch.compile):
        _remembered = torch.compile
    return _remembered


def _from_mindspeed() -> Callable[..., Any] | None:
    """The original MindSpeed recorded when it patched ``torch.compile`` (None if not loaded / not patched)."""
    mod = sys.modules.get("mindspeed.patch_utils")
    manager = getattr(mod, "MindSpeedPatchesManager", None)
    info = getattr(manager, "patches_info", None)
    if not isinstance(info, dict):
        return None
    patch = info.get("torch.compile")
    orig = getattr(patch, "orig_func", None)
    return orig if is_real_torch_compile(orig) else None


def find_real_torch_compile() -> Callable[..., Any] | None:
    """The real ``torch.compile``: current attribute, remembered one, or MindSpeed's record; else None."""
    import torch

    if is_real_torch_compile(torch.compile):
        return torch.compile
    if _remembered is not None:
        return _remembered
    return _from_mindspeed()


@contextmanager
def real_torch_compile() -> Iterator[Callable[..., Any]]:
    """Context with the real ``torch.compile`` installed as ``torch.compile``.

    Yields:
        The function ``torch.compile`` is during the context (the real one when it can be found; if it
        cannot, a warning is logged and the current one is kept).
    """
    import torch

    current = torch.compile
    if is_real_torch_compile(current):
        yield current
        return
    real = find_real_torch_compile()
    if real is None:
        logger.warning("torch.compile is replaced by %s.%s and the original was not found; the rollout runs "
                       "without torch.compile", getattr(current, "__module__", "?"),
                       getattr(current, "__name__", "?"))
        yield current
        return
    torch.compile = real
    try:
        yield real
    finally:
        torch.compile = current


@contextmanager
def rollout_torch_compile(rollout_config: Mapping[str, object] | None) -> Iterator[Callable[..., Any]]:
    """:func:`real_torch_compile` if ``rollout.real_torch_compile`` is on (missing = on), else nothing.

    Yields:
        The function ``torch.compile`` is during the context. With the switch off it is left as it is
        (upstream verl 0.6.1: MindSpeed's dummy in the Megatron worker).
    """
    if read_switch(rollout_config, CONFIG_KEY, True):
        with real_torch_compile() as fn:
            yield fn
        return
    import torch

    yield torch.compile
