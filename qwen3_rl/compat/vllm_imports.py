"""vLLM names that moved between releases, resolved against the installed vLLM.

vLLM 0.12/0.13 split ``vllm/utils/__init__.py`` into submodules and renamed ``vllm/lora/models.py``
to ``vllm/lora/lora_model.py``; verl 0.6.1 still imports the old locations and fails with
``ImportError`` / ``ModuleNotFoundError`` on vLLM 0.13.0.

Usage (what the verl patch writes)::

    from qwen3_rl.compat.vllm_imports import FlexibleArgumentParser, get_tcp_uri

Each name is looked up in its candidate modules in order (newest vLLM layout first) on first
access (PEP 562 module ``__getattr__``), so importing this module never imports vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> candidate modules, newest vLLM layout first.
CANDIDATES: dict[str, tuple[str, ...]] = {
    # vllm 0.13.0: vllm/utils/argparse_utils.py; <= 0.10: vllm/utils/__init__.py
    "FlexibleArgumentParser": ("vllm.utils.argparse_utils", "vllm.utils"),
    # vllm 0.13.0: vllm/utils/network_utils.py; <= 0.10: vllm/utils/__init__.py
    "get_tcp_uri": ("vllm.utils.network_utils", "vllm.utils"),
    # vllm 0.13.0: vllm/lora/lora_model.py; <= 0.11: vllm/lora/models.py
    "LoRAModel": ("vllm.lora.lora_model", "vllm.lora.models"),
}

__all__ = sorted(CANDIDATES)


def resolve(name: str, candidates: tuple[str, ...] | None = None) -> Any:
    """Return the object ``name`` from the first candidate module that defines it.

    Args:
        name: attribute name, e.g. ``"FlexibleArgumentParser"``.
        candidates: module paths to try in order; default ``CANDIDATES[name]``.

    Raises:
        ImportError: no candidate module exists or none defines ``name`` (message lists all tried).
    """
    mods = CANDIDATES[name] if candidates is None else candidates
    tried: list[str] = []
    for mod_name in mods:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            # Only swallow "this candidate module does not exist", never a broken dependency inside it.
            if e.name is None or not (mod_name == e.name or mod_name.startswith(e.name + ".")):
                raise
            tried.append(f"{mod_name} (no such module)")
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
        tried.append(f"{mod_name} (no attribute {name})")
    raise ImportError(f"cannot import {name!r} from vllm: tried {', '.join(tried)}")


def __getattr__(name: str) -> Any:
    if name in CANDIDATES:
        value = resolve(name)
        globals()[name] = value  # cache: later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
