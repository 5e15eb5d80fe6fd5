"""``rollout.cudagraph_capture_sizes`` for vLLM's ``CompilationConfig`` (verl patch 0007).

verl 0.6.1's SPMD vLLM rollout (``vllm_rollout_spmd.py``) builds the ``CompilationConfig`` only when
``cudagraph_capture_sizes`` is an OmegaConf ``ListConfig``. The Megatron worker hands it the
``RolloutConfig`` dataclass, whose value is a plain list, so upstream drops the sizes with a warning and
vLLM captures its default graph sizes. The fix accepts list / tuple / ListConfig and passes plain ints.

Off switch (default on): ``actor_rollout_ref.rollout.plain_list_capture_sizes=false`` restores
upstream's check exactly: only a ``ListConfig`` is used (passed on unchanged); anything else is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qwen3_rl.compat.switches import read_switch

__all__ = ["CONFIG_KEY", "capture_sizes_for_vllm"]

#: Key of the switch inside verl's rollout config (``actor_rollout_ref.rollout.<CONFIG_KEY>``).
CONFIG_KEY = "plain_list_capture_sizes"


def capture_sizes_for_vllm(sizes: Any, rollout_config: Mapping[str, object] | None) -> Any:
    """The ``cudagraph_capture_sizes`` to give vLLM's ``CompilationConfig``, or None to drop them.

    Args:
        sizes: ``rollout_config.cudagraph_capture_sizes`` (non-empty; the caller checks that).
        rollout_config: the rollout config holding the switch :data:`CONFIG_KEY` (missing = on).

    Returns:
        Switch on: ``[int, ...]`` for a list, tuple or ListConfig, else None. Switch off (upstream):
        ``sizes`` itself if it is a ListConfig, else None. None means the caller logs upstream's warning.
    """
    from omegaconf import ListConfig

    if not read_switch(rollout_config, CONFIG_KEY, True):
        return sizes if isinstance(sizes, ListConfig) else None
    if isinstance(sizes, ListConfig | list | tuple):
        return [int(x) for x in sizes]
    return None
