"""DAPO dynamic sampling: group filtering, accumulation, trimming, budget error -- on verl's DataProto,
and the trainer's fit loop driven with fake worker groups on the patched verl (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from qwen3_rl.trainer.dapo import DapoSettings
from qwen3_rl.trainer.dynamic_sampling import informative_row_mask

RESP_LEN = 4


def test_informative_row_mask_groups() -> None:
    uids = np.array(["a", "a", "b", "b", "c", "c", "d"])
    vals = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    # a: all agree -> drop; b: mixed -> keep; c: all agree -> drop; d: single response -> keep
    assert informative_row_mask(uids, vals).tolist() == [False, False, True, True, False, False, True]
    assert informative_row_mask(uids, vals + np.array([0, 1e-9, 0, 0, 0, 0, 0]), atol=1e-6).tolist()[:2] == [
        False, False]
    with pytest.raises(ValueError, match="equal 1-D"):
        informative_row_mask(uids, vals[:3])


def _proto(uids: list[str], acc: list[float], offset: int = 0):
    """A scored batch: one row per response; ``ids`` tensor records the row identity."""
    import torch
    from verl import DataProto

    n = len(uids)
    ids = torch.arange(offset, offset + n).unsqueeze(-1).repeat(1, RESP_LEN)
    scores = torch.zeros(n, RESP_LEN)
    scores[:, -1] = torch.tensor(acc)
    return DataProto.from_dict(
        tensors={"ids": ids, "token_level_scores": scores, "token_level_rewards": scores.clone()},
        non_tensors={"uid": np.array(uids, dtype=object), "acc": np.array(acc, dtype=np.float64)},
        meta_info={"global_steps": 1 + offset},
    )


def _groups(prefix: str, pattern: list[list[float]]) -> tuple[list[str], list[float]]:
    uids, acc = [], []
    for g, vals in enumerate(pattern):
        uids += [f"{prefix}{g}"] * len(vals)
        acc += vals
    return uids, acc


def test_filter_groups_on_dataproto(patched_imports) -> None:
    from qwen3_rl.trainer.dynamic_sampling import filter_groups, take_whole_groups

    uids, acc = _groups("p", [[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    kept, st = filter_groups(_proto(uids, acc), "acc")
    assert (st.num_groups, st.num_kept_groups, st.num_rows, st.num_kept_rows) == (4, 2, 16, 8)
    assert kept.non_tensor_batch["uid"].tolist() == ["p1"] * 4 + ["p3"] * 4
    assert kept.batch["ids"][:, 0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]  # tensors follow, order kept
    # tensor metrics: the same decision from token_level_scores / token_level_rewards
    for metric in ("seq_reward", "seq_final_reward"):
        k2, _ = filter_groups(_proto(uids, acc), metric)
        assert k2.non_tensor_batch["uid"].tolist() == kept.non_tensor_batch["uid"].tolist()
    with pytest.raises(KeyError, match="filter_groups.metric 'score' is not in the batch"):
        filter_groups(_proto(uids, acc), "score")
    first = take_whole_groups(kept, 1)
    assert first.non_tensor_batch["uid"].tolist() == ["p1"] * 4
    with pytest.raises(ValueError, match="2 groups, 3 requested"):
        take_whole_groups(kept, 3)


def test_accumulate_trim_and_budget(patched_imports) -> None:
    from qwen3_rl.trainer.dynamic_sampling import DynamicSamplingError, GroupAccumulator

    acc = GroupAccumulator(train_batch_size=3, metric="acc", max_num_gen_batches=3)
    # batch 1: 2 informative groups of 4 -> not full
    st = acc.add(_proto(*_groups("a", [[1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 0]]), offset=0))
    assert st.num_kept_groups == 2 and acc.num_groups == 2 and not acc.is_full()
    acc.check_can_continue()  # 1 < 3 batches: allowed
    # batch 2: 2 more informative groups -> 4 >= 3: full, trimmed to exactly 3 whole groups
    acc.add(_proto(*_groups("b", [[0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]), offset=100))
    assert acc.is_full() and acc.num_groups == 4
    m = acc.metrics()
    assert m["dapo/num_gen_batches"] == 2.0 and m["dapo/kept_group_ratio"] == pytest.approx(4 / 6)
    out = acc.pop_train_batch()
    assert len(out) == 3 * 4
    assert out.non_tensor_batch["uid"].tolist() == ["a0"] * 4 + ["a2"] * 4 + ["b0"] * 4
    assert out.batch["ids"][:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 100, 101, 102, 103]
    assert out.meta_info == {}  # per-generation meta (global_steps 1 vs 101) does not clash in concat
    assert acc.batch is None and acc.num_gen_batches == 0  # reset for the next step

    # budget: one informative group per batch, 3 needed, at most 2 batches -> clear error
    acc = GroupAccumulator(train_batch_size=3, metric="acc", max_num_gen_batches=2)
    for i in range(2):
        acc.add(_proto(*_groups(f"c{i}", [[1, 0], [1, 1]]), offset=10 * i))
    assert not acc.is_full()
    with pytest.raises(DynamicSamplingError, match=r"2 of 3 prompt groups .* after 2 generation batches .*"
                       r"max_num_gen_batches=2"):
        acc.check_can_continue()
    with pytest.raises(DynamicSamplingError, match="not full"):
        acc.pop_train_batch()

    # no limit (<= 0): never raises; filtering off (metric None) keeps every group
    acc = GroupAccumulator(train_batch_size=100, metric="acc", max_num_gen_batches=0)
    for i in range(5):
        acc.add(_proto(*_groups(f"d{i}", [[1, 1]]), offset=10 * i))
        acc.check_can_continue()
    assert acc.num_groups == 0
    acc = GroupAccumulator(train_batch_size=2, metric=None)
    acc.add(_proto(*_groups("e", [[1, 1], [0, 0]])))
    assert acc.is_full() and len(acc.pop_train_batch()) == 4


def test_dapo_settings_validation() -> None:
    base = {"data": {"train_batch_size": 4, "gen_batch_size": 8},
            "algorithm": {"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 2}}}
    s = DapoSettings.from_config(OmegaConf.create(base))
    assert (s.train_batch_size, s.gen_batch_size, s.filter_metric, s.max_num_gen_batches) == (4, 8, "acc", 2)
    bad = OmegaConf.create(base)
    bad.algorithm.filter_groups.metric = None
    with pytest.raises(ValueError, match="needs algorithm.filter_groups.metric"):
        DapoSettings.from_config(bad)
    off = OmegaConf.create(base)
    off.algorithm.filter_groups.enable = False
    with pytest.raises(ValueError, match="only makes sense with algorithm.filter_groups.enable=True"):
        DapoSettings.from_config(off)
    off.data.gen_batch_size = 4
    assert DapoSettings.from_config(off).filter_metric is None


class _FakeRolloutWG:
    """Stands in for the actor/rollout worker group: 'generates' responses whose correctness is
    scripted per prompt (row ``i`` of a group is correct iff ``pattern[prompt][i]``)."""

    def __init__(self, patterns: dict[int, list[int]]) -> None:
        self.patterns = patterns
        self.generate_calls = 0
        self.updated: list = []

    def generate_sequences(self, gen_batch):
        import torch
        from verl import DataProto

        self.generate_calls += 1
        n = len(gen_batch)
        resp = torch.ones(n, RESP_LEN, dtype=torch.long)
        prompts = gen_batch.batch["input_ids"]
        return DataProto.from_dict(
            tensors={"responses": resp, "prompts": prompts,
                     "attention_mask": torch.ones(n, prompts.shape[1] + RESP_LEN, dtype=torch.long)},
            meta_info={"timing": {"generate_sequences": 0.01}})

    def load_checkpoint(self, *_a, **_k):
        return None


def _reward_fn(wg: _FakeRolloutWG):
    def fn(data, return_dict=False):
        import torch

        pid = data.batch["pid"][:, 0].tolist()
        correct, seen = [], {}
        for p in pid:
            k = seen.get(p, 0)
            seen[p] = k + 1
            correct.append(float(wg.patterns[p][k]))
        r = torch.zeros(len(data), RESP_LEN)
        r[:, -1] = torch.tensor(correct)
        return {"reward_tensor": r, "reward_extra_info": {"acc": correct}}
    return fn


def test_trainer_fit_dynamic_sampling(patched_imports) -> None:
    """The fit loop generates until the batch is full, trains on exactly train_batch_size whole groups,
    then errors past max_num_gen_batches -- with verl's real RayPPOTrainer helpers on CPU."""
    import torch

    from qwen3_rl.trainer.dapo import make_dapo_trainer_class
    from qwen3_rl.trainer.dynamic_sampling import DynamicSamplingError

    from helpers.dapo_probe import make_probe_trainer

    cls = make_dapo_trainer_class()
    n = 2
    # prompts 0..3 per dataloader batch of 2 prompts; informative iff responses differ
    patterns = {0: [1, 1], 1: [0, 1], 2: [1, 0], 3: [0, 0], 4: [1, 1], 5: [0, 0], 6: [0, 0], 7: [1, 1]}
    wg = _FakeRolloutWG(patterns)

    def batch_dict(pids: list[int]) -> dict:
        return {"input_ids": torch.tensor([[p, p] for p in pids]),
                "attention_mask": torch.ones(len(pids), 2, dtype=torch.long),
                "position_ids": torch.tensor([[0, 1]] * len(pids)),
                "pid": torch.tensor([[p] for p in pids]),
                "data_source": np.array(["t"] * len(pids), dtype=object)}

    trained: list[list[int]] = []

    class _Pool:
        def get_n_gpus(self) -> int:
            return 1

    # the PPO update itself is verl's worker RPCs: record what it receives
    # batches: [0,1] -> 1 informative; [2,3] -> 1 more: full -> step 1 on prompts 1,2
    #          [4,5] -> 0 informative; [6,7] -> 0: 2 batches, budget spent -> error
    t = make_probe_trainer(cls, n=n, resp_len=RESP_LEN, actor_rollout_wg=wg, reward_fn=_reward_fn(wg),
                           resource_pool_manager=_Pool(), total_training_steps=10, response_mask=False,
                           on_update=lambda batch: trained.append(batch.batch["pid"][:, 0].tolist()),
                           train_dataloader=[batch_dict([0, 1]), batch_dict([2, 3]), batch_dict([4, 5]),
                                             batch_dict([6, 7])])
    with pytest.raises(DynamicSamplingError, match="0 of 2 prompt groups .* after 2 generation batches"):
        t.fit()
    assert trained == [[1, 1, 2, 2]]
    assert wg.generate_calls == 4 and t.global_steps == 2
