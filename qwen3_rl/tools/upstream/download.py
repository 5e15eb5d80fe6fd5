"""Fetch pristine upstream source trees into a workspace, in git or pypi mode.

Layout (both modes): ``<workspace>/<fw.dir>/`` is a git repository whose package folders sit at
the same paths as in the upstream git tag (``verl/``, ``vllm/``, ``vllm_ascend/``, ``megatron/``),
so one patch series applies to either.

* git mode: clone ``git_url``, check out the exact pinned commit (plus submodules where pinned),
  verify ``HEAD``.
* pypi mode: download the pinned wheel (cached), unpack only the text files of the pinned package
  folders, and commit them once as ``pristine <key> <version>`` with a fixed author and date. A framework pinned
  as an sdist (``sdist = true``: PyPI serves no wheel) is fetched from the package index's simple API, checked
  against its pinned sha256, and all its text files are unpacked (the sdist is the whole source tree).

Reruns verify and do nothing. A tree at another commit or with local changes stops with expected
vs found and the fix (``--force``).
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import os
import platform
import shutil
import tarfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable
from pathlib import Path

from qwen3_rl.tools.pins import Framework, load_pins, pypi_requirement
from qwen3_rl.tools.upstream.common import (
    UpstreamError,
    add_local_excludes,
    default_cache,
    dirty_files,
    git,
    is_git_repo,
    log,
    run,
)

# Binary files that are never part of a text source tree, whatever their content.
BINARY_SUFFIXES = (".so", ".a", ".o", ".dll", ".dylib", ".pyd", ".bin", ".pt", ".cubin", ".fatbin")
MAX_TEXT_BYTES = 4 * 1024 * 1024


def _platform_tags(arch: str) -> list[str]:
    return [f"manylinux_2_{v}_{arch}" for v in (35, 34, 31, 28, 24, 17)] + [f"manylinux2014_{arch}"]


def wheel_pattern(fw: Framework) -> str:
    """Glob of the pinned wheel's file name (distribution names are normalised with ``_``)."""
    return f"{fw.pypi.replace('-', '_')}-{fw.version}-*.whl"


def fetch_wheel(fw: Framework, wheel_dir: Path, arch: str | None = None) -> Path:
    """Return the pinned wheel from ``wheel_dir``, downloading it with pip if absent.

    Uses pip's usual index settings (``PIP_INDEX_URL`` etc.), so a PyPI mirror works.
    """
    wheel_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(wheel_dir.glob(wheel_pattern(fw)))
    if found:
        return found[0]
    arch = arch or platform.machine()
    cmd = ["python3", "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--python-version", "3.11", "-d", str(wheel_dir)]
    for tag in _platform_tags(arch):
        cmd += ["--platform", tag]
    cmd.append(pypi_requirement(fw))
    log(f"{fw.key}: downloading {pypi_requirement(fw)} wheel ({arch}) into {wheel_dir}")
    run(cmd)
    found = sorted(wheel_dir.glob(wheel_pattern(fw)))
    if not found:
        raise UpstreamError(f"{fw.key}: pip reported success but no {wheel_pattern(fw)} in {wheel_dir}")
    return found[0]


