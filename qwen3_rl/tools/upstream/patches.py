"""The patch series: ``patches/<framework>/NNNN-<framework>-<feature|bugfix>-<name>.patch``.

Each framework's series is applied in numeric order to ``<workspace>/<fw.dir>`` with ``git apply``,
all or nothing: the whole remaining series is first applied to a scratch copy of the files it
touches, and only when every patch goes in is the real tree changed. Already-applied patches are
detected (their reverse applies), so a rerun is a no-op and a half-applied series is completed.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from qwen3_rl.tools.pins import REPO_ROOT, Framework
from qwen3_rl.tools.upstream.common import UpstreamError, is_git_repo, log, run

PATCH_RE = re.compile(r"^(?P<num>\d{4})-(?P<fw>[a-z_]+)-(?P<kind>feature|bugfix)-(?P<name>[a-z0-9_]+)\.patch$")
HEADER_FIELDS = ("Subject", "Description", "Switch", "Upstream", "Verified")
#: How a patch is verified; its ``Verified:`` header starts with exactly one of these, then says which test
#: does what. real engine: runs inside vLLM 0.13.0's real engine (tests/engine); upstream code on CPU: the
#: patched upstream code is executed by the main suite among real upstream objects; stand-in: executed,
#: but on stand-in objects (fake runner / engine core / worker, torch_npu stood in); compiled/parsed only:
#: the patch applies and the file compiles or parses, no test executes the changed lines.
VERIFIED_LEVELS = ("real engine", "upstream code on CPU", "stand-in", "compiled/parsed only")
_LEVEL_END_RE = re.compile(r"[;(\u2014]")
_DIFF_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)
_FAIL_RE = re.compile(r"error: (?:patch failed: (\S+?):\d+|(\S+?): (?:No such file|does not exist|already exists))")


class State(StrEnum):
    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    CONFLICT = "conflict"
    BLOCKED = "blocked"


@dataclass(frozen=True)
class Patch:
    path: Path
    number: int
    framework: str
    kind: str
    name: str

    @property
    def files(self) -> list[str]:
        """Repository-relative paths the patch touches (both sides of each ``diff --git``)."""
        seen: dict[str, None] = {}
        for a, b in _DIFF_RE.findall(self.path.read_text()):
            seen[a] = None
            seen[b] = None
        return list(seen)

    def header(self) -> dict[str, str]:
        """DEP-3-like header fields found before the first ``diff --git`` line."""
        text = self.path.read_text().split("\ndiff --git ", 1)[0]
        fields: dict[str, str] = {}
        key = None
        for line in text.splitlines():
            m = re.match(r"^([A-Z][A-Za-z-]+):\s*(.*)$", line)
            if m and m.group(1) in HEADER_FIELDS + ("Author", "Forwarded", "Applied-Upstream"):
                key = m.group(1)
                fields[key] = m.group(2).strip()
            elif key and line.startswith(" "):
                fields[key] = (fields[key] + " " + line.strip()).strip()
            else:
                key = None
        return fields


def verified_level(value: str) -> str:
    """The level a ``Verified:`` header value starts with: its words before the first ';', '(' or em dash."""
    return _LEVEL_END_RE.split(value, maxsplit=1)[0].strip()


def patches_root() -> Path:
    return REPO_ROOT / "patches"


def parse_name(path: Path) -> Patch:
    m = PATCH_RE.match(path.name)
    if not m:
        raise UpstreamError(
            f"{path}: patch name must be NNNN-<framework>-<feature|bugfix>-<name>.patch"
        )
    return Patch(path, int(m["num"]), m["fw"], m["kind"], m["name"])


def series(key: str, root: Path | None = None) -> list[Patch]:
    """The patches of one framework in numeric order (validated names)."""
    folder = (root or patches_root()) / key
    if not folder.is_dir():
        return []
    return sorted((parse_name(p) for p in folder.glob("*.patch")), key=lambda p: p.number)


def lint_series(key: str, root: Path | None = None) -> list[str]:
    """Problems with names, numbering and headers of one framework's series ([] if none)."""
    problems: list[str] = []
    folder = (root or patches_root()) / key
    if not folder.is_dir():
        return problems
    pats: list[Patch] = []
    for p in sorted(folder.glob("*.patch")):
        try:
            pats.append(parse_name(p))
        except UpstreamError as e:
            problems.append(str(e))
    pats.sort(key=lambda p: p.number)
    for i, p in enumerate(pats, start=1):
        if p.number != i:
            problems.append(f"{p.path.name}: expected number {i:04d} (series must be contiguous from 0001)")
        if p.framework != key:
            problems.append(f"{p.path.name}: framework in name is '{p.framework}', folder is '{key}'")
        head = p.header()
        for f in HEADER_FIELDS:
            if not head.get(f):
                problems.append(f"{p.path.name}: header lacks '{f}:'")
        level = verified_level(head.get("Verified", ""))
        if head.get("Verified") and level not in VERIFIED_LEVELS:
            problems.append(f"{p.path.name}: 'Verified:' must start with one of {', '.join(VERIFIED_LEVELS)} "
                            f"(then ';' or '(' and the tests), got '{level}'")
        if not p.files:
            problems.append(f"{p.path.name}: contains no 'diff --git' section")
    return problems


def _conflict_file(stderr: str) -> str:
    m = _FAIL_RE.search(stderr)
    if m:
        return m.group(1) or m.group(2)
    lines = [ln for ln in stderr.strip().splitlines() if ln.startswith("error:")]
    return lines[0][len("error: "):] if lines else stderr.strip()[:200]


