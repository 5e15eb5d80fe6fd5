"""Install the patched stack into a Python environment, in order (``build_project.sh``).

Order: runtime requirements -> vllm (``VLLM_TARGET_DEVICE=empty``) -> vllm-ascend (needs CANN and
torch_npu) -> megatron-core -> MindSpeed -> verl -> qwen3_rl. Each upstream is installed from its
patched tree in the workspace:

* git-mode tree: ``pip install --no-deps -e <tree>`` (vllm with ``VLLM_TARGET_DEVICE=empty``);
* pypi-mode tree (text sources from the pinned wheel, no build files): for the pure-Python
  frameworks (vllm built for the ``empty`` target is pure Python, verl, megatron-core) a
  ``qwen3_rl-<key>.pth`` file in site-packages puts the patched tree on ``sys.path`` — the same
  effect as an editable install. vllm-ascend compiles custom operators and MindSpeed is git-only:
  a pypi-mode tree of either is refused with the command that fixes it, unless it was made from an sdist
  or a git archive (the whole source tree with its build files: the current set's vllm-ascend, MindSpeed from
  ``--archive-dir``), which is built like a git tree.

The pin set (``PIN_SET`` / ``--pin-set``) picks the trees' default workspace and the requirements file
(``requirements.txt`` for the seed set, ``requirements-<set>.txt`` otherwise).

Every step is skipped when already done (editable install pointing at the tree, or the same
``.pth``), so a rerun is a no-op. ``--dry-run`` prints the steps and runs nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from qwen3_rl.tools.pins import DEFAULT_PIN_SET, REPO_ROOT, Framework, PinError, load_pins
from qwen3_rl.tools.upstream.common import OneLineParser, UpstreamError, default_workspace, die, log
from qwen3_rl.tools.upstream.download import tree_mode

ORDER = ("vllm", "vllm_ascend", "megatron", "mindspeed", "verl")
NPU_ONLY = ("vllm_ascend",)
PURE_PYTHON = ("vllm", "megatron", "verl")
CANN_SET_ENV = Path("/usr/local/Ascend/ascend-toolkit/set_env.sh")


@dataclass
class Step:
    name: str
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    pth: tuple[Path, str] | None = None  # (file, content) for a source link
    done: bool = False
    note: str = ""

    def render(self) -> str:
        if self.pth:
            return f"write {self.pth[0]} <- {self.pth[1].strip()}"
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (envs + " " if envs else "") + " ".join(shlex.quote(c) for c in self.cmd)


def _py_info(python: str) -> dict[str, str]:
    code = (
        "import json,sysconfig,sys;"
        "print(json.dumps({'purelib': sysconfig.get_paths()['purelib'],"
        "'version': '%d.%d' % sys.version_info[:2]}))"
    )
    proc = subprocess.run([python, "-c", code], text=True, capture_output=True)
    if proc.returncode != 0:
        raise UpstreamError(f"cannot run python interpreter {python!r}: {proc.stderr.strip()[:200]}")
    return json.loads(proc.stdout)


def _editable_target(python: str, dist: str) -> str:
    """The folder an editable install of ``dist`` points at, or '' if not editable-installed."""
    code = (
        "import importlib.metadata as m,json,sys\n"
        "try:\n d=m.distribution(sys.argv[1])\nexcept m.PackageNotFoundError:\n print('');raise SystemExit\n"
        "t=d.read_text('direct_url.json') or '{}'\nj=json.loads(t)\n"
        "print(j.get('url','') if j.get('dir_info',{}).get('editable') else '')\n"
    )
    proc = subprocess.run([python, "-c", code, dist], text=True, capture_output=True)
    url = proc.stdout.strip()
    return url[len("file://"):] if url.startswith("file://") else ""


def _declares_vllm_plugin(python: str) -> bool:
    """True when the installed ``qwen3_rl`` metadata declares the ``vllm.general_plugins`` entry point (an
    editable install made before pyproject.toml declared it has none: vLLM would then run without the recipe's
    hooks and drafter)."""
    code = ("import importlib.metadata as m\n"
            "print(any(e.name == 'qwen3_rl' for e in m.distribution('qwen3_rl').entry_points "
            "if e.group == 'vllm.general_plugins'))\n")
    proc = subprocess.run([python, "-c", code], text=True, capture_output=True)
    return proc.stdout.strip() == "True"


def npu_ready(python: str) -> tuple[bool, str]:
    """(True, '') when CANN is sourced and torch_npu imports; else (False, reason)."""
    if not os.environ.get("ASCEND_TOOLKIT_HOME"):
        where = f" (source {CANN_SET_ENV})" if CANN_SET_ENV.exists() else " (CANN not found)"
        return False, f"CANN environment not sourced: ASCEND_TOOLKIT_HOME is unset{where}"
    proc = subprocess.run([python, "-c", "import torch_npu"], text=True, capture_output=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["import failed"])[-1]
        return False, f"torch_npu does not import: {last}"
    return True, ""


def requirements_file(pin_set: str = DEFAULT_PIN_SET) -> Path:
    """The runtime requirements of a pin set: ``requirements.txt`` (seed) or ``requirements-<set>.txt``."""
    return REPO_ROOT / ("requirements.txt" if pin_set == DEFAULT_PIN_SET else f"requirements-{pin_set}.txt")


def plan_steps(
    fws: dict[str, Framework],
    workspace: Path,
    python: str,
    only: list[str] | None = None,
    requirements: bool = True,
    skip_npu: bool = False,
    with_package: bool = True,
    pin_set: str = DEFAULT_PIN_SET,
    target_python: str = "3.11",
) -> list[Step]:
    """The ordered build steps for the selected frameworks (nothing is run)."""
    info = _py_info(python)
    if info["version"] != target_python:
        log(f"warning: {python} is Python {info['version']}; the pinned stack targets {target_python}")
    purelib = Path(info["purelib"])
    pip = [python, "-m", "pip", "install"]
    steps: list[Step] = []
    if requirements:
        steps.append(Step("requirements", pip + ["-r", str(requirements_file(pin_set))]))
    for key in ORDER:
        if key not in fws or (only and key not in only):
            continue
        fw = fws[key]
        tree = workspace / fw.dir
        if not tree.is_dir():
            raise UpstreamError(
                f"{key}: no source tree at {tree}; run `bash download_frameworks_source_code.sh "
                f"--only {key}` and `bash apply_all_patches.sh --only {key}` first"
            )
        if key in NPU_ONLY and skip_npu:
            steps.append(Step(key, done=True, note="skipped (--skip-npu)"))
            continue
        mode = tree_mode(tree) or "git"
        if mode == "pypi" and any((tree / f).is_file() for f in ("setup.py", "pyproject.toml")):
            mode = "git"  # an unpacked sdist or git archive is the whole source tree: built like a git checkout
        if mode == "pypi":
            if key not in PURE_PYTHON:
                raise UpstreamError(
                    f"{key}: {tree} is a pypi-mode tree (text sources only) but {key} must be built "
                    f"from its git tree; run `bash download_frameworks_source_code.sh --source git "
                    f"--only {key} --force`"
                )
            pth = purelib / f"qwen3_rl-{key}.pth"
            content = str(tree.resolve()) + "\n"
            done = pth.is_file() and pth.read_text() == content
            steps.append(Step(key, pth=(pth, content), done=done,
                              note="already linked" if done else "pypi-mode tree: source link"))
            continue
        env = {"VLLM_TARGET_DEVICE": "empty"} if key == "vllm" else {}
        target = _editable_target(python, fw.pypi or key)
        done = bool(target) and Path(target).resolve() == tree.resolve()
        steps.append(Step(key, pip + ["--no-deps", "--no-build-isolation", "-e", str(tree)], env=env,
                          done=done, note="already installed editable" if done else ""))
    if with_package:
        target = _editable_target(python, "qwen3_rl")
        done = bool(target) and Path(target).resolve() == REPO_ROOT.resolve() and _declares_vllm_plugin(python)
        steps.append(Step("qwen3_rl", pip + ["--no-deps", "-e", str(REPO_ROOT)], done=done,
                          note="already installed editable" if done else ""))
    return steps


def run_steps(steps: list[Step], python: str, skip_npu: bool) -> None:
    total = len(steps)
    for i, st in enumerate(steps, start=1):
        if st.done:
            log(f"[{i}/{total}] {st.name}: {st.note or 'done'}")
            continue
        if st.name in NPU_ONLY and not skip_npu:
            ok, why = npu_ready(python)
            if not ok:
                raise UpstreamError(
                    f"{st.name} needs an NPU build environment: {why}; "
                    "re-run with --skip-npu to install everything else"
                )
        log(f"[{i}/{total}] {st.name}: {st.render()}")
        if st.pth:
            st.pth[0].parent.mkdir(parents=True, exist_ok=True)
            st.pth[0].write_text(st.pth[1])
            continue
        env = dict(os.environ)
        env.update(st.env)
        proc = subprocess.run(st.cmd, env=env)
        if proc.returncode != 0:
            raise UpstreamError(f"{st.name}: `{st.render()}` failed with exit code {proc.returncode}")


def build_main(argv: list[str]) -> int:
    ap = OneLineParser(prog="build_project.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pins")
    ap.add_argument("--pin-set", help="pin set: seed or current (default: $PIN_SET, else seed)")
    ap.add_argument("--only", help="comma-separated subset of " + ",".join(ORDER))
    ap.add_argument("--workspace", help="workspace (default: $QWEN3_RL_WORKSPACE or the set's, <repo>/workspace)")
    ap.add_argument("--python", default=sys.executable, help="target interpreter (default: this one)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--skip-npu", action="store_true", help="skip NPU-only builds (vllm-ascend)")
    ap.add_argument("--no-requirements", action="store_true", help="do not install requirements.txt")
    ap.add_argument("--no-package", action="store_true", help="do not install qwen3_rl itself")
    a = ap.parse_args(argv)
    try:
        pins = load_pins(a.pins, a.pin_set)
        sel = [fw.key for fw in pins.select(a.only)]
        if pins.name != DEFAULT_PIN_SET:
            log(f"pin set: {pins.name}")
        ws = Path(a.workspace) if a.workspace else default_workspace(pins)
        if not ws.is_dir():
            raise UpstreamError(f"workspace {ws} does not exist; run download_frameworks_source_code.sh first")
        if importlib.util.find_spec("tomllib") is None:  # pragma: no cover - 3.11+ always has it
            raise UpstreamError("Python 3.11+ is required")
        steps = plan_steps(pins.frameworks, ws, a.python, only=sel if a.only else None,
                           requirements=not a.no_requirements, skip_npu=a.skip_npu,
                           with_package=not a.no_package, pin_set=pins.name,
                           target_python=pins.runtime.get("python", "3.11"))
        if a.dry_run:
            for i, st in enumerate(steps, start=1):
                state = f"  # {st.note}" if st.note else ""
                print(f"[{i}/{len(steps)}] {st.name}: {st.render() if st.cmd or st.pth else ''}{state}")
            return 0
        run_steps(steps, a.python, a.skip_npu)
        log("build: done")
    except (PinError, UpstreamError) as e:
        return die(str(e))
    return 0
