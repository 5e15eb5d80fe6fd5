"""The feature registry (features.toml, qwen3_rl/tools/features.py): coverage of patches, switches and paths; the
train scripts' setups and groups; one-line errors for bad values; every requires / excludes rule reported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_rl.tools.features import FeatureError, load_registry, setup_overrides
from qwen3_rl.tools.launch import TrainScriptError, parse_train_script

REPO = Path(__file__).resolve().parents[2]
INTERNAL = REPO / "internal"
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
REG = load_registry()
SCRIPTS = sorted(p.name for p in INTERNAL.glob("train_*.sh"))
SHELL_FILES = sorted(INTERNAL.glob("*.sh")) + sorted(INTERNAL.glob("lib/*.sh"))
DEFAULT_RE = re.compile(r"^([A-Z_0-9]+)=\$\{\1:-(.*)\}$", re.M)
# sizes the CLI needs, as train_common.sh passes them (a 235B-like MoE setup and a dense one)
MOE_CTX = ["VLLM_DP=32", "ROLLOUT_TP=4", "TRAIN_BATCH_SIZE=512", "PPO_MINI_BATCH_SIZE=512", "DIST_CKPT_PATH=/ckpt"]
DENSE_CTX = ["VLLM_DP=1", "ROLLOUT_TP=8", "TRAIN_BATCH_SIZE=128", "PPO_MINI_BATCH_SIZE=128", "DIST_CKPT_PATH=/ckpt"]
MOE = "train_grpo_qwen3_235b_128die_true_weight.sh"
DENSE = "train_grpo_qwen3_32b_32die_true_weight.sh"
MBRIDGE = "train_grpo_qwen3_30b_a3b_32die.sh"


def test_every_patch_is_a_feature_or_a_listed_bug_fix() -> None:
    patches = {f"{p.parent.name}/{p.name}" for p in (REPO / "patches").glob("*/*.patch")}
    claimed = {p for f in REG.features.values() for p in f.patches}
    assert claimed <= patches, f"features name missing patches: {sorted(claimed - patches)}"
    assert set(REG.non_feature_patches) <= patches, sorted(set(REG.non_feature_patches) - patches)
    # a non-feature patch is a pure bug fix, and says why it has no switch
    for name, why in REG.non_feature_patches.items():
        assert "-bugfix-" in name and why.strip(), name
        assert name not in claimed, f"{name} is both a feature's patch and a non-feature patch"
    uncovered = patches - claimed - set(REG.non_feature_patches)
    assert not uncovered, f"patches in no features.toml entry nor in [non_feature_patches]: {sorted(uncovered)}"
    # every feature patch (not bugfix) belongs to some feature
    assert all(p in claimed for p in patches if "-feature-" in p)


def test_declared_paths_exist_and_every_entry_has_a_test() -> None:
    for f in REG.features.values():
        assert f.tests, f"{f.env}: no test"
        for rel in (*f.modules, *f.tests, f.doc):
            assert rel and (REPO / rel).is_file(), f"{f.env}: {rel!r} does not exist"
        assert f.name and f.setups and f.sets, f"{f.env}: no name, setups or keys"


def test_groups_match_the_train_scripts() -> None:
    """The registry's setups are the train scripts; dense / moe, dapo and the weight-source groups agree with
    what each script calls (train_add_base_overrides LAYOUT WEIGHTS, its entry module)."""
    assert REG.setups() == SCRIPTS
    for name in SCRIPTS:
        text = (INTERNAL / name).read_text()
        (layout, weights), = re.findall(r"^train_add_base_overrides (\w+) (\w+)$", text, re.M)
        groups = REG.groups_of(name)
        assert layout in groups and {"dense", "moe"} - {layout} & set(groups) == set(), (name, groups)
        assert ("dapo" in groups) == ("qwen3_rl.trainer.dapo" in text), name
        assert ("tiny" in groups) == ("tiny_cpu" in name), name
        assert ("moe_cluster" in groups) == (layout == "moe" and "tiny" not in groups), name
        for w in ("hf_or_dist_ckpt", "dist_ckpt_or_mbridge"):
            assert (w in groups) == (weights == w), (name, w)
        assert re.search(r"^train_add_feature_overrides$", text, re.M), name


def test_every_switch_the_scripts_read_is_declared_once() -> None:
    """A shell default of True/False is a switch: it must be a registry entry, and no registry switch keeps a
    shell default (one place). Every ${VAR} a shell file reads is its own variable, a registry switch's context
    or an environment the launcher sets."""
    shell_defaults = {var: (default, path.name) for path in SHELL_FILES
                      for var, default in DEFAULT_RE.findall(path.read_text())}
    for var, (default, where) in shell_defaults.items():
        assert var not in REG.features, f"{var} is a features.toml switch and still has a default in {where}"
        assert default.lower() not in ("true", "false"), f"{var} ({where}) looks like a switch: declare it"
    lib = (INTERNAL / "lib" / "train_common.sh").read_text()
    # nothing in the shell reads a switch any more (the registry is the only place that interprets them)
    for path in SHELL_FILES:
        used = set(re.findall(r"\$\{([A-Z_0-9]+)", path.read_text()))
        assert not used & set(REG.features), (path.name, sorted(used & set(REG.features)))
    # the context the CLI gets is what the registry declares
    assert set(re.findall(r'--context "([A-Z_]+)=', lib)) == {n for n, c in REG.context.items() if not c.product}


def test_defaults_and_values_validated_the_same_way() -> None:
    for f in REG.features.values():
        for value in (f.default, *f.default_for.values()):
            if value:
                assert f.parse(value) == value, f.env
        if f.type == "bool":
            for bad in ("true", "1", "yes", "TRUE", " True"):
                with pytest.raises(FeatureError) as err:
                    f.parse(bad)
                assert str(err.value) == f"{f.env}={bad!r}: expected one of True, False"
    assert REG.features["MOE_ZERO_MEMORY"].allowed == ("disable", "level0", "level1")
    with pytest.raises(FeatureError, match=r"^SAM_K='0': expected an integer >= 1$"):
        REG.features["SAM_K"].parse("0")
    with pytest.raises(FeatureError, match=r"^GRAPH_CAPTURE_SIZES='8,16': expected a Hydra list like \[8,16,32\]$"):
        REG.features["GRAPH_CAPTURE_SIZES"].parse("8,16")
    assert REG.features["MOE_PREFILL_CHUNK_SIZE"].parse("0042") == "42"


def _bad_value(f) -> str:
    return {"bool": "yes", "enum": "on", "int": "x1", "list": "8,16", "float": "fast"}[f.type]


@pytest.mark.parametrize("setup", [MOE, DENSE])
def test_bad_value_of_every_switch_is_one_line(setup: str) -> None:
    ctx = MOE_CTX if setup == MOE else DENSE_CTX
    for f in REG.features.values():
        if f.type == "str" or not REG.applies(f, setup):
            continue
        bad = _bad_value(f)
        with pytest.raises(FeatureError) as err:
            setup_overrides(setup, {f.env: bad}, ctx, REG)
        assert str(err.value) == f"{f.env}={bad!r}: {f.expected()}"
    # a switch of another setup is ignored there (noted), not validated
    notes: list[str] = []
    if setup == DENSE:
        assert setup_overrides(setup, {"ROLLOUT_EPLB": "maybe"}, ctx, REG, notes) == setup_overrides(setup, {}, ctx, REG)
        assert notes == [f"note: ROLLOUT_EPLB=maybe does not apply to {DENSE} (setups: moe_cluster); ignored"]


def test_cli_and_train_script_print_one_error_line() -> None:
    env = dict(BASE_ENV, PYTHONPATH=str(REPO), SAM_ENABLE="yes")
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "features", "overrides", "--setup", MOE,
                           *(a for c in MOE_CTX for a in ("--context", c))], env=env, capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", "error: SAM_ENABLE='yes': expected one of True, False\n")
    ok = subprocess.run([sys.executable, "-m", "qwen3_rl", "features", "overrides", "--setup", MOE,
                         *(a for c in MOE_CTX for a in ("--context", c))], env=dict(env, SAM_ENABLE="True"),
                        capture_output=True)
    assert ok.returncode == 0 and ok.stdout.endswith(b"\0")
    assert b"+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method=sam\0" in ok.stdout
    for script, var, bad in ((MOE, "SAM_ENABLE", "yes"), (DENSE, "OFFLOAD", "1"), (MOE, "DATA_REBALANCE", "true"),
                             ("train_dapo_tiny_cpu.sh", "MOE_ZERO_MEMORY", "level2")):
        f = REG.features[var]
        with pytest.raises(TrainScriptError) as err:
            parse_train_script(INTERNAL / script, env={**BASE_ENV, var: bad})
        assert str(err.value).endswith(f"failed in print mode: error: {var}={bad!r}: {f.expected()}")
        # the script's stderr is that one line and nothing else
        proc = subprocess.run(["bash", str(INTERNAL / script)], env={**BASE_ENV, var: bad, "QWEN3_RL_PRINT_COMMAND": "1"},
                              capture_output=True, text=True)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {var}={bad!r}: {f.expected()}\n")


# every requires / excludes rule of the registry, triggered: (setup, env, context, message)
RULE_CASES = [
    (MOE, {"USE_CURRENT_LOG_PROB_AS_OLD": "True"}, [*MOE_CTX, "PPO_MINI_BATCH_SIZE=128"],
     "USE_CURRENT_LOG_PROB_AS_OLD=True requires PPO_MINI_BATCH_SIZE == TRAIN_BATCH_SIZE (got PPO_MINI_BATCH_SIZE=128, "
     "TRAIN_BATCH_SIZE=512): one mini-batch per step, else later mini-batches are off-policy; the trainer refuses it "
     "(docs/old_log_prob.md)"),
    (MBRIDGE, {"USE_MBRIDGE": "True", "MOE_ALLTOALLV": "True"}, MOE_CTX,
     "USE_MBRIDGE=True excludes MOE_ALLTOALLV=True: the moe_alltoallv weight-sync hook converts only verl's own weight "
     "export, not mbridge's"),
    (MBRIDGE, {"USE_MBRIDGE": "True", "MOE_ALLTOALL_OVERLAP": "True"}, MOE_CTX,
     "USE_MBRIDGE=True excludes MOE_ALLTOALL_OVERLAP=True: the grouped_mlp_weights weight-sync hook converts only "
     "verl's own weight export, not mbridge's"),
    (MOE, {"MOE_ZERO_MEMORY": "level1"}, MOE_CTX,
     "MOE_ZERO_MEMORY=level1 requires MOE_ALLTOALL_OVERLAP=True (got MOE_ALLTOALL_OVERLAP=False): MindSpeed applies "
     "moe_zero_memory only with moe_alltoall_overlap_comm (mindspeed/features_manager/moe/moe_zero_memory.py:33,37)"),
    (MOE, {"MOE_ALLTOALLV": "True", "ROLLOUT_ENABLE_EP": "False"}, MOE_CTX,
     "MOE_ALLTOALLV=True requires ROLLOUT_ENABLE_EP=True (got ROLLOUT_ENABLE_EP=False): the all-to-allv sends each "
     "rank the experts of vLLM's expert-parallel placement"),
    (MOE, {"MOE_ALLTOALLV": "True", "ROLLOUT_EPLB": "True"}, MOE_CTX,
     "MOE_ALLTOALLV=True excludes ROLLOUT_EPLB=True: EPLB moves experts off vLLM's default placement"),
    (DENSE, {"ROLLOUT_REBALANCE": "True"}, DENSE_CTX,
     "ROLLOUT_REBALANCE=True requires VLLM_DP > 1 (got VLLM_DP=1): nothing to move requests between; the engine "
     "hook refuses vLLM DP 1 at start-up"),
    (MOE, {"SAM_GROUP": "True"}, MOE_CTX,
     "SAM_GROUP=True requires SAM_ENABLE=True (got SAM_ENABLE=False): group mode is a mode of the SAM drafter"),
    (MOE, {"SAM_ENABLE": "True", "SAM_GROUP_EXCHANGE": "True"}, MOE_CTX,
     "SAM_GROUP_EXCHANGE=True requires SAM_ENABLE=True and SAM_GROUP=True (got SAM_ENABLE=True, SAM_GROUP=False): "
     "the exchanged tokens feed the group automata of the SAM drafter"),
    (DENSE, {"SAM_ENABLE": "True", "SAM_GROUP": "True", "SAM_GROUP_EXCHANGE": "True"}, DENSE_CTX,
     "SAM_GROUP_EXCHANGE=True requires VLLM_DP > 1 (got VLLM_DP=1): with vLLM DP 1 every engine already holds all "
     "the siblings it serves"),
    (MOE, {"SAM_ENABLE": "True", "SAM_HISTORY": "4"}, MOE_CTX,
     "SAM_GROUP=False excludes SAM_HISTORY > 0: the history seeds the group automata of the SAM drafter"),
    (MOE, {"SAM_ADAPTIVE_K": "True"}, MOE_CTX,
     "SAM_ADAPTIVE_K=True requires SAM_ENABLE=True (got SAM_ENABLE=False): the draft length is chosen by the SAM "
     "drafter"),
    (MOE, {"SAM_ENABLE": "True", "SAM_ADAPTIVE_K": "True", "SAM_K_MAX": "16"}, MOE_CTX,
     "SAM_ADAPTIVE_K=True excludes SAM_K_MAX > 15: vLLM-Ascend's attention takes k + 1 <= 16 query tokens per "
     "sequence"),
    # a rule on any non-empty value (when = ["!"])
    (DENSE, {"SAM_ENABLE": "True", "SAM_COST_TABLE": "/t/cost.json@qwen3-32b-tp8"}, DENSE_CTX,
     "SAM_COST_TABLE=/t/cost.json@qwen3-32b-tp8 requires SAM_ENABLE=True and SAM_ADAPTIVE_K=True (got SAM_ENABLE=True, "
     "SAM_ADAPTIVE_K=False): the table prices the draft length that SAM_ADAPTIVE_K chooses"),
]
# data rebalance by group key
RULE_CASES += [
    (MOE, {"DATA_REBALANCE": "False", "DATA_REBALANCE_BY_KEY": "True"}, MOE_CTX,
     "DATA_REBALANCE_BY_KEY=True requires DATA_REBALANCE=True (got DATA_REBALANCE=False): it is a placement of data "
     "rebalance"),
]
# server mode (ROLLOUT_MODE=async)
RULE_CASES += [
    (MOE, {"ROLLOUT_MODE": "async", "DATA_REBALANCE": "True"}, MOE_CTX,
     "ROLLOUT_MODE=async excludes DATA_REBALANCE=True: the agent loop sends each request to a server by load, not a "
     "batch piece to a DP rank (qwen3_rl/rollout/data_rebalance.py refuses it); SERVER_ROUTING keeps a prompt's samples "
     "together instead"),
    (MOE, {"ROLLOUT_MODE": "async", "MOE_ALLTOALLV": "True"}, MOE_CTX,
     "ROLLOUT_MODE=async excludes MOE_ALLTOALLV=True (pin set seed): its expert placement is the sync rollout's "
     "(vLLM DP rank = RANK // TP under the external launcher); server mode's DP ranks come from verl's server "
     "(vllm_async_server.py:258-268) and are not checked against it"),
    (MOE, {"ROLLOUT_MODE": "async", "SAM_ENABLE": "True", "SAM_GROUP": "True", "SAM_GROUP_EXCHANGE": "True"}, MOE_CTX,
     "ROLLOUT_MODE=async excludes SAM_GROUP_EXCHANGE=True: the exchange runs between the vLLM DP ranks of the sync "
     "rollout's batch pieces; in server mode SERVER_ROUTING puts a prompt's samples on one engine instead"),
    (MOE, {"ROLLOUT_MODE": "async", "ROLLOUT_ENABLE_EP": "False"}, MOE_CTX,
     "ROLLOUT_MODE=async excludes VLLM_DP > 1 and ROLLOUT_ENABLE_EP=False: verl's server starts vLLM's DP engines "
     "only with expert parallel (vllm_async_server.py:251: expert_parallel_size > 1)"),
    (DENSE, {"SERVER_ROUTING": "True"}, DENSE_CTX,
     "SERVER_ROUTING=True requires ROLLOUT_MODE=async (got ROLLOUT_MODE=sync): routing chooses among the vLLM servers "
     "of verl's agent loop; the sync rollout has none"),
]
# the fully-async setups (30B: rollout DP 8 over 16 dies): off-policy correction and partial rollout
FA = "train_grpo_qwen3_30b_a3b_32die_fully_async.sh"
FA_CTX = ["VLLM_DP=8", "ROLLOUT_TP=2", "TRAIN_BATCH_SIZE=32", "PPO_MINI_BATCH_SIZE=32", "DIST_CKPT_PATH=/ckpt",
          "ROLLOUT_PROCS_PER_NODE=8"]
RULE_CASES += [
    (FA, {"USE_ROLLOUT_LOG_PROBS": "True"}, FA_CTX,
     "USE_ROLLOUT_LOG_PROBS=True excludes ROLLOUT_CORRECTION not off: the correction weighs by pi_old / pi_rollout, "
     "which is 1 when the old log-probs are the rollout's (the PPO ratio against the rollout policy is then the "
     "correction): ROLLOUT_CORRECTION=off with it"),
    (FA, {"ROLLOUT_REBALANCE": "True"}, FA_CTX,
     "PARTIAL_ROLLOUT=True excludes ROLLOUT_REBALANCE=True and ROLLOUT_MODE=async: a request rebalance moved to another vLLM DP engine is no "
     "longer in its origin's client entry, through which the pause's abort goes (vllm core_client.py:1248-1267 after "
     "qwen3_rl/rollout/vllm_engine_hook.py release_request): it would run on through the weight sync; "
     "PARTIAL_ROLLOUT=False (the pause waits for running requests) or ROLLOUT_REBALANCE=False"),
]
# rules whose switches set no key while the rule is broken (SAM_ENABLE off, sync mode): preflight has nothing to read
NO_KEY_CASES = ({"SAM_GROUP": "True"}, {"SAM_ADAPTIVE_K": "True"}, {"SERVER_ROUTING": "True"},
                {"DATA_REBALANCE": "False", "DATA_REBALANCE_BY_KEY": "True"})


def test_every_rule_is_reported() -> None:
    """The train script's CLI stops at each broken rule with its line; preflight finds the same rule in a command
    carrying the keys (hand-written), except SAM_GROUP and SAM_ADAPTIVE_K without SAM_ENABLE and
    DATA_REBALANCE_BY_KEY without DATA_REBALANCE, which set no key to read back."""
    from qwen3_rl.tools.features import check_command

    for setup, env, ctx, msg in RULE_CASES:
        with pytest.raises(FeatureError) as err:
            setup_overrides(setup, env, ctx, REG)
        assert str(err.value) == msg
        keys = _keys_for(setup, env, ctx)
        assert check_command(keys, setup, REG) == ([] if env in NO_KEY_CASES else [msg]), msg
    rules = [(f.env, r.kind) for f in REG.features.values() for r in (*f.requires, *f.excludes)]
    assert len(RULE_CASES) == len(rules), "a rule without a case (or a case without a rule)"
    assert {(m.split("=")[0], m.split(" ")[1]) for *_, m in RULE_CASES} == set(rules)
    # satisfied rules pass; rollout rebalance in server mode: the settings go to the servers' engine cores
    srv = setup_overrides(MOE, {"ROLLOUT_MODE": "async", "ROLLOUT_REBALANCE": "True"}, MOE_CTX, REG)
    assert "+qwen3_rl.rollout_rebalance.enable=True" in srv and "actor_rollout_ref.rollout.data_parallel_size=32" in srv
    assert setup_overrides(MOE, {"MOE_ZERO_MEMORY": "level0", "MOE_ALLTOALL_OVERLAP": "True"}, MOE_CTX, REG)
    assert setup_overrides(MOE, {"SAM_ENABLE": "True", "SAM_GROUP": "True", "SAM_GROUP_EXCHANGE": "True"}, MOE_CTX,
                           REG)
    # the fully-async defaults: token-level correction on the rollout's log-probs; either pair member alone is fine
    fa = setup_overrides(FA, {}, FA_CTX, REG)
    assert {"algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=True",
            "async_training.use_rollout_log_probs=False", "async_training.partial_rollout=True"} <= set(fa)
    bypass = setup_overrides(FA, {"USE_ROLLOUT_LOG_PROBS": "True", "ROLLOUT_CORRECTION": "off"}, FA_CTX, REG)
    assert {"algorithm.rollout_correction.rollout_is=null", "actor_rollout_ref.rollout.calculate_log_probs=True",
            "async_training.use_rollout_log_probs=True"} <= set(bypass)
    plain = setup_overrides(FA, {"ROLLOUT_CORRECTION": "off"}, FA_CTX, REG)
    assert not any(o.startswith("actor_rollout_ref.rollout.calculate_log_probs=") for o in plain)
    for env in ({"ROLLOUT_CORRECTION": "off"}, {"USE_ROLLOUT_LOG_PROBS": "True", "ROLLOUT_CORRECTION": "off"}):
        assert check_command(_keys_for(FA, env, FA_CTX), FA, REG) == []  # read back as set, not as the default
    assert setup_overrides(FA, {"ROLLOUT_REBALANCE": "True", "PARTIAL_ROLLOUT": "False"}, FA_CTX, REG)
    table = {"SAM_ENABLE": "True", "SAM_ADAPTIVE_K": "True", "SAM_COST_TABLE": "/t/cost.json"}
    assert ("+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.sam_config.cost_table=/t/cost.json"
            in setup_overrides(DENSE, table, DENSE_CTX, REG))
    assert not any("cost_table" in o for o in setup_overrides(DENSE, {**table, "SAM_COST_TABLE": ""}, DENSE_CTX, REG))


def _keys_for(setup: str, env: dict[str, str], ctx: list[str]) -> dict[str, str]:
    """The override map a command would carry with the rule broken: the valid keys plus the feature keys of
    ``env`` rendered without the rule check (as a hand-written Hydra argument would add them)."""
    from qwen3_rl.tools.features import parse_context, render, resolve

    context = parse_context(REG, ctx)
    values = resolve(REG, setup, env, context)
    out = {c.key: context[n] for n, c in REG.context.items() if c.key and n in context}
    for o in render(REG, values):
        k, _, v = o.partition("=")
        out[k.lstrip("+")] = v
    return out


def test_setup_overrides_follow_the_registry() -> None:
    """The CLI's overrides for the default environment are exactly the keys each applicable switch sets."""
    got = setup_overrides(DENSE, {}, DENSE_CTX, REG)
    assert "actor_rollout_ref.rollout.npu_expandable_segments=True" in got
    assert not any("moe_alltoall_overlap_comm" in o or "enable_expert_parallel" in o for o in got)  # MoE only
    assert "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/ckpt" in got  # USE_DIST_CKPT's keys
    tiny = setup_overrides("train_grpo_tiny_cpu.sh", {}, ["VLLM_DP=1", "ROLLOUT_TP=1", "TRAIN_BATCH_SIZE=8",
                                                          "PPO_MINI_BATCH_SIZE=8"], REG)
    assert {"actor_rollout_ref.actor.megatron.param_offload=False", "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.cudagraph_capture_sizes=[8,16,32]"} <= set(tiny)
    eplb = setup_overrides(MOE, {"ROLLOUT_EPLB": "True"}, MOE_CTX, REG)
    assert ("+actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config.num_redundant_experts=128"
            in eplb)  # default: vLLM DP x TP
    with pytest.raises(FeatureError, match="--setup 'nope.sh': not a setup of features.toml"):
        setup_overrides("nope.sh", {}, [], REG)
    with pytest.raises(FeatureError, match=r"^VLLM_DP='x': expected a non-negative integer$"):
        setup_overrides(MOE, {}, ["VLLM_DP=x"], REG)


