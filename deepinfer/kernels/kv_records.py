"""DeepSeek-V4.1's packed KV records: encode rows and scatter them to cache slots, and
the in-register decoding the attention and indexer kernels use on load; reference:
:func:`reference.store_record` (``pack_record`` + ``store_kv``) and :func:`reference.unpack_record`.

A record is one row of D channels, its values first, then one scale byte per block of
channels (kv_spec.py ``record_bytes``; byte layouts in docs/ARCHITECTURE.md):

- MXFP8 (window rows): D E4M3 bytes, then D/32 E8M0 bytes (scale ``2 ** (byte - 127)``);
- NVFP4 (compressed entries): D/2 bytes of E2M1 codes, channel 2i in the low nibble of byte
  i, then D/16 E4M3 scale bytes;
- MXFP4 (index keys): D/2 bytes of E2M1 codes as NVFP4's, then D/32 E8M0 bytes;
- ds_mla (DeepSeek-V4's FP8 KV, ``kv_spec.ds_mla_format``): the D - R nope channels as E4M3
  bytes, the R RoPE channels as bf16 (two bytes each, little-endian), one E8M0 byte per 64
  nope channels, zero padding to a multiple of 8 bytes; reference :func:`reference.pack_ds_mla`.

The encodings are :func:`reference._encode_mxfp8` / ``_encode_nvfp4`` / ``_encode_mxfp4`` bit
for bit, written with integer operations: Triton's float -> float8 cast rounds ties away
from zero in the CPU interpreter, and its ``log2`` is approximate on the GPU. Divisions are
IEEE (``div_rn``), as the reference's.

Store grid: one program per token, which encodes its whole row (the D/B scale blocks as
the rows of a [D/B, B] tile, padded to a power of two) and writes it to
``cache[slot // bs, slot % bs, 0, 0]``; a slot of -1 writes nothing. FP4 formats load the even
and odd channels of each block as two [D/B, B/2] tiles, whose codes pair up into bytes
without a reshape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kv_spec import ds_mla_rope, record_block, record_bytes

# Kernel constexpr ids of the cache formats: plain values, then the records (constexpr globals,
# which compiled kernels may read; plain ints work only in the interpreter). A ds_mla record's
# id is DS_MLA + R: its RoPE width R rides in the constexpr, so the kernels' signatures stay.
PLAIN, MXFP8, NVFP4, MXFP4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
DS_MLA = tl.constexpr(256)
FORMAT_IDS: dict[str | None, int] = {None: PLAIN.value, "mxfp8": MXFP8.value, "nvfp4": NVFP4.value,
                                     "mxfp4": MXFP4.value}
_FP8_MAX_INV = tl.constexpr(1.0 / 448.0)      # a float32 constant in the kernels, as in DeepSeek's


def format_id(fmt: str | None) -> int:
    """The kernels' constexpr id of a cache format (None: plain values)."""
    rope = ds_mla_rope(fmt)
    if rope is not None:
        return DS_MLA.value + rope
    if fmt not in FORMAT_IDS:
        raise ValueError(f"KV cache format {fmt!r} is not one of None, mxfp8, nvfp4, mxfp4, ds_mla_r<R>")
    return FORMAT_IDS[fmt]


