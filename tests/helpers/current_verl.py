"""Pristine and patched trees of the current pin set's verl 0.9.1, and the venv its checks run in, for
``tests/patches/test_patches_verl091.py`` and ``tests/upstream_own/verl091_cpu.py``.

:data:`VERL` is ``pins.toml``'s current-set entry. The pristine tree is made by the
download code (``qwen3_rl.tools.upstream.download.fill_pristine``: the PyPI wheel's text files, ``verl/``,
``scripts/`` and ``tests/``, as a one-commit git repo, in the current set's pristine cache). A patched
tree is a ``git clone --shared`` of it with ``patches/current/verl/NNNN-*.patch`` applied in order by ``git apply``.
The code runs in :data:`VENV` (``tests/setup_verl091_env.sh``): verl 0.9.1 imports transformers 5 and tensordict
0.10, which the seed set's venvs do not hold.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from qwen3_rl.tools.pins import load_pins
from qwen3_rl.tools.upstream.download import fill_pristine

REPO = Path(__file__).resolve().parents[2]
VERL = load_pins(REPO / "pins.toml", "current").frameworks["verl"]
SERIES = REPO / "patches" / "current" / "verl"
VENV = Path(os.environ.get("QWEN3_RL_VERL091_VENV", Path.home() / ".cache" / "qwen3_rl" / "verl091-venv"))
PYTHON = VENV / "bin" / "python"


def series() -> list[Path]:
    """The current set's verl patches, in order (none is an error)."""
    found = sorted(SERIES.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    if not found:
        raise FileNotFoundError(f"no patches in {SERIES}")
    return found


def patched_files(patch: Path) -> list[str]:
    """The files ``patch`` changes (paths relative to the tree)."""
    return re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), re.M)


def pristine_verl() -> Path:
    """The pristine verl 0.9.1 tree (downloaded and unpacked once, cached; processes take turns on a lock)."""
    tree = fill_pristine(REPO / "pins.toml", [VERL], "current") / VERL.dir
    if not (tree / "verl" / "single_controller" / "ray" / "base.py").is_file():
        raise FileNotFoundError(f"{tree} is not verl's tree")
    return tree


def clone(src: Path, dst: Path) -> Path:
    """``git clone --shared src dst`` (``__pycache__`` ignored); returns ``dst``."""
    subprocess.run(["git", "clone", "-q", "--shared", str(src), str(dst)], check=True)
    (dst / ".git" / "info").mkdir(parents=True, exist_ok=True)
    (dst / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n")
    return dst


def apply(tree: Path, patches: list[Path]) -> None:
    """``git apply`` each of ``patches`` to ``tree`` in order; raises with git's message when one does not apply."""
    for patch in patches:
        proc = subprocess.run(["git", "apply", str(patch)], cwd=tree, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply to {tree}: {proc.stderr}")


def patched_verl(dest: Path, without: str | None = None) -> Path:
    """A clone of the pristine tree at ``dest/verl`` with the current verl series applied (all of it, or all but the
    patch whose name contains ``without``: a positive control). Returns the tree."""
    tree = clone(pristine_verl(), dest / VERL.dir)
    apply(tree, [p for p in series() if without is None or without not in p.name])
    return tree


def run_in_venv(argv: list[str], path: list[Path], timeout: float, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``VENV/bin/python ARGV`` with ``PYTHONPATH`` exactly ``path`` (plus ``env``); never raises on exit codes.
    A missing venv is an error naming its set-up script."""
    return subprocess.run([str(PYTHON), *argv], capture_output=True, text=True, env=venv_env(path, env), cwd=cwd,
                          timeout=timeout)


def venv_env(path: list[Path], env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment :func:`run_in_venv` gives :data:`PYTHON`: this one without ``PYTHONPATH`` and ``RAY_*``,
    ``PYTHONPATH`` exactly ``path``, plus ``env``. A missing venv is an error naming its set-up script."""
    if not PYTHON.is_file():
        raise FileNotFoundError(f"{PYTHON} missing: run bash tests/setup_verl091_env.sh")
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("RAY_")}
    full.update(PYTHONPATH=os.pathsep.join(str(p) for p in path), RAY_USAGE_STATS_ENABLED="0", **(env or {}))
    return full
