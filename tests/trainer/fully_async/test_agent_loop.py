"""The fully-async agent loop (``qwen3_rl.trainer.fully_async.agent_loop``) on scripted server answers: how a
request aborted at weight syncs is sent again, counted and tagged (issue 42, finding 8).

Stand-ins (named): the agent-loop worker's server manager (answers each call with the next scripted segment, as
``PartialServerMixin.generate`` returns them) and the tokenizer (a fixed chat template); the agent loop is verl's
registered class, its ``run`` unchanged.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

PROMPT = [11, 12, 13]


class _Manager:
    def __init__(self, segments: list[tuple[list[int], bool, int]]) -> None:
        self.segments = list(segments)
        self.calls: list[dict] = []

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict):
        from qwen3_rl.trainer.fully_async.rollout import PartialTokenOutput

        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids), "params": dict(sampling_params)})
        tokens, aborted, version = self.segments.pop(0)
        return PartialTokenOutput(token_ids=tokens, log_probs=[-0.5] * len(tokens), aborted=aborted,
                                  param_version=version)


def _run(segments: list[tuple[list[int], bool, int]], response_length: int = 16):
    from qwen3_rl.trainer.fully_async.agent_loop import PartialRolloutAgentLoop

    loop = object.__new__(PartialRolloutAgentLoop)
    loop.server_manager = _Manager(segments)
    loop.tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **kw: list(PROMPT))
    loop.response_length, loop.chat_kwargs = response_length, {}

    async def go():
        loop.loop = asyncio.get_running_loop()
        return await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "q"}])

    return asyncio.run(go()), loop.server_manager.calls


def test_a_segment_aborted_before_its_first_token_is_no_resume(patched_imports) -> None:
    """Aborted with 0 tokens (queued at the sync, version 0), aborted after 3 tokens (version 1), finished with 2
    (version 2): one resume, started under version 1 (the first weights that generated a token), ended under 2.
    Before the fix: 2 resumes, start version 0."""
    out, calls = _run([([], True, 0), ([1, 2, 3], True, 1), ([4, 5], False, 2)])
    assert out.response_ids == [1, 2, 3, 4, 5] and out.response_logprobs == [-0.5] * 5
    assert out.extra_fields == {"param_version_start": 1, "param_version_end": 2, "num_resumes": 1}
    assert [c["prompt_ids"] for c in calls] == [PROMPT, PROMPT, PROMPT + [1, 2, 3]]
    assert len({c["request_id"] for c in calls}) == 1  # one request id throughout (verl's stickiness)
    from qwen3_rl.spec_decode.runner_drafter import GROUP_PROMPT_LEN_KEY

    # the re-send after 0 tokens is the plain prompt; the resume says where its prompt ends (routing, drafter)
    assert [c["params"].get(GROUP_PROMPT_LEN_KEY) for c in calls] == [None, None, len(PROMPT)]


def test_resumes_with_tokens_are_counted_and_tagged(patched_imports) -> None:
    """Every abort after tokens is a resume; a request never aborted has none and one version."""
    out, _ = _run([([1], True, 3), ([2], True, 4), ([3], False, 5)])
    assert out.extra_fields == {"param_version_start": 3, "param_version_end": 5, "num_resumes": 2}
    out, _ = _run([([1, 2], False, 7)])
    assert out.extra_fields == {"param_version_start": 7, "param_version_end": 7, "num_resumes": 0}
    out, _ = _run([([], True, 1), ([], False, 2)])  # aborted empty, then an empty answer: started under 2
    assert out.extra_fields == {"param_version_start": 2, "param_version_end": 2, "num_resumes": 0}
