"""The FP4 fused MoE kernels (packed e2m1 experts dequantised in registers) against
reference.fp4_moe_experts on random data, with float32 scales (DeepSeek-V4) and UE8M0 bytes
(V4.1, MXFP4).

Accuracy stated in kernels/fp4_moe.py: against the reference the kernel differs by accumulation
order only (the fused bf16 kernel's tolerances); against the unquantised experts the routed
output's relative error is the format's, about 0.2 on Gaussian weights (allowed 0.3).
The CPU interpreter sweeps float32 and float16 (it multiplies bfloat16 tiles wrongly,
tests/kernels/conftest.py); bfloat16 runs on CUDA. Both paths are swept: the group path (codes as
e4m3, scale after each 32-input group's dot) with 1, 2 and 4 groups a K step, and the dequant
path; the group path's FP8 dots against reference.fp4_moe_experts_fp8.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from deepinfer.kernels import reference
from deepinfer.kernels.fp4_moe import (FP4Kernel, _nibbles_to_bf16, _nibbles_to_e4m3, fp4_moe, fp4_pick_config,
                                       fp4_pick_kernel)
from deepinfer.kernels.fused_moe import MoEConfig
from deepinfer.models.quant import SCALE_FORMATS, quant_fp4_e2m1

from .conftest import capture
from .test_fused_moe import make_experts, make_routing

ON_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# bf16: the kernel rounds the intermediate to bf16 before the down projection (2^-6 relative, up to
# 0.06 at the clamp 7), the reference keeps it in float32 (an H100 run: 0.0117 at one element).
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 1e-2, "atol": 2e-3},
       torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def quantised(gate_up: torch.Tensor, down: torch.Tensor, scale_format: str):
    return (*quant_fp4_e2m1(gate_up, 32, scale_format), *quant_fp4_e2m1(down, 32, scale_format))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# The dequant path and the default kernel over every batch shape; the other group-path variants
# (scale after the dot or on the tile, a load a group or a step, nibbles interleaved or split;
# 4 groups a step: a ragged last step over H = 96) at one.
KERNEL_CASES = ([(kern, t, limit) for kern in (FP4Kernel(path="dequant"), fp4_pick_kernel())
                 for t, limit in ((1, 0.0), (7, 0.7), (40, 7.0))]
                + [(kern, 7, 0.7) for kern in (
                    FP4Kernel(groups=1), FP4Kernel(groups=2), FP4Kernel(groups=4), FP4Kernel(groups=2, scale="weight"),
                    FP4Kernel(groups=2, scale="weight", wide=True), FP4Kernel(groups=4, scale="weight", wide=True),
                    FP4Kernel(groups=1, scale="weight", wide=True, split=True),
                    FP4Kernel(groups=2, scale="weight", wide=True, split=True),
                    FP4Kernel(groups=4, scale="weight32", wide=True, split=True),
                    FP4Kernel(groups=4, scale="weight", wide=True, split=True, prefetch=True),
                    FP4Kernel(groups=2, scale="weight32", wide=True, prefetch=True))])


def kernel_id(k: FP4Kernel) -> str:
    return (f"{k.path}-{k.dot}-g{k.groups}-{k.scale}{'-wide' if k.wide else ''}{'-split' if k.split else ''}"
            f"{'-prefetch' if k.prefetch else ''}")


@triton.jit
def _decode_bytes_kernel(b_ptr, lo_ptr, hi_ptr, ASM: tl.constexpr):
    offs = tl.arange(0, 256)
    lo, hi = _nibbles_to_e4m3(tl.load(b_ptr + offs), ASM)
    tl.store(lo_ptr + offs, lo.to(tl.float32))
    tl.store(hi_ptr + offs, hi.to(tl.float32))


@pytest.mark.parametrize("asm", [False] + ([True] if ON_CUDA else []))
def test_nibbles_to_e4m3_all_codes(asm, device):
    """Every byte: each nibble's e4m3 byte is its e2m1 value times 2^-6 exactly (16 codes, both
    nibbles, -0 included); on CUDA the inline PTX (4 bytes a register) too."""
    b = torch.arange(256, dtype=torch.uint8)
    lo, hi = torch.empty(256, device=device), torch.empty(256, device=device)
    _decode_bytes_kernel[(1,)](b.to(device), lo, hi, asm)
    lo, hi = lo.cpu(), hi.cpu()
    assert torch.equal(lo * 64, reference._e2m1_values(b & 15))
    assert torch.equal(hi * 64, reference._e2m1_values(b >> 4))
    assert torch.equal(torch.signbit(lo), (b & 8) != 0) and torch.equal(torch.signbit(hi), (b & 128) != 0)


@triton.jit
def _decode_bf16_kernel(b_ptr, lo_ptr, hi_ptr, ASM: tl.constexpr):
    offs = tl.arange(0, 256)
    lo, hi = _nibbles_to_bf16(tl.load(b_ptr + offs), ASM)
    tl.store(lo_ptr + offs, lo.to(tl.int16, bitcast=True))      # the bits (the interpreter flushes
    tl.store(hi_ptr + offs, hi.to(tl.int16, bitcast=True))      # bf16 subnormals it converts)


@pytest.mark.parametrize("asm", [False] + ([True] if ON_CUDA else []))
def test_nibbles_to_bf16_all_codes(asm, device):
    """Every byte: each nibble straight to bf16 bits is its e2m1 value times 2^-126 exactly (codes
    0 and 1 on bf16's subnormals, -0 included); on CUDA the inline PTX (4 bytes a register) too."""
    b = torch.arange(256, dtype=torch.uint8)
    lo, hi = (torch.empty(256, dtype=torch.int16, device=device) for _ in range(2))
    _decode_bf16_kernel[(1,)](b.to(device), lo, hi, asm)
    lo, hi = (v.cpu().view(torch.bfloat16).double() for v in (lo, hi))
    assert torch.equal(lo * 2.0 ** 126, reference._e2m1_values(b & 15).double())
    assert torch.equal(hi * 2.0 ** 126, reference._e2m1_values(b >> 4).double())
    assert torch.equal(torch.signbit(lo), (b & 8) != 0) and torch.equal(torch.signbit(hi), (b & 128) != 0)


@pytest.mark.parametrize("scale_format", SCALE_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,t,limit", KERNEL_CASES, ids=lambda v: kernel_id(v) if isinstance(v, FP4Kernel) else str(v))
def test_fp4_moe_matches_reference(t, limit, dtype, scale_format, kernel, device, poison_empty):
    e, h, i, k = 6, 96, 64, 2                            # H = 3 groups: a ragged last step for 2 and 4 a step
    gate_up, down = make_experts(e, h, i, torch.float32, "cpu", seed=t)
    weights = quantised(gate_up, down, scale_format)
    weights = [w.to(device) for w in weights]
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype).to(device)
    topk_weights, ids = make_routing(t, k, [0, 1, 3, 4, 5], device, seed=t)      # expert 2 gets nothing
    out = fp4_moe(x, *weights, topk_weights, ids, limit, kernel=kernel)
    ref = reference.fp4_moe_experts(x, *weights, topk_weights, ids, limit)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_fp4_moe_bf16_decode_refuses_what_it_cannot_read(device):
    gate_up, down = make_experts(2, 64, 32, torch.float32, "cpu")
    topk_weights, ids = make_routing(3, 1, [0, 1], device)
    x = torch.randn(3, 64).to(device)
    f32_scales = [w.to(device) for w in quantised(gate_up, down, "float32")]
    ue8m0 = [w.to(device) for w in quantised(gate_up, down, "ue8m0")]
    bits = FP4Kernel(groups=4, scale="weight", wide=True, split=True, decode="bf16")
    with pytest.raises(ValueError, match="decode='bf16' takes UE8M0"):
        fp4_moe(x.half(), *ue8m0, topk_weights, ids, kernel=bits)
    with pytest.raises(ValueError, match="decode='bf16' takes UE8M0"):
        fp4_moe(x.bfloat16(), *f32_scales, topk_weights, ids, kernel=bits)
    with pytest.raises(ValueError, match="needs wide=True"):
        FP4Kernel(decode="bf16")


PREFILL_LIKE = (96, MoEConfig(64, 32, 32, 64, 32, 1, 4, 2))


def fp8_dot_cases() -> list:
    """Decode-like (T=5) for every activation group and scale format; prefill-like (T=96, 3-7 s
    each in the interpreter) by default for two of them, one per scale format and activation group
    size, the other four with -m slow."""
    cases = []
    for act_group, groups in [(32, 2), (64, 1), (64, 4)]:
        for scale_format in SCALE_FORMATS:
            name = f"{act_group}-{groups}-{scale_format}"
            cases.append(pytest.param(act_group, groups, 5, None, scale_format, id=f"decode-{name}"))
            default = (act_group, groups, scale_format) in {(32, 2, "float32"), (64, 4, "ue8m0")}
            cases.append(pytest.param(act_group, groups, *PREFILL_LIKE, scale_format, id=f"prefill-{name}",
                                      marks=() if default else pytest.mark.slow))
    return cases


@pytest.mark.parametrize("act_group,groups,t,config,scale_format", fp8_dot_cases())
def test_fp4_moe_fp8_dots_match_their_reference(act_group, groups, t, config, scale_format, device, poison_empty):
    """FP8 dots, decode-like (a few pairs an expert) and prefill-like (about 50 an expert, 64-row
    blocks): the FP8 reference's result up to accumulation order, and within the activations' e4m3
    rounding (about 2^-4 relative an element) of the bf16-dot reference."""
    e, h, i, k = 4, 128, 64, 2
    gate_up, down = make_experts(e, h, i, torch.float32, "cpu", seed=t)
    weights = [w.to(device) for w in quantised(gate_up, down, scale_format)]
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(device)
    topk_weights, ids = make_routing(t, k, list(range(e)), device, seed=t)
    kernel = FP4Kernel(dot="fp8", groups=groups, act_group=act_group)
    out = fp4_moe(x, *weights, topk_weights, ids, 7.0, config=config, kernel=kernel)
    ref = reference.fp4_moe_experts_fp8(x, *weights, topk_weights, ids, 7.0, act_group, scale_format == "ue8m0")
    assert not out.isnan().any()
    # A float32 act that lands on the other side of an e4m3 rounding boundary moves one element of
    # the intermediate by an e4m3 step, and with it its token's whole output row a little; the rest
    # is accumulation order (and on CUDA the FP8 MMA's ~14-bit running sum, which moves more acts
    # across a boundary: 1 to 3 tokens of 96 on an H100).
    err = (out - ref).abs()
    scale = ref.abs().max().item()
    off_rows = (err > 1e-3 * scale + 1e-3 * ref.abs()).any(dim=1)
    assert off_rows.float().mean().item() <= 0.05, f"{int(off_rows.sum())} of {t} tokens off"
    assert err.max().item() < 2 ** -6 * scale
    exact = reference.fp4_moe_experts(x, *weights, topk_weights, ids, 7.0)
    assert 0.005 < rel_err(out, exact) < 0.1


@pytest.mark.parametrize("scale_format", SCALE_FORMATS)
def test_fp4_moe_accuracy_against_unquantised_experts(scale_format, device):
    e, h, i, t, k = 4, 128, 64, 16, 2
    gate_up, down = make_experts(e, h, i, torch.float32, "cpu", seed=1)
    weights = [w.to(device) for w in quantised(gate_up, down, scale_format)]
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).to(device)
    topk_weights, ids = make_routing(t, k, list(range(e)), device, seed=1)
    out = fp4_moe(x, *weights, topk_weights, ids, 0.0)
    exact = reference.clamped_moe_experts(x, gate_up.to(device), down.to(device), topk_weights, ids, 0.0)
    assert 0.05 < rel_err(out, exact) < 0.3


