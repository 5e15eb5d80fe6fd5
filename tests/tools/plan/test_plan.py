"""``python -m qwen3_rl plan``: reproduces the memory figures of [ref 002 §2.1] from first principles."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from qwen3_rl.tools.plan import (
    RolloutLayout,
    TrainLayout,
    kv_bytes_per_token,
    kv_heads_per_rank,
    load_model_config,
    model_spec_from_dict,
    plan_rollout,
    plan_training,
)
from qwen3_rl.tools.plan.cli import main as plan_main
from qwen3_rl.tools.plan.memory import A3_DIE_VISIBLE_GIB
from qwen3_rl.tools.plan.model import PlanError

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data"
CFG_235B = DATA / "qwen3_235b_a22b_config.json"
CFG_32B = DATA / "qwen3_32b_config.json"
GIB = 1 << 30

REF_235B = [
    "--model-config", str(CFG_235B), "--rollout-tp", "4", "--rollout-ep", "128", "--rollout-dp", "32",
    "--max-model-len", "32768", "--gpu-memory-utilization", "0.87",
]  # fmt: skip


def _run_json(capsys, argv: list[str]) -> dict:
    assert plan_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_model_param_counts_match_published_sizes():
    """235B-A22B has ~235 B parameters and ~22 B active; Qwen3-32B ~32.8 B."""
    moe = load_model_config(CFG_235B)
    dense = load_model_config(CFG_32B)
    assert 234.5e9 < moe.total_params() < 235.5e9
    active = (
        moe.total_params()
        - moe.num_sparse_layers * (moe.num_experts - moe.num_experts_per_tok) * moe.expert_params()
    )
    assert 21.5e9 < active < 22.5e9
    assert 32.5e9 < dense.total_params() < 33.0e9
    assert moe.num_sparse_layers == 94 and dense.num_sparse_layers == 0


def test_235b_seed_figures(capsys):
    """[ref 002 §2.1]: TP4 weights ≈ 7.09 GiB/die, KV 1.47 GiB per 32K sequence, 20–30 concurrent at 0.87."""
    plan = _run_json(capsys, REF_235B)
    r = plan["rollout"]
    assert r["weights_gib_per_die"] == pytest.approx(7.09, rel=0.02)
    assert r["kv_gib_per_seq"] == pytest.approx(1.47, rel=0.02)
    assert 20 <= r["max_concurrent_seqs"] <= 30
    # exact derivations: 94 layers × 2 × 1 KV head × 128 × 2 B; one expert per die at EP128
    assert r["kv_bytes_per_token_per_die"] == 94 * 2 * 1 * 128 * 2
    assert r["kv_heads_per_die"] == 1
    assert r["weights_gib_by_part"]["experts"] == pytest.approx(94 * 3 * 4096 * 1536 * 2 / GIB)
    assert r["weights_gib_by_part"]["embedding"] == pytest.approx(151936 / 4 * 4096 * 2 / GIB)
    assert r["blocks_per_seq"] == 256 and r["block_size"] == 128
    # the budget is what is left of visible × utilization
    res = r["reserved"]
    left = r["device"]["requested_gib"] - r["weights_gib_per_die"] - res["activation_gib"] - res["hccl_gib"]
    assert r["kv_budget_gib"] == pytest.approx(left)
    assert r["num_blocks"] == int(left * GIB // (128 * r["kv_bytes_per_token_per_die"]))
    assert r["max_concurrent_seqs"] == r["num_blocks"] // 256


def test_235b_concurrency_in_seed_range_over_plausible_settings():
    """The 20–30 holds for verl's default and the reference's batch size 256, 32K or 34K lengths."""
    spec = load_model_config(CFG_235B)
    for max_num_seqs in (256, 1024):
        for length in (32768, 34816):
            lay = RolloutLayout(tp=4, ep=128, dp=32, max_model_len=length, gpu_memory_utilization=0.87,
                                max_num_seqs=max_num_seqs)  # fmt: skip
            assert 20 <= plan_rollout(spec, lay)["max_concurrent_seqs"] <= 30, (max_num_seqs, length)


def test_concurrency_grows_with_utilization_and_shrinks_with_length():
    spec = load_model_config(CFG_235B)
    base = dict(tp=4, ep=128, dp=32)
    c = {u: plan_rollout(spec, RolloutLayout(**base, gpu_memory_utilization=u))["max_concurrent_seqs"]
         for u in (0.6, 0.87, 0.95)}  # fmt: skip
    assert c[0.6] < c[0.87] < c[0.95]
    short = plan_rollout(spec, RolloutLayout(**base, max_model_len=8192, gpu_memory_utilization=0.87))
    assert short["max_concurrent_seqs"] >= 4 * c[0.87]


def test_32b_sanity(capsys):
    """Qwen3-32B at TP8: 8 KV heads → 1 per die, 64 × 2 × 128 × 2 B per token; ~1/8 of 32.8 B params."""
    plan = _run_json(
        capsys,
        ["--model-config", str(CFG_32B), "--rollout-tp", "8", "--max-prompt-length", "2048",
         "--max-response-length", "34816", "--gpu-memory-utilization", "0.87"],
    )  # fmt: skip
    r = plan["rollout"]
    assert r["kv_bytes_per_token_per_die"] == 64 * 2 * 1 * 128 * 2
    assert r["layout"]["max_model_len"] == 2048 + 34816
    assert r["kv_gib_per_seq"] == pytest.approx(36864 * 32768 / GIB)
    assert r["weights_gib_per_die"] == pytest.approx(32.76e9 * 2 / 8 / GIB, rel=0.01)
    assert r["weights_gib_by_part"]["experts"] == 0 and r["weights_gib_by_part"]["router"] == 0
    assert 30 <= r["max_concurrent_seqs"] <= 45
    assert plan["training"] is None


def test_kv_heads_replicated_when_tp_exceeds_kv_heads():
    """TP8 over 4 KV heads: vLLM replicates, each die stores one head (not half a head)."""
    assert kv_heads_per_rank(4, 8) == 1
    assert kv_heads_per_rank(8, 4) == 2
    spec = load_model_config(CFG_235B)
    assert kv_bytes_per_token(spec, RolloutLayout(tp=8)) == kv_bytes_per_token(spec, RolloutLayout(tp=4))
    with pytest.raises(PlanError, match="multiple"):
        kv_heads_per_rank(4, 6)


def test_expert_sharding_without_ep_matches_ep_bytes():
    """Without EP vLLM shards every expert over TP×DP: same expert bytes per die as EP."""
    spec = load_model_config(CFG_235B)
    with_ep = plan_rollout(spec, RolloutLayout(tp=4, ep=128, dp=32))["weights_gib_by_part"]["experts"]
    no_ep = plan_rollout(spec, RolloutLayout(tp=4, ep=1, dp=32))["weights_gib_by_part"]["experts"]
    assert with_ep == pytest.approx(no_ep)
    redundant = plan_rollout(spec, RolloutLayout(tp=4, ep=128, dp=32, redundant_experts=128))
    assert redundant["weights_gib_by_part"]["experts"] == pytest.approx(2 * with_ep)


def test_training_static_memory_formula():
    """bf16 param 2 + fp32 grad 4 + 12/d optimizer bytes per parameter (Megatron distributed optimizer)."""
    spec = load_model_config(CFG_32B)
    t = plan_training(spec, TrainLayout(world=32, tp=8, pp=2, cp=2))
    assert t["layout"]["dp"] == 1 and t["stage_layers"] == [32, 32]
    p = t["params_per_die"]
    assert t["static_gib"] == pytest.approx(p * (2 + 4 + 12 / 2) / GIB)  # d = DP×CP = 2
    plain = plan_training(spec, TrainLayout(world=32, tp=8, pp=2, cp=2, distributed_optimizer=False))
    assert plain["static_gib"] == pytest.approx(p * 18 / GIB)
    emb = spec.embedding_params()
    # one of the two stages: half the layers and one vocab table, all split by TP8
    assert p == pytest.approx((spec.total_params() - 2 * emb) / 16 + emb / 8, rel=1e-3)


def test_training_235b_layout(capsys):
    """Recipe layout TP4 PP4 CP4 EP32 on 128 dies needs ETP1 and an uneven pipeline for 94 layers."""
    args = [*REF_235B, "--train-dies", "128", "--actor-tp", "4", "--actor-pp", "4", "--actor-cp", "4",
            "--actor-ep", "32"]  # fmt: skip
    assert plan_main(args) == 1
    assert "ETP" in capsys.readouterr().err
    assert plan_main([*args, "--actor-etp", "1"]) == 1
    assert "do not split evenly" in capsys.readouterr().err
    plan = _run_json(capsys, [*args, "--actor-etp", "1", "--actor-first-stage-layers", "23",
                              "--actor-last-stage-layers", "23"])  # fmt: skip
    t = plan["training"]
    assert t["stage_layers"] == [23, 24, 24, 23]
    assert t["layout"]["expert_dp"] == 1 and t["layout"]["dp"] == 2
    assert t["expert_params_per_die"] == 23 * 4 * 3 * 4096 * 1536
    assert t["bytes_per_param_expert"] == 18 and t["bytes_per_param_dense"] == 6 + 12 / 8


def test_text_output_and_dispatcher():
    out = subprocess.run(
        [sys.executable, "-m", "qwen3_rl", "plan", *REF_235B],
        capture_output=True, text=True, cwd=REPO, check=True,
    ).stdout  # fmt: skip
    assert "weights per die       7.099 GiB" in out
    assert "KV per sequence       1.469 GiB" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model-config", "/nonexistent/config.json", "--rollout-tp", "4", "--max-model-len", "8"],
            "not found",
        ),
        ([*REF_235B[:2], "--max-model-len", "8"], "rollout TP unknown"),
        ([*REF_235B[:4], "--rollout-ep", "64", "--rollout-dp", "32", "--max-model-len", "8"], "TP×DP = 128"),
        ([*REF_235B[:2], "--rollout-tp", "3", "--max-model-len", "8"], "does not divide"),
        ([*REF_235B[:4]], "max model length unknown"),
        ([*REF_235B, "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    ],
)
def test_bad_inputs_one_line_error(capsys, argv, message):
    assert plan_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_config_lacking_fields(tmp_path, capsys):
    cfg = json.loads(CFG_235B.read_text())
    del cfg["num_key_value_heads"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert plan_main(["--model-config", str(tmp_path), "--rollout-tp", "4", "--max-model-len", "8"]) == 1
    err = capsys.readouterr().err
    assert "lacks 'num_key_value_heads'" in err and err.count("\n") == 1
    cfg = json.loads(CFG_235B.read_text())
    del cfg["moe_intermediate_size"]
    with pytest.raises(PlanError, match="moe_intermediate_size"):
        model_spec_from_dict(cfg)
    p.write_text("{not json")
    assert plan_main(["--model-config", str(p), "--rollout-tp", "4", "--max-model-len", "8"]) == 1
    assert "cannot read model config" in capsys.readouterr().err


def test_train_script_values_and_flag_precedence(monkeypatch, capsys):
    """Layout read through parse_train_script(path); explicit flags override it."""
    seen = {}

    def parse_train_script(path):
        seen["path"] = path
        return [
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            "actor_rollout_ref.rollout.expert_parallel_size=128",
            "actor_rollout_ref.rollout.data_parallel_size=32",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.87",
            "data.max_prompt_length=2048",
            "data.max_response_length=32768",
            "trainer.nnodes=8",
            "trainer.n_gpus_per_node=16",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4",
            "actor_rollout_ref.actor.megatron.context_parallel_size=4",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=32",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=23",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage=23",
        ]

    fake = types.ModuleType("qwen3_rl.tools.launch.train_script")
    fake.parse_train_script = parse_train_script
    monkeypatch.setitem(sys.modules, "qwen3_rl.tools.launch.train_script", fake)
    plan = _run_json(capsys, ["--model-config", str(CFG_235B), "--train-script", "grpo.sh"])
    assert seen["path"] == "grpo.sh"
    r = plan["rollout"]
    assert (r["layout"]["tp"], r["layout"]["ep"], r["layout"]["dp"]) == (4, 128, 32)
    assert r["layout"]["max_model_len"] == 34816
    assert plan["training"]["layout"]["world"] == 128
    over = _run_json(
        capsys, ["--model-config", str(CFG_235B), "--train-script", "grpo.sh", "--max-model-len", "32768"]
    )
    assert over["rollout"]["kv_gib_per_seq"] == pytest.approx(1.47, rel=0.02)
    fake.parse_train_script = lambda path: {"actor_rollout_ref.rollout.tensor_model_parallel_size": "four"}
    assert plan_main(["--model-config", str(CFG_235B), "--train-script", "grpo.sh"]) == 1
    assert "expected int" in capsys.readouterr().err


def test_train_script_engine_kwargs_enable_expert_parallel(monkeypatch, capsys):
    """verl sync rollout: engine_kwargs.vllm.{data_parallel_size, enable_expert_parallel} win; EP = TP×DP."""
    fake = types.ModuleType("qwen3_rl.tools.launch.train_script")
    fake.parse_train_script = lambda path: {
        "actor_rollout_ref.rollout.tensor_model_parallel_size": "4",
        "actor_rollout_ref.rollout.data_parallel_size": "1",
        "actor_rollout_ref.rollout.expert_parallel_size": "1",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.data_parallel_size": "32",
        "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel": "True",
        "actor_rollout_ref.rollout.max_num_seqs": "256",
    }
    monkeypatch.setitem(sys.modules, "qwen3_rl.tools.launch.train_script", fake)
    plan = _run_json(
        capsys, ["--model-config", str(CFG_235B), "--train-script", "s.sh", "--max-model-len", "32768"]
    )
    lay = plan["rollout"]["layout"]
    assert (lay["tp"], lay["dp"], lay["ep"], lay["max_num_seqs"]) == (4, 32, 128, 256)


def test_real_train_script_parser():
    """End to end with the package's train-script parser and the 235B GRPO script of internal/."""
    script = REPO / "internal" / "train_grpo_qwen3_235b_128die_true_weight.sh"
    res = subprocess.run(
        [sys.executable, "-m", "qwen3_rl", "plan", "--model-config", str(CFG_235B), "--train-script", str(script),
         "--max-model-len", "32768", "--actor-first-stage-layers", "23", "--actor-last-stage-layers", "23",
         "--json"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    lay = plan["rollout"]["layout"]
    assert (lay["tp"], lay["ep"], lay["dp"]) == (4, 128, 32)
    assert plan["rollout"]["weights_gib_per_die"] == pytest.approx(7.09, rel=0.02)
    assert 20 <= plan["rollout"]["max_concurrent_seqs"] <= 30
    assert plan["training"]["layout"]["world"] == 128


@pytest.mark.parametrize("cp, comms", [(2, 0), (4, 1), (8, 2)])
def test_hdp_sub_group_hccl_buffers(capsys, cp, comms):
    """--actor-hdp counts the HCCL communicators of HDP's CP sub-groups: the groups HDPProcessGroups.build really
    makes that contain a die and have more than one member (a ring of one carries no traffic; the whole CP group
    is Megatron's own), each 2 × HCCL_BUFFSIZE."""
    from qwen3_rl.parallel.hdp_wiring import HDPProcessGroups

    made: list[tuple[int, ...]] = []
    groups = [list(range(i, i + cp)) for i in range(0, 2 * cp, cp)]
    HDPProcessGroups.build(groups, groups[0], lambda r: made.append(tuple(r)) or tuple(r), cp_group="cp")
    assert len(made) == len(set(made)) and tuple(range(cp)) not in made
    assert sum(1 for g in made if 0 in g and len(g) > 1) == comms
    args = [*REF_235B, "--train-dies", "128", "--actor-tp", "4", "--actor-pp", "4", "--actor-cp", str(cp),
            "--actor-ep", "32", "--actor-etp", "1", "--actor-first-stage-layers", "23", "--actor-last-stage-layers",
            "23", "--hccl-buffsize-mb", "512"]  # fmt: skip
    assert _run_json(capsys, args)["training"]["hdp"] is None  # off unless asked for
    hdp = _run_json(capsys, [*args, "--actor-hdp"])["training"]["hdp"]
    assert hdp == {"hccl_comms_per_die": comms, "hccl_buffsize_mb": 512, "hccl_gib": comms * 2 * 512 / 1024}
    assert plan_main([*args, "--actor-hdp"]) == 0
    assert f"HDP sub-groups        HCCL {comms:.2f} GiB ({comms} comms × 2 × 512 MB)" in capsys.readouterr().out


def test_hdp_needs_context_parallel(capsys):
    args = [*REF_235B, "--train-dies", "128", "--actor-tp", "4", "--actor-pp", "1", "--actor-cp", "1",
            "--actor-ep", "32", "--actor-etp", "1", "--actor-hdp"]  # fmt: skip
    assert plan_main(args) == 1
    assert "HDP needs context parallel size >= 2" in capsys.readouterr().err


def test_30b_a3b_setup_plan(capsys):
    """Qwen3-30B-A3B (HF config: 48 layers, hidden 2048, 32/4 heads of 128, 128 experts top-8 of width 768):
    30.5 B parameters, ~3.3 B active; its train script's layout (docs/setups.md) fits with the figures shown there."""
    cfg = DATA / "qwen3_30b_a3b_config.json"
    spec = load_model_config(cfg)
    assert 30.4e9 < spec.total_params() < 30.6e9 and spec.num_sparse_layers == 48
    active = spec.total_params() - 48 * (128 - 8) * spec.expert_params()
    assert 3.2e9 < active < 3.4e9
    plan = _run_json(capsys, ["--model-config", str(cfg), "--train-script",
                              str(REPO / "internal" / "train_grpo_qwen3_30b_a3b_32die.sh")])
    r, t = plan["rollout"], plan["training"]
    assert (r["layout"]["tp"], r["layout"]["dp"], r["layout"]["ep"], r["layout"]["max_model_len"]) == (2, 16, 32, 3072)
    assert round(r["weights_gib_per_die"], 3) == 3.135 and r["max_concurrent_seqs"] == 331
    assert r["max_concurrent_seqs"] >= 128 * 16 // 16  # one engine's share of the batch fits at full length
    assert (t["layout"]["tp"], t["layout"]["pp"], t["layout"]["ep"], t["stage_layers"]) == (2, 2, 8, [24, 24])
    assert round(t["static_gib"], 2) == 22.96


def test_235b_fully_async_split(capsys):
    """The 235B fully-async script's split (internal/train_grpo_qwen3_235b_128die_fully_async.sh, its header): the
    actor on the 96 train dies fits (64 would not: 64.4 GiB > 60.96 visible), one vLLM server on the 32 rollout dies."""
    args = ["--model-config", str(DATA / "qwen3_235b_a22b_config.json"), "--hccl-buffsize-mb", "512", "--json",
            "--train-script", str(REPO / "internal" / "train_grpo_qwen3_235b_128die_fully_async.sh")]
    assert plan_main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    r, t = plan["rollout"], plan["training"]
    assert (r["layout"]["tp"], r["layout"]["dp"], r["layout"]["ep"], r["layout"]["max_model_len"]) == (4, 8, 32, 34816)
    assert round(r["weights_gib_per_die"], 1) == 17.0 and r["max_concurrent_seqs"] == 19
    assert r["mode"] == {"mode": "async", "replica_dies": 32, "servers": 1, "agent_workers": 8}
    assert (t["layout"]["world"], t["layout"]["dp"], t["layout"]["expert_dp"], t["stage_layers"]) == (96, 2, 1,
                                                                                                   [31, 32, 31])
    assert round(t["static_gib"], 1) == 44.3 < A3_DIE_VISIBLE_GIB
    half = ["--model-config", str(DATA / "qwen3_235b_a22b_config.json"), "--json", "--rollout-tp", "4",
            "--max-model-len", "34816", "--train-dies", "64", "--actor-tp", "4", "--actor-pp", "4", "--actor-cp", "4",
            "--actor-ep", "16", "--actor-etp", "1", "--actor-first-stage-layers", "23", "--actor-last-stage-layers", "23"]
    assert plan_main(half) == 0
    assert round(json.loads(capsys.readouterr().out)["training"]["static_gib"], 1) == 64.4 > A3_DIE_VISIBLE_GIB


def test_plan_knows_the_rollout_mode(capsys, monkeypatch):
    """ROLLOUT_MODE=async: the plan names the vLLM servers verl will start (one per TP x DP replica) and the agent-loop
    workers, with the same memory per die as sync mode (positive control: the sync line without the switch)."""
    args = ["--model-config", str(DATA / "qwen3_235b_a22b_config.json"),
            "--train-script", str(REPO / "internal" / "train_grpo_qwen3_235b_128die_true_weight.sh"), "--json"]
    assert plan_main(args) == 0
    sync = json.loads(capsys.readouterr().out)
    assert sync["rollout"]["mode"] == {"mode": "sync"}
    monkeypatch.setenv("ROLLOUT_MODE", "async")
    assert plan_main(args) == 0
    server = json.loads(capsys.readouterr().out)
    assert server["rollout"]["mode"] == {"mode": "async", "replica_dies": 128, "servers": 1, "agent_workers": 8}
    assert server["rollout"]["kv_budget_gib"] == sync["rollout"]["kv_budget_gib"]
    monkeypatch.setenv("ROLLOUT_MODE", "async")
    args32 = ["--model-config", str(DATA / "qwen3_32b_config.json"),
              "--train-script", str(REPO / "internal" / "train_grpo_qwen3_32b_32die_true_weight.sh")]
    assert plan_main(args32) == 0
    assert "async: 4 vLLM server(s) of 8 dies, 8 agent-loop workers" in capsys.readouterr().out
