"""The pinned upstream source trees the benchmarks compare against (verl's Karmarkar-Karp, vLLM's EPLB policy and
n-gram drafter, vLLM-Ascend's EPLB policies).

Default: ``<workspace>/<tree>`` with the workspace of ``download_frameworks_source_code.sh``
(``$QWEN3_RL_WORKSPACE``, else ``<repo>/workspace``). A tree that is not there is made from the pinned PyPI wheel's
text sources, as ``bash download_frameworks_source_code.sh --source pypi --only <key>`` does (same code,
``qwen3_rl.tools.upstream.download.download_pypi``; the wheel is cached in ``~/.cache/qwen3_rl/wheels``). When that
fails (no PyPI), :class:`UpstreamTreeError` carries a one-line reason with the command that creates the tree.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from qwen3_rl.tools.pins import load_pins
from qwen3_rl.tools.upstream.common import UpstreamError, default_cache, default_workspace

__all__ = ["UpstreamTreeError", "create_command", "upstream_tree"]


class UpstreamTreeError(RuntimeError):
    """A benchmark's upstream tree is missing and could not be made; the message is one line."""


def create_command(key: str) -> str:
    """The shell command that creates the tree of framework ``key`` in the default workspace."""
    return f"bash download_frameworks_source_code.sh --source pypi --only {key}"


def upstream_tree(key: str, explicit: str | Path | None = None, fetch: bool = True) -> Path:
    """Root of the pinned ``key`` tree (the folder holding its package, e.g. ``vllm/``).

    Args:
        key: framework key of ``pins.toml`` (``verl``, ``vllm``, ``vllm_ascend``, ...).
        explicit: a tree given on the command line: used as is, must hold the package.
        fetch: make a missing default tree from the pinned wheel (``download_pypi``; its log goes to stderr so
            ``--json`` output stays clean).

    Raises:
        UpstreamTreeError: the tree is not there and was not made (one line, with the command that makes it).
    """
    fw = load_pins().frameworks[key]
    package = fw.packages[0]
    if explicit is not None:
        tree = Path(explicit)
        if not (tree / package).is_dir():
            raise UpstreamTreeError(f"{tree} holds no {package}/ (the {key} tree); pass the tree's root or drop the "
                                    f"option to use the workspace's ({create_command(key)})")
        return tree
    workspace = default_workspace()
    tree = workspace / fw.dir
    if (tree / package).is_dir():
        return tree
    if not fetch:
        raise UpstreamTreeError(f"no {key} tree at {tree}; create it with: {create_command(key)}")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from qwen3_rl.tools.upstream.download import download_pypi

            download_pypi(fw, workspace, default_cache() / "wheels")
    except (UpstreamError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UpstreamTreeError(f"no {key} tree at {tree} and fetching the pinned wheel failed ({reason}); "
                                f"create it with: {create_command(key)}") from None
    if not (tree / package).is_dir():
        raise UpstreamTreeError(f"no {key} tree at {tree}; create it with: {create_command(key)}")
    return tree
