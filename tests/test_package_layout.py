"""The package's shape: runtime code (what runs inside verl / vLLM / Megatron processes) never imports the
tooling under ``qwen3_rl/tools``, and the tests mirror the package."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "qwen3_rl"
TOOLING = PKG / "tools"
# folders of tests/ that are not a package folder: the helpers, the test data, the engine-venv suites and the tests
# of the patch series (patches/<framework>), upstream's own tests run on the pristine and the patched trees
NOT_MIRRORS = {"helpers", "data", "engine", "engine_current", "engine_verl091", "patches", "upstream_own", "__pycache__"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every absolute import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def runtime_files() -> list[Path]:
    """Every package module outside the tooling and the CLI entry point."""
    return [p for p in sorted(PKG.rglob("*.py"))
            if TOOLING not in p.parents and p.name != "__main__.py" and "__pycache__" not in p.parts]


def test_runtime_never_imports_tooling() -> None:
    files = runtime_files()
    assert len(files) > 30, "the runtime package is missing"
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}" for p in files for line, mod in _imports(p)
           if mod == "qwen3_rl.tools" or mod.startswith("qwen3_rl.tools.")]
    assert not bad, "runtime code imports tooling:\n" + "\n".join(bad)


def test_the_check_sees_a_tooling_import(tmp_path: Path) -> None:
    """Positive control: the scan reports a runtime-style module that imports the tooling."""
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom qwen3_rl.tools.launch import preflight\n")
    assert (2, "qwen3_rl.tools.launch") in _imports(f)


def test_tests_mirror_the_package() -> None:
    """Each folder of tests/ (bar the listed exceptions) names a folder of the package, and no test module sits
    in tests/ itself except the repository-level ones (scripts, Dockerfile, train configs, suite rules)."""
    pkg_dirs = {p.relative_to(PKG) for p in PKG.rglob("*") if p.is_dir() and "__pycache__" not in p.parts}
    for d in sorted(p for p in (REPO / "tests").rglob("*") if p.is_dir()):
        rel = d.relative_to(REPO / "tests")
        if rel.parts[0] in NOT_MIRRORS or "__pycache__" in rel.parts:
            continue
        assert rel in pkg_dirs, f"tests/{rel} mirrors no folder of qwen3_rl/"
    top = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    repo_level = {"test_dockerfile.py", "test_machine_paths.py", "test_requirements.py", "test_scripts.py",
                  "test_suite_rules.py", "test_train_configs.py", "test_setup_env.py", "test_package_layout.py",
                  "test_docs.py", "test_venv_lock.py"}
    assert set(top) <= repo_level, f"tests/ holds package tests at its top: {sorted(set(top) - repo_level)}"


def _imported_modules(path: Path) -> set[str]:
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


#: modules that are the current set's seam (verl 0.9.1 has no seam patch: they read the recipe's ``qwen3_rl`` group
#: from verl's own extension points, as the seed seam reads it from the verl config) and may parse it with the seam's
#: declarations; the seam never imports them
CURRENT_SET_SEAMS = {"rollout/verl_server_auth.py"}


def test_features_do_not_import_the_seam() -> None:
    """The verl seam (qwen3_rl.trainer.seam) imports the features it configures; a feature module never imports the
    seam (no import circle). Tooling may read the seam's declared defaults, and the current set's seams
    (CURRENT_SET_SEAMS) its declarations."""
    pkg = Path(__file__).resolve().parents[1] / "qwen3_rl"
    seam = pkg / "trainer" / "seam.py"
    offenders = [str(p.relative_to(pkg)) for p in sorted(pkg.rglob("*.py"))
                 if p != seam and "tools" not in p.relative_to(pkg).parts
                 and str(p.relative_to(pkg)) not in CURRENT_SET_SEAMS
                 and "qwen3_rl.trainer.seam" in _imported_modules(p)]
    assert not offenders, f"feature modules importing the seam: {offenders}"
    adapters = {"qwen3_rl." + m.removesuffix(".py").replace("/", ".") for m in CURRENT_SET_SEAMS}
    assert all((pkg / m).is_file() for m in CURRENT_SET_SEAMS), CURRENT_SET_SEAMS
    assert not adapters & set(_imported_modules(seam)), "the seam imports a current-set seam (import circle)"
    # positive control: the seam does import features
    assert any(m.startswith("qwen3_rl.rollout.") for m in _imported_modules(seam))
