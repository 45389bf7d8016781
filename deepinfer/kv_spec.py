"""What one attention layer needs from the KV cache.

Models declare a :class:`KVCacheSpec` per attention layer; the engine groups
layers with equal :attr:`KVCacheSpec.group_key` into KV-cache groups that share
one block table per sequence (DESIGN.md, Contracts: KV-cache layer groups).
The scheduler only sees the group-level facts (kind, window, ratio); the runner
uses the per-layer sizes to lay out device memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

CacheKind = Literal["full", "sliding", "compressed"]


@dataclass(frozen=True)
class KVCacheSpec:
    kind: CacheKind
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    # Tensors stored per entry: 2 for separate K and V, 1 for a shared K=V
    # vector or an MLA latent.
    num_tensors: int = 2
    # Sliding layers keep only the last ``sliding_window`` tokens live.
    sliding_window: int | None = None
    # Compressed layers store one entry per ``compress_ratio`` tokens.
    compress_ratio: int = 1

    def __post_init__(self) -> None:
        if self.kind == "sliding" and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("a 'sliding' KV cache spec needs sliding_window > 0")
        if self.kind == "compressed" and self.compress_ratio < 2:
            raise ValueError("a 'compressed' KV cache spec needs compress_ratio >= 2")

    @property
    def group_key(self) -> tuple:
        return (self.kind, self.sliding_window, self.compress_ratio)

    @property
    def entry_numel(self) -> int:
        """Elements of one cache entry (one token, or one compressed entry)."""
        return self.num_tensors * self.num_kv_heads * self.head_size

    @property
    def entry_bytes(self) -> int:
        return self.entry_numel * torch.empty((), dtype=self.dtype).element_size()
