"""The pin-set switch (``PIN_SET`` / ``--pin-set``): one function decides, the default is the seed set unchanged, a bad
value stops every command with one line, and the current set's series lints and applies to its pristine trees."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen3_rl.tools.pins import DEFAULT_PIN_SET, PinError, load_pins, pin_set_names, resolve_pin_set
from qwen3_rl.tools.upstream.download import fill_pristine, pristine_dir

REPO = Path(__file__).resolve().parents[3]
PINS = REPO / "pins.toml"


def _run(*cmd: str, pin_set: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PIN_SET", "QWEN3_RL_WORKSPACE")}
    if pin_set is not None:
        env["PIN_SET"] = pin_set
    return subprocess.run(list(cmd), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_one_function_resolves_the_set() -> None:
    assert pin_set_names(PINS) == ["seed", "current"]
    assert resolve_pin_set(env={}, path=PINS) == DEFAULT_PIN_SET == "seed"
    assert resolve_pin_set(env={"PIN_SET": "current"}, path=PINS) == "current"
    assert resolve_pin_set(env={"PIN_SET": ""}, path=PINS) == "seed"
    assert resolve_pin_set("seed", env={"PIN_SET": "current"}, path=PINS) == "seed"  # the flag wins
    for value, env in (("bogus", {}), (None, {"PIN_SET": "Current"})):
        with pytest.raises(PinError) as e:
            resolve_pin_set(value, env=env, path=PINS)
        assert "\n" not in str(e.value) and "use one of: seed, current" in str(e.value)


def test_the_two_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIN_SET", raising=False)
    seed, current = load_pins(PINS), load_pins(PINS, "current")
    assert seed.name == "seed" and seed.patches_root == REPO / "patches" and seed.workspace_dir == "workspace"
    assert seed.frameworks["vllm"].version == "0.13.0" and seed.runtime["cann"] == "8.5.0"
    assert current.patches_root == REPO / "patches" / "current" and current.workspace_dir == "workspace-current"
    assert list(current.frameworks) == list(seed.frameworks)
    got = {k: fw.version for k, fw in current.frameworks.items()}
    assert got == {"verl": "0.9.1", "vllm": "0.23.0", "vllm_ascend": "0.23.0.post1", "megatron": "0.16.1",
                   "mindspeed": "0.16.0"}
    assert current.frameworks["vllm_ascend"].sdist and len(current.frameworks["vllm_ascend"].sha256) == 64
    assert current.frameworks["mindspeed"].commit == "e4772499f7eb9fa9a68919dd1eaddef00e915b2d"
    assert (current.runtime["cann"], current.runtime["torch"], current.runtime["torch_npu"]) == \
        ("9.1.0", "2.10.0", "2.10.0.post4")
    monkeypatch.setenv("PIN_SET", "current")
    assert load_pins(PINS).name == "current"
    # each set has its own pristine cache, keyed by its own pins
    assert pristine_dir(PINS, "seed") != pristine_dir(PINS, "current") == pristine_dir(PINS)


@pytest.mark.parametrize("cmd", [
    ("bash", "apply_all_patches.sh", "--lint"),
    ("bash", "apply_all_patches.sh", "--check"),
    ("bash", "download_frameworks_source_code.sh", "--source", "pypi", "--only", "verl"),
    ("bash", "build_project.sh", "--dry-run"),
    (sys.executable, "-m", "qwen3_rl", "pins"),
], ids=lambda c: " ".join(c[1:3]))
def test_bad_pin_set_stops_with_one_line(cmd: tuple[str, ...]) -> None:
    proc = _run(*cmd, pin_set="newest")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: PIN_SET='newest' is not a pin set of pins.toml; use one of: seed, current"], proc.stderr
    flag = _run(*cmd, "--pin-set", "newest")
    assert flag.returncode != 0 and len(flag.stderr.strip().splitlines()) == 1 and "--pin-set='newest'" in flag.stderr


def test_default_is_the_seed_set_unchanged() -> None:
    """No switch = ``--pin-set seed`` = the seed series, output without a set line (as before the switch existed)."""
    plain = _run("bash", "apply_all_patches.sh", "--lint")
    seed = _run("bash", "apply_all_patches.sh", "--lint", pin_set="seed")
    n = sum(1 for fw in load_pins(PINS, "seed").frameworks for _ in (REPO / "patches" / fw).glob("*.patch"))
    assert plain.returncode == 0 and plain.stdout == seed.stdout == f"patch series OK ({n} patches)\n"
    table = _run("bash", "apply_all_patches.sh", "--table")
    assert "](../patches/verl/0001-" in table.stdout and "patches/current/" not in table.stdout


def test_current_series_lints_and_a_bad_patch_does_not(tmp_path: Path) -> None:
    root = REPO / "patches" / "current"
    pats = sorted(root.glob("*/*.patch"))
    assert {p.parent.name for p in pats} >= {"vllm", "vllm_ascend"}
    assert {p.parent.name for p in pats} <= set(load_pins(PINS, "current").frameworks)
    proc = _run("bash", "apply_all_patches.sh", "--lint", pin_set="current")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["pin set: current (patches: patches/current/)",
                                        f"patch series OK ({len(pats)} patches)"]
    # positive control: the same folder with one header field dropped fails the lint
    bad = tmp_path / "patches"
    (bad / "vllm").mkdir(parents=True)
    src = root / "vllm" / "0001-vllm-bugfix-rope_registry.patch"
    (bad / "vllm" / src.name).write_text(src.read_text().replace("Upstream:", "Upstream-Status:", 1))
    proc = _run("bash", "apply_all_patches.sh", "--lint", "--patches-dir", str(bad), pin_set="current")
    assert proc.returncode == 1 and "header lacks 'Upstream:'" in proc.stdout


def test_current_series_checks_clean_on_pristine_trees(tmp_path: Path) -> None:
    """``PIN_SET=current bash apply_all_patches.sh --check`` on the pristine trees of the current set's PyPI pins (the
    download script's pypi mode, cached per set), then apply, status, revert back to pristine."""
    pins = load_pins(PINS, "current")
    keys = [k for k, fw in pins.frameworks.items() if fw.on_pypi]
    t0 = time.perf_counter()
    pristine = fill_pristine(PINS, [pins.frameworks[k] for k in keys], pin_set="current")
    ws = tmp_path / "ws"
    for k in keys:
        subprocess.run(["git", "clone", "-q", "--shared", str(pristine / pins.frameworks[k].dir),
                        str(ws / pins.frameworks[k].dir)], check=True, timeout=300)
    base = ("bash", "apply_all_patches.sh", "--workspace", str(ws), "--only", ",".join(keys))
    check = _run(*base, "--check", pin_set="current")
    assert check.returncode == 0, check.stdout + check.stderr
    want = sorted(f"{k}: would apply {p.name}" for k in keys for p in (pins.patches_root / k).glob("*.patch"))
    assert sorted(ln for ln in check.stdout.splitlines() if "would apply" in ln) == want and want
    assert _run(*base, pin_set="current").returncode == 0
    status = _run(*base, "--status", pin_set="current")
    assert status.returncode == 0 and status.stdout.count(" applied ") == len(want), status.stdout
    seed_on_current = _run(*base, "--status")  # the seed series does not fit the 0.23 trees: the set matters
    assert seed_on_current.returncode == 1 and "conflict" in seed_on_current.stdout
    assert _run(*base, "--revert", pin_set="current").returncode == 0
    for k in keys:
        dirty = subprocess.run(["git", "-C", str(ws / pins.frameworks[k].dir), "status", "--porcelain"],
                               capture_output=True, text=True, check=True).stdout
        assert dirty == "", (k, dirty)
    print(f"current set: fill + check + apply + status + revert in {time.perf_counter() - t0:.1f} s")


