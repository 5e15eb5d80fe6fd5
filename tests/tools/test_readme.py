"""README.md and README.zh-CN.md: short, the same shape and the same commands; links resolve; counts generated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READMES = ("README.md", "README.zh-CN.md")
MAX_BYTES = 15 * 1024


def _text(name: str) -> str:
    return (REPO / name).read_text()


def _commands(text: str) -> list[str]:
    """Every command of the fenced code blocks (comments dropped) and every `inline` command in a table cell."""
    out = []
    for block in re.findall(r"```(?:bash)?\n(.*?)```", text, re.S):
        out += [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.strip()]
    out += re.findall(r"`((?:bash|python) [^`]+)`", text)
    return out


def _shape(text: str) -> list[tuple[str, int, int]]:
    """Heading levels in order, with each section's count of table rows and list items."""
    shape = []
    for sec in re.split(r"(?m)^(?=#{1,3} )", text):
        if not sec.startswith("#"):
            continue
        level = len(sec.split(" ")[0])
        rows = sum(1 for ln in sec.splitlines() if ln.startswith("|"))
        items = sum(1 for ln in sec.splitlines() if re.match(r"(- |\d+\. )", ln))
        shape.append((f"h{level}", rows, items))
    return shape


@pytest.mark.parametrize("name", READMES)
def test_readme_is_short(name):
    assert len(_text(name).encode()) <= MAX_BYTES


def test_the_two_readmes_have_the_same_sections_and_commands():
    en, zh = (_text(n) for n in READMES)
    assert _shape(en) == _shape(zh)
    assert _commands(en) == _commands(zh)
    assert _commands(en), "no command found: the parser is broken"


@pytest.mark.parametrize("name", READMES)
def test_links_resolve(name):
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", _text(name))
    assert links
    missing = [ln for ln in links if not ln.startswith("http") and not (REPO / ln).exists()]
    assert not missing


@pytest.mark.parametrize("name", READMES)
def test_every_script_named_exists(name):
    scripts = set(re.findall(r"((?:internal/)?[\w./-]+\.sh)\b", _text(name)))
    assert scripts
    assert not [s for s in scripts if not (REPO / s).exists()]


def test_counts_are_the_generated_ones():
    """The counts line is generated (readme --check covers staleness); check it against the sources directly."""
    from qwen3_rl.tools.features import load_registry
    from qwen3_rl.tools.pins import load_pins
    from qwen3_rl.tools.upstream.patches import series

    n_patches = sum(len(series(k)) for k in load_pins().frameworks)
    n_switches = len(load_registry().features)
    assert f"{n_switches} switches; {n_patches} patches" in _text("README.md")
    assert f"{n_switches} 个开关；{n_patches} 个 patch" in _text("README.zh-CN.md")
