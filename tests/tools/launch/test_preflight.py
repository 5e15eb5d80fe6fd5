"""``python -m qwen3_rl preflight``: every check on a good setup and on one broken thing at a time, all
problems listed at once, stub ``npu-smi`` on PATH, the real ``apply_all_patches.sh --status``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_launch import (
    DATA,
    PY,
    REPO,
    make_cann,
    make_model,
    make_parquet,
    make_standin,
    make_stubs,
    stub_env,
)

from qwen3_rl.tools.launch.preflight import check_batches, check_layout, check_lengths, hydra_list
from qwen3_rl.tools.pins import load_pins

W = "actor_rollout_ref.actor.megatron."
# the trees the patched_workspace fixture builds (those on PyPI); MindSpeed is not among them
ONLY = ",".join(k for k, fw in load_pins(REPO / "pins.toml").frameworks.items() if fw.on_pypi)


def _setup(tmp_path: Path, **over: str) -> tuple[Path, dict[str, str]]:
    bin_dir = make_stubs(tmp_path, ray=False, ip=False)
    script = make_standin(tmp_path, "raise SystemExit(0)\n")
    cann = make_cann(tmp_path)
    env = stub_env(tmp_path, bin_dir, MODEL_PATH=str(make_model(tmp_path)),
                   TRAIN_FILE=str(make_parquet(tmp_path / "d" / "train.parquet")),
                   VAL_FILE=str(make_parquet(tmp_path / "d" / "val.parquet")),
                   ASCEND_HOME_PATH=str(cann / "ascend-toolkit" / "latest"))
    env.update(over)
    return script, env


def _preflight(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(env, PYTHONPATH=str(REPO))
    return subprocess.run([PY, "-m", "qwen3_rl", "preflight", str(script), *args], env=env, text=True,
                          capture_output=True, timeout=120, cwd=REPO)


def _errors(p: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]


def test_good_setup_passes_with_patched_workspace(tmp_path: Path, patched_workspace: Path):
    script, env = _setup(tmp_path)
    p = _preflight(script, env, "--workspace", str(patched_workspace), "--only", ONLY, "--nnodes", "1",
                   "--npus-per-node", "16")
    assert p.returncode == 0, p.stderr
    assert "preflight: 0 error(s)" in p.stdout and p.stdout.rstrip().endswith("- OK")
    assert "npu-smi info -m" in (tmp_path / "calls.log").read_text()


def test_unpatched_and_missing_trees_reported(tmp_path: Path, make_workspace):
    ws = make_workspace("verl")  # pristine verl (patches not applied), other trees absent
    script, env = _setup(tmp_path)
    p = _preflight(script, env, "--workspace", str(ws))
    errs = _errors(p)
    assert p.returncode == 1
    verl_line = [e for e in errs if "not applied" in e]
    assert len(verl_line) == 1 and "0001-verl-" in verl_line[0] and "run bash apply_all_patches.sh" in verl_line[0]
    assert any("pinned source trees missing" in e for e in errs)


BROKEN = [
    ("tp", {"ACTOR_TP": "3"}, "[layout] actor TP3 x PP1 x CP1 = 3 does not divide the world size 16"),
    ("rollout-tp", {"ROLLOUT_TP": "5"}, "[layout] rollout TP5 does not divide the world size 16"),
    ("ep-experts", {"ACTOR_EP": "16"}, "[layout] actor EP16 > 1 but the model has no experts"),
    ("batch", {"TRAIN_BATCH_SIZE": "40"}, "[batch] data.train_batch_size 40 is not a multiple of ppo_mini_batch_size 16"),
    ("length", {"MAX_RESPONSE_LENGTH": "40000"},
     "[length] prompt 1024 + response 40000 = 41024 > the model's max_position_embeddings 40960"),
    ("npus", {"STUB_NPU_MAP": str(DATA / "npu_smi_topo_a3.txt")}, "[npu] npu-smi info -m: no 'Chip Logic ID' header"),
    ("cann", {"ASCEND_HOME_PATH": ""}, "[cann] CANN is not sourced"),
    ("model", {"MODEL_PATH": "/nonexistent/model"}, "[model] model path /nonexistent/model does not exist"),
    ("dataset", {"VAL_FILE": "/nonexistent/val.parquet"}, "[data] data.val_files: /nonexistent/val.parquet not found"),
]


@pytest.mark.parametrize("case", BROKEN, ids=[c[0] for c in BROKEN])
def test_one_broken_thing_one_error_line(tmp_path: Path, patched_workspace: Path, case):
    _, over, expected = case
    script, env = _setup(tmp_path, **over)
    if over.get("ASCEND_HOME_PATH") == "":
        env.pop("ASCEND_HOME_PATH")
    p = _preflight(script, env, "--workspace", str(patched_workspace), "--only", ONLY, "--nnodes", "1",
                   "--npus-per-node", "16")
    errs = _errors(p)
    assert p.returncode == 1
    assert [e for e in errs if expected in e], p.stderr  # the broken thing is named (with its consequences)


def test_world_mismatch_from_override(tmp_path: Path):
    script, env = _setup(tmp_path)
    p = _preflight(script, env, "--no-node-checks", "--nnodes", "1", "--npus-per-node", "16", "trainer.nnodes=2")
    assert p.returncode == 1
    assert _errors(p) == ["error: [world] train script wants 2 nodes x 16 NPUs = 32, the launcher has 1 x 16 = 16"]


def test_all_problems_listed_at_once(tmp_path: Path):
    script, env = _setup(tmp_path, ACTOR_TP="3", TRAIN_BATCH_SIZE="40", MAX_RESPONSE_LENGTH="40000",
                         MODEL_PATH=str(tmp_path / "model"))
    (tmp_path / "model" / "model-00001-of-00001.safetensors").unlink()
    make_parquet(tmp_path / "d" / "bad.parquet", columns=("prompt", "extra_info"))
    env["TRAIN_FILE"] = str(tmp_path / "d" / "bad.parquet")
    p = _preflight(script, env, "--no-node-checks", "--nnodes", "1", "--npus-per-node", "16")
    errs = _errors(p)
    assert p.returncode == 1
    checks = {e.split("]")[0] + "]" for e in errs}
    # response 40000 > verl's default max_num_batched_tokens 8192 with chunked prefill: verl's rollout refuses it
    assert checks == {"error: [model]", "error: [data]", "error: [layout]", "error: [batch]", "error: [length]",
                      "error: env-contract[verl-batched-tokens-chunked]"}, errs
    assert any("lacks verl column(s) data_source, reward_model" in e for e in errs)
    assert any("no weights (*.safetensors / *.bin)" in e for e in errs)
    assert f"preflight: {len(errs)} error(s)" in p.stdout


def test_moe_layout_checks_with_real_235b_config():
    import json

    cfg = json.loads((DATA / "qwen3_235b_a22b_config.json").read_text())
    vals = {"trainer.nnodes": "8", "trainer.n_gpus_per_node": "16", W + "tensor_model_parallel_size": "4",
            W + "pipeline_model_parallel_size": "4", W + "context_parallel_size": "4",
            W + "expert_model_parallel_size": "32", W + "expert_tensor_parallel_size": "1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size": "4",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size": "32"}
    errs = [f.message for f in check_layout(vals, cfg)]
    assert errs == ["94 layers do not split evenly over PP4; set override_transformer_config."
                    "num_layers_in_first/last_pipeline_stage (megatron/core/transformer/transformer_block.py asserts it)"]
    vals[W + "override_transformer_config.num_layers_in_first_pipeline_stage"] = "22"
    vals[W + "override_transformer_config.num_layers_in_last_pipeline_stage"] = "24"
    assert check_layout(vals, cfg) == []
    vals[W + "expert_model_parallel_size"] = "48"
    msgs = [f.message for f in check_layout(vals, cfg)]
    assert "actor EP48 does not divide the 128 experts" in msgs
    assert "actor EP48 x ETP1 x PP4 = 192 does not divide the world size 128 (megatron expert data parallel)" in msgs
    vals[W + "expert_model_parallel_size"] = "32"
    vals["actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size"] = "16"
    assert [f.message for f in check_layout(vals, cfg)] == [
        "rollout TP4 x DP16 = 64 != world size 128 (sync rollout puts one rank on every die)"]


def test_batch_and_length_rules():
    base = {"trainer.nnodes": "1", "trainer.n_gpus_per_node": "16", "data.train_batch_size": "32",
            "actor_rollout_ref.rollout.n": "4", "actor_rollout_ref.actor.ppo_mini_batch_size": "16",
            W + "tensor_model_parallel_size": "4"}
    assert check_batches(base) == []
    bad = dict(base, **{"actor_rollout_ref.actor.ppo_mini_batch_size": "3", "data.train_batch_size": "3",
                        W + "tensor_model_parallel_size": "2"})
    msgs = [f.message for f in check_batches(bad)]
    assert "ppo_mini_batch_size 3 x n 4 = 12 does not divide over the actor's 8 data-parallel ranks" in msgs
    assert "train_batch_size 3 x n 4 = 12 does not split over the 16 ranks the rollout batch is dispatched to" in msgs
    lens = {"data.max_prompt_length": "2048", "data.max_response_length": "34816",
            "actor_rollout_ref.actor.use_dynamic_bsz": "True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "8192"}
    assert [f.message for f in check_lengths(lens, {"max_position_embeddings": 40960})] == [
        "ppo_max_token_len_per_gpu 8192 < prompt + response 36864: one sequence would not fit a micro-batch"]
    assert hydra_list("[a.parquet,'b.parquet']") == ["a.parquet", "b.parquet"] and hydra_list("x") == ["x"]


def test_shipped_scripts_pass_config_checks_with_real_configs(tmp_path: Path):
    """The train scripts, with the real Qwen3 configs as model path: no layout/batch/length error."""
    model32 = make_model(tmp_path / "m32")
    model235 = make_model(tmp_path / "m235", config="qwen3_235b_a22b_config.json")
    model30 = make_model(tmp_path / "m30", config="qwen3_30b_a3b_config.json")
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny", TinySpec(moe=True))
    for script in sorted((REPO / "internal").glob("train_*.sh")):
        env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NPUS_PER_NODE")}
        env["MODEL_PATH"] = str(model235 if "235b" in script.name else model30 if "30b_a3b" in script.name
                                else tiny if "tiny_cpu" in script.name else model32)
        env["PYTHONPATH"] = str(REPO)
        args = ["--env-script", str(REPO / "internal" / "qwen3_235b_env.sh")] if "235b" in script.name else []
        p = subprocess.run([PY, "-m", "qwen3_rl", "preflight", str(script), "--no-node-checks", *args], env=env,
                           text=True, capture_output=True, timeout=120, cwd=REPO)
        cfg_errors = [ln for ln in p.stderr.splitlines()
                      if ln.startswith("error:") and ("[layout]" in ln or "[batch]" in ln or "[length]" in ln)]
        assert cfg_errors == [], f"{script.name}: {cfg_errors}"


OTC = W + "override_transformer_config."
MOE_SCRIPT = REPO / "internal" / "train_grpo_qwen3_235b_128die_true_weight.sh"


def _feature_errors(extra: list[str], **env: str) -> list[str]:
    """[feature] errors of the real 235B script with hand-written Hydra overrides (past the script's own checks)."""
    from qwen3_rl.tools.launch.preflight import run_preflight

    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env}
    found = run_preflight(str(MOE_SCRIPT), node_checks=False, env=base, extra_args=extra, npu_env=None)
    assert not [f for f in found if f.check == "script"], found
    return [f.message for f in found if f.check == "feature"]