def test_registry_errors(tmp_path: Path) -> None:
    text = (REPO / "features.toml").read_text()
    bad = tmp_path / "f.toml"
    bad.write_text(text.replace('default = "disable"', 'default = "off"'))
    with pytest.raises(FeatureError, match=r"MOE_ZERO_MEMORY='off': expected one of disable, level0, level1"):
        load_registry(bad)
    bad.write_text(text.replace('when = { SAM_ENABLE = "True", SAM_BS_THRESHOLD = "!0" }',
                                'when = { SAM_ENABLED = "True" }'))
    with pytest.raises(FeatureError, match="feature.SAM_BS_THRESHOLD: unknown name 'SAM_ENABLED'"):
        load_registry(bad)


def test_generated_docs_are_current() -> None:
    """docs/features.md (switch table, feature index) and docs/setups.md (defaults per setup, flat commands) are
    what features.toml and the golden commands say."""
    from qwen3_rl.tools import readme

    assert readme.main(["--check"]) == 0
    text = (REPO / "docs" / "features.md").read_text()
    for f in REG.features.values():
        assert f"| `{f.env}` | {f.type} |" in text and f"| `{f.env}` | " in text.split("generated:feature-index")[1]
    # the deliberate fix: the all-to-all overlap is a switch of the MoE setups only
    (row,) = [line for line in text.splitlines() if line.startswith("| `MOE_ALLTOALL_OVERLAP` | bool")]
    assert row.split(" | ")[-2] == "moe"
    (row,) = [line for line in text.splitlines() if line.startswith("| `NPUGRAPH_EX` | bool")]
    assert "sam_config.pad_drafts" in row


