"""Data rebalance by group key (``qwen3_rl.data_rebalance.by_key``, ``DATA_REBALANCE_BY_KEY``): a prompt's samples
go to ranks chosen by its key, so they run where its SAM history is at the next visit, every rank still gets
``B / dp`` rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qwen3_rl.rollout.data_rebalance import (
    DataRebalanceError,
    home_ranks,
    keyed_permutation,
    keyed_rank_of_rows,
    prompt_key,
    rank_of_rows,
)


def _keys(p: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, np.iinfo(np.int64).max, p).astype(np.uint64)


@pytest.mark.parametrize("p,n,dp", [(512, 16, 32), (256, 8, 32), (22, 8, 16), (22, 8, 11), (6, 4, 8), (8, 16, 4),
                                    (30, 3, 9), (1, 4, 4)])
def test_every_rank_gets_its_share_and_rows_keep_their_order(p: int, n: int, dp: int) -> None:
    rank, home = keyed_rank_of_rows(_keys(p), n, dp)
    assert np.bincount(rank, minlength=dp).tolist() == [p * n // dp] * dp
    perm = keyed_permutation(_keys(p), n, dp)
    assert sorted(perm.tolist()) == list(range(p * n))
    chunks = perm.reshape(dp, -1)  # verl's equal contiguous chunks
    for r in range(dp):
        assert (rank[chunks[r]] == r).all() and (np.diff(chunks[r]) > 0).all()
    want = (home_ranks(_keys(p), n, dp)[:, None] + np.arange(n)) % dp
    assert ((rank == want.reshape(-1)) == home).all()


def test_a_prompt_runs_on_the_same_ranks_whatever_its_batch_position() -> None:
    """The same 512 prompts (n 16, DP 32) in two shuffled batch orders: by key, at least 95 % of each prompt's
    samples run on the ranks of its other visit; by position (the dealing), about half (its parity decides)."""
    p, n, dp = 512, 16, 32
    keys = _keys(p)
    rng = np.random.default_rng(1)
    o1, o2 = rng.permutation(p), rng.permutation(p)

    def ranks_by_prompt(order: np.ndarray, by_key: bool) -> dict[int, set[int]]:
        r = (keyed_rank_of_rows(keys[order], n, dp)[0] if by_key else rank_of_rows(p * n, dp)).reshape(p, n)
        return {int(q): set(r[j].tolist()) for j, q in enumerate(order)}

    def landing(by_key: bool) -> float:
        a, b = ranks_by_prompt(o1, by_key), ranks_by_prompt(o2, by_key)
        return float(np.mean([len(a[q] & b[q]) / n for q in range(p)]))

    key, pos = landing(True), landing(False)
    print(f"share of a prompt's samples on the ranks of its other visit: by key {key:.3f}, by position {pos:.3f}")
    assert key >= 0.95
    assert 0.4 <= pos <= 0.6


def test_more_samples_than_ranks_and_colliding_keys_stay_balanced() -> None:
    rank, home = keyed_rank_of_rows(_keys(8), 16, 4)  # n > dp: every prompt on every rank, 4 samples each
    assert all(np.bincount(r, minlength=4).tolist() == [4] * 4 for r in rank.reshape(8, 16)) and home.all()
    same = np.full(64, 12345, np.uint64)  # every prompt with one key: homes overflow, the rest fill free ranks
    rank, home = keyed_rank_of_rows(same, 4, 32)
    assert np.bincount(rank, minlength=32).tolist() == [8] * 32
    assert home.mean() == pytest.approx(8 / 64)
    with pytest.raises(DataRebalanceError, match="not a multiple of the DP size 5"):
        keyed_rank_of_rows(_keys(3), 4, 5)


def test_the_key_is_the_prompt_token_ids() -> None:
    assert prompt_key(np.array([5, 6, 7])) == prompt_key(np.array([5, 6, 7], np.int32))
    assert prompt_key(np.array([5, 6, 7])) != prompt_key(np.array([5, 6, 8]))


def test_dataproto_by_key_round_trip(patched_imports: Path) -> None:
    """A left-padded verl batch (GRPO's repeat): the key reads the prompt tokens under the attention mask (padding
    does not change it), every chunk holds its share, and restore puts rows back in dataset order."""
    import torch
    from verl import DataProto

    from qwen3_rl.rollout.data_rebalance import group_keys, restore_dataproto
    from qwen3_rl.trainer.seam import RecipeConfig

    prompts = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41], [11, 12, 13, 14], [61, 62]]
    width, n, dp = 5, 4, 8
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, pr in enumerate(prompts):
        ids[i, width - len(pr):] = torch.tensor(pr)
        mask[i, width - len(pr):] = 1
    base = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})
    batch = base.repeat(repeat_times=n, interleave=True)
    keys = group_keys(batch, n)
    assert keys.tolist() == [prompt_key(np.array(pr)) for pr in prompts]
    perm = keyed_permutation(keys, n, dp)
    permuted = batch.select_idxs(perm)
    chunks = permuted.chunk(dp)
    assert all(len(c) == len(prompts) * n // dp for c in chunks)
    rank, _ = keyed_rank_of_rows(keys, n, dp)
    for r, c in enumerate(chunks):
        assert torch.equal(c.batch["input_ids"], batch.batch["input_ids"][torch.as_tensor(np.flatnonzero(rank == r))])
    assert torch.equal(restore_dataproto(permuted, perm).batch["input_ids"], batch.batch["input_ids"])
    cfg = RecipeConfig.from_group({"data_rebalance": {"enable": True, "by_key": True}})
    assert cfg.data_rebalance.by_key and not RecipeConfig.from_group({}).data_rebalance.by_key


def test_grpo_fit_places_by_key_and_restores_order(patched_imports: Path) -> None:
    """RayPPOTrainer.fit (patched verl, the seam's trainer hook) with ``qwen3_rl.data_rebalance.by_key``: each DP
    piece holds the rows ``keyed_rank_of_rows`` gives (prompt keys from the batch's prompt tokens), the same prompts
    in another order land on the same pieces, and training gets dataset order."""
    pytest.importorskip("tensordict")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_rollout_integration import PROMPT_LEN, _check_trained_rows, _grpo_trainer

    n, dp = 4, 4
    pieces = []
    for order in ([10, 11, 12, 13], [13, 12, 11, 10]):
        t = _grpo_trainer(patched_imports, data_rebalance=True, n=n, train=[order], val=None,
                          extra=["+qwen3_rl.data_rebalance.by_key=true"])
        t.fit()
        got = t.actor_rollout_wg.pieces[0]
        keys = np.asarray([prompt_key(np.full(PROMPT_LEN, p)) for p in order], np.uint64)
        rank, _ = keyed_rank_of_rows(keys, n, dp)
        rows = np.repeat(order, n)
        assert got == [rows[rank == r].tolist() for r in range(dp)]
        _check_trained_rows(t.actor_rollout_wg.updated[0])
        pieces.append(sorted(map(sorted, got)))
    assert pieces[0] == pieces[1]  # the placement follows the prompts, not their batch positions