def test_moe_zero_memory_needs_alltoall_overlap():
    """features.toml's MOE_ZERO_MEMORY rule on the final command's keys, also past the script's own check."""
    from qwen3_rl.tools.launch.preflight import check_feature_rules

    assert check_feature_rules({}) == [] and check_feature_rules({OTC + "moe_zero_memory": "disable"}) == []
    for level in ("level0", "level1"):
        (err,) = check_feature_rules({OTC + "moe_zero_memory": level})
        assert err.line() == (f"error: [feature] MOE_ZERO_MEMORY={level} requires MOE_ALLTOALL_OVERLAP=True (got "
                              "MOE_ALLTOALL_OVERLAP=False): MindSpeed applies moe_zero_memory only with "
                              "moe_alltoall_overlap_comm (mindspeed/features_manager/moe/moe_zero_memory.py:33,37)")
        assert check_feature_rules({OTC + "moe_zero_memory": level, OTC + "moe_alltoall_overlap_comm": "true"}) == []
    assert _feature_errors([]) == []
    (msg,) = _feature_errors([f"+{OTC}moe_zero_memory=level1"])
    assert msg.startswith("MOE_ZERO_MEMORY=level1 requires MOE_ALLTOALL_OVERLAP=True")
    assert _feature_errors([f"+{OTC}moe_zero_memory=level1"], MOE_ALLTOALL_OVERLAP="True") == []