def test_a_copied_train_script_names_its_setup(tmp_path: Path) -> None:
    """The setup is the script's file name; a copy under another name stops with a hint, and runs once it passes
    the setup it is based on to train_add_feature_overrides (same command as the original)."""
    import shutil

    (tmp_path / "lib").mkdir()
    for lib in (INTERNAL / "lib").glob("*.sh"):
        shutil.copy(lib, tmp_path / "lib" / lib.name)
    copy = tmp_path / "my_tiny.sh"
    copy.write_text((INTERNAL / "train_grpo_tiny_cpu.sh").read_text())
    env = {**BASE_ENV, "QWEN3_RL_HOME": str(REPO)}
    with pytest.raises(TrainScriptError) as err:
        parse_train_script(copy, env=env)
    assert str(err.value).endswith("a copied train script passes the setup it is based on: "
                                   "train_add_feature_overrides SETUP")
    copy.write_text(copy.read_text().replace("\ntrain_add_feature_overrides\n",
                                             "\ntrain_add_feature_overrides train_grpo_tiny_cpu.sh\n"))
    assert parse_train_script(copy, env=env).overrides == parse_train_script(
        INTERNAL / "train_grpo_tiny_cpu.sh", env=env).overrides


def test_every_feature_says_what_it_does_on_the_current_set() -> None:
    from qwen3_rl.tools.features import PIN_STATUSES

    missing = [f.env for f in REG.features.values() if f.current is None]
    assert missing == []
    assert {f.current.status for f in REG.features.values()} <= set(PIN_STATUSES)
    # the modes gone in verl 0.9.1 say so; what its upstream does itself names where
    assert REG.features["DATA_REBALANCE"].current.status == "dropped"
    assert "rollout.py:280-285" in REG.features["SAM_GROUP_EXCHANGE"].current.note
    assert REG.features["NPU_EXPANDABLE_SEGMENTS"].current.status == "upstream"
    assert "platform_npu.py" in REG.features["NPU_EXPANDABLE_SEGMENTS"].current.note
    # DAPO's group filter is verl 0.9.1's own key, switched by us there
    assert REG.features["FILTER_GROUPS"].current.status == "config"
    assert "replay_buffer.py" in REG.features["FILTER_GROUPS"].current.note