def test_fp4_moe_skips_ids_outside_the_experts(device, poison_empty):
    e, h, i, t = 4, 32, 32, 5
    gate_up, down = make_experts(e, h, i, torch.float32, "cpu", seed=3)
    weights = [w.to(device) for w in quantised(gate_up, down, "ue8m0")]
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3)).to(device)
    topk_weights, ids = make_routing(t, 2, list(range(e)), device, seed=3)
    ids[1, 0] = -1
    ids[3, :] = -1
    out = fp4_moe(x, *weights, topk_weights, ids, 0.0)
    ref = reference.fp4_moe_experts(x, *weights, topk_weights.masked_fill(ids < 0, 0.0), ids.clamp(min=0), 0.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out[3] == 0).all()


@pytest.mark.parametrize("config", [MoEConfig(16, 16, 32, 16, 32, 1, 4, 2), MoEConfig(32, 32, 64, 32, 64, 2, 4, 2)])
def test_fp4_moe_tile_configs(config, device, poison_empty):
    """Tiles smaller than the problem, and a ragged K tail (H=96 over 64-wide steps)."""
    e, h, i, t = 5, 96, 64, 9
    gate_up, down = make_experts(e, h, i, torch.float32, "cpu", seed=5)
    weights = [w.to(device) for w in quantised(gate_up, down, "float32")]
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).to(device)
    topk_weights, ids = make_routing(t, 3, list(range(e)), device, seed=5)
    out = fp4_moe(x, *weights, topk_weights, ids, 0.7, config=config)
    torch.testing.assert_close(out, reference.fp4_moe_experts(x, *weights, topk_weights, ids, 0.7),
                               rtol=1e-5, atol=1e-5)