def test_rollout_rebalance_needs_vllm_dp():
    from qwen3_rl.tools.launch.preflight import check_feature_rules

    R = "actor_rollout_ref.rollout."
    RB = "qwen3_rl.rollout_rebalance.enable"
    assert check_feature_rules({RB: "False"}) == []
    assert check_feature_rules({RB: "True",
                                R + "engine_kwargs.vllm.data_parallel_size": "32"}) == []
    for dp in ({}, {R + "engine_kwargs.vllm.data_parallel_size": "1"}):
        (err,) = check_feature_rules({RB: "true", **dp})
        assert err.line() == ("error: [feature] ROLLOUT_REBALANCE=True requires VLLM_DP > 1 (got VLLM_DP=1): nothing "
                              "to move requests between; the engine hook refuses vLLM DP 1 at start-up")
    # a hand-written override past the script's own check: the 235B script with vLLM DP 1
    (msg,) = _feature_errors([f"++{RB}=True", f"+{R}engine_kwargs.vllm.data_parallel_size=1"])
    assert msg.startswith("ROLLOUT_REBALANCE=True requires VLLM_DP > 1")
    assert _feature_errors([f"++{RB}=True"]) == []  # DP 32


def test_feature_rules_read_back_from_keys():
    """Switches on through hand-written keys only: SAM group exchange without group mode, all-to-allv with EPLB
    (an excludes rule), the old-log-prob switch with two mini-batches (a context comparison)."""
    from qwen3_rl.tools.launch.preflight import check_feature_rules

    R = "actor_rollout_ref.rollout."
    sc = R + "engine_kwargs.vllm.speculative_config."
    dp = {R + "engine_kwargs.vllm.data_parallel_size": "4"}
    (err,) = check_feature_rules({**dp, sc + "method": "sam", sc + "sam_config.group_exchange": "True"})
    assert err.message == ("SAM_GROUP_EXCHANGE=True requires SAM_ENABLE=True and SAM_GROUP=True (got SAM_ENABLE=True, "
                           "SAM_GROUP=False): the exchanged tokens feed the group automata of the SAM drafter")
    assert check_feature_rules({**dp, sc + "method": "sam", sc + "sam_config.group_mode": "True",
                                sc + "sam_config.group_exchange": "True"}) == []
    eplb = R + "engine_kwargs.vllm.additional_config.eplb_config.dynamic_eplb"
    (err,) = check_feature_rules({"qwen3_rl.moe_alltoallv.enable": "True", eplb: "True"},
                                 "train_grpo_qwen3_235b_128die_true_weight.sh")
    assert err.message == "MOE_ALLTOALLV=True excludes ROLLOUT_EPLB=True: EPLB moves experts off vLLM's default placement"
    sizes = {"data.train_batch_size": "128", "actor_rollout_ref.actor.ppo_mini_batch_size": "64"}
    (err,) = check_feature_rules({**sizes, "qwen3_rl.old_log_prob.enable": "True"})
    assert err.message.startswith("USE_CURRENT_LOG_PROB_AS_OLD=True requires PPO_MINI_BATCH_SIZE == TRAIN_BATCH_SIZE "
                                  "(got PPO_MINI_BATCH_SIZE=64, TRAIN_BATCH_SIZE=128)")
    # a switch that is not the setup's is not read: the dense 32B setup has no EPLB / all-to-allv
    assert check_feature_rules({"qwen3_rl.moe_alltoallv.enable": "True", eplb: "True"},
                               "train_grpo_qwen3_32b_32die_true_weight.sh") == []


