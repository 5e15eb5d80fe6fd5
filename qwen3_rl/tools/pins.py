"""The pin file (``pins.toml``): the single source of every upstream version and commit.

Everything that needs a version or commit (download, apply, build, Dockerfile, tests, docs)
reads it through :func:`load_pins`. The file holds two pin sets: ``seed`` (the top-level tables, the
default) and ``current`` (``[sets.current]``). Which one is used is decided in one place,
:func:`resolve_pin_set`: a ``--pin-set`` flag, else the ``PIN_SET`` environment variable, else ``seed``;
any other value stops with one line.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PINS_ENV = "QWEN3_RL_PINS"
PIN_SET_ENV = "PIN_SET"
DEFAULT_PIN_SET = "seed"
_HEX = frozenset("0123456789abcdef")

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
    sdist: bool = False
    sha256: str = ""

    @property
    def on_pypi(self) -> bool:
        return bool(self.pypi)

    @property
    def pristine_message(self) -> str:
        """Commit message of the one commit of a pypi-mode tree."""
        return f"pristine {self.key} {self.version}"


@dataclass(frozen=True)
class Pins:
    """One pin set of the pin file.

    ``name``: the set (``seed`` or ``current``); ``patches_dir`` / ``workspace_dir``: its patch folder and default
    workspace, relative to the checkout (``patches`` and ``workspace`` for the seed set).
    """

    path: Path
    frameworks: dict[str, Framework]
    runtime: dict[str, str] = field(default_factory=dict)
    name: str = DEFAULT_PIN_SET
    patches_dir: str = "patches"
    workspace_dir: str = "workspace"
    source: str = "git"  # the download script's default --source for this set

    @property
    def patches_root(self) -> Path:
        """The set's patch folder (``patches/`` or ``patches/current/``): ``<root>/<fw key>/NNNN-*.patch``."""
        return REPO_ROOT / self.patches_dir

    def digest(self) -> str:
        """sha256 (hex) of the set's frameworks and runtime: a cache key that changes only when this set's pins do."""
        import hashlib
        import json

        data = {"frameworks": {k: {**fw.__dict__, "packages": list(fw.packages)} for k, fw in self.frameworks.items()},
                "runtime": self.runtime}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

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


