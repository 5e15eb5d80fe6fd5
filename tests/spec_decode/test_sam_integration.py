"""SAM speculative decoding selected end to end on the patched pins (the vLLM and vLLM-Ascend seam patches, the
"sam" drafter registered by the plugin's ``vllm.general_plugins`` entry point).

* The patched vLLM ``SpeculativeConfig`` (built on CPU, also from the dict ``LLM(speculative_config=...)``
  passes) keeps ``method == "sam"`` (a registered drafter); bad k, unknown or foreign options raise.
* The patched vLLM-Ascend ``spec_decode`` package is imported with stand-in ``torch_npu`` / ``torchair`` /
  ``acl`` modules; the patched ``NPUModelRunner._set_up_drafter`` / ``_get_drafter`` /
  ``propose_draft_token_ids`` are compiled from the patched file and run on a stand-in runner that
  holds vLLM's real ``InputBatch`` and the drafter ``GPUModelRunner.__init__`` builds from the registry: "sam"
  keeps that drafter (built once), and a replay of a batch (chunked prefill, finished, preempted and resumed
  requests, batch-size threshold crossings) runs it beside vLLM-Ascend's own n-gram adapter as the reference.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import sys
import types
from dataclasses import fields
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from qwen3_rl.spec_decode.bs_threshold import BatchSizeGate
from qwen3_rl.spec_decode.config import (
    MAX_SPECULATIVE_TOKENS,
    SAM_OPTIONS,
    check_num_speculative_tokens,
    parse_sam_options,
)
from qwen3_rl.spec_decode.sam import SamConfig

L = 512  # max_model_len of the replays
K = 3


# ----------------------------------------------------------------------------- pure package logic
def test_options_and_gate_validation() -> None:
    assert parse_sam_options(None) == SamConfig()
    cfg = parse_sam_options({"group_mode": True, "cache_max_responses": 8, "pad_drafts": True}, 4)
    assert (cfg.group_mode, cfg.cache_max_responses, cfg.pad_drafts, cfg.num_speculative_tokens) == (True, 8, True, 4)
    assert set(SAM_OPTIONS) == {f.name for f in fields(SamConfig)} - {"num_speculative_tokens"}
    for bad, msg in [({"group_mod": True}, "unknown option"), ({"group_mode": 1}, "must be bool"),
                     ({"min_match": True}, "must be int"), ({"rule": "often"}, "rule"),
                     ({"cache_max_responses": 500}, "cache_max_responses"), ([1], "mapping")]:
        with pytest.raises(ValueError, match=msg):
            parse_sam_options(bad)
    assert check_num_speculative_tokens(5) == 5
    for bad in (None, 0, -1, MAX_SPECULATIVE_TOKENS + 1, True, 2.0, "3"):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            check_num_speculative_tokens(bad)

    gate = BatchSizeGate(threshold=4)
    seq = [gate.drafting_on(n) for n in (2, 4, 5, 9, 4, 3, 6)]
    assert seq == [True, True, False, False, True, True, False]
    assert (gate.steps_on, gate.steps_off, gate.switches) == (4, 3, 3)
    assert all(BatchSizeGate().drafting_on(n) for n in (1, 10_000))
    for bad in (0, True, "4"):
        with pytest.raises(ValueError):
            BatchSizeGate(threshold=bad)
    eagle = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method="eagle", disable_by_batch_size=8))
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        BatchSizeGate.from_vllm_config(eagle)
    assert BatchSizeGate.from_vllm_config(types.SimpleNamespace(speculative_config=None)).threshold is None


# ----------------------------------------------------------------------------- patched vLLM config
def test_patched_speculative_config_keeps_sam(patched_imports: Path) -> None:
    import dataclasses

    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    # the path of LLM(speculative_config={...}) / verl engine_kwargs: EngineArgs -> SpeculativeConfig
    raw = {"method": "sam", "num_speculative_tokens": 4, "disable_by_batch_size": 64,
           "sam_config": {"group_mode": True}}
    spec = EngineArgs(model="stand-in", speculative_config=dict(raw)).create_speculative_config(None, None)
    assert isinstance(spec, SpeculativeConfig)
    assert spec.method == "sam" and spec.method != "ngram"  # never rewritten
    assert (spec.num_speculative_tokens, spec.disable_by_batch_size) == (4, 64)
    # the drafter's options key (sam_config) lands in the seam's generic drafter_config field
    assert spec.drafter_config == {"group_mode": True} and spec.prompt_lookup_max is None
    assert not spec.use_eagle() and "method='sam'" in repr(spec)
    assert dataclasses.replace(spec, num_speculative_tokens=2).method == "sam"
    # ngram is untouched by the patch
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (ngram.method, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("ngram", 5, 5)

    bad_cases = [
        ({"num_speculative_tokens": 0}, "greater than 0"),
        ({"num_speculative_tokens": 500}, r"\[1, 128\]"),
        ({}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 3, "sam_group_mode": True}, r"unknown option\(s\) \['sam_group_mode'\]"),
        ({"num_speculative_tokens": 3, "sam_config": {"group": True}}, r"unknown option\(s\) \['group'\]"),
        ({"num_speculative_tokens": 3, "sam_config": {"group_mode": "yes"}}, "group_mode must be bool"),
        ({"num_speculative_tokens": 3, "prompt_lookup_max": 5}, "not used by method='sam'"),
        ({"num_speculative_tokens": 3, "model": "org/draft"}, "model-free"),
        ({"num_speculative_tokens": 3, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ]
    for extra, msg in bad_cases:
        with pytest.raises(Exception, match=msg):
            SpeculativeConfig(method="sam", **extra)
    with pytest.raises(Exception, match="only used with method='sam'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, sam_config={"group_mode": True})
    with pytest.raises(Exception, match="only used with a plugin-registered method"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, drafter_config={"group_mode": True})
    with pytest.raises(Exception, match="Unknown speculative decoding method 'sam2'"):
        SpeculativeConfig(method="sam2", num_speculative_tokens=3)


# ----------------------------------------------------------------------------- vLLM-Ascend with stand-ins
class _Stub(types.ModuleType):
    """Stand-in module: every attribute is a MagicMock."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    roots = ("torch_npu", "torchair", "acl")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        return None


