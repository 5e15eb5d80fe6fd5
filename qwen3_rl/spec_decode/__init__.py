"""Model-free speculative-decoding drafter: a suffix automaton per request or per prompt group (SAM).

The drafter's names (``SamConfig``, ``SamProposer``, ``group_key``) load :mod:`qwen3_rl.spec_decode.sam`,
and with it numpy and the numba kernels, on first access only: tooling that reads a config through a pure
submodule (preflight's :mod:`qwen3_rl.spec_decode.requests`) imports the package without the runtime stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qwen3_rl.spec_decode.sam import SamConfig, SamProposer, group_key

__all__ = ["SamConfig", "SamProposer", "group_key"]


def __getattr__(name: str) -> Any:
    """PEP 562: the drafter's names from :mod:`qwen3_rl.spec_decode.sam`, imported on first use."""
    if name in __all__:
        return getattr(importlib.import_module("qwen3_rl.spec_decode.sam"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
