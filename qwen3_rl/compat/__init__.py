"""Small compatibility and bug-fix helpers that the verl patches call.

Each module here is the logic behind one patch of ``patches/verl/`` (the patch only wires it):

* :mod:`qwen3_rl.compat.vllm_imports` -- vLLM names that moved between releases (0001).
* :mod:`qwen3_rl.compat.rollout_progress` -- the rollout's tqdm progress switch (0002).
* :mod:`qwen3_rl.compat.meta_info` -- tolerant merge of per-worker ``meta_info['timing']`` (0003).

Nothing here imports vLLM, verl or torch_npu at module import time.
"""
