"""verl's server rollout on vLLM 0.13 (bug fixes verl 0010-0012, 0014, 0015): the patched upstream code in the engine
environment (vLLM 0.13.0's CPU build), each probe in a fresh interpreter on the patched engine tree and, as the
control, on the same tree with the fix reversed (``tree_without``).

The real-engine run of the same code (Ray, AgentLoopManager, vLLMHttpServer, AsyncLLM on vLLM's CPU engine) is
``tests/engine/test_server_rollout.py``; here each changed line is driven directly:

* 0010: ``vLLMHttpServerBase.launch_server`` builds the ``vllm serve`` arguments and vLLM's own parser reads them (dict
  arguments as JSON, capture sizes in ``compilation_config``); ``ExternalZeroMQDistributedExecutor`` answers
  ``execute_model`` / ``sample_tokens`` with a done Future when asked for ``non_block`` (over a real ZeroMQ pair);
* 0011: the parsed ``enable_sleep_mode`` follows ``free_cache_engine``;
* 0012: ``AgentLoopManager.generate_sequences`` calls ``wake_up`` / ``sleep`` (the weight sync) with
  ``free_cache_engine=False``;
* 0014: ``RayPPOTrainer._dump_generations`` writes numpy scalars;
* 0015: ``run_unvicorn`` returns with the endpoint listening.

Stand-ins (named): Ray's ``ray.get`` inside ``launch_server`` (no worker actors: it is handed an empty list) and the
final ``run_server`` call (no engine is started; the parsed arguments are kept); the agent-loop workers of
``AgentLoopManager`` (return one ready output); the model config object (attributes only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import workspace
from conftest import tree_without

pytestmark = pytest.mark.server

LAUNCH = textwrap.dedent('''
    import asyncio, json, sys, types
    import ray
    import verl.workers.rollout.vllm_rollout.vllm_async_server as srv
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.replica import RolloutMode

    ray.get = lambda refs, *a, **k: []  # stand-in: no worker actors, no Ray cluster


    def launch(free_cache, group):
        cfg = RolloutConfig(name="vllm", mode="async", free_cache_engine=free_cache, cudagraph_capture_sizes=[8, 16],
                            engine_kwargs={"vllm": {"compilation_config": {"custom_ops": ["none"]},
                                                    "speculative_config": {"method": "ngram",
                                                                           "num_speculative_tokens": 3,
                                                                           "prompt_lookup_max": 4}}},
                            **({"qwen3_rl": group} if group else {}))
        server = object.__new__(srv.vLLMHttpServerBase)
        server.config, server.rollout_mode, server.workers = cfg, RolloutMode.HYBRID, []
        server.config.max_model_len = 160
        server.model_config = types.SimpleNamespace(local_path="/model", trust_remote_code=False, lora_rank=0)
        server.replica_rank, server.node_rank, server.gpus_per_node, server.nnodes = 0, 0, 1, 1
        server._master_address, server._master_port, server._server_address = "127.0.0.1", 1, "127.0.0.1"
        seen = {}

        async def run_server(args):  # stand-in: keep the parsed arguments, start no engine
            seen["args"] = args

        server.run_server = run_server
        try:
            asyncio.run(server.launch_server())
        except BaseException as e:  # argparse exits on a value it refuses
            return {"error": f"{type(e).__name__}: {e}"}
        a = seen["args"]
        hooks = getattr(server, "qwen3_rl_hooks", None)
        cc = a.compilation_config  # vLLM's parser makes a CompilationConfig of the JSON
        cc = {"custom_ops": list(cc.custom_ops), "cudagraph_capture_sizes": cc.cudagraph_capture_sizes}
        return {"compilation_config": cc, "speculative_config": a.speculative_config,
                "enable_sleep_mode": a.enable_sleep_mode, "api_key": a.api_key,
                "hook_key": getattr(hooks, "api_key", None), "additional_config": a.additional_config}


    # argv[1]: a JSON list of [free_cache_engine, the rollout config's qwen3_rl group or null], one launch each (a
    # fresh server object per launch, one process: verl and vLLM imported once)
    print(json.dumps([launch(*case) for case in json.loads(sys.argv[1])], default=str))
''')

#: the patched tree's launches (:data:`LAUNCH`), one process for all; the tests read their cases' results
AUTH_GROUP = {"server_auth": {"enable": True}}
CORE_GROUP = {"disable_gc": {"enable": True}, "rollout_rebalance": {"enable": True, "interval_steps": 4},
              "server_auth": {"enable": False}}
LAUNCH_CASES = {"plain": [False, None], "free_cache": [True, None], "auth": [False, AUTH_GROUP],
                "core": [False, CORE_GROUP]}


EXECUTOR = textwrap.dedent('''
    import json, pickle, threading
    from concurrent.futures import Future
    import zmq
    import verl.workers.rollout.vllm_rollout.vllm_async_server as srv

    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    calls = []

    def serve(n):  # the rollout worker's end of the ZeroMQ pair
        for _ in range(n):
            method, args, kwargs = pickle.loads(rep.recv())
            calls.append(method)
            rep.send(pickle.dumps(f"{method} output"))

    t = threading.Thread(target=serve, args=(3,), daemon=True)
    t.start()
    ex = object.__new__(srv.ExternalZeroMQDistributedExecutor)
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{port}")
    ex.sockets = [req]
    out = {}
    for name, call in (("execute_model", lambda: ex.execute_model("sched", non_block=True)),
                       ("sample_tokens", lambda: ex.sample_tokens(None, non_block=True)),
                       ("blocking", lambda: ex.execute_model("sched"))):
        r = call()
        out[name] = {"future": isinstance(r, Future), "value": r.result() if isinstance(r, Future) else r}
    t.join(10)
    print(json.dumps({"calls": calls, **out}))
''')

WAKE_SLEEP = textwrap.dedent('''
    import json
    import numpy as np
    import ray
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    import verl.experimental.agent_loop.agent_loop as al

    calls = []

    class Worker:  # stand-in agent-loop worker: one ready output per chunk
        class generate_sequences:
            @staticmethod
            def remote(chunk):
                calls.append("generate")
                n = len(chunk)
                out = DataProto.from_dict(tensors={"prompts": torch.ones(n, 2, dtype=torch.long),
                                                   "responses": torch.ones(n, 2, dtype=torch.long),
                                                   "attention_mask": torch.ones(n, 4, dtype=torch.long)})
                out.meta_info = {"metrics": [{"generate_sequences": 1.0, "tool_calls": 0.0}] * n}
                return out

    ray.get = lambda refs, *a, **k: refs  # stand-in: the workers above answer at once
    mgr = object.__new__(al.AgentLoopManager)
    mgr.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"free_cache_engine": False}},
                                   "reward_model": {"rollout": {"free_cache_engine": False}}})
    mgr.reward_model_manager, mgr.agent_loop_workers, mgr.server_handles = None, [Worker()], []
    mgr.qwen3_rl_hooks = None
    mgr.wake_up = lambda: calls.append("wake_up")
    mgr.sleep = lambda: calls.append("sleep")
    prompts = DataProto.from_dict(tensors={"input_ids": torch.ones(4, 2, dtype=torch.long)})
    mgr.generate_sequences(prompts)
    print(json.dumps(calls))
''')

DUMP = textwrap.dedent('''
    import json, sys
    import numpy as np
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.global_steps = 0
    try:
        trainer._dump_generations(["q"], ["a"], ["g"], [1.0],
                                  {"acc": np.array([True]), "score2": np.array([0.5], dtype=np.float32)}, sys.argv[1])
    except TypeError as e:
        print(json.dumps({"error": str(e)}))
        raise SystemExit(0)
    print(open(sys.argv[1] + "/0.jsonl").read())
''')

UVICORN = textwrap.dedent('''
    import asyncio, json, urllib.error, urllib.request
    from fastapi import FastAPI
    from verl.workers.rollout.utils import run_unvicorn

    app = FastAPI()

    @app.get("/ping")
    def ping():
        return {"ok": True}

    def get(url):
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status
        except urllib.error.URLError as e:
            return type(e.reason).__name__ if not isinstance(e, urllib.error.HTTPError) else e.code

    async def main():
        port, task = await run_unvicorn(app, None, "127.0.0.1")
        loop = asyncio.get_running_loop()
        status = await loop.run_in_executor(None, get, f"http://127.0.0.1:{port}/ping")
        task.cancel()
        return status

    print(json.dumps(asyncio.run(main())))
''')


def _run(code: str, ws: Path, *args: str) -> dict | list:
    """``python -c code args`` in the CPU profile's environment of tree ``ws``; its last stdout line as JSON."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **workspace.run_env(ws)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trees(engine_ws: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The patched engine tree; the same without verl 0010 and later ("unfixed": the server fixes and the seam
    reversed), without 0014 alone ("no_dump_fix") and without 0015 alone ("no_uvicorn_fix")."""
    root = tmp_path_factory.mktemp("server-patches")
    return {"patched": engine_ws, "unfixed": tree_without(engine_ws, root / "unfixed", "verl", 10),
            "no_dump_fix": tree_without(engine_ws, root / "no-dump-fix", "verl", 14, only=True),
            "no_uvicorn_fix": tree_without(engine_ws, root / "no-uvicorn-fix", "verl", 15, only=True)}


@pytest.fixture(scope="module")
def launched(trees: dict[str, Path]) -> dict[str, dict]:
    """{case of :data:`LAUNCH_CASES`: what vLLM's parser made of the patched server's arguments}."""
    got = _run(LAUNCH, trees["patched"], json.dumps(list(LAUNCH_CASES.values())))
    assert isinstance(got, list) and len(got) == len(LAUNCH_CASES), got
    return dict(zip(LAUNCH_CASES, got, strict=True))


def test_server_arguments_reach_vllm_parser(trees: dict[str, Path], launched: dict[str, dict]) -> None:
    """0010 + 0011: dict arguments as JSON, capture sizes inside compilation_config, sleep mode = free_cache_engine;
    the unfixed tree's Python repr of the dict is refused by vLLM's own parser."""
    for case, free_cache in (("plain", False), ("free_cache", True)):
        got = launched[case]
        assert "error" not in got, got
        assert got["compilation_config"]["custom_ops"] == ["none"]
        assert got["compilation_config"]["cudagraph_capture_sizes"] == [8, 16]
        assert "ngram" in json.dumps(got["speculative_config"])
        assert got["enable_sleep_mode"] is free_cache
        assert got["api_key"] is None and got["hook_key"] is None  # the recipe's group is empty: nothing added
    (bad,) = _run(LAUNCH, trees["unfixed"], json.dumps([LAUNCH_CASES["plain"]]))
    assert "SystemExit" in bad["error"], bad


def test_server_auth_key_reaches_vllm_and_is_masked(launched: dict[str, dict]) -> None:
    """The seam's server_auth: the key the server made is the one vLLM parses (its --api-key check)."""
    got = launched["auth"]
    assert got["hook_key"] and got["api_key"] in (got["hook_key"], [got["hook_key"]]), got


