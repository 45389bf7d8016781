"""DeepSeek-V4.1 engram lookup: gather the table rows a step needs and dequantise them on the
device; reference: :func:`reference.engram_gather`.

The table stays in its checkpoint form: E4M3 codes [R, E] (one byte a value) and one E8M0
scale a group of ``E / G`` values ([R, G], one byte each; float32 scales also taken). It may
live in pinned host memory: a pinned (or ``cudaHostRegister``-ed) buffer is device-accessible
at its host address under unified virtual addressing, and Triton resolves a pointer argument
through ``cuPointerGetAttribute``, so the kernel reads the host table in place over PCIe
(zero-copy: only the gathered rows cross the bus, and the ids never leave the device). A
device-resident table takes the same kernel.

Grid (ceil(T*C / BLOCK_R),): a program takes BLOCK_R (token, column) pairs, loads each pair's
id, and reads that row as a [G, E/G] tile (a row's E bytes are contiguous: one 256-byte read
in the release) with its G scales. The E4M3 bytes are decoded with integer operations (exact,
and the same under the interpreter and on every GPU); the product with the power-of-two
scale is exact in float32 and rounds once to the output dtype, so the rows equal
``dequant_engram_table(table)[ids]`` cast to that dtype bit for bit. Ids outside ``[0, R)``
read nothing and give zero rows. Nothing reads back to the host (CUDA-graph safe).

Shapes: T tokens, C hash columns, R table rows, E row width, G scale groups a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

# Values one program gathers: 16 release rows of 256 (4 KB of codes), so a decode step's few
# thousand rows spread over a hundred programs or more, each keeping several PCIe reads in flight.
_TILE_ELEMS = 4096
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)


@triton.jit
def _e4m3_to_f32(b):
    """E4M3 (fn: no infinities, S.1111.111 is NaN) bytes as int32 0..255 -> float32, exactly."""
    negative = b >= 128
    exp = (b >> 3) & 15
    man = b & 7
    # Normal: (8 + man) * 2**(exp - 10) = 1.man * 2**(exp - 7), rebiased to float32's 127.
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)   # subnormal: man * 2**-9
    magnitude = tl.where((exp == 15) & (man == 7), float("nan"), magnitude)
    return tl.where(negative, -magnitude, magnitude)


@triton.jit
def _e8m0_to_f32(s):
    """E8M0 bytes as int32 0..255 -> float32 ``2 ** (s - 127)``, exactly (0: 2**-127, a
    subnormal; 255: NaN)."""
    value = (s << 23).to(tl.float32, bitcast=True)
    value = tl.where(s == 0, tl.full(s.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True), value)
    return tl.where(s == 255, float("nan"), value)


@triton.jit
def _engram_gather_kernel(
    codes_ptr, scales_ptr, ids_ptr, out_ptr,
    n_pairs, num_rows,
    stride_codes_row, stride_scales_row, stride_ids_t, stride_ids_c, stride_out_t,
    COLS: tl.constexpr, WIDTH: tl.constexpr, GROUPS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_SIZE: tl.constexpr,
    SCALE_BYTES: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pair = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)      # [BLOCK_R]
    in_range = pair < n_pairs
    t = pair // COLS
    c = pair % COLS
    row = tl.load(ids_ptr + t * stride_ids_t + c * stride_ids_c, mask=in_range, other=-1).to(tl.int64)
    hit = in_range & (row >= 0) & (row < num_rows)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, GROUP_SIZE)
    g_ok = g < GROUPS
    ok2 = hit[:, None] & g_ok[None, :]                                            # [BLOCK_R, BLOCK_G]
    ok3 = ok2[:, :, None]
    col = g[:, None] * GROUP_SIZE + j[None, :]                                    # [BLOCK_G, GROUP_SIZE]
    src = codes_ptr + row[:, None, None] * stride_codes_row + col[None, :, :]
    q = tl.load(src, mask=ok3, other=0).to(tl.int32) & 255
    if SCALE_BYTES:
        s = tl.load(scales_ptr + row[:, None] * stride_scales_row + g[None, :], mask=ok2, other=127)
        scale = _e8m0_to_f32(s.to(tl.int32) & 255)
    else:
        scale = tl.load(scales_ptr + row[:, None] * stride_scales_row + g[None, :], mask=ok2, other=1.0)
    values = _e4m3_to_f32(q) * scale[:, :, None]                                  # exact in float32
    values = tl.where(ok3, values, 0.0)
    dst = out_ptr + t[:, None, None] * stride_out_t + c[:, None, None] * WIDTH + col[None, :, :]
    tl.store(dst, values.to(out_ptr.dtype.element_ty), mask=in_range[:, None, None] & g_ok[None, :, None])


def engram_gather(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the FP8 table (codes [R, E] ``float8_e4m3fn`` or uint8 bytes, scales
    [R, G] ``float8_e8m0fnu`` / uint8 exponent bytes / float32; each row's last dim
    contiguous) dequantised on the ids' device: ids [T, C] int32/int64 -> [T, C, E] in
    ``dtype``. The table may be in pinned host memory (see the module docstring); E / G must
    be a power of two."""
    if codes.dim() != 2 or codes.dtype not in (torch.float8_e4m3fn, torch.uint8) or codes.stride(1) != 1:
        raise ValueError(f"engram_gather: codes must be [R, E] float8_e4m3fn (or uint8) with E contiguous, "
                         f"got {codes.dtype} of shape {tuple(codes.shape)} strides {codes.stride()}")
    rows, width = codes.shape
    if scales.dim() != 2 or scales.shape[0] != rows or scales.dtype not in SCALE_DTYPES or scales.stride(1) != 1:
        raise ValueError(f"engram_gather: scales must be [{rows}, G] ({', '.join(map(str, SCALE_DTYPES))}) with "
                         f"G contiguous, got {scales.dtype} of shape {tuple(scales.shape)} strides {scales.stride()}")
    groups = scales.shape[1]
    group_size = width // groups if groups else 0
    if not groups or width % groups or group_size & (group_size - 1):
        raise ValueError(f"engram_gather: a row of {width} values must split into the {groups} scale groups "
                         "of a power-of-two size")
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"engram_gather: ids must be [T, C] int32/int64, got {ids.dtype} of shape {tuple(ids.shape)}")
    if codes.device != scales.device:
        raise ValueError(f"engram_gather: codes on {codes.device} but scales on {scales.device}")
    if codes.device != ids.device and not (ids.is_cuda and codes.device.type == "cpu" and codes.is_pinned()
                                           and scales.is_pinned()):
        raise ValueError(f"engram_gather: a table on {codes.device} for ids on {ids.device} must be in pinned "
                         "host memory (the kernel reads it through its device-mapped address)")
    t, c = ids.shape
    out = torch.empty(t, c, width, dtype=dtype, device=ids.device)
    if t * c == 0:
        return out
    # Tile config: whole rows (G groups padded to a power of two x E/G), as many as fill
    # _TILE_ELEMS values; 4 warps (the program is a handful of loads and integer decodes).
    block_g = triton.next_power_of_2(groups)
    block_r = max(1, _TILE_ELEMS // (block_g * group_size))
    scale_bytes = scales.dtype != torch.float32
    _engram_gather_kernel[(triton.cdiv(t * c, block_r),)](
        codes.view(torch.uint8), scales.view(torch.uint8) if scale_bytes else scales, ids, out,
        t * c, rows,
        codes.stride(0), scales.stride(0), ids.stride(0), ids.stride(1), out.stride(0),
        COLS=c, WIDTH=width, GROUPS=groups, BLOCK_R=block_r, BLOCK_G=block_g, GROUP_SIZE=group_size,
        SCALE_BYTES=scale_bytes, num_warps=4, **pdl.flags(ids.device))
    return out
