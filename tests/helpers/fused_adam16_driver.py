"""One gloo process (world size 1) with megatron-core 0.16.1's ``DistributedOptimizer`` over a tiny model, under the
current set's CPU device layer (``qwen3_rl/cpu_device/megatron16_shims.py``) with or without its ``FUSED_ADAM`` item;
for ``tests/engine_verl091/test_verl091_fused_adam.py``.

``python fused_adam16_driver.py shim|no-shim PORT`` prints one JSON line: which Adam megatron took, what
``DistributedOptimizer.state_dict()`` of a fresh optimizer did (the call verl's resume path makes through
``sharded_state_dict``, ``distrib_optimizer.py:1260`` -> ``:642``), and after two steps: the parameters and Adam
moments against ``torch.optim.AdamW`` fed the same gradients, the state layout and the saved step count.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "qwen3_rl" / "cpu_device")]

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def main(mode: str, port: int) -> dict:
    """``mode``: ``shim`` (the whole device layer) or ``no-shim`` (without ``FUSED_ADAM``)."""
    from qwen3_rl.cpu_device import megatron16_shims

    if mode == "no-shim":
        megatron16_shims._fused_adam = lambda: None
    megatron16_shims.install()
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer as dopt
    from megatron.core.transformer import MegatronModule, TransformerConfig

    mpu.initialize_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=torch.float32)

    class Tiny(MegatronModule):
        """Linear 8 -> 8 with bias, then a bias-free scale vector [8] (no weight decay on it)."""

        def __init__(self) -> None:
            super().__init__(config)
            self.lin = torch.nn.Linear(8, 8)
            self.scale = torch.nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        Tiny(),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            weight_decay=WD,
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            adam_eps=EPS,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    out: dict = {
        "apex_or_te": dopt.HAVE_APEX_OR_TE,
        "adam": f"{dopt.Adam.__module__}.{dopt.Adam.__qualname__}",
    }
    try:
        opt.state_dict()
        out["fresh_state_dict"] = "ok"
    except AssertionError:
        tb = traceback.extract_tb(sys.exc_info()[2])[-1]
        out["fresh_state_dict"] = f"AssertionError at {Path(tb.filename).name}:{tb.lineno}: {tb.line}"
    if mode == "no-shim":
        return out
    inner = opt.optimizer  # the Adam megatron built, over this rank's fp32 main-parameter shards
    ref: list = []  # torch.optim.AdamW over copies of those shards, with each group's own lr / decay / betas / eps
    inner_step = inner.step

    def checked_step(closure=None):  # noqa: ANN001, ANN202
        live = [[p for p in g["params"]] for g in inner.param_groups]
        if not ref:
            copies = [[p.detach().clone() for p in ps] for ps in live]
            ref.append(copies)
            ref.append(
                torch.optim.AdamW(
                    [
                        {"params": c, **{k: g[k] for k in ("lr", "weight_decay", "betas", "eps")}}
                        for c, g in zip(copies, inner.param_groups, strict=True)
                    ]
                )
            )
        for ps, cs in zip(live, ref[0], strict=True):
            for p, c in zip(ps, cs, strict=True):
                c.grad = p.grad.detach().clone()
        ref[1].step()
        return inner_step(closure)

    inner.step = checked_step
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(x).square().sum().backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
    diffs = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    n = 0
    for g, cs in zip(inner.param_groups, ref[0], strict=True):
        for p, c in zip(g["params"], cs, strict=True):
            n += 1
            diffs["param"] = max(diffs["param"], (p - c).abs().max().item())
            for k in ("exp_avg", "exp_avg_sq"):
                diffs[k] = max(diffs[k], (inner.state[p][k] - ref[1].state[c][k]).abs().max().item())
    out["against_torch_adamw"] = {"tensors": n, "max_abs_diff": diffs}
    out["state_keys"] = sorted({k for s in inner.state.values() for k in s})
    out["group_steps"] = [g.get("step") for g in inner.param_groups]
    sd = opt.state_dict()
    out["saved_steps"] = [g.get("step") for g in sd["optimizer"]["param_groups"]]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
