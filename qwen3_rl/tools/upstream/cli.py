"""Command-line entry points behind download_frameworks_source_code.sh and apply_all_patches.sh."""

from __future__ import annotations

import argparse
from pathlib import Path

from qwen3_rl.tools.pins import DEFAULT_PIN_SET, PinError, Pins, load_pins
from qwen3_rl.tools.upstream import patches as ps
from qwen3_rl.tools.upstream.common import (
    OneLineParser,
    UpstreamError,
    default_cache,
    default_workspace,
    die,
    log,
)
from qwen3_rl.tools.upstream.download import download_archive, download_git, download_pypi


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pins", help="pin file (default: $QWEN3_RL_PINS or <repo>/pins.toml)")
    p.add_argument("--pin-set", help="pin set: seed or current (default: $PIN_SET, else seed)")
    p.add_argument("--only", help="comma-separated frameworks (default: all in the pin file)")


def _report_set(pins: Pins, root: Path | None = None) -> None:
    """Name a non-default pin set (and the patch folder used) on stdout; the seed set's output stays as it was."""
    if pins.name != DEFAULT_PIN_SET:
        where = f"{pins.patches_dir}/" if root is None or root == pins.patches_root else str(root)
        log(f"pin set: {pins.name} (patches: {where})")


def download_main(argv: list[str]) -> int:
    ap = OneLineParser(
        prog="download_frameworks_source_code.sh",
        description="Fetch the pinned upstream source trees into a workspace (git or PyPI).",
    )
    _common(ap)
    ap.add_argument("--source", choices=("git", "pypi"), default=None,
                    help="git: clone and check out the pinned commit (the seed set's default); "
                         "pypi: unpack the pinned wheels' (or sdist's) text sources into one-commit git repos "
                         "(the current set's default)")
    ap.add_argument("--dest", "--workspace", dest="dest",
                    help="workspace folder (default: $QWEN3_RL_WORKSPACE or <repo>/workspace)")
    ap.add_argument("--wheel-dir", help="wheel cache for pypi mode (default: ~/.cache/qwen3_rl/wheels)")
    ap.add_argument("--arch", help="wheel platform architecture for pypi mode (default: this machine's)")
    ap.add_argument("--force", action="store_true",
                    help="replace trees at a wrong commit or with local changes (discards changes)")
    ap.add_argument("--archive-dir",
                    help="pypi mode: take a framework no registry serves (MindSpeed) from DIR/<key>-<commit>.tar.gz, "
                         "checked against DIR/SHA256SUMS and the commit (e.g. ../shared/upstream)")
    a = ap.parse_args(argv)
    try:
        pins = load_pins(a.pins, a.pin_set)
        fws = pins.select(a.only)
        _report_set(pins)
        dest = Path(a.dest) if a.dest else default_workspace(pins)
        wheel_dir = Path(a.wheel_dir) if a.wheel_dir else default_cache() / "wheels"
        source = a.source or pins.source
        for fw in fws:
            if source == "pypi":
                if not fw.on_pypi and a.archive_dir:
                    download_archive(fw, dest, Path(a.archive_dir), force=a.force)
                    continue
                if not fw.on_pypi:
                    if a.only:
                        raise UpstreamError(
                            f"{fw.key} is not published on PyPI: it needs --source git "
                            f"({fw.git_url} {fw.git_ref})")
                    log(f"{fw.key}: skipped: not published on PyPI, needs --source git")
                    continue
                download_pypi(fw, dest, wheel_dir, force=a.force, arch=a.arch)
            else:
                download_git(fw, dest, force=a.force)
    except (PinError, UpstreamError) as e:
        return die(str(e))
    return 0


def patches_main(argv: list[str]) -> int:
    ap = OneLineParser(
        prog="apply_all_patches.sh",
        description="Apply patches/<framework>/NNNN-*.patch in order to the workspace trees, "
                    "all or nothing per framework; a rerun on a patched tree does nothing.",
    )
    _common(ap)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="dry run: list what would apply, change nothing")
    g.add_argument("--status", action="store_true", help="table of patch / applied, not applied, conflict")
    g.add_argument("--revert", action="store_true", help="reverse the applied patches, last first")
    g.add_argument("--lint", action="store_true", help="check patch names, numbering and headers")
    g.add_argument("--table", action="store_true", help="print the markdown table of the series (as in docs/patches.md)")
    ap.add_argument("--workspace", help="workspace folder (default: $QWEN3_RL_WORKSPACE or <repo>/workspace)")
    ap.add_argument("--patches-dir", help="patch folder (default: the pin set's, <repo>/patches or <repo>/patches/current)")
    a = ap.parse_args(argv)
    try:
        pins = load_pins(a.pins, a.pin_set)
        fws = pins.select(a.only)
        ws = Path(a.workspace) if a.workspace else default_workspace(pins)
        root = Path(a.patches_dir) if a.patches_dir else pins.patches_root
        if a.table:
            print(ps.markdown_table([fw.key for fw in fws], root))
            return 0
        if a.lint:
            problems = [p for fw in fws for p in ps.lint_series(fw.key, root)]
            for p in problems:
                print(p)
            if problems:
                return die(f"{len(problems)} problem(s) in the patch series")
            _report_set(pins, root)
            print(f"patch series OK ({sum(len(ps.series(fw.key, root)) for fw in fws)} patches)")
            return 0
        _report_set(pins, root)
        if not a.status and not ws.is_dir():
            raise UpstreamError(f"workspace {ws} does not exist; run download_frameworks_source_code.sh first")
        failures: list[str] = []
        rows: list[tuple[str, str, str]] = []
        for fw in fws:
            pats = ps.series(fw.key, root)
            if not pats:
                log(f"{fw.key}: no patches")
                continue
            tree = ws / fw.dir
            try:
                if a.status:
                    if not tree.is_dir():
                        rows += [(p.path.name, "no tree", str(tree)) for p in pats]
                        failures.append(f"{fw.key}: no tree at {tree}")
                        continue
                    for s in ps.status(tree, pats):
                        rows.append((s.patch.path.name, s.state.value, s.detail))
                        if s.state is ps.State.CONFLICT:
                            failures.append(f"{fw.key}: {s.patch.path.name} conflicts ({s.detail})")
                elif a.revert:
                    done = ps.revert_series(fw, tree, pats)
                    log(f"{fw.key}: reverted {len(done)} patch(es)" if done else f"{fw.key}: nothing to revert")
                else:
                    todo = ps.apply_series(fw, tree, pats, check_only=a.check)
                    if a.check:
                        for p in todo:
                            print(f"{fw.key}: would apply {p.path.name}")
                        applied = len(pats) - len(todo)
                        log(f"{fw.key}: {len(todo)} to apply, {applied} already applied")
                    elif not todo:
                        log(f"{fw.key}: all {len(pats)} patches already applied, nothing to do")
            except UpstreamError as e:
                failures.append(str(e))
        if a.status:
            w = max([len(r[0]) for r in rows] + [5])
            print(f"{'patch'.ljust(w)}  state        detail")
            for name, state, detail in rows:
                print(f"{name.ljust(w)}  {state.ljust(11)}  {detail}")
        if failures:
            for f in failures[:-1]:
                print(f"error: {f}")
            return die(failures[-1])
    except (PinError, UpstreamError) as e:
        return die(str(e))
    return 0
