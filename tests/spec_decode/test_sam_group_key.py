"""The SAM group key across DP ranks and data rebalance (issue 16 item 2).

The drafter's group key is ``group_key(prompt token ids)``, computed on each vLLM DP rank by the adapter
from the request's prompt in the runner (``SamRunnerDrafter.observe``). verl's sync rollout builds each
request's ``prompt_token_ids`` from its row (``raw_prompt_ids``, or the left-padded ``input_ids`` stripped
by verl's ``_pre_process_inputs``: ``vllm_rollout_spmd.py:323-346``), and data rebalance moves whole rows
(``DataProto.select_idxs``), so the key travels with the row: no verl change is needed. Here the real
patched verl ``DataProto`` path (``repeat(interleave=True)`` as the GRPO trainer, ``permute_for_rollout``,
``chunk`` as verl's dispatch, verl's own prompt extraction) feeds one ``SamRunnerDrafter`` per rank, and the
keys they assign are checked against the prompts' ``uid`` on every rank, after the permutation and after
its inverse.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
from qwen3_rl.spec_decode.sam import SamConfig, group_key
from qwen3_rl.spec_decode.sibling_exchange import group_key64

from helpers.fake_input_batch import FakeInputBatch

PAD = 0


def test_group_key_is_the_same_for_every_token_container() -> None:
    ids = [151644, 8948, 198, 2610, 525]
    k = group_key(ids)
    assert k == group_key(np.asarray(ids, np.int64)) == group_key(np.asarray(ids, np.int32))
    assert k != group_key(ids[:-1]) and group_key64(k) == group_key64(group_key(tuple(ids)))


def test_group_key_survives_data_rebalance_and_its_inverse(patched_imports: Path) -> None:
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import _pre_process_inputs

    from qwen3_rl.rollout.data_rebalance import restore_after_rollout
    from qwen3_rl.trainer.seam import permute_for_rollout

    num_prompts, n, dp, width = 6, 4, 4, 12
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, int(rng.integers(4, width))).tolist() for _ in range(num_prompts)]
    prompts[5] = list(prompts[4])  # a duplicate prompt: same key (its samples may draft from each other)
    ids = torch.full((num_prompts, width), PAD, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p)  # left padding, as verl's dataset
    base = DataProto.from_dict(
        tensors={"input_ids": ids},
        non_tensors={"uid": np.array([f"u{i}" for i in range(num_prompts)], dtype=object),
                     "raw_prompt_ids": np.array([list(p) for p in prompts] + [[]], dtype=object)[:-1]},
    )
    batch = base.repeat(repeat_times=n, interleave=True)  # ray_trainer: samples of a prompt adjacent
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 1}},
                            "qwen3_rl": {"data_rebalance": {"enable": True}},
                            "trainer": {"n_gpus_per_node": dp, "nnodes": 1}})  # rollout pieces: dp
    permuted, perm = permute_for_rollout(cfg, None, batch, n=n)
    assert perm is not None
    chunks = permuted.chunk(dp)  # verl's dispatch: piece k -> vLLM DP rank k
    key_of_uid: dict[str, str] = {}
    outs = []
    for rank, c in enumerate(chunks):
        uids = c.non_tensor_batch["uid"].tolist()
        assert len(set(uids)) == len(uids) > 1  # spread: each rank holds one sample of several prompts
        # the request's prompt_token_ids as verl's rollout builds them (vllm_rollout_spmd.py:323-346)
        from_raw = [list(x) for x in c.non_tensor_batch["raw_prompt_ids"]]
        from_ids = [list(_pre_process_inputs(PAD, c.batch["input_ids"][i])) for i in range(len(c))]
        assert [[int(t) for t in x] for x in from_ids] == from_raw
        # the rank's SAM adapter assigns the group from the runner's prompt
        sam = SamRunnerDrafter(SamConfig(num_speculative_tokens=3, group_mode=True, group_exchange=True), 256)
        rids = [f"r{rank}-{i}" for i in range(len(c))]
        sam.observe(FakeInputBatch.from_prompts(from_raw, rids), {r: None for r in rids}, None)
        for r, u in zip(rids, uids, strict=True):
            g = sam.drafter._reqs[r].group
            assert key_of_uid.setdefault(u, g) == g, (rank, u)  # the same key on every rank
            assert sam.exchange is not None and sam.exchange._key_group[group_key64(g)] == g
        outs.append(DataProto.from_dict(non_tensors={"key": np.array([sam.drafter._reqs[r].group for r in rids],
                                                                     dtype=object),
                                                     "uid": np.array(uids, dtype=object)}))
    assert len(key_of_uid) == num_prompts
    assert len(set(key_of_uid.values())) == num_prompts - 1  # u4 and u5: identical prompts
    assert key_of_uid["u4"] == key_of_uid["u5"]
    # the inverse: after generation the rows come back in dataset order, each with its prompt's key
    restored = restore_after_rollout(DataProto.concat(outs), perm)
    assert restored.non_tensor_batch["uid"].tolist() == batch.non_tensor_batch["uid"].tolist()
    assert restored.non_tensor_batch["key"].tolist() == [key_of_uid[u] for u in batch.non_tensor_batch["uid"]]
    assert restored.non_tensor_batch["key"].tolist() == [group_key(p) for p in prompts for _ in range(n)]


def test_a_resumed_request_stays_in_its_siblings_group() -> None:
    """A request resumed after a weight sync (fully-async partial rollout) comes back as a new vLLM request whose
    prompt is the original prompt + its response so far; ``extra_args[GROUP_PROMPT_LEN_KEY]`` names the original
    prompt's length and the drafter puts it in the siblings' group. Without it (positive control) it gets a group
    of its own."""
    from types import SimpleNamespace

    from qwen3_rl.spec_decode.runner_drafter import GROUP_PROMPT_LEN_KEY, group_prompt_len

    prompt = [5, 6, 7, 8]
    resumed = prompt + [9, 10, 11]
    state = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={GROUP_PROMPT_LEN_KEY: len(prompt)}))
    assert group_prompt_len(state, len(resumed)) == len(prompt)
    assert group_prompt_len(None, 7) == 7 and group_prompt_len(SimpleNamespace(sampling_params=None), 7) == 7
    sam = SamRunnerDrafter(SamConfig(num_speculative_tokens=3, group_mode=True), 256)
    rids = ["sibling", "resumed", "unmarked"]
    live = {"sibling": None, "resumed": state, "unmarked": None}
    sam.observe(FakeInputBatch.from_prompts([prompt, resumed, resumed], rids), live, None)
    groups = {r: sam.drafter._reqs[r].group for r in rids}
    assert groups["resumed"] == groups["sibling"] == group_key(prompt)
    assert groups["unmarked"] == group_key(resumed) != groups["sibling"]
