"""FP8 block / FP4 e2m1 dequantisation vs HF transformers' reference (``Fp8Dequantize``),
and the pairing of ``.scale`` tensors with their weights in a checkpoint stream."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.quant import (dequant_fp4_e2m1, dequant_fp8_block, pair_scales, scale_name_for,
                                    unpack_fp4_e2m1)

transformers = pytest.importorskip("transformers")
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402


def hf_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)


def random_fp8(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)


def random_e8m0(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(100, 140, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("scale_kind", ["e8m0", "float32"])
@pytest.mark.parametrize("shape", [(256, 384), (3, 128, 256)])
def test_fp8_block_matches_hf(shape, scale_kind):
    g = torch.Generator().manual_seed(0)
    q = random_fp8(shape, g)
    grid = (*shape[:-2], shape[-2] // 128, shape[-1] // 128)
    scale = random_e8m0(grid, g) if scale_kind == "e8m0" else torch.rand(grid, generator=g) + 0.5
    got = dequant_fp8_block(q, scale, 128)
    assert got.dtype == torch.float32
    assert torch.equal(got, hf_dequant(q, scale))


def test_fp8_partial_blocks_and_raw_exponent_bytes():
    """Shapes that are not multiples of the block (scales cover ceil(n/block) tiles), and
    e8m0 scales stored as raw uint8 exponents (2**(b - 127))."""
    g = torch.Generator().manual_seed(1)
    q = random_fp8((200, 130), g)
    scale = random_e8m0((2, 2), g)
    got = dequant_fp8_block(q, scale.view(torch.uint8), 128)
    want = torch.empty(200, 130)
    for i in range(2):
        for j in range(2):
            tile = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            want[tile] = q[tile].float() * 2.0 ** (int(scale.view(torch.uint8)[i, j]) - 127)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"needs a scale of shape \(2, 2\), got \(2, 1\)"):
        dequant_fp8_block(q, scale[:, :1], 128)


@pytest.mark.parametrize("storage", [torch.int8, torch.uint8, torch.float4_e2m1fn_x2])
def test_fp4_matches_hf(storage):
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (4, 64, 48), generator=g, dtype=torch.uint8)   # 96 inputs per row
    scale = random_e8m0((4, 64, 3), g)
    got = dequant_fp4_e2m1(packed.view(storage), scale, 32)
    assert got.shape == (4, 64, 96)
    want = torch.stack([hf_dequant(p.view(torch.int8), s) for p, s in zip(packed, scale)])
    assert torch.equal(got, want)


def test_fp4_code_points_and_nibble_order():
    # byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0); 0xF8: -0.0 then -6.0
    got = unpack_fp4_e2m1(torch.tensor([[0x21, 0xF8]], dtype=torch.uint8))
    assert got.tolist() == [[0.5, 1.0, -0.0, -6.0]]
    with pytest.raises(ValueError, match="needs a scale of shape"):
        dequant_fp4_e2m1(torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 2), 32)


def test_pair_scales_dequantises_and_passes_other_tensors():
    g = torch.Generator().manual_seed(3)
    q1, s1 = random_fp8((128, 128), g), random_e8m0((1, 1), g)
    q2, s2 = random_fp8((128, 256), g), torch.rand(1, 2, generator=g)
    packed = torch.randint(0, 256, (8, 16), generator=g, dtype=torch.uint8).view(torch.int8)
    s4 = random_e8m0((8, 1), g)
    hc_scale = torch.rand(3)
    stream = [
        ("a.scale", s1), ("a.weight", q1),                     # scale first (safetensors' sorted order)
        ("b.weight", q2), ("b.weight_scale_inv", s2),          # weight first, V3-style name
        ("layers.0.attn_hc.scale", hc_scale),                  # a plain parameter named '.scale'
        ("e.weight", packed), ("e.scale", s4),
        ("norm.weight", torch.ones(4)),
    ]
    out = dict(pair_scales(stream))
    assert set(out) == {"a.weight", "b.weight", "layers.0.attn_hc.scale", "e.weight", "norm.weight"}
    assert torch.equal(out["a.weight"], hf_dequant(q1, s1))
    assert torch.equal(out["b.weight"], hf_dequant(q2, s2))
    assert torch.equal(out["e.weight"], hf_dequant(packed, s4))
    assert out["layers.0.attn_hc.scale"] is hc_scale


def test_pair_scales_errors():
    q = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no scale tensor.*x.weight"):
        list(pair_scales([("x.weight", q)]))
    with pytest.raises(ValueError, match=r"'x.weight'.*needs a scale of shape \(1, 1\)"):
        list(pair_scales([("x.scale", torch.ones(2, 2)), ("x.weight", q)]))


def test_scale_name_for():
    names = {"a.scale": 0, "b.weight_scale_inv": 0}
    assert scale_name_for("a.weight", names) == "a.scale"
    assert scale_name_for("b.weight", names) == "b.weight_scale_inv"
    assert scale_name_for("c.weight", names) is None
    assert scale_name_for("a.bias", names) is None
