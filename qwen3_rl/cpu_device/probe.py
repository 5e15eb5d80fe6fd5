"""Observation probes for the tiny CPU training runs (tests/engine/test_e2e_training.py). They change no value.

Installed in every Ray worker by ``sitecustomize.py`` when ``QWEN3_RL_E2E_PROBE_DIR`` is set; they wrap verl's
sync SPMD rollout (``verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py`` ``vLLMRollout``) and its server-mode
worker (``vLLMAsyncRollout``, same module) once imported:

* ``update_weights`` (the weight sync, called by the worker's ``rollout_mode`` before each generation): the
  (name, tensor) stream the actor exports is passed through unchanged and kept; after vLLM has loaded it, every
  parameter of the engine's model is compared exactly (``torch.equal``) with the tensor the stream implies for it
  (:func:`expected_vllm_params`: vLLM's fused q/k/v, gate/up and per-expert w13/w2 layouts). One JSON record per
  sync; rank 0 also saves the stream as ``sync-<n>.safetensors`` so the test can compare syncs with each other and
  with the checkpoint on disk.
  Rank 0 also saves what the engine holds after the sync (its named parameters, vLLM's fused layout) as
  ``engine-<n>.safetensors``: the test compares it with an independent conversion of the saved checkpoint.
  Fault injection (the fully-async test's killed rollout worker): with ``QWEN3_RL_E2E_KILL_IN_SYNC=N`` a process
  whose ``update_weights`` runs its N-th sync records ``killed_in_sync`` once the first tensor has arrived and
  kills itself (SIGKILL) before loading it.
* ``generate_sequences``: a start and an end record per call (the fault test kills a worker between them).
* server mode (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``): every request a vLLM server answers
  (``vLLMHttpServerBase.generate``): the server's replica rank, the prompt's group key and the response length
  (the routing test counts sibling pairs per server from these, independently of the router's own counts);
  once a server is up (``launch_server``), the HTTP status of ``GET /v1/models`` without a key, with a wrong one
  and with the server's own key (server_auth).
* rollout rebalance (``qwen3_rl/rollout/migration.py`` ``RebalanceCoordinator.run_round``, in the engine or, in
  server mode, its DP engine core processes): the first round and each round that planned moves, with its DP
  rank, moves and KV bytes.
* verl's ``MegatronCheckpointManager`` (``verl/utils/checkpoint/megatron_checkpoint_manager.py``): after each
  ``save_checkpoint`` and after ``load_checkpoint``, every tensor of the optimizer (each sub-optimizer's main
  parameters and their state: Adam moments, step) is saved as ``optim-<save-step N|load>-rank<r>.pt`` (the resume
  test compares the loaded state with the saved one, tensor by tensor).

Records: ``<probe dir>/events-<pid>.jsonl``, one JSON object per line.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import post_import

_FUSED = (  # HF suffixes concatenated (dim 0, in this order) into one vLLM parameter
    (re.compile(r"^(.*)\.self_attn\.[qkv]_proj\.weight$"), "{}.self_attn.qkv_proj.weight",
     ("q_proj", "k_proj", "v_proj")),
    (re.compile(r"^(.*)\.mlp\.(?:gate|up)_proj\.weight$"), "{}.mlp.gate_up_proj.weight", ("gate_proj", "up_proj")),
)
_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def expected_vllm_params(hf: dict) -> dict:
    """vLLM 0.13 Qwen3 / Qwen3-MoE parameter name -> tensor, from HF-named full tensors.

    ``q/k/v_proj`` -> ``qkv_proj`` (concatenated, dim 0); ``gate/up_proj`` -> ``gate_up_proj``; expert ``e``'s
    ``gate/up_proj`` -> ``experts.w13_weight[e]`` (gate rows then up rows) and ``down_proj`` -> ``w2_weight[e]``
    (``vllm/model_executor/layers/fused_moe/layer.py`` weight_loader); every other name is kept.
    """
    import torch

    out: dict = {}
    experts: dict[str, dict[int, dict[str, object]]] = {}
    done: set[str] = set()
    for name, t in hf.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            continue
        for pat, fmt, parts in _FUSED:
            m = pat.match(name)
            if m:
                prefix = m.group(1)
                key = fmt.format(prefix)
                if key not in done:
                    sub = "self_attn" if "qkv" in key else "mlp"
                    out[key] = torch.cat([hf[f"{prefix}.{sub}.{p}.weight"] for p in parts], dim=0)
                    done.add(key)
                break
        else:
            out[name] = t
    for prefix, by_e in experts.items():
        n = max(by_e) + 1
        out[f"{prefix}.mlp.experts.w13_weight"] = torch.stack(
            [torch.cat([by_e[e]["gate"], by_e[e]["up"]], dim=0) for e in range(n)])
        out[f"{prefix}.mlp.experts.w2_weight"] = torch.stack([by_e[e]["down"] for e in range(n)])
    return out


def compare(received: dict, engine_params: dict) -> dict:
    """Exact comparison of the engine's parameters with what ``received`` implies; a JSON-able summary."""
    import torch

    want = expected_vllm_params(received)
    unequal, missing = [], []
    max_diff = 0.0
    for name, p in engine_params.items():
        if name not in want:
            missing.append(name)
            continue
        w = want[name].to(p.dtype)
        if w.shape != p.shape or not torch.equal(p.detach().cpu(), w):
            unequal.append(name)
            if w.shape == p.shape:
                max_diff = max(max_diff, float((p.detach().cpu().double() - w.double()).abs().max()))
    return {"engine_params": len(engine_params), "compared": len(engine_params) - len(missing),
            "unequal": unequal, "missing": missing, "unused": sorted(set(want) - set(engine_params)),
            "max_abs_diff": max_diff,
            "all_equal": not unequal and not missing and len(engine_params) > 0}


