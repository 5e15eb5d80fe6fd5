"""``eval merge``: a verl 0.6.1 Megatron checkpoint to a Hugging Face model directory.

The conversion itself is verl's: ``python -m verl.model_merger merge --backend megatron --local_dir
<global_step_N/actor> --target_dir <out>`` (``verl/model_merger/megatron_model_merger.py``). This module finds
the actor directory, refuses a checkpoint that is missing or was not finished, and builds that command.

What a finished verl 0.6.1 Megatron actor checkpoint holds (``verl/utils/checkpoint/megatron_checkpoint_manager.py``
``save_checkpoint``, paths from ``verl/utils/megatron_utils.py:516-530``):

* ``dist_ckpt/`` -- Megatron ``dist_checkpointing.save``: ``common.pt`` first, the shard files (``*.distcp`` with
  the default ``torch_dist`` backend, ``.metadata`` their index), and ``metadata.json`` LAST: megatron-core writes
  it "only when the checkpoint is complete" (``megatron/core/dist_checkpointing/serialization.py:311-316,389``);
* ``huggingface/`` -- ``config.json`` and the tokenizer (rank 0); the merger reads the model config from there
  (``verl/model_merger/base_model_merger.py:135``);
* ``transformer_config.json`` -- the Megatron transformer config (rank 0).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class MergeError(ValueError):
    """A checkpoint that cannot be merged: one line, printed as ``error: <message>``."""


_STEP_RE = re.compile(r"^global_step_(\d+)$")


@dataclass(frozen=True)
class ActorCheckpoint:
    """A complete verl Megatron actor checkpoint.

    Attributes:
        actor_dir: ``.../global_step_N/actor``.
        step: N (None when the directory is not named ``global_step_N``).
        tie_word_embeddings: the HF config's flag (the merger needs ``--tie-word-embedding`` then).
        shards: number of shard files in ``dist_ckpt/``.
    """

    actor_dir: Path
    step: int | None
    tie_word_embeddings: bool
    shards: int


def find_actor_dir(path: str | Path, step: int | None = None) -> Path:
    """The ``actor`` directory of ``path``: a ``global_step_N/actor`` directory, a ``global_step_N`` directory,
    or a trainer's ``default_local_dir`` (then ``step``, else ``latest_checkpointed_iteration.txt``, which verl's
    trainer writes after a save: ``verl/trainer/ppo/ray_trainer.py``)."""
    p = Path(path)
    if not p.exists():
        raise MergeError(f"checkpoint {p} does not exist")
    if not p.is_dir():
        raise MergeError(f"checkpoint {p} is not a directory")
    if (p / "dist_ckpt").exists() or (p / "huggingface").exists():
        return p
    if (p / "actor").is_dir():
        return p / "actor"
    if step is None:
        latest = p / "latest_checkpointed_iteration.txt"
        if latest.is_file():
            text = latest.read_text().strip()
            if not text.isdigit():
                raise MergeError(f"{latest} holds {text!r}, not a step number")
            step = int(text)
        else:
            steps = sorted(int(m.group(1)) for d in p.iterdir() if (m := _STEP_RE.match(d.name)) and d.is_dir())
            if not steps:
                raise MergeError(f"{p} holds no global_step_N/actor checkpoint")
            raise MergeError(f"{p} has no latest_checkpointed_iteration.txt (an unfinished save?); "
                             f"give --step, one of {steps}")
    actor = p / f"global_step_{step}" / "actor"
    if not actor.is_dir():
        raise MergeError(f"{actor} does not exist")
    return actor


def check_actor_checkpoint(actor_dir: str | Path) -> ActorCheckpoint:
    """Refuse a missing or partial checkpoint with the first thing missing; see the module docstring."""
    a = Path(actor_dir)
    dist = a / "dist_ckpt"
    if not dist.is_dir():
        raise MergeError(f"{a}: no dist_ckpt/ (not a verl Megatron checkpoint; an FSDP one merges with "
                         "--backend fsdp)")
    if not (dist / "common.pt").is_file():
        raise MergeError(f"{dist}: no common.pt: the save did not get far (partial checkpoint)")
    if not (dist / "metadata.json").is_file():
        raise MergeError(f"{dist}: no metadata.json, which megatron-core writes last: the save did not finish "
                         "(partial checkpoint)")
    try:
        json.loads((dist / "metadata.json").read_text())
    except (OSError, ValueError):
        raise MergeError(f"{dist / 'metadata.json'} is not valid JSON (partial checkpoint)") from None
    shards = [f for f in dist.iterdir() if f.is_file() and f.name not in ("common.pt", "metadata.json")
              and not f.name.startswith(".")]
    if not shards:
        raise MergeError(f"{dist}: no shard files next to metadata.json (partial checkpoint)")
    if not (dist / ".metadata").exists() and any(f.suffix == ".distcp" for f in shards):
        raise MergeError(f"{dist}: *.distcp shards without their .metadata index (partial checkpoint)")
    cfg_path = a / "huggingface" / "config.json"
    if not cfg_path.is_file():
        raise MergeError(f"{a}: no huggingface/config.json (the merger reads the model config there)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        raise MergeError(f"{cfg_path} is not valid JSON") from None
    m = _STEP_RE.match(a.parent.name)
    return ActorCheckpoint(actor_dir=a, step=int(m.group(1)) if m else None,
                           tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), shards=len(shards))


def merge_command(ckpt: ActorCheckpoint, target_dir: str | Path, python: str = sys.executable,
                  trust_remote_code: bool = False, use_cpu_initialization: bool = False) -> list[str]:
    """verl's model merger command line for ``ckpt`` (argv)."""
    cmd = [python, "-m", "verl.model_merger", "merge", "--backend", "megatron",
           "--local_dir", str(ckpt.actor_dir), "--target_dir", str(target_dir)]
    if ckpt.tie_word_embeddings:
        cmd.append("--tie-word-embedding")
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if use_cpu_initialization:
        cmd.append("--use_cpu_initialization")
    return cmd


