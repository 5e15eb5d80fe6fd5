"""Every Python process of ``tests/upstream_own/vllm_ascend_cpu.py``'s pytest runs (this folder is on their
``PYTHONPATH``) starts with the CPU stand-in for ``torch_npu`` installed (``qwen3_rl/cpu_device/npu``), as
vLLM-Ascend's own unit-test CI has torch_npu installed in every process (imported by vLLM-Ascend, not autoloaded:
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), e.g. the subprocess in which vLLM inspects a model class. A process of
another interpreter (without torch) is left alone."""

import importlib.util

if importlib.util.find_spec("torch") is not None:
    from qwen3_rl.cpu_device.npu import stand_in

    stand_in.install()
