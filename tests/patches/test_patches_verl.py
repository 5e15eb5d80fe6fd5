"""The verl patch series (patches/verl/0001-0004) and the qwen3_rl.compat logic they call.

Unit tests exercise ``qwen3_rl.compat`` directly; the ``patched_imports`` tests import the patched
verl 0.6.1 tree with the pinned vLLM 0.13.0 tree on ``sys.path`` and execute the patched code.
One subprocess runs the same inputs on the *pristine* verl tree to show each bug exists in the pin.
"""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen3_rl.compat import meta_info, rollout_progress, vllm_imports
from qwen3_rl.tools.pins import load_pins

from conftest import run_python

REPO = Path(__file__).resolve().parents[2]
PINS = load_pins(REPO / "pins.toml")
VERL_DIR = PINS.frameworks["verl"].dir
VLLM_DIR = PINS.frameworks["vllm"].dir
VLLM_VERSION = PINS.frameworks["vllm"].version


# ----------------------------------------------------------------------------------------------
# 0001 vllm_imports: resolution logic (no vLLM needed)
# ----------------------------------------------------------------------------------------------


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_vllm_imports_prefers_new_location_then_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    new, old = object(), object()
    _fake_module(monkeypatch, "fakevllm")
    _fake_module(monkeypatch, "fakevllm.new_home", Thing=new)
    _fake_module(monkeypatch, "fakevllm.old_home", Thing=old)
    assert vllm_imports.resolve("Thing", ("fakevllm.new_home", "fakevllm.old_home")) is new
    # new module missing entirely (older vLLM): the old location is used
    assert vllm_imports.resolve("Thing", ("fakevllm.absent", "fakevllm.old_home")) is old
    # new module present but without the name: the old location is used
    _fake_module(monkeypatch, "fakevllm.empty")
    assert vllm_imports.resolve("Thing", ("fakevllm.empty", "fakevllm.old_home")) is old
    with pytest.raises(ImportError, match=r"fakevllm.absent \(no such module\).*fakevllm.empty \(no attribute"):
        vllm_imports.resolve("Thing", ("fakevllm.absent", "fakevllm.empty"))