def check_merged(target_dir: str | Path) -> list[str]:
    """Files of a merged HF directory (config + weights), or MergeError when the merger left none."""
    t = Path(target_dir)
    weights = sorted(p.name for p in t.glob("*.safetensors")) + sorted(p.name for p in t.glob("*.bin"))
    if not (t / "config.json").is_file() or not weights:
        raise MergeError(f"{t}: the merger finished but left no config.json + weights")
    return weights


def run_merge(checkpoint: str | Path, target_dir: str | Path, step: int | None = None, dry_run: bool = False,
              trust_remote_code: bool = False, use_cpu_initialization: bool = False,
              python: str = sys.executable, env: dict[str, str] | None = None) -> tuple[list[str], int]:
    """Check, then run verl's merger (or only print it with ``dry_run``). Returns (argv, return code)."""
    ckpt = check_actor_checkpoint(find_actor_dir(checkpoint, step))
    target = Path(target_dir)
    if target.exists() and any(target.iterdir()):
        raise MergeError(f"target {target} exists and is not empty")
    cmd = merge_command(ckpt, target, python, trust_remote_code, use_cpu_initialization)
    if dry_run:
        return cmd, 0
    proc = subprocess.run(cmd, env=dict(os.environ, **(env or {})))
    if proc.returncode == 0:
        check_merged(target)
    return cmd, proc.returncode


def main(argv: Sequence[str]) -> int:
    """``eval merge CHECKPOINT --target DIR [--step N] [--dry-run]``."""
    import argparse
    import shlex

    ap = argparse.ArgumentParser(prog="python -m qwen3_rl eval merge",
                                 description="verl Megatron checkpoint -> HF directory (verl.model_merger)")
    ap.add_argument("checkpoint", help="global_step_N/actor, global_step_N, or the trainer's checkpoint root")
    ap.add_argument("--target", required=True, help="HF output directory (must be empty or absent)")
    ap.add_argument("--step", type=int, help="with a checkpoint root: this step instead of the latest")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--use-cpu-initialization", action="store_true",
                    help="verl's --use_cpu_initialization (build the model on CPU: large models)")
    ap.add_argument("--dry-run", action="store_true", help="check the checkpoint, print the command, run nothing")
    args = ap.parse_args(list(argv))
    try:
        cmd, rc = run_merge(args.checkpoint, args.target, args.step, args.dry_run, args.trust_remote_code,
                            args.use_cpu_initialization)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if rc != 0:
        print(f"error: verl.model_merger exited {rc}", file=sys.stderr)
        return 1
    print(f"merged into {args.target}")
    return 0