# -- scalar formats, element-wise on int32 codes and float32 values ----------------------------------
@triton.jit
def e4m3_code(x):
    """float32 x with |x| <= 448 -> E4M3 byte (int32), rounded to nearest, ties to even; the
    sign bit is kept (-0 and negatives rounding to 0 give 0x80), as torch's cast."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    # Normal E4M3 (|x| >= 2 ** -6, float32 exponent >= 121): round the 23 mantissa bits to 3
    # on the bits themselves (a carry moves into the exponent), then rebias 127 -> 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Below: the multiple of 2 ** -9 (E4M3's subnormal step), the significand shifted right by
    # 141 - exp and rounded to nearest even; from 26 on everything rounds to 0 (the clamp also
    # keeps the unused lanes of normal values in range).
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - exp, 1), 26)
    kept = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((kept & 1) == 1))
    sub = kept + up.to(tl.int32)
    return tl.where(exp >= 121, normal, sub) | sign


@triton.jit
def e4m3_value(code):
    """E4M3 byte (int32 0..255, not 0x7F / 0xFF) -> its float32 value (code 0x80 is -0)."""
    e = (code >> 3) & 15
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((code & 0x80) != 0, -mag, mag)


@triton.jit
def e2m1_code(q):
    """float32 q in [-6, 6] -> E2M1 code (int32 0..15), as :func:`reference.e2m1_codes`."""
    mag = tl.abs(q)
    index = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
             + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
             + (mag > 5.0).to(tl.int32))
    return index | tl.where(q < 0, 8, 0)


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32 0..15) -> float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 8 is -0)."""
    i = code & 7
    # Codes >= 2 are 2 ** ((i >> 1) - 1) * (1 + (i & 1) / 2): built from the bits.
    normal = ((((i >> 1) + 126) << 23) | ((i & 1) << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(i < 2, i.to(tl.float32) * 0.5, normal)
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def e8m0_value(code):
    """E8M0 byte (int32 1..254) -> float32 ``2 ** (code - 127)``, exact."""
    return (code << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_exponent_code(q):
    """E8M0 byte (int32) of ``2 ** ceil(log2(q))`` with the log2 rounded to float32 first, as
    :func:`reference._pow2_exponent`; q is a positive normal float32.

    q = 2 ** k * (1 + j * 2 ** -23): the exponent is k when j = 0, and when log2(q) is so close
    above k that it rounds to k in float32, i.e. log2(1 + j * 2 ** -23) < u / 2 with u the
    float32 step next to k towards k + 1, ``2 ** (p - 23)``: p = floor(log2(k)) for k > 0,
    floor(log2(-k - 1)) for k < 0 (the step below a power of two is half). That holds for
    j <= floor(2 ** (p - 1) * ln 2): 0 for p <= 1, then 1, 2, 5, 11, 22 for p = 2 .. 6
    (|k| <= 127). Otherwise the exponent is k + 1.
    """
    bits = q.to(tl.int32, bitcast=True)
    k = (bits >> 23) - 127
    j = bits & 0x7FFFFF
    n = tl.where(k > 0, k, -k - 1)
    limit = tl.where(n >= 64, 22, tl.where(n >= 32, 11, tl.where(n >= 16, 5,
                     tl.where(n >= 8, 2, tl.where(n >= 4, 1, 0)))))
    return tl.where(j <= limit, k, k + 1) + 127


# -- reading records ---------------------------------------------------------------------------
@triton.jit
def load_record_rows(cache_ptr, row, dims, mask, head_dim, FMT: tl.constexpr):
    """[N, BLOCK_D] float32 values of the records that start at element offsets ``row`` [N],
    channels ``dims`` [BLOCK_D]; masked lanes read nothing and give 0. Scale bytes are read
    once per channel (the 16 or 32 channels of a block share an address)."""
    base = cache_ptr + row[:, None]
    if FMT >= DS_MLA:
        # ds_mla: channels [0, D-R) are E4M3 bytes with an E8M0 scale per 64, the trailing R
        # are bf16 (two bytes, little-endian) right after them.
        nope = head_dim - (FMT - DS_MLA)
        is_nope = dims[None, :] < nope
        nope_mask = mask & is_nope
        rope_mask = mask & (dims[None, :] >= nope)
        code = tl.load(base + dims[None, :], mask=nope_mask, other=0).to(tl.int32)
        scale = tl.load(base + nope + 2 * (FMT - DS_MLA) + dims[None, :] // 64, mask=nope_mask,
                        other=127).to(tl.int32)
        at = base + nope + 2 * (dims[None, :] - nope)
        lo = tl.load(at, mask=rope_mask, other=0).to(tl.int32)
        hi = tl.load(at + 1, mask=rope_mask, other=0).to(tl.int32)
        rope = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
        value = tl.where(is_nope, e4m3_value(code) * e8m0_value(scale), rope)
    elif FMT == MXFP8:
        code = tl.load(base + dims[None, :], mask=mask, other=0).to(tl.int32)
        scale = tl.load(base + head_dim + dims[None, :] // 32, mask=mask, other=0).to(tl.int32)
        value = e4m3_value(code) * e8m0_value(scale)
    else:
        byte = tl.load(base + dims[None, :] // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((dims[None, :] & 1) * 4)) & 15
        if FMT == NVFP4:
            scale = tl.load(base + head_dim // 2 + dims[None, :] // 16, mask=mask, other=0).to(tl.int32)
            value = e2m1_value(code) * e4m3_value(scale)
        else:
            scale = tl.load(base + head_dim // 2 + dims[None, :] // 32, mask=mask, other=0).to(tl.int32)
            value = e2m1_value(code) * e8m0_value(scale)
    return tl.where(mask, value, 0.0)


# -- storing records -----------------------------------------------------------------------------
@triton.jit
def _fp4_block_codes(x_even, x_odd, FMT: tl.constexpr):
    """Two [NB, B/2] float32 tiles (a block's even and odd channels) -> (packed code bytes
    [NB, B/2], scale byte [NB]) of NVFP4 (B = 16) or MXFP4 (B = 32)."""
    amax = tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1))   # [NB]
    if FMT == NVFP4:
        amax = tl.maximum(amax, 0.01171875)                          # 6 * 2 ** -9: scale >= 2 ** -9
        scale_code = e4m3_code(tl.minimum(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)), 448.0))
        scale = e4m3_value(scale_code)
    else:
        amax = tl.maximum(amax, 7.052966104933725e-38)               # 6 * 2 ** -126: scale >= 2 ** -126
        scale_code = pow2_exponent_code(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
        scale = e8m0_value(scale_code)
    q_even = tl.minimum(tl.maximum(tl.math.div_rn(x_even, scale[:, None] + tl.zeros_like(x_even)), -6.0), 6.0)
    q_odd = tl.minimum(tl.maximum(tl.math.div_rn(x_odd, scale[:, None] + tl.zeros_like(x_odd)), -6.0), 6.0)
    return e2m1_code(q_even) | (e2m1_code(q_odd) << 4), scale_code


@triton.jit
def _store_ds_mla(src, dst, blocks, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                  ROPE_P2: tl.constexpr, PAD: tl.constexpr):
    """Encode one row (``src``, HEAD_DIM float values) as a ds_mla record at ``dst``: the nope
    channels in [NB, 64] blocks (DeepSeek's ``act_quant`` with UE8M0 scales, bit for bit), the
    RoPE channels rounded to bf16 (nearest even, on the bits: the interpreter's casts differ),
    the scale bytes, then PAD zero bytes."""
    NOPE = HEAD_DIM - ROPE
    cols = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]                 # [NB, 64]
    live = cols < NOPE
    x = tl.load(src + cols, mask=live, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)                           # [NB]
    # ceil(log2(amax * (1/448))) from the float32 product's bits: the biased exponent, plus one
    # when any mantissa bit is set; that is the scale's E8M0 byte.
    bits = (amax * _FP8_MAX_INV).to(tl.int32, bitcast=True)
    scale_code = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    q = tl.math.div_rn(x, e8m0_value(scale_code)[:, None] + tl.zeros_like(x))
    code = e4m3_code(tl.minimum(tl.maximum(q, -448.0), 448.0))
    tl.store(dst + cols, code.to(tl.uint8), mask=live)
    tl.store(dst + NOPE + 2 * ROPE + blocks, scale_code.to(tl.uint8), mask=blocks * BLOCK < NOPE)
    r = tl.arange(0, ROPE_P2)
    rope_ok = r < ROPE
    rb = tl.load(src + NOPE + r, mask=rope_ok, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    half = (rb + 0x7FFF + ((rb >> 16) & 1)) >> 16          # bf16 bits (finite inputs), nearest even
    tl.store(dst + NOPE + 2 * r, (half & 0xFF).to(tl.uint8), mask=rope_ok)
    tl.store(dst + NOPE + 2 * r + 1, ((half >> 8) & 0xFF).to(tl.uint8), mask=rope_ok)
    if PAD > 0:
        p = tl.arange(0, 8)
        tl.store(dst + NOPE + 2 * ROPE + (NOPE + BLOCK - 1) // BLOCK + p, tl.zeros([8], tl.uint8), mask=p < PAD)


@triton.jit
def _store_records_kernel(
    x_ptr, slot_ptr, cache_ptr,
    stride_x, stride_cache_block, stride_cache_offset,
    FMT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROPE_P2: tl.constexpr = 1, PAD: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
        src = x_ptr + token * stride_x
        blocks = tl.arange(0, NUM_BLOCKS_P2)                                      # [NB]
        live = blocks < HEAD_DIM // BLOCK
        if FMT >= DS_MLA:
            _store_ds_mla(src, dst, blocks, FMT - DS_MLA, HEAD_DIM, BLOCK, ROPE_P2, PAD)
        elif FMT == MXFP8:
            cols = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]           # [NB, B]
            x = tl.load(src + cols, mask=live[:, None], other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)       # an all-zero block gets 2 ** -22
            scale_code = pow2_exponent_code(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
            q = tl.math.div_rn(x, e8m0_value(scale_code)[:, None] + tl.zeros_like(x))
            code = e4m3_code(tl.minimum(tl.maximum(q, -448.0), 448.0))
            tl.store(dst + cols, code.to(tl.uint8), mask=live[:, None])
            tl.store(dst + HEAD_DIM + blocks, scale_code.to(tl.uint8), mask=live)
        else:
            pairs = blocks[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]   # [NB, B/2] bytes
            x_even = tl.load(src + 2 * pairs, mask=live[:, None], other=0.0).to(tl.float32)
            x_odd = tl.load(src + 2 * pairs + 1, mask=live[:, None], other=0.0).to(tl.float32)
            packed, scale_code = _fp4_block_codes(x_even, x_odd, FMT)
            tl.store(dst + pairs, packed.to(tl.uint8), mask=live[:, None])
            tl.store(dst + HEAD_DIM // 2 + blocks, scale_code.to(tl.uint8), mask=live)


def store_records(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """Encode each row of x as a ``fmt`` record and write it to ``cache[slot // bs, slot % bs, 0, 0]``
    for each token whose slot is >= 0 (see :func:`reference.store_record`).

    cache: [NB, bs, 1, 1, record_bytes(fmt, D)] uint8 (any block/offset strides, bytes
    contiguous); slot_mapping: [T] int; x: [T, D] float (any row stride, D contiguous).
    """
    if cache.dim() != 5 or cache.shape[2:4] != (1, 1) or cache.dtype != torch.uint8:
        raise ValueError(f"store_records: cache must be a uint8 [NB, bs, 1, 1, R] record cache, got "
                         f"{cache.dtype} of shape {tuple(cache.shape)}")
    if x.dim() != 2 or not x.is_floating_point() or x.stride(1) != 1:
        raise ValueError(f"store_records: x must be a float [T, D] tensor with D contiguous, got "
                         f"{x.dtype} of shape {tuple(x.shape)} strides {x.stride()}")
    t, d = x.shape
    block = record_block(fmt)
    rope = ds_mla_rope(fmt)
    if cache.shape[4] != record_bytes(fmt, d) or cache.stride(4) != 1:
        raise ValueError(f"store_records: a {fmt} record of {d} channels is {record_bytes(fmt, d)} "
                         f"contiguous bytes, the cache's rows are {cache.shape[4]} (strides {cache.stride()})")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_records: slot_mapping must be [T={t}] int32/int64, got "
                         f"{slot_mapping.dtype} of shape {tuple(slot_mapping.shape)}")
    if not (x.device == cache.device == slot_mapping.device):
        raise ValueError(f"store_records: x, cache and slot_mapping must share a device, got "
                         f"{x.device}, {cache.device}, {slot_mapping.device}")
    if t == 0:
        return
    # Tile config: one program per token and its whole row (at most a few hundred channels).
    # ds_mla: the scale blocks cover the D - R nope channels (the last may be short).
    scaled = d if rope is None else d - rope
    num_blocks = -(-scaled // block)
    extra = {} if rope is None else {
        "ROPE_P2": triton.next_power_of_2(rope),
        "PAD": record_bytes(fmt, d) - (scaled + 2 * rope + num_blocks)}
    _store_records_kernel[(t,)](
        x, slot_mapping.contiguous(), cache, x.stride(0), cache.stride(0), cache.stride(1),
        FMT=format_id(fmt), HEAD_DIM=d, BLOCK=block, NUM_BLOCKS_P2=triton.next_power_of_2(num_blocks),
        BLOCK_SIZE=cache.shape[1], num_warps=4, **extra,
        **pdl.flags(cache.device))
