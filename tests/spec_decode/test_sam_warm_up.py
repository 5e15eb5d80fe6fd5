"""The SAM drafter's load-time warm-up (``runner_drafter._warm_up``).

* In a fresh process, building a ``SamRunnerDrafter`` (what ``SamVllmProposer`` and the Ascend adapter do
  in their constructors) leaves every kernel of the runner's path compiled: numba dispatchers with a
  signature, so the first decode step compiles nothing.
* The warm-up runs on throwaway drafters: the drafter built holds nothing, and it drafts exactly as one
  built without warm-up, step by step, on the same batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from qwen3_rl.spec_decode import runner_drafter
from qwen3_rl.spec_decode.config import parse_sam_options
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter

REPO = Path(__file__).resolve().parents[2]
#: Kernels the runner's Python code calls (extend: appends, warm pass, cache pointers; drafts; hash growth).
#: Kernels they call are compiled into them (a process that loads them from numba's disk cache gives the
#: callees no signature of their own), so these are the ones a first call would compile.
CORE = ("extend_batch", "propose_batch", "root_rehash", "hub_rehash")
#: Kernels of the sibling exchange (only with ``group_exchange``).
EXCHANGE = ("pack_pending", "gather_tails", "parse_messages", "shadow_fast")

_PROBE = """
import json, sys
from qwen3_rl.spec_decode import _sam_kernels as K
from qwen3_rl.spec_decode.config import parse_sam_options
from qwen3_rl.spec_decode.runner_drafter import SamRunnerDrafter
before = {n: len(getattr(K, n).signatures) for n in sys.argv[2].split(",")}
d = SamRunnerDrafter(parse_sam_options(json.loads(sys.argv[1])), 512)
after = {n: len(getattr(K, n).signatures) for n in sys.argv[2].split(",")}
print("PROBE " + json.dumps({"before": before, "after": after, "requests": len(d.request_ids),
                             "nbytes": d.drafter.nbytes(), "groups": d.drafter.num_groups()}))
"""


def _probe(sam_config: dict, names: tuple[str, ...]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(sam_config), ",".join(names)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE "):])


@pytest.mark.parametrize("sam_config,names", [({}, CORE), ({"group_mode": True, "group_exchange": True},
                                                            CORE + EXCHANGE)])
def test_construction_compiles_every_kernel_of_the_runner_path(sam_config: dict, names: tuple[str, ...]) -> None:
    r = _probe(sam_config, names)
    assert all(v == 0 for v in r["before"].values()), r["before"]  # a fresh process: nothing compiled yet
    assert all(v >= 1 for v in r["after"].values()), r["after"]
    assert r["requests"] == 0 and r["groups"] == 0 and r["nbytes"] == _fresh_nbytes(sam_config)


def _fresh_nbytes(sam_config: dict) -> int:
    from qwen3_rl.spec_decode.sam import SamProposer

    return SamProposer(parse_sam_options(sam_config)).nbytes()


def _batch(texts: list[np.ndarray], ids: list[str], nums: list[int], plen: int) -> SimpleNamespace:
    tok = np.zeros((len(texts), max(t.shape[0] for t in texts)), np.int32)
    for i, t in enumerate(texts):
        tok[i, : t.shape[0]] = t
    return SimpleNamespace(num_reqs=len(ids), req_ids=list(ids), req_id_to_index={r: i for i, r in enumerate(ids)},
                           token_ids_cpu=tok, num_tokens_no_spec=np.asarray(nums, np.int32),
                           num_prompt_tokens=np.full(len(ids), plen, np.int32), spec_decode_unsupported_reqs=set())


@pytest.mark.parametrize("sam_config", [{}, {"group_mode": True, "cache_max_responses": 2},
                                        {"group_mode": True, "group_exchange": True}])
def test_warm_up_leaves_no_state(monkeypatch: pytest.MonkeyPatch, sam_config: dict) -> None:
    opts = parse_sam_options(sam_config)
    warm = SamRunnerDrafter(opts, 512)
    monkeypatch.setattr(runner_drafter, "_warm_up", lambda config: None)  # a drafter built without warm-up
    cold = SamRunnerDrafter(opts, 512)
    assert warm.request_ids == cold.request_ids == set()
    assert warm.drafter.nbytes() == cold.drafter.nbytes() and warm.drafter.num_groups() == 0
    # the warm-up's own text (same prompt, same token ids) must not be drafted from
    rng = np.random.default_rng(3)
    prompt = runner_drafter._WARM_PROMPT
    texts = [np.concatenate([prompt, rng.integers(0, 16, 80, dtype=np.int32)]) for _ in range(2)]
    ids = ["a", "b"]
    nums = [prompt.shape[0]] * 2
    drafted = 0
    for step in range(20):
        fin: set[str] = set()
        if step == 12:  # b finishes (group mode: its response enters the cache)
            ids, texts, nums, fin = ids[:1], texts[:1], nums[:1], {"b"}
        b = _batch(texts, ids, nums, prompt.shape[0])
        out = SimpleNamespace(finished_req_ids=fin, scheduled_new_reqs=())
        out_w = warm.step(b, [[1]] * b.num_reqs, None, out)
        out_c = cold.step(b, [[1]] * b.num_reqs, None, out)
        assert out_w == out_c, step
        drafted += sum(map(len, out_w))
        nums = [n + 1 + (step + i) % 3 for i, n in enumerate(nums)]
    assert drafted > 0
    assert warm.drafter.nbytes() == cold.drafter.nbytes()


def test_warm_cache_command_fills_numba_cache(tmp_path) -> None:
    """``python -m qwen3_rl sam-warm-cache`` (run at image build) leaves every kernel in numba's disk cache; a second
    process finds them there (it reports the same cache and exits 0)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")} | {"NUMBA_CACHE_DIR": str(tmp_path)}
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "sam-warm-cache"], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert str(tmp_path) in proc.stdout
    index = sorted(p.name for p in tmp_path.rglob("*.nbi"))
    assert any(n.startswith("_sam_kernels.") for n in index), index
    assert any(n.startswith("adaptive_k.") for n in index), index  # the adaptive draft-length kernels too
    assert len(list(tmp_path.rglob("*.nbc"))) >= len(index) > 5


def test_warm_cache_command_refuses_without_cache() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ) | {"NUMBA_BOUNDSCHECK": "1"}
    proc = subprocess.run([sys.executable, "-m", "qwen3_rl", "sam-warm-cache"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "numba's disk cache is off" in proc.stderr, proc.stderr
