"""No machine paths in the product: the tracked files of qwen3_rl/, tests/, docs/ and README.md name no absolute
folder under /work or /tmp of the machine they were written on. Paths are relative to the checkout, to
``../shared`` beside it, or under the workspace (``$QWEN3_RL_WORKSPACE``, else ``./workspace``); scratch space
comes from pytest's ``tmp_path`` / ``tempfile``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCOPE = ("qwen3_rl", "tests", "docs", "README.md", "README.zh-CN.md")
# an absolute path into one of the two folders: not preceded by a name character, a dot (../work/...) or ~
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp)/")
# (file, text on the line) -> why it is not a machine path
ALLOWED: dict[tuple[str, str], str] = {
    ("qwen3_rl/tools/launch/options.py", "$TMPDIR/ray or /tmp/ray]"):
        "Ray's own default temp folder (ray start --temp-dir), named in the option's help text",
    ("qwen3_rl/tools/launch/ray_node.py", "``$TMPDIR/ray`` or ``/tmp/ray``"):
        "Ray's own default temp folder, where Ray writes ray_current_cluster (its docstring)",
    ("docs/launch.md", "`$TMPDIR/ray` or `/tmp/ray`"): "Ray's own default temp folder (the --temp-dir row)",
    ("tests/tools/launch/test_launch_ray_node.py", 'Path("/tmp/ray")'): "Ray's own default temp folder (expected value)",
}
SELF = "tests/test_machine_paths.py"  # not scanned: it holds examples of the paths it looks for


def _hits() -> list[tuple[str, int, str]]:
    files = subprocess.run(["git", "ls-files", "--", *SCOPE], cwd=REPO, text=True, capture_output=True,
                           check=True).stdout.split()
    out = []
    for rel in files:
        path = REPO / rel
        if rel == SELF or not path.is_file():  # not-a-file: deleted in the work tree, not yet committed
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for no, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                out.append((rel, no, line.strip()))
    return out


def test_pattern_finds_machine_paths_and_spares_relative_ones() -> None:
    for bad in ('CORPUS = Path("/work/shared/x")', "--dest /tmp/ws_ms", "file:///work/.mirror/repo",
                "(`/tmp/ws1/...` in a", "x=/tmp/y"):
        assert MACHINE_PATH.search(bad), bad
    for ok in ("../shared/bench/x", "workspace/verl/x", '"HOME": "/tmp"', "dir=\"/tmp\")", "~/tmp/x",
               "$HOME/tmp/x", "a/work/b", "../work/x"):
        assert not MACHINE_PATH.search(ok), ok


def test_no_machine_paths_in_tracked_files() -> None:
    hits = _hits()
    unexplained = [h for h in hits if not any(f == h[0] and needle in h[2] for f, needle in ALLOWED)]
    assert not unexplained, "machine paths (use a path relative to the checkout, ../shared or the workspace):\n" + \
        "\n".join(f"{f}:{n}: {line}" for f, n, line in unexplained)
    # every allow-list entry still matches something (no stale exceptions)
    for (f, needle), why in ALLOWED.items():
        assert any(h[0] == f and needle in h[2] for h in hits), f"stale allow-list entry {f!r} ({why})"
