"""A CPU stand-in for ``torch_npu``, ``torch.npu``, ``acl`` and ``torchair`` (device and kernel layer only), so
vLLM-Ascend 0.13.0's own engine (``NPUWorker`` -> ``NPUModelRunner``, Ascend attention and fused MoE) runs on a
host without an NPU. ``stand_in.install()`` installs it; ``python -m qwen3_rl.cpu_device.npu.run SCRIPT`` runs a
vLLM script on vLLM-Ascend with it. Items and reasons: ``stand_in.py``; kernels: ``ops.py``; runtime: ``runtime.py``;
process groups: ``hccl.py``; doc: ``docs/ascend_on_cpu.md``.
"""
