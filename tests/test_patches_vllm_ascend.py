"""vLLM-Ascend: patch 0001 (per-group HCCL op-expansion mode) and the two upstream checks.

vLLM-Ascend does not import without torch_npu, so the patched source is compiled and inspected,
and the logic it calls (``qwen3_rl.compat.vllm_ascend_*``) is executed here.

* 0001 set_hccl_op_expansion_mode: shipped; helper behaviour + patched call site.
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

import pytest

from qwen3_rl.compat.vllm_ascend_fia import TND_SAFE_CUDAGRAPH_MODES, check_cudagraph_mode_for_tnd
from qwen3_rl.compat.vllm_ascend_hccl import (
    ADDITIONAL_CONFIG_KEY,
    MODES,
    OPTION_KEY,
    op_expansion_modes,
    parse_mode,
    with_op_expansion_mode,
)

ASCEND = "vllm-ascend/vllm_ascend"


def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{name} not found in {path}")


# ------------------------------------------------------------- 0001: helper (executed here)

def test_parse_mode_names_and_values() -> None:
    # HcclCommConfig.hcclOpExpansionMode: 0 default, 1 host, 2 aicpu, 3 aiv (hccl_types.h)
    assert MODES == {"default": 0, "host": 1, "aicpu": 2, "aiv": 3}
    assert parse_mode("AIV") == 3
    assert parse_mode("ai_cpu") == 2
    assert parse_mode(" Host ") == 1
    assert parse_mode(0) == 0
    for bad in ("fast", 4, -1, True, None, 2.0):
        with pytest.raises(ValueError, match=OPTION_KEY):
            parse_mode(bad)


def test_unset_config_changes_nothing() -> None:
    cfg = {"hccl_buffer_size": 200}
    for additional in (None, {}, {"other": 1}, {ADDITIONAL_CONFIG_KEY: {}},
                       {ADDITIONAL_CONFIG_KEY: {OPTION_KEY: {"dp": "aiv"}}}):
        assert with_op_expansion_mode("tp", cfg, additional) is cfg
    assert cfg == {"hccl_buffer_size": 200}


def test_tp_group_gets_its_mode_and_others_keep_theirs() -> None:
    additional = {ADDITIONAL_CONFIG_KEY: {OPTION_KEY: {"tp": "aicpu", "ep": 3}}}
    assert op_expansion_modes(additional) == {"tp": 2, "ep": 3}
    base = {"hccl_buffer_size": 200}
    tp = with_op_expansion_mode("tp", base, additional)
    assert tp == {"hccl_buffer_size": 200, OPTION_KEY: 2}
    assert tp is not base and base == {"hccl_buffer_size": 200}
    assert isinstance(tp[OPTION_KEY], int)  # torch_npu requires an int (uint32) value
    assert with_op_expansion_mode("dp", {"hccl_buffer_size": 1}, additional) == {"hccl_buffer_size": 1}
    # groups vLLM-Ascend gives no options (mc2 -> None) stay without options
    assert with_op_expansion_mode("mc2", None, {ADDITIONAL_CONFIG_KEY: {OPTION_KEY: {"mc2": "aiv"}}}) is None
    assert with_op_expansion_mode(None, base, additional) is base


def test_bad_config_is_rejected_when_groups_are_built() -> None:
    with pytest.raises(ValueError, match="must be a mapping"):
        op_expansion_modes({ADDITIONAL_CONFIG_KEY: "tp=aiv"})
    with pytest.raises(ValueError, match="must map group names"):
        op_expansion_modes({ADDITIONAL_CONFIG_KEY: {OPTION_KEY: "aiv"}})
    with pytest.raises(ValueError, match="unknown mode"):
        with_op_expansion_mode("tp", {}, {ADDITIONAL_CONFIG_KEY: {OPTION_KEY: {"tp": "fastest"}}})


def test_hydra_style_config_is_accepted() -> None:
    from omegaconf import OmegaConf

    additional = OmegaConf.create({ADDITIONAL_CONFIG_KEY: {OPTION_KEY: {"tp": "aiv"}}})
    assert with_op_expansion_mode("tp", {"hccl_buffer_size": 200}, additional)[OPTION_KEY] == 3


# ------------------------------------------------------- 0001: the patched call site (parsed)

def test_patched_utils_compiles_and_routes_pg_options(pristine_workspace: Path,
                                                      patched_workspace: Path) -> None:
    patched = patched_workspace / ASCEND / "utils.py"
    compile(patched.read_text(), str(patched), "exec")  # byte-compiles

    fn = _function(patched, "get_hccl_config_for_pg_options")
    returns = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Return)), key=lambda n: n.lineno)
    # the mc2 early exit (None) is kept, the final return goes through our helper
    assert isinstance(returns[0].value, ast.Constant) and returns[0].value.value is None
    call = returns[-1].value
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == "with_op_expansion_mode"
    assert [ast.unparse(a) for a in call.args] == [
        "group_name", "hccl_config", "get_current_vllm_config().additional_config"]
    imports = {(n.module, a.name) for n in ast.walk(fn) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("qwen3_rl.compat.vllm_ascend_hccl", "with_op_expansion_mode") in imports

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
