"""The server endpoint's key on every route and its bind address (``qwen3_rl.rollout.server_auth``), on their
own: the ASGI middleware driven with ASGI scopes as Starlette hands them, the seam's ``server_args`` adding it, the
bind-address choice. The real server (vLLM 0.13's app, every route over HTTP) is
``tests/engine/test_server_auth.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from qwen3_rl.rollout.server_auth import MIDDLEWARE, OPEN_PATHS, KeyEveryRoute, http_address, key_matches

KEY = "ab" * 32


def _call(path: str, *, key: str | None = None, kind: str = "http", method: str = "GET", keys=(KEY,),
          root_path: str = "", scheme: str = "Bearer") -> tuple[list[dict], bool]:
    """One request through the middleware: (messages it sent, whether the app was reached)."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    headers = [] if key is None else [(b"authorization", f"{scheme} {key}".encode())]
    scope = {"type": kind, "path": root_path + path, "root_path": root_path, "method": method, "headers": headers,
             "app": SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=list(keys))))}
    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request"}

    asyncio.run(KeyEveryRoute(app)(scope, receive, send))
    return sent, bool(reached)


@pytest.mark.parametrize("path", ["/invocations", "/pause", "/resume", "/tokenize", "/metrics", "/docs",
                                  "/openapi.json", "/v1/models", "/", "/healthz", "/health/", "/x/health"])
def test_every_path_but_the_liveness_probe_needs_the_key(path) -> None:
    for method in ("GET", "POST", "OPTIONS"):
        sent, reached = _call(path, method=method)
        assert not reached and sent[0]["status"] == 401, (path, method)
        assert _call(path, key="wrong", method=method)[0][0]["status"] == 401
        assert _call(path, key=KEY, scheme="Basic", method=method)[0][0]["status"] == 401
        assert _call(path, key=KEY, method=method) == ([], True)
        assert _call(path, key=KEY, scheme="bearer", method=method) == ([], True)  # the scheme is case-blind


def test_liveness_probe_open_root_path_stripped_websocket_refused_lifespan_passed() -> None:
    assert OPEN_PATHS == {"/health"}
    assert _call("/health") == ([], True)
    assert _call("/health", root_path="/api") == ([], True)
    assert _call("/pause", root_path="/api")[0][0]["status"] == 401
    sent, reached = _call("/v1/realtime", kind="websocket")
    assert sent == [{"type": "websocket.close", "code": 1008}] and not reached
    assert _call("/v1/realtime", kind="websocket", key=KEY) == ([], True)
    assert _call("/", kind="lifespan") == ([], True)


def test_no_key_configured_closes_every_keyed_route() -> None:
    assert _call("/pause", keys=())[0][0]["status"] == 401
    assert _call("/pause", key="", keys=())[0][0]["status"] == 401
    assert _call("/health", keys=()) == ([], True)
    assert not key_matches("Bearer ", [])


def test_seam_adds_the_middleware_with_the_key_only() -> None:
    from qwen3_rl.trainer.seam import ServerHooks

    on = ServerHooks.from_rollout_config({"qwen3_rl": {"server_auth": {"enable": True}}})
    args = on.server_args({"dtype": "float32"})
    assert args["middleware"] == MIDDLEWARE == "qwen3_rl.rollout.server_auth.KeyEveryRoute"
    assert args["api_key"] == on.api_key
    off = ServerHooks.from_rollout_config({"qwen3_rl": {"server_auth": {"enable": False}}})
    assert "middleware" not in off.server_args({"dtype": "float32"})


def test_bind_address_per_switch_value() -> None:
    from qwen3_rl.trainer.seam import SeamConfigError, ServerHooks

    assert http_address("loopback", "10.0.0.5") == ("127.0.0.1", "127.0.0.1")
    assert http_address("node", "10.0.0.5") == ("10.0.0.5", "10.0.0.5")
    assert http_address("all", "10.0.0.5") == ("0.0.0.0", "10.0.0.5")
    assert http_address("all", "fd00::5") == ("::", "fd00::5")
    default = ServerHooks.from_rollout_config({"qwen3_rl": {"server_auth": {"enable": True}}})
    assert default.http_address("10.0.0.5") == ("127.0.0.1", "127.0.0.1")  # loopback unless asked
    node = ServerHooks.from_rollout_config({"qwen3_rl": {"server_http": {"host": "node"}}})
    assert node.http_address("10.0.0.5") == ("10.0.0.5", "10.0.0.5")
    with pytest.raises(SeamConfigError, match=r"^qwen3_rl.server_http: host must be one of loopback, node, all"):
        ServerHooks.from_rollout_config({"qwen3_rl": {"server_http": {"host": "0.0.0.0"}}})


def test_switch_values_are_refused_with_one_line() -> None:
    from qwen3_rl.tools.features import FeatureError, load_registry, resolve

    reg = load_registry()
    script = "train_grpo_tiny_cpu.sh"
    assert resolve(reg, script, {}, {})["SERVER_HTTP_HOST"] == "loopback"
    assert resolve(reg, script, {"SERVER_HTTP_HOST": "all"}, {})["SERVER_HTTP_HOST"] == "all"
    with pytest.raises(FeatureError, match=r"^SERVER_HTTP_HOST='0.0.0.0': expected one of loopback, node, all$"):
        resolve(reg, script, {"SERVER_HTTP_HOST": "0.0.0.0"}, {})
