"""verl 0.9.1's own start-up checks on train-script commands, on CPU and without Ray (run in the verl 0.9.1 venv).

``python verl091_dry_run_driver.py CASES.json OUT.json``, or ``python verl091_dry_run_driver.py --serve MARK``: the
same for each line ``["CASES.json", "OUT.json"]`` (JSON) read from stdin, answered by a line ``MARK OUT.json`` on
stdout (the client picks the marker), until EOF (the test modules' dry runs share one process: verl imported once per pytest session).
CASES.json: a list of ``{"name", "config_name", "overrides", "model", "entry"}`` (``overrides``: the command's Hydra
overrides, in order; ``model``: also convert ``actor_rollout_ref.model``, which reads the model's files;
``entry``: the command's ``-m`` module,
``verl.trainer.main_ppo`` when absent, or verl's fully-async main; optional ``report``: keys whose values in the
final config go to ``facts["keys"]``). For ``verl.trainer.main_ppo``, what its ``main``
does before Ray starts (``main_ppo.py:166-182``), then the conversions and checks the V1 trainer and its workers make:

1. Hydra compose of ``verl/trainer/config/<config_name>.yaml`` with the overrides (an unknown key fails here);
2. ``auto_set_device(config)`` (on this host verl falls back to its ``nvidia`` platform: ``trainer.device``
   becomes ``cuda``, as it would under ``main``);
3. ``validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))``;
4. ``omega_conf_to_dataclass`` of ``actor_rollout_ref.actor``, ``.rollout``, ``.rollout.checkpoint_engine``
   (``trainer/ppo/v1/trainer_base.py:381``), ``algorithm``, and with ``model`` ``actor_rollout_ref.model``
   (``trainer_base.py:703``);
5. the V1 trainer's group-filter check, ``PPOTrainer._resolve_filter_groups_metric`` (``trainer_base.py:187-211``,
   run when it builds its replay buffer), on the config alone;
6. the reward loop worker's reward manager, ``load_reward_manager(config, tokenizer=None, ...)``
   (``trainer/ppo/reward.py:111-156``, called at ``experimental/reward_loop/reward_loop.py:131-136``): the registry
   lookup, the custom reward function's import and the manager's own checks (the DAPO manager's overlong buffer,
   ``experimental/reward_loop/reward_manager/dapo.py:39-50``).

For ``verl.experimental.fully_async_policy.fully_async_main``: the compose of
``experimental/fully_async_policy/config/<config_name>.yaml``, then what its ``main`` does before Ray starts
(``fully_async_main.py:222-238``: ``auto_set_device``, the rollout pool's sizes into ``actor_rollout_ref.rollout``,
``migrate_legacy_reward_impl``; it runs no ``validate_config``), then ``FullyAsyncRollouter.__init__`` up to its
dataset (its asserts, ``fully_async_rollouter.py:350-365``; the dataset reader is replaced by one that stops the
constructor there) and its ``_validate_config`` (``:729-733``), then steps 4 and 6, then the actor's Megatron LR
scheduler as its engine builds it (``get_megatron_optimizer_param_scheduler(optimizer, config=actor.optim)``,
``workers/engine/megatron/transformer_impl.py:552-557``) on a one-parameter torch optimizer: the trainer builds its
workers before the rollouter counts the run's updates (``fully_async_main.py:78-92``), so the command's
``actor.optim.total_training_steps`` must be > 0 there (megatron ``optimizer_param_scheduler.py:156``).

OUT.json: a list of ``{"name", "ok", "stage", "error", "facts"}`` (``stage``: the first step that failed, "" when
ok; ``error``: its exception, one line, at most 600 characters; ``facts``: what the steps resolved: the group-filter
metric (``filter_metric``, None = off), the reward manager's class (``reward_manager``), whether the custom reward
function is loaded (``custom_reward_fn``), the manager's overlong buffer and ``max_resp_len`` (DAPO manager only)).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf
from verl.trainer.main_ppo import validate_config
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import auto_set_device

CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"
FULLY_ASYNC_ENTRY = "verl.experimental.fully_async_policy.fully_async_main"
FULLY_ASYNC_CONFIG_DIR = Path(verl.__file__).parent / "experimental" / "fully_async_policy" / "config"
SECTIONS = (
    "actor_rollout_ref.actor",
    "actor_rollout_ref.rollout",
    "actor_rollout_ref.rollout.checkpoint_engine",
    "algorithm",
)


class _ReachedDataset(Exception):
    """Raised in place of reading the dataset: the rollouter's constructor got past its config checks."""


def _reached_dataset(*args: Any, **kwargs: Any) -> None:
    raise _ReachedDataset


def _fully_async_rollouter_checks(cfg: DictConfig) -> None:
    """``FullyAsyncRollouter.__init__`` (the class under Ray's decorator) up to its dataset, then its
    ``_validate_config``: every assert on the config it makes before it reads data or starts workers."""
    from verl.experimental.fully_async_policy import fully_async_rollouter as fr

    cls = fr.FullyAsyncRollouter.__ray_metadata__.modified_class
    obj = cls.__new__(cls)
    real = fr.create_rl_dataset
    fr.create_rl_dataset = _reached_dataset
    try:
        cls.__init__(obj, config=cfg, tokenizer=None, processor=None, device_name=cfg.trainer.device)
    except _ReachedDataset:
        pass
    else:
        raise AssertionError("FullyAsyncRollouter.__init__ never read its dataset")
    finally:
        fr.create_rl_dataset = real
    cls._validate_config(obj)


