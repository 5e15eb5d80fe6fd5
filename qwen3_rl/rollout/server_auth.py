"""The server rollout's HTTP endpoint keyed on every route (``SERVER_API_KEY``) and bound where asked
(``SERVER_HTTP_HOST``).

vLLM 0.13's own ``--api-key`` check (``AuthenticationMiddleware``, ``vllm/entrypoints/openai/api_server.py``)
guards only paths starting with ``/v1``; the app also serves ``/invocations`` (generation), ``/pause`` /
``/resume`` (abort every running request, block the rollout), ``/tokenize``, ``/metrics``, ``/docs`` and more
without a key. :class:`KeyEveryRoute` is an ASGI middleware vLLM adds through its own extension point
(``vllm serve --middleware qwen3_rl.rollout.server_auth.KeyEveryRoute``, added by the verl seam's
``ServerHooks.server_args`` with the key): every HTTP request and websocket, whatever its path or method, needs
``Authorization: Bearer <key>``, except the liveness probe :data:`OPEN_PATHS`. The key is the one vLLM parsed
(``app.state.args.api_key``, else vLLM's ``VLLM_API_KEY``), compared in constant time (sha256 digests,
``secrets.compare_digest``). No key configured: every keyed route answers 401 (closed, not open).

:func:`http_address` is where the endpoint listens and which address the server reports (verl seam, verl patch
0017): ``loopback`` (default; verl's rollout calls the servers through Ray, not HTTP), ``node`` (the node's
address, verl 0.6.1's own choice) or ``all`` (every interface; reports the node's address).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

#: paths answered without a key: the liveness probe only (an empty 200, no model, no state)
OPEN_PATHS = frozenset({"/health"})
#: ``SERVER_HTTP_HOST`` values (``qwen3_rl.server_http.host``)
HOSTS = ("loopback", "node", "all")
#: the import path vLLM's ``--middleware`` takes
MIDDLEWARE = f"{__name__}.KeyEveryRoute"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _keys_of(app: Any) -> list[bytes]:
    """sha256 digests of the keys the vLLM app was started with (``--api-key``, else ``VLLM_API_KEY``), as vLLM's
    own check takes them (``build_app``: the CLI keys take precedence over the environment)."""
    args = getattr(getattr(app, "state", None), "args", None)
    keys = list(getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY") or ""])
    return [_digest(k) for k in keys if k]


def key_matches(authorization: str | None, keys: list[bytes]) -> bool:
    """True when ``authorization`` (the header's value) is ``Bearer <one of keys>``; constant time per key."""
    if not authorization or not keys:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    got = _digest(token)
    ok = False
    for k in keys:
        ok |= secrets.compare_digest(got, k)
    return ok


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class KeyEveryRoute:
    """ASGI middleware: 401 for every HTTP request and websocket without the server's key, except
    :data:`OPEN_PATHS`. vLLM adds it with ``app.add_middleware(KeyEveryRoute)`` (``--middleware``), outside its
    own ``/v1`` check; the keys are read from the app the request reaches (``scope["app"]``, set by Starlette
    before the middleware stack runs) on the first request."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self._keys: list[bytes] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self._keys is None:
            self._keys = _keys_of(scope.get("app"))
        if key_matches(_header(scope, b"authorization"), self._keys):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":  # closed before accept: the client sees the handshake refused (HTTP 403)
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error":"Unauthorized"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def http_address(host: str, node_address: str) -> tuple[str, str]:
    """(address the HTTP endpoint binds, address the server reports) for ``SERVER_HTTP_HOST`` = ``host``;
    ``node_address``: the node's address verl found (``ray.util.get_node_ip_address()``)."""
    if host == "loopback":
        return "127.0.0.1", "127.0.0.1"
    if host == "node":
        return node_address, node_address
    if host == "all":
        return ("::" if ":" in node_address else "0.0.0.0"), node_address
    raise ValueError(f"SERVER_HTTP_HOST={host!r}: expected one of {', '.join(HOSTS)}")
