"""Loaded by every Python process of the tiny CPU training runs (this folder is first on ``PYTHONPATH``, which
the train scripts hand to Ray's workers): applies the device-layer shims and the test probes in each process.

Acts only when the test sets ``QWEN3_RL_CPU_SHIMS=1`` (any other process that happens to inherit the path is
untouched):

* ``megatron_shims.install()`` once ``torch`` is imported: the device calls and fused kernels megatron-core / verl's workers need on a CPU
  (each shim and its reason in ``megatron_shims.py``);
* ``gloo_shims.install()``: collective shapes gloo refuses (0-d all_gather);
* the rejection-sampling kernels of ``shims.py`` (vLLM-Ascend's PyTorch implementations in place of
  vLLM's Triton kernels), installed when ``vllm.v1.sample.rejection_sampler`` is first imported, from the engine
  workspace ``QWEN3_RL_ENGINE_WS``; its expert-parallel dispatch / combine and expert map of vLLM's CPU MoE kernel
  when ``vllm.model_executor.layers.fused_moe.cpu_fused_moe`` is first imported;
* the observation probes of ``probe.py`` when ``QWEN3_RL_E2E_PROBE_DIR`` is set;
* with ``QWEN3_RL_CPU_ROLLOUT=ascend``: the rollout on vLLM-Ascend's own engine (``NPUWorker`` ->
  ``NPUModelRunner``) instead of vLLM's CPU runner. When ``vllm`` is first imported (in the rollout workers, after
  verl has settled on the CPU device), the NPU stand-in (``npu/stand_in.py``) is installed, the workspace's patched
  vLLM-Ascend tree is put on ``sys.path`` and its platform plugin selected (``npu/run.py``'s ``prepare``); in the
  engine core that verl's vLLM server spawns (server mode: ``VERL_VLLM_ZMQ_ADDRESSES`` set) at start-up.
"""

import os

if os.environ.get("QWEN3_RL_CPU_SHIMS") == "1":
    import sys
    from pathlib import Path

    _here = Path(__file__).resolve().parent
    if str(_here) not in sys.path:
        sys.path.insert(0, str(_here))
    import post_import

    def _device_shims(_torch):  # noqa: ANN001 (only processes that import torch pay for the shims; Ray's own don't)
        import gloo_shims
        import megatron_shims

        megatron_shims.install()
        gloo_shims.install()

    post_import.after_import("torch", _device_shims)

    def _rejection_sampler(_module):  # noqa: ANN001
        import shims

        shims.install_ascend_pytorch_rejection_sampler(Path(os.environ["QWEN3_RL_ENGINE_WS"]) / "vllm-ascend")

    post_import.after_import("vllm.v1.sample.rejection_sampler", _rejection_sampler)

    def _expert_parallel(_module):  # noqa: ANN001
        import shims

        shims.install_cpu_expert_parallel()

    post_import.after_import("vllm.model_executor.layers.fused_moe.cpu_fused_moe", _expert_parallel)
    if os.environ.get("QWEN3_RL_CPU_ROLLOUT") == "ascend":

        def _ascend_rollout(_module):  # noqa: ANN001
            os.environ["VLLM_PLUGINS"] = "ascend,qwen3_rl"  # the platform plugin and ours (the CPU profile: "qwen3_rl" only)
            from qwen3_rl.cpu_device.npu import run as ascend_run

            ascend_run.prepare([str(Path(os.environ["QWEN3_RL_ENGINE_WS"]) / "vllm-ascend")])
            # the stand-in "NPU" has no Triton backend (an A3 has triton-ascend): vLLM-Ascend must take its PyTorch
            # paths (worker/worker.py:106 imports torch_npu._inductor when HAS_TRITON). In the Ray workers the
            # host's Triton reports an active driver (the CPU shims' torch.cuda), so say it here.
            import vllm.triton_utils
            import vllm.triton_utils.importing

            vllm.triton_utils.HAS_TRITON = vllm.triton_utils.importing.HAS_TRITON = False

        if os.environ.get("VERL_VLLM_ZMQ_ADDRESSES"):
            # verl's server mode: this is the engine core verl's vLLM server spawned (the server sets the variable right
            # before it starts AsyncLLM); the spawned child unpickles vllm_ascend objects (which import torch_npu)
            # before anything imports vllm, so the stand-in goes in now
            _ascend_rollout(None)
        else:
            post_import.after_import("vllm", _ascend_rollout)
    if os.environ.get("QWEN3_RL_E2E_PROBE_DIR"):
        import probe

        probe.install(os.environ["QWEN3_RL_E2E_PROBE_DIR"])
