"""The vLLM seam patch (``vllm/plugins/extensions.py`` and its call points) and the recipe's plugin.

* The plugin is found through vLLM's own ``vllm.general_plugins`` entry point (the one pyproject.toml declares)
  and fills the registries; the engine-step hooks come out in their documented order.
* The patched ``LLMEngine`` calls hooks at its four points, in order (hooks registered here, engine core and
  output processing stood in): ``has_unfinished``, ``step_context`` around the step, ``filter_outputs``,
  ``after_step`` on real and dummy steps.
* The patched engine core process loops (``EngineCoreProc`` / ``DPEngineCoreProc.run_busy_loop``, scheduler and
  model stood in) call them at theirs: ``has_unfinished`` (input wait, DP flag), ``step_context`` around the step
  and the DP dummy batch, ``filter_outputs`` per client before queueing, ``after_engine_core_step`` outputs
  queued. The real ``AsyncLLM`` runs are ``tests/engine/test_engine_core_loop.py``.
* No load-time dependency: in a process where ``qwen3_rl`` cannot be imported, the patched vLLM modules and the
  patched vLLM-Ascend files import / parse without it, the registries stay empty and ``SpeculativeConfig``
  behaves as pristine (``"sam"`` is an unknown method, ``ngram`` unchanged). The greedy-output comparison with
  the pristine tree is the engine test ``tests/engine/test_engine_seam.py``.
"""

from __future__ import annotations

import ast
import contextlib
import json
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import run_python

REPO = Path(__file__).resolve().parents[2]
#: files the vLLM / vLLM-Ascend patches touch (checked for imports of our package)
PATCHED_FILES = {
    "vllm": ["vllm/plugins/extensions.py", "vllm/config/speculative.py", "vllm/v1/engine/llm_engine.py",
             "vllm/v1/engine/core.py",
             "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/engine/core_client.py",
             "vllm/model_executor/layers/rotary_embedding/common.py", "vllm/v1/spec_decode/utils.py",
             "vllm/v1/sample/rejection_sampler.py"],
    "vllm-ascend": ["vllm_ascend/utils.py", "vllm_ascend/worker/model_runner_v1.py",
                    "vllm_ascend/eplb/core/policy/policy_factory.py", "vllm_ascend/ops/fused_moe/fused_moe.py"],
}


def test_pyproject_declares_the_entry_point() -> None:
    from qwen3_rl.vllm_plugin import ENTRY_POINT

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {ENTRY_POINT[0]: ENTRY_POINT[1]}


def test_plugin_is_loaded_through_the_entry_point(patched_imports: Path) -> None:
    from importlib.metadata import entry_points

    from vllm.plugins import extensions

    from qwen3_rl.rollout.gc_control import GcStepHook
    from qwen3_rl.rollout.vllm_engine_hook import VllmRebalanceHook
    from qwen3_rl.spec_decode.exchange_hook import SiblingExchangeHook

    assert any(ep.name == "qwen3_rl" and ep.value == "qwen3_rl.vllm_plugin:register"
               for ep in entry_points(group="vllm.general_plugins"))
    spec = extensions.get_drafter("sam")  # loads the general plugins first
    assert spec is not None and spec.options_key == "sam_config"
    assert extensions.get_drafter("ngram") is None  # vLLM's own methods are not in the registry
    engine = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(
        method="sam", drafter_config={"group_mode": True, "group_exchange": True})))
    hooks = extensions.build_engine_step_hooks(engine)
    assert [type(h) for h in hooks] == [GcStepHook, SiblingExchangeHook, VllmRebalanceHook]
    assert extensions.build_from_factory("spec_decode_gate", SimpleNamespace(speculative_config=None)) is None
    assert extensions.build_from_factory("no_such_point") is None


class _Recorder:
    """An engine-step hook that records every call (``log`` shared by the hooks of one test)."""

    def __init__(self, name: str, log: list, unfinished: bool = False) -> None:
        self.name, self.log, self.unfinished = name, log, unfinished

    @contextlib.contextmanager
    def step_context(self):
        self.log.append((self.name, "enter"))
        try:
            yield
        finally:
            self.log.append((self.name, "exit"))

    def has_unfinished(self) -> bool:
        self.log.append((self.name, "has_unfinished"))
        return self.unfinished

    def idle_in_lockstep(self) -> bool:
        return False

    def filter_outputs(self, outputs):
        self.log.append((self.name, "filter"))
        return outputs

    def after_step(self, request_outputs: list) -> list:
        self.log.append((self.name, "after"))
        return [*request_outputs, self.name]

    def after_engine_core_step(self) -> dict:
        self.log.append((self.name, "after_core"))
        return {7: self.name}


