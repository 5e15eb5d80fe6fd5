"""The verdict on a server's route walk (the drivers of tests/engine/test_server_auth.py and
tests/engine_verl091/test_verl091_vllm_server.py walk every route of the app the server serves, without a key, with
a wrong one and with the server's key, and record the HTTP status per method)."""

from __future__ import annotations

from collections.abc import Iterable

#: the routes every keyed server must answer with the key (and a monitor reads)
ANSWERED_WITH_KEY = ("/v1/models", "/version", "/metrics", "/health")


def assert_every_route_keyed(routes: list[dict], open_paths: Iterable[str]) -> int:
    """Assert that each route of ``routes`` (``{path, kind, methods, no_key, wrong_key, right_key}``, statuses per
    method) refuses requests without a key and with a wrong one (401; 403 for a websocket refused before accept)
    unless its path is in ``open_paths`` (then 200 either way), is not refused with the key, and that the
    :data:`ANSWERED_WITH_KEY` routes answer 200 with it. Returns the number of probes (route x method)."""
    open_paths = set(open_paths)
    probes = 0
    for r in routes:
        for m in r["methods"]:
            probes += 1
            if r["path"] in open_paths:
                assert r["no_key"][m] == 200 and r["wrong_key"][m] == 200, r
                continue
            want = 403 if r["kind"] == "websocket" else 401
            assert r["no_key"][m] == want, f"{m} {r['path']} without a key: {r['no_key'][m]}"
            assert r["wrong_key"][m] == want, f"{m} {r['path']} with a wrong key: {r['wrong_key'][m]}"
            assert isinstance(r["right_key"][m], int), f"{m} {r['path']} with the key: {r['right_key'][m]}"
            assert r["right_key"][m] not in (401, 403), f"{m} {r['path']} with the key: {r['right_key'][m]}"
    by_path = {r["path"]: r for r in routes}
    for path in ANSWERED_WITH_KEY:
        assert by_path[path]["right_key"]["GET"] == 200, (path, by_path[path]["right_key"])
    return probes
