"""``python -m qwen3_rl sam-warm-cache``: fill numba's disk cache with every SAM drafter kernel (image build)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    """``python -m qwen3_rl sam-warm-cache``: compile every SAM kernel into numba's disk cache.

    Run once at image build (``Dockerfile.vllm_ascend.mindspeed.qwen3``) so that every engine process of a run
    loads the machine code instead of compiling it while it constructs its drafter (~14 s per process with a cold
    cache, ~0.1 s with a warm one: docs/sam_decoding.md). Exits 1 when numba has no cache to write to.
    """
    import argparse
    import time

    from qwen3_rl.spec_decode import _sam_kernels
    from qwen3_rl.spec_decode.config import parse_sam_options
    from qwen3_rl.spec_decode.runner_drafter import _warm_up

    ap = argparse.ArgumentParser(prog="python -m qwen3_rl sam-warm-cache", description=main.__doc__)
    ap.parse_args(argv)
    if not _sam_kernels.CACHE:
        print("error: numba's disk cache is off here (NUMBA_BOUNDSCHECK=1, or no writable __pycache__ / "
              "NUMBA_CACHE_DIR): nothing to warm", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    _warm_up(parse_sam_options({"group_mode": True, "group_exchange": True, "history_responses": 2, "adaptive_k": True}))
    print(f"sam-warm-cache: every SAM kernel compiled and cached in {time.perf_counter() - t0:.1f} s "
          f"({os.environ.get('NUMBA_CACHE_DIR') or Path(_sam_kernels.__file__).parent / '__pycache__'})")
    return 0