def test_current_set_stops_a_feature_it_cannot_run_with_one_line() -> None:
    # positive control: the seed set (no PIN_SET, or PIN_SET=seed) composes the same setups
    dense = setup_overrides(DENSE, {}, DENSE_CTX, REG)
    assert setup_overrides(DENSE, {"PIN_SET": "seed"}, DENSE_CTX, REG) == dense
    assert "actor_rollout_ref.actor.megatron.grad_offload=True" in dense and "actor_rollout_ref.rollout.mode=sync" in dense
    # the current set by default: the server switches through verl 0.9.1's rollout.custom and the replica class
    # registered by Ray's worker_process_setup_hook; no key of the seed set's verl seam
    default = setup_overrides(DENSE, {"PIN_SET": "current"}, DENSE_CTX, REG)
    assert {"+actor_rollout_ref.rollout.custom.qwen3_rl.server_auth.enable=True",
            "+actor_rollout_ref.rollout.custom.qwen3_rl.server_http.host=loopback",
            "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=qwen3_rl.rollout.verl_server_auth.register",
            } <= set(default), default
    assert not [o for o in default if o.lstrip("+").startswith("qwen3_rl.")], default
    # a switch that runs there but whose keys are still the seed set's verl seam stops it
    from dataclasses import replace

    api_key = REG.features["SERVER_API_KEY"]
    seam_only = replace(REG, features={**REG.features,
                                       "SERVER_API_KEY": replace(api_key, current=replace(api_key.current, sets=None))})
    with pytest.raises(FeatureError, match="^SERVER_API_KEY=True on pin set current: runs, but not in the train "):
        setup_overrides(DENSE, {"PIN_SET": "current"}, DENSE_CTX, seam_only)
    # with those off: verl 0.9.1's keys (OFFLOAD without grad_offload, async only), and no key of a pending /
    # upstream switch or of the seam (the dry run in verl 0.9.1's venv: tests/trainer/test_verl091_dry_run.py)
    env = {"PIN_SET": "current", "SERVER_API_KEY": "False", "SERVER_HTTP_HOST": "node"}
    notes: list[str] = []
    cur = setup_overrides(DENSE, env, DENSE_CTX, REG, notes)
    assert "actor_rollout_ref.rollout.mode=async" in cur and "actor_rollout_ref.actor.megatron.param_offload=True" in cur
    assert not [o for o in cur if "grad_offload" in o or "npu_expandable_segments" in o
                or o.lstrip("+").startswith("qwen3_rl.")], cur
    assert any(n.startswith("note: NPU_EXPANDABLE_SEGMENTS=True on pin set current: upstream: ") for n in notes)
    # a parameter of a switch that is off does not stop it; the switch itself does, with one line
    assert setup_overrides(DENSE, env | {"ROLLOUT_REBALANCE_INTERVAL_STEPS": "5"}, DENSE_CTX, REG) == cur
    with pytest.raises(FeatureError) as err:
        setup_overrides(DENSE, env | {"HDP_ENABLE": "True"}, DENSE_CTX, REG)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("HDP_ENABLE=True on pin set current: pending: ")
    with pytest.raises(FeatureError, match="^ROLLOUT_MODE=sync on pin set current: it takes only async: "):
        setup_overrides(DENSE, env | {"ROLLOUT_MODE": "sync"}, DENSE_CTX, REG)
    with pytest.raises(FeatureError, match="^PIN_SET='newest' is not a pin set"):
        setup_overrides(DENSE, {"PIN_SET": "newest"}, DENSE_CTX, REG)


