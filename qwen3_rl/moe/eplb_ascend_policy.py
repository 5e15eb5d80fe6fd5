"""Our EPLB placement behind vLLM-Ascend's EPLB policy interface, 0.13 and 0.23 (no vllm_ascend import here).

vLLM-Ascend 0.13 (``vllm_ascend/eplb/core/policy/policy_abstract.py``) defines
``EplbPolicy.__init__(self, config: DynamicConfig)`` and
``rebalance_experts(self, current_expert_table, expert_workload) -> (changed, priority, new_table)``;
``PolicyFactory.generate_policy(policy_type: int, config)`` (``policy_factory.py``) maps
``additional_config["eplb_policy_type"]`` (or ``additional_config["eplb_config"]["eplb_policy_type"]``,
``ascend_config.py``) to a class; ``EplbWorker`` (``eplb_worker.py``) calls the policy in the EPLB
subprocess with the arrays below. vLLM-Ascend 0.23.0.post1 builds the class with no arguments
(``policy_factory.py:38``) and reads ``additional_config["eplb_config"]["eplb_policy_type"]`` only; the current
set's patch ``vllm_ascend 0002 eplb_policy_registry`` lets the plugin register type 4 there
(``qwen3_rl.vllm_plugin``). The arrays:

* ``current_expert_table``: ``[layers, ranks, slots]`` int tensor, logical expert id per physical slot;
* ``expert_workload``: ``[layers, ranks, slots]`` int64 tensor, tokens each slot served since the last update
  (``FusedMoE.moe_load`` per rank, all-gathered by ``EplbUpdator.compute_and_set_moe_load``).

It then rejects (per layer, falling back to the old table) a new table in which an expert is missing, a
rank holds two replicas of one expert, or an expert that stays on a rank changed slot
(``EplbWorker.check_expert_placement``). This adapter satisfies all three: the migration-aware placement
keeps a retained expert in its old slot and never puts two replicas of one expert on one rank.

The class does not subclass ``vllm_ascend``'s ``EplbPolicy`` (importing vllm_ascend needs torch_npu);
it has the same constructor and method, which is all ``PolicyFactory`` and ``EplbWorker`` use.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# qwen3_rl.moe.eplb (numba) is imported where it is used: the vLLM plugin imports this module in every vLLM
# process of a vLLM-Ascend 0.23 with the policy registry (qwen3_rl.vllm_plugin), most of which never rebalance.

#: The ``eplb_policy_type`` integer our vllm-ascend patch registers in ``PolicyFactory`` (0-3 are upstream's).
ASCEND_POLICY_TYPE = 4


class PackingAwareAscendPolicy:
    """vLLM-Ascend ``EplbPolicy``-compatible adapter around ``rebalance_experts_migration_aware``.

    Args:
        config: vLLM-Ascend's ``DynamicConfig`` (kept as ``self.config``; optional attributes
            ``migration_weight`` and ``min_gain`` override the defaults below).
        migration_weight: peak-to-mean ratio one moved expert slot must buy (see ``qwen3_rl.moe.eplb``).
        min_gain: report ``changed = 1`` only if the mean balancedness gain over layers is at least this.
    """

    def __init__(self, config: Any = None, migration_weight: float = 0.002, min_gain: float = 0.0) -> None:
        from qwen3_rl.moe.eplb import EplbOptions

        self.config = config
        self.migration_weight = float(getattr(config, "migration_weight", migration_weight))
        self.min_gain = float(getattr(config, "min_gain", min_gain))
        self.options = EplbOptions(distinct=True)

    def rebalance_experts(
        self, current_expert_table: Any, expert_workload: Any
    ) -> tuple[int, np.ndarray, torch.Tensor]:
        """New placement from the per-slot loads.

        Args:
            current_expert_table: [layers, ranks, slots] logical expert id per slot (tensor, array or list).
            expert_workload: [layers, ranks, slots] tokens per slot.

        Returns:
            changed: 1 if the placement changed and balancedness improved by >= ``min_gain``, else 0.
            priority: layer indices ordered by decreasing balancedness gain (layers to update first).
            new_table: [layers, ranks, slots] int64 tensor.
        """
        from qwen3_rl.moe.eplb import balancedness, rebalance_experts_migration_aware

        table = torch.as_tensor(np.asarray(current_expert_table), dtype=torch.int64)
        work = torch.as_tensor(np.asarray(expert_workload), dtype=torch.float64)
        if table.dim() != 3 or table.shape != work.shape:
            raise ValueError(
                f"table {tuple(table.shape)} and workload {tuple(work.shape)} must be equal [L, R, S]"
            )
        num_layers, num_ranks, slots = table.shape
        prev = table.reshape(num_layers, num_ranks * slots)
        num_log = int(prev.max()) + 1
        loads = torch.zeros(num_layers, num_log, dtype=torch.float64)
        loads.scatter_add_(1, prev, work.reshape(num_layers, -1))
        new, _, _, moved = rebalance_experts_migration_aware(
            loads, num_ranks * slots, 1, 1, num_ranks, prev, self.migration_weight, self.options
        )
        before = balancedness(loads.numpy(), prev.numpy(), num_ranks)
        after = balancedness(loads.numpy(), new.numpy(), num_ranks)
        gain = after - before
        priority = np.argsort(-gain, kind="stable")
        changed = int(bool(moved.sum() > 0) and float(gain.mean()) >= self.min_gain)
        return changed, priority, new.reshape(num_layers, num_ranks, slots)


def extra_policies() -> dict[int, type]:
    """Policy types our vllm-ascend patches add to ``PolicyFactory.generate_policy``'s table: the seed set's through
    vLLM's seam factory ``ascend_eplb_policies``, the current set's through ``register_eplb_policy``.

    vLLM-Ascend selects the type by ``additional_config["eplb_config"]["eplb_policy_type"]`` (0.13 also the
    deprecated top-level ``additional_config["eplb_policy_type"]``), read in ``ascend_config.py``.
    """
    return {ASCEND_POLICY_TYPE: PackingAwareAscendPolicy}
