"""Environment contract (``qwen3_rl/tools/launch/env_contract.py``): the five train scripts resolve clean with the
env files the launcher sources; the two env defects of the first cluster run (``PYTORCH_NPU_ALLOC_CONF=
expandable_segments:True``, ``VLLM_ASCEND_ENABLE_NZ`` left at vLLM-Ascend's default 1) are reported; every rule
fires on its breaking value; every cited upstream line holds its anchor in the pristine pinned tree; a user's
export that breaks a rule is one error line through the real preflight CLI and stops the launcher before
``ray start``. The current pin set's contract (section (e)): every citation against the pristine verl 0.9.1 /
vLLM 0.23.0 / vLLM-Ascend 0.23.0.post1 trees, every seed rule accounted for (holds / changed / gone), every
rule's breaking and fixing values, the shipped setups' launch environment, and ``PIN_SET=current`` through the CLI
and the launcher (the current lines cited where the seed set cites its own)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_launch import PY, make_cann, make_standin, make_stubs, run_launcher, stub_env
from test_launch import calls as stub_calls

from qwen3_rl.tools.launch import parse_train_script
from qwen3_rl.tools.launch.env_contract import (
    CURRENT_RULES,
    RULES,
    SEED_RULE_FATE,
    EngineContext,
    EnvResolveError,
    Rule,
    UpstreamRef,
    check_env,
    markdown_table,
    resolve_launch_env,
    rule,
)
from qwen3_rl.tools.pins import Pins, load_pins
from qwen3_rl.tools.upstream.download import fill_pristine

from conftest import PINS

REPO = Path(__file__).resolve().parents[3]
INTERNAL = REPO / "internal"
DATA = REPO / "tests" / "data"
ENV_235B = INTERNAL / "qwen3_235b_env.sh"
NPU_ENV = INTERNAL / "npu_env.sh"
SCRIPTS = sorted(p.name for p in INTERNAL.glob("train_*.sh"))
S235 = INTERNAL / "train_grpo_qwen3_235b_128die_true_weight.sh"
CAMEM_LINE = ("env-contract[camem-expandable-segments]: PYTORCH_NPU_ALLOC_CONF=expandable_segments:True is refused "
              "by vLLM-Ascend when sleep mode is on (vllm_ascend/device_allocator/camem.py:145-149)")
NZ_LINE = ("env-contract[nz-wake-up]: VLLM_ASCEND_ENABLE_NZ unset (default 1) is refused by vLLM-Ascend's "
           "NPUWorker.wake_up when sleep mode is on; set VLLM_ASCEND_ENABLE_NZ=0 (vllm_ascend/worker/worker.py:181-184)")
# the lines the two env files had before the fix (the NZ export did not exist; the allocator one did)
OLD_ALLOC_EXPORT = "export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}\n"
NZ_EXPORT = "export VLLM_ASCEND_ENABLE_NZ=${VLLM_ASCEND_ENABLE_NZ:-0}\n"


def clean_env(**extra: str) -> dict[str, str]:
    """A user environment without any variable of the contract (the test runner's could have some)."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(extra)
    return env


def model_config(script: str) -> dict:
    name = ("qwen3_235b_a22b_config.json" if "235b" in script else
            "qwen3_30b_a3b_config.json" if "30b_a3b" in script else "qwen3_32b_config.json")
    return json.loads((DATA / name).read_text())


def env_file(script: str) -> Path | None:
    """The setup's ENV_SCRIPT as docs/setups.md lists it (the launcher sources npu_env.sh for every setup)."""
    return ENV_235B if "235b" in script else None


def violations(script: Path, user_env: dict[str, str], env_script: Path | None, npu_env: Path | None = NPU_ENV,
               extra_args: list[str] | None = None) -> list[str]:
    """Resolve like the launcher (bash sources the files), read the command, evaluate the contract."""
    env = resolve_launch_env(user_env, env_script, npu_env)
    cmd = parse_train_script(script, env=env, extra_args=extra_args)
    ctx = EngineContext.from_overrides(cmd.override_map(), model_config(script.name))
    return [v.line() for v in check_env(cmd.env, ctx)]


# ---- (a) the shipped setups ---------------------------------------------------------------------------
SWITCHES = {"defaults": {}, "eplb": {"ROLLOUT_EPLB": "True"},
            "sam_npugraph_ex": {"SAM_ENABLE": "True", "SAM_GROUP": "True", "NPUGRAPH_EX": "True"}}


@pytest.mark.parametrize("case", sorted(SWITCHES))
@pytest.mark.parametrize("script", SCRIPTS)
def test_shipped_setups_resolve_clean(script: str, case: str) -> None:
    """Every train script with its env files, as the launcher sources them: no rule broken."""
    assert violations(INTERNAL / script, clean_env(**SWITCHES[case]), env_file(script)) == []


def test_resolved_environment_has_the_fixed_values() -> None:
    for script in SCRIPTS:
        env = resolve_launch_env(clean_env(), env_file(script), NPU_ENV)
        assert env["VLLM_ASCEND_ENABLE_NZ"] == "0", script
        assert "PYTORCH_NPU_ALLOC_CONF" not in env, script
    # the context the rules see for a 235B setup: sleep mode, graphs, TP4 with expert parallel, EPLB's env var
    cmd = parse_train_script(S235, env=resolve_launch_env(clean_env(ROLLOUT_EPLB="True"), ENV_235B, NPU_ENV))
    ctx = EngineContext.from_overrides(cmd.override_map())
    assert (ctx.sleep_mode, ctx.graph_mode, ctx.tensor_parallel_size, ctx.moe, ctx.expert_parallel) == (
        True, True, 4, True, True)
    assert ctx.capture_sizes == (8, 16, 32, 64, 96, 128, 160, 192, 224, 256)
    assert ctx.max_model_len == ctx.max_num_batched_tokens == 2048 + 32768
    assert ctx.eplb_key("dynamic_eplb") == "True" and ctx.runtime_env["DYNAMIC_EPLB"] == "true"


# ---- (b) regression: the values of the first cluster run ------------------------------------------------
def test_old_env_values_are_reported_and_committed_files_are_clean(tmp_path: Path) -> None:
    committed_235b, committed_npu = ENV_235B.read_text(), NPU_ENV.read_text()
    assert "PYTORCH_NPU_ALLOC_CONF=" not in "".join(
        ln for ln in committed_235b.splitlines(keepends=True) if not ln.lstrip().startswith("#"))
    assert NZ_EXPORT in committed_npu
    old_235b = tmp_path / "qwen3_235b_env.sh"
    old_235b.write_text(committed_235b + OLD_ALLOC_EXPORT)
    old_npu = tmp_path / "npu_env.sh"
    old_npu.write_text(committed_npu.replace(NZ_EXPORT, ""))

    assert violations(S235, clean_env(), old_235b, old_npu) == [CAMEM_LINE, NZ_LINE]
    assert violations(S235, clean_env(), old_235b, NPU_ENV) == [CAMEM_LINE]
    assert violations(S235, clean_env(), ENV_235B, old_npu) == [NZ_LINE]
    assert violations(S235, clean_env(), ENV_235B, NPU_ENV) == []
    # the 32B setups source npu_env.sh only: the missing NZ default broke them too
    s32 = INTERNAL / "train_grpo_qwen3_32b_32die_true_weight.sh"
    assert violations(s32, clean_env(), None, old_npu) == [NZ_LINE]


def test_user_exports_win_exactly_as_in_the_shell(tmp_path: Path) -> None:
    user = clean_env(PYTORCH_NPU_ALLOC_CONF="expandable_segments:True", VLLM_ASCEND_ENABLE_NZ="1")
    got = violations(S235, user, ENV_235B)
    assert got == [CAMEM_LINE, NZ_LINE.replace("VLLM_ASCEND_ENABLE_NZ unset (default 1)", "VLLM_ASCEND_ENABLE_NZ=1")]
    # ${VAR:-0}: an empty export takes the file's default, like bash
    assert violations(S235, clean_env(VLLM_ASCEND_ENABLE_NZ=""), ENV_235B) == []
    # sleep mode off (free_cache_engine=False): the two sleep-mode rules do not apply
    assert violations(S235, user, ENV_235B, extra_args=["actor_rollout_ref.rollout.free_cache_engine=False"]) == []
    # an env script that assigns unconditionally wins over the user's value, like bash
    forced = tmp_path / "forced_env.sh"
    forced.write_text("PYTORCH_NPU_ALLOC_CONF=expandable_segments:True\n")  # no export: set -a exports it
    assert violations(S235, clean_env(PYTORCH_NPU_ALLOC_CONF="expandable_segments:False"), forced) == [CAMEM_LINE]


def test_resolve_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(EnvResolveError, match="env file not found"):
        resolve_launch_env(clean_env(), tmp_path / "nope.sh", NPU_ENV)
    bad = tmp_path / "bad_env.sh"
    bad.write_text("export A=1\necho 'bad line in env' >&2\nfalse\n")
    with pytest.raises(EnvResolveError, match=r"sourcing .*bad_env.sh.* failed: bad line in env"):
        resolve_launch_env(clean_env(), bad, NPU_ENV)
    unset_var = tmp_path / "unset_env.sh"
    unset_var.write_text("export B=${NOT_SET_ANYWHERE}\n")  # the launcher runs under set -u
    with pytest.raises(EnvResolveError, match="NOT_SET_ANYWHERE"):
        resolve_launch_env(clean_env(), unset_var, None)


# ---- every rule: breaking value reported, fixed value not, condition respected -----------------------------
C = EngineContext
# rule id -> (breaking env, context where the rule applies, shown setting, env that fixes it (None: an engine-key
# rule, fixed by the context only), a context in which the breaking env is fine: the rule does not apply or the
# context satisfies it (None: context-independent))
CASES: dict[str, tuple[dict[str, str], EngineContext, str, dict[str, str] | None, EngineContext | None]] = {
    "camem-expandable-segments": (
        {"PYTORCH_NPU_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True"}, C(),
        "PYTORCH_NPU_ALLOC_CONF=garbage_collection_threshold:0.6,expandable_segments:True",
        {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}, C(sleep_mode=False)),
    "nz-wake-up": ({"VLLM_ASCEND_ENABLE_NZ": "2"}, C(), "VLLM_ASCEND_ENABLE_NZ=2", {"VLLM_ASCEND_ENABLE_NZ": "0"},
                   C(sleep_mode=False)),
    "aclgraph-launch-blocking": ({"ASCEND_LAUNCH_BLOCKING": "1"}, C(), "ASCEND_LAUNCH_BLOCKING=1",
                                 {"ASCEND_LAUNCH_BLOCKING": "0"}, C(enforce_eager=True)),
    "dynamic-eplb-env": ({}, C(additional_config={"eplb_config.dynamic_eplb": "True"}),
                         "DYNAMIC_EPLB unset (default false)", {"DYNAMIC_EPLB": "TRUE"},
                         C(additional_config={"dynamic_eplb": "True", "eplb_config.dynamic_eplb": "False"})),
    "expert-map-record-env": ({"EXPERT_MAP_RECORD": "1"},
                              C(additional_config={"eplb_config.expert_map_record_path": "/x/map.json"}),
                              "EXPERT_MAP_RECORD=1", {"EXPERT_MAP_RECORD": "true"}, C()),
    "flashcomm1-tp": ({"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"}, C(tensor_parallel_size=1),
                      "VLLM_ASCEND_ENABLE_FLASHCOMM1=1", {"VLLM_ASCEND_ENABLE_FLASHCOMM1": "0"},
                      C(tensor_parallel_size=2)),
    "flashcomm1-moe-ep": ({"VLLM_ASCEND_ENABLE_FLASHCOMM": "1"}, C(tensor_parallel_size=4, moe=True),
                          "VLLM_ASCEND_ENABLE_FLASHCOMM=1", {"VLLM_ASCEND_ENABLE_FLASHCOMM": "0"},
                          C(tensor_parallel_size=4, moe=True, expert_parallel=True)),
    "flashcomm1-graph-sizes": ({"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"},
                               C(tensor_parallel_size=4, capture_sizes=(1, 2, 6, 64), max_num_batched_tokens=32),
                               "VLLM_ASCEND_ENABLE_FLASHCOMM1=1 with cudagraph_capture_sizes [1, 2, 6] "
                               "(none a multiple of rollout TP 4)", {"VLLM_ASCEND_ENABLE_FLASHCOMM1": "0"},
                               C(tensor_parallel_size=4, capture_sizes=None)),
    "flashcomm2-oproj-tp": ({"VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE": "3"}, C(tensor_parallel_size=4),
                            "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE=3 with rollout TP 4",
                            {"VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE": "2"}, C(tensor_parallel_size=6)),
    "msmonitor-profiler": ({"MSMONITOR_USE_DAEMON": "1", "VLLM_TORCH_PROFILER_DIR": "/prof"}, C(),
                           "MSMONITOR_USE_DAEMON=1 with VLLM_TORCH_PROFILER_DIR set",
                           {"MSMONITOR_USE_DAEMON": "0", "VLLM_TORCH_PROFILER_DIR": "/prof"}, None),
    "verl-batched-tokens-chunked": ({}, C(max_model_len=36864, max_num_batched_tokens=8192),
                                    "rollout.max_num_batched_tokens=8192 < max_model_len 36864", None,
                                    C(max_model_len=36864, max_num_batched_tokens=36864)),
    "vllm-batched-tokens-unchunked": ({}, C(max_model_len=4096, max_num_batched_tokens=2048, chunked_prefill=False),
                                      "rollout.max_num_batched_tokens=2048 < max_model_len 4096", None,
                                      C(max_model_len=4096, max_num_batched_tokens=2048)),
    "vllm-batched-tokens-seqs": ({}, C(max_num_seqs=256, max_num_batched_tokens=128),
                                 "rollout.max_num_batched_tokens=128 < rollout.max_num_seqs 256", None,
                                 C(max_num_seqs=256, max_num_batched_tokens=256)),
}


def test_every_rule_has_a_case_and_unique_id() -> None:
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)) and set(ids) == set(CASES)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_breaking_and_fixed_values(rule_id: str) -> None:
    env, ctx, shown, fixed, ctx_off = CASES[rule_id]
    r = rule(rule_id)
    got = [v for v in check_env(env, ctx) if v.rule.id == rule_id]
    assert [v.shown for v in got] == [shown]
    assert got[0].line() == f"env-contract[{rule_id}]: {shown} {r.explanation} ({r.refs[0].cite()})"
    assert (fixed is None) == (not r.is_env)
    if fixed is not None:
        assert not [v for v in check_env({**env, **fixed}, ctx) if v.rule.id == rule_id]
    if ctx_off is not None:
        assert not [v for v in check_env(env, ctx_off) if v.rule.id == rule_id]


