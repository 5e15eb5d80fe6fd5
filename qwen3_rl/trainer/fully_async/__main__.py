"""Hydra entry: ``python -m qwen3_rl.trainer.fully_async --config-name fully_async_megatron_trainer key=value ...``
(the config: ``qwen3_rl/trainer/config/fully_async_megatron_trainer.yaml``)."""

from __future__ import annotations

from typing import Any

import hydra

from qwen3_rl.trainer.fully_async.trainer import run_fully_async


@hydra.main(config_path="../config", config_name="fully_async_megatron_trainer", version_base=None)
def main(config: Any) -> None:
    run_fully_async(config)


if __name__ == "__main__":
    main()
