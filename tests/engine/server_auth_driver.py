"""One vLLM 0.13.0 API server started by verl 0.6.1's own ``vLLMHttpServerBase.launch_server`` / ``run_server``
(patched trees, CPU engine, a tiny model), then every route of its app probed over HTTP. Prints one line
``ENGINE_RESULT <json>``.

    python tests/engine/server_auth_driver.py SPEC.json

SPEC: {"model": DIR, "group": the rollout config's ``qwen3_rl`` group, "node_address": the address verl's server
       takes for the node's (a loopback address here: servers on this machine bind loopback only),
       "without_middleware": bool (positive control: the seam's ``server_args`` without the recipe's middleware,
       the state before it existed)}

Stand-ins (named): Ray's ``ray.get`` inside ``launch_server`` (no hybrid worker actors: it is handed an empty list, so
verl leaves vLLM its own in-process executor) and the node address (``node_address`` instead of
``ray.util.get_node_ip_address()``). ``build_app`` is vLLM's own, wrapped only to keep the app it returns.

Result: {"bound": address the endpoint listens on (verl's ``get_server_address``), "port", "unreachable": other
loopback address refused, "routes": [{"path", "kind", "methods", "no_key": {method: status}, "wrong_key": ...,
"right_key": ...}], "api_key_set": bool}
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: routes the right-key walk leaves out (each answers with a key; these would change the server for the walk):
#: none today, the set is named so that a route added later that must not be called has one place
RIGHT_KEY_SKIP: frozenset[tuple[str, str]] = frozenset()
WS_KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def _free_port(host: str) -> tuple[int, socket.socket]:
    s = socket.socket()
    s.bind((host, 0))
    return s.getsockname()[1], s


def _concrete(path: str) -> str:
    """A route's path with each ``{param}`` filled (a value the route can parse)."""
    import re

    return re.sub(r"\{[^}]+\}", "x", path)


def _status(host: str, port: int, method: str, path: str, key: str | None, websocket: bool = False) -> int | str:
    """HTTP status of one request (``Authorization: Bearer key`` when given); a JSON ``{}`` body for methods with a
    body; a websocket upgrade when ``websocket``."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    body = None
    if websocket:
        headers.update({"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                        "Sec-WebSocket-Key": WS_KEY})
    elif method in ("POST", "PUT", "PATCH", "DELETE"):
        body, headers["Content-Type"] = b"{}", "application/json"
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        conn.close()


def route_table(app) -> list[dict]:  # noqa: ANN001 - a FastAPI app
    """Every route of the app as served: HTTP routes with their methods, mounts (an ASGI app under a prefix) and
    websocket routes."""
    from starlette.routing import Mount, Route, WebSocketRoute

    def flat(routes):  # noqa: ANN001, ANN202 - (path, route) pairs, included routers opened
        for r in routes:
            if hasattr(r, "effective_route_contexts"):  # FastAPI >= 0.165: include_router keeps the router
                for ctx in r.effective_route_contexts():
                    yield ctx.path or ctx.original_route.path, ctx.original_route
            else:
                yield r.path, r

    out = []
    for path, r in flat(app.routes):
        if isinstance(r, WebSocketRoute):
            out.append({"path": path, "kind": "websocket", "methods": ["GET"]})
        elif isinstance(r, Mount):
            out.append({"path": path, "kind": "mount", "methods": ["GET"]})
        elif isinstance(r, Route):  # FastAPI's APIRoute too
            out.append({"path": path, "kind": "http", "methods": sorted(r.methods or ["GET"])})
        else:
            raise AssertionError(f"a route of a kind the walk does not know: {type(r).__name__} {r!r}")
    seen = set()
    return [r for r in out if (r["path"], r["kind"]) not in seen and not seen.add((r["path"], r["kind"]))]


def main(spec: dict) -> dict:
    import ray
    import verl.workers.rollout.vllm_rollout.vllm_async_server as srv
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.replica import RolloutMode

    apps = []
    build_app = srv.build_app

    def keep_app(args):  # noqa: ANN001, ANN202 - vLLM's own build_app; the app kept for its route table
        app = build_app(args)
        apps.append(app)
        return app

    srv.build_app = keep_app
    cfg = RolloutConfig(name="vllm", mode="async", free_cache_engine=False, dtype="float32", enforce_eager=True,
                        tensor_model_parallel_size=1, data_parallel_size=1,
                        max_num_seqs=4, max_num_batched_tokens=256, prompt_length=64, response_length=32,
                        gpu_memory_utilization=0.5, qwen3_rl=spec["group"],
                        # the CPU engine's native ops (train_add_tiny_cpu_overrides)
                        engine_kwargs={"vllm": {"compilation_config": {"custom_ops": ["none"]}}})
    server = object.__new__(srv.vLLMHttpServerBase)
    server.config, server.rollout_mode, server.workers = cfg, RolloutMode.HYBRID, []
    server.config.max_model_len = 96
    server.model_config = types.SimpleNamespace(local_path=spec["model"], trust_remote_code=False, lora_rank=0)
    server.replica_rank, server.node_rank, server.gpus_per_node, server.nnodes = 0, 0, 1, 1
    node = spec["node_address"]
    server._server_address, server._server_port = node, None
    server._master_address = node
    server._master_port, _s1 = _free_port(node)
    server._dp_master_port, _s2 = _free_port(node)
    ray.get = lambda refs, *a, **k: []  # stand-in: no hybrid worker actors, no Ray cluster
    if spec.get("without_middleware"):
        from qwen3_rl.trainer.seam import ServerHooks

        plain = ServerHooks.server_args

        def server_args(self, args):  # noqa: ANN001, ANN202 - positive control: the seam as before the middleware
            out = plain(self, args)
            out.pop("middleware", None)
            return out

        ServerHooks.server_args = server_args

    async def run() -> dict:
        await server.launch_server()
        host, port = server.get_server_address()
        key = getattr(server.qwen3_rl_hooks, "api_key", None)
        app = apps[-1]
        table = route_table(app)
        loop = asyncio.get_running_loop()

        async def probe(method: str, path: str, k: str | None, ws: bool) -> int | str:
            return await loop.run_in_executor(None, _status, host, port, method, path, k, ws)

        for r in table:
            path = _concrete(r["path"])
            ws = r["kind"] == "websocket"
            r["no_key"] = {m: await probe(m, path, None, ws) for m in r["methods"]}
            r["wrong_key"] = {m: await probe(m, path, "not-the-key", ws) for m in r["methods"]}
        for r in table:  # with the key last: a route that changes the server state runs after every no-key probe
            path = _concrete(r["path"])
            r["right_key"] = {m: await probe(m, path, key, r["kind"] == "websocket") for m in r["methods"]
                              if (m, r["path"]) not in RIGHT_KEY_SKIP}
        other = "127.0.0.2" if host == "127.0.0.1" else "127.0.0.1"
        refused = await loop.run_in_executor(None, _status, other, port, "GET", "/health", None, False)
        server._server_task.cancel()
        return {"bound": host, "port": port, "unreachable": {other: refused}, "routes": table,
                "api_key_set": bool(key)}

    return asyncio.run(run())


if __name__ == "__main__":
    result = main(json.loads(Path(sys.argv[1]).read_text()))
    print("ENGINE_RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    import os

    os._exit(0)  # the engine's background threads / processes are not waited for