def sdist_name(fw: Framework) -> str:
    """File name of the pinned sdist (PEP 625: normalised name, ``.tar.gz``)."""
    return f"{fw.pypi.replace('-', '_')}-{fw.version}.tar.gz"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _index_url() -> str:
    """pip's index (``PIP_INDEX_URL``, else PyPI's simple API): the same registry ``pip download`` uses."""
    return (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")


def fetch_sdist(fw: Framework, cache_dir: Path) -> Path:
    """The pinned sdist from ``cache_dir``, downloaded from the index's simple API (JSON, PEP 691) if absent, and
    checked against ``fw.sha256`` either way. ``pip download`` cannot fetch it: it builds an sdist's metadata,
    which for vllm-ascend needs CANN."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / sdist_name(fw)
    if not out.is_file():
        url = f"{_index_url()}/{fw.pypi}/"
        req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                files = json.load(r).get("files", [])
        except (OSError, ValueError) as e:
            raise UpstreamError(f"{fw.key}: cannot read the package index {url}: {e}") from e
        hit = next((f for f in files if f.get("filename") == out.name), None)
        if hit is None:
            raise UpstreamError(f"{fw.key}: the index {url} lists no {out.name}")
        log(f"{fw.key}: downloading {out.name} (sdist) into {cache_dir}")
        tmp = out.with_suffix(".partial")
        try:
            with urllib.request.urlopen(urllib.parse.urljoin(url, hit["url"]), timeout=600) as r, tmp.open("wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise UpstreamError(f"{fw.key}: download of {out.name} failed: {e}") from e
        tmp.rename(out)
    got = _sha256(out)
    if got != fw.sha256:
        raise UpstreamError(f"{fw.key}: {out} has sha256 {got}, pins.toml says {fw.sha256}; delete it and rerun")
    return out


def unpack_sdist(fw: Framework, sdist: Path, tree: Path) -> tuple[int, int]:
    """Unpack the text files of ``sdist`` (its top folder stripped) into ``tree``. Returns (written, skipped)."""
    written = skipped = 0
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            if not m.isfile():
                continue
            parts = m.name.split("/", 1)
            if len(parts) < 2 or ".." in parts[1].split("/"):
                continue
            name = parts[1]
            f = tf.extractfile(m)
            data = f.read() if f else b""
            if any(name.endswith(s) for s in BINARY_SUFFIXES) or not _is_text(data):
                skipped += 1
                continue
            out = tree / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            if m.mode & 0o111:
                out.chmod(0o755)
            written += 1
    missing = [p for p in fw.packages if not (tree / p).exists()]
    if missing:
        raise UpstreamError(f"{fw.key}: sdist {sdist.name} has no folder {', '.join(missing)}")
    return written, skipped


def _is_text(data: bytes) -> bool:
    return len(data) <= MAX_TEXT_BYTES and b"\0" not in data[:65536]


def unpack_wheel(fw: Framework, wheel: Path, tree: Path) -> tuple[int, int]:
    """Unpack the text files of ``fw.packages`` from ``wheel`` into ``tree``.

    Returns (files written, binary files skipped).
    """
    written = skipped = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            top = info.filename.split("/", 1)[0]
            if top not in fw.packages:
                continue
            name = info.filename
            if any(name.endswith(s) or fnmatch.fnmatch(name, f"*{s}.*") for s in BINARY_SUFFIXES):
                skipped += 1
                continue
            data = zf.read(info)
            if not _is_text(data):
                skipped += 1
                continue
            out = tree / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            mode = (info.external_attr >> 16) & 0o777
            if mode & 0o111:
                out.chmod(0o755)
            written += 1
    missing = [p for p in fw.packages if not (tree / p).exists()]
    if missing:
        raise UpstreamError(f"{fw.key}: wheel {wheel.name} has no folder {', '.join(missing)}")
    return written, skipped


def tree_mode(tree: Path) -> str:
    """'pypi' if the tree is a pypi-mode pristine repo, 'git' if another git repo, '' if none."""
    if not is_git_repo(tree):
        return ""
    first = git(tree, "log", "--reverse", "--format=%s", check=False).stdout.splitlines()
    return "pypi" if first and first[0].startswith("pristine ") else "git"


def _verify_clean(fw: Framework, tree: Path) -> None:
    dirty = dirty_files(tree)
    if dirty:
        shown = ", ".join(dirty[:3]) + (f" (+{len(dirty) - 3} more)" if len(dirty) > 3 else "")
        raise UpstreamError(
            f"{fw.key}: {tree} has local changes ({shown}); expected a pristine tree. "
            "If these are our patches run `bash apply_all_patches.sh --revert`; "
            f"to discard all changes re-run with --force --only {fw.key}"
        )


def download_pypi(fw: Framework, dest: Path, wheel_dir: Path, force: bool = False,
                  arch: str | None = None) -> str:
    """Create or verify ``dest/fw.dir`` from the pinned wheel. Returns 'created' or 'verified'."""
    if not fw.on_pypi:
        raise UpstreamError(
            f"{fw.key} is not published on PyPI: it needs --source git "
            f"({fw.git_url} {fw.git_ref})"
        )
    tree = dest / fw.dir
    if tree.exists():
        mode = tree_mode(tree)
        if mode == "pypi":
            head = git(tree, "log", "-1", "--format=%s").stdout.strip()
            if head != fw.pristine_message or git(tree, "rev-list", "--count", "HEAD").stdout.strip() != "1":
                if not force:
                    raise UpstreamError(
                        f"{fw.key}: expected '{fw.pristine_message}' at {tree}, found '{head}'; "
                        f"re-run with --force --only {fw.key}"
                    )
            elif not force:
                _verify_clean(fw, tree)
                log(f"{fw.key}: {tree} verified ({fw.pristine_message}), nothing to do")
                return "verified"
        elif not force:
            found = "a git checkout" if mode == "git" else "a folder that is not a pypi-mode tree"
            raise UpstreamError(
                f"{fw.key}: expected a pypi-mode tree '{fw.pristine_message}' at {tree}, "
                f"found {found}; re-run with --force --only {fw.key} to replace it"
            )
        shutil.rmtree(tree)
    archive = fetch_sdist(fw, wheel_dir) if fw.sdist else fetch_wheel(fw, wheel_dir, arch)
    tmp = dest / f".{fw.dir}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    written, skipped = (unpack_sdist if fw.sdist else unpack_wheel)(fw, archive, tmp)
    run(["git", "init", "-q", str(tmp)])
    git(tmp, "config", "core.autocrlf", "false")
    git(tmp, "config", "commit.gpgsign", "false")
    add_local_excludes(tmp)
    git(tmp, "add", "-A", "-f")
    git(tmp, "commit", "-q", "--no-verify", "-m", fw.pristine_message)
    tmp.rename(tree)  # only a complete tree ever gets the final name
    log(f"{fw.key}: {tree} created from {archive.name} ({written} text files, {skipped} binaries left out)")
    return "created"


def archive_name(fw: Framework) -> str:
    """``<key>-<commit>.tar.gz``: a ``git archive --prefix=<dir>/`` of the pinned commit (``../shared/upstream``)."""
    return f"{fw.key}-{fw.commit}.tar.gz"


def download_archive(fw: Framework, dest: Path, archive_dir: Path, force: bool = False) -> str:
    """Create or verify ``dest/fw.dir`` from ``archive_dir/<key>-<commit>.tar.gz`` for a framework no registry
    serves (MindSpeed): the archive's sha256 must be listed in ``archive_dir/SHA256SUMS`` and its embedded commit
    id (``git get-tar-commit-id``) must be the pinned commit. The tree is a one-commit repo like a pypi-mode tree.
    Returns 'created' or 'verified'."""
    import gzip
    import subprocess

    archive = archive_dir / archive_name(fw)
    if not archive.is_file():
        raise UpstreamError(f"{fw.key}: no {archive.name} in {archive_dir} (git-only: use --source git)")
    sums = {}
    sums_file = archive_dir / "SHA256SUMS"
    if sums_file.is_file():
        for line in sums_file.read_text().splitlines():
            if line.strip():
                digest, name = line.split(None, 1)
                sums[name.strip().lstrip("*")] = digest
    if sums.get(archive.name) != _sha256(archive):
        raise UpstreamError(f"{fw.key}: {archive.name} does not match {sums_file}")
    with gzip.open(archive) as f:
        head = f.read(1 << 16)
    commit = subprocess.run(["git", "get-tar-commit-id"], input=head, capture_output=True, timeout=60)
    if commit.stdout.decode().strip() != fw.commit:
        raise UpstreamError(f"{fw.key}: {archive.name} is not a git archive of {fw.commit}")
    tree = dest / fw.dir
    if tree.exists() and not force:
        if tree_mode(tree) == "pypi" and git(tree, "log", "-1", "--format=%s").stdout.strip() == fw.pristine_message:
            _verify_clean(fw, tree)
            log(f"{fw.key}: {tree} verified ({fw.pristine_message}), nothing to do")
            return "verified"
        raise UpstreamError(f"{fw.key}: {tree} is not the tree of {archive.name}; re-run with --force --only {fw.key}")
    if tree.exists():
        shutil.rmtree(tree)
    tmp = dest / f".{fw.dir}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tf:
        tf.extractall(tmp, filter="data")
    inner = tmp / fw.dir
    if not inner.is_dir():
        raise UpstreamError(f"{fw.key}: {archive.name} has no top folder {fw.dir}/")
    run(["git", "init", "-q", str(inner)])
    git(inner, "config", "core.autocrlf", "false")
    git(inner, "config", "commit.gpgsign", "false")
    add_local_excludes(inner)
    git(inner, "add", "-A", "-f")
    git(inner, "commit", "-q", "--no-verify", "-m", fw.pristine_message)
    inner.rename(tree)
    shutil.rmtree(tmp)
    log(f"{fw.key}: {tree} created from {archive.name} (commit {fw.commit[:12]})")
    return "created"


def _head(tree: Path) -> str:
    return git(tree, "rev-parse", "HEAD").stdout.strip()


def _submodules_ok(tree: Path) -> list[str]:
    out = git(tree, "submodule", "status", "--recursive", check=False).stdout
    return [line.strip() for line in out.splitlines() if line[:1] in "+-U"]


def download_git(fw: Framework, dest: Path, force: bool = False) -> str:
    """Clone or verify ``dest/fw.dir`` at the pinned commit. Returns 'created', 'updated' or 'verified'.

    An abbreviated commit pin is checked as a prefix of ``HEAD``; an empty one (tag only) is reported, not checked.
    """
    if not fw.git_ref:
        raise UpstreamError(f"{fw.key} {fw.version} has no upstream tag in pins.toml: download it with --source pypi")
    tree = dest / fw.dir
    action = "verified"
    if tree.exists() and not is_git_repo(tree):
        if not force:
            raise UpstreamError(
                f"{fw.key}: {tree} exists but is not a git repository; "
                f"remove it or re-run with --force --only {fw.key}"
            )
        shutil.rmtree(tree)
    if tree.exists() and tree_mode(tree) == "pypi":
        if not force:
            raise UpstreamError(
                f"{fw.key}: expected commit {fw.commit} at {tree}, found a pypi-mode tree "
                f"('{fw.pristine_message}'); re-run with --force --only {fw.key} to replace it"
            )
        shutil.rmtree(tree)
    if not tree.exists():
        dest.mkdir(parents=True, exist_ok=True)
        log(f"{fw.key}: cloning {fw.git_url} into {tree}")
        tmp = dest / f".{fw.dir}.partial"
        if tmp.exists():
            shutil.rmtree(tmp)
        run(["git", "clone", "-q", "--no-checkout", fw.git_url, str(tmp)])
        _checkout(fw, tmp)
        tmp.rename(tree)
        action = "created"
    else:
        head = _head(tree)
        if not _at_pin(fw, head):
            if not force:
                raise UpstreamError(
                    f"{fw.key}: expected commit {fw.commit} ({fw.git_ref}) at {tree}, found {head}; "
                    f"re-run with --force --only {fw.key}"
                )
            _checkout(fw, tree)
            action = "updated"
        elif force:
            _checkout(fw, tree)
            action = "updated"
    add_local_excludes(tree)
    if fw.submodules:
        bad = _submodules_ok(tree)
        if bad and not force:
            raise UpstreamError(
                f"{fw.key}: submodules not at the pinned commits ({bad[0]}); "
                f"re-run with --force --only {fw.key}"
            )
    _verify_clean(fw, tree)
    head = _head(tree)
    if not _at_pin(fw, head):
        raise UpstreamError(f"{fw.key}: expected commit {fw.commit}, found {head} after checkout")
    pinned = fw.commit[:12] if fw.commit else f"{head[:12]}, no commit pinned: the tag's"
    log(f"{fw.key}: {tree} {action} at {fw.git_ref} ({pinned})")
    return action


def _at_pin(fw: Framework, head: str) -> bool:
    """HEAD is the pinned commit (a full id, or an abbreviation of it); with no commit pinned, the tag's commit."""
    if fw.commit:
        return head.startswith(fw.commit)
    return True


def _checkout(fw: Framework, tree: Path) -> None:
    if not fw.commit or len(fw.commit) < 40:  # resolve the tag, then check its commit against the abbreviation
        git(tree, "fetch", "-q", "origin", f"+refs/tags/{fw.git_ref}:refs/tags/{fw.git_ref}", check=False)
        target = git(tree, "rev-parse", f"refs/tags/{fw.git_ref}^{{commit}}", check=False).stdout.strip()
        if not target or not _at_pin(fw, target):
            raise UpstreamError(f"{fw.key}: tag {fw.git_ref} of {fw.git_url} is {target or 'absent'}, "
                                f"pins.toml says {fw.commit or '(any)'}")
        git(tree, "checkout", "-q", "-f", "--detach", target)
        git(tree, "clean", "-q", "-fd")
        if fw.submodules:
            git(tree, "submodule", "sync", "--recursive")
            git(tree, "submodule", "update", "-q", "--init", "--recursive", "--force")
        return
    has = git(tree, "cat-file", "-e", f"{fw.commit}^{{commit}}", check=False).returncode == 0
    if not has:
        git(tree, "fetch", "-q", "origin", f"+refs/tags/{fw.git_ref}:refs/tags/{fw.git_ref}",
            check=False)
        if git(tree, "cat-file", "-e", f"{fw.commit}^{{commit}}", check=False).returncode != 0:
            git(tree, "fetch", "-q", "origin", fw.commit, check=False)
        if git(tree, "cat-file", "-e", f"{fw.commit}^{{commit}}", check=False).returncode != 0:
            raise UpstreamError(
                f"{fw.key}: commit {fw.commit} ({fw.git_ref}) not found in {fw.git_url}"
            )
    git(tree, "checkout", "-q", "-f", "--detach", fw.commit)
    git(tree, "clean", "-q", "-fd")
    if fw.submodules:
        git(tree, "submodule", "sync", "--recursive")
        git(tree, "submodule", "update", "-q", "--init", "--recursive", "--force")


def pristine_dir(pins_file: Path, pin_set: str | None = None) -> Path:
    """``<cache>/pristine-<first 12 hex of the set's digest>``: the shared cache of pristine trees of one pin set
    (``pin_set``, else ``$PIN_SET``, else seed; :meth:`Pins.digest`: it changes only when that set's pins do)."""
    return default_cache() / f"pristine-{load_pins(pins_file, pin_set).digest()[:12]}"


def fill_pristine(pins_file: Path, frameworks: Iterable[Framework], pin_set: str | None = None) -> Path:
    """:func:`pristine_dir` of ``pins_file`` holding the pristine tree of each of ``frameworks`` (from its pinned
    wheel; made once, verified after). Processes filling the same cache at the same time (the test suite and
    ``tests/upstream_own/verl_cpu.py``) take turns on a lock file beside it. Returns the cache folder."""
    ws = pristine_dir(pins_file, pin_set)
    ws.mkdir(parents=True, exist_ok=True)
    with (ws.parent / f"{ws.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for fw in frameworks:
            download_pypi(fw, ws, default_cache() / "wheels")
    return ws
