"""MOE_ALLTOALLV's trainer rank -> vLLM EP rank (``qwen3_rl.moe.alltoallv_verl091.vllm_ep_rank``) against verl
0.9.1's own weight-sync rank resolver (``vllm_rollout/utils.py:47-70``), for one- and multi-node replicas.

verl's server starts each node's vLLM workers with ``data_parallel_start_rank = node_rank * dp_local`` (dp_local =
GPUs per node / TP, ``vllm_async_server.py:388-396``); a worker of local index ``w`` binds the ZMQ rank verl's
resolver gives it, and its vLLM 0.23 EP rank is ``dp_rank * TP + tp_rank`` (``fused_moe/config.py:1081, 1205-1206``).
The trainer rank whose ``ServerAdapter`` connects to that ZMQ rank (same replica and node,
``vllm_rollout.py:81-83, 131-133``) must get that EP rank from :func:`vllm_ep_rank`, for every worker.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

# (TP, DP, GPUs per node): one node, several DP engines on a node, a replica over 2 and 4 nodes
LAYOUTS = [(1, 4, 4), (2, 2, 4), (2, 4, 4), (4, 8, 8), (4, 32, 16)]


@pytest.mark.parametrize(("tp", "dp", "gpn"), LAYOUTS)
def test_ep_rank_matches_the_vllm_worker_the_adapter_feeds(tp: int, dp: int, gpn: int) -> None:
    from verl.workers.rollout.vllm_rollout.utils import _resolve_vllm_weight_sync_local_rank

    from qwen3_rl.moe.alltoallv_verl091 import vllm_ep_rank

    world = tp * dp
    nodes, dp_local = world // gpn, gpn // tp
    ep_of_zmq: dict[tuple[int, int], int] = {}
    for node in range(nodes):
        for w in range(gpn):
            dp_local_rank, tp_rank = divmod(w, tp)
            dp_rank = node * dp_local + dp_local_rank
            pc = SimpleNamespace(
                tensor_parallel_size=tp,
                data_parallel_size=dp,
                data_parallel_size_local=dp_local,
                data_parallel_rank=dp_rank,
                data_parallel_rank_local=dp_local_rank,
            )
            zmq = _resolve_vllm_weight_sync_local_rank(w, pc)
            assert (node, zmq) not in ep_of_zmq  # one worker per ZMQ socket on a node
            ep_of_zmq[(node, zmq)] = dp_rank * tp + tp_rank
    assert sorted(ep_of_zmq.values()) == list(range(world))
    for rank in range(2 * world):  # two replicas
        rollout_rank = rank % world
        adapter = SimpleNamespace(
            rollout_rank=rollout_rank, node_rank=rollout_rank // gpn
        )  # vllm_rollout.py:81-83
        want = ep_of_zmq[(adapter.node_rank, rollout_rank % gpn)]
        assert vllm_ep_rank(adapter, tp, gpn) == want == rollout_rank
