"""Dataset preparation (tooling): ``python -m qwen3_rl data prepare``."""