@pytest.fixture(scope="module")
def ascend(patched_imports: Path):
    """The patched vLLM-Ascend spec_decode package and runner methods, imported with stand-ins."""
    import torch

    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    had_npu = hasattr(torch, "npu")
    if not had_npu:
        torch.npu = _Stub("torch.npu")
    tree = patched_imports / "vllm-ascend"
    sys.path.insert(0, str(tree))
    before = set(sys.modules)
    try:
        import vllm_ascend.spec_decode as sd
        from vllm_ascend.spec_decode.interface import Proposer
        from vllm_ascend.spec_decode.ngram_proposer import NgramProposer
        from vllm_ascend.utils import speculative_enable_dispatch_gmm_combine_decode

        from qwen3_rl.spec_decode.ascend_adapter import SamAscendProposer

        assert sd.__file__.startswith(str(tree)), "not the patched vllm-ascend"
        yield types.SimpleNamespace(sd=sd, Proposer=Proposer, NgramProposer=NgramProposer,
                                    SamAscendProposer=SamAscendProposer, runner=_runner_methods(tree, sd),
                                    gmm=speculative_enable_dispatch_gmm_combine_decode)
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(tree))
        if not had_npu:
            del torch.npu
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("vllm_ascend", "torch_npu", "torchair", "acl") or \
                    name == "qwen3_rl.spec_decode.ascend_adapter":
                del sys.modules[name]


def _runner_methods(tree: Path, sd: types.ModuleType) -> types.SimpleNamespace:
    """Compile NPUModelRunner._set_up_drafter / _get_drafter / propose_draft_token_ids from the patched
    model_runner_v1.py (the module itself needs the NPU stack) with the names they use on our path."""
    import torch
    from vllm.plugins.extensions import build_from_factory, get_drafter

    src = (tree / "vllm_ascend" / "worker" / "model_runner_v1.py").read_text()
    module = ast.parse(src)
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "NPUModelRunner")
    wanted = {"_set_up_drafter", "_get_drafter", "propose_draft_token_ids"}
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in funcs} == wanted
    imports = {n.module for n in module.body if isinstance(n, ast.ImportFrom)}
    assert "vllm.plugins.extensions" in imports, "seam import missing"
    assert not any(m and m.startswith("qwen3_rl") for m in imports)  # upstream imports nothing of ours
    code = ast.Module(body=[ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0), *funcs],
                      type_ignores=[])
    ns = {"get_spec_decode_method": sd.get_spec_decode_method, "get_drafter": get_drafter,
          "build_from_factory": build_from_factory, "torch": torch,
          "get_pp_group": lambda: types.SimpleNamespace(is_last_rank=True),
          "RejectionSampler": lambda sampler: ("rejection-sampler", sampler)}
    exec(compile(ast.fix_missing_locations(code), str(tree / "model_runner_v1.py"), "exec"), ns)
    return types.SimpleNamespace(**{name: ns[name] for name in wanted})


