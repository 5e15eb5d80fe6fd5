"""vLLM-Ascend: patch 0001 (per-group HCCL op-expansion mode) and the two upstream checks.

vLLM-Ascend does not import without torch_npu, so the patched source is compiled and inspected, and the
patch's own parser (self-contained in the patched utils.py) is executed here.

* 0001 set_hccl_op_expansion_mode: shipped; the patched parser + the patched call site.
* npugraph_ex_static_kernel_typo: NOT shipped; the typo (``num_speculative_token``,
  ``max_num_seq``, ``cudagraph_capture_size``) came with vllm-ascend PR #5775 after v0.13.0. The pin
  sets the correct torchair attribute and has none of the misspelled reads.
* align_FIA_input_for_TND_layout: NOT shipped; the pin already aligns the paths our rollout uses
  (eager, FULL_DECODE_ONLY uniform decode, draft graphs). ``cudagraph_mode=FULL`` is refused by
  :func:`qwen3_rl.compat.vllm_ascend_fia.check_cudagraph_mode_for_tnd`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

from qwen3_rl.compat.vllm_ascend_fia import TND_SAFE_CUDAGRAPH_MODES, check_cudagraph_mode_for_tnd

ASCEND = "vllm-ascend/vllm_ascend"
OPTION_KEY = "hccl_op_expansion_mode"
SECTION = "qwen3_rl"  # additional_config section the patch reads


def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{name} not found in {path}")


@pytest.fixture(scope="module")
def patched_hccl(patched_workspace: Path) -> SimpleNamespace:
    """The patched file's own parser (``_hccl_op_expansion_modes`` and its mode table), executed here:
    vllm_ascend/utils.py does not import without torch_npu, and the parser needs nothing of it."""
    path = patched_workspace / ASCEND / "utils.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "_hccl_op_expansion_modes")
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_HCCL_OP_EXPANSION_MODES"
                                                   for t in n.targets))]
    assert len(keep) == 2, "parser or mode table missing in the patched utils.py"
    ns: dict = {"Optional": Optional}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
    return SimpleNamespace(modes=ns["_HCCL_OP_EXPANSION_MODES"], parse=ns["_hccl_op_expansion_modes"])


# ---------------------------------------------- 0001: the patched file's parser (executed here)

def test_parse_mode_names_and_values(patched_hccl: SimpleNamespace) -> None:
    # HcclCommConfig.hcclOpExpansionMode: 0 default, 1 host, 2 aicpu, 3 aiv (hccl_types.h)
    assert patched_hccl.modes == {"default": 0, "host": 1, "aicpu": 2, "aiv": 3}
    cfg = lambda mode: {SECTION: {OPTION_KEY: {"tp": mode}}}  # noqa: E731
    assert patched_hccl.parse(cfg("AIV")) == {"tp": 3}
    assert patched_hccl.parse(cfg("ai_cpu")) == {"tp": 2}
    assert patched_hccl.parse(cfg(" Host ")) == {"tp": 1}
    assert patched_hccl.parse(cfg(0)) == {"tp": 0}
    for bad in ("fast", 4, -1, True, 2.0):
        with pytest.raises(ValueError, match=OPTION_KEY):
            patched_hccl.parse(cfg(bad))


def test_unset_config_changes_nothing(patched_hccl: SimpleNamespace) -> None:
    for additional in (None, {}, {"other": 1}, {SECTION: {}}, {SECTION: {OPTION_KEY: {}}}):
        assert patched_hccl.parse(additional) == {}


def test_groups_get_their_modes(patched_hccl: SimpleNamespace) -> None:
    modes = patched_hccl.parse({SECTION: {OPTION_KEY: {"tp": "aicpu", "ep": 3}}})
    assert modes == {"tp": 2, "ep": 3}
    assert all(isinstance(v, int) for v in modes.values())  # torch_npu requires an int (uint32) value


def test_bad_config_is_rejected_when_groups_are_built(patched_hccl: SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="must be a mapping"):
        patched_hccl.parse({SECTION: "tp=aiv"})
    with pytest.raises(ValueError, match="must map group names"):
        patched_hccl.parse({SECTION: {OPTION_KEY: "aiv"}})
    with pytest.raises(ValueError, match="unknown mode"):
        patched_hccl.parse({SECTION: {OPTION_KEY: {"tp": "fastest"}}})


def test_hydra_style_config_is_accepted(patched_hccl: SimpleNamespace) -> None:
    """verl hands additional_config over as a plain dict (OmegaConf.to_container); the parser works on that."""
    from omegaconf import OmegaConf

    additional = OmegaConf.to_container(OmegaConf.create({SECTION: {OPTION_KEY: {"tp": "aiv"}}}))
    assert patched_hccl.parse(additional) == {"tp": 3}


# ------------------------------------------------------- 0001: the patched call site (parsed)

def test_patched_utils_compiles_and_routes_pg_options(pristine_workspace: Path,
                                                      patched_workspace: Path) -> None:
    patched = patched_workspace / ASCEND / "utils.py"
    text = patched.read_text()
    compile(text, str(patched), "exec")  # byte-compiles
    assert "from qwen3_rl" not in text and "import qwen3_rl" not in text  # self-contained

    fn = _function(patched, "get_hccl_config_for_pg_options")
    returns = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Return)), key=lambda n: n.lineno)
    # the mc2 early exit (None) is kept, the final return is the config with the mode added
    assert isinstance(returns[0].value, ast.Constant) and returns[0].value.value is None
    body = ast.unparse(fn)
    assert "_hccl_op_expansion_modes(get_current_vllm_config().additional_config).get(group_name)" in body
    assert "hccl_config = {**hccl_config, 'hccl_op_expansion_mode': mode}" in body
    assert ast.unparse(returns[-1].value) == "hccl_config"

    # the pristine function never sets an op-expansion mode, and the options still come from it
    pristine_fn = ast.unparse(_function(pristine_workspace / ASCEND / "utils.py",
                                        "get_hccl_config_for_pg_options"))
    assert "op_expansion" not in pristine_fn
    create = ast.unparse(_function(patched, "create_hccl_pg_options"))
    assert "get_hccl_config_for_pg_options(group_name)" in create
    assert "options.hccl_config = hccl_config" in create


def test_tp_group_name_in_pinned_vllm(pristine_workspace: Path) -> None:
    """The helper is keyed by vLLM's group name; the TP group is called "tp" in the pin."""
    src = (pristine_workspace / "vllm/vllm/distributed/parallel_state.py").read_text()
    assert re.search(r'_TP = init_model_parallel_group\(.{0,300}?group_name="tp"', src, re.S)
    patch_src = (pristine_workspace / ASCEND / "patch/worker/patch_distributed.py").read_text()
    assert "hccl_pg_options = create_hccl_pg_options(group_name)" in patch_src