def _actor_lr_scheduler(cfg: DictConfig) -> None:
    """verl 0.9.1's Megatron LR scheduler from the actor's optim config, as the engine builds it, on a torch SGD over
    one parameter (the scheduler only sets the param groups' lr / weight decay)."""
    import torch
    from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler

    optim = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(optim.lr))
    get_megatron_optimizer_param_scheduler(opt, config=optim)


def _reward_facts(cfg: DictConfig) -> dict[str, Any]:
    """The reward loop worker's reward manager built from ``cfg``, and what it resolved."""
    from verl.trainer.ppo.reward import get_default_compute_score, load_reward_manager

    manager = load_reward_manager(cfg, None, reward_router_address=None, reward_model_tokenizer=None)
    default = get_default_compute_score(cfg.reward.reward_manager.name)
    overlong = getattr(manager, "overlong_buffer_cfg", None)
    return {
        "reward_manager": type(manager).__name__,
        "custom_reward_fn": manager.compute_score is not default,
        "overlong_buffer": None if overlong is None else OmegaConf.to_container(overlong),
        "max_resp_len": getattr(manager, "max_resp_len", None),
    }


def _plain(value: Any) -> Any:
    """A config value as JSON data (a node as a dict / list)."""
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def dry_run(
    config_name: str, overrides: list[str], model: bool, entry: str, report: list[str]
) -> tuple[str, str, dict[str, Any]]:
    """(stage, error, facts) of one command: the first failing step ("", "" when every step passes)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    fully_async = entry == FULLY_ASYNC_ENTRY
    facts: dict[str, Any] = {}
    stage = "compose"
    try:
        config_dir = FULLY_ASYNC_CONFIG_DIR if fully_async else CONFIG_DIR
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg: DictConfig = compose(config_name=config_name, overrides=overrides)
        stage = "auto_set_device"
        auto_set_device(cfg)
        if fully_async:
            from verl.experimental.reward_loop import migrate_legacy_reward_impl

            stage = "fully_async_main"
            cfg.actor_rollout_ref.rollout.nnodes = cfg.rollout.nnodes
            cfg.actor_rollout_ref.rollout.n_gpus_per_node = cfg.rollout.n_gpus_per_node
            cfg = migrate_legacy_reward_impl(cfg)
            stage = "FullyAsyncRollouter"
            _fully_async_rollouter_checks(cfg)
        else:
            stage = "validate_config"
            validate_config(
                config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
            )
        for path in (*SECTIONS, *(("actor_rollout_ref.model",) if model else ())):
            stage = f"omega_conf_to_dataclass({path})"
            omega_conf_to_dataclass(OmegaConf.select(cfg, path))
        if fully_async:
            stage = "get_megatron_optimizer_param_scheduler(actor.optim)"
            _actor_lr_scheduler(cfg)
        else:
            stage = "_resolve_filter_groups_metric"
            facts["filter_metric"] = PPOTrainer._resolve_filter_groups_metric(SimpleNamespace(config=cfg))
        facts["keys"] = {k: _plain(OmegaConf.select(cfg, k)) for k in report}
        stage = "load_reward_manager"
        facts.update(_reward_facts(cfg))
    except Exception as exc:  # noqa: BLE001 - every failure is a result, reported per case
        last = traceback.format_exception_only(type(exc), exc)[-1].strip().replace("\n", " ")
        if not str(exc):  # a bare assert: where it failed
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            last += f" at {Path(frame.filename).name}:{frame.lineno}"
        return stage, last[:600], facts
    return "", "", facts


def run_cases(cases_path: str, out_path: str, log=sys.stdout) -> None:
    """The dry run of every case in ``cases_path`` (CASES.json), in order; the results go to ``out_path`` (OUT.json)."""
    cases = json.loads(Path(cases_path).read_text())
    out = []
    for case in cases:
        stage, error, facts = dry_run(
            case["config_name"],
            list(case["overrides"]),
            bool(case.get("model")),
            case.get("entry") or "verl.trainer.main_ppo",
            list(case.get("report") or []),
        )
        out.append({"name": case["name"], "ok": not stage, "stage": stage, "error": error, "facts": facts})
        print(f"{case['name']}: {'ok' if not stage else stage + ': ' + error} {facts}", file=log, flush=True)
    Path(out_path).write_text(json.dumps(out, indent=1))


def main(argv: list[str]) -> int:
    if argv[1] != "--serve":
        run_cases(argv[1], argv[2])
        return 0
    # serve mode: one process (one import of verl) for the dry runs of several test modules; each request a line
    # ["CASES.json", "OUT.json"] on stdin, answered by "MARK OUT.json" (stdout) when OUT.json is written; ends at EOF
    mark = argv[2]
    for line in sys.stdin:
        cases_path, out_path = json.loads(line)
        run_cases(cases_path, out_path, log=sys.stderr)
        print(f"{mark} {out_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
