"""``python -m qwen3_rl eval merge|score|compare``: from a training checkpoint to an accuracy table.

* :mod:`qwen3_rl.tools.eval.merge` -- a verl Megatron checkpoint (``global_step_N/actor``) to a Hugging Face
  directory through verl 0.6.1's own ``python -m verl.model_merger merge --backend megatron``, after checking
  that the checkpoint is complete;
* :mod:`qwen3_rl.tools.eval.score` -- generate with vLLM (offline ``LLM`` or an OpenAI-compatible server) on AIME 2024
  or gsm8k test, judge with the training reward (``qwen3_rl/data/reward.py``), accuracy over rounds;
* :mod:`qwen3_rl.tools.eval.compare` -- before / after table (and plot) beside [ref 004]'s published figures.
"""