def _vllm_config(spec):
    return types.SimpleNamespace(
        speculative_config=spec, model_config=types.SimpleNamespace(max_model_len=L),
        scheduler_config=types.SimpleNamespace(max_num_seqs=8),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1), additional_config={})


class _NPUModelRunnerStandIn(types.SimpleNamespace):
    """Stands in for vLLM-Ascend's NPUModelRunner (the plugin's drafter factory keys on the runner's module)."""


_NPUModelRunnerStandIn.__module__ = "vllm_ascend.worker.model_runner_v1"


def _make_runner(ascend, spec_kwargs: dict, max_num_reqs: int = 8):
    """A stand-in NPUModelRunner set up by the patched _set_up_drafter, with vLLM's real InputBatch; its drafter
    built first from vLLM's registry, as the patched GPUModelRunner.__init__ does for a registered method."""
    import torch
    from vllm.config import SpeculativeConfig
    from vllm.plugins.extensions import get_drafter
    from vllm.v1.worker.gpu_input_batch import InputBatch

    spec = SpeculativeConfig(**spec_kwargs)
    batch = InputBatch(max_num_reqs=max_num_reqs, max_model_len=L, max_num_batched_tokens=4096,
                       device=torch.device("cpu"), pin_memory=False, vocab_size=1000, block_sizes=[16],
                       kernel_block_sizes=[16], is_spec_decode=True, num_speculative_tokens=spec.num_speculative_tokens)
    runner = _NPUModelRunnerStandIn(
        speculative_config=spec, vllm_config=_vllm_config(spec), device=torch.device("cpu"),
        max_num_reqs=max_num_reqs, max_num_tokens=4096, sampler=object(), input_batch=batch, requests={},
        _make_buffer=lambda n, dtype: types.SimpleNamespace(np=np.zeros(n, np.int64)))
    registered = get_drafter(spec.method)
    if registered is not None:  # GPUModelRunner.__init__ (vLLM seam patch)
        runner.drafter = registered.build(runner.vllm_config, runner)
    prebuilt = getattr(runner, "drafter", None)
    runner._get_drafter = types.MethodType(ascend.runner._get_drafter, runner)
    ascend.runner._set_up_drafter(runner)
    if registered is not None:
        assert runner.drafter is prebuilt  # kept: one drafter per engine
    return runner


def test_patched_get_spec_decode_method_selects_sam(ascend) -> None:
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    spec = EngineArgs(model="stand-in", speculative_config={"method": "sam", "num_speculative_tokens": K}
                      ).create_speculative_config(None, None)
    runner = types.SimpleNamespace(input_batch=None, requests={})
    # vLLM-Ascend's own method table is unchanged: "sam" comes from vLLM's registry, not from it
    with pytest.raises(ValueError, match="Unknown speculative decoding method"):
        ascend.sd.get_spec_decode_method("sam", _vllm_config(spec), "cpu", runner)
    ngram_spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K)
    assert isinstance(ascend.sd.get_spec_decode_method("ngram", _vllm_config(ngram_spec), "cpu", runner),
                      ascend.NgramProposer)
    # MoE: "sam" keeps dispatch_gmm_combine_decode like the other model-free methods (a registered drafter)
    assert ascend.gmm(types.SimpleNamespace(speculative_config=spec)) is True
    # the patched runner keeps the registry's drafter (the Proposer subclass on an NPU runner), built once
    r = _make_runner(ascend, {"method": "sam", "num_speculative_tokens": K, "disable_by_batch_size": 6})
    assert type(r.drafter) is ascend.SamAscendProposer and isinstance(r.drafter, ascend.Proposer)
    assert not isinstance(r.drafter, ascend.NgramProposer) and r.drafter.k == K and r.drafter.runner is r
    assert r.decode_token_per_req == K + 1
    assert r.drafter.gate.threshold == 6 and r.spec_decode_gate.threshold == 6
    assert _make_runner(ascend, {"method": "sam", "num_speculative_tokens": K}).spec_decode_gate is None


