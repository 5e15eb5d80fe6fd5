"""The settings side of :mod:`qwen3_rl.rollout.verl_server_auth` (``SERVER_API_KEY`` / ``SERVER_HTTP_HOST`` on verl
0.9.1's server): where they are read from and the combinations that stop. The server itself, keyed and bound on a
real vLLM 0.23 engine behind verl 0.9.1's own server: ``tests/engine_verl091/test_verl091_vllm_server.py``."""

from __future__ import annotations

import pytest

from qwen3_rl.rollout.verl_server_auth import check_combination, recipe_of
from qwen3_rl.trainer.seam import SeamConfigError


def _rollout(group: dict | None, prometheus: bool = False) -> dict:
    return {"custom": None if group is None else {"qwen3_rl": group}, "prometheus": {"enable": prometheus}}


def test_settings_come_from_rollout_custom() -> None:
    r = recipe_of(_rollout({"server_auth": {"enable": False}, "server_http": {"host": "node"}}))
    assert r.server_auth.enable is False and r.server_http.host == "node"
    d = recipe_of(_rollout(None))  # no group: the seam's defaults (the key on, loopback)
    assert d.server_auth.enable is True and d.server_http.host == "loopback"


def test_bad_setting_stops_with_one_line() -> None:
    with pytest.raises(SeamConfigError) as e:
        recipe_of(_rollout({"server_http": {"host": "everywhere"}}))
    assert "server_http" in str(e.value) and "\n" not in str(e.value)


def test_prometheus_scrape_stops_the_key_and_a_non_node_bind() -> None:
    check_combination(
        _rollout({"server_auth": {"enable": True}}, prometheus=False)
    )  # control: no scrape, no stop
    check_combination(
        _rollout({"server_auth": {"enable": False}, "server_http": {"host": "node"}}, prometheus=True)
    )
    with pytest.raises(
        ValueError, match=r"^current set: SERVER_API_KEY=True with rollout\.prometheus\.enable"
    ):
        check_combination(_rollout({"server_auth": {"enable": True}, "server_http": {"host": "node"}}, True))
    with pytest.raises(ValueError, match=r"^current set: SERVER_HTTP_HOST=loopback with rollout\.prometheus"):
        check_combination(_rollout({"server_auth": {"enable": False}}, prometheus=True))