class _Sandbox:
    """A scratch git repo holding copies of the files a series touches, in its current state."""

    def __init__(self, tree: Path, files: list[str]):
        self._tmp = tempfile.TemporaryDirectory(prefix="qwen3_rl_patch_")
        self.root = Path(self._tmp.name)
        run(["git", "init", "-q", str(self.root)])
        for rel in files:
            src = tree / rel
            if src.is_file():
                dst = self.root / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)

    def apply(self, patch: Patch, reverse: bool = False) -> str:
        """'' on success, else the file that failed."""
        cmd = ["git", "-C", str(self.root), "apply", "--whitespace=nowarn"]
        if reverse:
            cmd.append("-R")
        proc = run(cmd + [str(patch.path)], check=False)
        return "" if proc.returncode == 0 else _conflict_file(proc.stderr)

    def close(self) -> None:
        self._tmp.cleanup()

    def __enter__(self) -> _Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Status:
    patch: Patch
    state: State
    detail: str = ""


def _touched(pats: list[Patch]) -> list[str]:
    seen: dict[str, None] = {}
    for p in pats:
        for f in p.files:
            seen[f] = None
    return list(seen)


def applied_prefix(tree: Path, pats: list[Patch]) -> int:
    """Largest k such that the first k patches are applied (their reverse applies in order)."""
    files = _touched(pats)
    for k in range(len(pats), 0, -1):
        with _Sandbox(tree, files) as sb:
            if all(not sb.apply(p, reverse=True) for p in reversed(pats[:k])):
                return k
    return 0


def status(tree: Path, pats: list[Patch]) -> list[Status]:
    """Per patch: applied / not applied (the rest of the series applies) / conflict / blocked."""
    k = applied_prefix(tree, pats)
    out = [Status(p, State.APPLIED) for p in pats[:k]]
    with _Sandbox(tree, _touched(pats)) as sb:
        failed = False
        for p in pats[k:]:
            if failed:
                out.append(Status(p, State.BLOCKED, "after a conflict"))
                continue
            bad = sb.apply(p)
            if bad:
                failed = True
                out.append(Status(p, State.CONFLICT, bad))
            else:
                out.append(Status(p, State.NOT_APPLIED))
    return out


def _require_tree(fw: Framework, tree: Path) -> None:
    if not tree.is_dir():
        raise UpstreamError(
            f"{fw.key}: no source tree at {tree}; run `bash download_frameworks_source_code.sh "
            f"--only {fw.key}` first (or pass --workspace)"
        )
    if not is_git_repo(tree):
        raise UpstreamError(f"{fw.key}: {tree} is not a git repository (download it with our script)")


def _first_conflict(fw: Framework, sts: list[Status]) -> Status | None:
    return next((s for s in sts if s.state is State.CONFLICT), None)


def apply_series(fw: Framework, tree: Path, pats: list[Patch], check_only: bool = False) -> list[Patch]:
    """Apply the not-yet-applied rest of the series; all or nothing. Returns what was (or would be) applied."""
    _require_tree(fw, tree)
    sts = status(tree, pats)
    bad = _first_conflict(fw, sts)
    if bad:
        raise UpstreamError(
            f"{fw.key}: {bad.patch.path.name} does not apply ({bad.detail}); nothing was changed"
        )
    todo = [s.patch for s in sts if s.state is State.NOT_APPLIED]
    if check_only or not todo:
        return todo
    backup = _Sandbox(tree, _touched(todo))
    try:
        for p in todo:
            proc = run(["git", "-C", str(tree), "apply", "--whitespace=nowarn", str(p.path)], check=False)
            if proc.returncode != 0:
                _restore(tree, backup, _touched(todo))
                raise UpstreamError(
                    f"{fw.key}: {p.path.name} failed ({_conflict_file(proc.stderr)}); tree restored"
                )
            log(f"{fw.key}: applied {p.path.name}")
    finally:
        backup.close()
    return todo


def revert_series(fw: Framework, tree: Path, pats: list[Patch], check_only: bool = False) -> list[Patch]:
    """Reverse the applied prefix of the series, last patch first. Returns what was reverted."""
    _require_tree(fw, tree)
    k = applied_prefix(tree, pats)
    todo = list(reversed(pats[:k]))
    if check_only or not todo:
        return todo
    backup = _Sandbox(tree, _touched(todo))
    try:
        for p in todo:
            proc = run(["git", "-C", str(tree), "apply", "-R", "--whitespace=nowarn", str(p.path)], check=False)
            if proc.returncode != 0:
                _restore(tree, backup, _touched(todo))
                raise UpstreamError(f"{fw.key}: reverting {p.path.name} failed; tree restored")
            log(f"{fw.key}: reverted {p.path.name}")
    finally:
        backup.close()
    return todo


def _restore(tree: Path, backup: _Sandbox, files: list[str]) -> None:
    for rel in files:
        src, dst = backup.root / rel, tree / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif dst.exists():
            dst.unlink()


def markdown_table(keys: list[str], root: Path | None = None, link_prefix: str = "../") -> str:
    """The patch table of docs/patches.md: one row per patch with its subject, switch and verification level (from
    its header; the level only, the patch header says which tests); links are ``link_prefix`` + the repo path."""
    rows = ["| framework | patch | what | switch (default) | verified |", "|---|---|---|---|---|"]
    for key in keys:
        for p in series(key, root):
            head = p.header()
            subject = head.get("Subject", "").replace("|", "\\|")
            switch = head.get("Switch", "").replace("|", "\\|")
            level = verified_level(head.get("Verified", "")).replace("|", "\\|")
            rel = p.path.resolve().relative_to(REPO_ROOT).as_posix() if p.path.resolve().is_relative_to(REPO_ROOT) \
                else f"patches/{key}/{p.path.name}"
            rows.append(f"| {key} | [{p.path.name}]({link_prefix}{rel}) | {subject} | {switch} | {level} |")
    return "\n".join(rows)