def test_preflight_and_plan_report_the_set_and_stop_on_a_bad_one() -> None:
    """The launch-side readers: preflight (env contract only, the tiny CPU setup) and ``plan``."""
    pre = (sys.executable, "-m", "qwen3_rl", "preflight", "internal/train_grpo_tiny_cpu.sh", "--env-only")
    bad = _run(*pre, pin_set="newest")
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "error: [pin-set] PIN_SET='newest' is not a pin set of pins.toml; use one of: seed, current"]
    seed = _run(*pre)
    assert seed.returncode == 0 and seed.stdout.strip().splitlines()[-1] == \
        "preflight (environment contract only): 0 error(s), 0 warning(s) - OK", seed.stdout + seed.stderr
    # the current set has its own contract (checked through the CLI in tests/tools/launch/test_env_contract.py): the
    # tiny GRPO and fully-async scripts pass it there (the fully-async one on verl 0.9.1's own trainer)
    cur = _run(*pre, pin_set="current")
    assert cur.returncode == 0 and cur.stdout.strip().splitlines()[-1] == \
        "preflight (environment contract only) (pin set current): 0 error(s), 0 warning(s) - OK", cur.stdout + cur.stderr
    stop = _run(sys.executable, "-m", "qwen3_rl", "preflight", "internal/train_grpo_tiny_cpu_fully_async.sh",
                "--env-only", pin_set="current")
    assert stop.returncode == 0 and stop.stdout.strip().splitlines()[-1] == \
        "preflight (environment contract only) (pin set current): 0 error(s), 0 warning(s) - OK", \
        stop.stdout + stop.stderr
    assert "not checked" not in cur.stdout + cur.stderr + stop.stdout + stop.stderr
    plan = (sys.executable, "-m", "qwen3_rl", "plan", "--model-config", "tests/data/qwen3_235b_a22b_config.json",
            "--rollout-tp", "4", "--rollout-ep", "128", "--rollout-dp", "32", "--max-model-len", "32768")
    out = _run(*plan)
    assert out.returncode == 0 and out.stdout.splitlines()[0] == "pin set: seed", out.stdout + out.stderr
    assert _run(*plan, pin_set="current").stdout.startswith("pin set: current (")
    wrong = _run(*plan, pin_set="newest")
    assert wrong.returncode == 1 and len(wrong.stderr.strip().splitlines()) == 1 and "newest" in wrong.stderr


