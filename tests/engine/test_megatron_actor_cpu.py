"""verl 0.6.1's Megatron actor (``ActorRolloutRefWorker``, role ``actor_rollout``) on CPU: megatron-core
0.12.1 on gloo, 2 processes, the tiny random-weight Qwen3-MoE, actor TP2 + EP2 and PP2, rollout = vLLM
0.13.0's real CPU engine (rollout TP 1 per process).

The worker's config is composed by Hydra from ``internal/train_dapo_tiny_cpu.sh`` (the tiny MoE setup) (its CPU settings: vLLM
float32 with native ops, ``free_cache_engine=False`` since sleep mode needs a device allocator, no offload),
the layout given through the script's own env vars (ACTOR_TP/EP/PP). Each rank runs ``megatron_driver.py``
(``init_model`` -> ``generate_sequences`` -> ``compute_log_prob`` -> ``update_actor`` -> ``rollout_mode``
weight sync) with the environment Ray gives verl's workers. Device-layer shims only
(``qwen3_rl/cpu_device/megatron_shims.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import gloo_port

HERE = Path(__file__).resolve().parent
# the tiny MoE setup (Megatron random init; the GRPO tiny script is dense and loads HF weights)
SCRIPT = "internal/train_dapo_tiny_cpu.sh"
RANK_TIMEOUT_S = 1200
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23], [30, 31, 30, 31, 30], [40, 41, 42]]
RESPONSE_LENGTH = 12
#: what the trainer would set or pass; everything else comes from the script
OVERRIDES = [
    # RayPPOTrainer sets this from its dataloader before the workers start (ray_trainer.py)
    "actor_rollout_ref.actor.optim.total_training_steps=2",
    # the actor's log-probs of the rollout's tokens are compared with vLLM's own
    "actor_rollout_ref.rollout.calculate_log_probs=True",
]


def layout_env(tp: int, ep: int, pp: int) -> dict[str, str]:
    """The tiny script's env vars: the actor layout over the 2 processes and a 4-prompt batch."""
    return {"ACTOR_TP": str(tp), "ACTOR_PP": str(pp), "ACTOR_EP": str(ep), "TRAIN_BATCH_SIZE": str(len(PROMPTS)),
            "N_SAMPLES": "1", "MAX_PROMPT_LENGTH": "8", "MAX_RESPONSE_LENGTH": str(RESPONSE_LENGTH), "ROLLOUT_MAX_NUM_SEQS": "4", "LR": "1e-2",
            # DAPO's own sizes, consistent with the 4-prompt batch and the 12-token responses
            "GEN_BATCH_SIZE": str(len(PROMPTS)), "OVERLONG_BUFFER_LEN": "4"}


def run_ranks(spec: dict, tmp_path: Path, world: int = 2) -> list[dict]:
    """Start ``world`` driver processes with Ray's worker environment; returns their results by rank."""
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(spec))
    port = gloo_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    # vLLM-CPU binds each engine's threads to a NUMA node picked by local rank
                    # (vllm/v1/worker/cpu_worker.py:148): one node here, so no binding; one thread per rank
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen([sys.executable, str(HERE / "megatron_driver.py"), str(f)], env=env,
                                       stdout=subprocess.PIPE, stderr=log, text=True), log))
    deadline = time.monotonic() + RANK_TIMEOUT_S
    results, failed = [], []
    for rank, (p, log) in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            out = ""
        log.close()
        lines = [ln for ln in out.splitlines() if ln.startswith("ENGINE_RESULT ")]
        if p.returncode != 0 or not lines:
            tail = "\n".join((tmp_path / f"rank{rank}.log").read_text().splitlines()[-60:])
            failed.append(f"rank {rank} (rc {p.returncode}):\n{tail}")
        else:
            results.append(json.loads(lines[-1][len("ENGINE_RESULT "):]))
    if failed:
        raise AssertionError("megatron driver failed:\n" + "\n".join(failed))
    return results


def actor_spec(ws: Path, model: Path, out: Path, tp: int, ep: int, pp: int) -> dict:
    return {"workspace": str(ws), "script": SCRIPT, "env": {**layout_env(tp, ep, pp), "MODEL_PATH": str(model)},
            "overrides": OVERRIDES, "prompts": PROMPTS, "out": str(out)}


#: (actor TP, EP, PP) over the 2 processes; ETP 1, CP 1
LAYOUTS = {"tp2_ep2": (2, 2, 1), "pp2": (1, 1, 2)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def ranks(request, engine_ws: Path, tiny_models: dict[str, Path], tmp_path_factory) -> tuple[tuple, list[dict]]:
    """((tp, ep, pp), the two ranks' results) for each layout."""
    tp, ep, pp = LAYOUTS[request.param]
    tmp = tmp_path_factory.mktemp(f"megatron-{request.param}")
    return (tp, ep, pp), run_ranks(actor_spec(engine_ws, tiny_models["moe"], tmp / "weights", tp, ep, pp), tmp)


def test_layout_reaches_megatron(ranks) -> None:
    (tp, ep, pp), results = ranks
    for r in results:
        assert r["parallel"] == {"tp": tp, "pp": pp, "ep": ep, "etp": 1, "dp": 1}


def test_generate_and_log_probs(ranks) -> None:
    _, (r0, r1) = ranks
    assert r0["responses"] == r1["responses"]  # the whole batch, collected from both rollout ranks
    assert len(r0["responses"]) == len(PROMPTS) and all(len(x) == RESPONSE_LENGTH for x in r0["responses"])
    for r in (r0, r1):
        assert r["old_log_probs_finite"]
        print(f"rank {r['rank']} {r['parallel']}: timings {r['timings_s']}")
        print(f"rank {r['rank']}: actor vs vLLM log-probs, max |diff| {r['rollout_log_probs_max_abs_diff']:.2e}")
        # same weights (synced), same tokens: the Megatron actor (bfloat16, verl's only Megatron dtypes) and
        # vLLM (float32 with the actor's bfloat16 weights) agree on every token's log-prob to bfloat16 precision
        assert r["rollout_log_probs_max_abs_diff"] < 2e-2


def test_update_actor_changes_the_parameters(ranks) -> None:
    _, results = ranks
    for r in results:
        changed = r["params_changed"]
        assert all(v > 0 for v in changed.values()), {k: v for k, v in changed.items() if v == 0}
        assert any(".experts." in k for k in changed) and any("linear_qkv.layer_norm_weight" in k for k in changed)
        assert not r["initial_equals_after"]


def test_weight_sync_is_exact(ranks) -> None:
    # every vLLM parameter equals the actor's gathered HF-named weight (fused qkv / expert tensors rebuilt from
    # their HF parts): at start-up (vLLM began from dummy weights) and after the update
    _, results = ranks
    for r in results:
        for key in ("sync_initial", "sync"):
            s = r[key]
            assert s["checked"] == 21 and not s["missing"] and not s["mismatched"] and not s["unchecked"], s
