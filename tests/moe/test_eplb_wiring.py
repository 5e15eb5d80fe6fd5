"""EPLB switch -> vLLM-Ascend policy factory (vllm_ascend patch 0004): the keys a 235B train script emits
with ROLLOUT_EPLB=True, composed with the patched verl config into the rollout's vLLM engine kwargs, are
read by the PATCHED vLLM-Ascend 0.13 ``AscendConfig`` and select our policy in the PATCHED
``PolicyFactory``; the env var vLLM-Ascend also requires reaches its check. vllm_ascend imports on CPU
except ``vllm_ascend.utils`` (torch_npu), which is stood in for the one function ``AscendConfig`` calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qwen3_rl.moe.eplb_ascend_policy import ASCEND_POLICY_TYPE, PackingAwareAscendPolicy, extra_policies
from qwen3_rl.tools.launch import parse_train_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "internal" / "train_grpo_qwen3_235b_128die_true_weight.sh"
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}


def test_extra_policies_table() -> None:
    assert extra_policies() == {ASCEND_POLICY_TYPE: PackingAwareAscendPolicy} and ASCEND_POLICY_TYPE == 4


def test_train_script_switch_reaches_policy_factory(vllm_ascend_on_path, ascend_config, rollout_engine_kwargs,
                                                     monkeypatch) -> None:
    from vllm_ascend.eplb.core.eplb_utils import EPLBParamUtils
    from vllm_ascend.eplb.core.policy.policy_abstract import DynamicConfig
    from vllm_ascend.eplb.core.policy.policy_dynamic_ep import DynamicEplb
    from vllm_ascend.eplb.core.policy.policy_factory import PolicyFactory

    assert (vllm_ascend_on_path / "vllm_ascend" / "eplb" / "core" / "policy" / "policy_factory.py").is_file()
    kwargs, env_vars = rollout_engine_kwargs(SCRIPT, dict(BASE_ENV, ROLLOUT_EPLB="True"))
    add = kwargs["additional_config"]
    assert type(add) is dict  # plain dict, as vLLM's VllmConfig.additional_config expects
    assert dict(add) == {"eplb_config": {"dynamic_eplb": True, "eplb_policy_type": 4, "num_redundant_experts": 128,
                                         "expert_heat_collection_interval": 400,
                                         "algorithm_execution_interval": 30}}
    assert env_vars["DYNAMIC_EPLB"] == "true"  # a string, as Ray's runtime_env env_vars require
    ascend = ascend_config(add)
    # what worker/model_runner_v1.py reads to start the EPLB process, and what eplb_utils reads to place
    assert (ascend.dynamic_eplb, ascend.eplb_policy_type, ascend.init_redundancy_expert) == (True, 4, 128)
    assert (ascend.num_iterations_eplb_update, ascend.num_wait_worker_iterations) == (400, 30)
    # EplbWorker.__init__: PolicyFactory.generate_policy(policy_type, DynamicConfig())
    policy = PolicyFactory.generate_policy(ascend.eplb_policy_type, DynamicConfig())
    assert type(policy) is PackingAwareAscendPolicy
    # the env var the scripts hand to the Ray workers passes vLLM-Ascend's own gate; without it: refused
    monkeypatch.setenv("DYNAMIC_EPLB", env_vars["DYNAMIC_EPLB"])
    EPLBParamUtils.check_dynamic_eplb(ascend.dynamic_eplb)
    monkeypatch.delenv("DYNAMIC_EPLB")
    with pytest.raises(ValueError, match="DYNAMIC_EPLB"):
        EPLBParamUtils.check_dynamic_eplb(ascend.dynamic_eplb)

    # the policy from the factory runs on the table/workload EplbWorker hands it ([layers, ranks, slots])
    table = torch.tensor([[[0, 1], [2, 3], [4, 5], [6, 7]]] * 2)
    work = torch.zeros_like(table)
    work[:, 0, :] = 100  # rank 0 holds the two hot experts
    work[:, 1:, :] = 10
    changed, priority, new = policy.rebalance_experts(table, work)
    assert changed == 1 and new.shape == table.shape and sorted(priority.tolist()) == [0, 1]
    for layer in new:
        assert sorted(layer.flatten().tolist()) == list(range(8))  # every expert kept once
        assert {0, 1} not in [set(r.tolist()) for r in layer]  # the hot pair is split

    # default (switch off): no additional_config at all -> upstream defaults, no EPLB
    kwargs_off, env_off = rollout_engine_kwargs(SCRIPT, BASE_ENV)
    assert "additional_config" not in kwargs_off and "DYNAMIC_EPLB" not in env_off
    off = ascend_config(kwargs_off.get("additional_config"))
    assert (off.dynamic_eplb, off.eplb_policy_type) == (False, 1)
    assert type(PolicyFactory.generate_policy(off.eplb_policy_type, DynamicConfig())) is DynamicEplb
    # the deprecated top-level key selects it too
    assert ascend_config({"eplb_policy_type": ASCEND_POLICY_TYPE}).eplb_policy_type == 4


def test_bad_switch_value_is_an_error() -> None:
    from qwen3_rl.tools.launch import TrainScriptError

    with pytest.raises(TrainScriptError, match="error: ROLLOUT_EPLB=.yes.: expected one of True, False"):
        parse_train_script(SCRIPT, env=dict(BASE_ENV, ROLLOUT_EPLB="yes"))


def test_redundant_default_matches_vllm_ascend_even_split() -> None:
    """vLLM-Ascend builds its initial placement with np.array_split of the experts over EP ranks plus the
    redundant slots round-robin and torch.tensor(groups): it needs (experts + redundant) % ranks == 0.
    The scripts' default (one redundant slot per rollout die) satisfies it for 128 experts."""
    cmd = parse_train_script(SCRIPT, env=dict(BASE_ENV, ROLLOUT_EPLB="True"))
    key = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.eplb_config.num_redundant_experts"
    redundant = int(cmd.get(key))
    ranks = int(cmd.get("actor_rollout_ref.rollout.tensor_model_parallel_size")) * int(
        cmd.get("actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size"))
    assert (128 + redundant) % ranks == 0 and np.isclose((128 + redundant) / ranks, 2)
