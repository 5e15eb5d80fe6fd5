"""``python -m qwen3_rl eval`` end to end on CPU: a tiny verl Megatron actor checkpoint (megatron-core 0.12.1's
dist_checkpointing on gloo through verl's own save function, ``merge_driver.py``) merged by verl 0.6.1's real
model merger through ``eval merge``; the merged weights equal the Megatron model's; ``eval score`` generates with
vLLM 0.13.0's real CPU engine (offline ``LLM``) on gsm8k-style problems over 2 rounds; ``--rejudge`` reproduces
the score from the saved generations; ``eval compare`` puts the base model and the merged one side by side.

Device-layer shims only (``qwen3_rl/cpu_device/``: gloo for nccl, CPU stand-ins for TE / CUDA calls). A random model
answers about nothing right: the judge itself is tested on known answers in tests/tools/eval/test_eval.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import workspace
from conftest import gloo_port, run_engine

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CPU_LLM_KWARGS = {"dtype": "float32", "enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}}


def _env(ws: Path, shims: bool) -> dict[str, str]:
    """The engine tree first on PYTHONPATH (as workspace.activate does in-process), the CPU shims when asked."""
    paths = ([str(workspace.CPU_DEVICE)] if shims else []) + [str(ws / d) for d in workspace.PATH_TREES]
    env = dict(os.environ, PYTHONPATH=":".join([*paths, str(REPO), str(ws / ".dist-info")]),
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_PLUGINS="none", VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_KVCACHE_SPACE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(gloo_port()))
    if shims:
        env.update(QWEN3_RL_CPU_SHIMS="1", QWEN3_RL_ENGINE_WS=str(ws))
    return env


def _eval(args: list[str], env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "eval", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    return proc


def _qkv_split(qkv, heads: int, kv_heads: int, head_dim: int):
    """Megatron's fused [groups x (q heads of the group, k, v), h] rows -> (q, k, v) HF row blocks."""
    per = heads // kv_heads
    g = qkv.view(kv_heads, (per + 2) * head_dim, -1)
    q = g[:, : per * head_dim].reshape(heads * head_dim, -1)
    k = g[:, per * head_dim : (per + 1) * head_dim].reshape(kv_heads * head_dim, -1)
    v = g[:, (per + 1) * head_dim :].reshape(kv_heads * head_dim, -1)
    return q, k, v


