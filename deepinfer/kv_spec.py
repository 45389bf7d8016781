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
``kernels/kv_records.py`` and ``kernels/reference.py`` ``pack_record``).
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


def record_block(fmt: str) -> int:
    """Channels per scale of a record format."""
    if fmt not in _RECORD_LAYOUT:
        raise ValueError(f"KV record format {fmt!r} is not one of {', '.join(RECORD_FORMATS)}")
    return _RECORD_LAYOUT[fmt][1]


def record_value_bytes(fmt: str, dim: int) -> int:
    """Bytes of a record's values (the scales follow them)."""
    record_block(fmt)
    return dim * _RECORD_LAYOUT[fmt][0] // 8


def record_bytes(fmt: str, dim: int) -> int:
    """Bytes of one record of ``dim`` channels: 528 (MXFP8) / 288 (NVFP4) at 512 channels,
    68 (MXFP4) at 128. ``dim`` must be a multiple of the format's scale block."""
    block = record_block(fmt)
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
    # Packed records: the format of every row (``dtype`` must then be torch.uint8).
    record: RecordFormat | None = None

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
