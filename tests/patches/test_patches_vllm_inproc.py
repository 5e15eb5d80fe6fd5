"""vllm 0002: the in-process engine client hands draft tokens to the scheduler.

Runs the patched ``InprocClient.get_output`` with vLLM's real ``EngineCore.post_step`` bound to a
stand-in engine core (its scheduler and executor record the calls). In the pristine pin the same
call never reaches ``update_draft_token_ids``: speculative decoding got 0 drafts in sync mode."""

from __future__ import annotations

import types
from pathlib import Path

import pytest


class _Scheduler:
    def __init__(self) -> None:
        self.updates: list[object] = []

    def update_draft_token_ids(self, draft) -> None:
        self.updates.append(draft)


def _stand_in_core(model_executed: bool, spec: bool = True, async_sched: bool = False):
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.outputs import DraftTokenIds

    core = types.SimpleNamespace(
        async_scheduling=async_sched, use_spec_decode=spec, scheduler=_Scheduler(),
        model_executor=types.SimpleNamespace(
            take_draft_token_ids=lambda: DraftTokenIds(req_ids=["a", "b"], draft_token_ids=[[5, 6, 7], []])),
    )
    outs = EngineCoreOutputs(outputs=[])
    core.step_fn = lambda: ({0: outs}, model_executed)
    core.post_step = types.MethodType(EngineCore.post_step, core)
    return core, outs


@pytest.mark.parametrize("model_executed, spec, async_sched, expect", [
    (True, True, False, 1),    # sync scheduling + drafter: drafts reach the scheduler
    (False, True, False, 0),   # nothing ran: nothing to take
    (True, False, False, 0),   # no speculative decoding: post_step is a no-op
    (True, True, True, 0),     # async scheduling keeps drafts in the worker
])
def test_inproc_get_output_runs_post_step(patched_imports: Path, model_executed, spec, async_sched, expect) -> None:
    from vllm.v1.engine.core_client import InprocClient

    core, outs = _stand_in_core(model_executed, spec, async_sched)
    client = object.__new__(InprocClient)
    client.engine_core = core
    assert client.get_output() is outs
    assert len(core.scheduler.updates) == expect
    if expect:
        assert core.scheduler.updates[0].draft_token_ids == [[5, 6, 7], []]


def test_pristine_pin_drops_drafts(pristine_workspace: Path) -> None:
    src = (pristine_workspace / "vllm" / "vllm" / "v1" / "engine" / "core_client.py").read_text()
    body = src.split("class InprocClient", 1)[1].split("def get_output", 1)[1].split("def ", 1)[0]
    assert "step_fn()" in body and "post_step" not in body
    parallel = (pristine_workspace / "vllm" / "vllm" / "config" / "parallel.py").read_text()
    assert 'os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"' in parallel  # forced for external_launcher
