"""Small compatibility and bug-fix helpers that the verl patches call.

Each module here is the logic behind one patch of ``patches/verl/`` (the patch only wires it):

* :mod:`qwen3_rl.compat.vllm_imports` -- vLLM names that moved between releases (0001).
* :mod:`qwen3_rl.compat.rollout_progress` -- the rollout's tqdm progress switch (0002).
* :mod:`qwen3_rl.compat.meta_info` -- tolerant merge of per-worker ``meta_info['timing']`` (0003).
* :mod:`qwen3_rl.compat.allocator` -- expandable-segments hot swap on CUDA and NPU (0004).
* :mod:`qwen3_rl.compat.torch_compile` -- the real ``torch.compile`` for the rollout under MindSpeed (0009).
* :mod:`qwen3_rl.compat.capture_sizes` -- ``rollout.cudagraph_capture_sizes`` also as a plain list (0011).
* :mod:`qwen3_rl.compat.switches` -- reading the off switches of 0004, 0009 and 0011.

Nothing here imports vLLM, verl or torch_npu at module import time.
"""
