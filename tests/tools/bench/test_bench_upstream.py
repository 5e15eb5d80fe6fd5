"""The benchmarks run as the README shows compare against the pinned upstream trees of the workspace
($QWEN3_RL_WORKSPACE), fetch a missing tree from the pinned wheel, and without PyPI name the command that
creates it (qwen3_rl.tools.bench.upstream_trees)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qwen3_rl.tools.upstream.common import UpstreamError

REPO = Path(__file__).resolve().parents[3]


def _bench(module: str, *args: str, workspace: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "QWEN3_RL_WORKSPACE": str(workspace)}
    return subprocess.run([sys.executable, "-m", f"qwen3_rl.tools.bench.{module}", *args], cwd=REPO, text=True,
                          capture_output=True, env=env, timeout=600)


def test_benches_compare_against_the_workspace_trees(pristine_workspace: Path, tmp_path: Path) -> None:
    """No tree options: the workspace's vLLM / vLLM-Ascend / verl trees are used (here the pinned wheels' sources)."""
    from qwen3_rl.tools.bench.eplb import DEFAULT_POLICIES, synthetic_loads, write_csv

    csv = tmp_path / "loads.csv"
    write_csv(csv, synthetic_loads(num_layers=3, num_experts=16, tokens=500))
    proc = _bench("eplb", "--loads", str(csv), "--num-ranks", "4", "--redundant", "4", "--json",
                  workspace=pristine_workspace)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    for name in DEFAULT_POLICIES:
        if name != "identity":  # identity has no redundant experts
            assert 0.0 < res[name]["balancedness"] <= 1.0, (name, res[name])
    assert {"vllm_default", "ascend_dynamic_ep", "ascend_flashlb"} <= set(DEFAULT_POLICIES)
    proc = _bench("hdp", "--sizes", "16", "--cp", "4", "--batches", "1", "--json", workspace=pristine_workspace)
    assert proc.returncode == 0, proc.stderr
    case = json.loads(proc.stdout)["cases"]["cp4_n16"]
    assert case["pure_cp_ratio"] >= 1.0 and case["pure_dp_ratio"] > 0.0  # pure DP ignores the budget: may be < 1


def test_missing_tree_is_made_from_the_pinned_wheel(pristine_workspace: Path, tmp_path: Path) -> None:
    """An empty workspace: the hdp bench unpacks verl's pinned wheel into it (the wheel cache is warm from the
    pristine_workspace fixture) and compares; the download log goes to stderr, stdout stays JSON."""
    ws = tmp_path / "ws"
    proc = _bench("hdp", "--sizes", "16", "--cp", "4", "--batches", "1", "--json", workspace=ws)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["cases"]["cp4_n16"]["pure_cp_ratio"] >= 1.0
    assert (ws / "verl" / "verl" / "utils" / "seqlen_balancing.py").is_file()
    assert "verl:" in proc.stderr and "created from" in proc.stderr


def test_missing_tree_without_pypi_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import qwen3_rl.tools.upstream.download as download
    from qwen3_rl.tools.bench import eplb, hdp
    from qwen3_rl.tools.bench.upstream_trees import UpstreamTreeError, upstream_tree

    def no_pypi(fw, dest, wheel_dir, *a, **k):
        raise UpstreamError(f"{fw.key}: no wheel (PyPI unreachable)")

    monkeypatch.setenv("QWEN3_RL_WORKSPACE", str(tmp_path / "ws"))
    monkeypatch.setattr(download, "download_pypi", no_pypi)
    assert hdp.main(["--sizes", "8", "--cp", "4", "--batches", "1", "--json"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: no verl tree at {tmp_path / 'ws' / 'verl'} and fetching")
    assert "(verl: no wheel (PyPI unreachable)); create it with: bash download_frameworks_source_code.sh " \
           "--source pypi --only verl" in err
    # eplb: the upstream policies report an error, ours still run; one hint line per missing tree
    vllm_tree, ascend_tree = eplb.baseline_trees(("ours", "vllm_default", "ascend_flashlb"), None, None)
    assert (vllm_tree, ascend_tree) == (None, None)
    hints = capsys.readouterr().err.splitlines()
    assert [h.split(" tree at")[0] for h in hints] == ["hint: no vllm", "hint: no vllm_ascend"]
    assert hints[1].endswith("create it with: bash download_frameworks_source_code.sh --source pypi --only vllm_ascend")
    res = eplb.run_case(np.full((2, 8), 10), 4, 1, 1, 0, ("ours", "vllm_default", "ascend_flashlb"))
    assert res["ours"]["balancedness"] == pytest.approx(1.0)
    assert res["vllm_default"]["error"].startswith("FileNotFoundError: no vLLM tree")
    assert res["ascend_flashlb"]["error"].startswith("FileNotFoundError: no vLLM-Ascend tree")
    # a tree given on the command line is used as is, or refused in one line
    with pytest.raises(UpstreamTreeError, match=f"^{tmp_path} holds no verl/ \\(the verl tree\\)"):
        upstream_tree("verl", tmp_path)
    (tmp_path / "verl").mkdir()
    assert upstream_tree("verl", tmp_path) == tmp_path
