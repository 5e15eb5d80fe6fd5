"""docs/: size, one shape per feature doc, no development diary, counts in prose that match the sources, and the
CPU shim list equal to what the shim modules install."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from qwen3_rl.tools import readme

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
#: 150 KiB for the seed pin set, + 34 KiB for the current set (its patch-fate table, bridge choice, HDP and drafter
#: comparisons, every switch's status there, its environment contract, its engines, its trainer side)
MAX_DOCS_BYTES = 184 * 1024
#: the sections of a feature doc, in this order
FEATURE_SHAPE = ("## What it does", "## Switches", "## Measured", "## Limits", "## Upstream status", "## Design")
#: docs named by features.toml that are not one feature's page (tables, setups, weights)
NOT_FEATURE_DOCS = {"docs/features.md", "docs/setups.md", "docs/weights.md"}
#: phrases of a development diary (git log holds the history)
DIARY = re.compile(r"previous commit|the old code|before this change|machine was shared|\(before\)|commit [0-9a-f]{7}\b"
                   r"|no longer (?!than)|the former |was changed to", re.I)
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def _prose(path: Path) -> str:
    """The text of a doc without its generated sections."""
    return re.sub(r"<!-- generated:(\S+) -->.*?<!-- /generated:\1 -->", "", path.read_text(), flags=re.S)


def _feature_docs() -> list[str]:
    from qwen3_rl.tools.features import load_registry

    return sorted({f.doc for f in load_registry().features.values()} - NOT_FEATURE_DOCS)


def test_docs_fit_the_size_limit():
    total = sum(p.stat().st_size for p in DOCS.rglob("*") if p.is_file())
    assert total <= MAX_DOCS_BYTES, f"docs/ is {total} bytes (limit {MAX_DOCS_BYTES})"


@pytest.mark.parametrize("doc", _feature_docs())
def test_feature_doc_has_the_shape(doc):
    heads = [ln.split(" (")[0].rstrip() for ln in (REPO / doc).read_text().splitlines() if ln.startswith("## ")]
    found = [h for h in heads if h in FEATURE_SHAPE]
    assert found == list(FEATURE_SHAPE), f"{doc}: sections {heads}"


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_no_development_diary(path):
    hits = [m.group(0) for m in DIARY.finditer(_prose(path))]
    assert not hits, f"{path.name}: {hits}"


def test_counts_in_prose_match_the_sources():
    """"N switches", "N patches", "N bug fixes", "N cluster setups", "N tiny ... setups" in any doc or README must be
    the registry's and the patch series' numbers (the counts line of the READMEs is generated)."""
    c = readme._count_values()
    want = {"switches": c["switches"], "patches": c["patches"], "bug fixes": c["fixes"],
            "cluster setups": c["cluster"], "tiny CPU setups": c["tiny"], "tiny setups": c["tiny"],
            "setups": c["cluster"] + c["tiny"]}
    want = {k.lower(): v for k, v in want.items()}
    num = r"(\d+|" + "|".join(WORDS) + r")"
    pat = re.compile(rf"\b{num} ({'|'.join(sorted(want, key=len, reverse=True))})\b", re.I)
    wrong, seen = [], 0
    texts = [(p.name, _prose(p)) for p in sorted(DOCS.glob("*.md"))]
    texts += [(n, (REPO / n).read_text()) for n in ("README.md", "README.zh-CN.md")]  # the counts line included
    for name, text in texts:
        for m in pat.finditer(text):
            seen += 1
            n = int(m.group(1)) if m.group(1).isdigit() else WORDS[m.group(1).lower()]
            if n != want[m.group(2).lower()]:
                wrong.append(f"{name}: '{m.group(0)}' (is {want[m.group(2).lower()]})")
    assert not wrong
    assert seen, "no count found, not even the READMEs' counts line: the pattern is broken"
    assert pat.search("the five setups") and pat.search("3 patches") and not pat.search("patches")


def _install_calls(rel: str) -> list[str]:
    """The module-level functions ``install()`` of a shim module calls."""
    tree = ast.parse((REPO / rel).read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "install"]
    return [n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]


def test_shim_list_equals_what_the_megatron_shims_install():
    """Each numbered item NAME of megatron_shims.py is the function ``_name`` that install() calls, and install()
    calls no other shim."""
    names = [n for n, _ in readme.shim_items("qwen3_rl/cpu_device/megatron_shims.py")]
    calls = [c for c in _install_calls("qwen3_rl/cpu_device/megatron_shims.py") if c.startswith("_")]
    assert sorted(f"_{n.lower()}" for n in names) == sorted(calls)
    assert {"FUSED_ADAM", "TE_MODULES", "FP8_CAST"} <= set(names)


def test_shim_list_of_the_vllm_cpu_shims_names_their_code():
    import qwen3_rl.cpu_device.shims as shims

    names = [n for n, _ in readme.shim_items("qwen3_rl/cpu_device/shims.py")]
    assert names == ["CPU_RUNNER_SPEC_ASSERT", "REJECTION_KERNELS", "EP_DISPATCH_COMBINE", "MOE_EXPERT_MAP"]
    assert all(hasattr(shims, n) for n in names)


def test_gloo_shim_list_is_the_wrapped_collective():
    """gloo_shims.py's one item is the all_gather wrapper install() puts in torch.distributed, and it is listed."""
    import torch.distributed as dist

    from qwen3_rl.cpu_device import gloo_shims

    assert [n for n, _ in readme.shim_items("qwen3_rl/cpu_device/gloo_shims.py")] == ["GLOO_SCALAR_ALL_GATHER"]
    orig, orig_c10d, was = dist.all_gather, dist.distributed_c10d.all_gather, gloo_shims._INSTALLED
    try:
        gloo_shims._INSTALLED = False
        gloo_shims.install()
        assert dist.all_gather is not orig and dist.all_gather.__module__ == gloo_shims.__name__
    finally:
        dist.all_gather, dist.distributed_c10d.all_gather, gloo_shims._INSTALLED = orig, orig_c10d, was