# ----------------------------------------------------------------------------- replay harness
def _phrase_text(rng: np.random.Generator, phrases: list[np.ndarray], n_phrases: int) -> list[int]:
    return np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), n_phrases)]).tolist()


class _Replay:
    """Plays vLLM's scheduler and the runner's state updates around the patched propose path.

    Per step, as vLLM 0.13 / vLLM-Ascend 0.13 do: finished requests leave ``runner.requests`` and
    the batch; unscheduled ones leave the batch (kept in ``runner.requests``); new / resumed ones are
    added (``InputBatch.add_request`` writes prompt + outputs); last step's drafts are written beyond
    ``num_tokens_no_spec`` (``_update_states``); verification is greedy-equivalent against the
    request's true continuation; ``_bookkeeping_sync`` appends the accepted tokens; then
    ``propose_draft_token_ids`` runs.
    """

    def __init__(self, runner, propose, truth: dict[str, tuple[list[int], list[int]]]) -> None:
        self.r = runner
        self.propose = propose
        self.truth = truth  # req_id -> (prompt, response)
        self.drafts: dict[str, list[int]] = {}
        self.finished_pending: set[str] = set()
        self.done: set[str] = set()
        self.steps = 0
        self.advanced = 0
        self.drafted = 0

    def step(self, scheduled: list[str], new: set[str] = frozenset(), chunked: set[str] = frozenset(),
             params=None) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        b, reqs = self.r.input_batch, self.r.requests
        finished = set(self.finished_pending)
        self.finished_pending.clear()
        for rid in finished:
            reqs.pop(rid, None)
            b.remove_request(rid)
        for rid in [x for x in b.req_ids if x not in scheduled]:
            b.remove_request(rid)
            self.drafts.pop(rid, None)  # a preempted request loses its drafts
        added = []
        for rid in scheduled:
            if rid in new:
                prompt, _ = self.truth[rid]
                sp = (params or {}).get(rid, SamplingParams(temperature=1.0))
                reqs[rid] = CachedRequestState(req_id=rid, prompt_token_ids=list(prompt), mm_features=[],
                                               sampling_params=sp, generator=None, block_ids=([],),
                                               num_computed_tokens=0, output_token_ids=[])
            if rid not in b.req_id_to_index:
                added.append(rid)
                b.add_request(reqs[rid])
        b.condense()
        b.refresh_metadata()  # as the runner does after condense (resets the batch-update record)
        for rid, d in self.drafts.items():  # _update_states: draft tokens beyond num_tokens_no_spec
            i = b.req_id_to_index[rid]
            s = b.num_tokens_no_spec[i]
            b.token_ids_cpu[i, s:s + len(d)] = d
            b.num_tokens[i] = s + len(d)
        valid: list[list[int]] = []
        for i, rid in enumerate(b.req_ids):
            prompt, resp = self.truth[rid]
            pos = int(b.num_tokens_no_spec[i]) - len(prompt)
            if rid in chunked:
                valid.append([])  # partial prefill: its sampled token is discarded
                continue
            d = [] if rid in added else self.drafts.get(rid, [])
            acc = 0
            while acc < len(d) and pos + acc < len(resp) - 1 and d[acc] == resp[pos + acc]:
                acc += 1
            sampled = resp[pos: pos + acc + 1]
            valid.append(list(sampled))
        for i, rid in enumerate(b.req_ids):  # _bookkeeping_sync
            if not valid[i]:
                continue
            s = int(b.num_tokens_no_spec[i])
            e = s + len(valid[i])
            b.token_ids_cpu[i, s:e] = valid[i]
            b.num_tokens_no_spec[i] = e
            b.num_tokens[i] = e
            reqs[rid].output_token_ids.extend(valid[i])
            self.advanced += len(valid[i])
            if e - len(self.truth[rid][0]) >= len(self.truth[rid][1]):
                self.finished_pending.add(rid)
                self.done.add(rid)
        sched_out = types.SimpleNamespace(finished_req_ids=finished,
                                          scheduled_new_reqs=[types.SimpleNamespace(req_id=x) for x in new])
        before = self.batch_snapshot()
        out = self.propose(self.r, valid, sched_out)
        self.snapshots = (before, self.batch_snapshot())  # the runner's batch around the drafter call
        assert len(out) == b.num_reqs
        self.drafts = {rid: list(out[i]) for i, rid in enumerate(b.req_ids)
                       if out[i] and rid not in self.finished_pending}
        self.steps += 1
        self.drafted += sum(len(d) for d in out)
        return out

    def batch_snapshot(self) -> dict:
        b = self.r.input_batch
        return {"tok": b.token_ids_cpu.copy(), "num": b.num_tokens.copy(), "nospec": b.num_tokens_no_spec.copy(),
                "prompt": b.num_prompt_tokens.copy(), "ids": list(b.req_ids),
                "unsup": set(b.spec_decode_unsupported_reqs)}


