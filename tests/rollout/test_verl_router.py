"""Group routing as verl 0.9.1's router plugin (``qwen3_rl.rollout.verl_router``, current set).

Unit tests on the balancer alone, then verl 0.9.1's own ``get_router_handle`` and ``LLMServerClient.generate`` (the
current set's patched verl tree, in the verl 0.9.1 venv, local Ray on 127.0.0.1: ``helpers/verl091_router_driver.py``)
with verl's default balancer as the control: it splits a prompt's samples over the servers, the plugin does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen3_rl.rollout.server_routing import routing_metrics
from qwen3_rl.rollout.verl_dp_rank import RankedServerHandle
from qwen3_rl.rollout.verl_router import GroupRoutingBalancer, parse_router_config

from conftest import REPO
from helpers.current_verl import patched_verl, run_in_venv

SERVERS = {"10.0.0.2:8000": "handle-b", "10.0.0.1:8000": "handle-a"}


def test_siblings_share_a_server_and_the_load_spreads() -> None:
    lb = GroupRoutingBalancer(SERVERS, {"router_class": "x"})
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    got: dict[int, set[str]] = {}
    for s in range(4):  # interleaved, as concurrent agent-loop workers send them
        for p, prompt in enumerate(prompts):
            sid, handle = lb.acquire_server(f"r{p}-{s}", prompt_ids=prompt)
            assert handle == SERVERS[sid]
            got.setdefault(p, set()).add(sid)
    assert all(len(v) == 1 for v in got.values())
    per_server = [sum(1 for v in got.values() if sid in v) for sid in sorted(SERVERS)]
    assert per_server == [2, 2]
    assert lb.get_total_inflight() == 16 and sum(lb.get_status()["servers"].values()) == 16


def test_batch_ends_when_nothing_is_in_flight_and_counts_add_up() -> None:
    lb = GroupRoutingBalancer(SERVERS)
    for i in range(3):
        lb.acquire_server(f"a{i}", prompt_ids=[7, 7])
    assert lb.take_routing_counts() == {}  # the batch is still running
    for i in range(3):
        sid = lb._in_flight[f"a{i}"]
        lb.release_server(sid, request_id=f"a{i}")
    counts = lb.take_routing_counts()
    assert (
        counts["routing_requests"] == 3
        and counts["routing_sibling_pairs"] == counts["routing_sibling_pairs_same"] == 3
    )
    assert routing_metrics(counts)["rollout/routing/sibling_same_engine"] == 1.0
    assert lb.get_total_inflight() == 0 and lb.take_routing_counts() == {}
    # the next batch: the same prompt again counts as a revisit, not as a sibling of the first batch's samples
    lb.acquire_server("b0", prompt_ids=[7, 7])
    lb.clear_sticky_cache()
    assert lb.take_routing_counts()["routing_revisits"] == 1


def test_a_later_turn_keeps_its_server_and_is_no_new_sample() -> None:
    lb = GroupRoutingBalancer(SERVERS)
    first, _ = lb.acquire_server("conv", prompt_ids=[1, 2])
    lb.release_server(first, request_id="conv")
    for k in range(6):  # other prompts fill the pool in between
        lb.acquire_server(f"x{k}", prompt_ids=[100 + k])
    again, _ = lb.acquire_server("conv", prompt_ids=[1, 2, 55, 66])
    assert again == first
    lb.clear_sticky_cache()  # stickiness dropped: a new turn is placed by its prompt
    assert lb.take_routing_counts()["routing_sibling_pairs"] == 0


def test_pool_changes_and_errors() -> None:
    lb = GroupRoutingBalancer({})
    with pytest.raises(RuntimeError, match="No available servers"):
        lb.acquire_server("r", prompt_ids=[1])
    lb.add_servers(SERVERS)
    assert lb.get_all_servers() == sorted(SERVERS)
    with pytest.raises(ValueError, match="needs prompt_ids"):
        lb.acquire_server("r")
    lb.remove_servers(["10.0.0.1:8000"])
    assert {lb.acquire_server(f"r{i}", prompt_ids=[i])[0] for i in range(5)} == {"10.0.0.2:8000"}
    assert lb.require_acquire_fields() == ["prompt_ids"] and lb.require_release_fields() == ["request_id"]


class _Method:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def remote(self, **kwargs: object) -> str:
        self.calls.append(kwargs)
        return "ref"


class _Handle:
    """A server's actor handle as the balancer holds it: only ``generate.remote`` is called on what it returns."""

    def __init__(self) -> None:
        self.generate = _Method()