def test_every_shim_module_is_in_the_list():
    """Every module under qwen3_rl/cpu_device with an install() is a listed shim module, or a part a listed module
    installs and names in its list (the stand-in's hccl.py)."""
    listed = set(readme.SHIM_MODULES)
    parts = {"qwen3_rl/cpu_device/npu/hccl.py": "qwen3_rl/cpu_device/npu/stand_in.py"}
    # record what the run did (weights, optimizer); change nothing
    observers = {"qwen3_rl/cpu_device/probe.py", "qwen3_rl/cpu_device/probe_verl091.py"}
    for path in sorted((REPO / "qwen3_rl" / "cpu_device").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if "def install(" not in path.read_text() or rel in listed or rel in observers:
            continue
        assert rel in parts, f"{rel} has install() but is not in readme.SHIM_MODULES"
        owner_items = " ".join(n for n, _ in readme.shim_items(parts[rel]))
        assert path.name in owner_items
    stand_in = [n for n, _ in readme.shim_items("qwen3_rl/cpu_device/npu/stand_in.py")]
    assert len(stand_in) >= 10 and any("torch_npu" in n for n in stand_in)


def test_shim_section_is_generated_in_the_doc():
    text = (DOCS / "real_engine_tests.md").read_text()
    assert readme._shims() in text
    for rel in readme.SHIM_MODULES:
        for name, _ in readme.shim_items(rel):
            assert name in text


def test_reference_table_maps_every_reference_patch():
    """Every reference patch maps to a switch, a bug-fix patch that exists, or a pinned-upstream note with a test;
    the generated table is in docs/patches.md."""
    table = readme._reference()
    rows = [ln for ln in table.splitlines()[2:]]
    assert len(rows) >= 30
    heres = [r.split(" | ")[2] for r in rows]
    assert all(h.startswith(("`", "bug fix ", "not needed: ")) for h in heres), heres
    assert table in (DOCS / "patches.md").read_text()


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_doc_links_resolve(path):
    """Every relative link of a doc names a file of the checkout (removed or renamed pages show up here)."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    missing = [ln for ln in links if not ln.startswith("http") and not (path.parent / ln).exists()]
    assert not missing, f"{path.name}: {missing}"


def test_named_tests_exist():
    """Every ``tests/...py::name`` a doc or README cites is a test function of that file; a bare ``::name`` belongs to
    the test file named last before it."""
    cited, missing = 0, []
    for path in [*sorted(DOCS.glob("*.md")), REPO / "README.md", REPO / "README.zh-CN.md"]:
        current = None
        for m in re.finditer(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", path.read_text()):
            current = m.group(1) or current
            if not m.group(2):
                continue
            assert current, f"{path.name}: '::{m.group(2)}' follows no test file"
            cited += 1
            if not re.search(rf"^def {m.group(2)}\(", (REPO / current).read_text(), re.M):
                missing.append(f"{path.name}: {current}::{m.group(2)}")
    assert cited > 20
    assert not missing


def test_named_test_files_exist():
    """Every ``tests/...py`` file a doc names exists (a glob such as ``test_ascend_*.py`` must match one)."""
    missing = []
    for path in sorted(DOCS.glob("*.md")):
        for rel in set(re.findall(r"\b(tests/[\w/*]+\.py)\b", path.read_text())):
            if not list(REPO.glob(rel)):
                missing.append(f"{path.name}: {rel}")
    assert not missing
