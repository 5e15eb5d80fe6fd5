"""Group routing for verl's server rollout (qwen3_rl.rollout.server_routing) and its seam hooks."""

from __future__ import annotations

import json
import random

import pytest

from qwen3_rl.rollout.server_routing import GroupRouter, VerlLeastAssigned, prompt_key, routing_metrics


def _grpo_requests(prompts: int, n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """``prompts`` x ``n`` requests as verl's agent loop sends them: one request id per sample, a prompt's
    samples adjacent (``DataProto.repeat(n, interleave=True)``)."""
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        ids = [rng.randrange(1, 500) for _ in range(rng.randrange(5, 40))]
        out += [(f"req-{p}-{s}", ids) for s in range(n)]
    return out


def test_prompt_key_is_the_sam_group_key() -> None:
    from qwen3_rl.spec_decode.sam import group_key

    for ids in ([1, 2, 3], [70000, 5], list(range(300))):
        assert prompt_key(ids) == group_key(ids)
    assert prompt_key([1, 2]) != prompt_key([2, 1])


def test_siblings_share_an_engine_and_load_stays_within_slack() -> None:
    r = GroupRouter(3, slack=8)
    reqs = _grpo_requests(prompts=12, n=8)
    chosen = {rid: r.choose(rid, ids) for rid, ids in reqs}
    for p in range(12):
        assert len({chosen[f"req-{p}-{s}"] for s in range(8)}) == 1
    # nothing finished yet: every prompt went to an engine within slack of the least busy one
    assert max(r.in_flight) - min(r.in_flight) <= 8 + 8 and sum(r.in_flight) == 96
    # slack 0: the least busy engine always (ties by the prompt's rendezvous rank)
    r0 = GroupRouter(3, slack=0)
    for rid, ids in reqs:
        r0.choose(rid, ids)
    assert r0.in_flight == [32, 32, 32]


def test_a_prompt_returns_to_its_engine_in_later_batches_also_from_another_router() -> None:
    """The rendezvous choice is a function of the prompt: a second router (another agent-loop worker, which shares
    no state) and a later batch of the same router put the prompt on the same engine while loads allow."""
    reqs = _grpo_requests(prompts=6, n=4)
    a, b = GroupRouter(4, slack=100), GroupRouter(4, slack=100)
    first = {rid: a.choose(rid, ids) for rid, ids in reqs}
    for rid, _ in reqs:
        a.done(rid, 5)
    a.take_counts()  # batch boundary
    again = {rid: a.choose(rid + "-next", ids) for rid, ids in reqs}
    other = {rid: b.choose(rid + "-other", ids) for rid, ids in reqs}
    assert again == first == other
    c = a.take_counts()
    assert c["routing_revisits"] == 6 and c["routing_revisits_same"] == 6
    # an overloaded preferred engine is not taken: with slack 0, busy engines are skipped
    busy = GroupRouter(2, slack=0)
    pref = busy.choose("x", [1, 2, 3])
    assert busy.choose("y", [1, 2, 3]) == pref  # a sibling follows whatever the load
    busy.take_counts()
    assert busy.choose("z", [1, 2, 3]) != pref  # next batch: 2 in flight there, 0 on the other


def test_dp_ranks_are_engines_of_their_server() -> None:
    r = GroupRouter(2, dp=4, slack=0)
    targets = {r.choose(f"r{p}", [p, p + 1]) for p in range(8)}
    assert targets == set(range(8))  # 8 prompts spread over 2 servers x 4 DP ranks
    c = r.take_counts()
    assert sum(c[f"routing_requests_s{t}"] for t in range(8)) == 8
    # verl's replay: 2 servers by assignment count, then vLLM's DP balancer inside each: all 8 engines used
    assert [c[f"routing_verl_requests_s{t}"] for t in range(8)] == [1] * 8


def test_counts_ours_against_verl_replayed_on_the_same_requests() -> None:
    r = GroupRouter(2)
    for rid, ids in _grpo_requests(prompts=4, n=8):
        r.choose(rid, ids)
        r.done(rid, response_tokens=len(ids))
    c = r.take_counts()
    assert c["routing_requests"] == 32
    assert c["routing_sibling_pairs"] == 4 * 28
    assert c["routing_sibling_pairs_same"] == 4 * 28  # ours: every pair on one engine
    # verl: least-assigned per request id alternates the two servers, 4 + 4 samples of each prompt
    assert c["routing_verl_sibling_pairs_same"] == 4 * 2 * 6
    assert c["routing_requests_s0"] + c["routing_requests_s1"] == 32
    assert c["routing_verl_requests_s0"] == c["routing_verl_requests_s1"] == 16
    m = routing_metrics(c)
    assert m["rollout/routing/sibling_same_engine"] == 1.0
    assert m["rollout/routing/verl_sibling_same_engine"] == pytest.approx(48 / 112)
    assert m["rollout/routing/verl_load_spread_requests"] == 1.0
    assert "rollout/routing/history_same_engine" not in m  # no prompt came back
    # counts are reset by take_counts
    assert r.take_counts()["routing_requests"] == 0


def test_verl_replay_matches_verls_policy() -> None:
    """Sticky per request id, else fewest assigned so far."""
    v = VerlLeastAssigned(3)
    assert [v.choose(f"r{i}") for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert v.choose("r1") == 1 and v.assigned == [2, 2, 2]


def test_same_request_id_keeps_its_engine_and_forgotten_prompts_are_placed_anew() -> None:
    r = GroupRouter(2, max_keys=1)
    a = r.choose("a", [1, 2, 3])
    assert r.choose("a", [1, 2, 3]) == a  # multi-turn: same request id, same engine (verl's stickiness)
    r.choose("b", [4, 5])  # evicts [1, 2, 3]
    assert list(r.target_of_key) == [prompt_key([4, 5])]
    r.take_counts()
    r.choose("c", [1, 2, 3])  # forgotten: placed as a new prompt, not counted as a revisit
    assert r.take_counts()["routing_revisits"] == 0


def test_routing_metrics_of_summed_counts_and_empty() -> None:
    assert routing_metrics({}) == {}
    assert routing_metrics({"routing_requests": 0}) == {}
    c1 = GroupRouter(2)
    c2 = GroupRouter(2)
    for r, reqs in ((c1, _grpo_requests(2, 4, seed=1)), (c2, _grpo_requests(2, 4, seed=2))):
        for rid, ids in reqs:
            r.choose(rid, ids)
            r.done(rid, 3)
    from qwen3_rl.spec_decode.metrics import merge_counts

    total = merge_counts(c1.take_counts(), c2.take_counts())
    m = routing_metrics(total)
    assert m["rollout/routing/requests"] == 16
    assert m["rollout/routing/sibling_same_engine"] == 1.0
    assert m["rollout/routing/load_spread_tokens"] == pytest.approx(1.0)


def test_router_refuses_no_servers() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        GroupRouter(0)
    with pytest.raises(ValueError, match="slack"):
        GroupRouter(1, slack=-1)


# ---- the seam's server hooks (qwen3_rl.trainer.seam.ServerHooks) ---------------------------------------


class _Handle:
    def __init__(self, name: str) -> None:
        self.name = name
        self._actor_id = bytes.fromhex(name)

    def __repr__(self) -> str:
        return f"H({self.name})"


class _Manager:
    """What ServerHooks reads of verl's AsyncLLMServerManager: its (shuffled) handles and _choose_server."""

    def __init__(self, handles: list[_Handle]) -> None:
        self.server_handles = handles
        self.calls: list[str] = []

    def _choose_server(self, request_id: str) -> _Handle:
        self.calls.append(request_id)
        return self.server_handles[len(self.calls) % len(self.server_handles)]


def _hooks(group: dict) -> object:
    from qwen3_rl.trainer.seam import ServerHooks

    return ServerHooks.from_rollout_config({"qwen3_rl": group})


def test_server_hooks_route_by_prompt_in_an_order_every_worker_shares() -> None:
    from qwen3_rl.trainer.seam import DP_RANK_KEY, ROUTING_META_KEY

    handles = [_Handle("bb"), _Handle("aa"), _Handle("cc")]
    seen = []
    for order in (handles, list(reversed(handles))):  # two workers, each with its own shuffle
        hooks = _hooks({"server_routing": {"enable": True}})
        mgr = _Manager(order)
        params = {"temperature": 1.0}
        routed = [hooks.route(mgr, f"r{i}", [7, 7, i // 4], params) for i in range(8)]
        assert mgr.calls == [] and params == {"temperature": 1.0}  # verl's choice not asked, its dict untouched
        assert all(sp == {"temperature": 1.0, DP_RANK_KEY: 0} for _, sp in routed)
        got = [h for h, _ in routed]
        assert got[0] is got[3] and got[4] is got[7]  # siblings together
        seen.append([h.name for h in got])
        for i in range(8):
            hooks.request_done(f"r{i}", type("O", (), {"token_ids": [1, 2, 3]})())
        meta = hooks.worker_meta()
        assert sum(v for k, v in meta[ROUTING_META_KEY].items() if k.startswith("routing_tokens_s")) == 24
    assert seen[0] == seen[1]  # the same prompts on the same servers whatever a worker's shuffle


def test_server_hooks_without_routing_ask_verl_and_report_nothing() -> None:
    hooks = _hooks({"spec_decode_metrics": {"enable": True}})
    mgr = _Manager([_Handle("aa"), _Handle("bb")])
    params = {"temperature": 1.0}
    server, got = hooks.route(mgr, "r0", [1], params)
    assert server is mgr.server_handles[1] and got is params
    assert mgr.calls == ["r0"]
    assert hooks.worker_meta() == {}


def test_server_hooks_carry_the_dp_rank_to_the_engine_call() -> None:
    """With vLLM DP inside each server (expert parallel on), the route picks a DP rank too; the server pops it
    from the request's parameters into AsyncLLM.generate(data_parallel_rank=...)."""
    from qwen3_rl.trainer.seam import DP_RANK_KEY, server_dp_size

    cfg = {"data_parallel_size": 4, "expert_parallel_size": 16, "qwen3_rl": {"server_routing": {"enable": True,
                                                                                                  "slack": 0}}}
    assert server_dp_size(cfg) == 4 and server_dp_size({"data_parallel_size": 4, "expert_parallel_size": 1}) == 1
    from qwen3_rl.trainer.seam import ServerHooks

    hooks = ServerHooks.from_rollout_config(cfg)
    mgr = _Manager([_Handle("aa")])
    ranks = [hooks.route(mgr, f"r{p}", [p], {})[1][DP_RANK_KEY] for p in range(4)]
    assert sorted(ranks) == [0, 1, 2, 3]
    server_side = {"temperature": 0.5, DP_RANK_KEY: 3}
    assert hooks.request_kwargs(server_side) == {"data_parallel_rank": 3} and server_side == {"temperature": 0.5}
    assert hooks.request_kwargs({"temperature": 0.5}) == {}


def test_server_hooks_after_generate_pops_worker_counts_for_the_trainer() -> None:
    from qwen3_rl.spec_decode.metrics import META_KEY
    from qwen3_rl.trainer.seam import ROUTING_META_KEY, RecipeConfig, TrainerHooks, pop_rollout_counts

    hooks = _hooks({"server_routing": {"enable": True}})
    outs = [type("Out", (), {"meta_info": {ROUTING_META_KEY: {"routing_requests": 3, "routing_sibling_pairs": 3,
                                                                "routing_sibling_pairs_same": 3}}})()
            for _ in range(2)]
    metrics = hooks.after_generate([], None, outs)
    assert all(ROUTING_META_KEY not in o.meta_info for o in outs)
    assert metrics[f"{META_KEY}/routing_requests"] == 6
    counts = pop_rollout_counts({"metrics": metrics})
    trainer = TrainerHooks({}, RecipeConfig.from_group({"server_routing": {"enable": True}}))
    step = trainer.step_metrics(counts)
    assert step["rollout/routing/sibling_same_engine"] == 1.0
    assert not any(k.startswith("rollout/spec_decode/") for k in step)


def test_server_routing_config_is_validated() -> None:
    from qwen3_rl.trainer.seam import SeamConfigError

    with pytest.raises(SeamConfigError, match=r"qwen3_rl.server_routing.enable must be bool"):
        _hooks({"server_routing": {"enable": "yes"}})
    with pytest.raises(SeamConfigError, match=r"qwen3_rl.server_routing: max_prompts must be >= 1"):
        _hooks({"server_routing": {"enable": True, "max_prompts": 0}})


def test_server_auth_adds_a_fresh_key_and_masks_it_when_printed() -> None:
    a, b = _hooks({"server_routing": {"enable": True}}), _hooks({"server_routing": {"enable": True}})
    args = {"dtype": "float32", "max_model_len": 160}
    got_a, got_b = a.server_args(args), b.server_args(args)
    assert args == {"dtype": "float32", "max_model_len": 160}  # input untouched
    assert got_a["api_key"] == a.api_key and got_b["api_key"] == b.api_key
    assert a.api_key != b.api_key and len(a.api_key) == 64  # one per server: 32 random bytes, hex
    cli = ["serve", "/m", "--api_key", a.api_key, "--dtype", "float32"]
    assert a.printable(cli) == ["serve", "/m", "--api_key", "***", "--dtype", "float32"]
    assert cli[3] == a.api_key  # the arguments vLLM parses keep the key
    # switched off: no key, nothing masked
    off = _hooks({"server_auth": {"enable": False}})
    assert off.server_args(args) == args and off.api_key is None


def test_disable_gc_reaches_the_servers_engine_cores_through_additional_config() -> None:
    # DISABLE_GC_IN_ENGINE_STEP in server mode: the server's vLLM arguments carry the policy to its engine core
    # processes (gc_control.configure_from_vllm_config reads it there), merged into an existing additional_config
    from omegaconf import OmegaConf

    from qwen3_rl.rollout.gc_control import ENGINE_CONFIG_KEY

    on = _hooks({"disable_gc": {"enable": True}, "server_auth": {"enable": False}})
    assert on.server_args({"dtype": "float32"}) == {
        "dtype": "float32", "additional_config": {ENGINE_CONFIG_KEY: {"disable_gc": True}}}
    kept = on.server_args({"additional_config": OmegaConf.create({"ascend_scheduler_config": {"enabled": True}})})
    assert kept["additional_config"] == {"ascend_scheduler_config": {"enabled": True},
                                         ENGINE_CONFIG_KEY: {"disable_gc": True}}
    assert json.loads(json.dumps(kept["additional_config"])) == kept["additional_config"]  # plain, as verl dumps it
    assert on.server_args({"additional_config": '{"a": 1}'})["additional_config"] == {
        "a": 1, ENGINE_CONFIG_KEY: {"disable_gc": True}}
    off = _hooks({"disable_gc": {"enable": False}, "server_auth": {"enable": False}})
    assert off.server_args({"dtype": "float32"}) == {"dtype": "float32"}


def test_rollout_rebalance_settings_reach_the_servers_dp_engine_cores() -> None:
    # ROLLOUT_REBALANCE in server mode: the server's vLLM arguments carry the settings to each DP engine core
    # (additional_config.qwen3_rl.rollout_rebalance), where core_settings reads back the same RebalanceSettings
    # (after verl's json dump of the argument); merged with the gc policy; off: nothing added
    from types import SimpleNamespace

    from qwen3_rl.rollout.gc_control import ENGINE_CONFIG_KEY
    from qwen3_rl.rollout.rebalance import RebalanceSettings
    from qwen3_rl.rollout.vllm_engine_hook import core_settings

    group = {"rollout_rebalance": {"enable": True, "interval_steps": 4, "max_moves": 3},
             "disable_gc": {"enable": True}, "server_auth": {"enable": False}}
    args = _hooks(group).server_args({"dtype": "float32"})
    extra = json.loads(json.dumps(args["additional_config"]))
    assert extra[ENGINE_CONFIG_KEY]["disable_gc"] is True
    got = core_settings(SimpleNamespace(additional_config=extra))
    assert got == RebalanceSettings(enable=True, interval_steps=4, max_moves=3)
    off = _hooks({"rollout_rebalance": {"enable": False}, "server_auth": {"enable": False}})
    assert off.server_args({"dtype": "float32"}) == {"dtype": "float32"}


def test_rollout_hooks_worker_call_switches_gc_off_for_model_steps_only() -> None:
    # verl's hybrid worker in server mode (vLLMAsyncRollout): each call of the server's engine core runs inside
    # worker_call; with disable_gc on, the collector is off during execute_model / sample_tokens and restored after
    # (also when the call raises); other calls and the feature off leave it alone
    import gc

    from qwen3_rl.trainer.seam import RolloutHooks

    on = RolloutHooks.from_rollout_config({"qwen3_rl": {"disable_gc": {"enable": True}}})
    off = RolloutHooks.from_rollout_config({"qwen3_rl": {"disable_gc": {"enable": False}}})
    assert gc.isenabled()
    for method in ("execute_model", "sample_tokens"):
        with on.worker_call(None, method):
            assert not gc.isenabled()
        assert gc.isenabled()
    with pytest.raises(RuntimeError), on.worker_call(None, "execute_model"):
        raise RuntimeError("step failed")
    assert gc.isenabled()
    for hooks, method in ((on, "collective_rpc_fn"), (on, b"pickled"), (off, "execute_model")):
        with hooks.worker_call(None, method):
            assert gc.isenabled()


def test_server_auth_key_parses_as_the_value_of_api_key() -> None:
    """verl passes the key to vLLM's argparse as ``--api_key <key>``: a value starting with "-" is read as an option
    ("argument --api-key: expected at least one argument", seen once in a fully-async CPU run with url-safe keys).
    Every key made parses as the option's value; positive control: a url-safe-shaped key starting with "-" fails."""
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--api-key", "--api_key", nargs="+")
    parser.add_argument("--dtype")
    for _ in range(2000):  # a url-safe key would start with "-" ~31 times in 2000
        h = _hooks({"server_routing": {"enable": True}})
        h.server_args({})
        assert parser.parse_args(["--api_key", h.api_key, "--dtype", "float32"]).api_key == [h.api_key]
    with pytest.raises(argparse.ArgumentError, match="expected at least one argument"):
        parser.parse_args(["--api_key", "-Xq3" + "a" * 39, "--dtype", "float32"])



# ---- issue 42, finding 8: resumed requests, verl's replayed request-id memory ----------------------------


def test_a_resumed_request_stays_on_its_siblings_engine() -> None:
    """A partial rollout aborted at a weight sync is sent again as its prompt plus its response so far, with the
    prompt's length under GROUP_PROMPT_LEN_KEY (fully-async agent loop). Under SERVER_ROUTING it goes back to its
    siblings' engine in the next batch, even when that engine is the busiest; control: routed by a hash of prompt
    plus response (what the router did before), most resumes land elsewhere."""
    from qwen3_rl.spec_decode.runner_drafter import GROUP_PROMPT_LEN_KEY

    handles = [_Handle("aa"), _Handle("bb"), _Handle("cc"), _Handle("dd")]
    hooks = _hooks({"server_routing": {"enable": True}})
    control = _hooks({"server_routing": {"enable": True}})
    reqs = _grpo_requests(40, 4, seed=3)
    engine_of: dict[str, object] = {}
    for h in (hooks, control):
        mgr = _Manager(list(handles))
        for rid, ids in reqs:  # batch 0: every sample placed; none finishes (all in flight at the sync)
            server, _ = h.route(mgr, rid, ids, {})
            engine_of.setdefault(f"{id(h)}/{rid}", server)
        for rid, _ in reqs:  # the sync aborts them all: their answers come back (3 tokens each)
            h.request_done(rid, type("Out", (), {"token_ids": [7, 8, 9]})())
        h.worker_meta()  # the worker's call ends: the next requests are a new batch
    rng = random.Random(4)
    moved = kept = 0
    for rid, ids in reqs[::3]:
        resp = [rng.randrange(1, 500) for _ in range(5)]
        server, params = hooks.route(_Manager(list(handles)), rid, ids + resp, {GROUP_PROMPT_LEN_KEY: len(ids)})
        assert server is engine_of[f"{id(hooks)}/{rid}"], rid
        assert params[GROUP_PROMPT_LEN_KEY] == len(ids)  # the server still needs it (the drafter's group)
        kept += 1
        old, _ = control.route(_Manager(list(handles)), rid + "-ctl", ids + resp, {})
        moved += old is not engine_of[f"{id(control)}/{rid}"]
    counts = hooks.worker_meta()
    from qwen3_rl.trainer.seam import ROUTING_META_KEY

    assert counts[ROUTING_META_KEY]["routing_sibling_pairs"] == 0  # resumes are no new siblings
    assert counts[ROUTING_META_KEY]["routing_revisits"] == 0  # nor a prompt's later visit
    print(f"resumed on their siblings' engine {kept} of {kept}; by a hash of prompt + response {kept - moved} "
          f"of {kept}")
    assert moved >= kept // 2, (moved, kept)


def test_verl_replay_remembers_request_ids_as_verl_does() -> None:
    """verl's AsyncLLMServerManager keeps request id -> server in an LRU of 10000 (max_cache_size): the replay
    is sticky for a request sent again under its id while remembered, and its memory stays bounded (it grew
    with every request before)."""
    from qwen3_rl.rollout.server_routing import VERL_MAX_CACHE_SIZE

    assert VERL_MAX_CACHE_SIZE == 10_000
    v = VerlLeastAssigned(3, max_ids=4)
    first = [v.choose(f"r{i}") for i in range(4)]
    assert v.choose("r0") == first[0]  # still remembered: sticky, and now the most recent
    for i in range(4, 40):
        v.choose(f"r{i}")
    assert len(v.by_request) == 4 and list(v.by_request) == ["r36", "r37", "r38", "r39"]
    r = GroupRouter(2)
    for i in range(VERL_MAX_CACHE_SIZE + 500):
        r.choose(f"q{i}", [i % 7, 1])
        r.done(f"q{i}", 1)
    assert len(r.shadow.by_request) == VERL_MAX_CACHE_SIZE and not r._placed
