"""Per-group HCCL op-expansion mode for vLLM-Ascend process groups (patch ``vllm_ascend/0001``).

Problem: HCCL's op-expansion mode (where a collective is expanded and launched: host, AI CPU or
AI Vector cores) is in vLLM-Ascend 0.13.0 only settable process-wide, through the environment
variable ``HCCL_OP_EXPANSION_MODE`` (read by HCCL itself; vLLM-Ascend only reads it to size ACL
graphs, ``vllm_ascend/utils.py:479``). The recipe's long decodes saw the TP group's all-gather time
out under the process-wide mode; the fix is to give the TP communicator its own mode while the
other groups keep theirs.

Mechanism: vLLM-Ascend creates every device group with ``ProcessGroupHCCL.Options`` built by
``create_hccl_pg_options(group_name)`` (``vllm_ascend/utils.py:931``) from the dict returned by
``get_hccl_config_for_pg_options(group_name)`` (``vllm_ascend/utils.py:939``; the TP group is named
``"tp"``, ``vllm/distributed/parallel_state.py:1343``). torch_npu 2.8.0.post2 copies the key
``"hccl_op_expansion_mode"`` of that dict into ``HcclCommConfig.hcclOpExpansionMode``
(``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp:3332``, tag v7.3.0-pytorch2.8.0), whose values are
0 default, 1 host, 2 AI CPU, 3 AIV (``third_party/hccl/inc/hccl/hccl_types.h:131``). The patch
passes that dict through :func:`with_op_expansion_mode`.

Switch (default: none, behaviour unchanged): vLLM's ``additional_config`` (a declared engine
argument that reaches every worker), key ``qwen3_rl.hccl_op_expansion_mode``, a mapping from
group name to mode, e.g. ``{"qwen3_rl": {"hccl_op_expansion_mode": {"tp": "aicpu"}}}``. From verl:
``actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.qwen3_rl.hccl_op_expansion_mode.tp=aicpu``.
Groups for which vLLM-Ascend passes no options (``mc2``: ``None``, see its FIXME) are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "MODES",
    "OPTION_KEY",
    "op_expansion_modes",
    "parse_mode",
    "with_op_expansion_mode",
]

#: Top-level key of our settings inside vLLM's ``additional_config``.
ADDITIONAL_CONFIG_KEY = "qwen3_rl"
#: Sub-key holding ``{group_name: mode}``; also the ``hccl_config`` key torch_npu reads.
OPTION_KEY = "hccl_op_expansion_mode"
#: Mode names accepted in the config and the ``HcclCommConfig.hcclOpExpansionMode`` values.
MODES: dict[str, int] = {"default": 0, "host": 1, "aicpu": 2, "aiv": 3}


def parse_mode(value: object) -> int:
    """A mode name (case-insensitive, ``"ai_cpu"`` accepted) or its integer, as the HCCL value.

    Raises:
        ValueError: unknown name or integer outside ``MODES``' values.
    """
    if isinstance(value, bool):
        raise ValueError(f"{OPTION_KEY}: expected a mode name or integer, got {value!r}")
    if isinstance(value, int):
        if value in MODES.values():
            return value
        raise ValueError(f"{OPTION_KEY}: integer mode must be one of {sorted(MODES.values())}, got {value}")
    if isinstance(value, str):
        key = value.strip().lower().replace("_", "").replace("-", "")
        if key in MODES:
            return MODES[key]
    raise ValueError(f"{OPTION_KEY}: unknown mode {value!r}; use one of {sorted(MODES)}")


def op_expansion_modes(additional_config: Mapping[str, Any] | None) -> dict[str, int]:
    """``{group_name: HCCL mode value}`` configured in vLLM's ``additional_config`` ({} if none)."""
    if not additional_config:
        return {}
    ours = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if ours is None:
        return {}
    if not isinstance(ours, Mapping):
        raise ValueError(f"additional_config.{ADDITIONAL_CONFIG_KEY} must be a mapping, got {ours!r}")
    per_group = ours.get(OPTION_KEY)
    if per_group is None:
        return {}
    if not isinstance(per_group, Mapping):
        raise ValueError(
            f"additional_config.{ADDITIONAL_CONFIG_KEY}.{OPTION_KEY} must map group names to modes, "
            f"got {per_group!r}")
    return {str(group): parse_mode(mode) for group, mode in per_group.items()}


def with_op_expansion_mode(group_name: str | None, hccl_config: dict[str, Any] | None,
                           additional_config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``hccl_config`` for ``group_name`` with the configured op-expansion mode added.

    Args:
        group_name: the vLLM group name (``"tp"``, ``"dp"``, ``"ep"``, ...).
        hccl_config: what vLLM-Ascend would pass (``{"hccl_buffer_size": <MB>}``) or ``None``
            (no options for this group).
        additional_config: ``VllmConfig.additional_config``.

    Returns:
        ``hccl_config`` unchanged (same object) when nothing is configured for the group or it is
        ``None``; otherwise a new dict with ``"hccl_op_expansion_mode": <int>`` added.
    """
    if hccl_config is None or not group_name:
        return hccl_config
    mode = op_expansion_modes(additional_config).get(group_name)
    if mode is None:
        return hccl_config
    return {**hccl_config, OPTION_KEY: mode}