def test_runtime_env_of_the_command_overrides_the_node_env() -> None:
    ctx = C(additional_config={"eplb_config.dynamic_eplb": "True"}, runtime_env={"DYNAMIC_EPLB": "true"})
    assert check_env({"DYNAMIC_EPLB": "false", "VLLM_ASCEND_ENABLE_NZ": "0"}, ctx) == []
    ctx = C(runtime_env={"VLLM_ASCEND_ENABLE_NZ": "1"})
    assert [v.shown for v in check_env({"VLLM_ASCEND_ENABLE_NZ": "0"}, ctx)] == ["VLLM_ASCEND_ENABLE_NZ=1"]


# ---- (c) every citation against the pristine pinned upstream ---------------------------------------------
def test_cited_upstream_lines_hold_their_anchor(pristine_workspace: Path) -> None:
    """A pin bump that moves or drops the code a rule cites fails here (update the rule's file:line)."""
    assert anchor_problems(RULES, pristine_workspace, PINS) == []


def anchor_problems(rules: tuple[Rule, ...], workspace: Path, pins: Pins) -> list[str]:
    """Every cited line range of ``rules`` that is missing, lacks its anchor, is not tight, or (the first, cited
    refusal) holds no raise / assert in the pristine trees of ``workspace`` (``pins``'s folder names)."""
    problems = []
    for r in rules:
        for i, ref in enumerate(r.refs):
            f = workspace / pins.frameworks[ref.framework].dir / ref.path
            if not f.is_file():
                problems.append(f"{r.id}: {ref.path} not in the pristine {ref.framework} tree")
                continue
            lines = f.read_text().splitlines()
            cited = "\n".join(lines[ref.start - 1 : ref.end])
            if not (1 <= ref.start <= ref.end <= len(lines)) or ref.anchor not in cited:
                problems.append(f"{r.id}: {ref.cite()} lacks {ref.anchor!r}")
            elif i == 0 and "raise" not in cited and "assert" not in cited:
                problems.append(f"{r.id}: {ref.cite()} (the cited refusal) has no raise/assert")
            if ref.end - ref.start > 12:
                problems.append(f"{r.id}: {ref.cite()} is not a tight citation")
    return problems