def test_current_requirements_agree_with_the_pins_and_vllm_ascend() -> None:
    """requirements-current.txt (build_project.sh's requirements for the set) pins what pins.toml [sets.current.runtime]
    and vLLM-Ascend 0.23.0.post1's own requirements.txt (in its pristine sdist tree) pin."""
    import re

    pins = load_pins(PINS, "current")
    ours = {}
    for line in (REPO / "requirements-current.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)$", line.strip())
        if m:
            ours[re.sub(r"\[.*\]", "", m.group(1)).lower().replace("_", "-")] = m.group(2)
    assert ours["torch"] == pins.runtime["torch"] and ours["torch-npu"] == pins.runtime["torch_npu"]
    assert ours["ray"] == pins.runtime["ray"]
    tree = fill_pristine(PINS, [pins.frameworks["vllm_ascend"]], pin_set="current") / pins.frameworks["vllm_ascend"].dir
    theirs = {}
    for line in (tree / "requirements.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)$", line.strip())
        if m:
            theirs[m.group(1).lower().replace("_", "-")] = m.group(2)
    shared = sorted(set(ours) & set(theirs))
    assert {"torch", "torch-npu", "torchvision", "triton-ascend", "transformers"} <= set(shared)
    assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}
    from qwen3_rl.tools.upstream.build import requirements_file

    assert requirements_file("seed") == REPO / "requirements.txt"
    assert requirements_file("current") == REPO / "requirements-current.txt"