def test_engine_calls_hooks_at_four_points_in_order(patched_imports: Path) -> None:
    from vllm.plugins import extensions
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor

    log: list = []
    names = ("test_late", "test_early")
    extensions.register_engine_step_hook("test_late", lambda eng: _Recorder("late", log), order=50)
    extensions.register_engine_step_hook("test_early", lambda eng: _Recorder("early", log, unfinished=True), order=5)
    extensions.register_engine_step_hook("test_off", lambda eng: None, order=1)  # feature off: no hook
    try:
        eng = object.__new__(LLMEngine)
        eng.vllm_config = SimpleNamespace(speculative_config=None)
        hooks = extensions.build_engine_step_hooks(eng)
    finally:
        for name in (*names, "test_off"):
            extensions._STEP_HOOK_FACTORIES.pop(name)
    # ascending order: test_early (5), gc_guard (10), rollout_rebalance (30), test_late (50)
    assert [getattr(h, "name", type(h).__name__) for h in hooks] == ["early", "GcStepHook", "VllmRebalanceHook",
                                                                      "late"]
    eng.step_hooks = [hooks[0], hooks[3]]
    eng.log_stats, eng.logger_manager, eng.dp_group = False, None, None
    eng.output_processor = OutputProcessor(None, log_stats=False)
    eng.engine_core = SimpleNamespace(execute_dummy_batch=lambda: log.append(("core", "dummy")),
                                      get_output=lambda: log.append(("core", "real")) or EngineCoreOutputs(),
                                      abort_requests=lambda ids: None, dp_engines_running=lambda: False)
    # 1. has_unfinished_requests: a hook's work keeps the loop going (no request in the engine)
    assert eng.has_unfinished_requests() is True
    assert log == [("early", "has_unfinished")]
    log.clear()
    # 2-4. a real step: contexts around everything, filter before processing, after_step chained in order
    eng.should_execute_dummy_batch = False
    assert eng.step() == ["early", "late"]
    assert log == [("early", "enter"), ("late", "enter"), ("core", "real"), ("early", "filter"),
                   ("late", "filter"), ("early", "after"), ("late", "after"), ("late", "exit"),
                   ("early", "exit")]
    log.clear()
    # a dummy step: no outputs to filter, after_step still runs
    eng.should_execute_dummy_batch = True
    assert eng.step() == ["early", "late"]
    assert log == [("early", "enter"), ("late", "enter"), ("core", "dummy"), ("early", "after"), ("late", "after"),
                   ("late", "exit"), ("early", "exit")]
    # no hooks: the pristine step
    log.clear()
    eng.step_hooks = []
    assert eng.step() == [] and log == [("core", "real")]


class _LoopDone(Exception):
    pass


def _core_standin(cls: type, log: list, hooks: list, step_result: tuple, loops: int) -> object:
    """An ``EngineCoreProc`` / ``DPEngineCoreProc`` without ``__init__``: scheduler, model and queues stood in; the
    busy loop stops after ``loops`` passes."""
    import queue

    eng = object.__new__(cls)
    eng.step_hooks = hooks
    eng.output_queue, eng.input_queue = queue.Queue(), queue.Queue()
    eng.engines_running, eng.batch_queue = False, None
    eng.scheduler = SimpleNamespace(has_requests=lambda: False, has_unfinished_requests=lambda: False)
    eng.step_fn = lambda: log.append(("core", "step")) or step_result
    eng.post_step = lambda executed: None
    eng.execute_dummy_batch = lambda: log.append(("core", "dummy"))
    calls = []

    def input_queue_pass() -> None:
        calls.append(1)
        if len(calls) > loops:
            raise _LoopDone

    eng._process_input_queue = input_queue_pass
    return eng


def test_engine_core_loops_call_hooks_in_order(patched_imports: Path) -> None:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

    log: list = []
    early, late = _Recorder("early", log, unfinished=True), _Recorder("late", log)
    # has_unfinished: a hook's work ends the wait for input (no request, no wave) instead of blocking
    eng = _core_standin(EngineCoreProc, log, [early, late], ({}, False), loops=1)
    EngineCoreProc._process_input_queue(eng)
    assert log == [("early", "has_unfinished")]
    log.clear()
    # one pass of EngineCoreProc's loop: contexts around the step, each client's outputs filtered by each hook in
    # order before they are queued, then the hooks' own outputs queued
    out = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="a", new_token_ids=[1])])
    eng = _core_standin(EngineCoreProc, log, [early, late], ({0: out}, True), loops=1)
    with pytest.raises(_LoopDone):
        eng.run_busy_loop()
    assert log == [("early", "enter"), ("late", "enter"), ("core", "step"), ("early", "filter"), ("late", "filter"),
                   ("early", "after_core"), ("late", "after_core"), ("late", "exit"), ("early", "exit")]
    assert [eng.output_queue.get_nowait() for _ in range(3)] == [(0, out), (7, "early"), (7, "late")]
    log.clear()
    # DPEngineCoreProc: nothing scheduled, no wave, but a hook holds work: it joins the DP flag as unfinished and
    # the rank runs a dummy batch inside the hooks' contexts; after_engine_core_step follows the dummy batch
    eng = _core_standin(DPEngineCoreProc, log, [early, late], ({}, False), loops=1)
    eng._maybe_publish_request_counts = lambda: None
    flags: list = []
    eng._has_global_unfinished_reqs = lambda local: flags.append(local) or True
    with pytest.raises(_LoopDone):
        eng.run_busy_loop()
    assert log == [("early", "enter"), ("late", "enter"), ("core", "step"), ("early", "has_unfinished"),
                   ("core", "dummy"), ("early", "after_core"), ("late", "after_core"), ("late", "exit"),
                   ("early", "exit")]
    assert flags == [True]
    log.clear()
    # without hooks: the pristine DP loop (idle rank, no wave: no dummy batch, no all-reduce)
    eng = _core_standin(DPEngineCoreProc, log, [], ({}, False), loops=1)
    eng._maybe_publish_request_counts = lambda: None
    eng._has_global_unfinished_reqs = lambda local: flags.append(local) or True
    with pytest.raises(_LoopDone):
        eng.run_busy_loop()
    assert log == [("core", "step")] and flags == [True] and eng.output_queue.empty()