def test_dp_ranks_siblings_share_server_and_rank_and_the_handle_carries_it() -> None:
    handles = {"10.0.0.1:8000": _Handle(), "10.0.0.2:8000": _Handle()}
    lb = GroupRoutingBalancer(handles, {"data_parallel_size": 2})
    where: dict[int, set[tuple[str, int]]] = {}
    for s in range(3):
        for p in range(4):
            sid, h = lb.acquire_server(f"r{p}-{s}", prompt_ids=[p, p + 1])
            assert isinstance(h, RankedServerHandle) and h.handle is handles[sid]
            where.setdefault(p, set()).add((sid, h.rank))
            assert h.generate.remote(request_id="x") == "ref"
            assert handles[sid].generate.calls[-1] == {"data_parallel_rank": h.rank, "request_id": "x"}
    assert all(len(v) == 1 for v in where.values())
    assert sorted(next(iter(v)) for v in where.values()) == [
        (sid, r) for sid in sorted(handles) for r in (0, 1)
    ]
    # a later turn keeps its server and rank
    sid, h = lb.acquire_server("r2-0", prompt_ids=[9, 9, 9])
    assert (sid, h.rank) == next(iter(where[2]))
    # control: one rank per server (YAML 1, or a server without get_rollout_config): the plain handle, no rank
    for cfg in ({"data_parallel_size": 1}, {}):
        sid, h = GroupRoutingBalancer(handles, cfg).acquire_server("q", prompt_ids=[1])
        assert h is handles[sid]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"slack": "2"}, "slack must be an integer"),
        ({"slack": -1}, "slack >= 0"),
        ({"max_prompts": True}, "max_prompts must be an integer"),
        ({"slak": 1}, r"unknown key\(s\) \['slak'\]"),
        ({"data_parallel_size": -1}, "data_parallel_size >= 1"),
    ],
)
def test_bad_router_config_stops_with_one_line(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_router_config(config)
    assert "\n" not in str(err.value)


def test_router_plugin_in_verl091s_factory_and_client(tmp_path: Path) -> None:
    tree = patched_verl(tmp_path / "verl")
    router_yaml = tmp_path / "router.yaml"
    router_yaml.write_text("router_class: qwen3_rl.rollout.verl_router.GroupRoutingBalancer\nslack: 0\n")
    out = tmp_path / "out.json"
    proc = run_in_venv(
        [str(REPO / "tests" / "helpers" / "verl091_router_driver.py"), str(out), str(router_yaml)],
        path=[tree, REPO],
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"driver exit {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    res = json.loads(out.read_text())
    n_prompts, n_samples = 4, 4
    for run in ("default", "group"):
        r = res[run]
        assert len(r["batches"]) == 2 and r["inflight_after"] == 0
        for batch in r["batches"]:
            assert [len(b) for b in batch] == [n_samples] * n_prompts
        assert r["turns"][0] == r["turns"][1]  # a conversation's second turn on its first turn's server
    # control: verl's own least-in-flight balancer splits every prompt's samples over both servers
    assert res["default"]["fields"] == []
    assert all(len(set(b)) == 2 for batch in res["default"]["batches"] for b in batch)
    # the plugin: verl's client hands it the prompt; every prompt's samples on one server, two prompts per server
    assert res["group"]["fields"] == ["prompt_ids"]
    for batch in res["group"]["batches"]:
        assert all(len(set(b)) == 1 for b in batch)
        assert sorted(b[0] for b in batch) == [0, 0, 1, 1]
    counts = res["group"]["counts"]
    pairs = 2 * n_prompts * n_samples * (n_samples - 1) // 2
    assert counts["routing_sibling_pairs"] == counts["routing_sibling_pairs_same"] == pairs
    assert counts["routing_verl_sibling_pairs_same"] < pairs
