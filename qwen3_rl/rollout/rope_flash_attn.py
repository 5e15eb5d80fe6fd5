"""Guarded lookup of flash-attn's Triton rotary kernel (patch ``vllm/0002-...-rope_registry``).

vLLM 0.13.0 builds an ``ApplyRotaryEmb`` custom op inside every rotary embedding
(``vllm/model_executor/layers/rotary_embedding/base.py:52``; vLLM-Ascend registers its
``AscendApplyRotaryEmb`` subclass for the same op). Its ``__init__``
(``vllm/model_executor/layers/rotary_embedding/common.py:133-137``) imports
``flash_attn.ops.triton.rotary`` whenever a package named ``flash_attn`` is discoverable, on every
platform, with no ``try``. Only the ROCm path (``forward_hip``) ever uses that kernel. On an Ascend
image where some dependency dragged in a CUDA build of flash-attn, the import fails (no CUDA
runtime, no Triton GPU backend) and every model with RoPE fails to build.

The patch replaces that block by :func:`load_flash_attn_rotary`, which asks only when the platform
will use the kernel and turns an unusable installation into "not available" (the op then falls
back to its native PyTorch path, exactly as when flash-attn is absent). Bug fix, always on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

__all__ = ["load_flash_attn_rotary"]

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def load_flash_attn_rotary(platform_uses_it: bool) -> Callable[..., Any] | None:
    """flash-attn's ``apply_rotary`` when the platform uses it and it imports; else ``None``.

    Args:
        platform_uses_it: ``current_platform.is_rocm()`` at the call site: the only platform whose
            ``ApplyRotaryEmb.forward_hip`` calls the kernel.

    Returns:
        ``flash_attn.ops.triton.rotary.apply_rotary`` (x: [batch, seq, heads, head_dim],
        cos/sin: [seq, rotary_dim // 2]) or ``None``, in which case the caller uses its native
        implementation.
    """
    if not platform_uses_it:
        return None
    if find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn.ops.triton.rotary import apply_rotary
    except (ImportError, OSError, RuntimeError) as exc:  # a broken or foreign-device build
        msg = f"{type(exc).__name__}: {exc}"
        if msg not in _warned:
            _warned.add(msg)
            logger.warning("flash_attn is installed but its rotary kernel does not import (%s); "
                           "using the native rotary embedding", msg)
        return None
    return apply_rotary