def test_spec_decode_requests_a_drafter_can_serve():
    """SAM on through the real 235B script: clean; a penalty the rollout passes to every request is a warning
    (vLLM drafts nothing for it); calculate_log_probs with SAM is clean in both rollout modes (vllm 0004)."""
    from qwen3_rl.tools.launch.preflight import run_preflight

    R = "actor_rollout_ref.rollout."
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "SAM_ENABLE": "True"}

    def found(extra: list[str]) -> list[str]:
        got = run_preflight(str(MOE_SCRIPT), node_checks=False, env=base, extra_args=extra, npu_env=None)
        return [f.line() for f in got if f.check == "spec-decode"]

    assert found([]) == []
    (warn,) = found([f"+{R}repetition_penalty=1.05"])
    assert warn == ("warning: [spec-decode] speculative_config.method=sam drafts nothing: every rollout request has "
                    "repetition_penalty=1.05 (must be 1.0) (vllm/v1/spec_decode/utils.py:9-17)")
    # both rollouts draft for requests with log-probs (vllm 0004); the penalty warning still shows beside it
    assert found([f"{R}calculate_log_probs=True"]) == found([f"{R}calculate_log_probs=True", f"{R}mode=async"]) == []
    assert found([f"+{R}repetition_penalty=1.05", f"{R}calculate_log_probs=True"]) == [warn]
    # without a drafter neither matters
    base["SAM_ENABLE"] = "False"
    assert found([f"+{R}repetition_penalty=1.05", f"{R}calculate_log_probs=True"]) == []