def _propose_via_runner(ascend):
    def call(runner, valid, sched_out):
        return ascend.runner.propose_draft_token_ids(runner, valid, None, sched_out, None, None, 0, None, None)
    return call


def _corpus(seed: int, n_req: int, shared_prompt_groups: int | None = None):
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, 900, rng.integers(6, 12)) for _ in range(14)]
    prompts = [rng.integers(1, 900, 40).tolist() for _ in range(shared_prompt_groups or n_req)]
    truth = {}
    for j in range(n_req):
        prompt = prompts[j % len(prompts)]
        truth[f"r{j}"] = (prompt, _phrase_text(rng, phrases, int(rng.integers(8, 16))))
    return truth


def _assert_fed_exactly_accepted(runner) -> None:
    """Every batch row: the automaton's text == the runner's prompt + accepted tokens."""
    b, sam = runner.input_batch, runner.drafter.sam
    for i, rid in enumerate(b.req_ids):
        n = int(b.num_tokens_no_spec[i])
        np.testing.assert_array_equal(sam.drafter.tokens(rid), b.token_ids_cpu[i, :n])


def test_sam_adapter_replay_lifecycle_threshold_beside_ngram(ascend) -> None:
    """Batch of 8 requests on vLLM's InputBatch: chunked prefill, unsupported sampling params,
    finished, preempted + resumed, and batch-size threshold crossings; n-gram adapter beside it."""
    from vllm import SamplingParams

    from qwen3_rl.spec_decode.sam import SamProposer

    truth = _corpus(seed=7, n_req=10)
    ids = sorted(truth, key=lambda x: int(x[1:]))
    params = {"r3": SamplingParams(temperature=1.0, repetition_penalty=1.2)}  # spec decode unsupported

    results = {}
    for method in ("sam", "ngram"):
        spec = {"method": method, "num_speculative_tokens": K, "disable_by_batch_size": 5}
        if method == "ngram":
            spec.update(prompt_lookup_min=2, prompt_lookup_max=5)
        runner = _make_runner(ascend, spec)
        rep = _Replay(runner, _propose_via_runner(ascend), truth)
        started: set[str] = set()
        live: list[str] = []
        on_steps = off_steps = 0
        while len(rep.done) < len(truth):
            assert rep.steps < 400
            s = rep.steps
            # r0..r7 start at step 0; r2 is preempted during steps 6-9; r8, r9 join after step 12
            live = [x for x in live if x not in rep.done]
            sched = [x for x in live if not (x == "r2" and 6 <= s <= 9)]
            new: set[str] = set()
            waiting = [x for x in ids if x not in started]
            while waiting and len(sched) < 8 and (s == 0 or s > 12):
                x = waiting.pop(0)
                sched.append(x)
                live.append(x)
                new.add(x)
            started |= new
            chunked = {x for x in new if x in ("r1", "r8")}  # their first step is a partial prefill
            out = rep.step(sched, new=new, chunked=chunked, params=params)
            b = runner.input_batch
            over = b.num_reqs > 5
            if over:
                off_steps += 1
                assert out == [[]] * b.num_reqs  # drafting off above the threshold
            else:
                on_steps += 1
            for i, rid in enumerate(b.req_ids):
                if rid in chunked or rid == "r3":
                    assert out[i] == []  # partial prefill / unsupported sampling: no draft (as n-gram)
                assert len(out[i]) <= K
            if method == "sam":
                _assert_fed_exactly_accepted(runner)
                before, after = rep.snapshots
                # the adapter wrote nothing into the runner's batch (vLLM-Ascend's n-gram adapter
                # writes the sampled ids again beyond num_tokens_no_spec, ngram_proposer.py:54-58)
                for key in ("tok", "num", "nospec", "prompt"):
                    np.testing.assert_array_equal(after[key], before[key])
                assert (after["ids"], after["unsup"]) == (before["ids"], before["unsup"])
                sam = runner.drafter.sam
                assert ("r2" in sam.request_ids and sam.is_paused("r2")) == (6 <= rep.steps - 1 <= 9
                                                                            and "r2" not in rep.done)
                if not over:  # same drafts as a fresh drafter given the same text (state fully restored)
                    for i, rid in enumerate(b.req_ids):
                        if out[i] and rid not in rep.finished_pending:
                            ref = SamProposer(num_speculative_tokens=K)
                            ref.add_request("x", b.token_ids_cpu[i, :b.num_prompt_tokens[i]])
                            ref.extend("x", b.token_ids_cpu[i, b.num_prompt_tokens[i]:b.num_tokens_no_spec[i]])
                            assert out[i] == ref.propose(["x"])[0][: len(out[i])]
        gate = runner.drafter.gate if method == "sam" else runner.spec_decode_gate  # SAM gates itself
        assert gate.switches >= 2 and off_steps > 0 and on_steps > 0  # crossed both ways
        assert (gate.steps_on, gate.steps_off) == (on_steps, off_steps)
        assert rep.drafted > 0  # drafting happened while on
        results[method] = (rep.steps, rep.advanced, rep)

    rep = results["sam"][2]
    sam = rep.r.drafter.sam
    assert sam.request_ids and sam.drafter.nbytes() > 0
    rep.step([])  # the step after the last ones finished: the runner drops them, so does the drafter
    assert sam.request_ids == set() and sam.drafter.nbytes() == 0
    # same tokens generated by both; SAM needs no more steps than the n-gram reference here
    assert results["sam"][1] == results["ngram"][1] == sum(len(r) for _, r in truth.values())
    print({m: {"steps": v[0], "tokens": v[1], "drafted": v[2].drafted} for m, v in results.items()})
    assert results["sam"][0] <= results["ngram"][0], results


