"""Does verl 0.9.1's NPU engine get MindSpeed on this node? (preflight, current pin set)

verl 0.9.1 imports MindSpeed's adaptor inside ``try: from mindspeed.megatron_adaptor import repatch`` / ``except
ImportError: repatch = None`` (``verl/workers/engine/mindspeed/transformer_impl.py:18-21``, no message), and
``verl/workers/engine/__init__.py:54-61`` imports that module in its own ``try / except ImportError``. Importing the
adaptor runs MindSpeed's whole patch pass (``mindspeed/megatron_adaptor.py:23-42, 66``), which looks up names on
every loaded module (``mindspeed/patch_utils.py:126-128``): a missing dependency of any of them (e.g. torchvision,
which transformers 5's alias modules import on lookup) raises there, and verl then trains on its NPU engine with no
MindSpeed patch and no MindSpeed switch in force, silently.

:func:`probe` does what verl's worker does, ``import verl.workers.engine``, with the import of
``mindspeed.megatron_adaptor`` watched; ``python -m qwen3_rl.tools.launch.mindspeed_check`` runs it in a fresh
process (the patch pass changes the process) and prints one JSON line: ``{"ok", "error", "missing"}`` (``error``:
``"<Type>: <message>"`` of what the adaptor's import raised, or why verl has no ``repatch``; ``missing``: the module
a ``ModuleNotFoundError`` names).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import types
from typing import Any

ADAPTOR = "mindspeed.megatron_adaptor"


class _WatchAdaptor(importlib.abc.MetaPathFinder):
    """Finds ``mindspeed.megatron_adaptor`` as the path finder does and keeps what running it raises (re-raised)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != ADAPTOR:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, watch = spec.loader, self

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: types.ModuleType) -> None:
                try:
                    loader.exec_module(module)
                except BaseException as exc:
                    watch.error = exc
                    raise

        spec.loader = Loader()
        return spec


def _describe(exc: BaseException) -> dict[str, Any]:
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "missing": missing}


def probe() -> dict[str, Any]:
    """``import verl.workers.engine`` in this process with the adaptor's import watched: {"ok", "error", "missing"}
    (ok: verl's ``repatch`` is MindSpeed's)."""
    watch = _WatchAdaptor()
    sys.meta_path.insert(0, watch)
    try:
        import verl.workers.engine  # noqa: F401  (as verl's worker imports it)
        from verl.workers.engine.mindspeed import transformer_impl
    except ImportError as exc:  # verl's engine package itself, or its MindSpeed engine module
        return _describe(watch.error or exc)
    finally:
        sys.meta_path.remove(watch)
    if watch.error is not None:
        return _describe(watch.error)
    if transformer_impl.repatch is None:  # the adaptor was never found
        try:
            import mindspeed.megatron_adaptor  # noqa: F401
        except ImportError as exc:
            return _describe(exc)
        return {"ok": False, "error": "verl's repatch is None", "missing": None}
    return {"ok": True, "error": None, "missing": None}


def main() -> int:
    print(json.dumps(probe()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
