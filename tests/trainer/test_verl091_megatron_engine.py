"""The current set's trainer side: verl 0.9.1's own Megatron engine (``MegatronEngineWithLMHead``,
``verl/workers/engine/megatron/transformer_impl.py``; mbridge 0.15.1 as the bridge, megatron-core 0.16.1) on the
tiny dense Qwen3 of the tiny GRPO run, TP 2 over gloo on CPU, driven through verl's ``TrainingWorker`` as the V1
trainer's actor calls it (``compute_log_prob`` -> ``infer_batch``, ``update_actor`` -> ``train_mini_batch`` with
verl's ``ppo_loss``, the rollout export ``get_per_tensor_param``), on the pristine verl 0.9.1 tree.

``tests/helpers/verl091_engine_driver.py`` runs in the verl 0.9.1 venv (``bash tests/setup_verl091_env.sh``), two
gloo ranks, on the device layer only: ``qwen3_rl/cpu_device/megatron16_shims.py`` (megatron-core's device calls and
the TE stand-in) and ``qwen3_rl/cpu_device/verl091_cpu.py`` (the host as verl's platform, through verl's
``PlatformRegistry``). One setting is not the trainer's: the engine runs in float32 (verl's config validation allows
only bf16 / fp16, ``verl/workers/config/engine.py:218``; the driver says how it sets it), so that the log-probs can be
compared with HF transformers' exactly. Checked:

* the log-probs of a 2-sequence batch (left-padded prompts, right-padded responses, packed by verl's
  ``left_right_2_no_padding``) equal HF transformers' within :data:`LOGP_ATOL`;
* one ``update_actor`` step (Adam, LR 5e-5) changes every parameter and lowers verl's PPO loss on the same batch;
  the loss the engine reports after the step is the clipped PPO loss of its own new log-probs (recomputed here);
* the rollout export yields, tensor by tensor, the engine's parameters in HF naming: before the step exactly the HF
  files' tensors; after the step exactly the engine's updated parameters (its two TP shards, mapped to HF names
  here), an HF model loads them with no missing or unexpected name and its ``state_dict()`` equals them, and its
  log-probs equal the engine's after the step.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port
from helpers.current_verl import pristine_verl, run_in_venv

LOGP_ATOL = 1e-5  # float32 log-probs of the same weights in two implementations
TP = 2
DRIVER = REPO / "tests" / "helpers" / "verl091_engine_driver.py"
PATH = [REPO / "tests" / "helpers" / "grouped_gemm_cpu", REPO / "qwen3_rl" / "cpu_device", REPO]
CLIP, CLIP_C = 0.2, 3.0  # verl's actor defaults (ppo_megatron_trainer.yaml: clip_ratio, clip_ratio_c)


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense Qwen3 (``qwen3_rl.tools.tiny_model``, the tiny GRPO run's model)."""
    from qwen3_rl.tools.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "dense")


@pytest.fixture(scope="module")
def run(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{"engine": rank 0's OUT_DIR/engine.pt, "shards": [each rank's params], "hf": OUT_DIR/hf.pt}."""
    out = tmp_path_factory.mktemp("engine")
    tree = pristine_verl()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(TP),
        "LOCAL_RANK": "0",
    }

    def rank(r: int):
        return run_in_venv(
            [str(DRIVER), "engine", str(tiny_dense), str(out)],
            path=[tree, *PATH],
            timeout=900,
            env={**env, "RANK": str(r)},
        )

    with ThreadPoolExecutor(TP) as pool:
        procs = list(pool.map(rank, range(TP)))
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"engine rank {r} (exit {proc.returncode}):\n{proc.stderr[-5000:]}"
    proc = run_in_venv([str(DRIVER), "hf", str(tiny_dense), str(out)], path=[tree, REPO], timeout=600)
    assert proc.returncode == 0, f"hf (exit {proc.returncode}):\n{proc.stderr[-5000:]}"
    return {
        "engine": torch.load(out / "engine.pt", weights_only=False),
        "shards": [torch.load(out / f"params_rank{r}.pt") for r in range(TP)],
        "hf": torch.load(out / "hf.pt", weights_only=False),
    }


def ppo_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> float:
    """verl's vanilla dual-clip PPO policy loss, token-mean over ``mask`` ([b, R] each)."""
    ratio = torch.exp(logp - old)
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    loss = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, clipped), clipped)
    return float(loss[mask].mean())