def test_fp4_moe_rejects_bad_weights(device):
    gate_up, down = make_experts(2, 64, 32, torch.float32, "cpu")
    gq, gs, dq, ds = [w.to(device) for w in quantised(gate_up, down, "ue8m0")]
    x = torch.randn(3, 64).to(device)
    topk_weights, ids = make_routing(3, 1, [0, 1], device)
    with pytest.raises(ValueError, match="down scales"):
        fp4_moe(x, gq, gs, dq, ds[:, :, :0], topk_weights, ids)
    with pytest.raises(ValueError, match="differ"):
        fp4_moe(x, gq, gs, dq, ds.float(), topk_weights, ids)
    with pytest.raises(ValueError, match="gate_up must be uint8"):
        fp4_moe(x, gq.view(torch.int8), gs, dq, ds, topk_weights, ids)


def test_fp4_kernel_rejects_bad_choices(device):
    with pytest.raises(ValueError, match="path='fast'"):
        FP4Kernel(path="fast")
    with pytest.raises(ValueError, match="dot='fp4'"):
        FP4Kernel(dot="fp4")
    with pytest.raises(ValueError, match="groups=3"):
        FP4Kernel(groups=3)
    with pytest.raises(ValueError, match="scale='row'"):
        FP4Kernel(scale="row")
    with pytest.raises(ValueError, match="wide=True"):
        FP4Kernel(wide=True)
    with pytest.raises(ValueError, match="split=True"):
        FP4Kernel(scale="weight", split=True)
    with pytest.raises(ValueError, match="prefetch=True"):
        FP4Kernel(scale="weight", prefetch=True)
    gate_up, down = make_experts(2, 96, 32, torch.float32, "cpu")
    weights = [w.to(device) for w in quantised(gate_up, down, "ue8m0")]
    topk_weights, ids = make_routing(3, 1, [0, 1], device)
    with pytest.raises(ValueError, match="per 64 inputs, which must divide H=96"):
        fp4_moe(torch.randn(3, 96).to(device), *weights, topk_weights, ids, kernel=FP4Kernel(dot="fp8", act_group=64))