def test_engine_core_settings_reach_vllm_parser(launched: dict[str, dict]) -> None:
    """The seam's server_args for the engine cores: disable_gc and the rollout_rebalance settings become vLLM's
    parsed ``additional_config`` (what each engine core's hooks read: the same RebalanceSettings come back)."""
    from qwen3_rl.rollout.rebalance import RebalanceSettings
    from qwen3_rl.rollout.vllm_engine_hook import core_settings

    got = launched["core"]
    extra = got["additional_config"]
    assert extra["qwen3_rl"]["disable_gc"] is True, got
    assert core_settings(types.SimpleNamespace(additional_config=extra)) == RebalanceSettings(enable=True,
                                                                                              interval_steps=4)
    assert launched["plain"]["additional_config"] == {}


def test_executor_answers_non_block_with_a_done_future(trees: dict[str, Path]) -> None:
    """0010: vLLM 0.13's engine core asks execute_model / sample_tokens with non_block=True and waits on a Future."""
    got = _run(EXECUTOR, trees["patched"])
    assert got["calls"] == ["execute_model", "sample_tokens", "execute_model"]
    assert got["execute_model"] == {"future": True, "value": "execute_model output"}
    assert got["sample_tokens"] == {"future": True, "value": "sample_tokens output"}
    assert got["blocking"] == {"future": False, "value": "execute_model output"}
    unfixed = _run(EXECUTOR, trees["unfixed"])
    assert unfixed["execute_model"]["future"] is False  # the engine core would call .result() on the output


