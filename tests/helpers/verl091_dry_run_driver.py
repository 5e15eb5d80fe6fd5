"""verl 0.9.1's own start-up checks on train-script commands, on CPU and without Ray (run in the verl 0.9.1 venv).

``python verl091_dry_run_driver.py CASES.json OUT.json``. CASES.json: a list of ``{"name", "config_name",
"overrides", "model"}`` (``overrides``: the command's Hydra overrides, in order; ``model``: also convert
``actor_rollout_ref.model``, which reads the model's files). For each case, what ``verl.trainer.main_ppo.main``
does before Ray starts (``main_ppo.py:166-182``), then the conversions the V1 trainer and its workers make:

1. Hydra compose of ``verl/trainer/config/<config_name>.yaml`` with the overrides (an unknown key fails here);
2. ``auto_set_device(config)`` (on this host verl falls back to its ``nvidia`` platform: ``trainer.device``
   becomes ``cuda``, as it would under ``main``);
3. ``validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))``;
4. ``omega_conf_to_dataclass`` of ``actor_rollout_ref.actor``, ``.rollout``, ``.rollout.checkpoint_engine``
   (``trainer/ppo/v1/trainer_base.py:381``), ``algorithm``, and with ``model`` ``actor_rollout_ref.model``
   (``trainer_base.py:703``).

OUT.json: a list of ``{"name", "ok", "stage", "error"}`` (``stage``: the first step that failed, "" when ok;
``error``: its exception, one line, at most 600 characters).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from verl.trainer.main_ppo import validate_config
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import auto_set_device

CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"
SECTIONS = (
    "actor_rollout_ref.actor",
    "actor_rollout_ref.rollout",
    "actor_rollout_ref.rollout.checkpoint_engine",
    "algorithm",
)


def dry_run(config_name: str, overrides: list[str], model: bool) -> tuple[str, str]:
    """(stage, error) of the first failing step of one command; ("", "") when every step passes."""
    stage = "compose"
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg: DictConfig = compose(config_name=config_name, overrides=overrides)
        stage = "auto_set_device"
        auto_set_device(cfg)
        stage = "validate_config"
        validate_config(
            config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
        )
        for path in (*SECTIONS, *(("actor_rollout_ref.model",) if model else ())):
            stage = f"omega_conf_to_dataclass({path})"
            omega_conf_to_dataclass(OmegaConf.select(cfg, path))
    except Exception as exc:  # noqa: BLE001 - every failure is a result, reported per case
        last = traceback.format_exception_only(type(exc), exc)[-1].strip().replace("\n", " ")
        return stage, last[:600]
    return "", ""


def main(argv: list[str]) -> int:
    cases = json.loads(Path(argv[1]).read_text())
    out = []
    for case in cases:
        stage, error = dry_run(case["config_name"], list(case["overrides"]), bool(case.get("model")))
        out.append({"name": case["name"], "ok": not stage, "stage": stage, "error": error})
        print(f"{case['name']}: {'ok' if not stage else stage + ': ' + error}", flush=True)
    Path(argv[2]).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