def _read(p: Path) -> dict:
    if not p.is_file():
        raise PinError(f"pin file not found: {p}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise PinError(f"{p}: not valid TOML: {e}") from e
    if data.get("schema") != 1:
        raise PinError(f"{p}: expected 'schema = 1', found {data.get('schema')!r}")
    return data


def pin_set_names(path: str | os.PathLike[str] | None = None) -> list[str]:
    """The sets the pin file defines: ``seed`` first, then its ``[sets.*]`` tables."""
    data = _read(Path(path) if path else default_pins_path())
    return [DEFAULT_PIN_SET, *(data.get("sets") or {})]


def _switch(data: dict) -> tuple[str, str]:
    """(environment variable, default set) as the pin file's ``[pin_set]`` table declares the switch."""
    decl = data.get("pin_set") or {}
    return str(decl.get("env", PIN_SET_ENV)), str(decl.get("default", DEFAULT_PIN_SET))


def resolve_pin_set(value: str | None = None, env: Mapping[str, str] | None = None,
                    path: str | os.PathLike[str] | None = None) -> str:
    """THE choice of pin set, for every command: ``value`` (a ``--pin-set`` flag) if given, else the switch's
    environment variable (``[pin_set].env`` of the pin file: ``PIN_SET``) in ``env`` (default: this process's
    environment), else the declared default (``seed``). An unknown name raises PinError (one line)."""
    env = os.environ if env is None else env
    data = _read(Path(path) if path else default_pins_path())
    var, default = _switch(data)
    name = value if value else (env.get(var) or default)
    known = [DEFAULT_PIN_SET, *(data.get("sets") or {})]
    if name not in known:
        source = "--pin-set" if value else var
        raise PinError(f"{source}={name!r} is not a pin set of pins.toml; use one of: {', '.join(known)}")
    return name


def _commit_ok(commit: str) -> bool:
    """A full (40) or abbreviated (7-39) lowercase hex commit id, or "" (tag only)."""
    return commit == "" or (7 <= len(commit) <= 40 and set(commit) <= _HEX)


def load_pins(path: str | os.PathLike[str] | None = None, pin_set: str | None = None) -> Pins:
    """Parse and validate one set of the pin file (default: ``$QWEN3_RL_PINS`` or the repo's ``pins.toml``; the
    set from :func:`resolve_pin_set`: ``pin_set``, else ``$PIN_SET``, else ``seed``)."""
    p = Path(path) if path else default_pins_path()
    top = _read(p)
    name = resolve_pin_set(pin_set, path=p)
    data = top if name == DEFAULT_PIN_SET else top["sets"][name]
    where = "" if name == DEFAULT_PIN_SET else f"sets.{name}."
    fws: dict[str, Framework] = {}
    for key, entry in (data.get("framework") or {}).items():
        missing = [k for k in _REQUIRED if k not in entry]
        if missing:
            raise PinError(f"{p}: {where}framework.{key} lacks {', '.join(missing)}")
        commit = str(entry["commit"])
        if not _commit_ok(commit):
            raise PinError(f"{p}: {where}framework.{key}.commit must be 7-40 lowercase hex digits or \"\": {commit!r}")
        if entry.get("sdist") and not entry.get("sha256"):
            raise PinError(f"{p}: {where}framework.{key}: an sdist pin needs its sha256")
        packages = entry["packages"]
        if not isinstance(packages, list) or not packages:
            raise PinError(f"{p}: {where}framework.{key}.packages must be a non-empty list")
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
            sdist=bool(entry.get("sdist", False)),
            sha256=str(entry.get("sha256", "")),
        )
    if not fws:
        raise PinError(f"{p}: no [{where}framework.*] tables")
    runtime = {k: str(v) for k, v in (data.get("runtime") or {}).items()}
    if name == DEFAULT_PIN_SET:
        return Pins(path=p, frameworks=fws, runtime=runtime)
    return Pins(path=p, frameworks=fws, runtime=runtime, name=name,
                patches_dir=str(data.get("patches", f"patches/{name}")),
                workspace_dir=str(data.get("workspace", f"workspace-{name}")),
                source=str(data.get("source", "git")))


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
    ap.add_argument("--pin-set", help="pin set (default: $PIN_SET, else seed)")
    ap.add_argument("--format", choices=("table", "shell", "json"), default="table")
    ap.add_argument("--get", help="print one value, e.g. vllm.version or runtime.torch")
    a = ap.parse_args(argv)
    try:
        pins = load_pins(a.pins, a.pin_set)
        if a.get:
            if a.get == "set":
                print(pins.name)
                return 0
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
        print(json.dumps({"set": pins.name, "frameworks": data, "runtime": pins.runtime}, indent=2))
    elif a.format == "shell":
        print(f"PIN_SET={shlex.quote(pins.name)}")
        for k, fw in pins.frameworks.items():
            up = k.upper()
            for fld in ("dir", "git_url", "git_ref", "commit", "pypi", "version"):
                print(f"PIN_{up}_{fld.upper()}={shlex.quote(str(getattr(fw, fld)))}")
        for k, v in pins.runtime.items():
            print(f"PIN_RUNTIME_{k.upper()}={shlex.quote(v)}")
    else:
        print(f"pin set: {pins.name}")
        for k, fw in pins.frameworks.items():
            src = f"{fw.pypi}=={fw.version}" + (" (sdist)" if fw.sdist else "") if fw.on_pypi else "(git only)"
            print(f"{k:12s} {fw.git_ref or '-':22s} {fw.commit[:12] or '-':12s}  {src}")
    return 0
