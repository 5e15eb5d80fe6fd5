"""The prompt stream's part of a checkpoint. verl's ``_save_checkpoint`` saves the actor and the dataloader's
position, which is past every prompt the stream has taken from it; the prompts taken and not yet trained (queued
finished groups, groups in flight, prompts of the current dataloader batch not started yet) are saved next to it
with the weight version and the epoch, and a resumed run starts them again first (their samples are generated
anew under the loaded weights): no prompt is lost or trained twice.

Files in ``global_step_<N>/``: :data:`STATE_FILE` (JSON, :class:`StreamState`) and, when prompts are carried,
:data:`PROMPTS_FILE` (verl's ``DataProto.save_to_disk`` of the carried prompt rows, one row per prompt).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

STATE_FILE = "fully_async.json"
PROMPTS_FILE = "fully_async_prompts.pkl"

T = TypeVar("T")


@dataclass(frozen=True)
class StreamState:
    """What the stream needs to continue where a checkpoint left it."""

    #: actor updates done (verl's global step of the checkpoint)
    step: int
    #: the weight version of the checkpoint's weights (the version a resumed run syncs them under)
    param_version: int
    #: the dataloader epoch the stream was reading (0-based)
    epoch: int
    #: prompts saved to start again (queued + in flight + not started)
    carried: int
    queued: int = 0
    inflight: int = 0
    not_started: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StreamState:
        """Parse :meth:`to_json`'s output; a missing or negative field raises ``ValueError``."""
        raw = json.loads(text)
        try:
            state = cls(**{k: int(raw[k]) for k in ("step", "param_version", "epoch", "carried")},
                        **{k: int(raw.get(k, 0)) for k in ("queued", "inflight", "not_started")})
        except KeyError as e:
            raise ValueError(f"{STATE_FILE}: missing field {e}") from None
        if min(asdict(state).values()) < 0:
            raise ValueError(f"{STATE_FILE}: negative field in {raw}")
        return state


def checkpoint_version(version: int, synced: bool) -> int:
    """The weight version of the weights a checkpoint saves: the rollout's current ``version`` when this update was
    followed by a weight sync (``synced``), else ``version + 1`` (the trainer is ahead of the rollout; the resumed
    run's first sync makes these weights a new version)."""
    return int(version) if synced else int(version) + 1


def untrained_prompts(queued: Iterable[T], inflight: Iterable[T], not_started: Iterable[T]) -> list[T]:
    """The prompts a checkpoint carries, in the order a resumed run starts them: the queued (finished, oldest
    first), then the ones in flight (in start order), then the ones taken from the dataloader and not started."""
    return [*queued, *inflight, *not_started]


def _abs(path: Path, cwd: str | None) -> Path:
    return path if path.is_absolute() else Path(cwd or os.getcwd()) / path


def step_folder(local_dir: str, step: int, cwd: str | None = None) -> Path:
    """``<local_dir>/global_step_<step>``, where verl's ``_save_checkpoint`` saves update ``step`` (a relative
    ``local_dir`` is taken from ``cwd``, the current directory by default, as verl does)."""
    return _abs(Path(str(local_dir)) / f"global_step_{int(step)}", cwd)


def resume_folder(trainer_cfg: Any, step: int, cwd: str | None = None) -> Path:
    """The folder verl's ``_load_checkpoint`` loaded update ``step`` from: ``trainer.resume_from_path`` with
    ``resume_mode=resume_path``, else :func:`step_folder` of ``trainer.default_local_dir``."""
    if str(trainer_cfg.resume_mode) == "resume_path":
        return _abs(Path(str(trainer_cfg.resume_from_path)), cwd)
    return step_folder(trainer_cfg.default_local_dir, step, cwd)


def save_stream(folder: Path, state: StreamState, rows: Sequence[Any]) -> None:
    """Write ``state`` and the carried prompt ``rows`` (one-row ``DataProto`` each) into ``folder``."""
    if len(rows) != state.carried:
        raise ValueError(f"{len(rows)} prompt rows for a state carrying {state.carried}")
    folder.mkdir(parents=True, exist_ok=True)
    if rows:
        from verl import DataProto

        DataProto.concat(list(rows)).save_to_disk(str(folder / PROMPTS_FILE))
    (folder / STATE_FILE).write_text(state.to_json() + "\n")


def load_stream(folder: Path) -> tuple[StreamState | None, list[Any]]:
    """The state and the carried prompt rows (one-row ``DataProto`` each) saved in ``folder``; ``(None, [])`` when
    the checkpoint has no stream state (saved by another trainer)."""
    if not (folder / STATE_FILE).is_file():
        return None, []
    state = StreamState.from_json((folder / STATE_FILE).read_text())
    if state.carried == 0:
        return state, []
    from verl import DataProto

    data = DataProto.load_from_disk(str(folder / PROMPTS_FILE))
    if len(data) != state.carried:
        raise ValueError(f"{folder / PROMPTS_FILE}: {len(data)} prompts, {STATE_FILE} says {state.carried}")
    return state, [data[i:i + 1] for i in range(len(data))]