def _git(*args: str, cwd: Path) -> str:
    from qwen3_rl.tools.upstream.common import GIT_ENV

    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def tagged_repo(tmp_path: Path) -> dict[str, str]:
    """A file:// upstream whose tag v1.0 is one commit behind its head, plus its ``git archive`` of v1.0."""
    up = tmp_path / "upstream"
    (up / "pkg").mkdir(parents=True)
    _git("init", "-q", cwd=up)
    (up / "pkg" / "__init__.py").write_text("V = 1\n")
    (up / "setup.py").write_text("")
    _git("add", "-A", cwd=up)
    _git("commit", "-qm", "release", cwd=up)
    _git("tag", "v1.0", cwd=up)
    release = _git("rev-parse", "HEAD", cwd=up)
    (up / "pkg" / "__init__.py").write_text("V = 2\n")
    _git("commit", "-qam", "later", cwd=up)
    arch = tmp_path / "archives"
    arch.mkdir()
    _git("archive", "--format=tar.gz", "--prefix=Demo/", "-o", str(arch / f"demo-{release}.tar.gz"), release, cwd=up)
    import hashlib

    digest = hashlib.sha256((arch / f"demo-{release}.tar.gz").read_bytes()).hexdigest()
    (arch / "SHA256SUMS").write_text(f"{digest}  demo-{release}.tar.gz\n")
    return {"up": str(up), "release": release, "archives": str(arch)}


def _pins_with_current(tmp_path: Path, up: str, git_ref: str, commit: str) -> Path:
    table = (f'dir = "Demo"\ngit_url = "file://{up}"\ngit_ref = "{git_ref}"\ncommit = "{commit}"\npypi = ""\n'
             'version = "1.0"\npackages = ["pkg"]\n')
    p = tmp_path / "pins.toml"
    seed = table.replace(f'commit = "{commit}"', f'commit = "{"0" * 40}"')
    p.write_text(f"schema = 1\n[framework.demo]\n{seed}\n[sets.current.framework.demo]\n{table}")
    return p


@pytest.mark.parametrize("kind", ["abbreviated", "tag only"])
def test_git_mode_with_an_abbreviated_or_no_commit(tmp_path: Path, tagged_repo: dict[str, str], kind: str) -> None:
    commit = tagged_repo["release"][:9] if kind == "abbreviated" else ""
    pins = _pins_with_current(tmp_path, tagged_repo["up"], "v1.0", commit)
    cmd = ("bash", "download_frameworks_source_code.sh", "--pins", str(pins), "--dest", str(tmp_path / "ws"))
    proc = _run(*cmd, pin_set="current")
    assert proc.returncode == 0, proc.stderr
    assert _git("rev-parse", "HEAD", cwd=tmp_path / "ws" / "Demo") == tagged_repo["release"]
    assert ("no commit pinned: the tag's" in proc.stdout) == (kind == "tag only")
    assert "verified" in _run(*cmd, pin_set="current").stdout
    if kind == "abbreviated":  # positive control: an abbreviation the tag does not have stops with one line
        bad = _pins_with_current(tmp_path, tagged_repo["up"], "v1.0", "abcdef123")
        proc = _run("bash", "download_frameworks_source_code.sh", "--pins", str(bad), "--dest", str(tmp_path / "ws2"),
                    pin_set="current")
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
        assert "pins.toml says abcdef123" in proc.stderr


def test_git_mode_refuses_a_pin_without_a_tag(tmp_path: Path, tagged_repo: dict[str, str]) -> None:
    pins = _pins_with_current(tmp_path, tagged_repo["up"], "", tagged_repo["release"][:9])
    proc = _run("bash", "download_frameworks_source_code.sh", "--pins", str(pins), "--dest", str(tmp_path / "ws"),
                pin_set="current")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: demo 1.0 has no upstream tag in pins.toml: download it with "
                                                "--source pypi"]


