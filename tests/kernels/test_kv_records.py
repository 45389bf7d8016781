"""DeepSeek-V4.1's packed KV records (deepinfer/kernels/kv_records.py): the store kernel against
:func:`reference.store_record` (``pack_record`` + ``store_kv``) byte for byte, its scalar
encodings against torch's float8 cast and :func:`reference._pow2_exponent` on every case that
matters, and the reference records against the rounding."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from deepinfer.kernels import backend, kv_records, reference
from deepinfer.kernels.kv_records import store_records
from deepinfer.kv_spec import KVCacheSpec, record_bytes
from tests.kernels.kv_inputs import random_inputs

FORMATS = ("mxfp8", "nvfp4", "mxfp4")
ROUND = {"mxfp8": reference.round_mxfp8, "nvfp4": reference.round_nvfp4, "mxfp4": reference.round_mxfp4}


@triton.jit
def _scalar_formats_kernel(x_ptr, e4m3_ptr, e4m3_back_ptr, exp_ptr, e2m1_ptr, e2m1_back_ptr, n,
                           BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=1.0)
    code = kv_records.e4m3_code(tl.minimum(tl.maximum(x, -448.0), 448.0))
    tl.store(e4m3_ptr + i, code, mask=ok)
    tl.store(e4m3_back_ptr + i, kv_records.e4m3_value(code), mask=ok)
    tl.store(exp_ptr + i, kv_records.pow2_exponent_code(tl.abs(x)), mask=ok)
    fp4 = kv_records.e2m1_code(tl.minimum(tl.maximum(x, -6.0), 6.0))
    tl.store(e2m1_ptr + i, fp4, mask=ok)
    tl.store(e2m1_back_ptr + i, kv_records.e2m1_value(fp4), mask=ok)


def scalar_formats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n = x.numel()
    outs = [torch.empty(n, dtype=torch.int32, device=x.device), torch.empty_like(x),
            torch.empty(n, dtype=torch.int32, device=x.device), torch.empty(n, dtype=torch.int32, device=x.device),
            torch.empty_like(x)]
    _scalar_formats_kernel[(triton.cdiv(n, 4096),)](x, *outs, n, BLOCK=4096)
    return tuple(outs)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def test_scalar_encodings_match_torch_and_the_reference(device):
    """E4M3 (nearest, ties to even, signed zeros, subnormals), E2M1 codes and values, and the
    power-of-two exponent: the E4M3 codes and their midpoints and neighbours, random values,
    and q = 2 ** k * (1 + j * 2 ** -23) for every exponent k and the mantissas j where float32
    log2 rounding decides the scale."""
    gen = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                   torch.randn(20000, generator=gen) * 100, torch.rand(5000, generator=gen) * 2**-8,
                   torch.tensor([-0.0, 0.0, 1e-40, -1e-40, 1e-45, 448.0, -448.0])]).clamp(-448, 448)
    ks = torch.arange(-126, 128)
    js = torch.cat([torch.arange(0, 40), torch.arange(0x7FFFFF - 3, 0x800000),
                    torch.randint(0, 0x800000, (20,), generator=gen)])
    pow2 = ((ks[:, None] + 127) << 23 | js[None, :]).flatten().int().view(torch.float32)
    x = torch.cat([x, pow2]).contiguous()
    e4m3, e4m3_back, exps, e2m1, e2m1_back = (t.cpu() for t in scalar_formats(x.to(device)))
    clamped = x.clamp(-448, 448)
    expected = clamped.to(torch.float8_e4m3fn)
    assert torch.equal(e4m3, expected.view(torch.uint8).int())
    assert torch.equal(bits(e4m3_back), bits(expected.float()))
    normal = x.abs() >= 2.0**-126                  # the exponent's contract (callers clamp amax above)
    assert torch.equal(exps[normal], reference._pow2_exponent(x.abs()[normal][:, None], 1.0)[:, 0].int())
    q = x.clamp(-6, 6)
    assert torch.equal(e2m1, reference.e2m1_codes(q).int())
    assert torch.equal(bits(e2m1_back), bits(reference._e2m1_values(e2m1.to(torch.uint8))))


def record_cache(num_blocks: int, bs: int, row: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [NB, 3 * bs * row + 7] byte page buffer of 0xA5, the [NB, bs, 1, 1, row] record view in
    its middle): the bytes around the view belong to other layers and must stay untouched."""
    buffer = torch.full((num_blocks, 3 * bs * row + 7), 0xA5, dtype=torch.uint8, device=device)
    off = bs * row + 7
    return buffer, buffer[:, off:off + bs * row].view(num_blocks, bs, 1, 1, row)


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_records_match_the_reference(fmt, device):
    """Rows of every magnitude (the format tests' hand-made blocks: ties, scale thresholds, zeros,
    subnormals, saturation) and D of 64 .. 512, a power of two or not, stored to random slots
    (some -1) of a strided page view: the same bytes as pack_record + store_kv, nothing else
    written."""
    gen = torch.Generator().manual_seed(41)
    for x in random_inputs(gen):
        x = x.reshape(-1, x.shape[-1])
        t, d = x.shape
        bs, num_blocks = 4, -(-t // 4) + 3
        row = record_bytes(fmt, d)
        buffer, cache = record_cache(num_blocks, bs, row, device)
        ref_buffer, ref_cache = record_cache(num_blocks, bs, row, device)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
        slots[::3] = -1
        slots, x = slots.to(device), x.to(device)
        store_records(cache, slots, x, fmt)
        reference.store_record(ref_cache, slots, x, fmt)
        # The reference writes only the view's rows at the slots: equal buffers mean the kernel
        # wrote those rows' bytes and nothing else.
        assert torch.equal(buffer, ref_buffer), f"{fmt} {tuple(x.shape)}"
        untouched = torch.full_like(cache, 0xA5)
        assert int((cache != untouched).any(dim=-1).sum()) >= int((slots >= 0).sum()) - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_records_of_half_rows(dtype, device):
    """16-bit rows (the model's compute dtype on CUDA) with int32 slots and a row stride (a slice
    of a wider buffer): encoded as their float32 values, as the reference does."""
    gen = torch.Generator().manual_seed(5)
    wide = (torch.randn(9, 3 * 128, generator=gen) * 3).to(dtype).to(device)
    x = wide[:, 128:256]
    slots = torch.tensor([5, -1, 0, 11, 7, -1, 2, 9, 14], dtype=torch.int32, device=device)
    for fmt in FORMATS:
        _, cache = record_cache(4, 4, record_bytes(fmt, 128), device)
        ref_buffer, ref_cache = record_cache(4, 4, record_bytes(fmt, 128), device)
        store_records(cache, slots, x, fmt)
        reference.store_record(ref_cache, slots, x, fmt)
        assert torch.equal(cache, ref_cache)
        rows = cache.reshape(-1, cache.shape[-1])[slots[slots >= 0].long()]
        decoded = reference.unpack_record(rows, fmt, 128, dtype)
        assert torch.equal(decoded, ROUND[fmt](x[slots >= 0]))


def test_store_records_reject_bad_inputs(device):
    _, cache = record_cache(4, 4, record_bytes("mxfp8", 64), device)
    x = torch.randn(3, 64, device=device)
    slots = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match=r"a nvfp4 record of 64 channels is 36 contiguous bytes, the "
                                         r"cache's rows are 66"):
        store_records(cache, slots, x, "nvfp4")
    with pytest.raises(ValueError, match="must be a uint8"):
        store_records(cache.float(), slots, x, "mxfp8")
    with pytest.raises(ValueError, match="slot_mapping must be"):
        store_records(cache, slots[:2], x, "mxfp8")
    with pytest.raises(ValueError, match=r"needs a positive multiple of 32 channels, got 48"):
        store_records(cache, slots, torch.randn(3, 48, device=device), "mxfp8")
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        store_records(cache, slots, x, "fp8")


