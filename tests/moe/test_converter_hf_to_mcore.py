"""verl's ``scripts/converter_hf_to_mcore.py`` (patched tree) EXECUTED on the repo's tiny Qwen3-MoE, on gloo, with and
without ``--moe_use_legacy_grouped_gemm``, and the checkpoint it writes loaded as verl's Megatron actor loads it.

The script ships in verl 0.6.1's wheel (top-level ``scripts/``, from which the workspace's verl tree is made) and runs as ``__main__`` in a child process (``tests/helpers/converter_driver.py``) with the
CPU device shims (its ``nccl`` group is gloo, Transformer Engine's layers are the CPU stand-ins) and, for
megatron's ``GroupedMLP``, a PyTorch stand-in of the ``grouped_gemm`` kernel (``tests/helpers/grouped_gemm_cpu``).
The same process then builds the actor's model (``hf_to_mcore_config`` -> ``init_mcore_model``, float32), loads
the checkpoint with ``verl.utils.model.load_mcore_dist_weights`` and runs verl's packed forward. Checked: every
parameter is loaded and the logits equal HF transformers' (the HF model at the bfloat16 weights the script converts,
run in float32) on the same tokens; positive control: a bare ``dist_checkpointing.load`` (verl 0.6.1's load before
patch 0016) leaves exactly the GroupedMLP experts unloaded.
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
DRIVER = REPO / "tests" / "helpers" / "converter_driver.py"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen3_rl.tools.tiny_model import TinySpec, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "moe", TinySpec(moe=True))
    g = torch.Generator().manual_seed(3)
    torch.save(torch.randint(1, 500, (2, 13), generator=g), path / "tokens.pt")
    return path


@pytest.fixture(scope="module")
def converted(patched_workspace: Path, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{"te": result, "grouped": result} of the driver, both runs side by side."""
    verl = patched_workspace / PINS.frameworks["verl"].dir
    megatron = patched_workspace / PINS.frameworks["megatron"].dir
    script = verl / "scripts" / "converter_hf_to_mcore.py"
    assert script.is_file(), f"{script} is missing from the verl source tree"
    root = tmp_path_factory.mktemp("conv")
    path = os.pathsep.join(str(p) for p in (REPO / "qwen3_rl" / "cpu_device", REPO / "tests" / "helpers" / "grouped_gemm_cpu",
                                            verl, megatron, REPO))
    procs = {}
    for name, flags in (("te", []), ("grouped", ["--moe_use_legacy_grouped_gemm"])):
        env = {**os.environ, "QWEN3_RL_CPU_SHIMS": "1", "PYTHONPATH": path, "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        log = (root / f"{name}.log").open("w")
        procs[name] = (subprocess.Popen([sys.executable, str(DRIVER), str(script), str(tiny_moe), str(root / name),
                                         str(root / f"{name}.pt"), *flags], env=env, stdout=log,
                                        stderr=subprocess.STDOUT), log)
    out = {}
    for name, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        tail = "\n".join((root / f"{name}.log").read_text().splitlines()[-40:])
        assert rc == 0, f"{name}: converter driver failed (rc {rc}):\n{tail}"
        out[name] = torch.load(root / f"{name}.pt")
        out[name]["ckpt"] = root / name
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


def test_bare_dist_load_misses_exactly_the_grouped_mlp_experts(converted) -> None:
    """Positive control for verl patch 0016: upstream's load (result of dist_checkpointing.load dropped) fills the
    TEGroupedMLP model whole but leaves GroupedMLP's weight1 / weight2 (ShardedTensorFactory) at their init."""
    assert converted["te"]["nan_after_bare_load"] == []
    missed = converted["grouped"]["nan_after_bare_load"]
    assert missed and all(k.endswith(("mlp.experts.weight1", "mlp.experts.weight2")) for k in missed), missed
    assert len(missed) == 2 * 2  # two MoE layers