def test_a_rule_limited_to_one_pin_set_holds_only_there(tmp_path: Path) -> None:
    """``pin_sets`` on a rule: ROLLOUT_MODE=async excludes MOE_ALLTOALLV on the seed set only (its seam's expert
    placement is the sync rollout's); on the current set, where server mode is the only mode, the recipe's mbridge
    bridge module takes it (verl's model.external_lib). An unknown set name in ``pin_sets`` is refused on load."""
    env = {"ROLLOUT_MODE": "async", "MOE_ALLTOALLV": "True"}
    with pytest.raises(FeatureError, match=r"^ROLLOUT_MODE=async excludes MOE_ALLTOALLV=True \(pin set seed\): "):
        setup_overrides(MOE, env, MOE_CTX, REG)
    cur = setup_overrides(MOE, {**env, "PIN_SET": "current"}, MOE_CTX, REG)
    assert {"actor_rollout_ref.model.external_lib=qwen3_rl.moe.alltoallv_verl091",
            "+actor_rollout_ref.qwen3_rl.moe_alltoallv.enable=True"} <= set(cur), cur
    # positive control: without the switch neither key is there
    assert not [o for o in setup_overrides(MOE, {"PIN_SET": "current"}, MOE_CTX, REG) if "alltoallv" in o]
    bad = tmp_path / "f.toml"
    bad.write_text((REPO / "features.toml").read_text().replace('pin_sets = ["seed"]', 'pin_sets = ["newest"]'))
    with pytest.raises(FeatureError, match=r"feature.ROLLOUT_MODE.excludes\[1\]: pin_sets \['newest'\]: expected "):
        load_registry(bad)