def test_vllm_imports_reraises_a_broken_dependency(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A candidate that exists but fails on its own import must not be skipped silently."""
    pkg = tmp_path / "fakevllm_broken"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("import qwen3_rl_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as e:
        vllm_imports.resolve("Thing", ("fakevllm_broken.mod", "fakevllm_broken"))
    assert e.value.name == "qwen3_rl_no_such_dependency"


def test_vllm_imports_unknown_name() -> None:
    with pytest.raises(AttributeError):
        vllm_imports.NoSuchName  # noqa: B018


# ----------------------------------------------------------------------------------------------
# 0002 rollout_progress
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("enabled", "tp", "rank", "expected"),
    [
        (False, 1, 0, False),
        (None, 4, 0, False),
        (True, 1, 0, True),
        (True, 1, 7, True),  # TP=1: every rank is its own replica
        (True, 4, 0, True),
        (True, 4, 3, False),
        (True, 4, 4, True),  # first rank of the second replica
        (True, 4, 13, False),
        (True, 0, 5, True),  # TP unset/0 is treated as 1
    ],
)
def test_rollout_use_tqdm_rank_rule(enabled: object, tp: int, rank: int, expected: bool) -> None:
    assert rollout_progress.rollout_use_tqdm(enabled, tp, rank=rank) is expected


def test_rollout_use_tqdm_reads_the_process_group_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert rollout_progress.rollout_use_tqdm(True, 8) is True  # no process group: rank 0
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 9)
    assert rollout_progress.rollout_use_tqdm(True, 8) is False  # TP rank 1 of replica 1
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 8)
    assert rollout_progress.rollout_use_tqdm(True, 8) is True


# ----------------------------------------------------------------------------------------------
# 0003 meta_info merge
# ----------------------------------------------------------------------------------------------

_timing = st.dictionaries(st.sampled_from(["gen", "gen/max", "gen/min", "reshard"]),
                          st.floats(0, 1e4, allow_nan=False), max_size=4)


@settings(max_examples=60, deadline=None)
@given(a=_timing, b=_timing, c=_timing)
def test_merge_timing_is_order_independent_keywise_max(a: dict, b: dict, c: dict) -> None:
    ab_c = meta_info.merge_timing(meta_info.merge_timing(a, b), c)
    c_ba = meta_info.merge_timing(c, meta_info.merge_timing(b, a))
    assert ab_c == c_ba
    assert set(ab_c) == set(a) | set(b) | set(c)
    for k, v in ab_c.items():
        assert v == max(d[k] for d in (a, b, c) if k in d)


def test_merge_meta_value_other_keys_still_conflict() -> None:
    assert meta_info.merge_meta_value("eos_token_id", 2, 2) == 2
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'eos_token_id'"):
        meta_info.merge_meta_value("eos_token_id", 2, 3)
    # timing with a non-numeric leaf still has to agree
    with pytest.raises(AssertionError, match="Conflicting timing values"):
        meta_info.merge_meta_value("timing", {"tag": "a"}, {"tag": "b"})
    assert meta_info.merge_meta_value("timing", {"gen": 1.0, "n": {"x": 1}}, {"gen": 1.0000001, "n": {"y": 2}}) == {
        "gen": 1.0000001, "n": {"x": 1, "y": 2}}


# ----------------------------------------------------------------------------------------------
# 0003 allocator (verl.utils.device of the patched tree)
# ----------------------------------------------------------------------------------------------


def _fake_torch(*devices: str, with_fn: bool = True) -> tuple[types.SimpleNamespace, list[tuple[str, str]]]:
    calls: list[tuple[str, str]] = []
    ns = types.SimpleNamespace()
    for dev in devices:
        mem = types.SimpleNamespace()
        if with_fn:
            mem._set_allocator_settings = lambda s, dev=dev: calls.append((dev, s))
        setattr(ns, dev, types.SimpleNamespace(memory=mem))
    return ns, calls


# ----------------------------------------------------------------------------------------------
# Patched verl executed on vLLM 0.13.0
# ----------------------------------------------------------------------------------------------


def _write_vllm_dist_info(root: Path) -> None:
    """A dist-info for the vllm tree on sys.path, as ``pip install --no-deps vllm`` would leave.

    verl reads vLLM's version with importlib.metadata at import (verl/third_party/vllm/__init__.py:31)
    and refuses to import without it; the text tree has no metadata of its own.
    """
    d = root / f"vllm-{VLLM_VERSION}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")


@pytest.fixture(scope="module")
def verl_on_vllm(patched_imports: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Patched verl + vLLM trees first on sys.path, with vLLM's distribution metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("vllm")
    except PackageNotFoundError:
        meta = tmp_path_factory.mktemp("vllm_meta")
        _write_vllm_dist_info(meta)
        sys.path.append(str(meta))
        found = version("vllm")
    assert found.split("+")[0] == VLLM_VERSION, f"vllm metadata says {found}, pin says {VLLM_VERSION}"
    return patched_imports


def test_patched_verl_imports_on_vllm_013(verl_on_vllm: Path) -> None:
    ws = verl_on_vllm
    # the breakage is real in the pinned vLLM: the old module is gone
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("vllm.lora.models")
    vllm_utils = importlib.import_module("vllm.utils")
    assert not hasattr(vllm_utils, "FlexibleArgumentParser") and not hasattr(vllm_utils, "get_tcp_uri")

    import verl.utils.vllm.utils as verl_vllm_utils
    import verl.workers.rollout.vllm_rollout as verl_vllm_rollout
    import verl.workers.rollout.vllm_rollout.vllm_async_server as server
    import vllm
    import vllm.lora.lora_model
    import vllm.utils.argparse_utils
    import vllm.utils.network_utils

    for m in (vllm, verl_vllm_utils, verl_vllm_rollout, server):
        assert Path(m.__file__).is_relative_to(ws), f"{m.__name__} not from the patched workspace"
    assert verl_vllm_utils.LoRAModel is vllm.lora.lora_model.LoRAModel
    assert server.FlexibleArgumentParser is vllm.utils.argparse_utils.FlexibleArgumentParser
    assert server.get_tcp_uri is vllm.utils.network_utils.get_tcp_uri
    # use them the way vllm_async_server does
    assert server.get_tcp_uri("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert server.get_tcp_uri("::1", 5555) == "tcp://[::1]:5555"
    args = server.FlexibleArgumentParser(description="t").parse_known_args(["--x", "1"])[1]
    assert args == ["--x", "1"]


@pytest.fixture
def clean_hydra():
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def _compose_rollout(config_dir: Path, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name="ppo_megatron_trainer", overrides=overrides)
    return cfg


def test_seam_progress_bar_is_a_group_key(verl_on_vllm: Path, pristine_workspace: Path, clean_hydra: None) -> None:
    """The seam's root group reaches the rollout workers' RolloutConfig; the package validates it."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from qwen3_rl.trainer.seam import RecipeConfig, SeamConfigError

    cfg_dir = verl_on_vllm / VERL_DIR / "verl" / "trainer" / "config"
    on = _compose_rollout(cfg_dir, ["+qwen3_rl.progress_bar.enable=true", "actor_rollout_ref.rollout.name=vllm"])
    OmegaConf.resolve(on)  # as verl's main_ppo does before the workers get their sub-configs
    rc = omega_conf_to_dataclass(on.actor_rollout_ref.rollout)
    assert isinstance(rc, RolloutConfig) and RecipeConfig.from_group(rc.qwen3_rl).progress_bar.enable is True
    default = _compose_rollout(cfg_dir, ["actor_rollout_ref.rollout.name=vllm"])
    OmegaConf.resolve(default)
    assert omega_conf_to_dataclass(default.actor_rollout_ref.rollout).qwen3_rl == {}
    assert RolloutConfig(name="vllm").qwen3_rl == {}
    with pytest.raises(SeamConfigError, match=r"^qwen3_rl.progress_bar.enabled: unknown key"):
        RecipeConfig.from_group({"progress_bar": {"enabled": True}})
    # the pristine pin has no such group
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    pristine = _compose_rollout(pristine_workspace / VERL_DIR / "verl" / "trainer" / "config", [])
    assert "qwen3_rl" not in pristine and "qwen3_rl" not in pristine.actor_rollout_ref.rollout


class _FakeLLM:
    """Stands in for vllm.LLM: records generate's arguments, answers with fixed token ids."""

    def __init__(self, responses: list[list[int]]):
        self.responses = responses
        self.calls: list[dict] = []

    def generate(self, prompts, sampling_params, lora_request, use_tqdm):
        self.calls.append({"n_prompts": len(prompts), "use_tqdm": use_tqdm, "sampling_params": sampling_params})
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=r)]) for r in self.responses]