# --------------------------------------- upstream check: npugraph_ex static-kernel typo (absent)

def test_npugraph_ex_static_kernel_attribute_is_correct_in_pin(pristine_workspace: Path) -> None:
    path = pristine_workspace / ASCEND / "compilation/compiler_interface.py"
    fn = _function(path, "npugraph_ex_compile")
    targets = [ast.unparse(t) for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets]
    # torchair's switch is experimental_config.aclgraph._aclnn_static_shape_kernel
    assert "config.experimental_config.aclgraph._aclnn_static_shape_kernel" in targets
    lineno = next(n.lineno for n in ast.walk(fn) if isinstance(n, ast.Assign)
                  and ast.unparse(n.targets[0]).endswith("_aclnn_static_shape_kernel"))
    assert lineno == 109  # vllm_ascend/compilation/compiler_interface.py:109 (docs table)
    # the misspelled reads of the later refactor (PR #5775, fixed by #6664) are not in the pin
    src = path.read_text()
    for typo in (r"\.num_speculative_token\b", r"\.max_num_seq\b", r"\.cudagraph_capture_size\b"):
        assert not re.search(typo, src), typo
    assert "npugraph_ex_config" not in (pristine_workspace / ASCEND / "ascend_config.py").read_text()


# ------------------------------------------------ upstream check: FIA TND alignment in the pin

def test_pin_aligns_fia_tnd_inputs_on_the_paths_we_use(pristine_workspace: Path) -> None:
    root = pristine_workspace / ASCEND
    # eager: the query is cut to the last cumulative length before the FIA call
    eager = ast.unparse(_function(root / "attention/attention_v1.py", "forward_fused_infer_attention"))
    cut = eager.index("query = query[:num_tokens]")
    assert eager.index("num_tokens = attn_metadata.actual_seq_lengths_q[-1]") < cut
    assert cut < eager.index("torch_npu.npu_fused_infer_attention_score(")
    # FULL uniform decode: dummy requests of uniform_decode_query_len tokens up to the padded size
    runner = (root / "worker/model_runner_v1.py").read_text()
    assert re.search(r"num_reqs_padded = num_input_tokens // self\.uniform_decode_query_len", runner)
    assert re.search(r"self\.arange_np\[\s*1:pad_size \+\s*1\] \* self\.uniform_decode_query_len "
                     r"\+ last_query_loc", runner)
    # draft graphs: lengths padded to the runtime shape before the FIA update
    pad = ast.unparse(_function(root / "compilation/acl_graph.py", "_pad_attention_seq_params"))
    assert "interpolated.append(runtime_shape)" in pad
    # the FULL mixed-batch fix of PR #6475 is not in the pin (hence the config check below)
    assert "_pad_query_start_loc_for_fia" not in runner


def test_pinned_vllm_rounds_decode_graph_sizes_for_spec_decode(pristine_workspace: Path) -> None:
    """FULL_DECODE_ONLY sizes are multiples of the decode query length (so the padding is exact)."""
    src = (pristine_workspace / "vllm/vllm/v1/worker/gpu_model_runner.py").read_text()
    assert re.search(r"cudagraph_mode\.decode_mode\(\) == CUDAGraphMode\.FULL\s+and cudagraph_mode\."
                     r"separate_routine\(\)\s+and self\.uniform_decode_query_len > 1", src)
    assert "adjust_cudagraph_sizes_for_spec_decode(" in src


def test_cudagraph_mode_check() -> None:
    assert check_cudagraph_mode_for_tnd(None) is None
    assert check_cudagraph_mode_for_tnd("full_decode_only") == "FULL_DECODE_ONLY"
    for mode in TND_SAFE_CUDAGRAPH_MODES:
        assert check_cudagraph_mode_for_tnd(mode) == mode
    with pytest.raises(ValueError, match="FULL_DECODE_ONLY"):
        check_cudagraph_mode_for_tnd("FULL")
    with pytest.raises(ValueError, match="unknown cudagraph_mode"):
        check_cudagraph_mode_for_tnd("FULL_GRAPH")