def test_sam_cost_table_file_checked(tmp_path: Path):
    """``sam_config.cost_table`` (SAM_COST_TABLE): a table that loads and reaches k is clean; a missing file, a file
    that is no cost table, a file of two shapes without @SHAPE and a table measuring shorter drafts than k are one
    error line each; without SAM the key is not read."""
    from qwen3_rl.tools.launch.preflight import check_sam_cost_table

    sc = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config."
    h100 = REPO.parent / "shared" / "bench" / "verify_cost_h100.json"

    def lines(spec: str, k: str = "15", method: str = "sam") -> list[str]:
        return [f.line() for f in check_sam_cost_table({sc + "method": method, sc + "num_speculative_tokens": k,
                                                         sc + "sam_config.cost_table": spec})]

    assert lines(f"{h100}@qwen3-32b-tp8") == [] and lines("") == []
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [{"model": "s", "B": 1, "k": 0, "ctx": 8, "step_ms": 1.0}]}')
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"rows": [{"model": "s", "B": 1, "k": k, "ctx": 8, "step_ms": 1.0 + k} for k in (0, 3)]}))
    cases = [(str(tmp_path / "none.json"), "cannot read it"), (str(bad), "needs rows at k = 0 and at least one k > 0"),
             (str(h100), "name one as FILE@SHAPE"), (str(short), "measures k <= 3, below num_speculative_tokens = 15")]
    for spec, msg in cases:
        (line,) = lines(spec)
        assert line.startswith("error: [spec-decode] sam_config.cost_table: ") and msg in line and "\n" not in line
    assert lines(str(tmp_path / "none.json"), method="ngram") == []
    # through the real 235B script: the switch sets the key, preflight reads the file back (and the switch's rule)
    from qwen3_rl.tools.launch.preflight import run_preflight

    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "SAM_ENABLE": "True",
            "SAM_ADAPTIVE_K": "True"}

    def found(env: dict[str, str], extra: list[str] = ()) -> list[str]:
        got = run_preflight(str(MOE_SCRIPT), node_checks=False, env={**base, **env}, extra_args=list(extra),
                            npu_env=None)
        return [f.line() for f in got if f.check in ("spec-decode", "feature")]

    assert found({"SAM_COST_TABLE": f"{h100}@qwen3-30b-a3b"}) == []
    (line,) = found({"SAM_COST_TABLE": str(tmp_path / "none.json")})
    assert line.startswith("error: [spec-decode] sam_config.cost_table: cost table ") and "cannot read it" in line
    # a hand-written key with adaptive k off: the switch's rule, read back from the keys
    (line,) = found({"SAM_ADAPTIVE_K": "False"}, [f"+{sc}sam_config.cost_table={h100}@qwen3-30b-a3b"])
    assert line.startswith(f"error: [feature] SAM_COST_TABLE={h100}@qwen3-30b-a3b requires SAM_ENABLE=True and "
                           "SAM_ADAPTIVE_K=True (got SAM_ENABLE=True, SAM_ADAPTIVE_K=False)")


