"""Server-mode rollout on CPU (marker ``server``): verl's agent loop over vLLM servers (``ROLLOUT_MODE=async``),
driven by the product command ``bash ray_start_npu.sh internal/train_grpo_tiny_cpu.sh --device cpu``.

verl 0.6.1's ``AgentLoopManager`` starts one ``vLLMHttpServer`` per rollout replica (here 2: one per worker process,
rollout TP 1); each server runs vLLM 0.13's ``AsyncLLM`` whose engine core drives the model in the Megatron worker
process over ZeroMQ (verl 0010: the vLLM 0.13 server API; 0011: no sleep mode without free_cache_engine; 0012: the
weight sync every step). With ``SERVER_ROUTING`` a prompt's samples go to one server (the verl seam's server hooks,
``qwen3_rl.rollout.server_routing``); with ``SAM_ENABLE SAM_GROUP`` the SAM drafter runs in the servers' engines.

What is checked, in one training run (2 steps, validation before and after), against the sync GRPO learning run of
``test_e2e_training`` (the ``grpo_on_run`` fixture, shared):

* the run learns: validation accuracy after 2 steps >= before + 0.10;
* SAM drafts in the servers' engines: every step's ``rollout/spec_decode/*`` (read from the servers) has drafted and
  accepted tokens > 0;
* siblings on one engine: from the servers' own request records (the probe in ``vLLMHttpServerBase.generate``, not
  the router's counts) every prompt's requests were answered by one server, and both servers answered requests; the
  router's step metrics say the same (1.0) and put verl's own routing, replayed on the same requests, lower;
* endpoint key: each server's ``/v1/models`` answers 401 without a key and with a wrong one, 200 with the server's
  own key (made in the server, per run), and the key is in no log (verl prints the server arguments masked);
* weight sync: at every sync each engine's parameters equal the actor's export exactly, and the update reaches the
  engines (the last sync differs from the first);
* greedy output equals the sync rollout's: the validation before training (greedy, the 64 test prompts, the same
  initial weights) gives the same responses in server mode as in the sync SPMD rollout.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from test_e2e_training import LEARNING_MARGIN, Run, _tail, check_weight_sync, launch, report, val_accuracy

pytestmark = [pytest.mark.e2e, pytest.mark.server]

STEPS = 2
SERVER = {"ROLLOUT_MODE": "async", "SERVER_ROUTING": "True", "SAM_ENABLE": "True", "SAM_GROUP": "True",
          "TOTAL_TRAINING_STEPS": str(STEPS)}


def _val_dump(run_dir: Path, step: int) -> dict[str, str]:
    """verl's validation dump (``trainer.validation_data_dir``) of ``step``: prompt -> response."""
    f = run_dir / "val_data" / f"{step}.jsonl"
    assert f.is_file(), f"verl wrote no validation dump {f}"
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return {r["input"]: r["output"] for r in rows}


@pytest.mark.timeout(1800)
def test_server_mode_grpo(cpu_ws: Path, grpo_on_run: Run, tmp_path: Path) -> None:
    model = cpu_ws / "tiny" / "qwen3_tiny"
    run_dir = tmp_path / "server"
    srv = launch(cpu_ws, "internal/train_grpo_tiny_cpu.sh", run_dir, env=SERVER,
                 args=[f"+trainer.validation_data_dir={run_dir / 'val_data'}"])
    assert srv.rc == 0, _tail(srv)
    doc = report(srv)
    trained = sorted(int(s) for s, m in doc["steps"].items() if "timing_s/step" in m)
    assert trained == list(range(1, STEPS + 1)), trained

    # learning
    before, after = val_accuracy(doc, 0), val_accuracy(doc, STEPS)
    print(f"server mode: val accuracy {before:.3f} -> {after:.3f} after {STEPS} steps ({srv.seconds:.0f} s)")
    assert after >= before + LEARNING_MARGIN, f"no learning in server mode: {before:.3f} -> {after:.3f}"

    # SAM in the servers' engines, counted by the servers
    for s in trained:
        m = doc["steps"][str(s)]
        drafted, accepted = m.get("rollout/spec_decode/draft_tokens", 0), m.get("rollout/spec_decode/accepted_tokens", 0)
        print(f"step {s}: drafted {drafted:.0f}, accepted {accepted:.0f}, routing "
              f"{ {k.split('/')[-1]: round(v, 3) for k, v in m.items() if k.startswith('rollout/routing/')} }")
        assert drafted > 0 and accepted > 0, f"step {s}: no drafts counted by the servers ({drafted}, {accepted})"
        assert m["rollout/routing/sibling_same_engine"] == 1.0
        assert m["rollout/routing/verl_sibling_same_engine"] < 1.0  # verl's routing splits the groups

    # siblings on one engine, from the servers' own records; a generation call starts with a weight sync, so the
    # requests after the k-th sync of rank 0 belong to call k (a prompt may move between calls: routing balances)
    served = srv.of("server_request")
    syncs = sorted(e["time"] for e in srv.of("weight_sync") if e["rank"] == 0)
    replicas_of: dict[tuple[int, str], set[int]] = defaultdict(set)
    for e in served:
        call = sum(t <= e["time"] for t in syncs)
        replicas_of[call, e["key"]].add(e["replica"])
    split = {k: r for k, r in replicas_of.items() if len(r) > 1}
    assert not split, f"{len(split)} prompts answered by more than one server in a call, e.g. {next(iter(split.items()))}"
    assert len({call for call, _ in replicas_of}) == STEPS + 2, "expected 2 validation and 2 training calls"
    assert {e["replica"] for e in served} == {0, 1}, "only one server answered: nothing was routed"
    train_requests = [e for e in served if e["tokens"] > 0]
    assert len(train_requests) >= STEPS * 16 * 8, len(train_requests)

    # the servers' HTTP endpoints answer only with their own key, which no log shows
    auth = srv.of("server_auth")
    assert sorted(e["replica"] for e in auth) == [0, 1], auth
    for e in auth:
        assert e["status"] == {"no_key": 401, "wrong_key": 401, "right_key": 200}, e
    logs = srv.log + "".join(f.read_text(errors="replace") for f in (run_dir / "logs").glob("*.log"))
    assert "--api_key" in logs and "'***'" in logs, "verl's printed server arguments do not show the masked key"
    assert not [e["replica"] for e in auth if e["key"] in logs], "a server's API key is in the logs"

    # weight sync into the servers' engines (both worker processes, every step, exact)
    check_weight_sync(srv, model)
    assert len(srv.of("weight_sync")) >= 2 * (STEPS + 2), "expected a sync per generation on both ranks"

    # greedy output: server mode == sync SPMD rollout (the sync GRPO learning run's validation before training,
    # SAM group on as here; its other switches leave generation alone), same initial weights
    assert grpo_on_run.rc == 0, _tail(grpo_on_run)
    got, want = _val_dump(run_dir, 0), _val_dump(grpo_on_run.probe.parent, 0)
    assert set(got) == set(want) and len(got) == 64
    same = sum(got[p] == want[p] for p in want)
    print(f"greedy validation responses equal to the sync rollout's: {same} of {len(want)}")
    assert same == len(want), [p for p in want if got[p] != want[p]][:2]