def test_speculative_config_with_a_registered_drafter(patched_imports: Path) -> None:
    from vllm.config import SpeculativeConfig
    from vllm.plugins import extensions

    checked: list = []
    extensions.register_drafter(extensions.DrafterSpec(
        method="test_drafter", build=lambda vllm_config, runner: ("built", runner), options_key="test_options",
        check_input=lambda cls, kwargs: checked.append(dict(kwargs)), validate=lambda spec: checked.append(spec)))
    try:
        spec = SpeculativeConfig(method="test_drafter", num_speculative_tokens=2, test_options={"x": 1})
        assert spec.method == "test_drafter" and spec.model == "test_drafter" and spec.drafter_config == {"x": 1}
        assert checked[0]["drafter_config"] == {"x": 1} and "test_options" not in checked[0]
        assert checked[1] is spec and "model=None" in repr(spec)
        with pytest.raises(Exception, match="only used with method='test_drafter'"):
            SpeculativeConfig(method="ngram", num_speculative_tokens=2, test_options={"x": 1})
    finally:
        extensions._DRAFTERS.pop("test_drafter")
    with pytest.raises(Exception, match="Unknown speculative decoding method 'test_drafter'"):
        SpeculativeConfig(method="test_drafter", num_speculative_tokens=2)


_NO_PACKAGE_PROBE = r"""
import ast, importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "qwen3_rl" or name.startswith("qwen3_rl."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
sys.meta_path.insert(0, Block())
import vllm.v1.engine.llm_engine as le
import vllm.v1.worker.gpu_model_runner as gmr
from vllm.config import SpeculativeConfig
from vllm.plugins import extensions
out = {"llm_engine": le.__file__, "gpu_model_runner": gmr.__file__,
       "hooks": len(extensions.build_engine_step_hooks(object())), "drafters": sorted(extensions.registered_drafters())}
ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
out["ngram"] = [ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max]
try:
    SpeculativeConfig(method="sam", num_speculative_tokens=3)
    out["sam"] = "accepted"
except Exception as exc:
    out["sam"] = str(exc)[:600]
out["qwen3_rl_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "qwen3_rl")
print("RESULT", json.dumps(out))
"""


def test_patched_vllm_imports_without_the_package(patched_imports: Path, tmp_path: Path) -> None:
    """``qwen3_rl`` blocked (and the plugin allowed, so vLLM tries to load it): the patched modules import, the
    registries stay empty, ``SpeculativeConfig`` behaves as pristine."""
    proc = run_python(f"import os; os.environ['VLLM_PLUGINS'] = 'qwen3_rl'\n{_NO_PACKAGE_PROBE}",
                      path=(patched_imports / "vllm", patched_imports / ".dist-info"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["llm_engine"].startswith(str(patched_imports)) and out["gpu_model_runner"].startswith(
        str(patched_imports))
    assert out["hooks"] == 0 and out["drafters"] == [] and out["qwen3_rl_loaded"] == []
    assert out["ngram"] == ["ngram", 5, 5]
    assert "Unknown speculative decoding method 'sam'" in out["sam"]
    assert "Failed to load plugin qwen3_rl" in proc.stdout + proc.stderr  # vLLM tried and carried on


def _module_level_imports_of_ours(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "qwen3_rl":
            found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "qwen3_rl" for a in node.names):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_patched_files_import_nothing_of_ours(patched_workspace: Path) -> None:
    """Every file the vLLM and vLLM-Ascend patches touch: no ``qwen3_rl`` import at any level."""
    files = [patched_workspace / tree / rel for tree, rels in PATCHED_FILES.items() for rel in rels]
    assert all(f.is_file() for f in files)
    assert [hit for f in files for hit in _module_level_imports_of_ours(f)] == []
