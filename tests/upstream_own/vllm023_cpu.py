"""vLLM 0.23.0's own CPU tests (the current set) on the pristine and on the patched vLLM tree: outcomes must be equal.

Run with the current engine venv's Python (``tests/setup_current_engine_env.sh``: vllm-cpu 0.23.0):
``$QWEN3_RL_CURRENT_ENGINE_VENV/bin/python tests/upstream_own/vllm023_cpu.py [--keep DIR] [--full] [--record]``.
Like ``vllm_cpu.py`` (whose code runs it, with :data:`CURRENT` as its suite) it downloads vLLM 0.23.0's sdist
(sha256 pinned below) for its ``tests/``, puts them beside two copies of the installed vllm-cpu 0.23.0 package,
applies ``patches/current/vllm/`` to one, runs :data:`TEST_FILES` in each tree whose record (``recorded/vllm023.json``,
``recorded/vllm023-patched.json``; ``recorded.py``) misses, both at the same time, and fails (exit 1) when
the outcome of a test id differs, when a run collects or passes nothing, or when pytest stops with a usage/internal
error.

Which files. The current series changes ``model_executor/layers/rotary_embedding/common.py`` only
(``ApplyRotaryEmb.__init__``, run by every RoPE layer: which platforms import flash-attn's rotary kernel). Of vLLM
0.23's tests, one builds a RoPE layer on the CPU: ``tests/compile/passes/test_scatter_split_replace.py`` (a
``RotaryEmbedding`` in a model compiled by Inductor on the CPU, checked against eager; about 2 min, most of it
compiling). On the CPU both trees take the no-import branch (pristine: ``is_cpu()``, patched: not ``is_rocm()``), so
the run shows that the patched module imports and builds and runs RoPE layers as before; the NPU and ROCm branches
are tested in ``tests/patches``. The other RoPE tests (``tests/kernels/core/test_{pos_encoding,rotary_embedding,
mrope,apply_rotary_emb}.py``, ``tests/compile/test_rotary_embedding_compile.py``, the RoPE fusion passes of
``tests/compile/passes``) are parametrized on CUDA devices or skip off CUDA/ROCm.
Beside it, as in the seed set, ``tests/v1/core/test_scheduler.py`` and ``tests/v1/spec_decode/test_ngram.py`` (both
still in 0.23; no current patch touches what they test, so they guard the next one that does); both name
``facebook/opt-125m`` for its config and tokenizer (``vllm_cpu.py``'s stand-in Hugging Face cache), and vLLM's
``tests/conftest.py`` needs ``tblib`` (``.ci/requirements-current-engine.txt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

import vllm_cpu  # noqa: E402

from qwen3_rl.tools.pins import load_pins  # noqa: E402

SDIST_URL = ("https://files.pythonhosted.org/packages/68/c6/c4dc766b09e93de278693502612de0beba822983d4f609830406ead"
             "65cc9/vllm-0.23.0.tar.gz")
SDIST_SHA256 = "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5"
TEST_FILES = ("tests/compile/passes/test_scatter_split_replace.py", "tests/v1/core/test_scheduler.py",
              "tests/v1/spec_decode/test_ngram.py")
#: Deselected on both trees (pytest -k): the scheduler's cases that build ``ModelConfig("llava-hf/llava-1.5-7b-hf")``
#: (30 cases at v0.23.0: the names ``vllm_cpu.DESELECT_K`` deselects, with EC-connector cases added since, and
#: ``test_eagle3_mm_encoder_cache_with_shift``); the stand-in cache has no llava config, so they fail on both trees
#: with the same ValidationError in ``ModelConfig``, before a scheduler is built, and prove nothing about the patch.
#: ``test_ec_connector_pending_prefetch_only_checks_future_mm_features`` matches a name but builds no model: it runs.
LLAVA_CASES = ("test_schedule_multimodal_requests", "test_schedule_partial_requests", "test_no_mm_input_chunking",
               "test_ec_connector_", "test_priority_scheduling_ec_connector_", "test_eagle3_mm_encoder_cache_with_shift")
DESELECT_K = f"not ({' or '.join(LLAVA_CASES)}) or test_ec_connector_pending_prefetch_only_checks_future_mm_features"
CURRENT = vllm_cpu.Suite(
    name="vllm023", label="vLLM 0.23.0", version=load_pins(REPO / "pins.toml", "current").frameworks["vllm"].version,
    sdist_url=SDIST_URL, sdist_sha256=SDIST_SHA256, patches="patches/current/vllm", test_files=TEST_FILES,
    deselect_k=DESELECT_K,
    repo_inputs=("tests/upstream_own/vllm023_cpu.py", *vllm_cpu.REPO_INPUTS))

if __name__ == "__main__":
    sys.exit(vllm_cpu.main(suite=CURRENT, doc=__doc__))
