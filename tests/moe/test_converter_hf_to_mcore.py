"""verl's ``scripts/converter_hf_to_mcore.py`` (patched tree) EXECUTED on the repo's tiny Qwen3-MoE on gloo, without
``--moe_use_legacy_grouped_gemm`` on one rank and with it on two (its distributed conversion, pipeline stages of one
layer each, as ``torchrun --nproc_per_node N`` runs it for the cluster), and the checkpoint it writes loaded as verl's
Megatron actor loads it.

The script ships in verl 0.6.1's wheel (top-level ``scripts/``, from which the workspace's verl tree is made) and runs
as ``python scripts/converter_hf_to_mcore.py ...`` in child processes with torchrun's environment and the CPU device
shims (its ``nccl`` group is gloo, Transformer Engine's layers are the CPU stand-ins) and, for megatron's
``GroupedMLP``, a PyTorch stand-in of the ``grouped_gemm`` kernel (``tests/helpers/grouped_gemm_cpu``). Then
``tests/helpers/actor_load_driver.py`` builds the actor's model (``hf_to_mcore_config`` -> ``init_mcore_model``,
float32), loads the checkpoint with ``verl.utils.model.load_mcore_dist_weights`` and runs verl's packed forward.
Checked: every parameter is loaded and the logits equal HF transformers' (the HF model at the bfloat16 weights the
script converts, run in float32) on the same tokens; positive control: a bare ``dist_checkpointing.load`` (verl
0.6.1's load before patch 0016) leaves exactly the GroupedMLP experts unloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PINS, REPO, free_port

LOGITS_ATOL = 1e-5  # float32 forward of the same bfloat16 weights in two implementations
DRIVER = REPO / "tests" / "helpers" / "actor_load_driver.py"




#: variant -> (converter ranks, converter flags)
VARIANTS = {"te": (1, []), "grouped": (2, ["--moe_use_legacy_grouped_gemm"])}


def _run_all(jobs: list[tuple[str, list[str], dict[str, str]]], logs: Path) -> None:
    """Run the (name, argv, env) jobs side by side; each must exit 0 within the bound."""
    procs = []
    for name, argv, env in jobs:
        log = (logs / f"{name}.log").open("w")
        procs.append((name, subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for name, proc, log in procs:
        try:
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        if rc != 0:
            failed.append(f"{name} (rc {rc}):\n" + "\n".join((logs / f"{name}.log").read_text().splitlines()[-40:]))
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def converted(patched_workspace: Path, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{variant: the load driver's result} for the checkpoints the script wrote."""
    verl = patched_workspace / PINS.frameworks["verl"].dir
    megatron = patched_workspace / PINS.frameworks["megatron"].dir
    script = verl / "scripts" / "converter_hf_to_mcore.py"
    assert script.is_file(), f"{script} is missing from the verl source tree"
    root = tmp_path_factory.mktemp("conv")
    base = {**os.environ, "QWEN3_RL_CPU_SHIMS": "1", "MASTER_ADDR": "127.0.0.1",
            "PYTHONPATH": os.pathsep.join(str(p) for p in (REPO / "qwen3_rl" / "cpu_device",
                                                           REPO / "tests" / "helpers" / "grouped_gemm_cpu",
                                                           verl, megatron, REPO))}

    def env(rank: int, world: int, port: int) -> dict[str, str]:
        return {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_PORT": str(port)}

    jobs = []
    for name, (world, flags) in VARIANTS.items():
        port = free_port()
        jobs += [(f"convert-{name}-{r}", [sys.executable, str(script), "--hf_model_path", str(tiny_moe),
                                          "--output_path", str(root / name), *flags], env(r, world, port))
                 for r in range(world)]
    _run_all(jobs, root)
    _run_all([(f"load-{name}", [sys.executable, str(DRIVER), str(tiny_moe), str(root / name), str(root / f"{name}.pt"),
                                *flags], env(0, 1, free_port())) for name, (_, flags) in VARIANTS.items()], root)
    out = {}
    for name, (world, _) in VARIANTS.items():
        out[name] = torch.load(root / f"{name}.pt")
        out[name]["ckpt"] = root / name
        out[name]["convert_logs"] = [(root / f"convert-{name}-{r}.log").read_text() for r in range(world)]
    return out


def _hf_logits(tiny_moe: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    # the script reads the HF model in bfloat16 (converter_hf_to_mcore.py: torch_dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_moe), dtype=torch.bfloat16).float().eval()
    with torch.no_grad():
        return hf(torch.load(tiny_moe / "tokens.pt")).logits


@pytest.mark.parametrize("name, experts", [("te", "TEGroupedMLP"), ("grouped", "GroupedMLP")])
def test_converted_checkpoint_loads_in_the_actor_and_matches_hf(converted, tiny_moe: Path, name: str,
                                                                 experts: str) -> None:
    res = converted[name]
    assert (res["ckpt"] / "metadata.json").is_file() and list(res["ckpt"].glob("*.distcp"))
    assert res["experts"] == [experts]
    assert res["nan_after_verl_load"] == []  # every parameter came from the checkpoint
    ref = _hf_logits(tiny_moe)
    assert res["logits"].shape == ref.shape
    diff = float((res["logits"] - ref).abs().max())
    print(f"\n{name}: max |logits - HF| = {diff:.2e} (|HF| max {float(ref.abs().max()):.2f})")
    torch.testing.assert_close(res["logits"], ref, rtol=0, atol=LOGITS_ATOL)


def test_two_rank_conversion_splits_the_layers(converted) -> None:
    """The flagged conversion ran the script's distributed branch: one pipeline stage per rank, each converting its
    own layer, and the parameter count over both ranks closes."""
    logs = converted["grouped"]["convert_logs"]
    for rank, log in enumerate(logs):
        assert "Pipeline shards: [1, 1]" in log, log[-2000:]
        assert f"pp_rank={rank} global_layer_idx={rank} layer_idx=0" in log, log[-2000:]
        # "total numel=N vs hf_model.num_parameters()=M": the all-reduced count of both stages equals HF's
        totals = [ln.split() for ln in log.splitlines() if ln.startswith("total numel=")]
        assert totals and all(t[1].split("=")[1] == t[3].split("=")[1] for t in totals), totals
    assert "Pipeline shards: [2]" in converted["te"]["convert_logs"][0]


def test_bare_dist_load_misses_exactly_the_grouped_mlp_experts(converted) -> None:
    """Positive control for verl patch 0016: upstream's load (result of dist_checkpointing.load dropped) fills the
    TEGroupedMLP model whole but leaves GroupedMLP's weight1 / weight2 (ShardedTensorFactory) at their init."""
    assert converted["te"]["nan_after_bare_load"] == []
    missed = converted["grouped"]["nan_after_bare_load"]
    assert missed and all(k.endswith(("mlp.experts.weight1", "mlp.experts.weight2")) for k in missed), missed
    assert len(missed) == 2 * 2  # two MoE layers
