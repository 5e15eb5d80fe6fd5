"""Run a callback right after a named module is first imported (a ``sys.meta_path`` finder that wraps the
module's real loader). Used to install test shims and probes lazily in Ray workers: a process that never
imports vLLM does not pay for importing it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader, callbacks: list[Callback]) -> None:
        self.real, self.callbacks = real, callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.real.exec_module(module)
        for cb in self.callbacks:
            cb(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.hooks: dict[str, list[Callback]] = {}

    def find_spec(self, name, path, target=None):  # noqa: ANN001 (importlib protocol)
        if name not in self.hooks:
            return None
        callbacks = self.hooks.pop(name)
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, callbacks)
                return spec
        return None


_FINDER = _Finder()


def after_import(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` has been imported (at once if it already is)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.hooks.setdefault(name, []).append(callback)
