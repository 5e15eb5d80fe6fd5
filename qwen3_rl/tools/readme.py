"""Generated sections of the docs: the counts in README.md / README.zh-CN.md, the feature index and switch table
(docs/features.md), pins, patches and the reference recipe's patch table mapped to this repository
(docs/patches.md), the bug fixes with their upstream status (docs/upstream_checks.md), the environment contract (docs/environment.md), each switch's default per setup
(docs/setups.md), the CPU shims (docs/real_engine_tests.md) and each setup's flat command (internal/COMMANDS.md,
data rather than prose): ``python -m qwen3_rl readme --write|--check``.

A section sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``; ``--check``
exits 1 when a file differs from what the pin file, the patch headers, features.toml and the golden
train commands (tests/data/train_commands) say.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable

from qwen3_rl.tools.pins import REPO_ROOT, load_pins
from qwen3_rl.tools.upstream.patches import markdown_table

DOC_FEATURES = "docs/features.md"


def _count_values() -> dict[str, object]:
    """The counts the READMEs state, from the registry, the patch series and the setups the registry knows."""
    from qwen3_rl.tools.upstream.patches import series

    reg = _registry()
    per_fw = {k: len(series(k)) for k in load_pins(pin_set="seed").frameworks}
    setups = reg.setups()
    tiny = sum(1 for s in setups if "tiny" in s)
    return {"switches": len(reg.features), "patches": sum(per_fw.values()),
            "per_fw": ", ".join(f"{k} {n}" for k, n in per_fw.items()),
            "fixes": sum(1 for k in per_fw for p in series(k) if "-bugfix-" in p.path.name),
            "cluster": len(setups) - tiny, "tiny": tiny}


def _counts() -> str:
    c = _count_values()
    return (f"{c['switches']} switches; {c['patches']} patches ({c['per_fw']}), {c['fixes']} of them bug fixes; "
            f"{c['cluster']} cluster setups and {c['tiny']} tiny CPU setups.")


def _counts_zh() -> str:
    c = _count_values()
    return (f"{c['switches']} 个开关；{c['patches']} 个 patch（{c['per_fw']}），其中 {c['fixes']} 个为 bug 修复；"
            f"{c['cluster']} 个集群 setup 和 {c['tiny']} 个 CPU 微型 setup。")


def _pins() -> str:
    pins = load_pins(pin_set="seed")
    rows = ["| framework | git tag | commit | PyPI |", "|---|---|---|---|"]
    for k, fw in pins.frameworks.items():
        src = f"`{fw.pypi}=={fw.version}`" if fw.on_pypi else "git only"
        rows.append(f"| {k} | {fw.git_ref} | `{fw.commit}` | {src} |")
    rt = ", ".join(f"{k} `{v}`" for k, v in pins.runtime.items())
    return "\n".join(rows) + f"\n\nRuntime (image): {rt}."


def _pins_current() -> str:
    """One line: the current pin set's versions (``PIN_SET=current``)."""
    pins = load_pins(pin_set="current")
    fws = ", ".join(f"{fw.pypi or fw.key} {fw.version}" + (" (sdist)" if fw.sdist else "")
                    + (f" ({fw.git_ref} `{fw.commit[:8]}`)" if not fw.on_pypi else "") for fw in pins.frameworks.values())
    rt = pins.runtime
    return f"{fws}; CANN {rt['cann']}, torch {rt['torch']}, torch-npu {rt['torch_npu']}, Python {rt['python']}."


def _short_switch(text: str, limit: int = 110) -> str:
    """A patch header's Switch: its first clause (up to the first '; ' or '. ' outside parentheses), at most ``limit``
    characters, parentheses closed (the header has the rest)."""
    depth, end = 0, len(text)
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ";." and text[i + 1:i + 2] == " " and text[max(0, i - 3):i] not in ("e.g", "i.e"):
            end = i
            break
    first = text[:end]
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0] + " …"
    first = first.replace("none (bug fix, always on", "none (bug fix")
    return first + ")" * max(0, first.count("(") - first.count(")"))


