"""The current set's wiring of ``SERVER_API_KEY`` / ``SERVER_HTTP_HOST``: the train scripts put
``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=qwen3_rl.rollout.verl_server_auth.register`` in the
command (features.toml), verl 0.9.1's ``main_ppo`` passes ``ray_kwargs.ray_init`` to ``ray.init``
(``verl/trainer/main_ppo.py:62-73``), and the trainer actor that builds the rollout replicas then finds the recipe's
replica class under ``"vllm"`` in verl's ``RolloutReplicaRegistry``, and the trainer mode ``qwen3_rl_sync``
(``qwen3_rl.trainer.verl091_spec_metrics``) in verl's trainer registry.

Checked in the processes that make the choice. With the hook: the current set's tiny launch
(``test_verl091_tiny_learning.py``, the train script's own command) runs the recipe's server class
(``KeyedvLLMHttpServer`` in its log) and the recipe's trainer mode (spec-decode counters in every step's metrics).
Without it (here, the control): a Ray worker of a local Ray cluster started with the command's
``env_vars.PYTHONPATH`` only, asking verl's registry as verl's trainer does (``RolloutReplicaRegistry.get``,
``verl/workers/rollout/replica.py:312-330``), gets verl's own ``vLLMReplica`` and no such trainer mode: importing the
recipe's modules registers nothing, the hook does. (One probe cluster: the hook's side was a second one, 137 s of
both in CI, and the launch already shows it.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: a child process (its own Ray cluster, no setup hook, shut down at exit): the replica class and trainer mode a Ray
#: worker gets from verl's registries
PROBE = """
import json, sys, ray
repo, tmp = sys.argv[1], sys.argv[2]
ray.init(address="local", num_cpus=1, include_dashboard=False, _temp_dir=tmp,
         runtime_env={"env_vars": {"PYTHONPATH": repo}},
         log_to_driver=False)
try:
    @ray.remote
    def replica():
        from verl.workers.rollout.replica import RolloutReplicaRegistry
        from verl.trainer.ppo.v1 import get_trainer_cls
        cls = RolloutReplicaRegistry.get("vllm")
        try:  # the trainer mode the SAM switch selects (trainer.v1.trainer_mode), as main_ppo asks for it
            trainer = [c.__name__ for c in get_trainer_cls("qwen3_rl_sync").__mro__]
        except ValueError as e:
            trainer = ["error: " + str(e)]
        return [c.__name__ for c in cls.__mro__], trainer
    print("PROBE " + json.dumps(ray.get(replica.remote(), timeout=540)))
finally:
    ray.shutdown()
"""


def _replica_mro() -> tuple[list[str], list[str]]:
    # Ray's socket paths must stay under 107 bytes: a short temp dir, not pytest's
    with tempfile.TemporaryDirectory(prefix="q3r-ray-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, str(REPO), tmp],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE ") :])


def test_without_the_setup_hook_a_ray_worker_gets_verls_own_replica_and_no_recipe_trainer() -> None:
    plain, trainer = _replica_mro()
    assert plain[0] == "vLLMReplica" and "KeyedvLLMReplica" not in plain, plain
    assert trainer[0].startswith("error: Unknown trainer 'qwen3_rl_sync'"), trainer
    print(f"no hook: a Ray worker's replica class {plain[0]}, trainer mode qwen3_rl_sync: {trainer[0]}")
