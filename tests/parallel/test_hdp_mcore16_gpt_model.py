"""Current set: megatron-core 0.16.1's own ``hybrid_context_parallel`` in its own GPTModel equals the plain CP step.

The current-set counterpart of ``test_hdp_gpt_model.py`` (issue 44 item 2). World 4 on gloo, TP = PP = 1. The model
is megatron-core 0.16.1's ``GPTModel`` (the current set's venv, ``tests/setup_verl091_env.sh``; the current megatron
series, ``patches/current/megatron``, touches only dist checkpointing) in the Qwen3 shape of the seed test, built
from megatron's Transformer Engine layer spec with the CPU stand-ins of ``qwen3_rl/cpu_device/megatron16_shims.py``.
The step runs in ``tests/helpers/hdp_mcore16_driver.py`` (docstring: what is upstream, what is a device shim):

- off: DP 2 x CP 2, megatron's no-pipelining schedule, every sample over its DP group's whole CP group
  (``get_batch_on_this_cp_rank``);
- hybrid: the same 4 ranks as one DP x CP domain with ``hybrid_context_parallel=True``: upstream's
  ``BalancedCPScheduler`` places each sample on 1 or 2 ranks, ``hybrid_context_parallel_forward_backward`` runs one
  pass per sample, ``PackedSeqParams.cp_group`` / ``local_cp_size`` select RoPE's and attention's group.

Core attention: megatron's own path (``TEDotProductAttention``'s place in the spec) with a CPU stand-in for TE's CP
flash attention, not MindSpeed's. Why not MindSpeed core_r0.16.0 (a reading of its tree, not run): hybrid CP needs
``context_parallel_size`` 1 in the model, since RoPE falls back to the model's CP group for a sample without one
(megatron ``models/common/embeddings/rotary_pos_embedding.py:199-204``; run with 2, a sample on one rank stops in
``rope_utils.py:125``: 16 vs 8 rows). At CP size 1 MindSpeed registers its own ``TEDotProductAttention``
(``mindspeed/features_manager/megatron_basic/transformer_engine_basic.py:62``), which picks plain flash attention at
construction (``mindspeed/te/pytorch/attention/dot_product_attention/dot_product_attention.py:216-231, 604-614``),
never calls ``set_context_parallel_group`` (megatron's TE wrapper does, ``extensions/transformer_engine.py:
1346-1363``) and ignores the ``local_cp_size`` / ``cp_group`` it is handed (``:325-326``, passed on at ``:675``): a
sample on two ranks attends only its local half. At CP size > 1 its ``MindSpeedCPDotProductAttention``
(``features_manager/context_parallel/context_parallel_feature.py:114-115``) rings over the fixed CP group
(``mindspeed/core/context_parallel/dot_product_attention.py:224``). Measured in
``test_mindspeed16_attention_breaks_hybrid_cp``: the hybrid step with MindSpeed's attention (its flash backend on
the repo's torch_npu kernel stand-ins). Per-token loss (``calculate_per_token_loss``): the reduced gradient is the
token mean over all 4 ranks' samples in both runs. Checked: every sample's loss sum (so each
DP group's loss) and every parameter's reduced gradient agree within the seed test's tolerances; positive controls:
the hybrid run took the hybrid path (samples with ``local_cp_size`` 1 and 2 from the schedule, attention calls on
groups of size 1 and 2 counted), the plain run ran every attention call on the CP group of 2, and the two runs'
samples were placed differently.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO
from helpers.current_set import MINDSPEED, apply, series
from helpers.current_verl import run_in_venv
from helpers.mindspeed_tree import pinned_mindspeed_workspace

DRIVER = REPO / "tests" / "helpers" / "hdp_mcore16_driver.py"
# the seed test's tolerances (tests/parallel/test_hdp_gpt_model.py: float32, different reduction orders)
GRAD_RTOL, GRAD_ATOL, LOSS_RTOL = 1e-4, 1e-6, 1e-5


MODES = ("off", "hybrid", "hybrid-mindspeed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The three runs of the driver in one set of 4 ranks: ``{mode: {"lens": [...], "ranks": [per-rank results]}}``.
    MindSpeed core_r0.16.0 (verified archive, current series applied) is on the path of the third."""
    ws = pinned_mindspeed_workspace(tmp_path_factory.mktemp("ms16"), MINDSPEED)
    tree = ws / MINDSPEED.dir
    apply(tree, series("mindspeed"))
    path = [REPO, REPO / "qwen3_rl" / "cpu_device", REPO / "tests"]
    proc = run_in_venv(
        ["-W", "ignore", str(DRIVER), ",".join(MODES)],
        path,
        timeout=400,
        cwd=REPO,
        env={"QWEN3_RL_MS16_TREE": str(Path(tree))},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("JSON"))
    got = json.loads(line[4:])
    for rank, res in enumerate(got["ranks"]):
        assert isinstance(res, dict), f"rank {rank} failed:\n{res}"
    return {mode: {"lens": got["lens"], "ranks": [r[mode] for r in got["ranks"]]} for mode in MODES}