def _patches() -> str:
    """The patch table of ``upstream.patches.markdown_table``, each link named ``NNNN kind name`` (the framework is
    the row's first column), the common key prefixes abbreviated as in the switch table."""
    rows = markdown_table(list(load_pins(pin_set="seed").frameworks)).splitlines()
    for i, row in enumerate(rows[2:], start=2):
        cols = row.split(" | ")
        cols[3] = _short_switch(cols[3])
        cols[2] = re.sub(r"^(verl|vllm|vLLM|mindspeed|megatron): ", "", cols[2])  # the framework column says it
        rows[i] = " | ".join(cols)
    table = re.sub(r"\[(\d{4})-[a-z_]+-(feature|bugfix)-([a-z0-9_]+)\.patch\]", r"[\1]", "\n".join(rows))
    for long, short in KEY_PREFIXES:
        table = table.replace(long, short)
    return table


@functools.cache
def _registry():
    """features.toml, parsed once for all the sections that render from it."""
    from qwen3_rl.tools.features import load_registry

    return load_registry()


def _context_text(reg, name: str) -> str:
    """How a default taken from a context value reads: its product (``VLLM_DP × ROLLOUT_TP``) or its name."""
    ctx = reg.context[name]
    return " × ".join(ctx.product) if ctx.product else name


def _setup_label(reg, names: tuple[str, ...]) -> str:
    return ", ".join(n if n in ("all", *reg.groups) else n.removeprefix("train_").removesuffix(".sh") for n in names)


def _default_text(reg, f) -> str:
    if f.default_context:
        text = _context_text(reg, f.default_context)
    else:
        text = f"`{f.default}`" if f.default != "" else "(empty)"
    extra = ", ".join(f"{g}: `{v}`" for g, v in f.default_for.items())
    return f"{text} ({extra})" if extra else text


def _allowed_text(f) -> str:
    if f.type in ("bool", "enum"):
        return ", ".join(f"`{a}`" for a in (("True", "False") if f.type == "bool" else f.allowed))
    if f.type == "int":
        return "integer" + (f" ≥ {f.min}" if f.min is not None else "") + (" or empty" if f.default == "" else "")
    return {"list": "Hydra list `[a,b]`", "float": "number"}.get(f.type, "any")


def _when_text(when: dict) -> str:
    from qwen3_rl.tools.features import _cond_text

    return " and ".join(_cond_text(n, v) for n, v in when.items())


#: key prefixes the switch table abbreviates (its legend says so)
KEY_PREFIXES = (("actor_rollout_ref.rollout.engine_kwargs.vllm.", "VLLM."), ("actor_rollout_ref.", "ARR."))


def _short_key(key: str) -> str:
    """A Hydra key with its common prefix abbreviated (``+`` kept): ``+ARR.actor.x`` for
    ``+actor_rollout_ref.actor.x``."""
    plus = "+" if key.startswith("+") else ""
    for long, short in KEY_PREFIXES:
        if key.lstrip("+").startswith(long):
            return plus + short + key.lstrip("+").removeprefix(long)
    return key


def _stem(doc: str) -> str:
    return doc.removeprefix("docs/").removesuffix(".md")


def _switches() -> str:
    """The feature switches of the train scripts, from features.toml: env var, type, default, allowed values,
    the keys each sets (and when), the setups it applies to, its requires / excludes rules."""
    reg = _registry()
    out = ["| env var | type | default | allowed | key(s) it sets | setups | requires / excludes |",
           "|---|---|---|---|---|---|---|"]
    for f in reg.features.values():
        keys = []
        for st in f.sets:
            cond = f" when {_when_text(st.when)}" if st.when else ""
            keys.append(f"`{_short_key(st.key)}={st.value}`{cond}")
        rules = [f"{'/'.join('not empty' if w == '!' else w for w in r.when)}: {r.kind} {r.describe()}"
                 for r in (*f.requires, *f.excludes)]
        out.append(f"| `{f.env}` | {f.type} | {_default_text(reg, f)} | {_allowed_text(f)} | "
                   f"{'<br>'.join(keys) or '(read by the keys of another switch)'} | {_setup_label(reg, f.setups)} | "
                   f"{'; '.join(rules) or '–'} |")
    return "\n".join(out)


