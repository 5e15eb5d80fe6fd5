"""MindSpeed patch series on the real pinned MindSpeed tree: applied, compiled and executed.

MindSpeed is not on PyPI and CI reaches no git host, so its pinned tree comes from the archive beside the checkout:
``../shared/upstream/mindspeed-<commit>.tar.gz`` (``git archive`` of the pinned commit, see
``../shared/upstream/README.md``). The archive is verified against ``../shared/upstream/SHA256SUMS`` and its
embedded commit id (``git get-tar-commit-id``) against ``pins.toml``, unpacked into a one-commit git repo, and:

* the series is applied with the real scripts: it applies, re-applies as a no-op and reverts byte-identically;
* every patched Python file byte-compiles (``py_compile``); the builder patch's C++ sources pass the
  own-includes check with ``g++ -fsyntax-only`` (the whole files include torch_npu and CANN ``acl`` headers,
  ``smart_swap/common.h:21-24`` and ``adaptive_recomputing/NpuCachingCustomAllocator.h:7,13-19``, which are
  not available on a CPU machine);
* MindSpeed's own ring attention (``MindSpeedCPDotProductAttention`` with the HDP patch, on Megatron's CP group
  and HDP sub-groups) and both patched RoPE entry points run forward and backward on 2 gloo processes with the
  device shims of ``tests/helpers/mindspeed_shims.py``, against a single-process float64 reference: with MindSpeed's
  default unfused ring merge (TP 2 and TP 1 alignment, the latter with 2-token fillers) and with the fused one;
  the unfused merge fails without the TND softmax-merge bug-fix patch (0003).

Without the archive every test here fails with the reason in ``tests/helpers/mindspeed_tree.py`` (no skip).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PINS, REPO, free_port, run_script
from helpers.mindspeed_tree import apply_series, git, pinned_mindspeed_workspace

FW = PINS.frameworks["mindspeed"]
# The <cstring> functions the builder patch is about (see patches/mindspeed/0001-*.patch).
CSTRING_FUNCS = ("strlen", "strcpy", "strncpy", "strcmp", "strncmp", "memcpy", "memmove", "memset")
_git = git


@pytest.fixture(scope="module")
def mindspeed_ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace holding MindSpeed at the pinned commit, from the verified archive. Fails without it."""
    return pinned_mindspeed_workspace(tmp_path_factory.mktemp("ms_ws"))


def _patched_files() -> list[str]:
    files = []
    for patch in sorted((REPO / "patches" / "mindspeed").glob("*.patch")):
        files += re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), re.M)
    return files


def test_mindspeed_series_applies_reapplies_and_reverts(mindspeed_ws: Path) -> None:
    ws = mindspeed_ws
    tree = ws / FW.dir
    files = _patched_files()
    assert files, "no mindspeed patches"
    pristine = {f: (tree / f).read_bytes() for f in files}
    common = ("--workspace", str(ws), "--only", "mindspeed")

    proc = run_script("apply_all_patches.sh", *common)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    changed = [f for f in files if (tree / f).read_bytes() != pristine[f]]
    assert changed == files
    status = run_script("apply_all_patches.sh", *common, "--status")
    assert status.returncode == 0 and "not applied" not in status.stdout, status.stdout

    again = run_script("apply_all_patches.sh", *common)
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr

    revert = run_script("apply_all_patches.sh", *common, "--revert")
    assert revert.returncode == 0, revert.stdout + revert.stderr
    assert all((tree / f).read_bytes() == pristine[f] for f in files)
    assert _git("status", "--porcelain", cwd=tree).stdout.strip() == ""


def _own_system_includes(text: str) -> list[str]:
    return re.findall(r"^\s*#\s*include\s*<([^>]+)>", text, re.M)


