"""vllm 0004: drafting for requests with log-probs, and raw log-probs out of the rejection sampler.

Upstream code on CPU: vLLM's ``RejectionSampler.forward`` of the patched tree and of the pristine pin (loaded
from its file) on the same float32 logits, with temperature 0.5 and top-p 0.9 (vLLM's own
``apply_sampling_constraints``, in place) and the rejection kernels swapped for vLLM-Ascend's PyTorch ones as in
the engine tests. Every returned log-prob (accepted, recovered and bonus positions) must equal the log-softmax of
the raw logits at its row, as decoding without drafts returns them (``raw_logprobs``). The pristine sampler
returns the scaled logits' values at the drafted rows (the positive control for the check).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

VOCAB, DRAFTS, TEMP = 64, [[3, 9, 17], [40, 41]], 0.5
#: logit added to each draft token: request 0's drafts are accepted (then its bonus token), request 1's
#: first draft is rejected (a recovered token)
BOOST = [8.0, -8.0]


def _inputs():
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    g = torch.Generator().manual_seed(0)
    rows = sum(len(d) + 1 for d in DRAFTS)
    logits = torch.randn(rows, VOCAB, generator=g)
    target, bonus, row = [], [], 0
    for d, boost in zip(DRAFTS, BOOST, strict=True):
        for j, tok in enumerate(d):
            logits[row + j, tok] += boost
        target += range(row, row + len(d))
        bonus.append(row + len(d))
        row += len(d) + 1
    n = [len(d) for d in DRAFTS]
    i32 = dict(dtype=torch.int32)
    meta = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(DRAFTS, []), **i32), num_draft_tokens=n,
        cu_num_draft_tokens=torch.tensor(n, **i32).cumsum(0, dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor([k + 1 for k in n], **i32).cumsum(0, dtype=torch.int32),
        target_logits_indices=torch.tensor(target, **i32), bonus_logits_indices=torch.tensor(bonus, **i32),
        logits_indices=torch.arange(rows, **i32))
    b = len(DRAFTS)
    sm = SamplingMetadata(
        temperature=torch.full((b,), TEMP), all_greedy=False, all_random=True, top_p=torch.full((b,), 0.9),
        top_k=None, generators={}, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b), repetition_penalties=torch.ones(b),
        output_token_ids=[[] for _ in DRAFTS], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(), spec_token_ids=DRAFTS)
    return logits, meta, sm


def _run(module, patched_workspace: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """(raw log-softmax at each returned token's row, returned log-probs, output token ids); vLLM's module is
    restored afterwards."""
    import vllm.v1.sample.rejection_sampler as vrs
    from vllm.v1.sample.sampler import Sampler

    from qwen3_rl.cpu_device import shims

    for fn in shims.REJECTION_KERNELS:
        monkeypatch.setattr(vrs, fn, getattr(vrs, fn))  # undone after the test
    shims.install_ascend_pytorch_rejection_sampler(patched_workspace / "vllm-ascend")
    for fn in shims.REJECTION_KERNELS:
        setattr(module, fn, getattr(vrs, fn))
    logits, meta, sm = _inputs()
    expected_all = torch.log_softmax(logits, dim=-1)
    torch.manual_seed(1)
    out = module.RejectionSampler(Sampler()).forward(meta, None, logits.clone(), sm)
    tokens = out.sampled_token_ids
    mask = tokens != module.PLACEHOLDER_TOKEN_ID
    starts = torch.cat([torch.zeros(1, dtype=torch.long), meta.cu_num_sampled_tokens[:-1].long()])
    rows = (starts[:, None] + torch.arange(tokens.shape[1])[None, :])[mask]
    expected = expected_all[rows, tokens[mask].long()]
    return expected, out.logprobs_tensors.logprobs[:, 0], tokens


def test_raw_logprobs_with_drafts(patched_imports: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.sample.rejection_sampler as vrs

    expected, got, tokens = _run(vrs, patched_imports, monkeypatch)
    print(f"patched: tokens {tokens.tolist()}, max |logprob - raw| {float((got - expected).abs().max()):.2e}")
    assert tokens[0].tolist()[:3] == DRAFTS[0] and tokens[1].tolist()[1] == -1  # accepted + bonus; recovered
    assert got.shape == expected.shape == (len(DRAFTS[0]) + 2,)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_pristine_sampler_returns_scaled_logprobs(patched_imports: Path, pristine_workspace: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    src = pristine_workspace / "vllm" / "vllm" / "v1" / "sample" / "rejection_sampler.py"
    spec = importlib.util.spec_from_file_location("qwen3_rl_test_pristine_rejection_sampler", src)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    expected, got, tokens = _run(mod, patched_imports, monkeypatch)
    off = (got - expected).abs()
    print(f"pristine: tokens {tokens.tolist()}, |logprob - raw| {off.tolist()}")
    # request 0: 3 accepted drafts, then the bonus token (through the Sampler, which copies the raw logits);
    # request 1: the recovered token. Every drafted row returns the scaled / masked logits' value.
    bonus = len(DRAFTS[0])
    assert float(off[bonus]) == 0.0
    assert float(torch.cat([off[:bonus], off[bonus + 1:]]).min()) > 1e-2


@pytest.mark.parametrize("kwargs, unsupported", [({"logprobs": 0}, False), ({"logprobs": 5}, False), ({}, False),
                                                 ({"repetition_penalty": 1.1}, True), ({"min_p": 0.1}, True)])
def test_logprob_requests_can_be_drafted(patched_imports: Path, pristine_workspace: Path, kwargs: dict,
                                         unsupported: bool) -> None:
    from vllm import SamplingParams
    from vllm.v1.spec_decode.utils import is_spec_decode_unsupported

    assert is_spec_decode_unsupported(SamplingParams(**kwargs)) is unsupported
    pristine = (pristine_workspace / "vllm" / "vllm" / "v1" / "spec_decode" / "utils.py").read_text()
    assert "or sampling_params.logprobs is not None" in pristine  # what the pin refused
