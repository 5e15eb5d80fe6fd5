"""``gc_control``'s two-call step bracket (``GcStepBracket``, used by the current set's vLLM 0.23 scheduler class)
and ``configure_from_vllm_config(keep_if_absent=True)``; the real-engine checks are in
``tests/engine_current/test_current_gc_control.py``."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from qwen3_rl.rollout import gc_control
from qwen3_rl.rollout.gc_control import GcStepBracket, configure_from_vllm_config, set_decode_gc_disabled


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    set_decode_gc_disabled(False)
    gc.set_threshold(*thresholds)
    gc.enable()


def test_bracket_holds_the_collector_off_from_open_to_close_and_restores_thresholds() -> None:
    set_decode_gc_disabled(True)
    gc.set_threshold(123, 7, 5)
    b = GcStepBracket()
    assert b.open() is True and not gc.isenabled() and b.is_open
    assert b.open() is True and not gc.isenabled()  # a second open (batch queue) keeps the first snapshot
    gc.set_threshold(1, 1, 1)  # changed inside the step: restored at close
    b.close()
    assert gc.isenabled() and gc.get_threshold() == (123, 7, 5) and not b.is_open
    b.close()  # not open: nothing
    assert gc.isenabled()


def test_bracket_restores_a_disabled_collector_and_is_inert_without_the_policy() -> None:
    set_decode_gc_disabled(True)
    gc.disable()
    b = GcStepBracket()
    assert b.open() is True
    b.close()
    assert not gc.isenabled()  # it was off before the step: still off
    gc.enable()
    set_decode_gc_disabled(False)  # positive control: policy off, the bracket touches nothing
    assert b.open() is False and gc.isenabled() and not b.is_open
    b.close()
    assert gc.isenabled()


def test_no_collection_between_open_and_close() -> None:
    # gen-0 threshold 10 and 200 unreachable cycles inside the bracket: no collection starts inside it, one starts
    # right after it; without the policy collections start inside (positive control)
    starts: list[str] = []
    where = ["outside"]

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(where[0])

    gc.callbacks.append(cb)
    try:
        for policy in (True, False):
            set_decode_gc_disabled(policy)
            gc.set_threshold(10, 10, 10)
            starts.clear()
            b = GcStepBracket()
            b.open()
            where[0] = "inside"
            for _ in range(200):
                a: list = []
                a.append(a)
            where[0] = "outside"
            b.close()
            _ = [[] for _ in range(20)]
            if policy:
                assert "inside" not in starts and "outside" in starts, starts
            else:
                assert "inside" in starts, starts
    finally:
        gc.callbacks.remove(cb)


def test_configure_keep_if_absent() -> None:
    set_decode_gc_disabled(True)
    for extra in (None, {}, {"qwen3_rl": {}}, {"qwen3_rl": {"sam_config": {}}}):
        assert (
            configure_from_vllm_config(SimpleNamespace(additional_config=extra), keep_if_absent=True) is True
        )
        assert gc_control.decode_gc_disabled() is True
    # explicit value applies; without keep_if_absent an absent key is off (the seed set's engine core rule)
    assert (
        configure_from_vllm_config(
            SimpleNamespace(additional_config={"qwen3_rl": {"disable_gc": False}}), keep_if_absent=True
        )
        is False
    )
    set_decode_gc_disabled(True)
    assert configure_from_vllm_config(SimpleNamespace(additional_config=None)) is False
    with pytest.raises(TypeError, match="must be a bool"):
        configure_from_vllm_config(
            SimpleNamespace(additional_config={"qwen3_rl": {"disable_gc": "true"}}), keep_if_absent=True
        )
