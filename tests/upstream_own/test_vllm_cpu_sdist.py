"""tests/upstream_own/vllm_cpu.py refuses a cached vLLM sdist whose sha256 is not the pinned one (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, load_module

vllm_cpu = load_module(REPO / "tests" / "upstream_own" / "vllm_cpu.py", "upstream_own_vllm_cpu")


def test_cached_sdist_with_another_sha256_is_refused_and_deleted(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QWEN3_RL_CACHE", str(tmp_path))
    cached = tmp_path / "sdists" / vllm_cpu.SDIST_URL.rsplit("/", 1)[1]
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not the vLLM 0.13.0 sdist")
    with pytest.raises(SystemExit, match=vllm_cpu.SDIST_SHA256):
        vllm_cpu.sdist()
    assert not cached.exists()