def test_docs_list_the_contract() -> None:
    doc = (REPO / "docs" / "environment.md").read_text()
    assert markdown_table() in doc
    assert doc.count("python -m qwen3_rl preflight") >= 2


# ---- (d) through the real CLI and the launcher -----------------------------------------------------------------
def _preflight(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "qwen3_rl", "preflight", *args], env=dict(env, PYTHONPATH=str(REPO)),
                          text=True, capture_output=True, timeout=120, cwd=REPO)


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


def test_preflight_cli_names_the_rule_and_upstream_line() -> None:
    env = clean_env(PYTORCH_NPU_ALLOC_CONF="expandable_segments:True")
    p = _preflight([str(S235), "--env-script", str(ENV_235B), "--env-only"], env)
    assert p.returncode == 1
    assert _errors(p.stderr) == [f"error: {CAMEM_LINE}"]
    assert "preflight (environment contract only): 1 error(s)" in p.stdout
    # the full preflight reports it among the other (file) problems of this machine
    p = _preflight([str(S235), "--env-script", str(ENV_235B), "--no-node-checks"], env)
    assert p.returncode == 1 and f"error: {CAMEM_LINE}" in _errors(p.stderr)
    # clean without the export; --npu-env '' (nothing sourced) leaves vLLM-Ascend's NZ default in place
    p = _preflight([str(S235), "--env-script", str(ENV_235B), "--env-only"], clean_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip().endswith("- OK")
    p = _preflight([str(S235), "--env-script", str(ENV_235B), "--env-only", "--npu-env", ""], clean_env())
    assert _errors(p.stderr) == [f"error: {NZ_LINE}"]
    p = _preflight([str(S235), "--env-script", str(S235.parent / "nope.sh"), "--env-only"], clean_env())
    assert p.returncode == 1 and _errors(p.stderr) == [f"error: [env] env file not found: {S235.parent}/nope.sh"]


def _launcher_env(tmp_path: Path, **extra: str) -> tuple[Path, dict[str, str]]:
    bin_dir = make_stubs(tmp_path)
    script = make_standin(tmp_path, "raise SystemExit(0)\n")
    return script, stub_env(tmp_path, bin_dir, CANN_HOME=str(make_cann(tmp_path)), **extra)


def test_launcher_stops_before_ray_start_even_without_preflight(tmp_path: Path) -> None:
    script, env = _launcher_env(tmp_path, PYTORCH_NPU_ALLOC_CONF="expandable_segments:True")
    env.pop("VLLM_ASCEND_ENABLE_NZ", None)
    p = run_launcher([str(script), "--no-preflight"], env)
    assert p.returncode == 1
    assert _errors(p.stderr) == [f"error: {CAMEM_LINE}",
                                 "error: the environment breaks the pinned upstream's contract (see above)"]
    assert not [c for c in stub_calls(tmp_path) if c.startswith("ray ")]
    # dry run: the same finding, listed where a real launch would stop
    p = run_launcher([str(script), "--no-preflight", "--dry-run"], env)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "--env-only  (--no-preflight: the environment contract only)" in out
    assert f"preflight: skipped; environment contract (a real launch stops on errors):\n  error: {CAMEM_LINE}" in out
    assert "  VLLM_ASCEND_ENABLE_NZ=0\n" in out  # npu_env.sh's value, in the environment listing
    assert not [c for c in stub_calls(tmp_path) if c.startswith("ray ")]


def test_launcher_passes_a_clean_environment(tmp_path: Path) -> None:
    script, env = _launcher_env(tmp_path)
    for k in ("PYTORCH_NPU_ALLOC_CONF", "VLLM_ASCEND_ENABLE_NZ"):
        env.pop(k, None)
    p = run_launcher([str(script), "--no-preflight", "--dry-run"], env)
    assert p.returncode == 0, p.stderr
    assert "environment contract (a real launch stops on errors):\n  no problems found" in p.stdout


# ---- (e) the current pin set's contract (verl 0.9.1 / vLLM 0.23.0 / vLLM-Ascend 0.23.0.post1) ---------------------
CURRENT = load_pins(REPO / "pins.toml", "current")
CURRENT_KEYS = ("vllm", "vllm_ascend", "verl")


@pytest.fixture(scope="module")
def current_pristine() -> Path:
    """The current set's pristine vLLM, vLLM-Ascend and verl trees (the pinned wheels / sdists, by our download code)."""
    return fill_pristine(REPO / "pins.toml", [CURRENT.frameworks[k] for k in CURRENT_KEYS], pin_set="current")


def test_current_cited_upstream_lines_hold_their_anchor(current_pristine: Path) -> None:
    """Every current-set citation holds its anchor in the pristine current trees; positive control: the seed set's
    citations, checked against the same trees, are reported (the lines moved), so the check can fail."""
    assert anchor_problems(CURRENT_RULES, current_pristine, CURRENT) == []
    seed_in_current = anchor_problems(RULES, current_pristine, CURRENT)
    assert "camem-expandable-segments: vllm_ascend/device_allocator/camem.py:145-149 lacks 'expandable_segments:True'" \
        in seed_in_current
    assert any(p.startswith("verl-batched-tokens-chunked: verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py not in")
               for p in seed_in_current)
    moved = Rule("x", "X", "", "", "", (UpstreamRef("vllm_ascend", "vllm_ascend/platform.py", 645, 649,
                                                    'os.environ.get("ASCEND_LAUNCH_BLOCKING", "0") == "1"'),),
                 lambda ctx: True, lambda env, ctx: None)
    assert anchor_problems((moved,), current_pristine, CURRENT) == [
        "x: vllm_ascend/platform.py:645-649 (the cited refusal) has no raise/assert"]


def test_current_rules_account_for_every_seed_rule() -> None:
    current = {r.id: r for r in CURRENT_RULES}
    assert len(current) == len(CURRENT_RULES)
    assert set(SEED_RULE_FATE) == {r.id for r in RULES}
    for r in RULES:
        status, note = SEED_RULE_FATE[r.id]
        assert status in ("holds", "changed", "gone") and note, r.id
        if status == "gone":
            assert r.id not in current, r.id
        elif r.id == "expert-map-record-env":  # merged: one assert reads both variables now
            assert "merged into `dynamic-eplb-env`" in note and r.id not in current
        else:
            assert current[r.id].subject == r.subject, r.id
            # same variable, new lines: never the seed set's citation of the refusal
            assert current[r.id].refs[0] != r.refs[0], r.id


CC = EngineContext
EPLB_ON = {"eplb_config.dynamic_eplb": "True"}
# rule id -> (breaking env, context where the rule applies, shown setting, env that fixes it (None: engine-key rule),
# a context in which the breaking env is fine (None: context-independent))
CURRENT_CASES: dict[str, tuple[dict[str, str], EngineContext, str, dict[str, str] | None, EngineContext | None]] = {
    "camem-expandable-segments": (
        {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}, CC(),
        "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True", {"PYTORCH_NPU_ALLOC_CONF": "page_size:1g"},
        CC(sleep_mode=False)),
    "nz-wake-up": ({}, CC(), "VLLM_ASCEND_ENABLE_NZ unset (default 1)", {"VLLM_ASCEND_ENABLE_NZ": "0"},
                   CC(free_cache_engine=False)),
    "nz-weight-update": ({"VLLM_ASCEND_ENABLE_NZ": "1"}, CC(checkpoint_backend="delta_sharded"),
                         "VLLM_ASCEND_ENABLE_NZ=1", {"VLLM_ASCEND_ENABLE_NZ": "0"}, CC()),
    "aclgraph-launch-blocking": ({"ASCEND_LAUNCH_BLOCKING": "1"}, CC(), "ASCEND_LAUNCH_BLOCKING=1",
                                 {"ASCEND_LAUNCH_BLOCKING": "0"}, CC(cudagraph_mode="NONE")),
    "dynamic-eplb-env": ({"DYNAMIC_EPLB": "false"}, CC(additional_config={"eplb_config.expert_map_record_path": "/m.json"}),
                         "DYNAMIC_EPLB=false and EXPERT_MAP_RECORD unset (default false)", {"EXPERT_MAP_RECORD": "true"},
                         CC(additional_config={"dynamic_eplb": "True"})),
    "flashcomm1-tp": ({"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"}, CC(tensor_parallel_size=1),
                      "VLLM_ASCEND_ENABLE_FLASHCOMM1=1", {"VLLM_ASCEND_ENABLE_FLASHCOMM1": "0"},
                      CC(tensor_parallel_size=1, additional_config={"enable_flashcomm1": "False"})),
    "flashcomm1-moe-ep": ({}, CC(tensor_parallel_size=4, moe=True, additional_config={"enable_flashcomm1": "True"}),
                          "additional_config enable_flashcomm1=True", None,
                          CC(tensor_parallel_size=4, moe=True, expert_parallel=True,
                             additional_config={"enable_flashcomm1": "True"})),
    "flashcomm1-graph-sizes": ({"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"},
                               CC(tensor_parallel_size=4, capture_sizes=(1, 2, 6, 64), max_num_batched_tokens=32),
                               "VLLM_ASCEND_ENABLE_FLASHCOMM1=1 with cudagraph_capture_sizes [1, 2, 6] "
                               "(none a multiple of rollout TP 4)", {"VLLM_ASCEND_ENABLE_FLASHCOMM1": "0"},
                               CC(tensor_parallel_size=4, capture_sizes=(1, 2, 6, 64), max_num_batched_tokens=32,
                                  cudagraph_mode="NONE")),
    "flashcomm2-oproj-tp": ({"VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE": "4"}, CC(tensor_parallel_size=4),
                            "VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE=4 with rollout TP 4",
                            {"VLLM_ASCEND_FLASHCOMM2_PARALLEL_SIZE": "2"},
                            CC(tensor_parallel_size=4, additional_config={"enable_flashcomm2_parallel_size": "2"})),
    "msmonitor-profiler": ({"MSMONITOR_USE_DAEMON": "1"}, CC(rollout_profiler=True), "MSMONITOR_USE_DAEMON=1",
                           {"MSMONITOR_USE_DAEMON": "0"}, CC()),
    "vllm-batched-tokens-seqs": ({}, CC(max_num_seqs=256, max_num_batched_tokens=128),
                                 "rollout.max_num_batched_tokens=128 < rollout.max_num_seqs 256", None,
                                 CC(max_num_seqs=128, max_num_batched_tokens=128)),
    "verl-max-model-len": ({}, CC(max_model_len=65536, max_position_embeddings=40960),
                           "rollout.max_model_len=65536 > the model's max_position_embeddings 40960", None,
                           CC(max_model_len=40960, max_position_embeddings=40960)),
    "fused-mc2-hierarchy": ({"VLLM_ASCEND_ENABLE_FUSED_MC2": "2"},
                            CC(additional_config={"enable_mc2_hierarchy_comm": "True"}), "VLLM_ASCEND_ENABLE_FUSED_MC2=2",
                            {"VLLM_ASCEND_ENABLE_FUSED_MC2": "0"}, CC()),
    "balance-scheduling-profiling-chunk": (
        {"VLLM_ASCEND_BALANCE_SCHEDULING": "1"}, CC(additional_config={"profiling_chunk_config.enabled": "True"}),
        "VLLM_ASCEND_BALANCE_SCHEDULING=1", {"VLLM_ASCEND_BALANCE_SCHEDULING": "0"}, CC()),
}
# the variables every case's breaking env must leave as a clean launch has them (npu_env.sh's NZ=0)
CURRENT_BASE = {"VLLM_ASCEND_ENABLE_NZ": "0"}


def test_every_current_rule_has_a_case() -> None:
    assert {r.id for r in CURRENT_RULES} == set(CURRENT_CASES)


@pytest.mark.parametrize("rule_id", sorted(CURRENT_CASES))
def test_current_rule_breaking_and_fixed_values(rule_id: str) -> None:
    env, ctx, shown, fixed, ctx_off = CURRENT_CASES[rule_id]
    env = {**CURRENT_BASE, **env} if rule_id not in ("nz-wake-up",) else env
    r = rule(rule_id, "current")
    got = [v for v in check_env(env, ctx, CURRENT_RULES) if v.rule.id == rule_id]
    assert [v.shown for v in got] == [shown]
    assert got[0].line() == f"env-contract[{rule_id}]: {shown} {r.explanation} ({r.refs[0].cite()})"
    if fixed is not None:
        assert not [v for v in check_env({**env, **fixed}, ctx, CURRENT_RULES) if v.rule.id == rule_id]
    if ctx_off is not None:
        assert not [v for v in check_env(env, ctx_off, CURRENT_RULES) if v.rule.id == rule_id]


def test_current_reading_differs_from_the_seed_reading() -> None:
    """What changed between the sets, each shown both ways on one environment."""
    # additional_config weight_nz_mode wins over the variable at wake-up, not at start_weight_update
    ctx = CC(additional_config={"weight_nz_mode": "2"}, checkpoint_backend="delta_sharded")
    got = {v.rule.id: v.shown for v in check_env({"VLLM_ASCEND_ENABLE_NZ": "0"}, ctx, CURRENT_RULES)}
    assert got == {"nz-wake-up": "additional_config weight_nz_mode=2"}
    got = {v.rule.id: v.shown for v in check_env({}, CC(additional_config={"weight_nz_mode": "0"},
                                                          checkpoint_backend="delta_sharded"), CURRENT_RULES)}
    assert got == {"nz-weight-update": "VLLM_ASCEND_ENABLE_NZ unset (default 1)"}
    # the older FlashComm variable: read by the seed set, not by the current one
    old = {"VLLM_ASCEND_ENABLE_FLASHCOMM": "1", **CURRENT_BASE}
    assert [v.rule.id for v in check_env(old, C(tensor_parallel_size=1))] == ["flashcomm1-tp"]
    assert check_env(old, CC(tensor_parallel_size=1), CURRENT_RULES) == []
    # EPLB: EXPERT_MAP_RECORD=true now satisfies dynamic EPLB too; top-level keys are no longer read
    on = C(additional_config=EPLB_ON)
    rec = {"EXPERT_MAP_RECORD": "true", **CURRENT_BASE}
    assert [v.rule.id for v in check_env(rec, on)] == ["dynamic-eplb-env"]
    assert check_env(rec, on, CURRENT_RULES) == []
    assert check_env(CURRENT_BASE, CC(additional_config={"dynamic_eplb": "True"}), CURRENT_RULES) == []
    # profiler: only a started rollout profiler is refused (VLLM_TORCH_PROFILER_DIR is not read by vLLM 0.23)
    prof = {"MSMONITOR_USE_DAEMON": "1", "VLLM_TORCH_PROFILER_DIR": "/prof", **CURRENT_BASE}
    assert [v.rule.id for v in check_env(prof, C())] == ["msmonitor-profiler"]
    assert check_env(prof, CC(), CURRENT_RULES) == []
    # batched tokens below max_model_len with chunked prefill: refused by verl 0.6.1, not reached in verl 0.9.1
    short = C(max_model_len=36864, max_num_batched_tokens=8192)
    assert [v.rule.id for v in check_env(CURRENT_BASE, short)] == ["verl-batched-tokens-chunked"]
    assert check_env(CURRENT_BASE, CC(max_model_len=36864, max_num_batched_tokens=8192, max_num_seqs=256),
                     CURRENT_RULES) == []


def test_current_context_reads_verl091_keys_and_defaults() -> None:
    base = {"data.max_prompt_length": "2048", "data.max_response_length": "32768"}
    seed, cur = EngineContext.from_overrides(base), EngineContext.from_overrides(base, {"max_position_embeddings": 40960},
                                                                                 pin_set="current")
    assert (seed.max_model_len, seed.max_num_seqs) == (34816, 1024)
    assert (cur.max_model_len, cur.max_num_seqs, cur.max_position_embeddings) == (40960, 256, 40960)
    assert (cur.sleep_mode, cur.free_cache_engine, cur.checkpoint_backend, cur.rollout_profiler) == (
        True, True, "naive", False)
    keys = {R + "enable_sleep_mode": "False", R + "free_cache_engine": "False", R + "max_model_len": "50000",
            R + "checkpoint_engine.backend": "delta_sharded", R + "profiler.tool": "npu", R + "profiler.enable": "True"}
    cur = EngineContext.from_overrides({**base, **keys}, {"max_position_embeddings": 40960}, pin_set="current")
    assert (cur.sleep_mode, cur.free_cache_engine, cur.max_model_len, cur.checkpoint_backend, cur.rollout_profiler) == (
        False, False, 50000, "delta_sharded", True)
    assert [v.rule.id for v in check_env(CURRENT_BASE, cur, CURRENT_RULES)] == ["verl-max-model-len"]
    # seed reading of the same keys: enable_sleep_mode is not a verl 0.6.1 key, free_cache_engine is its sleep mode
    assert EngineContext.from_overrides({**base, **keys}).sleep_mode is False


R = "actor_rollout_ref.rollout."


def current_violations(script: Path, user_env: dict[str, str], env_script: Path | None,
                       npu_env: Path | None = NPU_ENV) -> list[str]:
    """The current set's contract on a shipped setup: the environment resolved with ``PIN_SET=current`` as the
    launcher sources it, the engine keys from the command the script prints (read without ``PIN_SET``: with it
    every shipped script still stops on a feature the current set has pending, before any engine starts)."""
    env = resolve_launch_env({**user_env, "PIN_SET": "current"}, env_script, npu_env)
    cmd = parse_train_script(script, env={k: v for k, v in env.items() if k != "PIN_SET"})
    ctx = EngineContext.from_overrides(cmd.override_map(), model_config(script.name), pin_set="current")
    return [v.line() for v in check_env({**cmd.env, "PIN_SET": "current"}, ctx, CURRENT_RULES)]


@pytest.mark.parametrize("case", sorted(SWITCHES))
@pytest.mark.parametrize("script", SCRIPTS)
def test_shipped_setups_satisfy_the_current_contract(script: str, case: str) -> None:
    assert current_violations(INTERNAL / script, clean_env(**SWITCHES[case]), env_file(script)) == []


def test_current_contract_reports_a_broken_launch_env(tmp_path: Path) -> None:
    """Positive control of the setup check: without npu_env.sh's NZ default, or with the old allocator export, the
    235B setup breaks the current set's rules (new lines cited); with them it does not."""
    old_npu = tmp_path / "npu_env.sh"
    old_npu.write_text(NPU_ENV.read_text().replace(NZ_EXPORT, ""))
    nz = rule("nz-wake-up", "current")
    assert current_violations(S235, clean_env(), ENV_235B, old_npu) == [
        f"env-contract[nz-wake-up]: VLLM_ASCEND_ENABLE_NZ unset (default 1) {nz.explanation} "
        "(vllm_ascend/worker/worker.py:241-247)"]
    camem = rule("camem-expandable-segments", "current")
    assert current_violations(S235, clean_env(PYTORCH_NPU_ALLOC_CONF="expandable_segments:True"), ENV_235B) == [
        f"env-contract[camem-expandable-segments]: PYTORCH_NPU_ALLOC_CONF=expandable_segments:True "
        f"{camem.explanation} (vllm_ascend/device_allocator/camem.py:152-157)"]
    # EPLB with the runtime-env DYNAMIC_EPLB the layout emits: clean; a node export does not override it
    assert current_violations(S235, clean_env(ROLLOUT_EPLB="True", DYNAMIC_EPLB="false"), ENV_235B) == []


def test_preflight_cli_checks_the_current_contract(tmp_path: Path) -> None:
    """Through the real CLI with a stand-in train script: PIN_SET=current is checked (no "not checked" warning),
    with the current set's lines; the same environment under the seed set cites the seed lines."""
    script = make_standin(tmp_path, "raise SystemExit(0)\n")
    cur = clean_env(PIN_SET="current")
    p = _preflight([str(script), "--env-only"], cur)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip().endswith("preflight (environment contract only) (pin set current): 0 error(s), "
                                      "0 warning(s) - OK")
    assert "not checked" not in p.stdout + p.stderr
    blocking = rule("aclgraph-launch-blocking", "current").explanation
    p = _preflight([str(script), "--env-only"], {**cur, "ASCEND_LAUNCH_BLOCKING": "1"})
    assert p.returncode == 1
    assert _errors(p.stderr) == [f"error: env-contract[aclgraph-launch-blocking]: ASCEND_LAUNCH_BLOCKING=1 {blocking} "
                                 "(vllm_ascend/platform.py:647-652)"]
    p = _preflight([str(script), "--env-only"], clean_env(ASCEND_LAUNCH_BLOCKING="1"))
    assert _errors(p.stderr) == [f"error: env-contract[aclgraph-launch-blocking]: ASCEND_LAUNCH_BLOCKING=1 {blocking} "
                                 "(vllm_ascend/platform.py:304-311)"]
    # a rule only the current set has: delta_sharded weight sync with NZ on (and wake-up with it)
    p = _preflight([str(script), "--env-only", "--npu-env", "", R + "checkpoint_engine.backend=delta_sharded"], cur)
    assert [ln.split("]")[0] for ln in _errors(p.stderr)] == ["error: env-contract[nz-wake-up",
                                                              "error: env-contract[nz-weight-update"]
    # the old FlashComm variable at rollout TP 1: refused by the seed set only
    one = ["--env-only", R + "tensor_model_parallel_size=1"]
    p = _preflight([str(script), *one], {**cur, "VLLM_ASCEND_ENABLE_FLASHCOMM": "1"})
    assert p.returncode == 0, p.stderr
    p = _preflight([str(script), *one], clean_env(VLLM_ASCEND_ENABLE_FLASHCOMM="1"))
    assert [ln.split("]")[0] for ln in _errors(p.stderr)] == ["error: env-contract[flashcomm1-tp"]


def test_docs_list_the_current_contract() -> None:
    doc = (REPO / "docs" / "environment.md").read_text()
    table = markdown_table("current")
    assert table in doc and table != markdown_table()
    assert all(f"| `{rid}` | {status} |" in table for rid, (status, _) in SEED_RULE_FATE.items())


def test_launcher_checks_the_current_contract_before_ray_start(tmp_path: Path) -> None:
    """PIN_SET=current on the launcher (``--no-preflight`` still runs the contract): a broken current-set rule stops
    it before ``ray start`` citing the current lines; the same launch without the export passes the contract."""
    script, env = _launcher_env(tmp_path, PIN_SET="current", ASCEND_LAUNCH_BLOCKING="1")
    p = run_launcher([str(script), "--no-preflight"], env)
    assert p.returncode == 1
    assert _errors(p.stderr) == [
        "error: env-contract[aclgraph-launch-blocking]: ASCEND_LAUNCH_BLOCKING=1 "
        f"{rule('aclgraph-launch-blocking', 'current').explanation} (vllm_ascend/platform.py:647-652)",
        "error: the environment breaks the pinned upstream's contract (see above)"]
    assert not [c for c in stub_calls(tmp_path) if c.startswith("ray ")]
    env.pop("ASCEND_LAUNCH_BLOCKING")
    p = run_launcher([str(script), "--no-preflight", "--dry-run"], env)
    assert p.returncode == 0, p.stderr
    assert "environment contract (a real launch stops on errors):\n  no problems found" in p.stdout
