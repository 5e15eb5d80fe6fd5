"""qwen3_rl.spec_decode.requests: which rollout requests vLLM 0.13 can draft for."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from qwen3_rl.spec_decode.requests import speculative_method, unsupported_reasons


def rollout(method=None):
    vllm = {"speculative_config": {"method": method, "num_speculative_tokens": 3}} if method else {}
    return OmegaConf.create({"engine_kwargs": {"vllm": vllm}})


def test_no_speculative_method() -> None:
    assert speculative_method(rollout()) is None and speculative_method({}) is None
    assert speculative_method({"engine_kwargs": {"vllm": None}}) is None


@pytest.mark.parametrize("method", ["sam", "ngram", "suffix"])
def test_speculative_method(method: str) -> None:
    assert speculative_method(rollout(method)) == method
    # plain dicts (verl's RolloutConfig dataclass keeps engine_kwargs as a dict) work the same
    assert speculative_method({"engine_kwargs": {"vllm": {"speculative_config": {"method": method}}}}) == method


def test_unsupported_reasons_mirror_vllm() -> None:
    # vllm/v1/spec_decode/utils.py:9-17: penalties and min_p make a request undraftable
    assert unsupported_reasons({}) == []
    assert unsupported_reasons({"repetition_penalty": 1.0, "min_p": 0.0, "logprobs": None}) == []
    got = unsupported_reasons({"repetition_penalty": 1.05, "presence_penalty": 0.1, "frequency_penalty": 0.0,
                               "min_p": 0.05, "logprobs": 0})
    # logprobs: drafted since vllm 0004 (tests/engine/test_engine_spec_decode_logprobs.py)
    assert [g.split("=")[0] for g in got] == ["presence_penalty", "repetition_penalty", "min_p"]