def test_builder_patch_makes_cstring_users_self_sufficient(mindspeed_ws: Path, tmp_path: Path) -> None:
    """Each C++ source the builder patch touches declares the <cstring> functions it calls itself.

    Pristine, these files get ``strlen`` only through torch/torch_npu headers; a translation unit
    made of each file's own system includes plus the calls it makes must compile after the patch
    and fail before it (g++ -fsyntax-only; torch, torch_npu and CANN headers are not needed).
    """
    gxx = shutil.which("g++")
    assert gxx is not None, "g++ is needed for the include check (apt-get install g++)"
    ws = mindspeed_ws
    tree = ws / FW.dir
    builder = REPO / "patches" / "mindspeed" / "0001-mindspeed-bugfix-builder.patch"
    files = re.findall(r"^diff --git a/(\S+) b/", builder.read_text(), re.M)
    common = ("--workspace", str(ws), "--only", "mindspeed")

    def compiles(rel: str) -> bool:
        text = (tree / rel).read_text()
        used = [f for f in CSTRING_FUNCS if re.search(rf"\b{f}\s*\(", text)]
        assert used, f"{rel} calls no <cstring> function"
        lines = [f"#include <{h}>" for h in _own_system_includes(text)]
        lines += [f"static const void* use_{f} = reinterpret_cast<const void*>(&{f});" for f in used]
        unit = tmp_path / (Path(rel).stem + ".cpp")
        unit.write_text("\n".join(lines) + "\n")
        return subprocess.run([gxx, "-std=c++17", "-fsyntax-only", str(unit)], capture_output=True,
                              timeout=120).returncode == 0

    assert run_script("apply_all_patches.sh", *common, "--revert").returncode == 0
    assert not any(compiles(f) for f in files), "pristine files already include what they use"
    assert run_script("apply_all_patches.sh", *common).returncode == 0
    assert all(compiles(f) for f in files)


_apply = apply_series


def test_patched_python_files_byte_compile(mindspeed_ws: Path, tmp_path: Path) -> None:
    tree = _apply(mindspeed_ws)
    py = [f for f in _patched_files() if f.endswith(".py")]
    assert len(py) == 4, py
    for rel in py:
        proc = subprocess.run([sys.executable, "-m", "py_compile", str(tree / rel)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path)})
        assert proc.returncode == 0, f"{rel}: {proc.stderr}"


# ------------------------------------------------- MindSpeed ring attention + RoPE under HDP, 2 gloo processes
N_HEADS, N_KV, HEAD_DIM, VOCAB = 4, 2, 8, 50
HIDDEN = N_HEADS * HEAD_DIM
# (seq, length, micro-batch, block_start, block_size) on a CP group of 2 ranks: micro-batch 0 runs seqs 0 and 3
# as one ring group of 2 after a DP sequence on each rank; micro-batch 1 a ring sequence and a DP one on rank 1;
# micro-batch 2 a DP sequence on rank 1 while rank 0 runs a filler.
PLACEMENTS = [(0, 37, 0, 0, 2), (1, 9, 0, 0, 1), (2, 12, 0, 1, 1), (3, 21, 0, 0, 2), (4, 17, 1, 0, 2),
              (5, 5, 1, 1, 1), (6, 7, 2, 1, 1)]


def _assignment():
    from qwen3_rl.parallel.hdp import HDPAssignment, Placement, assign_hdp

    a = HDPAssignment(2, 10_000, assign_hdp([1], 1, 10).cost_model, [Placement(*p) for p in PLACEMENTS], 3)
    a.recompute()
    return a


def _inputs() -> dict[str, torch.Tensor]:
    """Token ids [n, L], cotangents [n, L, N*D] and the weights, float64."""
    g = torch.Generator().manual_seed(7)
    n, L = len(PLACEMENTS), max(p[1] for p in PLACEMENTS)
    return {"ids": torch.randint(1, VOCAB, (n, L), generator=g),
            "cot": torch.randn(n, L, HIDDEN, generator=g, dtype=torch.float64),
            "emb": torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64),
            "wq": torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN ** 0.5,
            "wk": torch.randn(HIDDEN, N_KV * HEAD_DIM, generator=g, dtype=torch.float64) / HIDDEN ** 0.5,
            "wv": torch.randn(HIDDEN, N_KV * HEAD_DIM, generator=g, dtype=torch.float64) / HIDDEN ** 0.5}