def test_sam_adapter_group_mode_drafts_from_sibling(ascend) -> None:
    """Two GRPO samples of one prompt (group key = hash of the prompt ids): with group_mode the second
    drafts the first's continuation; per request it cannot; pad_drafts fills drafts to k."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, 900, 30).tolist()
    tail = rng.integers(1, 900, 20).tolist()
    a_resp = [901, *tail, 905]
    b_resp = [901, *tail, 906]  # the sibling repeats a's response
    truth = {"a": (prompt, a_resp), "b": (prompt, b_resp)}
    got = {}
    for group in (False, True):
        runner = _make_runner(ascend, {"method": "sam", "num_speculative_tokens": K,
                                       "sam_config": {"group_mode": group}})
        rep = _Replay(runner, _propose_via_runner(ascend), truth)
        while "a" not in rep.done:
            rep.step(["a"], new={"a"} if rep.steps == 0 else set())
        out = rep.step(["b"], new={"b"})  # a finished; b's first token is 901
        got[group] = out[0]
    assert got[False] == [] or got[False][0] != tail[0]
    assert got[True] == tail[:K]

    runner = _make_runner(ascend, {"method": "sam", "num_speculative_tokens": K, "sam_config": {"pad_drafts": True}})
    rep = _Replay(runner, _propose_via_runner(ascend), {"c": (prompt, [950, 951, 952, 953])})
    out = rep.step(["c"], new={"c"})
    assert out == [[950] * K]  # no match (950 is not in the prompt): the last token repeated to k


# ----------------------------------------------------------------------------- verl side: train script -> LLM(...)
REPO = Path(__file__).resolve().parents[2]
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
SAM_ON = {"SAM_ENABLE": "True", "SAM_K": "4", "SAM_GROUP": "True", "SAM_BS_THRESHOLD": "96", "NPUGRAPH_EX": "True"}


class _RecordingLLM:
    """Stands in for vllm.LLM in verl's SPMD rollout constructor; keeps the engine arguments."""

    last: dict | None = None

    def __init__(self, **kwargs) -> None:
        _RecordingLLM.last = kwargs


