"""qwen3_rl.spec_decode.requests: which rollout requests vLLM 0.13 can draft for (verl 0007)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from qwen3_rl.spec_decode.requests import (
    request_logprobs,
    speculative_method,
    unsupported_reasons,
)


def rollout(method=None, calculate_log_probs=False):
    vllm = {"speculative_config": {"method": method, "num_speculative_tokens": 3}} if method else {}
    return OmegaConf.create({"engine_kwargs": {"vllm": vllm}, "calculate_log_probs": calculate_log_probs})


def test_upstream_request_without_a_drafter() -> None:
    assert request_logprobs(rollout()) == 0
    assert request_logprobs(rollout(calculate_log_probs=True)) == 0
    assert request_logprobs({}) == 0 and speculative_method({"engine_kwargs": {"vllm": None}}) is None


@pytest.mark.parametrize("method", ["sam", "ngram", "suffix"])
def test_no_logprobs_with_a_drafter(method: str) -> None:
    assert speculative_method(rollout(method)) == method
    assert request_logprobs(rollout(method)) is None
    # plain dicts (verl's RolloutConfig dataclass keeps engine_kwargs as a dict) work the same
    assert request_logprobs({"engine_kwargs": {"vllm": {"speculative_config": {"method": method}}}}) is None


@pytest.mark.parametrize("method", ["sam", "ngram"])
def test_drafter_with_calculate_log_probs_asks_for_them(method: str) -> None:
    # the sync rollout reads the sampled tokens' log-probs then: upstream's 0 (drafted with vllm 0004)
    assert request_logprobs(rollout(method, calculate_log_probs=True)) == 0


def test_unsupported_reasons_mirror_vllm() -> None:
    # vllm/v1/spec_decode/utils.py:9-17: penalties and min_p make a request undraftable
    assert unsupported_reasons({}) == []
    assert unsupported_reasons({"repetition_penalty": 1.0, "min_p": 0.0, "logprobs": None}) == []
    got = unsupported_reasons({"repetition_penalty": 1.05, "presence_penalty": 0.1, "frequency_penalty": 0.0,
                               "min_p": 0.05, "logprobs": 0})
    # logprobs: drafted since vllm 0004 (tests/engine/test_engine_spec_decode_logprobs.py)
    assert [g.split("=")[0] for g in got] == ["presence_penalty", "repetition_penalty", "min_p"]
