"""Every setup (``internal/train_*.sh``) with ``PIN_SET=current``: verl 0.9.1's own start-up checks on its command,
or one line naming the set and the switch that stops it.

Each script runs in print mode (``QWEN3_RL_PRINT_COMMAND=1``) with ``PIN_SET=current``. What it must do follows from
``features.toml``'s ``current`` statuses (:func:`qwen3_rl.tools.features.pin_set_problems`), not from a list here:

* a setup with a switch in use whose status there is pending or dropped, or runs / config without keys of that set
  while its seed keys are the seed set's verl seam (``qwen3_rl.*``: not wired there), stops with exactly one
  ``error:`` line, ``<SWITCH>=<value> on pin set current: <status>...``, naming the first such switch;
* every other setup prints a command that passes the dry run of ``tests/helpers/verl091_dry_run_driver.py`` in the
  verl 0.9.1 venv: Hydra compose of verl 0.9.1's own ``ppo_megatron_trainer.yaml``, ``auto_set_device``,
  ``validate_config`` and the dataclass conversions of the V1 trainer (the model's too for the tiny setups, on a
  tiny checkpoint made here), its group-filter check and the reward loop's reward manager; the fully-async setups
  through verl's own fully-async main (``fully_async_ppo_megatron_trainer.yaml``, its rollouter's checks).

The fully-async setups' run length on verl 0.9.1: its trainer builds the actor's Megatron LR scheduler before the
rollouter counts the run's updates (``fully_async_main.py:78-92``), so the command carries them in
``actor.optim.total_training_steps`` (the driver builds that scheduler): SYNCS x TRIGGER_SYNC_STEPS, or with SYNCS null
(235B, 30B-A3B) TRAIN_FILE's rows x TOTAL_EPOCHS / prompts per update (a parquet of ``TRAIN_ROWS`` rows made here);
the command without it (the yaml's -1) fails that scheduler's check; an unreadable TRAIN_FILE or one with fewer
prompts than an update stops the script with one line naming SYNCS, and SYNCS given prints it without reading data.

The DAPO and fully-async setups' commands there carry the seed set's settings under verl 0.9.1's keys: each value
read back from the composed config (and from the reward manager verl builds) equals the seed command's.

A setup whose weights are ``random`` (``train_add_base_overrides``) stops in the shell first: verl 0.9.1's Megatron
engine always loads a checkpoint.

Positive control: with the stopping switches that a GRPO setup (235B, 32B, 30B-A3B, tiny) turns on by default set off
in the env (False, or the set's ``current.off``) and ``USE_KL_LOSS=True`` (the reference policy's config checked
too), every one of them passes the dry run. Negative controls: a key verl
0.9.1 lacks (``megatron.grad_offload``, which the seed set's OFFLOAD sets) fails the compose; ``rollout.mode=sync``
passes the compose and fails RolloutConfig's conversion; ``ROLLOUT_MODE=sync`` asked for stops the script with one
line naming the set; the fully-async command with the seed's batch size (``data.train_batch_size`` > 0) fails the
rollouter's check, and without its config search path the compose; a DAPO overlong buffer longer than the response
fails the DAPO reward manager's check; the legacy ``custom_reward_function`` keys leave verl 0.9.1's V1 trainer on
its default reward function; ``MAX_NUM_GEN_BATCHES`` and ``ROLLOUT_MODE=sync`` asked for on a DAPO / fully-async
setup stop the script with one line naming the set.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import selectors
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen3_rl.tools import features as F
from qwen3_rl.tools.launch.train_script import parse_train_script

from conftest import REPO
from helpers.current_verl import PYTHON, venv_env

DRIVER = REPO / "tests" / "helpers" / "verl091_dry_run_driver.py"
SCRIPTS = sorted((REPO / "internal").glob("train_*.sh"))
GRPO = [
    "train_grpo_qwen3_235b_128die_true_weight.sh",
    "train_grpo_qwen3_32b_32die_true_weight.sh",
    "train_grpo_qwen3_30b_a3b_32die.sh",
    "train_grpo_tiny_cpu.sh",
]
STOP_STATUSES = ("pending", "dropped")
DAPO = ["train_dapo_qwen3_235b_128die_true_weight.sh", "train_dapo_qwen3_32b_32die_true_weight.sh"]
FULLY_ASYNC = [
    "train_grpo_qwen3_235b_128die_fully_async.sh",
    "train_grpo_qwen3_30b_a3b_32die_fully_async.sh",
    "train_grpo_tiny_cpu_fully_async.sh",
]
FULLY_ASYNC_MAIN = "verl.experimental.fully_async_policy.fully_async_main"
#: the weight source's keys (USE_DIST_CKPT, USE_MBRIDGE) and the Bridge's, read back from the composed config
WEIGHT_KEYS = [
    f"actor_rollout_ref.{role}.megatron.{key}"
    for role in ("actor", "ref")
    for key in ("use_dist_checkpointing", "dist_checkpointing_path", "use_mbridge", "vanilla_mbridge")
]
#: (case, setup, extra env, use_dist_checkpointing expected): the weight-source switches on the current set
WEIGHT_CASES = [
    ("USE_DIST_CKPT=True", "train_grpo_qwen3_32b_32die_true_weight.sh", {"USE_DIST_CKPT": "True"}, True),
    ("USE_DIST_CKPT=False", "train_grpo_qwen3_32b_32die_true_weight.sh", {"USE_DIST_CKPT": "False"}, False),
    ("USE_MBRIDGE=False", "train_grpo_qwen3_30b_a3b_32die_fully_async.sh", {"USE_MBRIDGE": "False"}, True),
    ("USE_MBRIDGE=True", "train_grpo_qwen3_30b_a3b_32die_fully_async.sh", {"USE_MBRIDGE": "True"}, False),
]
#: the keys MOE_ALLTOALLV sets on the current set, read back from the composed config
MOE_ALLTOALLV_KEYS = ["actor_rollout_ref.model.external_lib", "actor_rollout_ref.qwen3_rl.moe_alltoallv.enable"]
#: rows of the TRAIN_FILE the scripts read here (the fully-async setups with SYNCS null count their updates from it)
TRAIN_ROWS = 1000
LR_STEPS = "actor_rollout_ref.actor.optim.total_training_steps"
LR_STAGE = "get_megatron_optimizer_param_scheduler(actor.optim)"
#: seed key -> verl 0.9.1 key of the same setting, DAPO
DAPO_KEYS = {
    "actor_rollout_ref.actor.clip_ratio_low": "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "actor_rollout_ref.actor.clip_ratio_c",
    "data.gen_batch_size": "data.gen_batch_size",
    "algorithm.filter_groups.enable": "algorithm.filter_groups.enable",
    "algorithm.filter_groups.metric": "algorithm.filter_groups.metric",
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.reward_kwargs.max_resp_len": "reward.reward_kwargs.max_resp_len",
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": "reward.reward_kwargs.overlong_buffer_cfg.enable",
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": "reward.reward_kwargs.overlong_buffer_cfg.len",
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": (
        "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor"
    ),
    "custom_reward_function.path": "reward.custom_reward_function.path",
}
#: seed key -> verl 0.9.1 key of the same setting, fully async
FULLY_ASYNC_KEYS = {
    "trainer.nnodes": "trainer.nnodes",
    "trainer.n_gpus_per_node": "trainer.n_gpus_per_node",
    "rollout.nnodes": "rollout.nnodes",
    "rollout.n_gpus_per_node": "rollout.n_gpus_per_node",
    "async_training.staleness_threshold": "async_training.staleness_threshold",
    "async_training.trigger_parameter_sync_step": "async_training.trigger_parameter_sync_step",
    "async_training.require_batches": "async_training.require_batches",
    "async_training.partial_rollout": "async_training.partial_rollout",
    "async_training.use_rollout_log_probs": "algorithm.rollout_correction.bypass_mode",
    "algorithm.rollout_correction.rollout_is": "algorithm.rollout_correction.rollout_is",
    "actor_rollout_ref.rollout.mode": "actor_rollout_ref.rollout.mode",
    "custom_reward_function.path": "reward.custom_reward_function.path",
}
#: what verl 0.9.1's fully-async rollouter asserts (fully_async_rollouter.py:350-356, :733)
FULLY_ASYNC_FIXED = {
    "actor_rollout_ref.hybrid_engine": False,
    "data.train_batch_size": 0,
    "data.gen_batch_size": 1,
    "actor_rollout_ref.rollout.calculate_log_probs": True,
}


def _write_train_file(path: Path, rows: int) -> Path:
    """A parquet of ``rows`` prompts (only its row count is read: by the fully-async scripts with SYNCS null)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [f"prompt {i}" for i in range(rows)]}), path)
    return path


