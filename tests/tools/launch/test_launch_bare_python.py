"""The launcher's tooling on a host python without the runtime stack.

A dry run used to stop with ``ModuleNotFoundError: No module named 'llvmlite'`` on a host without numba:
preflight's spec-decode check imported ``qwen3_rl.spec_decode.requests`` and the package's ``__init__``
imported the SAM kernels.

* Every setup's ``ray_start_npu.sh --dry-run`` runs in a venv made from the test interpreter's base python
  with nothing installed (``venv --without-pip``: the launcher, preflight, features and plan need only the
  standard library), with a model config and parquet files present so that preflight's memory plan and data
  checks run too. Positive control: in that venv the SAM drafter itself does not import (no numpy).
* In the test venv, which has numba, numpy and torch, the tooling's commands on every setup (preflight,
  features overrides, plan) leave the runtime stack out of ``sys.modules``. Positive control: the same check
  reports numba and numpy once the drafter (``qwen3_rl.spec_decode.SamProposer``) is touched.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import DATA, REPO, make_model, make_parquet, make_stubs, stub_env

SETUPS = sorted(p.name for p in (REPO / "internal").glob("train_*.sh"))
ENV_235B = str(REPO / "internal" / "qwen3_235b_env.sh")
MASTER = "10.20.0.1"  # the stub `ip` makes it this node's address: the head of a 2-node cluster
# what reading a config must not import: the drafter's kernels and the rest of the runtime stack
RUNTIME = {"numba", "llvmlite", "numpy", "torch", "torch_npu", "vllm", "vllm_ascend", "verl", "megatron",
           "mindspeed", "ray", "pandas", "pyarrow", "omegaconf", "hydra", "transformers"}


def _model_config(setup: str) -> str | None:
    """The HF config of a setup's model (tests/data), None for the tiny CPU setups."""
    for tag, name in (("235b", "qwen3_235b_a22b_config.json"),
                      ("30b_a3b", "qwen3_30b_a3b_config.json"), ("32b", "qwen3_32b_config.json")):
        if f"qwen3_{tag}_" in setup:
            return name
    assert "tiny_cpu" in setup, f"{setup}: no model config in tests/data for it"
    return None


def _launch(setup: str) -> tuple[list[str], int, int]:
    """``ray_start_npu.sh`` arguments of a setup's dry run, its node count and NPUs per node: the issue's
    command (2 nodes, a master address) for the cluster setups, the CPU profile on one loopback node for the
    tiny ones."""
    if "tiny_cpu" in setup:
        return [f"internal/{setup}", "--device", "cpu", "--npus-per-node", "2", "--dry-run"], 1, 2
    env_script = [ENV_235B] if "235b" in setup else []
    return [f"internal/{setup}", *env_script, "--dry-run", "--nnodes", "2", "--master-addr", MASTER], 2, 16


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv from this interpreter's base python with nothing installed (no pip either)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   capture_output=True, timeout=120)
    py = venv / "bin" / "python"
    probe = "import sys; print(sys.version_info[:2], sys.prefix != sys.base_prefix)"
    p = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=30)
    assert p.stdout.strip() == "(3, 11) True", p.stdout + p.stderr
    return py


def _bare_env(py: Path, root: Path, **extra: str) -> dict[str, str]:
    """A new user's shell: the bare venv first on PATH (its ``python3`` runs the train scripts' feature
    check), the stub ``ip`` (and ``npu-smi`` where made), nothing inherited from the test environment."""
    env = {"PATH": f"{root / 'bin'}:{py.parent}:/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8",
           "TMPDIR": str(root), "LOG_DIR": str(root / "logs"), "CANN_HOME": str(root / "no_cann"),
           "QWEN3_RL_PYTHON": str(py), "STUB_LOG": str(root / "calls.log"),
           "STUB_IP_ADDRS": f"eth0={MASTER},lo=127.0.0.1",
           "STUB_NPU_MAP": str(DATA / "npu_smi_info_m_a3.txt"),
           "STUB_NPU_TOPO": str(DATA / "npu_smi_topo_a3.txt"),
           "STUB_NPU_INFO": str(DATA / "npu_smi_info_a3.txt")}
    env.update(extra)
    return env