def test_current_off_value_is_not_in_use() -> None:
    from dataclasses import replace

    from qwen3_rl.tools.features import PinStatus, in_use_on_set

    f = replace(REG.features["SERVER_HTTP_HOST"], current=PinStatus("pending", "x", off="node"))
    assert not in_use_on_set(f, {"SERVER_HTTP_HOST": "node", "ROLLOUT_MODE": "async"}, {})
    assert in_use_on_set(f, {"SERVER_HTTP_HOST": "loopback", "ROLLOUT_MODE": "async"}, {})
    assert not in_use_on_set(f, {"SERVER_HTTP_HOST": "loopback", "ROLLOUT_MODE": "sync"}, {})  # no key emitted


def test_pin_set_problems_sort_errors_from_upstream_notes() -> None:
    from qwen3_rl.tools.features import in_use, pin_set_problems

    values = {"FILTER_GROUPS": "True", "DATA_REBALANCE": "True", "SAM_ENABLE": "False", "ROLLOUT_USE_TQDM": None,
              "NPU_EXPANDABLE_SEGMENTS": "True", "MOE_ZERO_MEMORY": "disable"}
    errors, notes = pin_set_problems(REG, values, "current")
    assert [e.split(" on ")[0] for e in errors] == ["DATA_REBALANCE=True"]
    # FILTER_GROUPS (config there) is neither: rendered under its key
    assert [n.split(" on ")[0] for n in notes] == ["NPU_EXPANDABLE_SEGMENTS=True"]
    assert pin_set_problems(REG, values, "seed") == ([], [])
    assert [in_use(v) for v in ("True", "False", "0", "", "disable", "level0", "3", None)] == [
        True, False, False, False, False, True, True, False]