def test_generation_wakes_and_sleeps_without_free_cache_engine(trees: dict[str, Path]) -> None:
    """0012: wake_up (the hybrid engine's weight sync) before and sleep after the workers' calls, also with
    free_cache_engine=False; unfixed, both are skipped, so the rollout kept its initial weights."""
    assert _run(WAKE_SLEEP, trees["patched"]) == ["wake_up", "generate", "sleep"]
    assert _run(WAKE_SLEEP, trees["unfixed"]) == ["generate"]


def test_dumps_take_numpy_scalars(trees: dict[str, Path], tmp_path: Path) -> None:
    """0014: the agent loop's numpy reward extras are written as JSON values; unfixed, it raises."""
    row = _run(DUMP, trees["patched"], str(tmp_path / "patched"))
    assert row["acc"] is True and row["score2"] == 0.5 and row["input"] == "q"
    assert "bool_" in _run(DUMP, trees["no_dump_fix"], str(tmp_path / "unfixed"))["error"]


def test_endpoint_keeps_listening(trees: dict[str, Path]) -> None:
    """0015: the server's HTTP endpoint answers after run_unvicorn returns; unfixed (uvicorn shuts it down as serve()
    returns) the connection is refused."""
    assert _run(UVICORN, trees["patched"]) == 200
    assert _run(UVICORN, trees["no_uvicorn_fix"]) == "ConnectionRefusedError"