def test_backend_store_record_on_both_backends(monkeypatch, device):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=gen).to(device)
    slots = torch.tensor([3, -1, 0, 6, 1], device=device)
    caches = []
    for choice in ("triton", "torch"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", choice)
        _, cache = record_cache(2, 4, record_bytes("nvfp4", 64), device)
        backend.store_record(cache, slots, x, "nvfp4")
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_records_hold_the_rounded_values(fmt):
    """pack_record: values then scales, record_bytes long; unpack_record gives the rounding bit for
    bit (528 / 288 / 68 bytes at the release's 512 / 512 / 128 channels)."""
    gen = torch.Generator().manual_seed(7)
    for x in random_inputs(gen):
        records = reference.pack_record(x, fmt)
        assert records.dtype == torch.uint8 and records.shape == (*x.shape[:-1], record_bytes(fmt, x.shape[-1]))
        assert torch.equal(bits(reference.unpack_record(records, fmt, x.shape[-1], torch.float32)),
                           bits(ROUND[fmt](x)))
    assert [record_bytes(f, d) for f, d in (("mxfp8", 512), ("nvfp4", 512), ("mxfp4", 128))] == [528, 288, 68]
    with pytest.raises(ValueError, match="uint8 rows of 66 bytes"):
        reference.unpack_record(torch.zeros(2, 65, dtype=torch.uint8), "mxfp8", 64, torch.float32)


def test_record_specs_size_the_cache():
    spec = KVCacheSpec("sliding", 1, 512, torch.uint8, num_tensors=1, sliding_window=128, record="mxfp8")
    assert spec.row_size == 528 and spec.entry_bytes == 528
    key = KVCacheSpec("compressed", 1, 128, torch.uint8, num_tensors=1, compress_ratio=2, record="mxfp4")
    assert key.entry_bytes == 68
    with pytest.raises(ValueError, match="needs dtype torch.uint8"):
        KVCacheSpec("full", 1, 512, torch.bfloat16, num_tensors=1, record="nvfp4")
    with pytest.raises(ValueError, match="multiple of 16 channels, got 40"):
        KVCacheSpec("full", 1, 40, torch.uint8, num_tensors=1, record="nvfp4")