def test_features_status_cli_lists_every_feature() -> None:
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "features", "status"], capture_output=True, text=True,
                          env=dict(BASE_ENV, PYTHONPATH=str(REPO)), check=True)
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    assert [r[0] for r in rows] == list(REG.features) and all(len(r) == 3 and r[2] for r in rows)


@pytest.mark.parametrize(("current", "message"), [
    ('{ status = "maybe", note = "x" }', "current.status must be one of runs, config, upstream, dropped, pending"),
    ('{ status = "runs" }', "current must be { status = ..., note = ... }"),
    ('{ status = "runs", note = "" }', "current.note must be one non-empty line"),
])
def test_bad_current_status_is_refused(tmp_path: Path, current: str, message: str) -> None:
    text = (REPO / "features.toml").read_text()
    # NPUGRAPH_EX's current entry: from its "current = {" to the end of its section (the entry is the section's last)
    start = text.index("current = {", text.index("[feature.NPUGRAPH_EX]"))
    end = text.index("\n[", start)
    bad = tmp_path / "f.toml"
    bad.write_text(text[:start] + f"current = {current}\n" + text[end:])
    assert text[start:end].startswith("current = { status = ") and "[feature." not in text[start:end]
    with pytest.raises(FeatureError, match=re.escape(f"feature.NPUGRAPH_EX: {message}")):
        load_registry(bad)
