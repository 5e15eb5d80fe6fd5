"""The ``async_training`` group: read once, each bad value stops with one line naming the key."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from qwen3_rl.trainer.fully_async.settings import (
    AsyncSettings,
    AsyncSettingsError,
    behaviour_log_prob_problems,
)


def _config(**over):
    cfg = OmegaConf.create({
        "async_training": {"staleness_threshold": 1.0, "trigger_parameter_sync_step": 2, "require_batches": 2,
                           "partial_rollout": True, "use_rollout_log_probs": False},
        "data": {"train_batch_size": 16},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1},
        "rollout": {"nnodes": 1, "n_gpus_per_node": 2},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8},
                              "rollout": {"mode": "async", "calculate_log_probs": False,
                                          "tensor_model_parallel_size": 1, "data_parallel_size": 1,
                                          "pipeline_model_parallel_size": 1, "engine_kwargs": {"vllm": {}}}},
    })
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def test_reads_the_group() -> None:
    s = AsyncSettings.from_config(_config())
    assert (s.prompts_per_update, s.prompts_per_version, s.rollout_procs) == (16, 32, 2)
    assert s.partial_rollout and not s.use_rollout_log_probs


@pytest.mark.parametrize(("key", "value", "message"), [
    ("async_training.staleness_threshold", -1, "staleness_threshold=-1.0: must be >= 0"),
    ("data.train_batch_size", 8, "data.train_batch_size=8: must equal"),
    ("actor_rollout_ref.rollout.mode", "sync", "runs on the server rollout"),
    ("async_training.use_rollout_log_probs", True, "needs actor_rollout_ref.rollout.calculate_log_probs=True"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", 4, "not a multiple of one server's"),
    ("async_training.trigger_parameter_sync_step", 0, "trigger_parameter_sync_step=0: must be >= 1"),
])
def test_bad_values_stop_with_one_line(key, value, message) -> None:
    with pytest.raises(AsyncSettingsError, match=message):
        AsyncSettings.from_config(_config(**{key: value}))


def test_rollout_log_probs_with_a_drafter_are_accepted() -> None:
    # vllm 0004: vLLM drafts for requests that ask for log-probs and returns the raw ones (tests/engine/
    # test_engine_spec_decode_logprobs.py), so the pair is no longer refused; the rollout must still return them
    sam = {"actor_rollout_ref.rollout.engine_kwargs.vllm": {"speculative_config": {"method": "sam"}}}
    s = AsyncSettings.from_config(_config(**{"async_training.use_rollout_log_probs": True,
                                             "actor_rollout_ref.rollout.calculate_log_probs": True, **sam}))
    assert s.use_rollout_log_probs is True
    with pytest.raises(AsyncSettingsError, match="needs actor_rollout_ref.rollout.calculate_log_probs=True"):
        AsyncSettings.from_config(_config(**{"async_training.use_rollout_log_probs": True,
                                             "actor_rollout_ref.rollout.calculate_log_probs": False, **sam}))


@pytest.mark.parametrize("key", ["param_offload", "grad_offload", "optimizer_offload"])
def test_actor_offload_is_refused_in_the_trainer_pool(key) -> None:
    """OFFLOAD=True: verl 0.6.1 reads the actor's offload flags only for an actor that also rolls out
    (megatron_workers.py:272-283), so the trainer pool ignored them silently; now one line. The fully-async setups
    default to OFFLOAD=False (features.toml), and False passes."""
    with pytest.raises(AsyncSettingsError, match=rf"^actor_rollout_ref.actor.megatron.{key}=True \(OFFLOAD=True\)"):
        AsyncSettings.from_config(_config(**{f"actor_rollout_ref.actor.megatron.{key}": True}))
    AsyncSettings.from_config(_config(**{f"actor_rollout_ref.actor.megatron.{key}": False}))


def test_fully_async_setups_default_to_no_offload() -> None:
    from qwen3_rl.tools.features import load_registry, resolve

    reg = load_registry()
    for script in reg.groups["fully_async"]:
        assert resolve(reg, script, {}, {})["OFFLOAD"] == "False", script


def test_rollout_correction_is_read_and_needs_the_rollout_log_probs() -> None:
    on = {"algorithm.rollout_correction.rollout_is": "token", "actor_rollout_ref.rollout.calculate_log_probs": True}
    assert AsyncSettings.from_config(_config(**on)).rollout_is == "token"
    assert AsyncSettings.from_config(_config()).rollout_is is None
    with pytest.raises(AsyncSettingsError, match="rollout_is=token needs actor_rollout_ref.rollout.calculate_log_probs"):
        AsyncSettings.from_config(_config(**{**on, "actor_rollout_ref.rollout.calculate_log_probs": False}))
    with pytest.raises(AsyncSettingsError, match="weights pi_old / pi_rollout are 1"):
        AsyncSettings.from_config(_config(**on, **{"async_training.use_rollout_log_probs": True}))
    with pytest.raises(AsyncSettingsError, match="rollout_is=geometric: must be token, sequence or null"):
        AsyncSettings.from_config(_config(**{**on, "algorithm.rollout_correction.rollout_is": "geometric"}))


@pytest.mark.parametrize("mode", ["use_rollout_log_probs", "rollout_correction"])
@pytest.mark.parametrize(("key", "value", "shown"), [
    ("temperature", 0.7, "rollout.temperature=0.7"), ("top_p", 0.95, "rollout.top_p=0.95"),
    ("top_k", 20, "rollout.top_k=20")])
def test_sampling_whose_log_probs_are_not_the_behaviour_policys_is_refused(mode, key, value, shown) -> None:
    on = ({"async_training.use_rollout_log_probs": True} if mode == "use_rollout_log_probs"
          else {"algorithm.rollout_correction.rollout_is": "token"})
    on["actor_rollout_ref.rollout.calculate_log_probs"] = True
    plain = {"actor_rollout_ref.rollout.temperature": 1.0, "actor_rollout_ref.rollout.top_p": 1.0,
             "actor_rollout_ref.rollout.top_k": -1}
    AsyncSettings.from_config(_config(**on, **plain))
    bad = {**plain, f"actor_rollout_ref.rollout.{key}": value}
    with pytest.raises(AsyncSettingsError, match=f"^{shown}: the rollout's log-probs"):
        AsyncSettings.from_config(_config(**on, **bad))
    AsyncSettings.from_config(_config(**bad))  # the trainer's own log-probs only: any sampling


def test_behaviour_log_prob_problems() -> None:
    assert behaviour_log_prob_problems(1.0, 1.0, -1) == behaviour_log_prob_problems(1, 1, 0) == []
    assert behaviour_log_prob_problems(0.6, 0.9, 5) == ["rollout.temperature=0.6", "rollout.top_p=0.9",
                                                        "rollout.top_k=5"]