def _feature_index() -> str:
    """One row per feature of features.toml: its switch, patches, runtime modules, tests and doc."""
    reg = _registry()
    out = ["| feature | switch | patch(es) | module(s) | test(s) | doc |", "|---|---|---|---|---|---|"]
    for f in reg.features.values():
        patches = ", ".join(_patch_name(p) for p in f.patches) or "–"
        modules = ", ".join(f"`{m.removeprefix('qwen3_rl/')}`" for m in f.modules) or "–"
        tests = ", ".join(f"`{t.removeprefix('tests/')}`" for t in f.tests)
        doc = "this page" if f.doc == DOC_FEATURES else f"[{_stem(f.doc)}]({f.doc.removeprefix('docs/')})"
        out.append(f"| {f.name} | `{f.env}` | {patches} | {modules} | {tests} | {doc} |")
    return "\n".join(out)


def _current_set() -> str:
    """What each feature does on the current pin set (features.toml ``current``): one row per status and note, the
    switches that share them together, counts first."""
    from collections import Counter

    reg = _registry()
    counts = Counter(f.current.status if f.current else "undeclared" for f in reg.features.values())
    rows: dict[tuple[str, str], list[str]] = {}
    for f in reg.features.values():
        st = f.current
        rows.setdefault((st.status, st.note) if st else ("undeclared", ""), []).append(f"`{f.env}`")
    out = [", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + " (`python -m qwen3_rl features status`)", "",
           "| switch(es) | current set | where / why |", "|---|---|---|"]
    out += [f"| {', '.join(envs)} | {status} | {note} |" for (status, note), envs in rows.items()]
    return "\n".join(out)


def _golden(stem: str) -> dict:
    import json

    return json.loads((REPO_ROOT / "tests" / "data" / "train_commands" / f"{stem}.json").read_text())


def _setup_commands() -> str:
    """Each setup's flat command with every default, from the golden files of tests/test_train_configs.py."""
    import shlex

    out = []
    for script in _registry().setups():
        stem = script.removesuffix(".sh")
        argv = _golden(stem)["cases"]["defaults"]["argv"]
        head = " ".join(shlex.quote(a) for a in argv[:5])
        body = " \\\n".join([head, *(f"    {shlex.quote(a)}" for a in argv[5:])])
        out += [f"### `internal/{script}`", "", "```bash", body, "```", ""]
    return "\n".join(out).rstrip("\n")


def _feature_defaults() -> str:
    """The switches whose default differs between setups (– = the switch does not apply there), then one line naming
    those with the same default wherever they apply (their default: docs/features.md)."""
    reg = _registry()
    setups = reg.setups()
    out = ["| switch | " + " | ".join(s.removeprefix("train_").removesuffix(".sh") for s in setups) + " |",
           "|---|" + "---|" * len(setups)]
    same: list[str] = []
    for f in reg.features.values():
        cells = []
        for s in setups:
            if not reg.applies(f, s):
                cells.append("–")
            elif f.default_context and not any(g in f.default_for for g in reg.groups_of(s)):
                cells.append(_context_text(reg, f.default_context))
            else:
                d = reg.default(f, s, {})
                cells.append(f"`{d}`" if d != "" else "(empty)")
        if len(set(cells) - {"–"}) <= 1:
            same.append(f"`{f.env}`")
        else:
            out.append(f"| `{f.env}` | " + " | ".join(cells) + " |")
    out += ["", "One default in every setup they apply to: " + ", ".join(same) + "."]
    return "\n".join(out)


def _patch_name(rel: str) -> str:
    """``verl/0007-verl-feature-x.patch`` as ``verl 0007`` (the patch table of docs/patches.md links the files)."""
    fw, name = rel.split("/")
    return f"{fw} {name[:4]}"


