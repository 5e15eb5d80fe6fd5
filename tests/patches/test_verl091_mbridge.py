"""The current set's HF -> megatron-core 0.16.1 path (verl 0.9.1's Megatron engine with ``vanilla_mbridge=True``,
mbridge 0.15.1: pins.toml ``[sets.current.runtime]``) on the tiny Qwen3-MoE, and a dist-checkpoint save and load of
that model through verl's load, on the pristine verl 0.9.1 tree and with ``patches/current/verl`` applied.

``tests/helpers/verl091_mbridge_driver.py`` runs in the verl 0.9.1 venv (``bash tests/setup_verl091_env.sh``), one
gloo process per tree, on the device shims of ``qwen3_rl/cpu_device/megatron16_shims.py``. Checked:

* the bridge fills every parameter of the model it builds (TEGroupedMLP experts) from the HF files, and the
  model's logits (verl's packed forward) equal HF transformers' within :data:`LOGITS_ATOL` (transformers 5 in that
  venv, and the main venv's transformers 4, which wrote the files);
* mbridge's layout (``TEGroupedMLP``): verl 0016's case does not arise on 0.16.1. Its only ``ShardedTensorFactory``
  entries (the experts' ``linear_fc1``, swiglu split: ``megatron/core/transformer/moe/experts.py:768-805``) split
  views of the parameter, so ``dist_checkpointing.load`` fills the parameter in place even where its result is
  dropped: the bare load and both trees' ``load_mcore_dist_weights`` bring every tensor back equal to the saved one
  and the logits back bit for bit;
* positive control, the same bridge with ``moe_use_legacy_grouped_gemm`` (``GroupedMLP``, MindSpeed's all-to-all
  overlap layout): its weight1 / weight2 factories copy, so the bare load and the pristine tree's load leave exactly
  those 4 tensors NaN; the patched tree's load (patches/current/verl/0001) brings every tensor back.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port
from helpers.current_verl import patched_verl, pristine_verl, run_in_venv

LOGITS_ATOL = 1e-5  # float32 forward of the same weights in two implementations
DRIVER = REPO / "tests" / "helpers" / "verl091_mbridge_driver.py"
PATH = [REPO / "tests" / "helpers" / "grouped_gemm_cpu", REPO / "qwen3_rl" / "cpu_device", REPO]
LEGACY_EXPERTS = [f"decoder.layers.{i}.mlp.experts.weight{w}" for i in range(2) for w in (1, 2)]
TE_FACTORIES = [f"decoder.layers.{i}.mlp.experts.linear_fc1.weight{e}" for i in range(2) for e in range(4)]




def _run(args: list[str], tree: Path | None, out: Path) -> dict:
    """The driver in the verl 0.9.1 venv (``tree`` first on the path); its OUT.pt."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    proc = run_in_venv(
        [str(DRIVER), *args, str(out)], path=([tree] if tree else []) + PATH, timeout=600, env=env
    )
    assert proc.returncode == 0, f"{args[0]} on {tree} (exit {proc.returncode}):\n{proc.stderr[-5000:]}"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{"hf": HF logits in the verl 0.9.1 venv, "pristine" / "patched": the mcore driver's result on that tree}."""
    root = tmp_path_factory.mktemp("mbridge")
    trees = {"pristine": pristine_verl(), "patched": patched_verl(root)}
    with ThreadPoolExecutor(3) as pool:
        futs = {"hf": pool.submit(_run, ["hf", str(tiny_moe)], None, root / "hf.pt")}
        for name, tree in trees.items():
            (root / name).mkdir()
            futs[name] = pool.submit(
                _run, ["mcore", str(tiny_moe), str(root / name)], tree, root / f"{name}.pt"
            )
        return {name: f.result() for name, f in futs.items()}


def _main_venv_hf_logits(tiny_moe: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_moe), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.load(tiny_moe / "tokens.pt")).logits


def test_bridge_fills_every_parameter_and_logits_match_hf(runs: dict[str, dict], tiny_moe: Path) -> None:
    res = runs["patched"]
    assert (res["megatron_core"], res["mbridge"]) == ("0.16.1", "0.15.1")
    assert res["te"]["experts"] == ["TEGroupedMLP"]
    assert len(res["param_names"]) == 33 and res["nan_after_hf_load"] == []  # every parameter came from HF
    assert torch.equal(
        res["logits"], runs["pristine"]["logits"]
    )  # 0001 does not touch the build or the forward
    for name, ref in (
        ("transformers " + runs["hf"]["transformers"], runs["hf"]["logits"]),
        ("main venv transformers", _main_venv_hf_logits(tiny_moe)),
    ):
        assert res["logits"].shape == ref.shape
        diff = float((res["logits"] - ref).abs().max())
        print(
            f"\nmegatron-core 0.16.1 (mbridge) vs {name}: max |logits - HF| = {diff:.2e} "
            f"(|HF| max {float(ref.abs().max()):.2f})"
        )
        torch.testing.assert_close(res["logits"], ref, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("tree", ["pristine", "patched"])
def test_te_grouped_experts_round_trip_on_either_tree(runs: dict[str, dict], tree: str) -> None:
    """mbridge's layout: the factories (exactly the experts' linear_fc1) alias the parameters, so nothing is lost,
    with verl's result-dropping load (pristine) as with the fix (patched) and a bare dist_checkpointing.load."""
    res = runs[tree]["te"]
    assert res["factories"] == TE_FACTORIES and all(res["factories_alias"].values()), res["factories_alias"]
    assert res["bare"] == {"nan": [], "differ": []}
    assert res["verl"] == {"nan": [], "differ": []}
    assert torch.equal(res["logits_after_verl_load"], runs[tree]["logits"])


def test_legacy_grouped_experts_lost_on_pristine_filled_on_patched(runs: dict[str, dict]) -> None:
    """Positive control: the same bridge with GroupedMLP experts; its factories copy the parameter (no alias), so a
    load that drops dist_checkpointing.load's result misses exactly weight1 / weight2 of both layers."""
    for tree in ("pristine", "patched"):
        res = runs[tree]["legacy"]
        assert res["experts"] == ["GroupedMLP"]
        assert res["factories"] == LEGACY_EXPERTS and not any(res["factories_alias"].values())
        assert res["bare"] == {"nan": LEGACY_EXPERTS, "differ": LEGACY_EXPERTS}, tree
    assert runs["pristine"]["legacy"]["verl"] == {"nan": LEGACY_EXPERTS, "differ": LEGACY_EXPERTS}
    assert runs["patched"]["legacy"]["verl"] == {"nan": [], "differ": []}


def test_te_stand_in_refuses_a_foreign_process_group(runs: dict[str, dict]) -> None:
    """The 0.16.1 TE stand-in acts on parallel_state's groups: it builds with those and refuses any other group."""
    assert runs["patched"]["stand_in_groups"] == {"default": "built", "other": "NotImplementedError"}
