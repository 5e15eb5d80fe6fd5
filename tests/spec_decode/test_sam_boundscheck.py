"""The SAM kernels under ``NUMBA_BOUNDSCHECK=1`` (tests/run_tests.sh runs the SAM tests so once more).

The kernels reach the drafter's numpy arrays through raw addresses, but every access of the append,
match and draft paths goes through an int32 view of the whole array (``_view(address, capacity)``, a
numba ``carray``), so array indexing, and with it numba's bounds check, applies up to the capacity.
This file shows, in a fresh process with bounds checking on (numba reads the switch at import; its disk
cache must not hand back code compiled without checks, hence a new ``NUMBA_CACHE_DIR``), that an index
one past a view's end raises ``IndexError`` instead of reading the next bytes, both on a bare view and in
the real append kernel fed a corrupted state index. The read-only warm pass (``warm_batch``) reads single
records at computed addresses and is switched off in the corrupted case (it is not bounds-checked).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core import config as numba_config

from qwen3_rl.spec_decode import _sam_kernels as K

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import numpy as np
from numba import njit
from numba.core import config
from qwen3_rl.spec_decode import _sam_kernels as K
from qwen3_rl.spec_decode.sam import SamProposer

assert config.BOUNDSCHECK, "NUMBA_BOUNDSCHECK not in effect"
assert K.CACHE is False  # no disk cache under bounds checking (numba's cache key ignores the switch)

@njit
def read(addr, n, i):
    return K._view(addr, n)[i]

a = np.arange(10, dtype=np.int32)
assert read(a.ctypes.data, 10, 9) == 9
try:
    read(a.ctypes.data, 10, 10)
except IndexError:
    print("VIEW_RAISES")

p = SamProposer()
p._tuning.warm_lanes = 0  # the read-only warm pass reads records at computed addresses (unchecked)
p.add_request("r", [1, 2, 3, 1, 2])
s = p.slot_of("r")
a_ = int(p._SM[s, K.M_AUTO])
p._SM[s, K.M_LAST] = p._AM[a_, K.A_SCAP]  # one state past the state array's capacity
try:
    p.extend("r", [3])
except IndexError:
    print("KERNEL_RAISES")
"""


def test_out_of_range_index_raises_under_boundscheck(tmp_path: Path) -> None:
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["VIEW_RAISES", "KERNEL_RAISES"], proc.stdout + proc.stderr[-2000:]


def test_cache_falls_back_when_numba_has_no_cache_location(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a writable cache location numba raises at ``njit(cache=True)``: the kernels then compile
    without the disk cache instead of failing to import."""
    # this checkout's __pycache__ is writable: the cache is used unless bounds checking is on
    assert K.CACHE is K._cache_usable() is (not numba_config.BOUNDSCHECK)

    def no_locator(**kwargs):
        raise RuntimeError("cannot cache function '_cache_probe': no locator available for file")

    monkeypatch.setattr(K, "njit", no_locator)
    assert K._cache_usable() is False
