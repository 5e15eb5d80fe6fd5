"""Generated sections of README.md (pins, patches, switches, environment contract):
``python -m qwen3_rl readme --write|--check``.

A section sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``; ``--check``
exits 1 when README.md differs from what the pin file and the patch headers say.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from qwen3_rl.pins import REPO_ROOT, load_pins
from qwen3_rl.upstream.patches import markdown_table


def _pins() -> str:
    pins = load_pins()
    rows = ["| framework | git tag | commit | PyPI |", "|---|---|---|---|"]
    for k, fw in pins.frameworks.items():
        src = f"`{fw.pypi}=={fw.version}`" if fw.on_pypi else "git only"
        rows.append(f"| {k} | {fw.git_ref} | `{fw.commit}` | {src} |")
    rt = ", ".join(f"{k} `{v}`" for k, v in pins.runtime.items())
    return "\n".join(rows) + f"\n\nRuntime (image): {rt}."


def _patches() -> str:
    return markdown_table(list(load_pins().frameworks))


def _switches() -> str:
    """Boolean feature switches of the train scripts: env var, default, the Hydra key it sets.

    A script's variables and override lines are its own plus those of the libraries it sources
    (``source "$(dirname "${BASH_SOURCE[0]}")/lib/X.sh"``, internal/lib/): a switch defined once in
    a library is a switch of every script sourcing it."""
    source_re = re.compile(r'^(?:source|\.) "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/([\w./-]+\.sh)"', re.M)
    scripts = sorted((REPO_ROOT / "internal").glob("train_*.sh"))
    rows: dict[str, tuple[set[str], set[str], list[str]]] = {}
    for script in scripts:
        own = script.read_text()
        text = "\n".join([own, *((script.parent / rel).read_text() for rel in source_re.findall(own))])
        for var, default in re.findall(r"^([A-Z_0-9]+)=\$\{\1:-(.*)\}$", text, flags=re.M):
            if default not in ("True", "False"):
                continue
            keys = {k.replace("${_vllm_kw}", "actor_rollout_ref.rollout.engine_kwargs.vllm")
                    for k in re.findall(rf"\+*((?:\$\{{_vllm_kw\}})?[a-z_.0-9]+)=\$\{{{var}\}}", text)}
            if f'"${{{var}}}" == True' in text and keys:
                keys.add("(and more keys when True: see the script)")
            entry = rows.setdefault(var, (set(), set(), []))
            entry[0].add(default)
            entry[1].update(keys)
            entry[2].append(script.name.removeprefix("train_").removesuffix(".sh"))
    out = ["| env var | default | Hydra key it sets | scripts |", "|---|---|---|---|"]
    for var, (defaults, keys, names) in sorted(rows.items()):
        key = ", ".join(k if k.startswith("(") else f"`{k}`" for k in sorted(keys)) or "key(s) added only when True (see the script)"
        where = "all" if len(names) == len(scripts) else ", ".join(names)
        out.append(f"| `{var}` | `{'/'.join(sorted(defaults))}` | {key} | {where} |")
    return "\n".join(out)


def _env_contract() -> str:
    from qwen3_rl.launch.env_contract import markdown_table as contract_table

    return contract_table()


SECTIONS: dict[str, Callable[[], str]] = {"pins": _pins, "patches": _patches, "switches": _switches,
                                          "env-contract": _env_contract}


def render(text: str) -> str:
    for name, fn in SECTIONS.items():
        pat = re.compile(rf"(<!-- generated:{name} -->).*?(<!-- /generated:{name} -->)", re.S)
        if not pat.search(text):
            raise ValueError(f"README.md lacks the generated:{name} markers")
        text = pat.sub(lambda m, fn=fn: m.group(1) + "\n" + fn() + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl readme", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    path = REPO_ROOT / "README.md"
    old = path.read_text()
    try:
        new = render(old)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.write:
        if new != old:
            path.write_text(new)
            print("README.md: generated sections updated")
        return 0
    if new != old:
        print("error: README.md generated sections are stale; run: python -m qwen3_rl readme --write",
              file=sys.stderr)
        return 1
    return 0
