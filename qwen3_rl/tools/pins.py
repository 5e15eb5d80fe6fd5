"""The pin file (``pins.toml``): the single source of every upstream version and commit.

Everything that needs a version or commit (download, apply, build, Dockerfile, tests, docs)
reads it through :func:`load_pins`.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PINS_ENV = "QWEN3_RL_PINS"

_REQUIRED = ("dir", "git_url", "git_ref", "commit", "pypi", "version", "packages")


class PinError(ValueError):
    """The pin file is missing, malformed, or asked for an unknown framework."""


@dataclass(frozen=True)
class Framework:
    """One pinned upstream framework.

    ``key`` is both the patch folder name (``patches/<key>``) and the name used on command lines.
    """

    key: str
    dir: str
    git_url: str
    git_ref: str
    commit: str
    pypi: str
    version: str
    packages: tuple[str, ...]
    submodules: bool = False

    @property
    def on_pypi(self) -> bool:
        return bool(self.pypi)

    @property
    def pristine_message(self) -> str:
        """Commit message of the one commit of a pypi-mode tree."""
        return f"pristine {self.key} {self.version}"


@dataclass(frozen=True)
class Pins:
    path: Path
    frameworks: dict[str, Framework]
    runtime: dict[str, str] = field(default_factory=dict)

    def select(self, only: str | None) -> list[Framework]:
        """Frameworks named in a comma-separated ``only`` list (all, in pin-file order, if empty).

        Raises PinError naming the unknown key and the known ones.
        """
        if not only:
            return list(self.frameworks.values())
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in self.frameworks]
        if unknown:
            raise PinError(
                f"unknown framework {', '.join(unknown)!s}; known: {', '.join(self.frameworks)}"
            )
        return [self.frameworks[n] for n in self.frameworks if n in names]


def default_pins_path() -> Path:
    env = os.environ.get(PINS_ENV)
    return Path(env) if env else REPO_ROOT / "pins.toml"


def load_pins(path: str | os.PathLike[str] | None = None) -> Pins:
    """Parse and validate the pin file (default: ``$QWEN3_RL_PINS`` or the repo's ``pins.toml``)."""
    p = Path(path) if path else default_pins_path()
    if not p.is_file():
        raise PinError(f"pin file not found: {p}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise PinError(f"{p}: not valid TOML: {e}") from e
    if data.get("schema") != 1:
        raise PinError(f"{p}: expected 'schema = 1', found {data.get('schema')!r}")
    fws: dict[str, Framework] = {}
    for key, entry in (data.get("framework") or {}).items():
        missing = [k for k in _REQUIRED if k not in entry]
        if missing:
            raise PinError(f"{p}: framework.{key} lacks {', '.join(missing)}")
        commit = str(entry["commit"])
        if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
            raise PinError(f"{p}: framework.{key}.commit must be 40 lowercase hex digits: {commit!r}")
        packages = entry["packages"]
        if not isinstance(packages, list) or not packages:
            raise PinError(f"{p}: framework.{key}.packages must be a non-empty list")
        fws[key] = Framework(
            key=key,
            dir=str(entry["dir"]),
            git_url=str(entry["git_url"]),
            git_ref=str(entry["git_ref"]),
            commit=commit,
            pypi=str(entry["pypi"]),
            version=str(entry["version"]),
            packages=tuple(str(x) for x in packages),
            submodules=bool(entry.get("submodules", False)),
        )
    if not fws:
        raise PinError(f"{p}: no [framework.*] tables")
    runtime = {k: str(v) for k, v in (data.get("runtime") or {}).items()}
    return Pins(path=p, frameworks=fws, runtime=runtime)


def pypi_requirement(fw: Framework) -> str:
    """``name==version`` for pip, or PinError if the framework is git-only."""
    if not fw.on_pypi:
        raise PinError(f"{fw.key} is not published on PyPI; it needs --source git")
    return f"{fw.pypi}=={fw.version}"


def pins_main(argv: list[str]) -> int:
    """``python -m qwen3_rl pins [--format table|shell|json] [--get KEY.FIELD]``."""
    import argparse
    import json
    import shlex
    import sys

    ap = argparse.ArgumentParser(prog="python -m qwen3_rl pins", description=pins_main.__doc__)
    ap.add_argument("--pins")
    ap.add_argument("--format", choices=("table", "shell", "json"), default="table")
    ap.add_argument("--get", help="print one value, e.g. vllm.version or runtime.torch")
    a = ap.parse_args(argv)
    try:
        pins = load_pins(a.pins)
        if a.get:
            sect, _, fld = a.get.partition(".")
            if sect == "runtime":
                if fld not in pins.runtime:
                    raise PinError(f"no runtime.{fld} in {pins.path}")
                print(pins.runtime[fld])
            else:
                fw = pins.select(sect)[0]
                if not hasattr(fw, fld):
                    raise PinError(f"no field '{fld}' for {sect}")
                val = getattr(fw, fld)
                print(" ".join(val) if isinstance(val, tuple) else val)
            return 0
    except PinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.format == "json":
        data = {k: {**fw.__dict__, "packages": list(fw.packages)} for k, fw in pins.frameworks.items()}
        print(json.dumps({"frameworks": data, "runtime": pins.runtime}, indent=2))
    elif a.format == "shell":
        for k, fw in pins.frameworks.items():
            up = k.upper()
            for fld in ("dir", "git_url", "git_ref", "commit", "pypi", "version"):
                print(f"PIN_{up}_{fld.upper()}={shlex.quote(str(getattr(fw, fld)))}")
        for k, v in pins.runtime.items():
            print(f"PIN_RUNTIME_{k.upper()}={shlex.quote(v)}")
    else:
        for k, fw in pins.frameworks.items():
            src = f"{fw.pypi}=={fw.version}" if fw.on_pypi else "(git only)"
            print(f"{k:12s} {fw.git_ref:22s} {fw.commit[:12]}  {src}")
    return 0