def test_server_mode_needs_raw_chat_and_whole_worker_pieces():
    """rollout.mode=async: data.return_raw_chat must be on, and prompts x n must split evenly over the agent-loop
    workers; nothing is checked in sync mode (positive control: the same values pass there)."""
    from qwen3_rl.tools.launch.preflight import check_server_mode

    base = {"data.train_batch_size": "16", "actor_rollout_ref.rollout.n": "8"}
    assert check_server_mode({**base, "actor_rollout_ref.rollout.mode": "sync"}) == []
    assert check_server_mode(base) == []  # verl's default mode is sync
    bad = check_server_mode({**base, "actor_rollout_ref.rollout.mode": "async",
                             "actor_rollout_ref.rollout.agent.num_workers": "3"})
    assert [f.check for f in bad] == ["server-mode", "server-mode"]
    assert "data.return_raw_chat=True" in bad[0].message and "single_turn_agent_loop.py:38" in bad[0].message
    assert "128 rows" in bad[1].message and "num_workers=3" in bad[1].message
    good = {**base, "actor_rollout_ref.rollout.mode": "async", "data.return_raw_chat": "True",
            "actor_rollout_ref.rollout.agent.num_workers": "8"}
    assert check_server_mode(good) == []
    # ROLLOUT_MODE=async on a cluster setup: the registry's settings pass both checks
    env = {**os.environ, "ROLLOUT_MODE": "async", "SERVER_ROUTING": "True"}
    out = subprocess.run(["python3", "-m", "qwen3_rl", "features", "overrides", "--setup",
                          "train_grpo_qwen3_235b_128die_true_weight.sh"], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[3], timeout=60)
    assert out.returncode == 0, out.stderr
    keys = dict(kv.split("=", 1) for kv in out.stdout.split("\0") if "=" in kv)
    assert keys["actor_rollout_ref.rollout.mode"] == "async" and keys["data.return_raw_chat"] == "True"
    assert keys["actor_rollout_ref.rollout.agent.num_workers"] == "8"
    assert keys["+qwen3_rl.server_routing.enable"] == "True" and keys["+qwen3_rl.server_auth.enable"] == "True"


