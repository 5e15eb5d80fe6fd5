"""``NPUGRAPH_EX`` on the current pin set: the switch's keys (features.toml ``current.sets``, rendered as the train
scripts render them) reach vLLM-Ascend 0.23.0.post1's own config code and select its npugraph_ex graph mode.

vLLM's ``EngineArgs.create_engine_config`` runs ``NPUPlatform.check_and_update_config`` (``platform.py:450``) on the
recipe's CPU stand-in for torch_npu (``npugraph_ex_driver.py``, the patched tree of ``test_current_ascend_engine``).
The engine kwargs are what verl 0.9.1's server passes (``vllm_async_server.py:307-349``): the command's
``engine_kwargs.vllm`` keys, ``rollout.cudagraph_capture_sizes`` into ``compilation_config`` when set (:321-322),
``cudagraph_mode`` FULL_AND_PIECEWISE unless given (:310), ``enforce_eager`` False (``rollout.yaml:52``).

What is checked: the mode vLLM-Ascend picks (``cudagraph_mode``, compilation mode, ``AscendCompilationConfig
.enable_npugraph_ex`` and the ``additional_config`` the workers receive, no splitting ops, its compiler backend), the
spec-decode step of the model runner's graph set-up (``resolve_cudagraph_mode_and_sizes`` with vLLM-Ascend's attention
support and 1 + k tokens per request) and the drafter's ``pad_drafts``. Positive controls: the switch off (verl's
default mode) does not select npugraph_ex; ``enable_npugraph_ex=False`` under the switch's mode does not either (the
key is read); eager mode drops it; a static kernel without npugraph_ex and ``ASCEND_LAUNCH_BLOCKING=1`` with graphs
are refused. Not run: nothing is compiled by npugraph_ex or captured (that needs the NPU runtime), no engine steps.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_current_ascend_engine import patched_ascend_tree

from qwen3_rl.tools import features as F

from conftest import run_driver

pytestmark = pytest.mark.timeout(900)
EK = "+actor_rollout_ref.rollout.engine_kwargs.vllm."
CAPTURE = "actor_rollout_ref.rollout.cudagraph_capture_sizes"
K = 3
SIZES = [4, 6, 8]
#: the switches of the cases (the rest of the registry's switches off)
ON = {
    "NPUGRAPH_EX": "True",
    "SAM_ENABLE": "True",
    "SAM_K": str(K),
    "SAM_ADAPTIVE_K": "False",
    "GRAPH_CAPTURE_SIZES": json.dumps(SIZES).replace(" ", ""),
}
OFF = {**ON, "NPUGRAPH_EX": "False"}


def engine_kwargs(switches: dict[str, str]) -> dict[str, Any]:
    """vLLM engine kwargs from the current set's rendered overrides, as verl 0.9.1's server builds them (module
    docstring)."""
    overrides = F.render(F.load_registry(), switches, "current")
    kw: dict[str, Any] = {"enforce_eager": False}
    for o in overrides:
        key, _, raw = o.partition("=")
        value = yaml.safe_load(raw)
        if key.startswith(EK):
            *path, leaf = key.removeprefix(EK).split(".")
            node = kw
            for p in path:
                node = node.setdefault(p, {})
            node[leaf] = value
        elif key == CAPTURE and value is not None:
            kw.setdefault("compilation_config", {})["cudagraph_capture_sizes"] = value
    kw.setdefault("compilation_config", {}).setdefault("cudagraph_mode", "FULL_AND_PIECEWISE")
    return kw


def with_ascend_compilation(kw: dict[str, Any], **opts: bool) -> dict[str, Any]:
    """``kw`` with ``additional_config.ascend_compilation_config`` updated by ``opts``."""
    kw = copy.deepcopy(kw)
    kw.setdefault("additional_config", {}).setdefault("ascend_compilation_config", {}).update(opts)
    return kw


@pytest.fixture(scope="module")
def cases(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("npugraph_ex")
    on, off = engine_kwargs(ON), engine_kwargs(OFF)
    spec = {
        "tree": str(patched_ascend_tree(tmp / "ws")),
        "model": str(tiny_models["dense"]),
        "cases": [
            {"name": "on", "engine": on},
            {"name": "off", "engine": off},
            {"name": "ex_key_off", "engine": with_ascend_compilation(on, enable_npugraph_ex=False)},
            {"name": "eager", "engine": {**on, "enforce_eager": True}},
            {
                "name": "static_without_ex",
                "engine": with_ascend_compilation(on, enable_npugraph_ex=False, enable_static_kernel=True),
            },
            {"name": "launch_blocking", "engine": on, "env": {"ASCEND_LAUNCH_BLOCKING": "1"}},
        ],
    }
    f = tmp / "spec.json"
    f.write_text(json.dumps(spec))
    out = run_driver(
        "npugraph_ex_driver.py", [str(f)], "NPUGRAPH_EX_RESULT", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    )
    for name, r in out.items():
        print(f"{name}: {json.dumps(r)}")
    return out


def test_switch_keys_are_the_ones_vllm_ascend_023_reads() -> None:
    kw = engine_kwargs(ON)
    assert kw["compilation_config"] == {
        "cudagraph_capture_sizes": SIZES,
        "cudagraph_mode": "FULL_DECODE_ONLY",
    }
    assert kw["additional_config"]["ascend_compilation_config"] == {"enable_npugraph_ex": True}
    assert kw["additional_config"]["qwen3_rl"]["sam_config"]["pad_drafts"] is True
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": K}
    # the seed set's top-level key (vLLM-Ascend 0.13) is not among them
    assert "enable_npugraph_ex" not in kw["additional_config"]


def test_switch_on_selects_npugraph_ex_full_decode_graphs(cases: dict[str, dict]) -> None:
    r = cases["on"]
    assert r["error"] is None, r["error"]
    assert (r["cudagraph_mode"], r["mode"]) == ("FULL_DECODE_ONLY", "VLLM_COMPILE")
    assert r["enable_npugraph_ex"] is True and r["additional"]["enable_npugraph_ex"] is True
    assert r["enable_static_kernel"] is False
    assert r["splitting_ops"] == []  # one FX graph for npugraph_ex (platform.py:630-633)
    assert r["oot_compiler"] == "vllm_ascend.compilation.compiler_interface.AscendCompiler"
    assert r["capture_sizes"] == SIZES
    assert r["worker_cls"] == "qwen3_rl.spec_decode.rollout_worker.SamWorker"


def test_spec_decode_keeps_full_decode_graphs_of_uniform_1_plus_k_batches(cases: dict[str, dict]) -> None:
    """vLLM-Ascend's attention supports graphs for any batch (``ALWAYS``), so the runner's resolution keeps
    FULL_DECODE_ONLY with k drafts; the capture sizes become multiples of 1 + k; the drafter pads its drafts to k."""
    r = cases["on"]
    assert r["spec_k"] == K and r["attn_cg_support"] == "ALWAYS"
    assert r["resolved"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    sizes = r["resolved"]["capture_sizes"]
    assert sizes and all(s % (1 + K) == 0 for s in sizes), sizes
    assert set(sizes) < set(SIZES)  # 6 dropped: the adjustment ran
    assert r["sam_pad_drafts"] is True


def test_switch_off_leaves_npugraph_ex_off(cases: dict[str, dict]) -> None:
    """Positive control: verl's default FULL_AND_PIECEWISE turns vLLM-Ascend's default-on npugraph_ex off
    (platform.py:599-628); the drafter does not pad."""
    r = cases["off"]
    assert r["error"] is None, r["error"]
    assert r["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert r["enable_npugraph_ex"] is False and r["additional"]["enable_npugraph_ex"] is False
    assert r["splitting_ops"]  # piecewise graphs split at attention
    assert r["capture_sizes"] == SIZES  # GRAPH_CAPTURE_SIZES reaches vLLM either way
    assert r["sam_pad_drafts"] is False


def test_enable_npugraph_ex_key_is_read(cases: dict[str, dict]) -> None:
    """Positive control of the key: under the switch's FULL_DECODE_ONLY, ``enable_npugraph_ex=False`` gives plain
    full graphs without npugraph_ex."""
    r = cases["ex_key_off"]
    assert r["error"] is None, r["error"]
    assert r["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert r["enable_npugraph_ex"] is False and r["additional"]["enable_npugraph_ex"] is False


def test_eager_mode_drops_npugraph_ex(cases: dict[str, dict]) -> None:
    """``rollout.enforce_eager`` (ENFORCE_EAGER) wins: no graphs, npugraph_ex off (platform.py:527-531, 593-598)."""
    r = cases["eager"]
    assert r["error"] is None, r["error"]
    assert (r["cudagraph_mode"], r["mode"]) == ("NONE", "NONE")
    assert r["enable_npugraph_ex"] is False


def test_bad_combinations_are_refused(cases: dict[str, dict]) -> None:
    """A static kernel needs npugraph_ex (ascend_config.py:658-659); graphs refuse ASCEND_LAUNCH_BLOCKING=1
    (platform.py:647-656). The "on" case (same keys, no env) passes: see its test."""
    assert "Static kernel generation requires npugraph_ex" in (cases["static_without_ex"]["error"] or ""), (
        cases["static_without_ex"]
    )
    err = cases["launch_blocking"]["error"] or ""
    # inside pydantic's ValidationError
    assert "ACL graph is incompatible with ASCEND_LAUNCH_BLOCKING=1" in err, err
