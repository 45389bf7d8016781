"""DeepSeek-V4's FP8 KV record (``ds_mla``, kv_spec.py ``ds_mla_format``): the reference rounding
against an independent re-implementation of DeepSeek's ``act_quant(kv[..., :-rd], 64, "ue8m0",
inplace=True)``, the record layout, the Triton store kernel byte for byte against
:func:`reference.store_record`, the kernels' in-register decode against :func:`reference.unpack_record`,
and the sparse attention on records against the same kernel on their decoded values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from deepinfer.kernels import backend, kv_records, reference
from deepinfer.kernels.kv_records import store_records
from deepinfer.kernels.sparse_attention import SparseAttentionConfig, sparse_attention
from deepinfer.kv_spec import KVCacheSpec, ds_mla_format, ds_mla_rope, record_bytes
from tests.kernels.test_kv_records import record_cache
from tests.kernels.test_sparse_attention import KERNEL_TOL, packed_inputs

# (D, R): the release's 512 / 64, the tiny test model's 64 / 16 (one short block of 48), a
# nope part of exactly one block, and two blocks with the last short.
SHAPES = [(512, 64), (64, 16), (96, 32), (128, 8)]

# The positive finite E4M3 values in code order (code 0x7F is NaN): the independent grid.
_E4M3 = np.array([(m / 8 * 2.0 ** -6) if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                  for e in range(16) for m in range(8)][:127])


def independent_round(x: torch.Tensor, rope: int) -> torch.Tensor:
    """DeepSeek's rounding written out element by element in float64 from its definition:
    per block of 64 nope channels, s = 2 ** ceil(log2(float32(amax * float32(1/448)))) with amax
    floored at float32(1e-4), x / s clipped to +-448 and rounded to the nearest E4M3 value
    (ties to the even code), times s; the RoPE channels to the nearest bf16 (ties to even)."""
    xs = x.double().numpy().reshape(-1, x.shape[-1])
    out = np.empty_like(xs)
    nope = x.shape[-1] - rope
    inv = np.float32(1.0 / 448.0)
    for i, row in enumerate(xs):
        for b0 in range(0, nope, 64):
            block = row[b0:min(b0 + 64, nope)]
            amax = max(np.float32(np.abs(block).max()), np.float32(1e-4))
            prod = np.float32(np.float32(amax) * inv)
            frac, exp = math.frexp(float(prod))            # prod = frac * 2 ** exp, frac in [0.5, 1)
            scale = 2.0 ** (exp - 1 if frac == 0.5 else exp)
            q = np.clip(block / scale, -448.0, 448.0)
            mag = np.abs(q)
            hi = np.searchsorted(_E4M3, mag).clip(max=126)
            lo = (hi - 1).clip(min=0)
            d_lo, d_hi = mag - _E4M3[lo], _E4M3[hi] - mag
            pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
            out[i, b0:b0 + len(block)] = np.sign(q) * _E4M3[pick] * scale
        for c in range(nope, x.shape[-1]):
            bits = int(np.array(row[c], dtype=np.float32).view(np.uint32))
            keep, rest = bits >> 16, bits & 0xFFFF
            keep += rest > 0x8000 or (rest == 0x8000 and keep & 1)
            out[i, c] = float(np.array(keep << 16, dtype=np.uint32).view(np.float32))
    return torch.from_numpy(out).reshape(x.shape)


def random_rows(gen: torch.Generator, n: int, d: int, rope: int) -> torch.Tensor:
    """[n, d] float32 rows at magnitudes 1e-7 .. 1e4 (per block), with hand-made blocks: an amax
    exactly 448 * 2 ** k and just above it, E4M3 midpoints, values near 448 * scale, tiny values
    under the 1e-4 floor, and one zero block."""
    x = torch.randn(n, d, generator=gen)
    nope = d - rope
    blocks = -(-nope // 64)
    mags = 10.0 ** torch.randint(-7, 5, (n, blocks), generator=gen).float()
    x[:, :nope] *= mags.repeat_interleave(64, dim=1)[:, :nope]
    x[:, nope:] *= 10.0 ** torch.randint(-3, 3, (n, 1), generator=gen).float()
    width = min(64, nope)
    x[0, :width] = torch.linspace(-448.0, 448.0, width)                    # amax 448: scale 1
    x[1, :width] = torch.linspace(-1.0, 1.0, width) * 448.0 * 2.0**-5
    x[1, 0] = 448.0 * 2.0**-5 * (1 + 2.0**-20)                              # just above: next scale
    grid = torch.from_numpy(_E4M3).float()
    x[2, :width] = ((grid[1:width + 1] + grid[:width]) / 2) * 2.0**-3      # midpoints: ties
    x[2, 0] = 448.0 * 2.0**-3
    x[3, :width] = torch.rand(width, generator=gen) * 3e-5                  # under the 1e-4 floor
    x[4, :width] = 0.0
    x[5, :width] = 447.0 + torch.rand(width, generator=gen)                 # near FP8 max
    # One float32 step above 448 * 2 ** -5: the product's mantissa is no longer zero, so the exact
    # ceiling takes 2 ** -4 (a log2 rounded to float32 first would keep 2 ** -5).
    x[6, :width] = torch.linspace(-1.0, 1.0, width) * 14.0
    x[6, 0] = torch.tensor(14.0).nextafter(torch.tensor(15.0))
    x[6, 1:4] = torch.tensor([9e-5, -3e-4, 5e-5])       # E4M3 subnormals: their step follows the scale
    return x


@pytest.mark.parametrize("d,rope", SHAPES)
def test_rounding_matches_an_independent_implementation(d, rope):
    gen = torch.Generator().manual_seed(d + rope)
    x = random_rows(gen, 24, d, rope)
    got = reference.round_ds_mla(x, rope)
    want = independent_round(x, rope).float()
    assert torch.equal(got, want)
    # The rounding did something: the nope part moved, the bf16 part is bf16.
    assert not torch.equal(got[:, :d - rope], x[:, :d - rope])
    assert torch.equal(got[:, d - rope:], x[:, d - rope:].to(torch.bfloat16).float())
    # 448 * 2 ** k keeps the scale 2 ** k (the float32 constant 1/448 rounds up, the product back
    # down to 2 ** k); a hair above takes the next scale and rounds the rest more coarsely.
    assert float(got[0, 0]) == -448.0 and float(got[0, min(64, d - rope) - 1]) == 448.0
    assert float(got[1, 0]) == 448.0 * 2.0**-5 and float(got[1, 2]) != float(x[1, 2])
    assert int(reference.pack_ds_mla(x[6:7], rope)[0, d + rope]) == 127 - 4


def test_rounding_keeps_the_input_dtype_and_rope_channels():
    x = (torch.randn(4, 512) * 3).to(torch.bfloat16)
    got = reference.round_ds_mla(x, 64)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[:, 448:], x[:, 448:])
    assert torch.equal(got.float(), independent_round(x.float(), 64).float())


@pytest.mark.parametrize("d,rope", SHAPES)
def test_record_layout(d, rope):
    """codes, then the bf16 RoPE values' bytes, then the scale bytes, then zeros; 584 bytes at
    D = 512, R = 64; unpack gives the rounding bit for bit."""
    fmt = ds_mla_format(rope)
    gen = torch.Generator().manual_seed(3)
    x = random_rows(gen, 8, d, rope)
    rec = reference.pack_record(x, fmt)
    nope = d - rope
    nb = -(-nope // 64)
    assert rec.dtype == torch.uint8 and rec.shape == (8, record_bytes(fmt, d)) and rec.shape[1] % 8 == 0
    assert rec.shape[1] - (nope + 2 * rope + nb) < 8
    rounded = reference.round_ds_mla(x, rope)
    assert torch.equal(rec[:, nope:nope + 2 * rope].contiguous().view(torch.bfloat16),
                       x[:, nope:].to(torch.bfloat16))
    scales = torch.exp2(rec[:, nope + 2 * rope:nope + 2 * rope + nb].float() - 127)
    values = rec[:, :nope].view(torch.float8_e4m3fn).float() * scales.repeat_interleave(64, 1)[:, :nope]
    assert torch.equal(values, rounded[:, :nope])
    assert not rec[:, nope + 2 * rope + nb:].any()
    assert torch.equal(reference.unpack_record(rec, fmt, d, torch.float32), rounded)
    assert record_bytes(ds_mla_format(64), 512) == 584


def test_format_names_and_specs():
    assert ds_mla_format(64) == "ds_mla_r64" and ds_mla_rope("ds_mla_r64") == 64
    assert ds_mla_rope("mxfp8") is None and ds_mla_rope("ds_mla_r07") is None and ds_mla_rope("ds_mla_r") is None
    with pytest.raises(ValueError, match="even number of RoPE channels"):
        ds_mla_format(15)
    with pytest.raises(ValueError, match="needs more than 64 channels"):
        record_bytes("ds_mla_r64", 64)
    spec = KVCacheSpec("sliding", 1, 512, torch.uint8, num_tensors=1, sliding_window=128, record="ds_mla_r64")
    assert spec.row_size == 584 and spec.entry_bytes == 584
    assert KVCacheSpec("compressed", 1, 64, torch.uint8, num_tensors=1, compress_ratio=4,
                       record="ds_mla_r16").entry_bytes == 88
    assert kv_records.format_id("ds_mla_r64") == kv_records.DS_MLA.value + 64


@pytest.mark.parametrize("d,rope", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kernel_matches_the_reference(d, rope, dtype, device):
    """Rows stored to random slots (some -1) of a strided page view: the same bytes as
    pack_record + store_kv, nothing else written (16-bit rows: the CUDA compute dtype)."""
    fmt = ds_mla_format(rope)
    gen = torch.Generator().manual_seed(d * 7 + rope)
    t = 12
    wide = torch.zeros(t, d + 16, dtype=dtype)
    wide[:, 8:8 + d] = random_rows(gen, t, d, rope).to(dtype)
    x = wide[:, 8:8 + d].to(device)                                  # a row stride
    bs, num_blocks = 4, 6
    buffer, cache = record_cache(num_blocks, bs, record_bytes(fmt, d), device)
    ref_buffer, ref_cache = record_cache(num_blocks, bs, record_bytes(fmt, d), device)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    slots[::4] = -1
    slots = slots.to(torch.int32).to(device)
    store_records(cache, slots, x, fmt)
    reference.store_record(ref_cache, slots, x, fmt)
    assert torch.equal(buffer, ref_buffer)
    rows = cache.reshape(-1, cache.shape[-1])[slots[slots >= 0].long()]
    assert torch.equal(reference.unpack_record(rows, fmt, d, torch.float32),
                       reference.round_ds_mla(x[slots >= 0].float(), rope))


def test_backend_store_record_on_both_backends(monkeypatch, device):
    gen = torch.Generator().manual_seed(6)
    x = random_rows(gen, 8, 64, 16).to(device)
    slots = torch.tensor([3, -1, 0, 6, 1, 7, 2, 5], device=device)
    caches = []
    for choice in ("triton", "torch"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", choice)
        _, cache = record_cache(2, 4, record_bytes("ds_mla_r16", 64), device)
        backend.store_record(cache, slots, x, "ds_mla_r16")
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])


@triton.jit
def _decode_kernel(cache_ptr, slots_ptr, out_ptr, head_dim, stride_block, stride_offset,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr):
    j = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + j)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    row = (slot // BLOCK_SIZE).to(tl.int64) * stride_block + (slot % BLOCK_SIZE) * stride_offset
    mask = valid[:, None] & (dims[None, :] < head_dim)
    value = kv_records.load_record_rows(cache_ptr, row, dims, mask, head_dim, FMT)
    tl.store(out_ptr + j[:, None] * BLOCK_D + dims[None, :], value)


@pytest.mark.parametrize("d,rope", SHAPES)
def test_kernel_decode_matches_unpack(d, rope, device):
    """load_record_rows (what the attention kernel reads) gives unpack_record's float32 values bit
    for bit; masked lanes (slot -1, channels past D) give 0."""
    fmt = ds_mla_format(rope)
    gen = torch.Generator().manual_seed(d + 1)
    _, cache = record_cache(3, 4, record_bytes(fmt, d), device)
    x = random_rows(gen, 12, d, rope)
    all_slots = torch.arange(12)
    reference.store_record(cache, all_slots.to(device), x.to(device), fmt)
    slots = torch.tensor([5, -1, 0, 11, 7, 2, -1, 9], dtype=torch.int32)
    block_d = triton.next_power_of_2(d)
    out = torch.full((8, block_d), float("nan"), device=device)
    _decode_kernel[(1,)](cache, slots.to(device), out, d, cache.stride(0), cache.stride(1),
                         BLOCK_SIZE=4, BLOCK_N=8, BLOCK_D=block_d, FMT=kv_records.format_id(fmt))
    want = torch.zeros(8, block_d)
    ok = slots >= 0
    want[ok, :d] = reference.unpack_record(cache.reshape(-1, cache.shape[-1])[slots[ok].long()].cpu(), fmt, d,
                                           torch.float32)
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))


DS_CASES = [
    # t, h, d, sources [(bs, nt, K, fmt)], dtype, config
    (4, 4, 64, [(8, 1, 40, "ds_mla_r16"), (4, 1, 17, "ds_mla_r16")], torch.float32, None),   # window + entries
    (5, 4, 96, [(8, 1, 24, "ds_mla_r32"), (4, 1, 17, "ds_mla_r32")], torch.float32,
     SparseAttentionConfig(16, 16, 3, 4, 2)),                                                 # splits
    (3, 6, 64, [(4, 1, 20, "ds_mla_r16")], torch.float16, None),                             # one source
    (4, 16, 128, [(8, 1, 21, None), (4, 1, 33, "ds_mla_r8")], torch.float16,
     SparseAttentionConfig(16, 16, 1, 4, 2)),                                                 # a plain source beside
]


@pytest.mark.parametrize("t,h,d,specs,dtype,config", DS_CASES)
def test_sparse_attention_reads_ds_mla_records(t, h, d, specs, dtype, config, device, poison_empty):
    """The kernel on record sources equals the same kernel on the records' decoded values bit for
    bit in the interpreter (to rounding on a GPU), and the reference on records equals it on values."""
    gen = torch.Generator().manual_seed(sum(k for _, _, k, _ in specs) + d)
    q, sinks, sources, values, q_values, formats = packed_inputs(t, h, d, specs, dtype, device, gen)
    ref = reference.sparse_attention(q, values, sinks, 0.2)
    assert torch.equal(reference.sparse_attention(q, sources, sinks, 0.2, formats), ref)
    out = sparse_attention(q, sources, sinks, 0.2, config, formats=formats)
    on_values = sparse_attention(q, q_values, sinks, 0.2, config)
    assert not out.isnan().any()
    if out.is_cuda:
        torch.testing.assert_close(out, on_values, atol=2e-3, rtol=2e-3)
    else:
        assert torch.equal(out, on_values)
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])
    assert torch.equal(out[1], torch.zeros_like(out[1]))       # row 1 has no key in any source


def test_rope_attention_passes_formats_on_both_backends(monkeypatch, device):
    """backend.rope_attention (q norm + rope, the attention, the inverse rope) over record sources:
    the Triton path and the torch path agree, and both equal the torch path on decoded values."""
    gen = torch.Generator().manual_seed(21)
    t, h, d = 4, 4, 64
    q, sinks, sources, values, _, formats = packed_inputs(
        t, h, d, [(8, 1, 12, "ds_mla_r16"), (4, 1, 9, "ds_mla_r16")], torch.float32, device, gen)
    positions = torch.tensor([3, 9, 17, 30], device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)).to(device)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    want = backend.rope_attention(q, positions, inv_freq, 1.0, 1e-6, values, sinks, 0.2)
    outs = []
    for choice in ("torch", "triton"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", choice)
        outs.append(backend.rope_attention(q.clone(), positions, inv_freq, 1.0, 1e-6, sources, sinks, 0.2, formats))
    assert torch.equal(outs[0], want)
    torch.testing.assert_close(outs[1], want, **KERNEL_TOL[torch.float32])


def test_sparse_attention_rejects_mismatched_ds_mla_sources(device):
    gen = torch.Generator().manual_seed(13)
    q, sinks, sources, _, _, _ = packed_inputs(2, 4, 64, [(4, 1, 5, "ds_mla_r16")], torch.float32, device, gen)
    with pytest.raises(ValueError, match=r"ds_mla_r32 record of D=64: 104 bytes\], got \(12, 4, 1, 1, 88\)"):
        sparse_attention(q, sources, sinks, 1.0, formats=["ds_mla_r32"])
    with pytest.raises(ValueError, match="'ds_mla_r15' is not one of"):
        sparse_attention(q, sources, sinks, 1.0, formats=["ds_mla_r15"])