def full_params(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The TP shards of each megatron parameter joined (column-parallel on dim 0, row-parallel on dim 1, norms
    replicated: equal on every rank); names without DDP's ``module.``. The qkv and fc1 shards keep megatron's
    per-rank layout ([q/k/v of the rank's query groups], [gate_r; up_r]); :func:`to_hf` splits them per rank."""
    out = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        key = name.removeprefix("module.")
        if parts[0].dim() == 1:
            assert all(torch.equal(p, parts[0]) for p in parts), name
            out[key] = parts[0]
        elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[key] = torch.cat(parts, dim=1)
        else:
            out[key] = (
                torch.stack(parts)
                if key.endswith(("linear_qkv.weight", "linear_fc1.weight"))
                else torch.cat(parts, dim=0)
            )
    return out


def to_hf(params: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Megatron's Qwen3 parameters -> HF names (our own map of the layouts, independent of mbridge's)."""
    heads, groups, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per_group = heads // groups
    hf = {
        "model.embed_tokens.weight": params["embedding.word_embeddings.weight"],
        "lm_head.weight": params["output_layer.weight"],
        "model.norm.weight": params["decoder.final_layernorm.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = params[m + "self_attention.linear_qkv.weight"]  # [tp, groups/tp * (per_group + 2) * hd, hidden]
        blocks = qkv.reshape(groups, (per_group + 2) * hd, -1)  # the query groups in order over the ranks
        hf[h + "self_attn.q_proj.weight"] = blocks[:, : per_group * hd].reshape(heads * hd, -1)
        hf[h + "self_attn.k_proj.weight"] = blocks[:, per_group * hd : (per_group + 1) * hd].reshape(
            groups * hd, -1
        )
        hf[h + "self_attn.v_proj.weight"] = blocks[:, (per_group + 1) * hd :].reshape(groups * hd, -1)
        fc1 = params[m + "mlp.linear_fc1.weight"]  # [tp, 2 * ffn/tp, hidden]: [gate_r; up_r] per rank
        half = fc1.shape[1] // 2
        hf[h + "mlp.gate_proj.weight"] = fc1[:, :half].reshape(-1, fc1.shape[2])
        hf[h + "mlp.up_proj.weight"] = fc1[:, half:].reshape(-1, fc1.shape[2])
        hf[h + "self_attn.o_proj.weight"] = params[m + "self_attention.linear_proj.weight"]
        hf[h + "mlp.down_proj.weight"] = params[m + "mlp.linear_fc2.weight"]
        hf[h + "input_layernorm.weight"] = params[m + "self_attention.linear_qkv.layer_norm_weight"]
        hf[h + "post_attention_layernorm.weight"] = params[m + "mlp.linear_fc1.layer_norm_weight"]
        hf[h + "self_attn.q_norm.weight"] = params[m + "self_attention.q_layernorm.weight"]
        hf[h + "self_attn.k_norm.weight"] = params[m + "self_attention.k_layernorm.weight"]
    assert len(hf) == 3 + 11 * cfg["num_hidden_layers"]
    return hf


def _mask(run: dict) -> torch.Tensor:
    return run["engine"]["batch"]["response_mask"].bool()


def test_it_is_verl_091s_megatron_engine_on_the_current_pins(run: dict) -> None:
    eng = run["engine"]
    assert eng["engine_class"] == "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead"
    assert {k: eng["versions"][k] for k in ("verl", "megatron-core", "mbridge")} == {
        "verl": "0.9.1",
        "megatron-core": "0.16.1",
        "mbridge": "0.15.1",
    }
    assert eng["tp"] == TP and len(run["shards"]) == TP


def test_log_probs_equal_hf_transformers(run: dict) -> None:
    eng, hf, mask = run["engine"], run["hf"], _mask(run)
    diff = float((eng["logp_before"] - hf["logp_hf"])[mask].abs().max())
    step = float((hf["logp_hf_exported"] - hf["logp_hf"])[mask].abs().max())
    print(
        f"\nverl 0.9.1 Megatron engine (TP {TP}) vs transformers {hf['transformers']}: max |log-prob diff| = "
        f"{diff:.2e} over {int(mask.sum())} response tokens (one step moves them by up to {step:.2e})"
    )
    assert mask.sum() == 10 and bool((hf["logp_hf"][mask] < 0).all())
    torch.testing.assert_close(eng["logp_before"][mask], hf["logp_hf"][mask], rtol=0, atol=LOGP_ATOL)
    assert step > 100 * LOGP_ATOL  # the bound tells the weights before and after the step apart


def test_one_step_changes_every_weight_and_lowers_the_loss(run: dict) -> None:
    eng, mask = run["engine"], _mask(run)
    before, after = (
        full_params([s["params_before"] for s in run["shards"]]),
        full_params([s["params_after"] for s in run["shards"]]),
    )
    moved = {k: float((after[k] - before[k]).abs().max()) for k in before}
    adv = eng["batch"]["advantages"]
    old = eng["logp_before"]
    print(
        f"\nloss {eng['loss_before']:.6f} -> {eng['loss_after']:.6f}; {sum(v > 0 for v in moved.values())} of "
        f"{len(moved)} parameters moved, max |step| {max(moved.values()):.2e}, "
        f"grad norm {eng['train_metrics']['grad_norm'][0]:.4f}"
    )
    assert len(moved) == 19 and all(v > 0 for v in moved.values()), moved
    assert eng["train_metrics"]["actor/pg_loss"] == [pytest.approx(eng["loss_before"], abs=1e-6)]
    # on-policy before the step: ratio 1, so the loss is -mean(A) over the response tokens
    assert eng["loss_before"] == pytest.approx(ppo_loss(old, old, adv, mask), abs=1e-6)
    assert eng["loss_after"] == pytest.approx(ppo_loss(eng["logp_after"], old, adv, mask), abs=1e-6)
    assert eng["loss_after"] < eng["loss_before"] - 0.01


def test_rollout_export_is_the_engines_updated_parameters(run: dict, tiny_dense: Path) -> None:
    import json

    eng, hf, mask = run["engine"], run["hf"], _mask(run)
    files = hf["file_tensors"]
    before, after = eng["export_before"], eng["export_after"]
    assert sorted(before) == sorted(files) and all(torch.equal(before[k], files[k]) for k in files)
    names = eng["export_names_after"]
    assert len(names) == len(set(names)) == len(files) and sorted(after) == sorted(files)
    cfg = json.loads((tiny_dense / "config.json").read_text())
    engine_hf = to_hf(full_params([s["params_after"] for s in run["shards"]]), cfg)
    assert sorted(engine_hf) == sorted(after)
    differ = sorted(k for k in after if not torch.equal(after[k], engine_hf[k]))
    changed = sum(not torch.equal(after[k], files[k]) for k in files)
    assert hf["missing"] == [] and hf["unexpected"] == []
    loaded = sum(hf["state_dict_equal"].values())
    logp = float((hf["logp_hf_exported"] - eng["logp_after"])[mask].abs().max())
    print(
        f"\nexport after the step: {len(after)} HF tensors, {len(after) - len(differ)} equal to the engine's TP "
        f"shards mapped to HF names, {changed} changed by the step, {loaded} equal in the HF model's state_dict; "
        f"HF log-probs with them vs the engine's: max |diff| {logp:.2e}"
    )
    assert differ == []
    assert changed == len(files)
    assert loaded == len(after)
    torch.testing.assert_close(hf["logp_hf_exported"][mask], eng["logp_after"][mask], rtol=0, atol=LOGP_ATOL)
