"""What a launch leaves on a node besides processes: Ray's ``ray_current_cluster`` file and the auth token.

``ray_current_cluster``
    ``ray start`` (head and worker) writes the GCS address it joined to ``<ray temp dir>/ray_current_cluster``
    (Ray 2.52: ``ray/scripts/scripts.py`` ``write_ray_address``); only ``ray stop`` removes it. The launcher stops
    its Ray by PID, so the file kept pointing at the dead cluster, and the next bare ``ray.init()`` on that node
    (e.g. ``python -m verl.trainer.main_ppo`` run by hand) tried to attach to it and failed with "When connecting
    to an existing cluster, num_cpus and num_gpus must not be provided". :func:`save_address_file` records the
    file before ``ray start``; :func:`restore_address_file` puts it back as it was once this launch's Ray is gone.

Auth token (``RAY_AUTH_MODE=token``, Ray >= 2.52)
    One token per cluster: the head makes it (:func:`make_token`, 256 random bits as Ray's own generator) in a
    file only its owner can read; a worker waits for the same file (:func:`wait_token`) on storage both see, or
    every node gets ``RAY_AUTH_TOKEN`` from its scheduler (Slurm: the batch step's environment; Kubernetes: a
    Secret). Ray reads the file through ``RAY_AUTH_TOKEN_PATH``; the token itself is never printed.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path

ADDRESS_FILE = "ray_current_cluster"


def ray_temp_root(temp_dir: str | None, env: Mapping[str, str]) -> Path:
    """The Ray temp dir ``ray start`` uses: ``--temp-dir``, else ``$RAY_TMPDIR/ray``, ``$TMPDIR/ray`` or ``/tmp/ray``
    (Ray 2.52 ``ray/_common/utils.py`` ``get_user_temp_dir`` on Linux)."""
    if temp_dir:
        return Path(temp_dir)
    base = env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp"
    return Path(base) / "ray"


def save_address_file(path: Path, state: Path) -> dict[str, str | None]:
    """Record ``path``'s content (``None`` = absent) in the JSON file ``state``; returns the record."""
    content = path.read_text() if path.is_file() else None
    rec: dict[str, str | None] = {"path": str(path), "content": content}
    state.write_text(json.dumps(rec))
    return rec


def restore_address_file(state: Path, port: int) -> str:
    """Put the address file back as :func:`save_address_file` found it, if this launch's Ray changed it.

    The file counts as ours when it now names a GCS on ``port`` (the launch's port) and differs from the saved
    content; anything else (another cluster started meanwhile) is left alone.

    Returns:
        What was done, one line (``"removed ..."``, ``"restored ..."``, ``"left ..."``).
    """
    rec = json.loads(state.read_text())
    path, before = Path(rec["path"]), rec["content"]
    now = path.read_text() if path.is_file() else None
    if now == before:
        return f"left {path} as found"
    if now is None or not now.strip().endswith(f":{port}"):
        return f"left {path}: it names {now!r}, not this launch's port {port}"
    if before is None:
        path.unlink(missing_ok=True)
        return f"removed {path} (it pointed at this launch's stopped cluster {now.strip()})"
    path.write_text(before)
    return f"restored {path} to {before.strip()!r}"


def make_token(path: Path) -> None:
    """Write a new token (64 hex digits) to ``path``, mode 0600, atomically (a worker never reads half a token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def wait_token(path: Path, timeout_s: float, sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait (bounded) until ``path`` holds a token; True when it does."""
    deadline = clock() + timeout_s
    while True:
        try:
            if len(path.read_text().strip()) >= 32:
                return True
        except OSError:
            pass
        if clock() >= deadline:
            return False
        sleep(0.5)
