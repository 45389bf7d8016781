"""What one attention layer needs from the KV cache.

Models declare a :class:`KVCacheSpec` per attention layer; the engine groups
layers with equal :attr:`KVCacheSpec.group_key` into KV-cache groups that share
one block table per sequence (DESIGN.md, Contracts: KV-cache layer groups).
The scheduler only sees the group-level facts (kind, window, ratio); the runner
uses the per-layer sizes to lay out device memory.

A cache holds plain values (``record`` None: one ``dtype`` element per channel) or
*packed records* (``record`` names the format; ``dtype`` is ``torch.uint8``): each
row of ``head_size`` channels is stored as :func:`record_bytes` bytes, its values
first and then its block scales (docs/ARCHITECTURE.md, DeepSeek-V4.1 KV formats;
``kernels/kv_records.py`` and ``kernels/reference.py`` ``pack_record``). DeepSeek-V4's own
FP8 record (``ds_mla_r{R}``, :func:`ds_mla_format`) keeps the trailing R RoPE channels in
bf16 and the others in E4M3 with a power-of-two scale per 64 (docs/ARCHITECTURE.md,
DeepSeek-V4 FP8 KV records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

CacheKind = Literal["full", "sliding", "compressed"]
# DeepSeek-V4.1's KV records: MXFP8 (E4M3 values, a power-of-two scale per 32 channels),
# NVFP4 (E2M1 values two a byte, an E4M3 scale per 16), MXFP4 (E2M1 values, a power-of-two
# scale per 32).
RecordFormat = Literal["mxfp8", "nvfp4", "mxfp4"]
RECORD_FORMATS: tuple[str, ...] = get_args(RecordFormat)
# format -> (bits per value, channels per one-byte scale)
_RECORD_LAYOUT = {"mxfp8": (8, 32), "nvfp4": (4, 16), "mxfp4": (4, 32)}

# DeepSeek-V4's FP8 record ("ds_mla" in DeepSeek's and vLLM's kernels), one format per RoPE
# width R: ``ds_mla_r{R}``. A row of D channels is its D - R "nope" channels as E4M3 bytes,
# then the R RoPE channels as bf16 (little-endian), then one E8M0 scale byte per 64 nope
# channels (the last block shorter when 64 does not divide D - R), zero bytes up to a multiple
# of 8: 448 + 128 + 7 + 1 = 584 bytes at D = 512, R = 64.
DS_MLA_PREFIX = "ds_mla_r"
DS_MLA_BLOCK = 64
DS_MLA_ALIGN = 8
_DS_MLA_MAX_ROPE = 254       # the kernels' format id carries R (kv_records.py)


def ds_mla_format(rope_dim: int) -> str:
    """The record format of DeepSeek-V4's FP8 KV entries with ``rope_dim`` bf16 RoPE channels."""
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > _DS_MLA_MAX_ROPE:
        raise ValueError(f"a ds_mla KV record keeps an even number of RoPE channels in [2, {_DS_MLA_MAX_ROPE}], "
                         f"got {rope_dim}")
    return f"{DS_MLA_PREFIX}{rope_dim}"


def ds_mla_rope(fmt: str) -> int | None:
    """The RoPE width R of a ``ds_mla_r{R}`` format, None for any other format name."""
    if not isinstance(fmt, str) or not fmt.startswith(DS_MLA_PREFIX) or not fmt[len(DS_MLA_PREFIX):].isdigit():
        return None
    rope = int(fmt[len(DS_MLA_PREFIX):])
    valid = 0 < rope <= _DS_MLA_MAX_ROPE and rope % 2 == 0 and fmt == f"{DS_MLA_PREFIX}{rope}"
    return rope if valid else None


def record_block(fmt: str) -> int:
    """Channels per scale of a record format."""
    if ds_mla_rope(fmt) is not None:
        return DS_MLA_BLOCK
    if fmt not in _RECORD_LAYOUT:
        raise ValueError(f"KV record format {fmt!r} is not one of {', '.join(RECORD_FORMATS)}, "
                         f"{DS_MLA_PREFIX}<R>")
    return _RECORD_LAYOUT[fmt][1]


def record_value_bytes(fmt: str, dim: int) -> int:
    """Bytes of a record's values (the scales follow them)."""
    rope = ds_mla_rope(fmt)
    if rope is not None:
        return dim - rope + 2 * rope
    record_block(fmt)
    return dim * _RECORD_LAYOUT[fmt][0] // 8


def record_bytes(fmt: str, dim: int) -> int:
    """Bytes of one record of ``dim`` channels: 528 (MXFP8) / 288 (NVFP4) at 512 channels,
    68 (MXFP4) at 128, 584 (``ds_mla_r64``) at 512. ``dim`` must be a multiple of the format's
    scale block (ds_mla: more channels than RoPE channels)."""
    block = record_block(fmt)
    rope = ds_mla_rope(fmt)
    if rope is not None:
        if dim <= rope:
            raise ValueError(f"a {fmt} KV record needs more than {rope} channels (its RoPE part), got {dim}")
        raw = record_value_bytes(fmt, dim) + -(-(dim - rope) // block)
        return -(-raw // DS_MLA_ALIGN) * DS_MLA_ALIGN
    if dim <= 0 or dim % block:
        raise ValueError(f"a {fmt} KV record needs a positive multiple of {block} channels, got {dim}")
    return record_value_bytes(fmt, dim) + dim // block


@dataclass(frozen=True)
class KVCacheSpec:
    kind: CacheKind
    num_kv_heads: int
    head_size: int                  # channels of one row (the logical size, packed or not)
    dtype: torch.dtype
    # Tensors stored per entry: 2 for separate K and V, 1 for a shared K=V
    # vector or an MLA latent.
    num_tensors: int = 2
    # Sliding layers keep only the last ``sliding_window`` tokens live.
    sliding_window: int | None = None
    # Compressed layers store one entry per ``compress_ratio`` tokens.
    compress_ratio: int = 1
    # Packed records: the format of every row (``dtype`` must then be torch.uint8): one of
    # RECORD_FORMATS or a ``ds_mla_format(R)``.
    record: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "sliding" and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("a 'sliding' KV cache spec needs sliding_window > 0")
        if self.kind == "compressed" and self.compress_ratio < 2:
            raise ValueError("a 'compressed' KV cache spec needs compress_ratio >= 2")
        if self.record is not None:
            if self.dtype != torch.uint8:
                raise ValueError(f"a KV cache spec of {self.record} records needs dtype torch.uint8, "
                                 f"got {self.dtype}")
            record_bytes(self.record, self.head_size)

    @property
    def group_key(self) -> tuple:
        return (self.kind, self.sliding_window, self.compress_ratio)

    @property
    def row_size(self) -> int:
        """The cache tensor's last dim: ``head_size`` values, or the bytes of one record."""
        return self.head_size if self.record is None else record_bytes(self.record, self.head_size)

    @property
    def entry_numel(self) -> int:
        """Elements of one cache entry (one token, or one compressed entry)."""
        return self.num_tensors * self.num_kv_heads * self.row_size

    @property
    def entry_bytes(self) -> int:
        return self.entry_numel * torch.empty((), dtype=self.dtype).element_size()
