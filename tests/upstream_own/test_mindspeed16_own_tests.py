"""MindSpeed core_r0.16.0's own tests that touch the files the current series patches (``patches/current/mindspeed``):
which they are, and why none of them runs on a CPU host.

The archive's tests (``tests_extend/``) are scanned for Python files that import a patched Python module or name the
op builder that compiles a patched C++ source. Each one found imports ``torch_npu`` at module level (the real package
needs CANN and an NPU; the suite's torch_npu stand-in has two kernels, not ``torch_npu.npu.get_device_name`` or
``.npu()`` tensors) and MindSpeed's Megatron-LM adaptor or ``megatron.training`` (Megatron-LM's training package,
which the megatron-core wheel does not ship): they cannot be run on the pristine and patched CPU trees. megatron-core
0.16.1 ships no tests in its wheel or its sdist (its tests are in the Megatron-LM repository only)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers.current_set import MINDSPEED, patched_files, series
from helpers.mindspeed_tree import pinned_mindspeed_workspace

#: the op builders that compile the builder patch's C++ sources (mindspeed/op_builder/*_builder.py)
BUILDERS = ("SmartSwapBuilder", "AdaptiveRecomputingPluggableAllocatorBuilder", "smart_swap_builder",
            "adaptive_recomputing_builder")
#: what the scan finds in core_r0.16.0 (e4772499)
EXPECTED = {
    "tests_extend/unit_tests/ops/cann/test_npu_ring_attention_update.py",
    "tests_extend/mindspore/unit_tests/ops/cann/test_npu_ring_attention_update.py",
    "tests_extend/unit_tests/mindspeed/core/context_parallel/test_ringattn_context_parallel_tnd.py",
    "tests_extend/unit_tests/mindspeed/core/context_parallel/test_adaptive_context_parallel.py",
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pinned_mindspeed_workspace(tmp_path_factory.mktemp("ms16"), MINDSPEED) / MINDSPEED.dir


def _module_imports(path: Path) -> set[str]:
    """Modules a file imports at module level (``import a.b`` and ``from a.b import c`` give ``a.b`` and
    ``a.b.c``)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_mindspeed16_own_tests_of_the_patched_files_need_an_npu(tree: Path) -> None:
    patched = [f for p in series("mindspeed") for f in patched_files(p)]
    modules = {f[:-3].replace("/", ".") for f in patched if f.endswith(".py")}
    assert modules == {"mindspeed.core.context_parallel.utils"}, modules
    found = {}
    for path in sorted((tree / "tests_extend").rglob("*.py")):
        imports = _module_imports(path)
        text = path.read_text()
        if imports & modules or any(re.search(rf"\b{b}\b", text) for b in BUILDERS):
            found[path.relative_to(tree).as_posix()] = imports
    assert set(found) == EXPECTED, sorted(found)
    for rel, imports in found.items():
        assert "torch_npu" in imports, rel
        assert imports & {"mindspeed.megatron_adaptor", "megatron.training.arguments"} or any(
            m.startswith("megatron.training") for m in imports), rel
