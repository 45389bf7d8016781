"""DeepSeek-V4.1 KV-cache formats: reference.round_mxfp8 / round_nvfp4 / round_mxfp4 against
mlx-lm's own fake quantisation (mlx_lm/models/deepseek_v41.py) bit for bit, and the packed
records (pack_* / unpack_*) against the rounding."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_lm.models import deepseek_v41 as v41

from deepinfer.kernels import reference

from .kv_inputs import random_inputs

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_SIGNED = torch.cat([E2M1, -E2M1])
E4M3_FINITE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_FINITE = E4M3_FINITE[~E4M3_FINITE.isnan()]                          # every byte but 0x7F, 0xFF

# name -> (reference rounding, mlx-lm's rounding, pack, unpack, block size)
FORMATS: dict[str, tuple[Callable, Callable, Callable, Callable, int]] = {
    "mxfp8": (reference.round_mxfp8, lambda x: v41._fake_quant_fp8(x, 32),
              reference.pack_mxfp8, reference.unpack_mxfp8, 32),
    "nvfp4": (reference.round_nvfp4, lambda x: v41._fake_quant_fp4(x, block_size=16, e4m3_scale=True),
              reference.pack_nvfp4, reference.unpack_nvfp4, 16),
    "mxfp4": (reference.round_mxfp4, lambda x: v41._fake_quant_fp4(x, block_size=32),
              reference.pack_mxfp4, reference.unpack_mxfp4, 32),
}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that equality also compares signed zeros."""
    return x.view({4: torch.int32, 2: torch.int16}[x.element_size()])