def _rope_ref(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half, base 10000) of x [s, h, d] at positions 0..s-1."""
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    f = torch.outer(torch.arange(x.shape[0], dtype=torch.float64), inv)
    emb = torch.cat([f, f], -1)[:, None, :]
    x1, x2 = x.chunk(2, -1)
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def _reference(inp: dict[str, torch.Tensor]) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process causal GQA attention per sequence: outputs {seq: [len, N*D]} and weight gradients of
    sum(out * cot)."""
    w = {k: inp[k].clone().requires_grad_() for k in ("emb", "wq", "wk", "wv")}
    outs, loss = {}, 0.0
    for seq, length, *_ in PLACEMENTS:
        x = w["emb"][inp["ids"][seq, :length]]
        q = _rope_ref((x @ w["wq"]).view(length, N_HEADS, HEAD_DIM)).transpose(0, 1)
        k = _rope_ref((x @ w["wk"]).view(length, N_KV, HEAD_DIM)).transpose(0, 1)
        v = (x @ w["wv"]).view(length, N_KV, HEAD_DIM).transpose(0, 1)
        k, v = (t.repeat_interleave(N_HEADS // N_KV, 0) for t in (k, v))
        s = (q @ k.transpose(1, 2)) / HEAD_DIM ** 0.5
        s = s.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), -torch.inf)
        o = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(length, HIDDEN)
        outs[seq] = o.detach()
        loss = loss + (o * inp["cot"][seq, :length]).sum()
    loss.backward()
    return outs, {k: t.grad for k, t in w.items()}