class _Recorder:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.syncs = 0
        self.generations = 0

    def write(self, event: str, **fields: object) -> None:
        rec = {"event": event, "pid": os.getpid(), "rank": int(os.environ.get("RANK", "-1")),
               "time": time.time(), **fields}
        with open(self.root / f"events-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def _wrap_update_weights(cls, rec: _Recorder, worker_of) -> None:
    """Wrap ``cls.update_weights`` (the weight sync); ``worker_of(rollout)`` is its vLLM worker."""
    orig_update = cls.update_weights

    async def update_weights(self, weights, **kwargs):
        received: dict = {}

        kill_in = int(os.environ.get("QWEN3_RL_E2E_KILL_IN_SYNC", "0"))

        def tee():
            for name, t in weights:
                received[name] = t.detach().to("cpu", copy=True)
                if kill_in and rec.syncs + 1 == kill_in:
                    import signal

                    rec.write("killed_in_sync", n=rec.syncs + 1, first_tensor=name)
                    os.kill(os.getpid(), signal.SIGKILL)
                yield name, t

        t0 = time.perf_counter()
        await orig_update(self, tee(), **kwargs)
        seconds = time.perf_counter() - t0
        rec.syncs += 1
        worker = worker_of(self)
        model = worker.model_runner.model
        summary = compare(received, dict(model.named_parameters()))
        # which engine the rollout runs: vLLM's CPU worker / runner or vLLM-Ascend's (QWEN3_RL_CPU_ROLLOUT=ascend)
        summary.update(worker=type(worker).__name__, runner=type(worker.model_runner).__name__,
                       drafter=type(getattr(worker.model_runner, "drafter", None)).__name__)
        if rec.root and int(os.environ.get("RANK", "0")) == 0:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in received.items()}, str(rec.root / f"sync-{rec.syncs}.safetensors"))
            save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.named_parameters()},
                      str(rec.root / f"engine-{rec.syncs}.safetensors"))
        rec.write("weight_sync", n=rec.syncs, seconds=seconds, tensors=len(received), **summary)

    cls.update_weights = update_weights


def _wrap_rollout(mod, rec: _Recorder) -> None:
    cls = mod.vLLMRollout
    orig_generate = cls.generate_sequences
    _wrap_update_weights(cls, rec, lambda r: r.inference_engine.llm_engine.model_executor.driver_worker.worker)
    # server mode: the worker process's engine is a WorkerWrapperBase driven by the server's engine core
    _wrap_update_weights(mod.vLLMAsyncRollout, rec, lambda r: r.inference_engine.worker)

    def generate_sequences(self, prompts, **kwargs):
        rec.generations += 1
        n = rec.generations
        rec.write("generate_start", n=n, batch=len(prompts))
        t0 = time.perf_counter()
        out = orig_generate(self, prompts, **kwargs)
        stand_in = sys.modules.get("qwen3_rl.cpu_device.npu.stand_in")  # the NPU stand-in's kernel calls so far
        rec.write("generate_end", n=n, seconds=time.perf_counter() - t0,
                  npu_calls=dict(stand_in.CALLS) if stand_in is not None else None)
        return out

    cls.generate_sequences = generate_sequences


def _wrap_server(mod, rec: _Recorder) -> None:
    import hashlib
    from array import array

    cls = mod.vLLMHttpServerBase
    orig_generate = cls.generate

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        key = hashlib.blake2b(array("i", [int(t) for t in prompt_ids]).tobytes(), digest_size=16).hexdigest()
        out = await orig_generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        rec.write("server_request", replica=self.replica_rank, key=key, tokens=len(out.token_ids),
                  request_id=request_id)
        return out

    cls.generate = generate
    orig_launch = cls.launch_server

    async def launch_server(self, *args, **kwargs):
        out = await orig_launch(self, *args, **kwargs)
        key = getattr(getattr(self, "qwen3_rl_hooks", None), "api_key", None)
        if self._server_port is not None:  # the HTTP endpoint is up: who gets an answer from /v1/models
            import asyncio

            url = f"http://{self._server_address}:{self._server_port}/v1/models"
            loop = asyncio.get_running_loop()
            status = {name: await loop.run_in_executor(None, _http_status, url, k)
                      for name, k in (("no_key", None), ("wrong_key", "not-the-key"), ("right_key", key))}
            rec.write("server_auth", replica=self.replica_rank, key=key, status=status)
        return out

    cls.launch_server = launch_server
    # Ray's actor class (@ray.remote at import) captured the methods when the module ran: the process that
    # creates the server actors exports that copy, so it gets the wrapped methods too
    meta = getattr(getattr(mod, "vLLMHttpServer", None), "__ray_metadata__", None)
    if meta is not None:
        meta.modified_class.generate = generate
        meta.modified_class.launch_server = launch_server


