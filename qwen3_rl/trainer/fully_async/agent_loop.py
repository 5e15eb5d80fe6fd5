"""The agent loop of the fully-async rollout: one chat turn, like verl's ``single_turn_agent``, but a request the
server aborted at a weight sync (partial rollout) is sent again with its tokens so far appended to the prompt,
under the new weights, until it finishes; the trajectory records the weight version that generated its first
token, the one of its last, and how many times it was resumed (``extra_fields``: ``param_version_start``,
``param_version_end``, ``num_resumes``); a segment aborted before its first token is sent again without counting as
a resume, and its version is not the start.

Registered as ``qwen3_rl_partial`` in verl's agent-loop registry when imported (the fully-async agent-loop
worker imports it, :mod:`.rollout`)."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.profiler import simple_timer

from qwen3_rl.spec_decode.runner_drafter import GROUP_PROMPT_LEN_KEY

AGENT_NAME = "qwen3_rl_partial"


@register(AGENT_NAME)
class PartialRolloutAgentLoop(AgentLoopBase):
    """Single-turn agent loop that resumes aborted requests (server: :class:`.rollout.PartialServerMixin`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.response_length = int(self.config.actor_rollout_ref.rollout.response_length)
        self.chat_kwargs = self.config.data.get("apply_chat_template_kwargs", {})

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.loop.run_in_executor(None, lambda: self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **self.chat_kwargs))
        request_id = uuid4().hex
        response: list[int] = []
        log_probs: list[float] | None = None
        start_version = end_version = -1
        resumes = 0
        metrics: dict[str, float] = {}
        with simple_timer("generate_sequences", metrics):
            while True:
                params = dict(sampling_params)
                if response:  # resumed: the drafter's group stays the original prompt's
                    params[GROUP_PROMPT_LEN_KEY] = len(prompt_ids)
                out = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids + response,
                                                         sampling_params=params)
                end_version = int(out.param_version)
                if start_version < 0 and (out.token_ids or not out.aborted):
                    start_version = end_version  # the first weights that generated a token of it
                response += list(out.token_ids)
                if out.log_probs is not None:
                    log_probs = (log_probs or []) + list(out.log_probs)
                if not out.aborted or len(response) >= self.response_length:
                    break
                if out.token_ids:  # aborted before its first token (queued at the sync): sent again, not resumed
                    resumes += 1
        start_version = end_version if start_version < 0 else start_version
        n = min(len(response), self.response_length)
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=response[:n], response_mask=[1] * n,
            response_logprobs=log_probs[:n] if log_probs is not None else None, multi_modal_data={}, num_turns=2,
            metrics=metrics,
            extra_fields={"param_version_start": start_version, "param_version_end": end_version,
                          "num_resumes": resumes})
