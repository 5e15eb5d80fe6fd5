"""The current set's verl 0.9.1 bug fix (``patches/current/verl``) executed in the real 0.9.1 code, with the pristine
0.9.1 tree as the positive control, and the seed-set fix not carried over shown unneeded on the pristine tree.

0001 (GroupedMLP dist load): ``verl.utils.model.load_mcore_dist_weights`` on a megatron-core 0.16.1 MoE model whose
experts are the legacy ``GroupedMLP`` (``helpers/verl091_dist_load_driver.py``): on the patched tree every parameter
comes back equal to the saved one, without and with a key prefix; on the pristine tree exactly the experts'
weight1 / weight2 stay NaN.

Seed 0009 (fail fast) is not needed: a ``RayWorkerGroup`` of two verl ``Worker`` actors in a local Ray on 127.0.0.1
(``helpers/verl091_fail_fast_driver.py``): with one worker raising or killed while the other blocks for 600 s, the
pristine tree's registered-method call (``func_generator``'s ``ray.get``, ``base.py:56``) and ``execute_all_sync``
(``:860``) raise within :data:`WAIT_S` (Ray 2.52.1's ``ray.get`` on a list raises the first error it sees); without
failures both return the ranks in order.

All of it runs in the verl 0.9.1 venv (``bash tests/setup_verl091_env.sh``); ``grouped_gemm`` is the PyTorch stand-in
of ``tests/helpers/grouped_gemm_cpu`` (GroupedMLP's constructor asserts the package; nothing here runs its kernel).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, free_port
from helpers.current_verl import patched_files, patched_verl, pristine_verl, run_in_venv, series

WAIT_S = 20.0  # a failure must surface within this (the other worker sleeps 600 s)
HELPERS = REPO / "tests" / "helpers"
GROUPED_GEMM = HELPERS / "grouped_gemm_cpu"


def _driver(name: str, tree: Path, args: list[str], timeout: float) -> dict:
    """Run ``helpers/<name>`` in the verl 0.9.1 venv on ``tree``; its JSON output (the last argument is written)."""
    proc = run_in_venv([str(HELPERS / name), *args], path=[tree, GROUPED_GEMM, REPO], timeout=timeout, cwd=tree,
                       env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                            "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    assert proc.returncode == 0, f"{name} on {tree} (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    out = next(a for a in args if a.endswith(".json"))
    return json.loads(Path(out).read_text())


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl091")
    return {"pristine": pristine_verl(), "patched": patched_verl(root)}


def test_series_applies_and_changes_its_files(trees: dict[str, Path]) -> None:
    patches = series()
    assert [p.name for p in patches] == ["0001-verl-bugfix-mcore_dist_load_grouped_mlp.patch"]
    for patch in patches:
        text = patch.read_text()
        assert "\nVerified: upstream code on CPU (" in text, patch.name
        for f in patched_files(patch):
            assert (trees["patched"] / f).read_bytes() != (trees["pristine"] / f).read_bytes(), f
    check = subprocess.run(["git", "apply", "--check", "-R", *map(str, patches)], cwd=trees["patched"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.fixture(scope="module")
def fail_fast(trees: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fail-fast driver's result on the pristine tree (its own local Ray)."""
    out = tmp_path_factory.mktemp("failfast") / "pristine.json"
    return _driver("verl091_fail_fast_driver.py", trees["pristine"], [str(out), str(WAIT_S)], 600)


FAIL_CASES = [f"{case}/{call}" for case in ("raises", "killed") for call in ("decorated", "execute_all_sync")]


def test_pristine_worker_group_values_in_rank_order(fail_fast: dict) -> None:
    assert fail_fast["values"] == {"decorated": [0, 1], "execute_all_sync": [0, 1]}


@pytest.mark.parametrize("case", FAIL_CASES)
def test_pristine_worker_group_raises_while_another_worker_blocks(fail_fast: dict, case: str) -> None:
    """Seed patch 0009 is not needed on verl 0.9.1 with this Ray: the whole-list ``ray.get`` raises the failed
    worker's error while the other worker still sleeps (the driver's ``blocked`` would fail this)."""
    res = fail_fast[case]
    print(f"\n{case}: pristine {res}")
    assert res["outcome"] == "raised", res
    assert res["error"] == ("RayTaskError(RuntimeError)" if case.startswith("raises") else "ActorDiedError"), res


@pytest.fixture(scope="module")
def dist_load(trees: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{run: the load driver's result} for the patched tree without and with a key prefix and the pristine tree."""
    out = tmp_path_factory.mktemp("distload")
    runs = {"patched": ("patched", ""), "patched-prefix": ("patched", "model."), "pristine": ("pristine", "")}
    with ThreadPoolExecutor(3) as pool:
        futs = {name: pool.submit(_driver, "verl091_dist_load_driver.py", trees[tree],
                                  [str(out / f"{name}-ckpt"), str(out / f"{name}.json"), prefix], 300)
                for name, (tree, prefix) in runs.items()}
        return {name: f.result() for name, f in futs.items()}


@pytest.mark.parametrize("run", ["patched", "patched-prefix"])
def test_patched_dist_load_fills_grouped_mlp(dist_load: dict[str, dict], run: str) -> None:
    res = dist_load[run]
    assert res["experts"] == ["GroupedMLP"]
    assert res["params"] > 10 and res["nan"] == [] and res["differ"] == [], res


def test_pristine_dist_load_misses_exactly_the_grouped_mlp_experts(dist_load: dict[str, dict]) -> None:
    """Positive control: verl 0.9.1's load (result of dist_checkpointing.load dropped) leaves GroupedMLP's
    weight1 / weight2 (ShardedTensorFactory) at NaN and loads everything else."""
    res = dist_load["pristine"]
    assert res["experts"] == ["GroupedMLP"]
    want = [f"decoder.layers.{i}.mlp.experts.weight{w}" for i in range(2) for w in (1, 2)]
    assert res["nan"] == want and res["differ"] == want, res