def _llm_kwargs_from_script(ws: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict:
    """Train script -> Hydra (patched verl config) -> RolloutConfig -> real vLLMRollout.__init__ -> LLM kwargs."""
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout import base
    from verl.workers.rollout.vllm_rollout import vllm_rollout_spmd as spmd

    from qwen3_rl.tools.launch import parse_train_script

    cmd = parse_train_script(REPO / "internal" / "train_grpo_qwen3_32b_32die_true_weight.sh",
                             env=dict(BASE_ENV, ROLLOUT_TP="1", **env))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ws / "verl" / "verl" / "trainer" / "config"), version_base=None):
        cfg = compose(config_name=cmd.config_name, overrides=list(cmd.overrides))
    GlobalHydra.instance().clear()
    OmegaConf.resolve(cfg)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # as megatron_workers.py:404 does
    assert isinstance(rollout, RolloutConfig)
    monkeypatch.setattr(spmd, "LLM", _RecordingLLM)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(spmd, "omega_conf_to_dataclass", lambda c, dataclass_type=None: c, raising=False)
    monkeypatch.setattr(base, "omega_conf_to_dataclass", lambda c, dataclass_type=None: c)
    model_config = types.SimpleNamespace(
        local_path="/models/stand-in", tokenizer=types.SimpleNamespace(pad_token_id=0),
        hf_config=types.SimpleNamespace(max_position_embeddings=40960, rope_scaling=None),
        trust_remote_code=False, lora_rank=0)
    _RecordingLLM.last = None
    spmd.vLLMRollout(rollout, model_config, device_mesh=None)
    assert _RecordingLLM.last is not None
    return _RecordingLLM.last


def test_train_script_switches_reach_llm(patched_imports: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SAM_* / NPUGRAPH_EX from the train script reach vllm.LLM(...) as speculative_config /
    additional_config / compilation_config through verl 0.6.1's rollout.engine_kwargs.vllm (no verl
    patch needed); the speculative_config builds the patched vLLM config with method "sam"."""
    from vllm.config import CompilationConfig, SpeculativeConfig

    from qwen3_rl.tools.launch import TrainScriptError, parse_train_script

    off = _llm_kwargs_from_script(patched_imports, monkeypatch, {})
    assert "speculative_config" not in off and "additional_config" not in off
    # the script's graph sizes reach vLLM as a CompilationConfig (verl 0005: pristine verl 0.6.1 drops
    # rollout.cudagraph_capture_sizes, vllm_rollout_spmd.py:224 wants a ListConfig and the dataclass holds a list);
    # with NPUGRAPH_EX they go to vLLM directly as a dict, below
    script_sizes = [8, 16, 32, 64, 96, 128, 160, 192, 224, 256]  # GRAPH_CAPTURE_SIZES, internal/lib/train_common.sh
    assert isinstance(off["compilation_config"], CompilationConfig)
    assert sorted(off["compilation_config"].cudagraph_capture_sizes) == script_sizes

    on = _llm_kwargs_from_script(patched_imports, monkeypatch, SAM_ON)
    spec_kwargs = on["speculative_config"]
    assert type(spec_kwargs) is dict and type(spec_kwargs["sam_config"]) is dict  # plain, not DictConfig
    assert spec_kwargs == {"method": "sam", "num_speculative_tokens": 4, "disable_by_batch_size": 96,
                           "sam_config": {"group_mode": True, "pad_drafts": True}}
    spec = SpeculativeConfig(**spec_kwargs)
    assert spec.method == "sam" and BatchSizeGate.from_vllm_config(types.SimpleNamespace(
        speculative_config=spec)).threshold == 96
    assert on["additional_config"] == {"enable_npugraph_ex": True}
    assert on["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": script_sizes}
    assert CompilationConfig(**on["compilation_config"]).cudagraph_mode.name == "FULL_DECODE_ONLY"

    sam_only = _llm_kwargs_from_script(patched_imports, monkeypatch, {"SAM_ENABLE": "True"})
    assert sam_only["speculative_config"] == {"method": "sam", "num_speculative_tokens": 3,
                                              "sam_config": {"group_mode": False, "pad_drafts": False}}
    assert "additional_config" not in sam_only and isinstance(sam_only["compilation_config"], CompilationConfig)
    assert sorted(sam_only["compilation_config"].cudagraph_capture_sizes) == script_sizes

    for name in sorted((REPO / "internal").glob("train_*.sh")):
        cmd = parse_train_script(name, env=dict(BASE_ENV, **SAM_ON))
        assert cmd.get("+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method") is None
        assert cmd.get("actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method") == "sam", name
        with pytest.raises(TrainScriptError):
            parse_train_script(name, env=dict(BASE_ENV, SAM_ENABLE="yes"))