def test_bare_python_lacks_the_runtime_stack(bare_python: Path):
    """Positive control: the bare venv sees neither the test venv's packages nor an installed qwen3_rl, and
    the drafter behind the package's lazy names still imports its kernels (numpy first) when touched."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    p = subprocess.run([str(bare_python), "-c", "from qwen3_rl.spec_decode import SamProposer"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert p.stderr.splitlines()[-1] == "ModuleNotFoundError: No module named 'numpy'", p.stderr
    p = subprocess.run([str(bare_python), "-c", "import qwen3_rl"], env={"PATH": "/usr/bin:/bin"}, cwd="/",
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "No module named 'qwen3_rl'" in p.stderr, p.stderr
    # what preflight reads: the package and the pure request rules import without the kernels
    code = "from qwen3_rl.spec_decode.requests import unsupported_reasons as u; print(u({'min_p': 0.1}))"
    p = subprocess.run([str(bare_python), "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['min_p=0.1 (must be 0)']", p.stdout


@pytest.mark.parametrize("setup", SETUPS)
def test_dry_run_in_a_bare_python(bare_python: Path, tmp_path: Path, setup: str):
    """Every setup's dry run exits 0 in the bare venv and prints the cluster split, the final command and
    the preflight findings; the data check says it could not read the columns instead of failing."""
    args, nnodes, per_node = _launch(setup)
    make_stubs(tmp_path, ray=False, npu_smi="tiny_cpu" not in setup)  # a CPU-profile node has no npu-smi
    cfg = _model_config(setup)
    extra: dict[str, str] = {}
    if cfg:
        extra["MODEL_PATH"] = str(make_model(tmp_path, cfg))
    train = make_parquet(tmp_path / "data" / "train.parquet")  # written by the test venv's pandas
    extra.update(TRAIN_FILE=str(train), VAL_FILE=str(make_parquet(tmp_path / "data" / "val.parquet")))
    p = subprocess.run(["bash", str(REPO / "ray_start_npu.sh"), *args],
                       env=_bare_env(bare_python, tmp_path, **extra), cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "ModuleNotFoundError" not in p.stdout + p.stderr, p.stderr
    out = p.stdout
    slots = "NPUs" if per_node == 16 else "worker slots"
    head = MASTER if nnodes > 1 else "127.0.0.1"
    assert (f"cluster:     {nnodes} node(s) x {per_node} {slots} = {nnodes * per_node} {slots}; "
            f"head {head}:6379") in out, out
    assert "      final command: python3 -m " in out, out
    assert f"        trainer.nnodes={nnodes}\n" in out
    if "fully_async" in setup:  # two pools: the trainer's and the rollout's dies fill each node
        split = {pool: int(n) for pool, n in re.findall(r"^ +(trainer|rollout)\.n_gpus_per_node=(\d+)$", out, re.M)}
        assert set(split) == {"trainer", "rollout"} and sum(split.values()) == per_node, (split, out)
    else:
        assert f"        trainer.n_gpus_per_node={per_node}\n" in out
    assert "preflight (a real launch stops on errors):" in out
    assert (f"  warning: [data] data.train_files: {train} exists; its columns are not checked "
            f"(no pyarrow in {bare_python})") in out, out
    assert "error: [feature]" not in out and "error: [script]" not in out, out


def test_dry_run_of_the_k8s_manifest_in_a_bare_python(bare_python: Path, tmp_path: Path):
    """``launch k8s`` needs PyYAML to write: without it one error line, not a traceback."""
    p = subprocess.run([str(bare_python), "-m", "qwen3_rl", "launch", "k8s", "--setup",
                        f"internal/{SETUPS[0]}", "--image", "img:1"],
                       env=_bare_env(bare_python, tmp_path, PYTHONPATH=str(REPO)), cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == ["error: launch k8s writes the manifest with PyYAML, which "
                                     f"{bare_python} lacks: pip install pyyaml"], p.stderr


GUARD = r"""
import contextlib, importlib, io, json, sys
from qwen3_rl.__main__ import main

