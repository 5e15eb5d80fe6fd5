"""qwen3_rl: feature logic for GRPO/DAPO post-training of Qwen3 on Atlas A3 NPU clusters.

The upstream frameworks (verl, vLLM, vLLM-Ascend, Megatron-core, MindSpeed) are patched with the
small wiring patches under ``patches/``; everything the patches call lives in this package.
Commands: ``python -m qwen3_rl --help``.
"""

__version__ = "0.1.0"
