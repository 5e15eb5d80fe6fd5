"""Engine-loop hook of the SAM sibling exchange (vllm patch 0006 + ``qwen3_rl.spec_decode.exchange_hook``).

* The patched ``LLMEngine.step`` (pinned vLLM 0.13.0 tree, executed on an ``object.__new__`` engine with
  stand-in engine core and hooks) calls the hook after a dummy step and after a real step, once each.
* In 2 gloo processes, ``SiblingExchangeHook.after_step`` drives the exchange between two
  ``SamRunnerDrafter`` s fed through a stand-in persistent batch (the runner's ``token_ids_cpu`` /
  ``num_tokens_no_spec`` layout): the rank that is behind drafts its sibling's next tokens, the rank that
  finished first keeps calling the hook (dummy steps) in lockstep, and both release everything.
* Switch and config checks: off by default, ``group_exchange`` without ``group_mode`` refused, preflight
  refuses it without SAM, group mode or vLLM DP > 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qwen3_rl.spec_decode.config import parse_sam_options
from qwen3_rl.spec_decode.exchange_hook import SiblingExchangeHook, exchange_enabled, find_sam_drafter
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
from qwen3_rl.spec_decode.sam import SamConfig

from helpers.fake_input_batch import FakeInputBatch

K = 3
R = "actor_rollout_ref.rollout."


def _engine(sam: SamRunnerDrafter | None, sam_config: dict | None) -> SimpleNamespace:
    spec = SimpleNamespace(method="sam", drafter_config=sam_config) if sam_config is not None else None
    runner = SimpleNamespace(drafter=SimpleNamespace(sam=sam) if sam is not None else None)
    core = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
        worker=SimpleNamespace(model_runner=runner))))
    return SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec),
                           engine_core=SimpleNamespace(engine_core=core))


def test_switch_and_config_checks() -> None:
    assert SamConfig().group_exchange is False
    opts = parse_sam_options({"group_mode": True, "group_exchange": True, "exchange_every": 2}, K)
    assert opts.group_exchange and opts.exchange_every == 2 and opts.exchange_max_bytes == 16384
    with pytest.raises(ValueError, match="needs group_mode=True"):
        parse_sam_options({"group_exchange": True})
    with pytest.raises(ValueError, match="exchange_every"):
        parse_sam_options({"group_mode": True, "group_exchange": True, "exchange_every": 0})
    with pytest.raises(ValueError, match="must be bool"):
        parse_sam_options({"group_mode": True, "group_exchange": "yes"})
    # off: the hook resolves to nothing and never touches a process group
    off = SiblingExchangeHook(_engine(SamRunnerDrafter(SamConfig(num_speculative_tokens=K, group_mode=True), 512), {"group_mode": True}),
                              group_factory=lambda: pytest.fail("no group when off"))
    for _ in range(3):
        off.after_step()
    assert not off.enabled and off.steps == 0
    assert not exchange_enabled(SimpleNamespace(speculative_config=None))
    # on, but no in-process SAM drafter reachable: a clear error, not a silent no-op
    with pytest.raises(RuntimeError, match="in-process engine"):
        SiblingExchangeHook(_engine(None, {"group_mode": True, "group_exchange": True})).after_step()
    sam = SamRunnerDrafter(opts, 512)
    assert find_sam_drafter(_engine(sam, {})) is sam and sam.exchange is not None
    assert sam.drafter.max_shadows_per_group == 7 and sam.drafter.max_shadow_tokens == 1 << 25
    sam = SamRunnerDrafter(parse_sam_options({"group_mode": True, "group_exchange": True,
                                              "exchange_max_siblings": 0, "exchange_max_shadow_tokens": 99}, K), 512)
    assert sam.drafter.max_shadows_per_group == 0 and sam.drafter.max_shadow_tokens == 99
    with pytest.raises(ValueError, match="exchange_max_siblings"):
        parse_sam_options({"group_mode": True, "group_exchange": True, "exchange_max_siblings": -1})


def test_preflight_refuses_group_exchange_without_group_mode_or_dp() -> None:
    """preflight's registry rules (features.toml SAM_GROUP_EXCHANGE) read back from the final command's keys."""
    from qwen3_rl.tools.launch.preflight import check_feature_rules

    sc = R + "engine_kwargs.vllm.speculative_config."
    ok = {sc + "method": "sam", sc + "sam_config.group_mode": "True", sc + "sam_config.group_exchange": "True",
          R + "engine_kwargs.vllm.data_parallel_size": "32"}
    assert check_feature_rules(ok) == []
    assert check_feature_rules({**ok, sc + "sam_config.group_exchange": "False"}) == []
    (e,) = check_feature_rules({**ok, sc + "sam_config.group_mode": "False"})
    assert e.level == "error" and "SAM_GROUP=False" in e.message
    (e,) = check_feature_rules({**ok, R + "engine_kwargs.vllm.data_parallel_size": "1"})
    assert "VLLM_DP > 1" in e.message
    dp_missing = {k: v for k, v in ok.items() if not k.endswith("data_parallel_size")}
    assert len(check_feature_rules(dp_missing)) == 1
    errs = check_feature_rules({sc + "sam_config.group_exchange": "True"})
    assert len(errs) == 2 and all(x.level == "error" for x in errs)


def test_patched_engine_step_calls_the_hook_after_dummy_and_real_steps(patched_imports: Path) -> None:
    import inspect

    from vllm.plugins.extensions import build_engine_step_hooks
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor

    from qwen3_rl.rollout.gc_control import GcStepHook
    from qwen3_rl.rollout.vllm_engine_hook import VllmRebalanceHook

    assert "qwen3_rl" not in inspect.getsource(LLMEngine)  # the seam names nothing of ours
    calls = []
    eng = object.__new__(LLMEngine)
    eng.log_stats = False
    eng.logger_manager = None
    eng.output_processor = OutputProcessor(None, log_stats=False)
    eng.engine_core = SimpleNamespace(execute_dummy_batch=lambda: calls.append("dummy"),
                                      get_output=lambda: calls.append("real") or EngineCoreOutputs(),
                                      abort_requests=lambda ids: None)
    # the plugin's factories: the exchange hook only with sam_config.group_exchange, between gc and rebalance
    eng.vllm_config = SimpleNamespace(speculative_config=None)
    assert [type(h) for h in build_engine_step_hooks(eng)] == [GcStepHook, VllmRebalanceHook]
    eng.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(
        method="sam", drafter_config={"group_mode": True, "group_exchange": True}))
    hooks = build_engine_step_hooks(eng)
    assert [type(h) for h in hooks] == [GcStepHook, SiblingExchangeHook, VllmRebalanceHook]
    assert hooks[1] is eng.qwen3_rl_sibling_exchange

    class Recorder(SiblingExchangeHook):
        def after_step(self, request_outputs=None):
            calls.append("exchange")
            return request_outputs

    eng.step_hooks = [hooks[0], Recorder(eng), hooks[2]]
    eng.should_execute_dummy_batch = True
    assert eng.step() == []
    eng.should_execute_dummy_batch = False
    assert eng.step() == []
    assert calls == ["dummy", "exchange", "real", "exchange"]
    # the real hook is inert on an engine without SAM: one attribute check per step
    eng.vllm_config = SimpleNamespace(speculative_config=None)
    eng.step_hooks = [SiblingExchangeHook(eng)]
    eng.step()
    assert not eng.step_hooks[0].enabled


def _hook_rank(rank: int, world: int, store: str, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        res = _drive(rank, lambda: dist.new_group(backend="gloo"))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


PROMPT = [7, 8, 9, 10, 11]
RESP = [int(x) for x in np.random.default_rng(3).integers(100, 400, 120)]  # no repeats worth drafting alone


def _drive(rank: int, group_factory) -> dict:  # type: ignore[no-untyped-def]
    """Rank 1 accepts 4 tokens of RESP per step and finishes first; rank 0 accepts what its drafts earn
    (1 + accepted) of the same RESP. Both call the hook after every step (rank 1 idle = dummy steps)."""
    sam = SamRunnerDrafter(SamConfig(num_speculative_tokens=K, group_mode=True, group_exchange=True), 512)
    hook = SiblingExchangeHook(_engine(sam, {"group_mode": True, "group_exchange": True}), group_factory)
    b = FakeInputBatch()
    b.add(f"r{rank}", PROMPT)
    pos, drafted_ok, steps = 0, 0, 0
    drafts: list[int] = []
    live = True
    while True:
        if live:
            if rank == 1:
                adv = 4
            else:
                a = 0
                while a < len(drafts) and pos + a < len(RESP) and drafts[a] == RESP[pos + a]:
                    a += 1
                drafted_ok += a
                adv = a + 1
            adv = min(adv, len(RESP) - pos)
            b.accept(0, RESP[pos: pos + adv])
            pos += adv
            if pos >= len(RESP):
                live = False
                b.remove_all()
                sam.observe(b, {}, SimpleNamespace(finished_req_ids={f"r{rank}"}, scheduled_new_reqs=[]))
            else:
                drafts = sam.step(b, [[1]], {f"r{rank}": None}, None)[0]
        hook.after_step()
        steps += 1
        # both ranks leave the loop together: the "unfinished requests" all-reduce of vLLM's loop
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(live)])
        dist.all_reduce(flag)
        if not int(flag.item()):
            break
    sam.release_all()
    d = sam.drafter
    return {"steps": steps, "hook_steps": hook.steps, "exchanges": hook.exchanges, "drafted_ok": drafted_ok,
            "merged": sam.exchange.stats.tokens_merged, "groups": d.num_groups(), "shadows": d.num_shadows(),
            "nbytes_no_cache": (d.clear_cache(), d.nbytes())[1], "rank": sam.exchange.rank}


def test_hook_exchanges_between_two_gloo_processes(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_hook_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["rank"] == 0 and r1["rank"] == 1
    assert r0["steps"] == r1["steps"] == r0["hook_steps"] == r1["hook_steps"] == r0["exchanges"]
    assert r0["merged"] >= len(RESP) and r1["merged"] > 0
    # rank 0 drafts its sibling's text: nearly every token after the first steps comes from accepted drafts
    assert r0["drafted_ok"] >= 0.6 * len(RESP), r0
    for r in (r0, r1):
        assert r["groups"] == 0 and r["shadows"] == 0 and r["nbytes_no_cache"] == 0