def test_fully_async_pools_and_stream():
    """The fully-async trainer: the trainer's and the rollout's pools together fill the launcher's world; one
    dataloader batch (require_batches x mini-batch) per update, the mini-batch divides over the trainer's ranks."""
    from qwen3_rl.tools.launch.preflight import check_world, is_fully_async

    vals = {"trainer.nnodes": "1", "trainer.n_gpus_per_node": "1", "rollout.nnodes": "1",
            "rollout.n_gpus_per_node": "1", "async_training.staleness_threshold": "0.5",
            "async_training.require_batches": "2", "data.train_batch_size": "16", "actor_rollout_ref.rollout.n": "8",
            "actor_rollout_ref.actor.ppo_mini_batch_size": "8"}
    assert is_fully_async(vals) and not is_fully_async({"trainer.nnodes": "1"})
    assert check_world(vals, 1, 2) == [] and check_batches(vals) == [] and check_layout(vals, None) == []
    assert [f.message for f in check_world(vals, 1, 4)] == [
        "train script wants 1 nodes x 2 NPUs (trainer 1 + rollout 1) = 2, the launcher has 1 x 4 = 4"]
    assert [f.message for f in check_batches(dict(vals, **{"data.train_batch_size": "8"}))] == [
        "fully async: data.train_batch_size 8 must be async_training.require_batches 2 x ppo_mini_batch_size 8 = 16"]
    # the sync rules on the same sizes (positive control): the world is the trainer's 1 + the rollout's 1 there
    sync = {k: v for k, v in vals.items() if not k.startswith(("rollout.", "async_training."))}
    assert check_world(sync, 1, 2)


FA_30B = REPO / "internal" / "train_grpo_qwen3_30b_a3b_32die_fully_async.sh"


def _log_prob_errors(extra: list[str], **env: str) -> list[str]:
    """[rollout-log-probs] lines of the real 30B fully-async script's final command (features of ``env``, extra
    Hydra overrides)."""
    from qwen3_rl.tools.launch.preflight import run_preflight

    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env}
    found = run_preflight(str(FA_30B), node_checks=False, env=base, extra_args=extra, npu_env=None)
    assert not [f for f in found if f.check in ("script", "feature")], found
    return [f.line() for f in found if f.check == "rollout-log-probs"]


def test_rollout_log_probs_need_the_behaviour_policys_sampling():
    """The fully-async default (ROLLOUT_CORRECTION=token) and USE_ROLLOUT_LOG_PROBS use the rollout's raw log-probs:
    temperature, top-p and top-k each are refused on one line; with neither, any sampling passes."""
    assert _log_prob_errors([]) == []
    t = R_ + "temperature=0.7"
    assert _log_prob_errors([t]) == [
        "error: [rollout-log-probs] rollout.temperature=0.7 with algorithm.rollout_correction.rollout_is=token: "
        "vLLM's log-probs are taken before temperature / top-p / top-k, so they are not the sampling policy's (set "
        "temperature 1, top_p 1, top_k -1, or turn USE_ROLLOUT_LOG_PROBS / ROLLOUT_CORRECTION off)"]
    bypass = {"USE_ROLLOUT_LOG_PROBS": "True", "ROLLOUT_CORRECTION": "off"}
    (line,) = _log_prob_errors([R_ + "top_p=0.9", R_ + "top_k=20"], **bypass)
    assert line.startswith("error: [rollout-log-probs] rollout.top_p=0.9, rollout.top_k=20 with "
                           "async_training.use_rollout_log_probs=True: "), line
    assert _log_prob_errors([t], ROLLOUT_CORRECTION="off") == []  # the trainer's log-probs only


R_ = "actor_rollout_ref.rollout."


FA_TINY = REPO / "internal" / "train_grpo_tiny_cpu_fully_async.sh"
_SIZE_CHECKS = ("script", "batch", "feature", "rollout-log-probs")


def _fa_tiny_errors(pin_set: str, extra: list[str] | None = None, **env: str) -> list[str]:
    """Error lines of the batch / feature / rollout-log-prob checks on the tiny fully-async script's final command on
    ``pin_set`` (the node, file and environment checks are other tests')."""
    from qwen3_rl.tools.launch.preflight import run_preflight

    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PIN_SET": pin_set, **env}
    found = run_preflight(str(FA_TINY), node_checks=False, env=base, extra_args=extra, npu_env=None)
    return [f.line() for f in found if f.check in _SIZE_CHECKS and f.level == "error"]


