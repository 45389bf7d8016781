"""DeepSeek-V4.1 engram gate (deepinfer/kernels/engram_gate.py) against
:func:`reference.engram_gate` on random streams and projections, including the first layer's
stride-0 streams and the gate at dot = 0."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.engram_gate import engram_gate

# float32: summation order and the exponential's rounding. Half precision: one rounding of the
# output (the interpreter truncates instead of rounding, tests/kernels/conftest.py: two ulps).
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 2 ** -7, "atol": 1e-2},
       torch.float16: {"rtol": 2 ** -10, "atol": 1e-3}}


def make_case(t: int, n: int, d: int, dtype: torch.dtype, gen: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    streams = (torch.randn(t, n, d, generator=gen) + 0.1).to(dtype)
    kv = (torch.randn(t, (n + 1) * d, generator=gen) * 2).to(dtype)
    weight = torch.randn(n, d, generator=gen) + 0.3
    return streams, kv, weight


@pytest.mark.parametrize("t, n, d", [(5, 4, 64), (3, 4, 1100), (1, 2, 48), (8, 4, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gate_matches_reference(device, t, n, d, dtype):
    gen = torch.Generator().manual_seed(t * 10 + d)
    streams, kv, weight = make_case(t, n, d, dtype, gen)
    got = engram_gate(streams.to(device), kv.to(device), weight.to(device), 1e-20).cpu()
    want = reference.engram_gate(streams, kv, weight, 1e-20)
    assert got.dtype == dtype and got.shape == (t, n, d)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert not torch.equal(want, streams)


def test_expanded_streams_and_signed_zero_dot(device):
    gen = torch.Generator().manual_seed(1)
    t, n, d = 6, 4, 96
    x = torch.rand(t, d, generator=gen) + 0.5                     # positive
    streams = x[:, None, :].expand(t, n, d)                       # the first layer's stride-0 streams
    kv = torch.randn(t, (n + 1) * d, generator=gen)
    kv[:, :n * d] = kv[:, :n * d].abs() + 0.1                     # positive keys
    weight = torch.randn(n, d, generator=gen)
    # Products of -0.0 sum to +0.0 (both sums start from +0.0, as DeepSeek's reference does):
    # the gate is sigmoid(+1e-3) either way.
    weight[1] = -0.0
    weight[2] = 0.0
    got = engram_gate(streams.to(device), kv.to(device), weight.to(device), 1e-20).cpu()
    want = reference.engram_gate(streams, kv, weight, 1e-20)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    value = kv[:, n * d:]
    large = value.abs() > 0.5
    for stream, gate in ((1, 0.50025), (2, 0.50025)):
        ratio = ((got[:, stream] - x) / value)[large]
        torch.testing.assert_close(ratio, torch.full_like(ratio, gate), atol=1e-5, rtol=0)


def test_launcher_checks_shapes():
    gen = torch.Generator().manual_seed(2)
    streams, kv, weight = make_case(3, 4, 32, torch.float32, gen)
    with pytest.raises(ValueError, match="kv must be"):
        engram_gate(streams, kv[:, :-1], weight, 1e-20)
    with pytest.raises(ValueError, match="weight must be"):
        engram_gate(streams, kv, weight.double(), 1e-20)
    with pytest.raises(ValueError, match="streams must be"):
        engram_gate(streams[0], kv, weight, 1e-20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_sizes_in_a_cuda_graph():
    """4 streams of 5120 in bf16 (the release), captured once and replayed with new streams."""
    from tests.kernels.conftest import capture
    gen = torch.Generator().manual_seed(10)
    streams, kv, weight = (x.cuda() for x in make_case(16, 4, 5120, torch.bfloat16, gen))
    graph, out = capture(lambda: engram_gate(streams, kv, weight, 1e-20))
    for _ in range(2):
        new = make_case(16, 4, 5120, torch.bfloat16, gen)[0]
        streams.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = reference.engram_gate(new, kv.cpu(), weight.cpu(), 1e-20)
        torch.testing.assert_close(out.cpu().float(), want.float(), **TOL[torch.bfloat16])
