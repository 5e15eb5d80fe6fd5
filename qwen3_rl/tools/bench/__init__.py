"""Benchmarks printing figures: ``python -m qwen3_rl.tools.bench.<name> ... --json``."""
