"""The current set's MindSpeed core_r0.16.0 series (``patches/current/mindspeed``) on the real tree from the archive in
``../shared/upstream`` (verified against ``SHA256SUMS`` and its embedded commit id): it applies and reverts
byte-identically; the builder fix's C++ sources compile (own includes, ``g++ -fsyntax-only``) after it and not
before; the TND softmax-merge fix runs MindSpeed's own ring merge (``forward_update``, unfused: MindSpeed's
default) on packed sequences, equal to attention over both key blocks, and the pristine tree fails the same call.
Without the archive every test here fails (no skip)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, run_python
from helpers.current_set import MINDSPEED, apply, patch_named, patched_files, patched_megatron, series
from helpers.mindspeed_tree import git, pinned_mindspeed_workspace

CSTRING_FUNCS = ("strlen", "strcpy", "strncpy", "strcmp", "strncmp", "memcpy", "memmove", "memset")


@pytest.fixture(scope="module")
def ms16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MindSpeed core_r0.16.0, pristine, as a one-commit git repo (from the verified archive)."""
    ws = pinned_mindspeed_workspace(tmp_path_factory.mktemp("ms16"), MINDSPEED)
    return ws / MINDSPEED.dir


def test_mindspeed16_series_applies_and_reverts(ms16: Path) -> None:
    files = [f for p in series("mindspeed") for f in patched_files(p)]
    pristine = {f: (ms16 / f).read_bytes() for f in files}
    apply(ms16, series("mindspeed"))
    assert all((ms16 / f).read_bytes() != pristine[f] for f in files)
    apply(ms16, series("mindspeed"), reverse=True)
    assert all((ms16 / f).read_bytes() == pristine[f] for f in files)
    assert git("status", "--porcelain", cwd=ms16).stdout.strip() == ""


def test_mindspeed16_builder_patch_makes_cstring_users_self_sufficient(ms16: Path, tmp_path: Path) -> None:
    """Each C++ source the builder patch touches: its own system includes plus the <cstring> calls it makes compile
    after the patch and not before (torch, torch_npu and CANN headers are not needed for that unit)."""
    gxx = shutil.which("g++")
    assert gxx is not None, "g++ is needed for the include check (apt-get install g++)"
    builder = patch_named("mindspeed", "builder")
    files = patched_files(builder)
    assert len(files) == 2, files

    def compiles(rel: str) -> bool:
        text = (ms16 / rel).read_text()
        used = [f for f in CSTRING_FUNCS if re.search(rf"\b{f}\s*\(", text)]
        assert used, f"{rel} calls no <cstring> function"
        lines = [f"#include <{h}>" for h in re.findall(r"^\s*#\s*include\s*<([^>]+)>", text, re.M)]
        lines += [f"static const void* use_{f} = reinterpret_cast<const void*>(&{f});" for f in used]
        unit = tmp_path / (Path(rel).stem + ".cpp")
        unit.write_text("\n".join(lines) + "\n")
        return subprocess.run([gxx, "-std=c++17", "-fsyntax-only", str(unit)], capture_output=True,
                              timeout=120).returncode == 0

    assert not any(compiles(f) for f in files), "pristine files already include what they use"
    apply(ms16, [builder])
    try:
        assert all(compiles(f) for f in files)
    finally:
        apply(ms16, [builder], reverse=True)


# ---- TND softmax merge: MindSpeed's forward_update on two ring steps' partial attentions ---------------------------
LENGTHS = [5, 3, 7]  # packed sequences (TND)
N_HEADS, HEAD_DIM = 4, 8

_MERGE = """
import json, math, sys
sys.path[:0] = ROOTS
sys.modules["qwen3_rl"] = None
from helpers import mindspeed_shims
mindspeed_shims.install()
import torch
import mindspeed.args_utils as ms_args
args = ms_args.get_mindspeed_args(get_defaults=True)
assert not args.use_fused_ring_attention_update  # MindSpeed's default: the unfused merge
ms_args._MINDSPEED_ARGS = args
from mindspeed.core.context_parallel import utils as cp_utils
lengths, n, d = LENGTHS, N_HEADS, HEAD_DIM
t = sum(lengths)
g = torch.Generator().manual_seed(0)
q = torch.randn(t, n, d, generator=g, dtype=torch.float64)
kv = [torch.randn(t, n, d, generator=g, dtype=torch.float64) for _ in range(4)]  # k and v of two ring steps
ends = [sum(lengths[:i + 1]) for i in range(len(lengths))]
scale = 1 / math.sqrt(d)
step = [mindspeed_shims.npu_fusion_attention(q, kv[2 * i], kv[2 * i + 1], n, "TND", scale=scale,
                                             actual_seq_qlen=ends, actual_seq_kvlen=ends)[:3] for i in range(2)]
try:
    out, mx, sm = cp_utils.forward_update(*step[0], *step[1], actual_seq_qlen=lengths, layout="TND")
except RuntimeError as e:
    import traceback
    print("RESULT " + json.dumps({"error": str(e), "where": [f.name for f in traceback.extract_tb(e.__traceback__)]}))
    raise SystemExit(0)
# reference: each sequence's queries attend both steps' keys of that sequence
err, start = 0.0, 0
for length in lengths:
    sl = slice(start, start + length)
    k = torch.cat([kv[0][sl], kv[2][sl]]).transpose(0, 1)
    v = torch.cat([kv[1][sl], kv[3][sl]]).transpose(0, 1)
    ref = (torch.softmax(q[sl].transpose(0, 1) @ k.transpose(1, 2) * scale, -1) @ v).transpose(0, 1)
    err = max(err, (out[sl] - ref).abs().max().item())
    start += length
print("RESULT " + json.dumps({"max_abs_err": err, "shape": list(out.shape)}))
"""


def _merge(ms_tree: Path, megatron: Path) -> dict:
    roots = [str(ms_tree), str(megatron), str(REPO / "tests")]
    code = f"ROOTS, LENGTHS, N_HEADS, HEAD_DIM = {roots!r}, {LENGTHS!r}, {N_HEADS}, {HEAD_DIM}\n" + _MERGE
    proc = run_python(textwrap.dedent(code))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.fixture(scope="module")
def megatron16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return patched_megatron(tmp_path_factory.mktemp("m16"))


def test_mindspeed16_unfused_tnd_merge_equals_attention_over_both_blocks(ms16: Path, megatron16: Path,
                                                                        tmp_path: Path) -> None:
    fix = patch_named("mindspeed", "tnd_softmax_merge")
    copy = tmp_path / MINDSPEED.dir
    shutil.copytree(ms16, copy)
    apply(copy, [fix])
    got = _merge(copy, megatron16)
    assert got.get("shape") == [sum(LENGTHS), N_HEADS, HEAD_DIM], got
    assert got["max_abs_err"] < 1e-12, got
    print(f"\nmerged TND ring steps: max |err| {got['max_abs_err']:.2e} (float64)")


def test_pristine_mindspeed16_unfused_tnd_merge_fails(ms16: Path, megatron16: Path) -> None:
    """Positive control: the same merge on the pristine core_r0.16.0 tree."""
    got = _merge(ms16, megatron16)
    assert "view size is not compatible" in got.get("error", ""), got
    assert got["where"][-2:] == ["unflatten_softmax", "<listcomp>"], got  # the .view in unflatten_softmax