def test_archive_dir_makes_a_checked_tree(tmp_path: Path, tagged_repo: dict[str, str]) -> None:
    """``--archive-dir``: a framework no registry serves, from its git archive (checksum and commit checked)."""
    pins = _pins_with_current(tmp_path, tagged_repo["up"], "v1.0", tagged_repo["release"])
    ws = tmp_path / "ws"
    cmd = ("bash", "download_frameworks_source_code.sh", "--pins", str(pins), "--dest", str(ws), "--source", "pypi",
           "--archive-dir", tagged_repo["archives"])
    proc = _run(*cmd, pin_set="current")
    assert proc.returncode == 0, proc.stderr
    assert (ws / "Demo" / "pkg" / "__init__.py").read_text() == "V = 1\n"
    assert _git("log", "--format=%s", cwd=ws / "Demo") == "pristine demo 1.0"
    assert "verified" in _run(*cmd, pin_set="current").stdout
    sums = Path(tagged_repo["archives"]) / "SHA256SUMS"
    sums.write_text("0" * 64 + sums.read_text()[64:])  # positive control: a checksum that does not match
    proc = _run("bash", "download_frameworks_source_code.sh", "--pins", str(pins), "--dest", str(tmp_path / "ws2"),
                "--source", "pypi", "--archive-dir", tagged_repo["archives"], pin_set="current")
    assert proc.returncode == 1 and "does not match" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_the_switch_is_declared_once_in_the_pin_file() -> None:
    import tomllib

    decl = tomllib.loads(PINS.read_text())["pin_set"]
    assert decl == {"env": "PIN_SET", "default": "seed"}
    features = (REPO / "features.toml").read_text()
    assert "PIN_SET" not in features  # declared once: pins.toml [pin_set]


def test_current_mindspeed_tree_from_the_archive_checks_clean(tmp_path: Path) -> None:
    """MindSpeed (no registry serves it) for the current set: ``download --source pypi --archive-dir ../shared/upstream``
    (the pristine archive beside the checkout, ../shared/upstream/README.md; missing, the test fails), then
    ``PIN_SET=current apply_all_patches.sh --check`` on it lists exactly patches/current/mindspeed/."""
    pins = load_pins(PINS, "current")
    fw = pins.frameworks["mindspeed"]
    archives = REPO.parent / "shared" / "upstream"
    assert (archives / f"mindspeed-{fw.commit}.tar.gz").is_file(), f"no MindSpeed archive of {fw.commit} in {archives}"
    ws = tmp_path / "ws"
    got = _run("bash", "download_frameworks_source_code.sh", "--source", "pypi", "--only", "mindspeed", "--dest", str(ws),
               "--archive-dir", str(archives), pin_set="current")
    assert got.returncode == 0, got.stderr
    assert (ws / fw.dir / "mindspeed").is_dir()
    check = _run("bash", "apply_all_patches.sh", "--check", "--only", "mindspeed", "--workspace", str(ws),
                 pin_set="current")
    assert check.returncode == 0, check.stdout + check.stderr
    want = sorted(f"mindspeed: would apply {p.name}" for p in (pins.patches_root / "mindspeed").glob("*.patch"))
    assert sorted(ln for ln in check.stdout.splitlines() if "would apply" in ln) == want


def test_dockerfile_takes_the_set_as_build_args() -> None:
    """The image: PIN_SET as a build argument exported to every script, the base image as a build argument, the
    set's default download source, MindSpeed by git in either set, both requirements files copied."""
    text = (REPO / "Dockerfile.vllm_ascend.mindspeed.qwen3").read_text()
    assert "ARG PIN_SET=seed" in text and "ENV PIN_SET=${PIN_SET}" in text
    assert "ARG BASE_IMAGE=" in text and "FROM ${BASE_IMAGE}" in text
    assert 'ARG SOURCE=""' in text and '${SOURCE:+--source "${SOURCE}"}' in text
    assert "download_frameworks_source_code.sh --source git --only mindspeed" in text
    assert "requirements-current.txt" in text
    current = load_pins(PINS, "current")
    assert "--pin-set current --get runtime.base_image" in text
    assert current.source == "pypi" and load_pins(PINS, "seed").source == "git"
    for fw in current.frameworks.values():  # nothing of the current set hard-coded either
        for pinned in (fw.commit, fw.git_ref, f"=={fw.version}"):
            assert not pinned or pinned not in text, (fw.key, pinned)
