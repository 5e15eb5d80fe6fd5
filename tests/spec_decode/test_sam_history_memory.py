"""The SAM history store's memory: its default bound comes from the host's memory and the drafters on the host
(``history_max_bytes = 0``, ``history.resolve_max_bytes``), and it lives in host memory only.

Host only, checked two ways, each with a positive control that fails the same check:

* every buffer the store and its drafter hold after a workload (two visits of a group, history seeding, reward
  marks) is a numpy array (host memory): the walk would report a ``torch.Tensor`` on a device (control: a tensor on
  the ``meta`` device planted in the store);
* no torch tensor is created on any device while the workload runs (``TorchDispatchMode`` sees every ATen op,
  factory functions included, whatever the device; control: ``torch.empty(..., device="meta")`` under the same
  mode), and the store's bytes show up as host allocations (``tracemalloc``, which traces numpy's buffers).
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

from qwen3_rl.spec_decode.history import HOST_SHARE, HistoryStore, resolve_max_bytes
from qwen3_rl.spec_decode.sam import SamConfig, SamProposer, group_key

PROMPT = np.arange(2000, 2016, dtype=np.int32)


def test_default_bound_is_a_share_of_host_memory_over_the_drafters() -> None:
    gib = 1 << 30
    assert resolve_max_bytes(0, host_bytes=1024 * gib, drafters=16)[0] == int(1024 * gib * HOST_SHARE) // 16
    bound, line = resolve_max_bytes(0, host_bytes=64 * gib, drafters=4)
    assert bound == 4 * gib and "4.00 GiB" in line and "64.0 GiB" in line and "4 drafter" in line
    assert resolve_max_bytes(1 << 20)[0] == 1 << 20  # a configured bound wins
    own, line = resolve_max_bytes(0)  # this host
    print(line)
    import os

    assert own == int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * HOST_SHARE)  # one drafter
    # the drafter's default config takes it, shared by the drafters the launcher names (sam_config.history_drafters)
    assert SamConfig().history_max_bytes == 0 and SamConfig().history_drafters == 1
    p = SamProposer(SamConfig(group_mode=True, history_responses=4))
    assert p.history is not None and p.history.max_bytes == own
    p = SamProposer(SamConfig(group_mode=True, history_responses=4, history_drafters=16))
    assert p.history is not None and p.history.max_bytes == resolve_max_bytes(0, drafters=16)[0] < own
    with pytest.raises(ValueError, match="history_drafters"):
        SamConfig(history_drafters=0)
    with pytest.raises(ValueError, match="history_max_bytes >= 0"):
        SamConfig(group_mode=True, history_responses=4, history_max_bytes=-1)


def _workload() -> SamProposer:
    """Two visits of a prompt's group with history, reward marks, a second prompt: returns the drafter."""
    rng = np.random.default_rng(0)
    p = SamProposer(SamConfig(num_speculative_tokens=3, group_mode=True, cache_max_responses=0,
                              history_responses=4, history_max_bytes=1 << 22))
    for visit in range(2):
        for prompt in (PROMPT, PROMPT + 100):
            ids = [f"{visit}-{prompt[0]}-{j}" for j in range(4)]
            for r in ids:
                p.add_request(r, prompt)
            for r in ids:
                p.extend(r, rng.integers(0, 500, 300).astype(np.int32))
                p.propose([r], 3)
            for r in ids:
                p.finish(r)
    h = p.history
    assert h is not None
    h.score(group_key(PROMPT), h.get(group_key(PROMPT))[:1], [1.0])
    assert h.num_responses() == 8 and p.history_strings > 0
    return p


def _device_buffers(obj: Any, seen: set[int] | None = None, path: str = "store") -> list[str]:
    """Paths of every torch.Tensor reachable from ``obj`` (attributes, containers) that is not on the CPU, and of
    every torch.Tensor at all (the store should hold numpy only): returns ``["<path>: <device>"]``."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (int, float, str, bytes, bool, type(None), np.ndarray, np.generic)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [f"{path}: torch.Tensor on {obj.device}"]
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _device_buffers(v, seen, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            out += _device_buffers(v, seen, f"{path}[{i}]")
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) + list(getattr(obj, "__slots__", ()))
        for name in names:
            if hasattr(obj, name):
                out += _device_buffers(getattr(obj, name), seen, f"{path}.{name}")
    return out


def test_store_and_drafter_hold_numpy_buffers_only() -> None:
    import torch

    p = _workload()
    assert _device_buffers(p.history) == [] and _device_buffers(p, path="drafter") == []
    arrays = [e.tokens for lst in p.history._d.values() for e in lst]
    assert arrays and all(isinstance(a, np.ndarray) for a in arrays)
    # positive control: a tensor on a device planted among the entries is reported with its path
    next(iter(p.history._d.values()))[0].tokens = torch.empty(4, device="meta")
    (found,) = _device_buffers(p.history)
    assert "tokens: torch.Tensor on meta" in found


class _Allocations:
    """Every tensor an ATen op returns while active (``TorchDispatchMode``): ``(op, device)``."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                import torch

                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (list, tuple)) else [out]:
                    if isinstance(t, torch.Tensor):
                        seen.append((str(func), str(t.device)))
                return out

        self.mode = Mode()

    def __enter__(self) -> list[tuple[str, str]]:
        self.mode.__enter__()
        return self.seen

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


def test_the_workload_creates_no_tensor_on_any_device_and_its_bytes_are_host_allocations() -> None:
    import torch

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with _Allocations() as seen:
            p = _workload()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert seen == []
    tokens = p.history.num_tokens() * 4
    print(f"history store: {p.history.nbytes()} bytes counted ({tokens} of token ids); host allocations traced "
          f"during the workload: {grown} bytes; tensors created: {len(seen)}")
    assert grown >= tokens
    # positive control: the same mode sees a device allocation (the meta device: no memory, same dispatch path)
    with _Allocations() as seen:
        torch.empty(1 << 20, device="meta")
    assert seen and seen[0][1] == "meta"
    with _Allocations() as seen:
        HistoryStore(1, 8, 64).add("g", np.arange(4, dtype=np.int32))
    assert seen == []