def test_merge_score_rejudge_compare(engine_ws: Path, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from qwen3_rl.tools.data.prepare import convert, find_dataset, write_parquet

    model = tiny_models["dense"]
    ckpt = tmp_path / "ckpt"
    made = run_engine({"workspace": str(engine_ws), "model": str(model), "out": str(ckpt), "port": gloo_port()},
                      tmp_path, driver="merge_driver.py")
    assert made["params"] > 0 and (ckpt / "global_step_1" / "actor" / "dist_ckpt" / "metadata.json").is_file()

    # merge with verl's own merger (the trainer's checkpoint root: the latest step is taken)
    merged = tmp_path / "merged"
    proc = _eval(["merge", str(ckpt), "--target", str(merged)], _env(engine_ws, shims=True))
    print(f"merge: {proc.stdout.strip().splitlines()[-1]}")
    assert proc.stdout.strip().endswith(f"merged into {merged}")
    hf = load_file(merged / "model.safetensors")
    ref = torch.load(ckpt / "reference.pt")
    cfg = json.loads((merged / "config.json").read_text())
    n, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    pairs = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
             "output_layer.weight": hf["lm_head.weight"], "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        pairs[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        pairs[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
        pairs[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        pairs[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[h + "input_layernorm.weight"]
        pairs[m + "mlp.linear_fc1.layer_norm_weight"] = hf[h + "post_attention_layernorm.weight"]
        pairs[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
        pairs[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
        q, k, v = _qkv_split(ref[m + "self_attention.linear_qkv.weight"], n, kv, hd)
        for name, part in (("q", q), ("k", k), ("v", v)):
            assert torch.equal(part, hf[h + f"self_attn.{name}_proj.weight"]), (i, name)
    assert set(pairs) | {f"decoder.layers.{i}.self_attention.linear_qkv.weight"
                         for i in range(cfg["num_hidden_layers"])} == set(ref)
    for name, want in pairs.items():
        assert ref[name].shape == want.shape and torch.equal(ref[name], want), name
    assert ref["embedding.word_embeddings.weight"].dtype == torch.bfloat16 and ref["embedding.word_embeddings.weight"].std() > 0

    # score the base model and the merged one with vLLM's real CPU engine, 4 problems x 2 rounds
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in ((2, 3), (10, 4), (7, 8), (1, 1))]
    data = write_parquet(convert(find_dataset("gsm8k"), rows, "test"), tmp_path / "data" / "gsm8k", "test")
    common = ["--data", str(data), "--rounds", "2", "--max-tokens", "24", "--seed", "0", "--max-model-len", "512",
              "--gpu-memory-utilization", "0.5", "--llm-kwargs", json.dumps(CPU_LLM_KWARGS), "--no-progress"]
    docs = {}
    for name, path in (("before", model), ("after", merged)):
        out = tmp_path / f"score-{name}"
        proc = _eval(["score", "--model", str(path), *common, "--out", str(out)], _env(engine_ws, shims=False))
        assert "\n| dataset | model | problems | rounds |" in "\n" + proc.stdout  # vLLM logs to stdout too
        doc = docs[name] = json.loads((out / "score.json").read_text())
        print(f"score {name}: engine start {doc['engine_start_seconds']:.1f} s, generation "
              f"{doc['generation_seconds']:.2f} s for {doc['response_tokens_total']} tokens, judge "
              f"{doc['judge_seconds']:.2f} s")
        assert (doc["dataset"], doc["num_problems"], doc["rounds"], doc["data_rows"]) == ("openai/gsm8k", 4, 2, 4)
        assert len(doc["per_round_accuracy"]) == 2 and all(0.0 <= a <= 100.0 for a in doc["per_round_accuracy"])
        gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
        assert sorted((g["problem"], g["round"]) for g in gens) == [(p, r) for p in range(4) for r in range(2)]
        assert all(0 < g["completion_tokens"] <= 24 and g["text"] for g in gens)
        assert doc["response_tokens_total"] == sum(g["completion_tokens"] for g in gens)
        assert {g["ground_truth"] for g in gens} == {"5", "14", "15", "2"}
        # the two rounds are two samples, not one repeated
        assert any(gens[2 * p]["text"] != gens[2 * p + 1]["text"] for p in range(4))
        redo = json.loads(_eval(["score", "--rejudge", str(out / "generations.jsonl"), "--json"],
                                _env(engine_ws, shims=False)).stdout)
        assert redo["per_round_accuracy"] == doc["per_round_accuracy"]
        assert redo["per_problem_correct"] == doc["per_problem_correct"]
    # the merged model is another random model than the base one: its answers differ
    before = [json.loads(x)["text"] for x in (tmp_path / "score-before" / "generations.jsonl").read_text().splitlines()]
    after = [json.loads(x)["text"] for x in (tmp_path / "score-after" / "generations.jsonl").read_text().splitlines()]
    assert before != after

    # (the plot needs matplotlib, which this venv lacks: tests/tools/eval/test_eval.py draws it)
    proc = _eval(["compare", str(tmp_path / "score-before"), str(tmp_path / "score-after"), "--json"],
                 _env(engine_ws, shims=False))
    row = json.loads(proc.stdout)["comparison"][0]
    assert row["dataset"] == "gsm8k" and row["published"] is None and row["num_problems"] == 4
    assert row["measured"] == docs["after"]["accuracy_mean"] - docs["before"]["accuracy_mean"]


def test_score_through_a_real_vllm_server(engine_ws: Path, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """``eval score --server``: vLLM 0.13.0's own OpenAI server (``vllm.entrypoints.openai.api_server``, CPU)
    takes the chat requests with [ref 004]'s vLLM-only fields (top_k, repetition_penalty); one request per
    (problem, round); the same --seed gives the same answers again through the server."""
    import socket
    import time
    import urllib.request

    from qwen3_rl.tools.data.prepare import convert, find_dataset, write_parquet

    rows = [{"question": f"What is {a} times 2?", "answer": f"#### {2 * a}"} for a in (3, 5, 9)]
    data = write_parquet(convert(find_dataset("gsm8k"), rows, "test"), tmp_path / "gsm8k", "test")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env(engine_ws, shims=False)
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                               str(tiny_models["dense"]), "--served-model-name", "tiny-served", "--dtype", "float32",
                               "--enforce-eager", "--max-model-len", "512", "--compilation-config",
                               json.dumps({"custom_ops": ["none"]}), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2)
                break
            except OSError:
                assert time.perf_counter() - t0 < 600, "vLLM server did not come up in 600 s"
                time.sleep(1)
        print(f"vllm server up in {time.perf_counter() - t0:.1f} s")
        texts = []
        for run in ("a", "b"):
            out = tmp_path / f"srv-{run}"
            _eval(["score", "--server", url, "--data", str(data), "--rounds", "2", "--max-tokens", "16", "--seed", "7",
                   "--concurrency", "3", "--out", str(out), "--no-progress"], env)
            doc = json.loads((out / "score.json").read_text())
            assert (doc["model"], doc["num_problems"], doc["rounds"]) == ("tiny-served", 3, 2)
            assert doc["sampling"]["top_k"] == 10 and doc["sampling"]["repetition_penalty"] == 1.03
            gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
            assert sorted((g["problem"], g["round"]) for g in gens) == [(p, r) for p in range(3) for r in range(2)]
            assert all(0 < g["completion_tokens"] <= 16 and g["finish_reason"] in ("length", "stop") for g in gens)
            print(f"server score {run}: generation {doc['generation_seconds']:.2f} s for "
                  f"{doc['response_tokens_total']} tokens")
            texts.append([g["text"] for g in gens])
        assert texts[0] == texts[1]  # per-request seeds reach the server
        assert len(set(texts[0])) > 1
        assert (tmp_path / "serve.log").read_text().count("POST /v1/chat/completions") == 12
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
