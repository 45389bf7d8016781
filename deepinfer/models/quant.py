"""Dequantisation of quantised checkpoint weights, as DeepSeek ships them.

- FP8: ``float8_e4m3fn`` weights with one scale per ``block x block`` tile
  (``[ceil(out/block), ceil(in/block)]``, e8m0 or float32), ``w = q * s``.
- Engram tables (DeepSeek-V4.1): ``float8_e4m3fn`` rows with one e8m0 scale per
  ``group`` values of a row (``[rows, cols/group]``), ``w = q * s``.
- FP4: ``e2m1`` values packed two per byte along the input dimension (low
  nibble first; stored as ``int8``, ``uint8`` or ``float4_e2m1fn_x2``) with one
  e8m0 scale per ``group`` inputs (``[out, in/group]``), ``w = q * s``.

Quantisation (the other way, for ``quantization="fp8"`` / ``"mxfp4-experts"`` and benchmark weights
made in the shipped formats): :func:`quant_fp8_block` and :func:`quant_fp4_e2m1` produce those
same layouts from floating-point weights, with float32 scales (``amax / max``) or UE8M0 bytes
(``2 ** ceil(log2(amax / max))``, stored as ``uint8``).

Every product is exact in float32 (e4m3/e2m1 values times a power of two, or
one float32 multiply for float scales): the functions return float32 and the
caller casts once to its compute dtype, as HF transformers does.

A quantised weight ``X.weight`` has its scale in ``X.scale`` (DeepSeek's names)
or ``X.weight_scale_inv`` (the DeepSeek-V3 HF names); :func:`pair_scales`
matches them in a stream of checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from deepinfer.kernels.reference import e2m1_codes

# The 16 e2m1 code points, indexed by the 4-bit code (sign bit is bit 3).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
# How a quantised weight's scales are stored: float32, or UE8M0 exponent bytes (uint8).
SCALE_FORMATS = ("float32", "ue8m0")
ENGRAM_TABLE_SUFFIX = ".engram.embed.weight"


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor as float32: e8m0 (``float8_e8m0fnu``, or raw ``uint8`` exponent
    bytes meaning ``2**(b - 127)``) or any float dtype."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor,
                      block: int | tuple[int, int] = 128) -> torch.Tensor:
    """FP8 weight [..., out, in] with scales [..., ceil(out/bn), ceil(in/bk)] -> float32;
    ``block`` is bn = bk, or (bn, bk)."""
    bn, bk = (block, block) if isinstance(block, int) else block
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // bn), -(-cols // bk))
    if tuple(scale.shape[-2:]) != grid or scale.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"FP8 weight of shape {tuple(weight.shape)} with {bn}x{bk} blocks needs "
                         f"a scale of shape {(*weight.shape[:-2], *grid)}, got {tuple(scale.shape)}")
    s = scale_to_float(scale)
    s = s.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]
    return weight.to(torch.float32) * s


def dequant_engram_table(weight: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP8 Engram table [rows, cols] with one scale per ``group`` values of a row
    ([rows, cols/group], e8m0 or raw exponent bytes) -> float32 [rows, cols]."""
    rows, cols = weight.shape
    if cols % group or tuple(scale.shape) != (rows, cols // group):
        raise ValueError(f"Engram table of shape {tuple(weight.shape)} with groups of {group} needs "
                         f"a scale of shape {(rows, cols // group)}, got {tuple(scale.shape)}")
    values = weight.to(torch.float32).view(rows, cols // group, group)
    return (values * scale_to_float(scale)[..., None]).view(rows, cols)


def unpack_fp4_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [..., n] (two codes per byte, low nibble first) -> float32 [..., 2n]."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).long()          # [..., n, 2]
    return lut[codes].flatten(-2)


def dequant_fp4_e2m1(packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Packed FP4 weight [..., out, in/2] with scales [..., out, in/group] -> float32 [..., out, in]."""
    values = unpack_fp4_e2m1(packed)                                  # [..., out, in]
    expected = (*values.shape[:-1], values.shape[-1] // group)
    if values.shape[-1] % group or tuple(scale.shape) != expected:
        raise ValueError(f"FP4 weight of shape {tuple(packed.shape)} (packed; {values.shape[-1]} inputs) "
                         f"with groups of {group} needs a scale of shape {expected}, "
                         f"got {tuple(scale.shape)}")
    return values * scale_to_float(scale).repeat_interleave(group, dim=-1)


def is_quantized(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES or tensor.dtype in FP4_DTYPES


def dequantize_weight(name: str, weight: torch.Tensor, scale: torch.Tensor,
                      fp8_block: int = 128, fp4_group: int = 32) -> torch.Tensor:
    """Checkpoint weight ``name`` dequantised with its scale, by the weight's storage dtype."""
    try:
        if weight.dtype in FP8_DTYPES and name.endswith(ENGRAM_TABLE_SUFFIX):
            # Engram tables scale each row's groups of 32, not 2-D blocks (and a small
            # table's grid shape would not tell the two apart).
            return dequant_engram_table(weight, scale)
        if weight.dtype in FP8_DTYPES:
            return dequant_fp8_block(weight, scale, fp8_block)
        if weight.dtype in FP4_DTYPES:
            return dequant_fp4_e2m1(weight, scale, fp4_group)
    except ValueError as err:
        raise ValueError(f"checkpoint tensor {name!r}: {err}") from None
    raise ValueError(f"checkpoint tensor {name!r} has a scale but dtype {weight.dtype}, "
                     f"which is neither FP8 ({FP8_DTYPES}) nor packed FP4 ({FP4_DTYPES})")


def scale_name_for(weight_name: str, names: Mapping[str, object]) -> str | None:
    """The scale tensor accompanying ``X.weight`` among ``names``, if any."""
    if not weight_name.endswith(".weight"):
        return None
    prefix = weight_name[: -len(".weight")]
    for suffix in SCALE_SUFFIXES:
        if prefix + suffix in names:
            return prefix + suffix
    return None


def pair_scales(weights: Iterable[tuple[str, torch.Tensor]], fp8_block: int = 128,
                fp4_group: int = 32,
                keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream checkpoint tensors with each quantised ``X.weight`` replaced by its float32
    dequantisation and its scale tensor consumed; other tensors pass through, and so do
    tensors named so that ``keep(name)`` is true (a weight the model keeps quantised, and its
    scale).

    A tensor named like a scale (``X.scale``) is only a scale if a quantised ``X.weight``
    exists: DeepSeek-V4's HF names also use ``.scale`` for plain parameters
    (``attn_hc.scale``), so unpaired ones are passed on at the end. Raises ValueError
    for a quantised weight without a scale.
    """
    weights_waiting: dict[str, tuple[str, torch.Tensor]] = {}   # prefix -> (name, quantised weight)
    scales_waiting: dict[str, tuple[str, torch.Tensor]] = {}    # prefix -> (name, scale)
    for name, tensor in weights:
        if keep is not None and keep(name):
            yield name, tensor
            continue
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            prefix = name[: -len(suffix)]
            if prefix in weights_waiting:
                wname, w = weights_waiting.pop(prefix)
                yield wname, dequantize_weight(wname, w, tensor, fp8_block, fp4_group)
            else:
                scales_waiting[prefix] = (name, tensor)
        elif name.endswith(".weight") and is_quantized(tensor):
            prefix = name[: -len(".weight")]
            if prefix in scales_waiting:
                yield name, dequantize_weight(name, tensor, scales_waiting.pop(prefix)[1],
                                              fp8_block, fp4_group)
            else:
                weights_waiting[prefix] = (name, tensor)
        else:
            yield name, tensor
    if weights_waiting:
        names = sorted(n for n, _ in weights_waiting.values())
        raise ValueError(f"{len(names)} quantised checkpoint weight(s) have no scale tensor "
                         f"(expected '<name>.scale' or '<name>.weight_scale_inv'): "
                         f"{', '.join(names[:10])}")
    yield from scales_waiting.values()


def _scales(amax: torch.Tensor, top: float, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale as float32, scale as stored) for blocks whose largest magnitude is ``amax`` (float32):
    ``amax / top``, or its UE8M0 rounding up to a power of two (so ``amax / scale <= top``)."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format={scale_format!r} is not one of {SCALE_FORMATS}")
    s = amax.clamp_min(1e-12) / top
    if scale_format == "float32":
        return s, s
    exponent = torch.ceil(torch.log2(s.double())).clamp(-127, 127)
    stored = (exponent + 127).to(torch.uint8)
    return scale_to_float(stored), stored


def quant_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128),
                    scale_format: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., out, in] -> (``float8_e4m3fn`` [..., out, in], scales [..., ceil(out/bn), ceil(in/bk)]),
    one scale per (bn, bk) = ``block`` tile; :func:`dequant_fp8_block` inverts it up to e4m3 rounding
    (relative error at most 2^-4 per element, absolute at most ``scale * 2^-10`` in the subnormals)."""
    bn, bk = block
    rows, cols = weight.shape[-2:]
    lead = weight.shape[:-2]
    gr, gc = -(-rows // bn), -(-cols // bk)
    w = torch.zeros(*lead, gr * bn, gc * bk, dtype=torch.float32, device=weight.device)
    w[..., :rows, :cols] = weight.float()
    tiles = w.view(*lead, gr, bn, gc, bk)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)                    # [..., gr, 1, gc, 1]
    s, stored = _scales(amax, 448.0, scale_format)
    q = (tiles / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(*lead, gr * bn, gc * bk)
    return q[..., :rows, :cols].contiguous(), stored.view(*lead, gr, gc)


def quant_fp4_e2m1(weight: torch.Tensor, group: int = 32,
                   scale_format: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., out, in] (in a multiple of ``group``) -> (e2m1 codes two a byte, low nibble first,
    ``uint8`` [..., out, in/2]; scales [..., out, in/group]). Values round to the nearest e2m1 point,
    ties to the even code; :func:`dequant_fp4_e2m1` inverts it up to that rounding."""
    cols = weight.shape[-1]
    if cols % group or group % 2:
        raise ValueError(f"FP4 weight of shape {tuple(weight.shape)}: the input width must be a multiple "
                         f"of the group size {group}")
    blocks = weight.float().reshape(*weight.shape[:-1], cols // group, group)
    s, stored = _scales(blocks.abs().amax(dim=-1, keepdim=True), 6.0, scale_format)
    codes = e2m1_codes((blocks / s).clamp(-6.0, 6.0), negative_zero=False).reshape(weight.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), stored.squeeze(-1)
