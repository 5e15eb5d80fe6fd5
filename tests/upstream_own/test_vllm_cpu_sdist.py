"""tests/upstream_own/vllm_cpu.py (seed set) and vllm023_cpu.py (current set) refuse a cached vLLM sdist whose sha256
is not the pinned one, and each pinned sdist is its set's vLLM release (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen3_rl.tools.pins import load_pins

from conftest import REPO, load_module

vllm_cpu = load_module(REPO / "tests" / "upstream_own" / "vllm_cpu.py", "upstream_own_vllm_cpu")
vllm023_cpu = load_module(REPO / "tests" / "upstream_own" / "vllm023_cpu.py", "upstream_own_vllm023_cpu")
SUITES = {"seed": vllm_cpu.SEED, "current": vllm023_cpu.CURRENT}


@pytest.mark.parametrize("pin_set", SUITES)
def test_cached_sdist_with_another_sha256_is_refused_and_deleted(pin_set: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    suite = SUITES[pin_set]
    monkeypatch.setenv("QWEN3_RL_CACHE", str(tmp_path))
    cached = tmp_path / "sdists" / suite.sdist_url.rsplit("/", 1)[1]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not the pinned vLLM sdist")
    with pytest.raises(SystemExit, match=suite.sdist_sha256):
        vllm_cpu.sdist(suite)
    assert not cached.exists()


@pytest.mark.parametrize("pin_set", SUITES)
def test_pinned_sdist_installed_version_and_patches_are_the_sets_vllm(pin_set: str) -> None:
    version = load_pins(REPO / "pins.toml", pin_set).frameworks["vllm"].version
    suite = SUITES[pin_set]
    assert suite.sdist_url.endswith(f"/vllm-{version}.tar.gz"), (suite.sdist_url, version)
    assert suite.version == version
    prefix = "patches/current/" if pin_set == "current" else "patches/"
    assert suite.patches == f"{prefix}vllm" and sorted((REPO / suite.patches).glob("*.patch"))
