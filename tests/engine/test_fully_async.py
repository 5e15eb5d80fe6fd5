"""Fully-async GRPO on CPU (marker ``fully_async``): ``ray_start_npu.sh internal/train_grpo_tiny_cpu_fully_async.sh
--device cpu`` runs our fully-async trainer (``qwen3_rl.trainer.fully_async``): the trainer pool (one Megatron actor
process) and the rollout pool (one standalone vLLM 0.13 CPU server, verl's agent loop) on separate processes,
prompts streamed one group at a time, stale samples allowed (staleness 1), the running requests aborted at every
weight sync and resumed after it with their tokens so far (partial rollout), the weights broadcast over a stateless
gloo group, SAM group drafting on, the fully-async setups' off-policy correction on (``ROLLOUT_CORRECTION=token``,
the default: the requests ask vLLM for their log-probs and are drafted all the same, vllm 0004; verl's truncated
importance weights pi_old / pi_rollout reach the Megatron actor's policy loss).

What is checked, from the run's training log (``step:N - key:value`` lines; several lines may share a step):

* off-policy correction: every batch logs verl's ``rollout_corr/rollout_is_mean`` (the weights were computed);
* learning: validation accuracy (``val-core``, greedy, the 64 test problems) after the last update is at least 0.10
  above the accuracy before the first;
* staleness: every trained batch logs ``fully_async/staleness/mean`` and ``max``; every batch's max is at most
  ``ceil(STALENESS_THRESHOLD)`` = 1 and some batch was trained on samples started by an older weight version
  (max >= 1);
* partial rollout: requests were aborted at a weight sync (``fully_async/sync/aborted_requests``) and trajectories
  resumed after it were trained on (``fully_async/partial/resumed`` summed over the batches > 0);
* weight sync: every sync's per-tensor checksums matched on both sides (the trainer stops otherwise) and the last
  validation ran on the synced weights (learning);
* SAM across a pause: the rollout drafted tokens in a weight version that began with resumed requests
  (``rollout/spec_decode/draft_tokens`` > 0 for the version after a sync that aborted requests), and drafts
  were accepted;
* checkpoint and resume: the run saves after update 5 and the last (``SAVE_FREQ=5``; the checkpoint directory did
  not exist before, the run says it trains from scratch); a short second launch resumes from ``global_step_5``
  (``RESUME_MODE=resume_path``): it says it loaded it, the optimizer state it loaded (main parameters, Adam moments)
  equals the one saved at update 5 tensor by tensor, its first weight sync equals the first run's step-5 sync
  bitwise, it carries over as many prompts as the save recorded (taken and not trained) and trains update 6 only,
  on exactly the first run's update-6 prompts (verl's rollout dump; positive control: update 5's differ).

In the real vLLM 0.13 CPU engine (no Ray): a request resumed as a new request (its prompt = the original prompt + its
tokens so far, as the partial rollout sends it) continues the greedy output token for token with SAM group drafting
on, and the original prompt's length in ``extra_args`` keeps it in its siblings' drafter group (it drafts from the
finished sibling's answer kept in the group's history: more accepted tokens than the same resume without it).

On-policy at staleness 0, then a killed rollout worker (a short third launch, ``STALENESS_THRESHOLD=0``, 4 syncs, no
validation, the rollout's log-probs as the old ones: ``USE_ROLLOUT_LOG_PROBS=True ROLLOUT_CORRECTION=off``): in the
3 updates logged before the last sync, every batch's staleness is 0 (max and mean), each version started exactly
one update's prompts, and no request was running at a sync (nothing to abort: the rollout waits for the sync). In
the 4th sync the rollout worker kills itself (SIGKILL, by the probe, after the first tensor arrived): the run exits
non-zero within KILL_EXIT_BOUND_S of the kill with a one-line error naming the dead worker.

``bash tests/run_tests.sh -m fully_async`` runs these tests alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_e2e_training import (
    LEARNING_MARGIN,
    Run,
    _tail,
    actor_death_watch,
    check_resume_state,
    launch,
    prompts_of_step,
)

from qwen3_rl.spec_decode.metrics import ACCEPTED_TOKENS, DRAFT_TOKENS
from qwen3_rl.trainer.fully_async.stream import staleness_bound

from conftest import run_engine

pytestmark = pytest.mark.fully_async

SCRIPT = "internal/train_grpo_tiny_cpu_fully_async.sh"
#: the script's defaults, spelled out: 6 weight syncs, each after 1 update of 16 prompts x 8 samples; responses up
#: to 128 tokens and a vLLM batch of 1 sequence, so that generation, not training, is the slower side and requests
#: are running at a sync
RUN_ENV = {"SYNCS": "6", "TRIGGER_SYNC_STEPS": "1", "PPO_MINI_BATCH_SIZE": "16", "STALENESS_THRESHOLD": "1",
           "PARTIAL_ROLLOUT": "True", "ROLLOUT_MAX_NUM_SEQS": "1", "MAX_RESPONSE_LENGTH": "128",
           "SAM_ENABLE": "True", "SAM_GROUP": "True", "ROLLOUT_CORRECTION": "token", "SAVE_FREQ": "5"}
#: the resumed launch: from the update-5 checkpoint to the end of the same run (update 6), no validation, no save
RESUME_STEP = 5
RESUME_ENV = {**RUN_ENV, "RESUME_MODE": "resume_path", "VAL_BEFORE_TRAIN": "False", "TEST_FREQ": "-1",
              "SAVE_FREQ": "-1"}
_CARRIED_RE = re.compile(r"fully async: resumed at update (\d+) from (\S+), weight version (\d+), (\d+) prompts carried")
_STEP_RE = re.compile(r"step:(\d+) - (.*)$")


def step_metrics(log: str) -> dict[int, dict[str, float]]:
    """The ``step:N - key:value - ...`` lines of ``log``, merged per step (a later value of a key wins)."""
    steps: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        m = _STEP_RE.search(line)
        if not m:
            continue
        row = steps.setdefault(int(m.group(1)), {})
        for item in m.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            try:
                row[key.strip()] = float(value)
            except ValueError:
                continue
    return steps


def val_accuracies(steps: dict[int, dict[str, float]]) -> list[tuple[int, float]]:
    """(step, validation accuracy) in step order."""
    out = []
    for s in sorted(steps):
        keys = [k for k in steps[s] if k.startswith("val-core/") and "/acc/mean@" in k]
        assert len(keys) <= 1, keys
        if keys:
            out.append((s, steps[s][keys[0]]))
    return out


def test_step_metrics_parser() -> None:
    """The parser merges the lines of one step and keeps floats only (positive control of the e2e checks)."""
    log = ("(FullyAsyncTaskRunner pid=1) step:2 - fully_async/staleness/max:1 - a:0.5\n"
           "(FullyAsyncTaskRunner pid=1) step:2 - val-core/x/acc/mean@1:0.25 - b:text\n"
           "noise step:x\n")
    assert step_metrics(log) == {2: {"fully_async/staleness/max": 1.0, "a": 0.5, "val-core/x/acc/mean@1": 0.25}}
    assert val_accuracies(step_metrics(log)) == [(2, 0.25)]


@pytest.mark.timeout(2400)  # two launcher runs (the learning run, the resumed one)
def test_fully_async_learns_stale_partial_and_drafts_after_resume(cpu_ws: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert not ckpt.exists()
    run = launch(cpu_ws, SCRIPT, tmp_path / "run", env=RUN_ENV, ckpt=ckpt)
    tail = "\n".join(run.log.splitlines()[-60:])
    assert run.rc == 0, f"fully-async run failed (exit {run.rc}):\n{tail}"
    steps = step_metrics(run.log)
    acc = val_accuracies(steps)
    assert len(acc) >= 2 and acc[0][0] == 0, f"validation before training and after it expected, got {acc}"
    before, after = acc[0][1], acc[-1][1]
    trained = {s: m for s, m in steps.items() if s > 0}
    assert sorted(trained) == list(range(1, int(RUN_ENV["SYNCS"]) + 1)), f"trained steps {sorted(trained)}"
    for s, m in trained.items():
        assert "fully_async/staleness/mean" in m and "fully_async/staleness/max" in m, f"step {s}: {sorted(m)}"
        assert "rollout_corr/rollout_is_mean" in m, f"step {s}: no rollout correction: {sorted(m)}"
    is_mean = {s: round(m["rollout_corr/rollout_is_mean"], 4) for s, m in trained.items()}
    staleness = {s: m["fully_async/staleness/max"] for s, m in trained.items()}
    aborted = {s: m.get("fully_async/sync/aborted_requests", 0.0) for s, m in trained.items()}
    resumed = {s: m.get("fully_async/partial/resumed", 0.0) for s, m in trained.items()}
    drafted = {s: m.get(DRAFT_TOKENS, 0.0) for s, m in trained.items()}
    accepted = {s: m.get(ACCEPTED_TOKENS, 0.0) for s, m in trained.items()}
    print(f"fully async: validation accuracy {before:.3f} -> {after:.3f} in {run.seconds:.0f} s; staleness max per "
          f"batch {staleness}; requests aborted at the sync after each step {aborted}; resumed trajectories per "
          f"batch {resumed}; drafted tokens per version {drafted}; accepted {accepted}; mean IS weight per batch {is_mean}")
    assert after >= before + LEARNING_MARGIN, f"no learning: {before:.3f} -> {after:.3f} ({acc})"
    bound = staleness_bound(float(RUN_ENV["STALENESS_THRESHOLD"]))
    assert all(v <= bound for v in staleness.values()), f"a batch staler than {bound} versions: {staleness}"
    assert max(staleness.values()) >= 1, f"no batch was trained on stale samples: {staleness}"
    assert sum(aborted.values()) > 0, f"no request was running at a weight sync: {aborted}"
    assert sum(resumed.values()) > 0, f"no trajectory resumed after a sync was trained on: {resumed}"
    # the version after a sync that aborted requests starts with those requests resumed: it must still draft
    after_resume = [s + 1 for s, n in aborted.items() if n > 0 and s + 1 in drafted]
    assert after_resume, f"no version followed a sync with aborted requests: {aborted}"
    assert any(drafted[s] > 0 for s in after_resume), (
        f"no drafts in the versions after a resume {after_resume}: {drafted}")
    assert sum(accepted.values()) > 0, f"no drafted token was accepted: {accepted}"
    check_checkpoint_resume(cpu_ws, tmp_path, run, steps)


def check_checkpoint_resume(ws: Path, tmp_path: Path, run: Run, steps: dict[int, dict[str, float]]) -> None:
    """The learning run's checkpoints, then a second launch resumed from update RESUME_STEP (module docstring)."""
    last = int(RUN_ENV["SYNCS"])
    assert "Training from scratch" in run.log, "the first run did not start from scratch"
    assert sorted(int(p.name.rpartition("_")[2]) for p in run.ckpt.glob("global_step_*")) == [RESUME_STEP, last]
    assert (run.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    saved_carried = steps[RESUME_STEP]["fully_async/checkpoint/carried_prompts"]
    assert steps[last]["fully_async/checkpoint/carried_prompts"] == 0, "prompts left over after the last update"
    folder = run.ckpt / f"global_step_{RESUME_STEP}"
    resumed = launch(ws, SCRIPT, tmp_path / "resumed", env=RESUME_ENV, ckpt=run.ckpt,
                     args=[f"trainer.resume_from_path={folder}"])
    tail = "\n".join(resumed.log.splitlines()[-60:])
    assert resumed.rc == 0, f"resumed run failed (exit {resumed.rc}):\n{tail}"
    assert f"Load from checkpoint folder: {folder}" in resumed.log, tail
    said = _CARRIED_RE.search(resumed.log)
    assert said, f"the resumed run did not report its resume:\n{tail}"
    step, carried = int(said.group(1)), int(said.group(4))
    trained = sorted(s for s, m in step_metrics(resumed.log).items() if "fully_async/staleness/max" in m)
    print(f"resume: loaded update {step} (weight version {said.group(3)}), {carried} prompts carried over "
          f"(the save recorded {saved_carried:.0f}), trained updates {trained}, {resumed.seconds:.0f} s launcher run")
    assert step == RESUME_STEP and carried == saved_carried, (step, carried, saved_carried)
    assert trained == [RESUME_STEP + 1], f"the resumed run trained updates {trained}, not update {RESUME_STEP + 1}"
    syncs = resumed.of("weight_sync")
    assert syncs and all(e["all_equal"] for e in syncs), syncs
    check_resume_state(run, resumed, step=RESUME_STEP, saved_sync=RESUME_STEP, earlier_sync=RESUME_STEP - 1,
                       ranks=(0,))
    after = prompts_of_step(tmp_path / "resumed", RESUME_STEP + 1)
    assert after == prompts_of_step(tmp_path / "run", RESUME_STEP + 1), \
        "the resumed update trained on other prompts than the first run's same update"
    assert after != prompts_of_step(tmp_path / "run", RESUME_STEP), "updates 5 and 6 trained the same prompts"


#: two prompts of one length (the group prompt length is one value per run); each has two greedy samples
RESUME_PROMPTS = [[5, 6, 7, 8, 9, 10], [30, 31, 30, 31, 30, 32]]
FULL, CUT = 48, 16  # tokens of an uninterrupted answer; tokens generated before the "weight sync"


def test_resumed_request_is_lossless_and_drafts_from_its_group(engine_ws: Path, tiny_models: dict[str, Path],
                                                               tmp_path: Path) -> None:
    from qwen3_rl.spec_decode.runner_drafter import GROUP_PROMPT_LEN_KEY

    model = str(tiny_models["dense"])
    base = run_engine({"workspace": str(engine_ws), "model": model, "prompts": RESUME_PROMPTS,
                       "runs": [{"name": "base", "max_tokens": [FULL] * 2}]}, tmp_path)
    full = base["base"]["outputs"]
    assert all(len(o) == FULL for o in full)
    # wave 1: the first sample of each prompt, uninterrupted; wave 2: the second samples resumed after CUT tokens
    prompts = RESUME_PROMPTS + [p + o[:CUT] for p, o in zip(RESUME_PROMPTS, full, strict=True)]
    # group mode with per-group history and no cross-group cache: a request drafts from its siblings' answers only
    # if it is in their group (SAM_HISTORY; the live siblings' shared automaton works through the same key)
    sam = {"speculative_config": {"method": "sam", "num_speculative_tokens": 3, "sam_config": {
        "group_mode": True, "cache_max_responses": 0, "history_responses": 4}}}
    run = {"llm": sam, "prompts": prompts, "phases": [[0, 1], [2, 3]], "max_tokens": [FULL, FULL, FULL - CUT,
                                                                                      FULL - CUT]}
    res = run_engine({"workspace": str(engine_ws), "model": model, "prompts": prompts, "runs": [
        {"name": "grouped", **run, "sampling": {"extra_args": {GROUP_PROMPT_LEN_KEY: len(RESUME_PROMPTS[0])}}},
        {"name": "own", **run}]}, tmp_path)
    for name in ("grouped", "own"):
        outs = res[name]["outputs"]
        assert outs[:2] == full, name
        assert [o[:CUT] + r for o, r in zip(full, outs[2:], strict=True)] == full, f"{name}: resume not lossless"
    acc = {n: int(res[n]["metrics"].get("spec_decode_num_accepted_tokens", 0)) for n in ("grouped", "own")}
    drafted = {n: int(res[n]["metrics"].get("spec_decode_num_draft_tokens", 0)) for n in ("grouped", "own")}
    print(f"resume after {CUT} tokens: drafted {drafted}, accepted {acc} (grouped = extra_args group length)")
    assert drafted["grouped"] > 0 and acc["grouped"] > acc["own"], (drafted, acc)


#: staleness 0: 4 syncs of one update each, no validation, no checkpoint; the rollout worker kills itself in the 4th
#: (the last) sync, after the updates 1-3 were logged (an update's metrics are logged after its sync)
ON_POLICY_ENV = {**RUN_ENV, "SYNCS": "4", "STALENESS_THRESHOLD": "0", "SAVE_FREQ": "-1", "VAL_BEFORE_TRAIN": "False",
                 "TEST_FREQ": "-1", "SAM_ENABLE": "False", "SAM_GROUP": "False", "USE_ROLLOUT_LOG_PROBS": "True",
                 "ROLLOUT_CORRECTION": "off", "QWEN3_RL_E2E_KILL_IN_SYNC": "4"}
KILL_IN_SYNC = int(ON_POLICY_ENV["QWEN3_RL_E2E_KILL_IN_SYNC"])
KILL_EXIT_BOUND_S = 120.0


@pytest.fixture(scope="module")
def on_policy_killed(cpu_ws: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, float]:
    """The staleness-0 launch that ends with its rollout worker killed in the last sync, and when it ended."""
    import time

    run = launch(cpu_ws, SCRIPT, tmp_path_factory.mktemp("on-policy-killed"), env=ON_POLICY_ENV)
    return run, time.time()


@pytest.mark.timeout(1500)
def test_staleness_zero_trains_on_policy(on_policy_killed: tuple[Run, float]) -> None:
    run, _ended = on_policy_killed
    assert run.of("killed_in_sync"), f"the run did not reach its last sync:\n{_tail(run)}"
    trained = {s: m for s, m in step_metrics(run.log).items() if s > 0}
    assert sorted(trained) == list(range(1, KILL_IN_SYNC)), f"trained steps {sorted(trained)}"
    staleness = {s: (m["fully_async/staleness/max"], m["fully_async/staleness/mean"]) for s, m in trained.items()}
    started = {s: m["fully_async/count/started_in_version"] for s, m in trained.items()}
    aborted = {s: m["fully_async/sync/aborted_requests"] for s, m in trained.items()}
    print(f"staleness 0: (max, mean) staleness per batch {staleness}; prompts started per version {started}; "
          f"requests aborted at each sync {aborted}; {run.seconds:.0f} s launcher run")
    assert all(v == (0.0, 0.0) for v in staleness.values()), f"off-policy batches at staleness 0: {staleness}"
    assert all(n == float(ON_POLICY_ENV["PPO_MINI_BATCH_SIZE"]) for n in started.values()), started
    assert all(n == 0 for n in aborted.values()), f"requests were running at a sync at staleness 0: {aborted}"


@pytest.mark.timeout(1500)
def test_rollout_worker_killed_in_a_weight_sync_ends_the_run(on_policy_killed: tuple[Run, float]) -> None:
    """The product command with the rollout worker killed (SIGKILL, by the probe: ``QWEN3_RL_E2E_KILL_IN_SYNC``)
    in the last weight sync, after the first tensor arrived: the run exits non-zero within KILL_EXIT_BOUND_S of
    the kill, with a one-line error naming the dead worker: the sync's, or the launcher's watch naming its pid (the
    seconds are printed)."""
    run, ended = on_policy_killed
    kills = run.of("killed_in_sync")
    tail = "\n".join(run.log.splitlines()[-40:])
    assert kills, f"no rollout worker was killed in a sync (exit {run.rc}):\n{tail}"
    assert kills[0]["n"] == KILL_IN_SYNC, kills
    seconds = ended - kills[0]["time"]
    # the sync's own error, or the launcher's actor-death watch (qwen3_rl.tools.launch.ray_actors) naming the killed
    # worker by its pid, whichever stops the run first (the watch won in a clean-clone CI run: exit 7 s after the kill)
    watch = actor_death_watch(kills[0]["pid"])
    said = [ln for ln in run.log.splitlines()
            if "weight sync: rollout worker 0 died during the sync" in ln or watch.search(ln)]
    print(f"rollout worker killed in weight sync {kills[0]['n']} ({kills[0]['first_tensor']} received): the "
          f"launcher exited {run.rc} {seconds:.0f} s after the kill; {said[:1]}")
    assert run.rc != 0, tail
    assert said, f"the run did not say which worker died:\n{tail}"
    # a failed run keeps Ray's own logs of the head and shows their tails (tests/helpers/tiny_launch.py)
    kept = sorted((run.probe.parent / "ray_logs").glob("session_*/raylet.out"))
    assert kept and "a failed run: Ray's own logs" in run.log, f"Ray's logs not kept: {kept}"
    assert seconds <= KILL_EXIT_BOUND_S, f"the run took {seconds:.0f} s to exit after the kill"