def test_fp4_pick_config_uses_pointer_loads():
    cfg = fp4_pick_config(4096, 6, 256, 4096, 2048)
    assert not cfg.tma and not cfg.sorted_act and cfg.block_m == 128
    assert fp4_pick_config(1, 6, 256, 4096, 2048).block_m == 16
    assert fp4_pick_kernel() == FP4Kernel(path="group", dot="bf16", groups=4, scale="weight", wide=True, split=True)
    prefill = fp4_pick_config(4096, 6, 256, 4096, 2048)
    assert fp4_pick_kernel(prefill) == FP4Kernel(path="group", dot="bf16", groups=2, scale="weight", wide=True,
                                                 split=True)
    # Small UE8M0 scales and bf16 activations: decode's codes straight to bf16 (prefill's unmeasured).
    assert fp4_pick_kernel(None, bf16_bits=True).decode == "bf16"
    assert fp4_pick_kernel(fp4_pick_config(16, 6, 256, 4096, 2048), bf16_bits=True).decode == "bf16"
    assert fp4_pick_kernel(prefill, bf16_bits=True).decode == "e4m3"


# -- GPU, DeepSeek-V4-Flash widths ----------------------------------------------------------------

@pytest.fixture(scope="module", params=SCALE_FORMATS)
def v4_fp4_experts_gpu(request):
    """E=256, H=4096, I=2048 in FP4 (3.4 GB), drawn and quantised on the GPU 16 experts at a time."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quant_fp4_e2m1(torch.randn(16, n, k, device="cuda", generator=gen) / k ** 0.5, 32, request.param)
                 for _ in range(256 // 16)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])

    return (*draw(4096, 4096), *draw(4096, 2048))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kernel", [FP4Kernel(path="dequant"), fp4_pick_kernel(),
                                    FP4Kernel(groups=2, scale="weight", wide=True), FP4Kernel(groups=1, asm=False),
                                    FP4Kernel(dot="fp8", groups=2),
                                    FP4Kernel(groups=4, scale="weight", wide=True, split=True, decode="bf16"),
                                    FP4Kernel(groups=4, scale="weight32", wide=True, split=True, decode="bf16"),
                                    FP4Kernel(groups=4, scale="weight", wide=True, split=True, decode="bf16",
                                              prefetch=True)],
                         ids=lambda k: kernel_id(k) + ("-asm" if k.asm else "") + f"-{k.decode}")
@pytest.mark.parametrize("t", [1, 16, 64, 4096])
def test_fp4_moe_gpu_v4_sizes(t, kernel, v4_fp4_experts_gpu):
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    weights, ids = reference.biased_topk(torch.randn(t, 256, device="cuda"), torch.zeros(256, device="cuda"),
                                         6, "sqrtsoftplus", 1.5)
    if kernel.decode == "bf16" and v4_fp4_experts_gpu[1].dtype != torch.uint8:
        with pytest.raises(ValueError, match="takes UE8M0"):                 # MXFP4 only
            fp4_moe(x, *v4_fp4_experts_gpu, weights, ids, 10.0, kernel=kernel)
        return
    out = fp4_moe(x, *v4_fp4_experts_gpu, weights, ids, 10.0, kernel=kernel)
    if kernel.dot == "fp8":
        pow2 = v4_fp4_experts_gpu[1].dtype == torch.uint8
        ref = reference.fp4_moe_experts_fp8(x, *v4_fp4_experts_gpu, weights, ids, 10.0, kernel.act_group, pow2)
    else:
        ref = reference.fp4_moe_experts(x, *v4_fp4_experts_gpu, weights, ids, 10.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 16, 64])
def test_fp4_moe_gpu_small_scales_decode_to_the_same_bits(t, v4_fp4_experts_gpu):
    """small_scales (UE8M0 scales of at most 2^1) picks the decode straight to bf16: the same bf16
    weights as through e4m3, so the same output bits. With float32 scales it changes nothing."""
    if v4_fp4_experts_gpu[1].dtype == torch.uint8:
        assert int(v4_fp4_experts_gpu[1].max()) <= 128 and int(v4_fp4_experts_gpu[3].max()) <= 128
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    weights, ids = reference.biased_topk(torch.randn(t, 256, device="cuda"), torch.zeros(256, device="cuda"),
                                         6, "sqrtsoftplus", 1.5)
    e4m3 = fp4_moe(x, *v4_fp4_experts_gpu, weights, ids, 10.0)
    bits = fp4_moe(x, *v4_fp4_experts_gpu, weights, ids, 10.0, small_scales=True)
    assert torch.equal(bits, e4m3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_fp4_moe_gpu_cuda_graph(v4_fp4_experts_gpu):
    from deepinfer.kernels.moe_routing import topk_route
    t = 16
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1

    def forward():
        weights, ids = topk_route(logits, 6, "sqrtsoftplus", 1.5, True, bias)
        return fp4_moe(x, *v4_fp4_experts_gpu, weights, ids, 10.0)

    graph, out = capture(forward)
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.testing.assert_close(out, forward(), rtol=0, atol=0)
