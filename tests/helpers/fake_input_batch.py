"""A stand-in for vLLM's persistent ``InputBatch``: the attributes ``SamRunnerDrafter`` reads.

Rows ``0..num_reqs-1`` are in use; ``add`` puts a request's prompt in the next row, ``accept`` appends
accepted tokens to a row, ``remove_all`` empties the batch. ``from_prompts`` builds a batch holding the
given prompts (one row each, 8 spare columns past the longest).
"""

from __future__ import annotations

import numpy as np


class FakeInputBatch:
    """The attributes of vLLM's ``InputBatch`` that ``SamRunnerDrafter`` reads (rows 0..n-1 in use)."""

    def __init__(self, width: int = 512, rows: int = 4) -> None:
        self.req_ids: list[str] = []
        self.token_ids_cpu = np.zeros((rows, width), np.int32)
        self.num_tokens_no_spec = np.zeros(rows, np.int64)
        self.num_prompt_tokens = np.zeros(rows, np.int64)
        self.spec_decode_unsupported_reqs: set[str] = set()

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], req_ids: list[str]) -> FakeInputBatch:
        b = cls(width=max(len(p) for p in prompts) + 8, rows=len(prompts))
        for rid, p in zip(req_ids, prompts, strict=True):
            b.add(rid, p)
        return b

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return {r: i for i, r in enumerate(self.req_ids)}

    def add(self, rid: str, prompt: list[int]) -> None:
        i = len(self.req_ids)
        self.req_ids.append(rid)
        self.token_ids_cpu[i, : len(prompt)] = prompt
        self.num_tokens_no_spec[i] = self.num_prompt_tokens[i] = len(prompt)

    def accept(self, i: int, toks: list[int]) -> None:
        n = int(self.num_tokens_no_spec[i])
        self.token_ids_cpu[i, n: n + len(toks)] = toks
        self.num_tokens_no_spec[i] = n + len(toks)

    def remove_all(self) -> None:
        self.req_ids = []