def _sample_sums(run: dict) -> dict[int, float]:
    """Each sample's loss sum over all its tokens (the ranks that ran it each hold a part)."""
    sums: dict[int, float] = {}
    for res in run["ranks"]:
        for gid, v in res["loss_sums"].items():
            sums[int(gid)] = sums.get(int(gid), 0.0) + v
    return sums


def test_hybrid_cp_step_equals_cp_step_in_megatron16_gpt_model(runs: dict[str, dict]) -> None:
    """Megatron-core 0.16.1's hybrid CP step and its plain DP 2 x CP 2 step, same model and samples: equal per-DP-group
    losses and reduced gradients (tolerances above); the hybrid path was taken with CP groups of 1 and 2."""
    off, hyb = runs["off"], runs["hybrid"]
    # positive controls: the plain run put every attention call on the CP group of 2 ...
    for res in off["ranks"]:
        assert res["attention_group_sizes"] == {"2": 10} and res["local_cp_sizes"] == {}
    # ... the hybrid run took upstream's schedule: one pass per sample, CP sizes 1 and 2 (the 32-token sample over
    # the budget of 24 on 2 ranks), attention on the matching groups
    lens = off["lens"]  # lengths by global id: DP rank 0's five, then DP rank 1's
    assert len(lens) == 10
    schedule = hyb["ranks"][0]["schedule"]
    assert all(res["schedule"] == schedule for res in hyb["ranks"])
    held = {g: sum(g in ids for group in schedule for ids in group) for g in range(len(lens))}
    assert sorted(held) == list(range(len(lens))) and held[5] == 2 and 1 in held.values()
    sizes: dict[str, int] = {}
    for rank, res in enumerate(hyb["ranks"]):
        assert {int(g): k for g, k in res["local_cp_sizes"].items()} == {
            g: held[g] for group in schedule for g in group[rank]
        }
        n_passes = sum(len(group[rank]) for group in schedule)
        assert sum(res["attention_group_sizes"].values()) == 2 * n_passes  # 2 layers
        for k, n in res["attention_group_sizes"].items():
            sizes[k] = sizes.get(k, 0) + n
    assert set(sizes) == {"1", "2"}, sizes

    # ... and moved samples across the plain run's DP groups (global ids 0-4 are DP group 0's, on ranks 0-1)
    assert any(g >= 5 for group in schedule for ids in group[:2] for g in ids)

    s_off, s_hyb = _sample_sums(off), _sample_sums(hyb)
    assert sorted(s_off) == sorted(s_hyb) == list(range(len(lens)))
    worst = {"loss": 0.0, "grad": 0.0}
    for dp in (0, 1):  # each DP group's token-mean loss (its samples as the plain run's DP group held them)
        ids = range(5 * dp, 5 * dp + 5)
        n_tok = sum(lens[g] for g in ids)
        lo, lh = sum(s_off[g] for g in ids) / n_tok, sum(s_hyb[g] for g in ids) / n_tok
        assert lo > 0 and abs(lh - lo) <= LOSS_RTOL * lo, (dp, lh, lo)
        worst["loss"] = max(worst["loss"], abs(lh - lo) / lo)
    for g in s_off:
        assert abs(s_hyb[g] - s_off[g]) <= LOSS_RTOL * s_off[g], (g, s_hyb[g], s_off[g])
    ref = off["ranks"][0]["grads"]
    assert len(ref) > 10
    for r in range(4):
        assert hyb["ranks"][r]["grads"].keys() == ref.keys()
        for name, g_off in ref.items():
            a, e = torch.tensor(hyb["ranks"][r]["grads"][name]), torch.tensor(g_off)
            assert e.abs().max() > 0, f"{name}: zero gradient"
            torch.testing.assert_close(a, e, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"rank {r} {name}")
            assert torch.equal(torch.tensor(off["ranks"][r]["grads"][name]), e)  # every rank holds the same
            worst["grad"] = max(worst["grad"], float((a - e).abs().max() / e.abs().max()))
    print(
        f"\nmegatron-core 0.16.1 hybrid CP vs CP 2: loss rel diff {worst['loss']:.2e}, grad max|diff|/max|grad| "
        f"{worst['grad']:.2e}; schedule {schedule}; attention calls by group size {sizes}; DP-group losses "
        f"{[round(sum(s_off[g] for g in range(5 * d, 5 * d + 5)) / sum(lens[5 * d : 5 * d + 5]), 6) for d in (0, 1)]}"
    )