@pytest.fixture(scope="module", autouse=True)
def train_file(tmp_path_factory: pytest.TempPathFactory):
    """TRAIN_FILE for every script run here: a parquet of TRAIN_ROWS rows."""
    path = _write_train_file(tmp_path_factory.mktemp("dry_run_data") / "train.parquet", TRAIN_ROWS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAIN_FILE", str(path))
        yield path


def _env(extra: dict[str, str] | None = None, model: Path | None = None) -> dict[str, str]:
    """This process's environment without the feature switches, plus ``PIN_SET=current`` and ``extra``."""
    reg = F.load_registry()
    env = {k: v for k, v in os.environ.items() if k not in reg.features and k != "PIN_SET"}
    env.update({"PIN_SET": "current", "QWEN3_RL_PRINT_COMMAND": "1", **(extra or {})})
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
    if model is not None:
        env["MODEL_PATH"] = str(model)
    return env


def _expected_stops(setup: str, env: dict[str, str]) -> list[str]:
    """The switches of ``setup`` in use on the current set whose status there is pending / dropped, or runs / config
    without ``current.sets`` while a seed key they emit is a ``qwen3_rl.*`` one (registry order), from features.toml:
    the sizes (context) read from the seed set's command of the same script."""
    reg = F.load_registry()
    seed = parse_train_script(REPO / "internal" / setup, env=dict(env, PIN_SET="seed"))
    vals = {o.lstrip("+").partition("=")[0]: o.partition("=")[2] for o in seed.overrides if "=" in o}
    implied = F.values_from_overrides(reg, vals, setup)
    ctx = {n: str(implied[n]) for n in reg.context if implied.get(n) not in (None, "")}
    values = F.resolve(reg, setup, env, ctx, pin_set="current")
    enables = F._seam_enables(reg, values)
    return [f.env for f in reg.features.values() if F.in_use_on_set(f, values, enables) and _stops(f, values)]


def _stops(f: F.Feature, values: dict[str, str | None]) -> bool:
    status = f.current.status if f.current else "pending"
    if status in STOP_STATUSES:
        return True
    seed_keys = [s.key for s in f.sets if F._all_hold(s.when, values.get)]
    return (
        f.current is not None
        and f.current.sets is None
        and any(k.lstrip("+").startswith("qwen3_rl.") for k in seed_keys)
    )


def _weights(setup: str) -> str:
    """The script's weight source (``train_add_base_overrides LAYOUT WEIGHTS``)."""
    found = re.findall(r"^train_add_base_overrides \S+ (\S+)", (REPO / "internal" / setup).read_text(), re.M)
    assert len(found) == 1, setup
    return found[0]


def _off_value(f: F.Feature) -> str:
    """The value that turns ``f`` off on the current set (a missing one fails)."""
    if f.type == "bool":
        return "False"
    if f.current is not None and f.current.off is not None:
        return f.current.off
    offs = [a for a in f.allowed if a in F.OFF_VALUES]
    assert offs, f"{f.env}: no off value on the current set"
    return offs[0]


def _report_keys(setup: str) -> list[str]:
    """The verl 0.9.1 keys whose final values the dry run reports for ``setup``."""
    if setup in DAPO:
        return [*DAPO_KEYS.values(), "reward.custom_reward_function.reward_kwargs.incorrect_score"]
    if setup in FULLY_ASYNC:
        return [*FULLY_ASYNC_KEYS.values(), *FULLY_ASYNC_FIXED, "rollout.total_rollout_steps", LR_STEPS]
    return []


def _same(seed: str, value: object) -> bool:
    """Whether a seed override's text ``seed`` and a composed config value are the same setting."""
    seed = seed.strip("'\"")
    if isinstance(value, bool):
        return seed == str(value)
    if value is None:
        return seed == "null"
    if isinstance(value, (int, float)):
        return float(seed) == float(value)
    return seed == str(value)


def _seed_command(setup: str, env: dict[str, str]) -> dict[str, str]:
    """The seed set's command of ``setup`` as {key: value}."""
    return parse_train_script(REPO / "internal" / setup, env=dict(env, PIN_SET="seed")).override_map()


def _fully_async_negatives(config_name: str, overrides: list[str]) -> list[dict]:
    """The tiny fully-async command with the seed set's batch size (prompts per step, not 0), and without the config
    search path the script gives verl's fully-async main."""
    batch = [o for o in overrides if not o.startswith("data.train_batch_size=")] + [
        "data.train_batch_size=16"
    ]
    no_path = [o for o in overrides if not o.startswith("hydra.searchpath=")]
    assert no_path != overrides, "the fully-async command gives no hydra.searchpath"
    return [
        {
            "name": "negative:fully_async_batch",
            "config_name": config_name,
            "overrides": batch,
            "model": False,
            "entry": FULLY_ASYNC_MAIN,
        },
        {
            "name": "negative:fully_async_no_searchpath",
            "config_name": config_name,
            "overrides": no_path,
            "model": False,
            "entry": FULLY_ASYNC_MAIN,
        },
    ]


def _off_switches(reg: F.Registry, setup: str, model: Path | None) -> dict[str, str]:
    """The values that turn off every switch ``setup``'s defaults stop on (its expected stops), as env overrides."""
    return {n: _off_value(reg.features[n]) for n in _expected_stops(setup, _env(model=model))}


def _render_case(out: dict, cases: list[dict], name: str, setup: str, env: dict[str, str], model: Path | None,
                 **extra: object):  # noqa: ANN201 (the parsed command or None)
    """Run ``setup``'s train script with ``env``: a stop records its stderr in ``out["stops"][name]`` and returns
    None; else the printed command's overrides go to ``out["overrides"][name]``, a dry-run case (``extra`` keys added)
    to ``cases``, and the parsed command is returned."""
    proc = _run_script(setup, env)
    if proc.returncode != 0:
        out["stops"][name] = proc.stderr
        return None
    cmd = parse_train_script(REPO / "internal" / setup, env=env)
    out["overrides"][name] = cmd.overrides
    cases.append({"name": name, "config_name": cmd.config_name, "overrides": cmd.overrides,
                  "model": model is not None, **extra})
    return cmd


def _run_script(setup: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "internal" / setup)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class _DryRunServer:
    """The driver in serve mode (``--serve``) in the verl 0.9.1 venv: one process, so one import of verl (about 13 CPU
    s), for the dry runs of every module of this session (this one, ``_sam``, ``_npugraph_ex``, ``_mindspeed``,
    ``_routing``, ``test_verl091_old_log_prob.py``). The driver already runs many commands one after another in one
    process; each request is one module's list, as a run of its own was. It ends at EOF on its stdin: when this
    pytest process closes it (at exit) or dies."""

    SERVE_DONE = "@@verl091-dry-run-done@@"  # the answer's marker, handed to the driver

    def __init__(self, log: Path) -> None:
        self.log = log
        self._log_f = log.open("w")
        self.proc = subprocess.Popen([str(PYTHON), str(DRIVER), "--serve", self.SERVE_DONE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log_f, env=venv_env([REPO]))
        self._out = b""  # stdout read so far, past the last answer
        atexit.register(self.close)

    def run(self, cases_path: Path, out_path: Path, timeout: float) -> None:
        """Ask for the dry run of ``cases_path``; returns when ``out_path`` is written (fails with the log's tail when
        the process ends first or takes longer than ``timeout`` seconds)."""
        assert self.proc.poll() is None, f"the dry-run server ended (exit {self.proc.returncode}):\n{self._tail()}"
        self.proc.stdin.write(json.dumps([str(cases_path), str(out_path)]).encode() + b"\n")
        self.proc.stdin.flush()
        done = f"{self.SERVE_DONE} {out_path}\n".encode()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while done not in self._out:
                left = deadline - time.monotonic()
                assert left > 0 and sel.select(left), f"no dry-run result within {timeout:.0f} s:\n{self._tail()}"
                chunk = os.read(fd, 65536)
                assert chunk, f"the dry-run server ended (exit {self.proc.wait()}):\n{self._tail()}"
                self._out += chunk
        self._out = self._out.partition(done)[2]

    def _tail(self) -> str:
        self._log_f.flush()
        return self.log.read_text()[-4000:]

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_f.close()


_SERVER: list[_DryRunServer] = []  # the session's server, started by the first dry run


def _dry_run(cases: list[dict], tmp: Path) -> dict[str, dict]:
    """The driver on ``cases`` in the verl 0.9.1 venv: {name: {"ok", "stage", "error"}}."""
    (tmp / "cases.json").write_text(json.dumps(cases))
    t0 = time.monotonic()
    if not _SERVER:
        _SERVER.append(_DryRunServer(tmp / "server.log"))
    try:
        _SERVER[0].run(tmp / "cases.json", tmp / "out.json", timeout=900)
    except AssertionError:  # a server that failed or hangs serves no other module: the next one starts its own
        _SERVER.pop().close(kill=True)
        raise
    print(f"dry run of {len(cases)} commands in the verl 0.9.1 venv: {time.monotonic() - t0:.1f} s")
    return {r["name"]: r for r in json.loads((tmp / "out.json").read_text())}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny dense and MoE checkpoints (tokenizer + config) for the tiny setups' model conversion."""
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("dry_run_models")
    return {
        "dense": make_tiny_model(root / "dense", TinySpec()),
        "moe": make_tiny_model(root / "moe", TinySpec(moe=True)),
    }


def _model_of(setup: str, models: dict[str, Path]) -> Path | None:
    if "tiny" not in setup:
        return None
    return models["moe" if setup in F.load_registry().groups["moe"] else "dense"]


@pytest.fixture(scope="module")
def outcomes(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per setup: the script's outcome with its defaults, and the positive / negative controls' dry runs."""
    reg = F.load_registry()
    assert sorted(s.name for s in SCRIPTS) == reg.setups(), "internal/ and features.toml's setups differ"
    cases, result = [], {"stops": {}, "expected": {}, "control_env": {}}
    for script in SCRIPTS:
        setup = script.name
        model = _model_of(setup, tiny_models)
        env = _env(model=model)
        result["expected"][setup] = _expected_stops(setup, env)
        proc = _run_script(setup, env)
        if proc.returncode != 0:
            result["stops"][setup] = (proc.returncode, proc.stderr)
        else:
            cmd = parse_train_script(script, env=env)
            result.setdefault("entry", {})[setup] = cmd.entry_module
            cases.append(
                {
                    "name": setup,
                    "config_name": cmd.config_name,
                    "overrides": cmd.overrides,
                    "model": model is not None,
                    "entry": cmd.entry_module,
                    "report": _report_keys(setup),
                }
            )
            if setup == "train_grpo_tiny_cpu_fully_async.sh":
                cases += _fully_async_negatives(cmd.config_name, cmd.overrides)
            if setup == FULLY_ASYNC[0]:  # SYNCS null: the command without its counted updates, as before
                unset = [o for o in cmd.overrides if not o.startswith(f"{LR_STEPS}=")]
                assert unset != cmd.overrides, f"{setup}: no {LR_STEPS}"
                cases.append(
                    {
                        "name": "negative:fully_async_lr_steps_unset",
                        "config_name": cmd.config_name,
                        "overrides": unset,
                        "entry": FULLY_ASYNC_MAIN,
                    }
                )
            if setup == "train_grpo_tiny_cpu.sh":  # the seed set's reward function keys, on verl 0.9.1
                legacy = [
                    o.removeprefix("reward.") if o.startswith("reward.custom_reward_function.") else o
                    for o in cmd.overrides
                ]
                assert legacy != cmd.overrides, "no reward.custom_reward_function key in the tiny command"
                cases.append(
                    {"name": "negative:legacy_reward_fn", "config_name": cmd.config_name, "overrides": legacy}
                )
    for setup in GRPO:
        off = {n: _off_value(reg.features[n]) for n in result["expected"][setup]} | {"USE_KL_LOSS": "True"}
        result["control_env"][setup] = off
        model = _model_of(setup, tiny_models)
        cmd = parse_train_script(REPO / "internal" / setup, env=_env(off, model))
        cases.append(
            {
                "name": f"control:{setup}",
                "config_name": cmd.config_name,
                "overrides": cmd.overrides,
                "model": model is not None,
            }
        )
        if setup == "train_grpo_tiny_cpu.sh":
            cases.append(
                {
                    "name": "negative:grad_offload",
                    "config_name": cmd.config_name,
                    "overrides": [*cmd.overrides, "actor_rollout_ref.actor.megatron.grad_offload=True"],
                    "model": False,
                }
            )
            cases.append(
                {
                    "name": "negative:mode_sync",
                    "config_name": cmd.config_name,
                    "overrides": [*cmd.overrides, "actor_rollout_ref.rollout.mode=sync"],
                    "model": False,
                }
            )
    for name, setup, extra, _ in WEIGHT_CASES:
        env = {**result["control_env"].get(setup, {}), **extra}
        cmd = parse_train_script(REPO / "internal" / setup, env=_env(env))
        cases.append(
            {
                "name": f"weights:{name}",
                "config_name": cmd.config_name,
                "overrides": cmd.overrides,
                "entry": cmd.entry_module,
                "report": WEIGHT_KEYS,
            }
        )
    moe = GRPO[0]  # MOE_ALLTOALLV on the current set: verl's model.external_lib loads the recipe's mbridge bridge
    cmd = parse_train_script(REPO / "internal" / moe, env=_env({**result["control_env"][moe], "MOE_ALLTOALLV": "True"}))
    cases.append({"name": "switch:MOE_ALLTOALLV", "config_name": cmd.config_name, "overrides": cmd.overrides,
                  "report": MOE_ALLTOALLV_KEYS})
    long_buffer = parse_train_script(REPO / "internal" / DAPO[1], env=_env({"OVERLONG_BUFFER_LEN": "40000"}))
    cases.append(
        {
            "name": "negative:overlong_longer_than_response",
            "config_name": long_buffer.config_name,
            "overrides": long_buffer.overrides,
        }
    )
    result["dry"] = _dry_run(cases, tmp_path_factory.mktemp("dry_run"))
    return result


@pytest.mark.parametrize("setup", [s.name for s in SCRIPTS])
def test_current_set_command_passes_verl091_checks_or_stops_on_one_line(outcomes: dict, setup: str) -> None:
    expected = outcomes["expected"][setup]
    if _weights(setup) == "random":  # checked by the shell before the switches: no random init on verl 0.9.1
        code, stderr = outcomes["stops"][setup]
        errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
        assert code == 2 and len(errors) == 1, stderr
        assert errors[0].startswith("error: weights random on pin set current: dropped: "), errors[0]
        print(f"{setup}: stops: {errors[0][:160]}")
    elif expected:
        assert setup in outcomes["stops"], f"{setup} should stop at {expected[0]} but printed a command"
        code, stderr = outcomes["stops"][setup]
        errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
        assert code == 2 and len(errors) == 1, stderr
        switch = errors[0].removeprefix("error: ").partition("=")[0]
        status = F.load_registry().features[switch].current
        assert switch == expected[0] and status is not None, errors[0]
        if status.status in STOP_STATUSES:
            assert f"on pin set current: {status.status}: " in errors[0], errors[0]
        else:
            assert f"on pin set current: {status.status}, but not in the train scripts there" in errors[0], (
                errors[0]
            )
        print(f"{setup}: stops: {errors[0][:160]}")
    else:
        assert setup not in outcomes["stops"], outcomes["stops"].get(setup)
        r = outcomes["dry"][setup]
        assert r["ok"], f"{setup}: {r['stage']}: {r['error']}"
        print(f"{setup}: clean")


@pytest.mark.parametrize("setup", GRPO)
def test_positive_control_grpo_setups_pass_with_pending_switches_off(outcomes: dict, setup: str) -> None:
    r = outcomes["dry"][f"control:{setup}"]
    assert r["ok"], f"{setup} with {outcomes['control_env'][setup]}: {r['stage']}: {r['error']}"
    print(f"{setup} with {outcomes['control_env'][setup]}: clean")


@pytest.mark.parametrize("setup", DAPO)
def test_dapo_setups_carry_the_seed_settings_on_verl091_keys(outcomes: dict, setup: str) -> None:
    """verl 0.9.1's main_ppo (V1 trainer); every DAPO setting of the seed command under its 0.9.1 key; the group filter
    on with the seed's metric (the V1 trainer's check); verl's DAPO reward manager built with the overlong buffer."""
    assert outcomes["entry"][setup] == "verl.trainer.main_ppo", outcomes["entry"][setup]
    r = outcomes["dry"][setup]
    assert r["ok"], r
    seed = _seed_command(setup, _env())
    got = r["facts"]["keys"]
    for seed_key, key in DAPO_KEYS.items():
        assert seed_key in seed and _same(seed[seed_key], got[key]), (
            seed_key,
            seed.get(seed_key),
            key,
            got[key],
        )
    assert got["reward.custom_reward_function.reward_kwargs.incorrect_score"] == -1.0, got
    facts = r["facts"]
    assert facts["filter_metric"] == seed["algorithm.filter_groups.metric"], facts
    assert facts["reward_manager"] == "DAPORewardManager" and facts["custom_reward_fn"] is True, facts
    buf = facts["overlong_buffer"]
    assert buf["enable"] is True and _same(
        seed["reward_model.reward_kwargs.overlong_buffer_cfg.len"], buf["len"]
    )
    assert _same(seed["reward_model.reward_kwargs.max_resp_len"], facts["max_resp_len"]), facts
    print(f"{setup}: {facts}")


@pytest.mark.parametrize("setup", FULLY_ASYNC)
def test_fully_async_setups_run_verl091_fully_async_main_with_the_seed_settings(
    outcomes: dict, setup: str
) -> None:
    """verl 0.9.1's own fully-async main; the seed command's pools, async_training sizes, partial rollout, old-log-prob
    source and rollout correction under verl 0.9.1's keys; what its rollouter asserts; the run's length in prompts."""
    assert outcomes["entry"][setup] == FULLY_ASYNC_MAIN, outcomes["entry"][setup]
    r = outcomes["dry"][setup]
    assert r["ok"], r
    seed = _seed_command(setup, _env())
    got = r["facts"]["keys"]
    for seed_key, key in FULLY_ASYNC_KEYS.items():
        assert seed_key in seed and _same(seed[seed_key], got[key]), (
            seed_key,
            seed.get(seed_key),
            key,
            got[key],
        )
    for key, value in FULLY_ASYNC_FIXED.items():
        assert got[key] == value, (key, got[key])
    steps = seed.get("trainer.total_training_steps")
    prompts_per_update = int(seed["async_training.require_batches"]) * int(
        seed["actor_rollout_ref.actor.ppo_mini_batch_size"]
    )
    trigger = int(seed["async_training.trigger_parameter_sync_step"])
    if steps is None or steps == "null":  # the epochs decide on both sets; the updates counted from the data
        assert got["rollout.total_rollout_steps"] is None, got
        prompts = TRAIN_ROWS * int(seed["trainer.total_epochs"])  # fully_async_rollouter.py:405
        assert got[LR_STEPS] == prompts // prompts_per_update, (prompts, prompts_per_update, got)
        # verl's own count of the run (weight syncs, fully_async_rollouter.py:498-501) from the same prompts
        assert got[LR_STEPS] // trigger == int(prompts / (prompts_per_update * trigger)), got
    else:  # verl counts prompts: updates = prompts / (prompts per update x updates per sync)
        assert got["rollout.total_rollout_steps"] == int(steps) * prompts_per_update, (steps, got)
        assert got[LR_STEPS] == int(steps), (steps, got)
    assert r["facts"]["custom_reward_fn"] is True, r["facts"]
    print(f"{setup}: {got}")


def test_fully_async_run_length_without_syncs(outcomes: dict, tmp_path: Path) -> None:
    """SYNCS null on the current set: the command without the counted updates (the yaml's -1) fails the actor's LR
    scheduler; an unreadable TRAIN_FILE, or one with fewer prompts than an update, stops the script with one line
    naming SYNCS; SYNCS given prints the command without reading data (SYNCS x TRIGGER_SYNC_STEPS updates)."""
    unset = outcomes["dry"]["negative:fully_async_lr_steps_unset"]
    assert not unset["ok"] and unset["stage"] == LR_STAGE, unset
    assert unset["error"] == "AssertionError at optimizer_param_scheduler.py:156", unset
    setup = FULLY_ASYNC[0]
    for train_file, start in (
        (tmp_path / "missing.parquet", "no readable parquet file: set SYNCS"),
        (
            _write_train_file(tmp_path / "small.parquet", 3),
            "has 3 prompts x TOTAL_EPOCHS 10, fewer than one update",
        ),
    ):
        proc = _run_script(setup, _env({"TRAIN_FILE": str(train_file)}))
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        error = errors[0]
        assert error.startswith("error: SYNCS=null on pin set current: ") and start in error, error
        print(f"{setup} with TRAIN_FILE {train_file.name}: {errors[0][:200]}")
    given = _env({"TRAIN_FILE": str(tmp_path / "missing.parquet"), "SYNCS": "5"})
    cmd = parse_train_script(REPO / "internal" / setup, env=given).override_map()
    assert cmd[LR_STEPS] == str(5 * int(cmd["async_training.trigger_parameter_sync_step"])), cmd[LR_STEPS]


@pytest.mark.parametrize("case", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_weight_source_switches_on_the_current_set(outcomes: dict, case: tuple) -> None:
    """USE_DIST_CKPT (32B) and USE_MBRIDGE (30B-A3B fully async) on verl 0.9.1's Megatron engine: the command passes
    the dry run; actor and ref read the dist checkpoint at the seed command's DIST_CKPT_PATH exactly when the seed
    command does (USE_DIST_CKPT=True, USE_MBRIDGE=False), else the HF files; the Bridge stays on (use_mbridge True,
    the pinned mbridge: vanilla_mbridge True) whatever the switch."""
    name, setup, extra, dist = case
    r = outcomes["dry"][f"weights:{name}"]
    assert r["ok"], r
    got = r["facts"]["keys"]
    seed = _seed_command(setup, _env(extra))
    for role in ("actor", "ref"):
        m = f"actor_rollout_ref.{role}.megatron."
        assert got[m + "use_dist_checkpointing"] is dist, (role, got)
        assert seed[m + "use_dist_checkpointing"] == str(dist), (role, seed[m + "use_dist_checkpointing"])
        if dist:
            assert got[m + "dist_checkpointing_path"] == seed[m + "dist_checkpointing_path"], (role, got)
        assert got[m + "use_mbridge"] is True and got[m + "vanilla_mbridge"] is True, (role, got)
    print(f"{setup} with {extra}: {got}")


def test_moe_alltoallv_switch_on_the_current_set(outcomes: dict) -> None:
    """MOE_ALLTOALLV=True on the 235B GRPO script (server mode, the only mode there; the seed set's rule against
    server mode holds on the seed set only): the command passes the dry run with verl's external_lib naming the
    recipe's bridge module and the switch key on."""
    r = outcomes["dry"]["switch:MOE_ALLTOALLV"]
    assert r["ok"], r
    got = r["facts"]["keys"]
    assert got[MOE_ALLTOALLV_KEYS[0]] == "qwen3_rl.moe.alltoallv_verl091" and got[MOE_ALLTOALLV_KEYS[1]] is True, got


def test_negative_controls_dapo_and_fully_async(outcomes: dict, tiny_models: dict[str, Path]) -> None:
    dry = outcomes["dry"]
    batch = dry["negative:fully_async_batch"]
    assert not batch["ok"] and batch["stage"] == "FullyAsyncRollouter", batch
    assert "train_batch_size must be zero" in batch["error"], batch
    no_path = dry["negative:fully_async_no_searchpath"]
    assert (
        not no_path["ok"] and no_path["stage"] == "compose" and "ppo_megatron_trainer" in no_path["error"]
    ), no_path
    long_buffer = dry["negative:overlong_longer_than_response"]
    assert not long_buffer["ok"] and long_buffer["stage"] == "load_reward_manager", long_buffer
    assert "max_resp_len must be larger than overlong_buffer.len" in long_buffer["error"], long_buffer
    legacy = dry["negative:legacy_reward_fn"]
    assert legacy["ok"] and legacy["facts"]["custom_reward_fn"] is False, legacy  # accepted, and unread
    assert dry["train_grpo_tiny_cpu.sh"]["facts"]["custom_reward_fn"] is True, dry["train_grpo_tiny_cpu.sh"]
    for setup, extra, start in (
        (DAPO[1], {"MAX_NUM_GEN_BATCHES": "3"}, "error: MAX_NUM_GEN_BATCHES=3 on pin set current: dropped: "),
        (
            "train_grpo_tiny_cpu_fully_async.sh",
            {"ROLLOUT_MODE": "sync"},
            "error: ROLLOUT_MODE=sync on pin set current: it takes only async",
        ),
    ):
        proc = _run_script(setup, _env(extra, _model_of(setup, tiny_models)))
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert errors[0].startswith(start), errors[0]
        print(f"{setup} with {extra}: {errors[0][:140]}")


def test_negative_controls_fail_the_dry_run(outcomes: dict, tiny_models: dict[str, Path]) -> None:
    grad = outcomes["dry"]["negative:grad_offload"]
    assert not grad["ok"] and grad["stage"] == "compose" and "grad_offload" in grad["error"], grad
    sync = outcomes["dry"]["negative:mode_sync"]
    assert not sync["ok"] and sync["stage"] == "omega_conf_to_dataclass(actor_rollout_ref.rollout)", sync
    assert "sync" in sync["error"], sync
    proc = _run_script("train_grpo_tiny_cpu.sh", _env({"ROLLOUT_MODE": "sync"}, tiny_models["dense"]))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: ROLLOUT_MODE=sync on pin set current: it takes only async"), errors[0]


def test_seed_set_renders_the_seed_keys() -> None:
    """The seed set keeps its keys (golden commands: tests/test_train_configs.py); the current set carries
    OFFLOAD's verl 0.9.1 keys (no grad_offload), no key of a switch whose status there is upstream, no key of the
    seed set's verl seam (qwen3_rl.*), and only async."""
    seed = parse_train_script(REPO / "internal" / "train_grpo_tiny_cpu.sh", env=_env({"PIN_SET": "seed"}))
    assert "actor_rollout_ref.actor.megatron.grad_offload=False" in seed.overrides
    off = {"SERVER_API_KEY": "False", "SERVER_HTTP_HOST": "node"}  # not wired there yet (test above)
    cur = parse_train_script(REPO / "internal" / "train_grpo_tiny_cpu.sh", env=_env(off))
    keys = [o.partition("=")[0] for o in cur.overrides]
    assert "actor_rollout_ref.actor.megatron.param_offload" in keys
    assert "actor_rollout_ref.actor.megatron.optimizer_offload" in keys
    assert not [k for k in keys if "grad_offload" in k or k.lstrip("+").startswith("qwen3_rl.")], keys
    upstream = [
        s.key
        for f in F.load_registry().features.values()
        if f.current and f.current.status == "upstream"
        for s in f.sets
    ]
    assert upstream and not set(keys) & set(upstream), set(keys) & set(upstream)
    assert "actor_rollout_ref.rollout.mode=async" in cur.overrides