def _http_status(url: str, key: str | None, wait_s: float = 60.0) -> int | str:
    """HTTP status of a GET to ``url`` (with ``Authorization: Bearer key`` when given); the endpoint may still be
    starting: refused connections are retried for ``wait_s``, then ``"unreachable"``."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                return "unreachable"
            time.sleep(0.5)


def optimizer_tensors(opt) -> dict:
    """Every tensor of a megatron-core optimizer (chained or not): ``c<k>/g<i>/p<j>/param`` (the main parameter the
    optimizer steps), ``c<k>/g<i>/p<j>/<state name>`` and the group's own tensors ``c<k>/g<i>/<name>``, in
    parameter-group order (the same model and optimizer
    construction gives the same order)."""
    import torch

    subs = list(getattr(opt, "chained_optimizers", None) or [opt])
    out: dict = {}
    for k, sub in enumerate(subs):
        inner = getattr(sub, "optimizer", sub)
        for i, group in enumerate(inner.param_groups):
            for name, v in group.items():  # e.g. the group's step count (the fused AdamW keeps it here)
                if name != "params" and torch.is_tensor(v):
                    out[f"c{k}/g{i}/{name}"] = v.detach().to("cpu", copy=True)
            for j, p in enumerate(group["params"]):
                out[f"c{k}/g{i}/p{j}/param"] = p.detach().to("cpu", copy=True)
                for name, v in inner.state.get(p, {}).items():
                    if torch.is_tensor(v):
                        out[f"c{k}/g{i}/p{j}/{name}"] = v.detach().to("cpu", copy=True)
                    else:
                        out[f"c{k}/g{i}/p{j}/{name}"] = torch.tensor(float(v))
    return out


def _wrap_checkpoint_manager(mod, rec: _Recorder) -> None:
    import torch

    cls = mod.MegatronCheckpointManager
    orig_save, orig_load = cls.save_checkpoint, cls.load_checkpoint
    rank = int(os.environ.get("RANK", "-1"))

    def save_checkpoint(self, local_path, *args, **kwargs):
        out = orig_save(self, local_path, *args, **kwargs)
        if getattr(self, "optimizer", None) is not None:
            step = kwargs.get("global_step", args[1] if len(args) > 1 else 0)
            torch.save(optimizer_tensors(self.optimizer), rec.root / f"optim-save-step{step}-rank{rank}.pt")
            rec.write("checkpoint_save", step=step, path=str(local_path))
        return out

    def load_checkpoint(self, local_path, *args, **kwargs):
        out = orig_load(self, local_path, *args, **kwargs)
        if getattr(self, "optimizer", None) is not None and local_path is not None:
            torch.save(optimizer_tensors(self.optimizer), rec.root / f"optim-load-rank{rank}.pt")
            rec.write("checkpoint_load", path=str(local_path))
        return out

    cls.save_checkpoint = save_checkpoint
    cls.load_checkpoint = load_checkpoint


def install(probe_dir: str) -> None:
    """Wrap verl's SPMD rollout and Megatron checkpoint manager once imported in this process; records go to
    ``probe_dir``."""
    rec = _Recorder(Path(probe_dir))
    post_import.after_import("verl.workers.rollout.vllm_rollout.vllm_rollout_spmd", lambda m: _wrap_rollout(m, rec))
    post_import.after_import("verl.workers.rollout.vllm_rollout.vllm_async_server", lambda m: _wrap_server(m, rec))
    post_import.after_import("verl.utils.checkpoint.megatron_checkpoint_manager",
                             lambda m: _wrap_checkpoint_manager(m, rec))
    post_import.after_import("qwen3_rl.rollout.migration", lambda m: _wrap_rebalance_round(m, rec))


def _wrap_rebalance_round(migration, rec: _Recorder) -> None:  # noqa: ANN001
    """Record each rollout-rebalance round of this engine (``RebalanceCoordinator.run_round``; in server mode it
    runs in the DP engine core processes): its DP rank, the planned moves ``[req_id, src, dst]`` and the KV bytes."""
    run_round = migration.RebalanceCoordinator.run_round

    def recorded(coord):  # noqa: ANN001, ANN202
        rep = run_round(coord)
        if rep.plan.moves or rep.round <= 1:
            rec.write("rebalance_round", dp_rank=coord.rank, round=rep.round, kv_path=rep.kv_path,
                      moves=[[m.req_id, m.src, m.dst] for m in rep.plan.moves], kv_bytes_sent=rep.kv_bytes_sent)
        return rep

    migration.RebalanceCoordinator.run_round = recorded
