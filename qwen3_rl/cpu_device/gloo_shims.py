"""Collective shapes gloo refuses that NCCL/HCCL accept (device-layer shim for the tiny CPU runs).

``GLOO_SCALAR_ALL_GATHER``: gloo's ``allgather`` rejects 0-d tensors ("ProcessGroupGloo::allgather: invalid tensor
size at index 0 (expected (), got (1))"); verl all-gathers 0-d timing scalars after every generation
(``verl/utils/profiler/performance.py:232-234``, ``topk_reduce_ratio_min_max``, called at
``verl/workers/megatron_workers.py`` ``generate_sequences``). :func:`install` lets ``torch.distributed.all_gather``
carry a 0-d tensor as a 1-element one on gloo groups and write the values back: same values, same semantics.

"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    """Wrap ``torch.distributed.all_gather`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.distributed as dist

    orig = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):  # noqa: ANN001 (torch's signature)
        if tensor.dim() == 0 and dist.get_backend(group) == "gloo":
            outs = [t.reshape(1).clone() for t in tensor_list]
            work = orig(outs, tensor.reshape(1), group=group, async_op=False)
            for dst, src in zip(tensor_list, outs, strict=True):
                dst.copy_(src.reshape(()))
            return work
        return orig(tensor_list, tensor, group=group, async_op=async_op)

    dist.all_gather = all_gather
    dist.distributed_c10d.all_gather = all_gather
    _INSTALLED = True

