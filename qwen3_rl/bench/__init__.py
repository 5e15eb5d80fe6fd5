"""Benchmarks printing figures: ``python -m qwen3_rl.bench.<name> ... --json``."""
