"""N-gram drafts (vLLM's ``method="ngram"``, prompt lookup): no model, the drafts are the
tokens that followed an earlier occurrence of the context's last n tokens.

For n from ``max_n`` down to ``min_n``, the latest earlier occurrence of the last n tokens
wins (the longest match first, then the most recent: recent text predicts the next tokens
best); the drafts are the up to ``k`` tokens that followed it. No match: no drafts. The
search is a numpy comparison of every window against the suffix, O(L * n) per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``token_ids`` (see the module docstring)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting before the suffix itself, so at least one token follows each.
        windows = sliding_window_view(tokens[:length - 1], n)                  # [L - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