def _find_fix(name: str) -> str:
    """The bug-fix patch whose file name ends in ``-bugfix-<name>.patch`` (any framework), as ``fw/file``."""
    from qwen3_rl.tools.upstream.patches import series

    hits = [f"{k}/{p.path.name}" for k in load_pins(pin_set="seed").frameworks for p in series(k)
            if p.path.name.endswith(f"-bugfix-{name}.patch")]
    if len(hits) != 1:
        raise ValueError(f"features.toml [reference]: fix {name!r} matches {len(hits)} bug-fix patches")
    return hits[0]


def _reference() -> str:
    """The reference recipe's patch table [ref 000] mapped to this repository, from features.toml ``[reference]``:
    each item is a feature (its switch, our patches and modules, read from the feature's entry), a bug-fix patch
    (found by name, so renumbering follows), or handled by the pinned upstream (with the test that shows it)."""
    import tomllib

    data = tomllib.loads((REPO_ROOT / "features.toml").read_text()).get("reference", {})
    if not data:
        raise ValueError("features.toml has no [reference] table")
    reg = _registry()
    out = ["| reference patch | what it does | here |", "|---|---|---|"]
    for ref, item in data.items():
        if "feature" in item:
            envs = item["feature"] if isinstance(item["feature"], list) else [item["feature"]]
            parts = []
            for env in envs:
                if env not in reg.features:
                    raise ValueError(f"features.toml [reference] {ref}: unknown switch {env!r}")
                f = reg.features[env]
                patches = ", ".join(_patch_name(p) for p in f.patches) or "no patch"
                mod = f"; `{f.modules[0].removeprefix('qwen3_rl/')}`" if f.modules else ""
                parts.append(f"`{env}`; {patches}{mod}")
            here = "<br>".join(parts)
        elif "fix" in item:
            here = f"bug fix {_patch_name(_find_fix(item['fix']))}"
        elif "pin" in item:
            test = item.get("test", "")
            if test and not (REPO_ROOT / test.split("::")[0]).exists():
                raise ValueError(f"features.toml [reference] {ref}: test {test} does not exist")
            here = f"not needed: {item['pin']}" + (f" (`{test}`)" if test else "")
        else:
            raise ValueError(f"features.toml [reference] {ref}: needs feature, fix or pin")
        out.append(f"| `{ref}` | {item.get('what', '')} | {here} |")
    return "\n".join(out)


def _fixes() -> str:
    """Every bug-fix patch with its subject and the first sentence of its ``Upstream:`` header (the rest of the
    evidence, upstream file:line and the tests, is in the patch header)."""
    from qwen3_rl.tools.upstream.patches import series

    out = ["| patch | upstream status |", "|---|---|"]
    for k in load_pins(pin_set="seed").frameworks:
        for p in series(k):
            if p.kind != "bugfix":
                continue
            head = p.header()
            up = " ".join(head.get("Upstream", "").split())
            out.append(f"| [{k} {p.path.name[:4]}](../patches/{k}/{p.path.name}) | "
                       f"{_first_sentence(up, 100).replace('|', '/')} |")
    return "\n".join(out)


#: the CPU shim modules, each listing its items in its docstring (numbered ``N. ``NAME``: ...`` items, a single
#: ````NAME``: ...`` paragraph, or a markdown table whose first column is the item)
SHIM_MODULES = ("qwen3_rl/cpu_device/shims.py", "qwen3_rl/cpu_device/gloo_shims.py",
                "qwen3_rl/cpu_device/megatron_shims.py", "qwen3_rl/cpu_device/npu/stand_in.py",
                "qwen3_rl/cpu_device/vllm023_shims.py", "qwen3_rl/cpu_device/megatron16_shims.py",
                "qwen3_rl/cpu_device/verl091_cpu.py", "qwen3_rl/cpu_device/vllm023_reload.py",
                "qwen3_rl/cpu_device/verl091_gloo_ckpt.py")
_SHIM_ITEM_RE = re.compile(r"^(?:\d+\. )?``([A-Z][A-Z0-9_]+)``: (.*)$")


