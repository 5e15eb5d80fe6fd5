"""Reading the off switches of the always-on verl fixes (0004, 0009, 0011) from verl's rollout config.

Each fix is on by default; ``actor_rollout_ref.rollout.<key>=false`` restores verl 0.6.1's own
behaviour, so a first cluster run that misbehaves can be bisected without editing a patch.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["read_switch"]


def read_switch(rollout_config: Mapping[str, object] | None, key: str, default: bool = True) -> bool:
    """The bool ``rollout_config[key]``; ``default`` when the config or the key is missing (or null).

    Args:
        rollout_config: the ``actor_rollout_ref.rollout`` mapping: an OmegaConf DictConfig, verl's
            ``RolloutConfig`` dataclass (a Mapping) or a dict.
        key: the switch's key inside the rollout config.
        default: the value for a missing key (the fix's default: on).

    Raises:
        TypeError: the value is not a bool (``"false"`` would otherwise count as on).
    """
    value = default if rollout_config is None else rollout_config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TypeError(f"rollout.{key} must be a bool, got {value!r}")
    return value