runs, out_file, touch = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
for target in touch:  # "module:name", e.g. the positive control's drafter
    mod, _, name = target.partition(":")
    getattr(importlib.import_module(mod), name)
codes = []
for argv in runs:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes.append(main(argv))
json.dump({"codes": codes, "modules": sorted(sys.modules)}, open(out_file, "w"))
"""


def _guard(tmp_path: Path, runs: list[list[str]], touch: list[str]) -> tuple[list[int], set[str], set[str]]:
    """Run ``python -m qwen3_rl`` commands in one process of the test venv; returns their exit codes, the
    top-level packages of :data:`RUNTIME` in ``sys.modules`` afterwards and the ``qwen3_rl`` modules."""
    bin_dir = make_stubs(tmp_path, ray=False)
    # an empty workspace: with a checkout's own tiny data on disk preflight would read its parquet columns (pyarrow,
    # when installed), which is data reading, not the runtime stack this guard is about
    env = stub_env(tmp_path, bin_dir, PYTHONPATH=str(REPO), STUB_IP_ADDRS=f"eth0={MASTER},lo=127.0.0.1",
                   QWEN3_RL_WORKSPACE=str(tmp_path / "empty-workspace"))
    out = tmp_path / "guard.json"
    p = subprocess.run([sys.executable, "-c", GUARD, json.dumps(runs), str(out), *touch], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    modules = set(got["modules"])
    runtime = {m.split(".")[0] for m in modules} & RUNTIME
    return got["codes"], runtime, {m for m in modules if m.startswith("qwen3_rl")}


def test_tooling_imports_no_runtime_stack(tmp_path: Path):
    """Preflight (what the dry run and a real launch run), the feature overrides and the memory plan of
    every setup, in one process of the test venv: none of the runtime stack is imported."""
    have = subprocess.run([sys.executable, "-c", "import numba, numpy, torch"], capture_output=True,
                          timeout=120)
    assert have.returncode == 0, "the test venv lacks numba/numpy/torch: the guard would prove nothing"
    runs = []
    for setup in SETUPS:
        _, nnodes, per_node = _launch(setup)
        script = str(REPO / "internal" / setup)
        pre = ["preflight", script, "--nnodes", str(nnodes), "--npus-per-node", str(per_node), "--json"]
        pre += ["--env-script", ENV_235B] if "235b" in setup else []
        pre += ["--no-node-checks"] if "tiny_cpu" in setup else []
        runs += [pre, ["features", "overrides", "--setup", setup]]
        if cfg := _model_config(setup):
            runs.append(["plan", "--model-config", str(DATA / cfg), "--train-script", script, "--json"])
    codes, runtime, ours = _guard(tmp_path, runs, [])
    assert runtime == set(), f"tooling imported {sorted(runtime)}"
    # the paths were taken: the spec-decode request rules, the feature registry and its seam, the memory plan
    assert {"qwen3_rl.spec_decode.requests", "qwen3_rl.tools.features", "qwen3_rl.trainer.seam",
            "qwen3_rl.tools.plan.memory", "qwen3_rl.tools.plan.cli",
            "qwen3_rl.tools.launch.preflight"} <= ours
    assert "qwen3_rl.spec_decode.sam" not in ours and "qwen3_rl.spec_decode._sam_kernels" not in ours
    # preflight finds problems (no weights, data, CANN here) and says so with 1; the others succeed
    by_command = [(argv[0], c) for argv, c in zip(runs, codes, strict=True)]
    assert {c for cmd, c in by_command if cmd == "preflight"} <= {0, 1}
    assert [c for cmd, c in by_command if cmd != "preflight"] == [0] * (len(runs) - len(SETUPS)), by_command


def test_the_guard_sees_the_drafter_kernels(tmp_path: Path):
    """Positive control: touching the drafter through the package's lazy name loads numba and numpy."""
    _, runtime, ours = _guard(tmp_path, [], ["qwen3_rl.spec_decode:SamProposer"])
    assert {"numba", "llvmlite", "numpy"} <= runtime
    assert {"qwen3_rl.spec_decode.sam", "qwen3_rl.spec_decode._sam_kernels"} <= ours
