"""Observation probes for the current pin set's tiny CPU run (``tests/engine_verl091/test_verl091_tiny_learning.py``):
the weight sync of verl 0.9.1's V1 trainer, seen from both ends. They change no value.

Installed by ``verl091_site/sitecustomize.py`` when ``QWEN3_RL_E2E_PROBE_DIR`` is set:

* trainer side, ``verl/workers/engine_workers.py`` ``ActorRolloutRefWorker.update_weights`` (the sync before each
  generation, ``engine_workers.py:728``): after it returns, the actor engine's export is taken again
  (``engine.get_per_tensor_param()``, what the sync streamed; every rank runs it, its TP all-gathers are collective)
  and rank 0 saves it as ``sync-<n>.safetensors`` (HF names, full tensors), ``n`` counting this process's syncs;
* rollout side, ``verl/workers/rollout/vllm_rollout/utils.py`` ``vLLMColocateWorkerExtension.update_weights_from_ipc``
  (vLLM's worker, ``utils.py:248``): after it returns, every parameter of the model vLLM serves is saved as
  ``engine-r<replica>-<n>.safetensors`` (vLLM's fused layout), ``n`` counting this worker's syncs.

* verl's ``MegatronCheckpointManager`` (``verl/utils/checkpoint/megatron_checkpoint_manager.py``): after each
  ``save_checkpoint`` and after ``load_checkpoint``, this rank's model parameters (``model<chunk>/<name>``) and every
  tensor of its optimizer (``probe.optimizer_tensors``, plus each group's step count ``c<k>/g<i>/step``) are saved as
  ``state-<save-step<N>|load>-rank<r>.pt`` (the resume test compares the loaded state with the saved one).

Records: ``<probe dir>/events-<pid>.jsonl`` (``actor_sync`` / ``engine_sync`` / ``checkpoint_save`` /
``checkpoint_load``, one JSON object per line).
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import post_import


def _record(probe: Path, event: dict) -> None:
    with open(probe / f"events-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"event": event.pop("event"), "time": time.time(), "pid": os.getpid(), **event}) + "\n")


def _save(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".partial")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.rename(path)


def _wrap_trainer(module: Any, probe: Path) -> None:
    cls = module.ActorRolloutRefWorker
    original = cls.update_weights
    count = {"n": 0}

    @functools.wraps(original)
    async def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = await original(self, *args, **kwargs)
        count["n"] += 1
        import torch.distributed as dist

        gen, _ = self.actor.engine.get_per_tensor_param()
        export = {k: v.detach().to("cpu").clone() for k, v in gen}
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            _save(export, probe / f"sync-{count['n']}.safetensors")
        _record(probe, {"event": "actor_sync", "rank": rank, "n": count["n"], "tensors": len(export)})
        return out

    cls.update_weights = update_weights


def _wrap_rollout(module: Any, probe: Path) -> None:
    cls = module.vLLMColocateWorkerExtension
    original = cls.update_weights_from_ipc
    count = {"n": 0}

    @functools.wraps(original)
    def update_weights_from_ipc(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        count["n"] += 1
        replica = os.environ.get("VERL_REPLICA_RANK", "0")
        params = dict(self.model_runner.model.named_parameters())
        _save(params, probe / f"engine-r{replica}-{count['n']}.safetensors")
        _record(probe, {"event": "engine_sync", "replica": int(replica), "n": count["n"], "tensors": len(params)})
        return out

    cls.update_weights_from_ipc = update_weights_from_ipc


def actor_state(manager: Any) -> dict:
    """This rank's model parameters and optimizer tensors held by a verl ``MegatronCheckpointManager``: name ->
    CPU copy (the optimizer's names as ``probe.optimizer_tensors``; a group's non-tensor step as a 0-d float64)."""
    import torch

    from probe import optimizer_tensors

    out = {f"model{c}/{n}": p.detach().to("cpu", copy=True)
           for c, chunk in enumerate(manager.model) for n, p in chunk.named_parameters()}
    opt = manager.optimizer
    out.update(optimizer_tensors(opt))
    for k, sub in enumerate(getattr(opt, "chained_optimizers", None) or [opt]):
        for i, group in enumerate(getattr(sub, "optimizer", sub).param_groups):
            if "step" in group and not torch.is_tensor(group["step"]):
                out[f"c{k}/g{i}/step"] = torch.tensor(float(group["step"]), dtype=torch.float64)
    return out


def _wrap_checkpoint_manager(module: Any, probe: Path) -> None:
    import torch

    cls = module.MegatronCheckpointManager
    orig_save, orig_load = cls.save_checkpoint, cls.load_checkpoint

    def rank() -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    @functools.wraps(orig_save)
    def save_checkpoint(self: Any, local_path: str, *args: Any, **kwargs: Any) -> Any:
        out = orig_save(self, local_path, *args, **kwargs)
        if getattr(self, "optimizer", None) is not None:
            step = kwargs.get("global_step", args[1] if len(args) > 1 else 0)
            torch.save(actor_state(self), probe / f"state-save-step{step}-rank{rank()}.pt")
            _record(probe, {"event": "checkpoint_save", "rank": rank(), "step": step, "path": str(local_path)})
        return out

    @functools.wraps(orig_load)
    def load_checkpoint(self: Any, local_path: str, *args: Any, **kwargs: Any) -> Any:
        out = orig_load(self, local_path, *args, **kwargs)
        if getattr(self, "optimizer", None) is not None and local_path is not None:
            torch.save(actor_state(self), probe / f"state-load-rank{rank()}.pt")
            _record(probe, {"event": "checkpoint_load", "rank": rank(), "path": str(local_path)})
        return out

    cls.save_checkpoint = save_checkpoint
    cls.load_checkpoint = load_checkpoint


def install(probe_dir: str) -> None:
    """Wrap both ends of the weight sync once their modules are imported (this process's)."""
    probe = Path(probe_dir)
    probe.mkdir(parents=True, exist_ok=True)
    post_import.after_import("verl.workers.engine_workers", lambda m: _wrap_trainer(m, probe))
    post_import.after_import("verl.workers.rollout.vllm_rollout.utils", lambda m: _wrap_rollout(m, probe))
    post_import.after_import("verl.utils.checkpoint.megatron_checkpoint_manager",
                             lambda m: _wrap_checkpoint_manager(m, probe))