def test_current_fully_async_reads_verl091_keys():
    """On the current set the fully-async command is verl 0.9.1's own (data.train_batch_size 0, gen_batch_size 1,
    the batch of an update = require_batches x mini-batch; USE_ROLLOUT_LOG_PROBS = rollout_correction.bypass_mode):
    clean as shipped; a train_batch_size other than 0, a mini-batch that does not divide, and the old log-probs
    together with the rollout correction are each still one error; the seed set's rules unchanged."""
    from qwen3_rl.tools.launch.preflight import check_feature_rules

    assert _fa_tiny_errors("current") == []
    assert _fa_tiny_errors("current", ["data.train_batch_size=16"]) == [
        "error: [batch] fully async on pin set current: data.train_batch_size 16 must be 0 (verl's rollouter asserts "
        "it, fully_async_rollouter.py:351; an update takes async_training.require_batches x ppo_mini_batch_size "
        "prompts)"]
    assert _fa_tiny_errors("current", ["data.gen_batch_size=4"]) == [
        "error: [batch] fully async on pin set current: data.gen_batch_size 4 must be 1 (verl's rollouter asserts it, "
        "fully_async_rollouter.py:352)"]
    # 3 prompts x 8 samples over the trainer's 2 ranks is fine; 3 prompts x n 1 = 3 rows over 2 ranks is not
    assert _fa_tiny_errors("current", ["actor_rollout_ref.actor.ppo_mini_batch_size=3", "trainer.n_gpus_per_node=2",
                                       "actor_rollout_ref.rollout.n=1"], NPUS_PER_NODE="3") == [
        "error: [batch] ppo_mini_batch_size 3 x n 1 = 3 does not divide over the actor's 2 data-parallel ranks",
        "error: [batch] train_batch_size 3 x n 1 = 3 does not split over the 2 ranks the rollout batch is dispatched "
        "to"]
    (line,) = _fa_tiny_errors("current", ["algorithm.rollout_correction.bypass_mode=True"])
    assert line.startswith("error: [feature] USE_ROLLOUT_LOG_PROBS=True excludes ROLLOUT_CORRECTION not off"), line
    assert _fa_tiny_errors("current", ["algorithm.rollout_correction.bypass_mode=True",
                                       "algorithm.rollout_correction.rollout_is=null"]) == []
    (line,) = _fa_tiny_errors("current", ["algorithm.rollout_correction.bypass_mode=True",
                                          "algorithm.rollout_correction.rollout_is=null", R_ + "temperature=0.7"])
    assert line.startswith("error: [rollout-log-probs] rollout.temperature=0.7 with "
                           "algorithm.rollout_correction.bypass_mode=True: "), line
    # the current command read with the seed set's keys: calculate_log_probs=True (set for the correction) reads as
    # USE_ROLLOUT_LOG_PROBS=True there, and train_batch_size 0 fails the seed fully-async batch rule
    current_cmd = {"algorithm.rollout_correction.rollout_is": "token", R_ + "calculate_log_probs": "True",
                   "algorithm.rollout_correction.bypass_mode": "False"}
    assert [f.message[:45] for f in check_feature_rules(current_cmd, FA_TINY.name)] == [
        "USE_ROLLOUT_LOG_PROBS=True excludes ROLLOUT_C"]
    assert check_feature_rules(current_cmd, FA_TINY.name, "current") == []
    # the seed set: its own fully-async batch rule and the shipped command, as before
    assert _fa_tiny_errors("seed") == []
    assert _fa_tiny_errors("seed", ["data.train_batch_size=0"]) == [
        "error: [batch] fully async: data.train_batch_size 0 must be async_training.require_batches 1 x "
        "ppo_mini_batch_size 16 = 16",
        "error: [batch] data.train_batch_size 0 is not a multiple of ppo_mini_batch_size 16"]