def _first_sentence(text: str, limit: int = 150) -> str:
    """The first sentence of ``text`` (not cut at "e.g." / "i.e."), at most ``limit`` characters."""
    s = re.split(r"(?<!e\.g)(?<!i\.e)\.(?:\s|$)", text.strip())[0].rstrip(":;")
    return s + "." if len(s) <= limit else s[:limit].rsplit(" ", 1)[0] + " …"


def shim_items(rel: str) -> list[tuple[str, str]]:
    """The items a shim module's docstring lists: (name, what it stands in for, first sentence)."""
    import ast

    doc = ast.get_docstring(ast.parse((REPO_ROOT / rel).read_text())) or ""
    items: list[tuple[str, str]] = []
    para: list[str] = []
    for line in [*doc.splitlines(), ""]:
        m = _SHIM_ITEM_RE.match(line)
        row = re.match(r"^\| (.+?) \| (.+?) \| (.+?) \|$", line)
        if m or row or not line.strip():
            if para:
                name, text = para[0], " ".join(para[1:])
                items.append((name, _first_sentence(text)))
                para = []
        if m:
            para = [m.group(1), m.group(2)]
        elif row:
            if row.group(1) not in ("item", "---") and not row.group(1).startswith("---"):
                items.append((row.group(1), f"{row.group(2)}: {row.group(3)}"))
        elif para and line.startswith("   "):
            para.append(line.strip())
        elif para and line.strip():
            para.append(line.strip())
    return items


def _shims() -> str:
    """Every CPU shim, from the docstrings of the shim modules (the list the code keeps)."""
    out = ["| module | shim | what it stands in for, and why |", "|---|---|---|"]
    for rel in SHIM_MODULES:
        items = shim_items(rel)
        if not items:
            raise ValueError(f"{rel}: its docstring lists no shim item")
        mod = rel.removeprefix("qwen3_rl/cpu_device/")
        for name, text in items:
            shown = name if "`" in name else f"`{name}`"
            out.append(f"| `{mod}` | {shown} | {text.replace('|', '/')} |")
    return "\n".join(out)


def _env_contract() -> str:
    from qwen3_rl.tools.launch.env_contract import markdown_table as contract_table

    return contract_table()


def _env_contract_current() -> str:
    from qwen3_rl.tools.launch.env_contract import markdown_table as contract_table

    return contract_table("current")


#: generated sections per document (path relative to the checkout), same markers everywhere
DOC_SECTIONS: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {"counts": _counts},
    "README.zh-CN.md": {"counts": _counts_zh},
    DOC_FEATURES: {"feature-index": _feature_index, "switches": _switches, "current-set": _current_set},
    "docs/environment.md": {"env-contract": _env_contract, "env-contract-current": _env_contract_current},
    "docs/patches.md": {"pins": _pins, "pins_current": _pins_current, "patches": _patches, "reference": _reference},
    "docs/setups.md": {"feature-defaults": _feature_defaults},
    "docs/real_engine_tests.md": {"shims": _shims},
    "docs/upstream_checks.md": {"fixes": _fixes},
    "internal/COMMANDS.md": {"setup-commands": _setup_commands},
}


def render(text: str, sections: dict[str, Callable[[], str]], name: str) -> str:
    for section, fn in sections.items():
        pat = re.compile(rf"(<!-- generated:{section} -->).*?(<!-- /generated:{section} -->)", re.S)
        if not pat.search(text):
            raise ValueError(f"{name} lacks the generated:{section} markers")
        text = pat.sub(lambda m, fn=fn: m.group(1) + "\n" + fn() + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl readme", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    stale = []
    for rel, sections in DOC_SECTIONS.items():
        path = REPO_ROOT / rel
        old = path.read_text()
        try:
            new = render(old, sections, rel)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if new == old:
            continue
        if a.write:
            path.write_text(new)
            print(f"{rel}: generated sections updated")
        else:
            stale.append(rel)
    if stale:
        print(f"error: generated sections are stale in {', '.join(stale)}; run: python -m qwen3_rl readme --write",
              file=sys.stderr)
        return 1
    return 0
