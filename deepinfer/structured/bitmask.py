"""The token bitmask: which tokens a grammar allows next, one bit per token.

Format (xgrammar's, shared by every backend): an int32 tensor ``[N, ceil(V / 32)]``;
bit ``j`` of word ``w`` in row ``i`` set means token ``32 * w + j`` is allowed for
row ``i``. Matchers fill rows of a CPU bitmask; the sampler applies it to the
logits on their device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU bitmask ``[rows, ceil(vocab_size / 32)]`` int32 that allows every token."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set ``logits[i, t]`` to -inf, in place, for every token ``t`` that ``bitmask[i]``
    disallows, for ``i`` in ``rows``; other rows are untouched.

    logits: [N, V] float32, contiguous; bitmask: [N, >= ceil(V / 32)] int32 on the
    logits' device. Runs xgrammar's kernel (native on the CPU, Triton on CUDA).
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0] \
            or bitmask.shape[1] < bitmask_width(logits.shape[1]):
        raise ValueError(f"token bitmask of shape {tuple(bitmask.shape)} and dtype {bitmask.dtype} for "
                         f"logits {tuple(logits.shape)}: expected int32 [{logits.shape[0]}, >= "
                         f"{bitmask_width(logits.shape[1])}]")
    if bitmask.device != logits.device:
        raise ValueError(f"token bitmask on {bitmask.device}, logits on {logits.device}")
    # Imported here: importing xgrammar takes seconds, and only engines that serve a
    # structured request (which imported it to compile the grammar) get this far.
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=list(rows))