def _ring_worker(rank: int, port: int, roots: list[str], inp: dict[str, torch.Tensor], q, fused: bool,
                 align: int) -> None:
    """One of 2 gloo ranks: HDP micro-batches through MindSpeed's patched attention and RoPE, forward + backward.

    fused: MindSpeed's --use-fused-ring-attention-update (off by default; on, its CANN op is a stand-in).
    align: the HDP alignment (TP size with sequence parallelism)."""
    sys.path[:0] = roots
    from helpers import mindspeed_shims

    mindspeed_shims.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(context_parallel_size=2)
        import mindspeed.args_utils as ms_args

        args = ms_args.get_mindspeed_args(get_defaults=True)  # MindSpeed's own defaults (megatron_cp_algo, causal)
        args.use_flash_attn, args.attention_mask_on_cpu = True, True
        args.use_fused_ring_attention_update = fused  # MindSpeed's default: False
        ms_args._MINDSPEED_ARGS = args
        from mindspeed.core.context_parallel import utils as cp_utils

        # count which ring merge runs (forward_update reads both names from its module at call time)
        merges = {"fused": 0, "unfused": 0}

        def counted(kind, fn):
            def wrapper(*a, **kw):
                merges[kind] += 1
                return fn(*a, **kw)
            return wrapper

        cp_utils.npu_ring_attention_update = counted("fused", cp_utils.npu_ring_attention_update)
        cp_utils.forward_update_without_fused = counted("unfused", cp_utils.forward_update_without_fused)
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig
        from mindspeed.core.context_parallel.adaptor import MindSpeedCPDotProductAttention
        from mindspeed.core.fusions import fused_rope
        from mindspeed.core.models.common.embeddings import rotary_pos_embedding
        from mindspeed.core.transformer.transformer_config import transformer_config_post_init_wrapper

        from qwen3_rl.parallel.hdp_runtime import HDPRuntime
        from qwen3_rl.parallel.hdp_wiring import FILLER, HDPProcessGroups, pack_sequences, plan_micro_batches

        # MindSpeed copies its arguments onto Megatron's TransformerConfig (as its patch manager installs it)
        TransformerConfig.__post_init__ = transformer_config_post_init_wrapper(TransformerConfig.__post_init__)
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=N_HEADS,
                                   num_query_groups=N_KV, kv_channels=HEAD_DIM, context_parallel_size=2,
                                   attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False)
        attn = MindSpeedCPDotProductAttention(config, 1, AttnMaskType.causal, "self")
        # the rotary table as Megatron's RotaryEmbedding.forward builds it ([max_s, 1, 1, d], rotate-half layout;
        # that forward moves inv_freq to torch.cuda.current_device(), rotary_pos_embedding.py:155)
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
        f = torch.outer(torch.arange(64, dtype=torch.float64), inv)
        freqs = torch.cat([f, f], -1)[:, None, None, :]
        pgs = HDPProcessGroups.build([[0, 1]], [0, 1], lambda r: dist.new_group(r),
                                     cp_group=parallel_state.get_context_parallel_group())
        w = {k: inp[k].clone().requires_grad_() for k in ("emb", "wq", "wk", "wv")}
        outs: dict[int, dict[int, list[float]]] = {}
        rope_same = True
        # align 1: the filler is 2 tokens (qwen3_rl.parallel.hdp_wiring.filler_length); a 1-token ring group
        # cannot back-propagate in MindSpeed's causal EoD (utils.py:43-55 -> ring_context_parallel.py:1086)
        for mb in plan_micro_batches(_assignment(), rank, align=align, process_groups=pgs):
            filler = mb.seq_indices == [FILLER]
            sel = torch.tensor([0] if filler else mb.seq_indices)
            am = torch.zeros(len(sel), inp["ids"].shape[1], dtype=torch.bool)
            for j, seg in enumerate(mb.segments):
                am[j, :seg.length] = True
            ids, psp = HDPRuntime.preprocess(inp["ids"][sel], am, mb, PackedSeqParams)
            cot = pack_sequences(torch.zeros_like(inp["cot"][sel]) if filler else inp["cot"][sel],
                                 [seg.length for seg in mb.segments], mb)  # [T, N*D]
            x = w["emb"][ids[0]]  # [T, H]
            t = x.shape[0]
            qq = (x @ w["wq"]).view(t, N_HEADS, HEAD_DIM)
            kk = (x @ w["wk"]).view(t, N_KV, HEAD_DIM)
            vv = (x @ w["wv"]).view(t, N_KV, HEAD_DIM)
            cu = psp.cu_seqlens_q
            qq = fused_rope.apply_rotary_pos_emb(qq, freqs, config, cu_seqlens=cu, hdp=mb)
            k1 = rotary_pos_embedding.apply_rotary_pos_emb(kk, freqs, config, cu_seqlens=cu, hdp=mb)
            rope_same &= torch.equal(k1, fused_rope.apply_rotary_pos_emb(kk, freqs, config, cu_seqlens=cu, hdp=mb))
            out = attn(qq, k1, vv, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
            out = out.reshape(t, HIDDEN)
            (out * cot).sum().backward()
            for seg in mb.segments:
                if seg.seq == FILLER:
                    continue
                pos = seg.positions()
                for r, p in enumerate(pos.tolist()):
                    if p < seg.length:
                        outs.setdefault(seg.seq, {})[p] = out[seg.offset + r].tolist()
        grads = {}
        for k, t in w.items():
            g = t.grad.clone()
            dist.all_reduce(g)
            grads[k] = g.numpy()  # by value: a queued tensor is shared through a socket of this process
        q.put((rank, outs, grads, rope_same, merges))
    except BaseException as e:  # report to the parent instead of hanging it
        import traceback

        q.put((rank, traceback.format_exc(), None, None, None))
        raise e
    finally:
        dist.destroy_process_group()


def _run_ring(tree: Path, megatron: Path, fused: bool, align: int) -> list[tuple]:
    """Both gloo ranks' reports (rank, outputs or traceback, gradients, rope_same, merge counts)."""
    import torch.multiprocessing as mp

    assert (megatron / "megatron" / "core").is_dir()
    roots = [str(tree), str(megatron), str(REPO), str(Path(__file__).resolve().parent), str(REPO / "tests")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ring_worker, args=(r, port, roots, _inputs(), q, fused, align)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return [q.get(timeout=600) for _ in range(2)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("fused, align", [(False, 2), (False, 1), (True, 2)],
                         ids=["unfused-merge-align2", "unfused-merge-align1", "fused-merge-align2"])
def test_mindspeed_ring_attention_and_rope_under_hdp_on_gloo(mindspeed_ws: Path, patched_workspace: Path,
                                                             fused: bool, align: int) -> None:
    """MindSpeed's CP attention with the HDP patch: per block ring attention on the block's sub-group (ring of 2
    and rings of one) and the patched RoPE, forward and backward; outputs and the summed weight gradients equal
    single-process causal attention on each whole sequence. Unfused: MindSpeed's default ring merge (with patch
    0003); align 1: the idle rank's filler is 2 tokens."""
    tree = _apply(mindspeed_ws)
    ref_out, ref_grad = _reference(_inputs())
    got = _run_ring(tree, patched_workspace / PINS.frameworks["megatron"].dir, fused, align)
    seen: dict[int, set[int]] = {}
    for rank, outs, grads, rope_same, merges in got:
        assert isinstance(outs, dict), f"rank {rank} failed:\n{outs}"
        assert rope_same, "MindSpeed's two patched apply_rotary_pos_emb disagree"
        used, unused = ("fused", "unfused") if fused else ("unfused", "fused")
        assert merges[used] > 0 and merges[unused] == 0, merges  # the ring of 2 merged its steps that way
        for seq, rows in outs.items():
            for pos, row in rows.items():
                torch.testing.assert_close(torch.tensor(row, dtype=torch.float64), ref_out[seq][pos],
                                           rtol=1e-10, atol=1e-10, msg=f"rank {rank} seq {seq} pos {pos}")
                seen.setdefault(seq, set()).add(pos)
        for k, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(g), ref_grad[k], rtol=1e-9, atol=1e-10, msg=f"rank {rank} grad {k}")
    assert seen == {p[0]: set(range(p[1])) for p in PLACEMENTS}  # every token of every sequence, once per owner


def test_unfused_ring_merge_fails_without_the_tnd_softmax_merge_patch(mindspeed_ws: Path, patched_workspace: Path,
                                                                      tmp_path: Path) -> None:
    """The same HDP step with MindSpeed's default (unfused) ring merge on a copy of the patched tree with patch
    0003 reversed: upstream's unflatten_softmax views a transposed tensor (utils.py:71-72) and both ranks fail."""
    tree = _apply(mindspeed_ws)
    bugfix = REPO / "patches" / "mindspeed" / "0003-mindspeed-bugfix-tnd_softmax_merge.patch"
    copy = tmp_path / FW.dir
    shutil.copytree(tree, copy)  # with its .git: git apply works relative to the copy
    proc = subprocess.run(["git", "apply", "-R", str(bugfix)], cwd=copy, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    utils = (copy / "mindspeed/core/context_parallel/utils.py").read_text()
    assert ".transpose(0, 1) \\\n              .view(-1, orig_shape[-1])" in utils  # upstream's line is back
    got = _run_ring(copy, patched_workspace / PINS.frameworks["megatron"].dir, False, 2)
    for rank, outs, *_ in got:
        assert isinstance(outs, str), f"rank {rank} ran through without patch 0003"
        assert "view size is not compatible" in outs and "in unflatten_softmax" in outs, outs
