"""The split-V greedy kernel (argmax + raw logprob in one pass) against
reference.greedy_sample, and the sampler's greedy fast path on both backends."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kernels import backend, reference
from deepinfer.kernels.greedy import greedy_sample
from deepinfer.runner.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import SamplingParams

NEG = float("-inf")
# Logprobs: the kernel computes -log(z) where the reference rounds x[token] - lse; float32
# sums in another order.
TOL = {"rtol": 1e-5, "atol": 2e-5}


def random_logits(n: int, width: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """[N, V'] random, never zeros: a kernel that skips loads cannot match by accident."""
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * 3
    return x.to(dtype).to(device)


def assert_matches_reference(x: torch.Tensor, vocab: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, logprobs = greedy_sample(x, vocab, **kw)
    ref_tokens, ref_logprobs = reference.greedy_sample(x, vocab)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.shape == logprobs.shape == (x.shape[0],)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, equal_nan=True, **TOL)
    return tokens, logprobs


@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,vocab", [(1, 1000), (3, 5003), (17, 1000), (17, 5003)])
def test_matches_reference(n, vocab, dtype, splits, device, poison_empty):
    """Vocabularies that are not a multiple of the tile, padding columns whose huge values
    must be ignored, one or several splits per row. bfloat16 rows tie at the max now and then
    (first index wins on both sides)."""
    x = random_logits(n, vocab + 37, seed=n + vocab, dtype=dtype, device=device)
    x[:, vocab:] = 1e4
    tokens, _ = assert_matches_reference(x, vocab, block=256, splits=splits)
    assert (tokens < vocab).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_default_launch_config(dtype, device, poison_empty):
    """The launcher's own tile and split choice (a single tile per row here)."""
    x = random_logits(5, 1003, seed=1, dtype=dtype, device=device)
    assert_matches_reference(x, 1000)


def test_ties_go_to_the_lowest_index(device, poison_empty):
    """Equal maxima in different lanes, in one lane across tiles, across splits, and a flat row
    (token 0, logprob -log V). block 16 and 4 splits of 256 columns over V = 1000."""
    v = 1000
    x = random_logits(6, v, seed=2, device=device)
    for r, cols in enumerate([(5, 900), (37, 21), (500, 250, 750), (999, 998), (260, 3, 517)]):
        x[r, list(cols)] = 20.0
    x[5] = 1.5
    tokens, logprobs = assert_matches_reference(x, v, block=16, splits=4)
    assert tokens.tolist() == [5, 21, 250, 998, 3, 0]
    torch.testing.assert_close(logprobs[5], torch.full_like(logprobs[5], -math.log(v)), **TOL)


def test_rows_with_neg_inf(device, poison_empty):
    """-inf entries: scattered; all but one (in the last split); the whole first split; and a
    row that is -inf throughout (token 0, logprob nan, as the reference), padding notwithstanding."""
    v = 1000
    x = random_logits(5, v + 24, seed=3, device=device)
    x[:, v:] = 1e4
    holes = torch.rand(v, generator=torch.Generator().manual_seed(4)) < 0.5
    x[0, :v][holes.to(device)] = NEG
    x[1, :v] = NEG
    x[1, 997] = -3.0
    x[2, :300] = NEG
    x[3, :v] = NEG
    x[4, :v:2] = NEG
    tokens, logprobs = assert_matches_reference(x, v, block=64, splits=4)
    assert tokens[1] == 997 and logprobs[1] == 0.0
    assert tokens[3] == 0 and logprobs[3].isnan()
    assert tokens[4] % 2 == 1


def test_strided_rows(device, poison_empty):
    """A slice of a wider buffer (row stride 1200, offset start) is read in place; so are the
    rows of a taller one."""
    buf = random_logits(9, 1200, seed=5, device=device)
    view = buf[2:7, 100:1100]                                            # [5, 1000]
    assert view.stride(0) == 1200
    assert_matches_reference(view, 1000, block=128, splits=3)
    assert_matches_reference(buf[::2, 100:], 1000, block=128, splits=3)  # V' = 1100, row stride 2400


def test_a_row_does_not_depend_on_its_batch(device):
    """Batch invariance: the split of a row comes from the vocabulary alone, so a row's token and
    logprob are bit for bit the same alone, in 3 rows and in 64 (several tiles: block 256)."""
    vocab = 3000
    x = random_logits(64, vocab + 8, seed=9, device=device)
    x[torch.arange(64), torch.arange(64) * 40] += 15     # z ~ 1 + small terms: logprob ~ -0.01, rounding shows
    big_t, big_lp = greedy_sample(x, vocab, block=256)
    for rows in (slice(5, 6), slice(4, 7)):
        t, lp = greedy_sample(x[rows], vocab, block=256)
        assert torch.equal(t, big_t[rows]) and torch.equal(lp, big_lp[rows])


def test_empty_batch(device):
    tokens, logprobs = greedy_sample(torch.empty(0, 100, device=device), 100)
    assert tokens.shape == logprobs.shape == (0,)


def test_rejects_bad_arguments(device):
    x = torch.ones(2, 100, device=device)
    with pytest.raises(ValueError, match="logits must be float32/bfloat16/float16"):
        greedy_sample(x.double(), 100)
    with pytest.raises(ValueError, match="vocab_size=101"):
        greedy_sample(x, 101)
    with pytest.raises(ValueError, match="unit column stride"):
        greedy_sample(torch.ones(100, 2, device=device).t(), 100)
    with pytest.raises(ValueError, match="block=24"):
        greedy_sample(x, 100, block=24)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_sampler_fast_path_matches_general_path(name, device, monkeypatch):
    """All rows plain greedy: one greedy_sample call. The same rows asking for logprobs=0 take
    the general path (process, argmax, gather): same tokens, logprobs up to rounding. Beside a
    row with a penalty (a no-op here: it has no output), the plain rows still take greedy_sample
    and keep their logprobs bit for bit."""
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", name)
    calls = []
    real = backend.greedy_sample
    monkeypatch.setattr(backend, "greedy_sample", lambda *a: calls.append(a) or real(*a))
    v = 1000
    logits = random_logits(6, v + 24, seed=6, device=device)
    logits[:, v:] = 1e4
    logits[2, [10, 600]] = 30.0                                          # a tie
    s = Sampler(v, {2}, device=device)

    def rows(**kw) -> list[SamplingRow]:
        return [SamplingRow(SamplingParams(temperature=0.0, **kw), [1, 2], [3] * i) for i in range(6)]

    fast = s(logits, rows())
    assert len(calls) == 1
    general = s(logits, rows(logprobs=0))
    assert len(calls) == 1
    mixed = s(logits, rows()[:-1] + [SamplingRow(SamplingParams(temperature=0.0, presence_penalty=1.0), [1], [])])
    assert len(calls) == 2 and calls[1][0].shape[0] == 5
    assert fast.token_ids == general.token_ids == mixed.token_ids == logits[:, :v].argmax(-1).tolist()
    assert fast.token_ids[2] == 10
    torch.testing.assert_close(torch.tensor(fast.sampled_logprobs), torch.tensor(general.sampled_logprobs), **TOL)
    assert mixed.sampled_logprobs[:5] == fast.sampled_logprobs[:5]
    assert mixed.sampled_logprobs[5] == general.sampled_logprobs[5]
    assert fast.logprobs == [None] * 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_gpu_sizes(rows, dtype):
    """DeepSeek-V4's vocabulary (padded): no host sync in the launch, and a CUDA graph replay
    gives the same result on new logits."""
    vocab = 129280
    x = random_logits(rows, vocab + 128, seed=rows, dtype=dtype, device="cuda")
    x[:, vocab:] = 1e4
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        greedy_sample(x, vocab)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches_reference(x, vocab)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = greedy_sample(x, vocab)
    x.copy_(random_logits(rows, vocab + 128, seed=rows + 1, dtype=dtype, device="cuda"))
    graph.replay()
    ref_tokens, ref_logprobs = reference.greedy_sample(x, vocab)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, **TOL)
