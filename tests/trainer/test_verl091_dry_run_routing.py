"""SERVER_ROUTING on the current pin set: the train scripts pass verl 0.9.1's ``rollout.router_config_path`` naming
the router YAML the recipe ships (``qwen3_rl/rollout/verl_router.yaml``), and the commands pass verl 0.9.1's
start-up checks.

Each case runs a train script in print mode with ``PIN_SET=current`` and ``SERVER_ROUTING`` (the switches that stop
the setup by default there turned off, as in ``test_verl091_dry_run.py``'s positive control), then the dry run of
``tests/helpers/verl091_dry_run_driver.py`` in the verl 0.9.1 venv, which reads the key back from the composed
config; the launcher's read-back of the switch from the command (``features.values_from_overrides`` on the
current set, through ``rollout.custom.qwen3_rl.server_routing.enable``) gives the value asked. The YAML itself is loaded the way verl loads it (``verl.workers.rollout.router._load_router_yaml`` and
``_resolve_router_class``, ``router.py:325-357``) in that venv. What the plugin does with the servers is checked in
``tests/rollout/test_verl_router.py`` and ``tests/engine_verl091/test_verl091_dp_rank.py``.

Positive control: the same setups with ``SERVER_ROUTING=False`` carry no such key and compose to verl's default
(``null``: its own balancer).
"""

from __future__ import annotations

import json

import pytest
import test_verl091_dry_run as base

from qwen3_rl.tools import features as F

from conftest import REPO
from helpers.current_verl import run_in_venv

KEY = "actor_rollout_ref.rollout.router_config_path"
ENABLE = "+actor_rollout_ref.rollout.custom.qwen3_rl.server_routing.enable"
YAML = REPO / "qwen3_rl" / "rollout" / "verl_router.yaml"
SETUPS = ["train_grpo_tiny_cpu.sh", "train_grpo_qwen3_30b_a3b_32die.sh", "train_grpo_tiny_cpu_fully_async.sh"]
LOAD = """
import json, sys
from verl.workers.rollout.router import _load_router_yaml, _resolve_router_class
cfg = _load_router_yaml(sys.argv[1])
cls = _resolve_router_class(cfg["router_class"])
print(json.dumps({"config": cfg, "class": f"{cls.__module__}.{cls.__qualname__}"}))
"""


@pytest.fixture(scope="module")
def routing_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per setup and switch value: the printed command's overrides (or the script's stderr) and its dry run."""
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    reg = F.load_registry()
    dense = make_tiny_model(tmp_path_factory.mktemp("dry_run_routing_model") / "dense", TinySpec())
    cases, out = [], {"overrides": {}, "stops": {}, "read_back": {}}
    for setup in SETUPS:
        model = dense if "tiny" in setup else None
        off = base._off_switches(reg, setup, model)
        for value in ("True", "False"):
            name = f"{value}:{setup}"
            env = base._env(off | {"SERVER_ROUTING": value}, model)
            cmd = base._render_case(out, cases, name, setup, env, model, report=[KEY])
            if cmd is None:
                continue
            cases[-1]["entry"] = cmd.entry_module
            back = F.values_from_overrides(reg, cmd.override_map(), setup, pin_set="current")
            out["read_back"][name] = back["SERVER_ROUTING"]
    out["dry"] = base._dry_run(cases, tmp_path_factory.mktemp("dry_run_routing"))
    return out


@pytest.mark.parametrize("setup", SETUPS)
def test_routing_key_in_the_command_and_verl091_checks_pass(routing_outcomes: dict, setup: str) -> None:
    on, off = f"True:{setup}", f"False:{setup}"
    for name in (on, off):
        assert name not in routing_outcomes["stops"], routing_outcomes["stops"].get(name)
    hit = [o for o in routing_outcomes["overrides"][on] if o.startswith(KEY + "=")]
    assert hit == [f"{KEY}={YAML}"], hit
    # control: no key, verl's own balancer
    assert not [o for o in routing_outcomes["overrides"][off] if KEY in o]
    for name, value in ((on, "True"), (off, "False")):
        assert [o for o in routing_outcomes["overrides"][name] if o.startswith(ENABLE)] == [
            f"{ENABLE}={value}"
        ]
        assert routing_outcomes["read_back"][name] == value
    for name, want in ((on, str(YAML)), (off, None)):
        r = routing_outcomes["dry"][name]
        assert r["ok"], f"{name}: {r['stage']}: {r['error']}"
        assert r["facts"]["keys"][KEY] == want, r["facts"]
    print(f"{setup}: clean, {KEY}={YAML.relative_to(REPO)} (off: null)")


def test_shipped_yaml_loads_as_verl_loads_it(tmp_path) -> None:
    proc = run_in_venv(["-c", LOAD, str(YAML)], path=[REPO], timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["class"] == "qwen3_rl.rollout.verl_router.GroupRoutingBalancer"
    assert got["config"] == {"router_class": got["class"], "slack": 0}