def test_mindspeed16_attention_breaks_hybrid_cp(runs: dict[str, dict]) -> None:
    """The same hybrid step with MindSpeed core_r0.16.0's ``TEDotProductAttention`` (what it registers at model CP
    size 1) as core attention: it is handed ``local_cp_size`` 2 for the samples on rank pairs, ignores it, and those
    samples' losses and the gradients differ from the plain step; the samples on one rank agree (positive control:
    MindSpeed's attention and its kernel stand-in are right where no CP is needed)."""
    off, hyb, ms = runs["off"], runs["hybrid"], runs["hybrid-mindspeed"]
    lens = off["lens"]
    schedule = ms["ranks"][0]["schedule"]
    assert schedule == hyb["ranks"][0]["schedule"]
    held = {g: sum(g in ids for group in schedule for ids in group) for g in range(len(lens))}
    pairs = sorted(g for g, k in held.items() if k == 2)
    assert pairs and len(pairs) < len(lens)
    # MindSpeed's attention was called with the hybrid schedule's local_cp_size on every rank
    for r in range(4):
        assert ms["ranks"][r]["attention_group_sizes"] == hyb["ranks"][r]["attention_group_sizes"]
    s_off, s_ms = _sample_sums(off), _sample_sums(ms)
    single = [g for g in range(len(lens)) if g not in pairs]
    for g in single:
        assert abs(s_ms[g] - s_off[g]) <= LOSS_RTOL * s_off[g], (g, s_ms[g], s_off[g])
    pair_err = {g: abs(s_ms[g] - s_off[g]) / s_off[g] for g in pairs}
    assert all(e > 100 * LOSS_RTOL for e in pair_err.values()), pair_err
    dp_err = []
    for dp in (0, 1):
        ids = range(5 * dp, 5 * dp + 5)
        n_tok = sum(lens[g] for g in ids)
        lo, lm = sum(s_off[g] for g in ids) / n_tok, sum(s_ms[g] for g in ids) / n_tok
        dp_err.append(abs(lm - lo) / lo)
    grad_err = 0.0
    for name, g_off in off["ranks"][0]["grads"].items():
        a, e = torch.tensor(ms["ranks"][0]["grads"][name]), torch.tensor(g_off)
        grad_err = max(grad_err, float((a - e).abs().max() / e.abs().max()))
    assert grad_err > 100 * GRAD_RTOL, grad_err
    print(
        f"\nMindSpeed core_r0.16.0 attention under hybrid CP: samples on rank pairs {pairs} loss rel err "
        f"{[f'{pair_err[g]:.2e}' for g in pairs]}, DP-group loss rel err {[f'{x:.2e}' for x in dp_err]}, grad "
        f"max|diff|/max|grad| {grad_err:.2e}; single-rank samples agree to {LOSS_RTOL:g}"
    )