def mlx_round(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """mlx-lm's rounding of x (float32, bfloat16 or float16), returned in x's dtype."""
    arr = mx.array(x.float().numpy()).astype({torch.float32: mx.float32, torch.bfloat16: mx.bfloat16,
                                              torch.float16: mx.float16}[x.dtype])
    out = FORMATS[fmt][1](arr)
    assert out.dtype == arr.dtype
    return torch.from_numpy(np.array(out.astype(mx.float32))).to(x.dtype)


@pytest.fixture(scope="module")
def inputs() -> list[torch.Tensor]:
    return random_inputs(torch.Generator().manual_seed(41))


@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_mlx_lm_float32(fmt, inputs):
    ours = FORMATS[fmt][0]
    for x in inputs:
        out = ours(x)
        assert out.dtype == x.dtype and out.shape == x.shape
        assert torch.equal(bits(out), bits(mlx_round(fmt, x))), f"{fmt} differs on shape {tuple(x.shape)}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_mlx_lm_half(fmt, dtype, inputs):
    """Half inputs round as their float32 values do; the result, cast back, is exact in bfloat16."""
    ours = FORMATS[fmt][0]
    for x in (inputs[0], inputs[1], inputs[-2]):
        x = (x.clamp(-6e4, 6e4) if dtype == torch.float16 else x).to(dtype)
        out = ours(x)
        assert out.dtype == dtype
        assert torch.equal(bits(out), bits(mlx_round(fmt, x)))
        if dtype == torch.bfloat16:
            assert torch.equal(out.float(), ours(x.float()))


def test_power_of_two_scale_follows_float32_log2():
    """A block maximum one ulp above 448 * 2**5 keeps the scale 2**5 (float32 log2 rounds to 5)
    and clips to 448 * 2**5; an exact rule would pick 2**6 and zero the small companion."""
    peak = torch.tensor(448.0 * 32).nextafter(torch.tensor(1e9))
    x = torch.zeros(32)
    x[0], x[1] = peak, 2.0 ** -9 * 32                                   # E4M3's smallest step at 2**5
    _, exps = reference.pack_mxfp8(x)
    assert exps.tolist() == [127 + 5]
    assert reference.round_mxfp8(x)[:2].tolist() == [448.0 * 32, 2.0 ** -9 * 32]
    assert torch.equal(reference.round_mxfp8(x), mlx_round("mxfp8", x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_idempotent(fmt, inputs):
    """round(round(x)) == round(x) in value (a negative E2M1 zero rounds again to +0), except NVFP4
    blocks with 9 * 2**-9 <= amax <= 10 * 2**-9, whose scale changes from 2**-8 to 2**-9."""
    ours, block = FORMATS[fmt][0], FORMATS[fmt][4]
    for x in inputs:
        once = ours(x)
        twice = ours(once)
        same = (twice == once).reshape(*x.shape[:-1], -1, block).all(-1)
        if fmt == "nvfp4":
            amax = x.abs().reshape(*x.shape[:-1], -1, block).amax(-1)
            same |= (amax >= 9 * 2.0**-9) & (amax <= 10 * 2.0**-9)
        assert same.all()
        if fmt == "mxfp8":
            assert torch.equal(bits(twice), bits(once))


def test_nvfp4_not_idempotent_below_the_normal_scales():
    x = torch.zeros(16)
    x[0] = 0.018                                           # amax / 6 = 1.54 * 2**-9: scale 2**-8, 4.6 -> 4
    once = reference.round_nvfp4(x)
    assert once[0].item() == 2.0**-6
    assert reference.round_nvfp4(once)[0].item() == 6 * 2.0**-9


def test_signed_zeros():
    """E4M3 keeps the sign of zero; E2M1 gives -0 for a negative value that rounds to zero and +0
    for a zero input of either sign (mlx-lm multiplies by sign(x))."""
    x = torch.zeros(32)
    x[0], x[1], x[2] = 6.0, -0.1, -0.0
    for fmt in ("nvfp4", "mxfp4"):
        out = FORMATS[fmt][0](x)
        assert torch.equal(bits(out[1:3]), bits(torch.tensor([-0.0, 0.0])))
    assert torch.equal(bits(reference.round_mxfp8(torch.full((32,), -0.0))), bits(torch.full((32,), -0.0)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_round_trip(fmt, dtype, inputs):
    ours, _, pack, unpack, block = FORMATS[fmt]
    for x in inputs:
        x = x.to(dtype)
        values, scales = pack(x)
        assert values.dtype == scales.dtype == torch.uint8
        c = x.shape[-1]
        assert values.shape == (*x.shape[:-1], c if fmt == "mxfp8" else c // 2)
        assert scales.shape == (*x.shape[:-1], c // block)
        out = unpack(values, scales, dtype)
        assert out.dtype == dtype and torch.equal(bits(out), bits(ours(x)))


def test_record_sizes():
    """Bytes a row: window KV 528 (MXFP8, 512 channels), compressed entry 288 (NVFP4, 512),
    index key 68 (MXFP4, 128)."""
    row, key = torch.randn(3, 512), torch.randn(3, 128)
    for pack, x, size in [(reference.pack_mxfp8, row, 528), (reference.pack_nvfp4, row, 288),
                          (reference.pack_mxfp4, key, 68)]:
        values, scales = pack(x)
        assert values[0].numel() * values.element_size() + scales[0].numel() * scales.element_size() == size


def test_nibble_order():
    """Two E2M1 codes a byte, the even channel in the low nibble; sign in bit 3."""
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 6.0, -1.0, -0.5, 4.0                  # unit scale in both E2M1 formats
    for pack in (reference.pack_nvfp4, reference.pack_mxfp4):
        values, _ = pack(x)
        assert values[:2].tolist() == [0x7 | (0xA << 4), 0x9 | (0x6 << 4)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_on_the_grid(fmt, inputs):
    ours, _, pack, _, block = FORMATS[fmt]
    for x in inputs:
        values, scales = pack(x)
        out = ours(x).reshape(*x.shape[:-1], -1, block)
        if fmt == "nvfp4":
            scale = scales.view(torch.float8_e4m3fn).float()[..., None]
            assert ((scale >= 2.0**-9) & (scale <= 448.0)).all()
        else:
            assert ((scales >= 1) & (scales <= 254)).all()
            scale = torch.exp2(scales.float() - 127)[..., None]
        grid = E4M3_FINITE if fmt == "mxfp8" else E2M1_SIGNED
        assert torch.isin(out / scale, grid).all()
    if fmt == "mxfp8":   # the floor 1e-4 gives an all-zero block the exponent ceil(log2(1e-4 / 448)) = -22
        assert reference.pack_mxfp8(torch.zeros(2, 64))[1].tolist() == [[127 - 22] * 2] * 2


def test_rejects_ragged_rows():
    for fn, c in [(reference.round_mxfp8, 48), (reference.round_nvfp4, 24), (reference.pack_mxfp4, 16)]:
        with pytest.raises(ValueError, match="multiple of"):
            fn(torch.zeros(2, c))