def _run_spmd_generate(use_tqdm: bool | None, tp: int) -> tuple[_FakeLLM, object]:
    """use_tqdm None: the qwen3_rl group empty (no hooks, upstream's call)."""
    import torch
    from verl import DataProto
    from verl.utils.qwen3_rl_hooks import rollout_hooks
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout.vllm_rollout_spmd import vLLMRollout
    from vllm import SamplingParams

    rollout = object.__new__(vLLMRollout)  # skip __init__: it builds a real vllm.LLM
    group = {} if use_tqdm is None else {"progress_bar": {"enable": use_tqdm}}
    rollout.config = RolloutConfig(name="vllm", qwen3_rl=group, tensor_model_parallel_size=tp,
                                   response_length=4, prompt_length=3)
    rollout.qwen3_rl_hooks = rollout_hooks(rollout.config)  # what __init__ sets once the engine is built
    rollout.pad_token_id = 0
    rollout.lora_kwargs = {}
    rollout.sampling_params = SamplingParams(max_tokens=4)
    rollout.inference_engine = _FakeLLM([[7, 8, 2], [9]])
    prompts = DataProto.from_dict(
        tensors={"input_ids": torch.tensor([[0, 5, 6], [4, 5, 6]]),
                 "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
                 "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]])},
        meta_info={"eos_token_id": 2},
    )
    out = rollout.generate_sequences(prompts)
    return rollout.inference_engine, out


def test_seam_spmd_generate_passes_use_tqdm(verl_on_vllm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm, out = _run_spmd_generate(use_tqdm=None, tp=1)  # group empty: upstream's use_tqdm=False, no meta_info
    assert llm.calls[0]["use_tqdm"] is False and out.meta_info == {}
    llm, out = _run_spmd_generate(use_tqdm=True, tp=1)
    assert llm.calls[0]["use_tqdm"] is True and llm.calls[0]["n_prompts"] == 2
    assert out.batch["responses"].tolist() == [[7, 8, 2, 0], [9, 0, 0, 0]]
    assert out.batch["input_ids"].shape == (2, 7)

    llm, _ = _run_spmd_generate(use_tqdm=False, tp=1)
    assert llm.calls[0]["use_tqdm"] is False
    # TP rank 1 of a TP=2 replica stays quiet, TP rank 0 draws the bar
    monkeypatch.setattr(rollout_progress, "_global_rank", lambda: 1)
    assert _run_spmd_generate(use_tqdm=True, tp=2)[0].calls[0]["use_tqdm"] is False
    monkeypatch.setattr(rollout_progress, "_global_rank", lambda: 2)
    assert _run_spmd_generate(use_tqdm=True, tp=2)[0].calls[0]["use_tqdm"] is True


def _timed_proto(gen_s: float, extra: dict | None = None):
    import torch
    from verl import DataProto

    meta = {"eos_token_id": 2, "timing": {"generate_sequences": gen_s, "generation_timing/max": 3.0}}
    meta.update(extra or {})
    return DataProto.from_dict(tensors={"x": torch.arange(4).view(2, 2)}, meta_info=meta)


def test_concat_tolerates_timing(verl_on_vllm: Path) -> None:
    from verl import DataProto

    parts = [_timed_proto(1.2345678), _timed_proto(1.2345679), _timed_proto(1.2345677, {"metrics": {"a": 1}})]
    merged = DataProto.concat(parts)
    assert merged.batch["x"].tolist() == [[0, 1], [2, 3]] * 3
    assert merged.meta_info["timing"] == {"generate_sequences": 1.2345679, "generation_timing/max": 3.0}
    assert merged.meta_info["eos_token_id"] == 2
    assert merged.meta_info["metrics"] == {"a": [1]}
    # inputs untouched (concat must not mutate a worker's meta_info)
    assert parts[0].meta_info["timing"]["generate_sequences"] == 1.2345678
    # other conflicting keys still fail as upstream
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'eos_token_id'"):
        DataProto.concat([_timed_proto(1.0), _timed_proto(1.0, {"eos_token_id": 3})])


def test_set_expandable_segments_reaches_npu_allocator(verl_on_vllm: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import verl.utils.device as device

    fake_npu, calls = _fake_torch("npu")
    monkeypatch.setattr(torch, "npu", fake_npu.npu, raising=False)
    monkeypatch.setattr(device, "is_cuda_available", False)
    monkeypatch.setattr(device, "is_npu_available", True)
    monkeypatch.setattr(device, "_npu_expandable_segments", True)
    # the order verl's megatron/fsdp workers use around a rollout in sleep mode
    device.set_expandable_segments(False)  # rollout_mode(): before vLLM wakes up
    device.set_expandable_segments(True)  # trainer_mode(): after vLLM sleeps
    assert calls == [("npu", "expandable_segments:False"), ("npu", "expandable_segments:True")]

    # CUDA keeps upstream's behaviour
    cuda_calls: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", cuda_calls.append)
    monkeypatch.setattr(device, "is_cuda_available", True)
    device.set_expandable_segments(False)
    assert cuda_calls == ["expandable_segments:False"] and len(calls) == 2
    # CPU: nothing to switch
    monkeypatch.setattr(device, "is_cuda_available", False)
    monkeypatch.setattr(device, "is_npu_available", False)
    device.set_expandable_segments(True)
    assert cuda_calls == ["expandable_segments:False"] and len(calls) == 2


def test_old_torch_npu_warns_once(verl_on_vllm: Path, caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch_npu without memory._set_allocator_settings: the patched function warns once and switches nothing."""
    import torch
    import verl.utils.device as device

    fake_npu, calls = _fake_torch("npu", with_fn=False)
    monkeypatch.setattr(torch, "npu", fake_npu.npu, raising=False)
    monkeypatch.setattr(device, "is_cuda_available", False)
    monkeypatch.setattr(device, "is_npu_available", True)
    monkeypatch.setattr(device, "_npu_expandable_segments", True)
    monkeypatch.setattr(device, "_warned_npu_allocator_settings_missing", False)
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        device.set_expandable_segments(True)
        device.set_expandable_segments(False)
    assert calls == []
    assert sum("_set_allocator_settings is missing" in r.message for r in caplog.records) == 1


def test_npu_switch_policy(verl_on_vllm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl.utils.device.set_npu_expandable_segments: False leaves the NPU allocator alone (CUDA is still
    switched, as upstream), True switches it again; a non-bool stops with one line naming the key."""
    import torch
    import verl.utils.device as device

    monkeypatch.setattr(device, "_npu_expandable_segments", True)
    fake_npu, calls = _fake_torch("npu")
    monkeypatch.setattr(torch, "npu", fake_npu.npu, raising=False)
    monkeypatch.setattr(device, "is_cuda_available", False)
    monkeypatch.setattr(device, "is_npu_available", True)
    device.set_npu_expandable_segments(False)
    device.set_expandable_segments(False)
    assert calls == []  # upstream: the NPU allocator is never switched
    device.set_npu_expandable_segments(True)
    device.set_expandable_segments(False)
    assert calls == [("npu", "expandable_segments:False")]
    with pytest.raises(TypeError, match="rollout.npu_expandable_segments must be a bool, got 'false'"):
        device.set_npu_expandable_segments("false")


def test_switch_off_restores_upstream(verl_on_vllm: Path, clean_hydra: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """rollout.npu_expandable_segments, declared in verl's config, read by the patched Megatron
    ActorRolloutRefWorker.__init__: false = upstream's CUDA-only swap, true (default) = also on NPU."""
    import torch
    import verl.utils.device as device
    import verl.workers.megatron_workers as mw
    from hydra.errors import ConfigCompositionException
    from verl.utils.config import omega_conf_to_dataclass

    cfg_dir = verl_on_vllm / VERL_DIR / "verl" / "trainer" / "config"
    off = _compose_rollout(cfg_dir, ["actor_rollout_ref.rollout.npu_expandable_segments=false", NAME_VLLM])
    assert omega_conf_to_dataclass(off.actor_rollout_ref.rollout).npu_expandable_segments is False
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    on = _compose_rollout(cfg_dir, [NAME_VLLM])
    assert on.actor_rollout_ref.rollout.npu_expandable_segments is True
    GlobalHydra.instance().clear()
    with pytest.raises(ConfigCompositionException, match="npu_expandable_segmentss"):
        _compose_rollout(cfg_dir, ["actor_rollout_ref.rollout.npu_expandable_segmentss=false"])

    class _StopInit(Exception):
        pass

    def stop(*_a, **_k):  # MindSpeed's repatch is the next statement: end __init__ there
        raise _StopInit

    monkeypatch.setattr(mw.Worker, "__init__", lambda self: None)
    monkeypatch.setattr(mw, "repatch", stop)
    monkeypatch.setattr(device, "_npu_expandable_segments", True)
    fake_npu, calls = _fake_torch("npu")
    monkeypatch.setattr(torch, "npu", fake_npu.npu, raising=False)
    monkeypatch.setattr(device, "is_cuda_available", False)
    monkeypatch.setattr(device, "is_npu_available", True)

    def run_worker_init(cfg) -> None:
        worker = object.__new__(mw.ActorRolloutRefWorker)
        with pytest.raises(_StopInit):
            mw.ActorRolloutRefWorker.__init__(worker, cfg.actor_rollout_ref, role="actor_rollout")
        device.set_expandable_segments(False)  # rollout_mode()
        device.set_expandable_segments(True)  # trainer_mode()

    run_worker_init(off)
    assert calls == []  # upstream verl 0.6.1 on NPU: the swap is a no-op
    cuda_calls: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", cuda_calls.append)
    monkeypatch.setattr(device, "is_cuda_available", True)
    device.set_expandable_segments(False)
    assert cuda_calls == ["expandable_segments:False"]  # CUDA keeps being switched, as upstream
    monkeypatch.setattr(device, "is_cuda_available", False)
    run_worker_init(on)
    assert calls == [("npu", "expandable_segments:False"), ("npu", "expandable_segments:True")]


NAME_VLLM = "actor_rollout_ref.rollout.name=vllm"


_PRISTINE_PROBE = textwrap.dedent("""
    import json, sys, types
    import torch
    from verl import DataProto
    import verl.utils.device as device
    out = {}
    def proto(t):
        return DataProto.from_dict(tensors={"x": torch.zeros(1, 1)}, meta_info={"timing": {"g": t}})
    try:
        DataProto.concat([proto(1.0), proto(1.0000001)])
        out["concat"] = "ok"
    except AssertionError as e:
        out["concat"] = str(e)
    calls = []
    torch.npu = types.SimpleNamespace(memory=types.SimpleNamespace(_set_allocator_settings=calls.append))
    device.is_cuda_available, device.is_npu_available = False, True
    device.set_expandable_segments(True)
    out["npu_calls"] = calls
    out["file"] = device.__file__
    print(json.dumps(out))
""")


def test_pristine_pin_has_the_bugs(pristine_workspace: Path) -> None:
    """Same inputs on pristine verl 0.6.1: concat fails on timing, NPU allocator never switched."""
    import json

    root = pristine_workspace / VERL_DIR
    proc = run_python(_PRISTINE_PROBE, path=(root,), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).is_relative_to(root)
    assert out["concat"] == "Conflicting values for meta_info key 'timing'"
    assert out["npu_calls"] == []
    # 0001/0002: the pinned sources hold the lines the patches replace
    server = (root / "verl/workers/rollout/vllm_rollout/vllm_async_server.py").read_text().splitlines()
    assert server[37] == "from vllm.utils import FlexibleArgumentParser, get_tcp_uri"
    assert (root / "verl/utils/vllm/utils.py").read_text().splitlines()[17] == "from vllm.lora.models import LoRAModel"
    spmd = (root / "verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py").read_text().splitlines()
    assert spmd[386].strip() == "use_tqdm=False,"


# ----------------------------------------------------------------------------------------------
# 0017 resuming a Megatron checkpoint without Transformer Engine
# ----------------------------------------------------------------------------------------------

_LOAD_WITHOUT_TE = textwrap.dedent("""
    import sys
    sys.modules["transformer_engine"] = None  # unimportable, as on Ascend (and on this CPU)
    from verl.utils.checkpoint import megatron_checkpoint_manager as m

    class Reached(Exception):
        pass

    def get_dist_checkpoint_path(path):  # the first call after the optimizer allow-list
        raise Reached
    m.get_dist_checkpoint_path = get_dist_checkpoint_path
    try:
        object.__new__(m.MegatronCheckpointManager).load_checkpoint(sys.argv[1])
    except Reached:
        print("reached the checkpoint path")
    except ImportError as e:
        print(f"{type(e).__name__}: {e}")
""")


@pytest.mark.parametrize("tree", ["patched", "pristine"])
def test_checkpoint_load_without_te(tree: str, patched_workspace: Path, pristine_workspace: Path,
                                        tmp_path: Path) -> None:
    """Patched: load_checkpoint goes past the optimizer allow-list to the checkpoint path with transformer_engine
    unimportable. Pristine verl 0.6.1: ModuleNotFoundError before the checkpoint is read."""
    ws = patched_workspace if tree == "patched" else pristine_workspace
    proc = run_python(_LOAD_WITHOUT_TE, str(tmp_path), path=tuple(ws / PINS.frameworks[k].dir for k in ("verl", "megatron")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = "reached the checkpoint path" if tree == "patched" else "ModuleNotFoundError: import of transformer_engine"
    assert proc.stdout.strip().splitlines()[-1].startswith(want), proc.stdout[-2000:]
