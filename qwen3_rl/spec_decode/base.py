"""The small interface every drafter in this package implements (vLLM ``NgramProposer``-like)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class DraftProposer(Protocol):
    """Model-free drafter fed with accepted tokens only.

    Shapes: ``prompt_ids`` [prompt_len], ``accepted_ids`` [n_accepted] (accepted draft tokens plus
    the bonus token of one verification step); ``propose`` returns one list of <= k ids per request.
    """

    def add_request(self, req_id: str, prompt_ids: Sequence[int], group_id: str | None = None) -> None: ...

    def extend(self, req_id: str, accepted_ids: Sequence[int]) -> None: ...

    def propose(self, req_ids: Sequence[str], k: int | None = None) -> list[list[int]]: ...

    def finish(self, req_id: str) -> None: ...

    def nbytes(self) -> int | None: ...
