"""The ``"hccl"`` process-group backend on the host: gloo underneath, HCCL's Python surface on top.

vLLM-Ascend builds every device group with ``backend="hccl"`` (``worker/worker.py:487``) and
``pg_options=ProcessGroupHCCL.Options()`` (``patch/worker/patch_distributed.py:50-56``, ``utils.py:931-936``), and
asks the backend for ``get_hccl_comm_name(rank)`` (``ops/fused_moe/token_dispatcher.py:107,416``: all four MoE
dispatchers are built up front, so even one device reaches it). Here:

* ``"hccl"`` is registered with ``torch.distributed`` for the ``npu`` and ``cpu`` device types (the stand-in's
  tensors live on the host), created through the extended API so the group's options arrive; one
  ``ProcessGroupGloo`` per group serves both device types;
* ``get_hccl_comm_name`` is set on the ``ProcessGroupGloo`` class (a Python subclass would lose its identity in
  ``ProcessGroup._get_backend``) and returns a stable name per group;
* ``ProcessGroupHCCL.Options`` is a plain class with ``hccl_config`` (dict); each group's ``hccl_config`` is
  recorded in :data:`GROUP_OPTIONS` (group name -> dict), which is what a real HCCL communicator would be
  configured from (torch_npu 2.8.0.post2 reads it into ``HcclCommConfig``);
* ``torch.distributed.is_hccl_available()`` is True (torch_npu adds the function);
* the comm name resolves back to its backend (:func:`backend_for_comm_name`): the MC2 kernels
  (``npu_moe_distribute_dispatch_v2`` / ``combine_v2``, ``ops.py``) are collectives that take the group by name.
"""

from __future__ import annotations

from typing import Any

#: torch group name -> the ``hccl_config`` dict the group was created with (None: no options given).
GROUP_OPTIONS: dict[str, dict | None] = {}
_BACKENDS: dict[str, Any] = {}
#: ``get_hccl_comm_name`` result -> the backend (``ProcessGroupGloo``) it names.
_BY_COMM_NAME: dict[str, Any] = {}
_INSTALLED = False


class ProcessGroupHCCLOptions:
    """``torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options``: the fields vLLM-Ascend sets."""

    def __init__(self) -> None:
        self.hccl_config: dict = {}
        self.is_high_priority_stream = False
        self.global_ranks_in_group: list[int] = []
        self.group_name = ""
        self._timeout = None


class ProcessGroupHCCL:
    """``torch_npu._C._distributed_c10d.ProcessGroupHCCL``: only its ``Options`` type is used on the stand-in
    path; constructing one directly (netloader) needs the device runtime."""

    Options = ProcessGroupHCCLOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("ProcessGroupHCCL: construct device groups with torch.distributed (backend='hccl')")


def _create(dist_opts: Any, pg_options: Any) -> Any:
    import torch.distributed as dist

    name = str(dist_opts.group_id)
    if name not in _BACKENDS:
        gloo = dist.ProcessGroupGloo
        opts = gloo._Options() if hasattr(gloo, "_Options") else None
        if opts is not None:
            opts._timeout = dist_opts.timeout
            opts._devices = [gloo.create_default_device()]
            _BACKENDS[name] = gloo(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, opts)
        else:
            _BACKENDS[name] = gloo(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout)
        cfg = getattr(pg_options, "hccl_config", None)
        GROUP_OPTIONS[name] = dict(cfg) if cfg is not None else None
    return _BACKENDS[name]


def install() -> None:
    """Register ``"hccl"`` and ``get_hccl_comm_name`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.distributed as dist

    if "HCCL" not in dist.Backend._plugins:
        dist.Backend.register_backend("hccl", _create, extended_api=True, devices=["npu", "cpu"])

    def get_hccl_comm_name(self: Any, rank: int, *args: Any, **kwargs: Any) -> str:
        name = f"hccl_host_{id(self):x}_{rank}"
        _BY_COMM_NAME[name] = self
        return name

    dist.ProcessGroupGloo.get_hccl_comm_name = get_hccl_comm_name
    # torch_npu adds it to torch.distributed; netloader imports it (model_loader/netloader/executor/netloader_pg.py:27)
    dist.is_hccl_available = lambda: True
    _INSTALLED = True


def backend_for_comm_name(name: str) -> Any:
    """The backend whose ``get_hccl_comm_name`` returned ``name`` (its low-level collectives: ``allgather``)."""
    try:
        return _BY_COMM_NAME[name]
    except KeyError:
        raise KeyError(f"no stand-in HCCL communicator named {name!r} (get_hccl_comm_name was not called)") from None
