"""The ``FUSED_ADAM`` device shim (``qwen3_rl/cpu_device/megatron_shims.py`` item 8): the CPU stand-in for the fused AdamW
MindSpeed registers as ``apex.optimizers.FusedAdam`` on an A3 must update like ``torch.optim.AdamW`` and keep
MindSpeed's state layout (step in the param group, ``exp_avg``/``exp_avg_sq`` per parameter), which is what
megatron-core's Apex/TE optimizer branch saves and resumes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "qwen3_rl" / "cpu_device"))
from megatron_shims import CpuFusedAdam  # noqa: E402


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


def _run(opt_cls, steps: int, **kw) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = _params(0)
    opt = opt_cls([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2,
                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params], opt


def test_updates_like_torch_adamw() -> None:
    ours, opt = _run(CpuFusedAdam, 3)
    ref, _ = _run(torch.optim.AdamW, 3, foreach=False)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert [float(group["step"]) for group in opt.param_groups] == [3.0, 3.0]
    assert all(set(s) == {"exp_avg", "exp_avg_sq"} for s in opt.state.values())


def test_resumes_from_its_state_dict() -> None:
    """Three steps straight equal two steps, a save, a fresh optimizer loading it, and one more step."""
    straight, _ = _run(CpuFusedAdam, 3)
    params = _params(0)
    groups = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}]
    opt = CpuFusedAdam(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    for step in grads[:2]:
        for p, gr in zip(params, step, strict=True):
            p.grad = gr
        opt.step()
    saved = opt.state_dict()
    fresh = CpuFusedAdam([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2,
                         betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    fresh.load_state_dict(saved)
    for p, gr in zip(params, grads[2], strict=True):
        p.grad = gr
    fresh.step()
    for a, b in zip(params, straight, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
