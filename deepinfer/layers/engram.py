"""DeepSeek-V4.1 Engram: an n-gram hash-table lookup gated into the mHC residual streams.

At each Engram layer (release: layers 1 and 14) the streams are updated before anything else
in the layer:

1. the 2- .. N-grams ending at a token, over *compressed* token ids (:func:`build_token_map`),
   are hashed into ``H`` prime-sized buckets each (:func:`engram_hash_ids`), giving C row ids;
2. those C rows of the table are read and concatenated, and ``wkv`` projects them to one key
   per stream plus one value shared by all streams;
3. each stream gets ``gate * value`` added, the gate a sigmoid of the signed square root of a
   normalised stream-key dot product (:func:`deepinfer.kernels.reference.engram_gate`).

Hash ids are a pure function of the token ids at positions p-N+1 .. p of a request, so chunked
prefill, prefix caching and speculative rollback need nothing but the request's token history
(the caller builds the [T, N] lookback windows). The static constants live in
:class:`EngramLayout`. Numerics follow DeepSeek's reference ``inference/engram.py`` and
``inference/model.py`` (see research/engram_v41.md).

Shapes: T tokens, n streams (hc_mult), D hidden size, N max n-gram size (orders 2..N, so a
lookback of N-1 tokens), H hash heads per order, C = (N-1)*H hash columns (order-major:
column ``(order-2)*H + head``), E table row width (head_dim), R table rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, normalizers
from torch import nn

from deepinfer.kernels import reference

# Decides every n < 3.3e24 (so every int64) when used as Miller-Rabin witnesses.
_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test (exact for every n below 3.3e24)."""
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _normalizer() -> normalizers.Normalizer:
    """The tokenizers normaliser that decides which tokens collapse to one compressed id."""
    # A token that is exactly whitespace would strip to "" and merge with other empty keys;
    # a private-use sentinel carries the single space through Strip().
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])


def build_token_map(tokenizer_json: str | Path) -> np.ndarray:
    """Compressed id of every token id: int32 [len(tokenizer)].

    Tokens whose decoded text normalises alike (case, accents, surrounding whitespace) share an
    id, handed out in first-seen order over increasing token id. A token that decodes to a
    partial UTF-8 sequence (contains U+FFFD) is keyed by its raw vocabulary string instead.
    The hash multipliers derive from the number of distinct ids, so the caller should check it
    against ``engram_compressed_vocab_size``.
    """
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    normalizer = _normalizer()
    compressed: dict[str, int] = {}   # normalised key -> compressed id
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    token_map = np.empty(size, dtype=np.int32)
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map[token_id] = compressed.setdefault(key, len(compressed))
    return token_map


@dataclass(frozen=True, eq=False)   # eq=False: array fields have no truthful ==
class EngramLayout:
    """Static hashing constants for all engram layers of a model (§3.2).

    Row i of each array belongs to ``layer_ids[i]`` (the layer's "hash index" is i).
    """

    layer_ids: tuple[int, ...]
    max_ngram: int            # engram_max_ngram_size (orders 2..max_ngram)
    n_heads: int              # engram_n_heads
    primes: np.ndarray        # int64 [n_layers, (max_ngram-1)*n_heads]
    offsets: np.ndarray       # int64 [n_layers, (max_ngram-1)*n_heads] exclusive cumsum per layer
    multipliers: np.ndarray   # int64 [n_layers, max_ngram]

    def __post_init__(self) -> None:
        if self.max_ngram < 2 or self.n_heads < 1:
            raise ValueError(f"engram_max_ngram_size={self.max_ngram} must be >= 2 and "
                             f"engram_n_heads={self.n_heads} >= 1")
        cols = (len(self.layer_ids), self.n_cols)
        for name, shape in (("primes", cols), ("offsets", cols),
                            ("multipliers", (len(self.layer_ids), self.max_ngram))):
            array = getattr(self, name)
            if array.shape != shape or array.dtype != np.int64:
                raise ValueError(f"EngramLayout.{name} must be int64 {shape}, "
                                 f"got {array.dtype} {array.shape}")

    @property
    def n_cols(self) -> int:
        """Hash columns (table rows read) per token and layer."""
        return (self.max_ngram - 1) * self.n_heads

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Table rows per layer: the sum of its bucket primes."""
        return tuple(int(n) for n in self.primes.sum(axis=1))

    @classmethod
    def from_config(cls, layer_ids: Sequence[int], vocab_base: int, n_heads: int, max_ngram: int,
                    compressed_vocab_size: int, num_embeddings: Sequence[int] | None = None) -> EngramLayout:
        """The layout of ``engram_layer_ids`` from the other ``engram_*`` config values.

        Primes: for each layer, then each order, ``n_heads`` times the smallest prime above the
        previous one (starting at ``vocab_base``) not handed out before, in any layer, so every
        bucket is distinct. Multipliers: odd, seeded by the raw layer id, and below
        ``INT64_MAX / compressed_vocab_size`` so that ``cid * multiplier`` cannot overflow.
        ``num_embeddings`` (``engram_num_embeddings``), if given, must equal each layer's prime sum.
        """
        layer_ids = tuple(int(i) for i in layer_ids)
        seen: set[int] = set()
        primes = []
        for _ in layer_ids:
            row = []
            for _ in range(max_ngram - 1):
                cur = vocab_base - 1
                for _ in range(n_heads):
                    cur += 1
                    while cur in seen or not _is_prime(cur):
                        cur += 1
                    seen.add(cur)
                    row.append(cur)
            primes.append(row)
        primes_arr = np.array(primes, dtype=np.int64).reshape(len(layer_ids), (max_ngram - 1) * n_heads)
        offsets = np.cumsum(primes_arr, axis=1) - primes_arr
        # numpy does not promise this generator stream across versions; the release values are
        # pinned by tests/models/test_engram.py.
        bound = (np.iinfo(np.int64).max // compressed_vocab_size) // 2
        multipliers = np.stack([
            np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
            for layer in layer_ids]).reshape(len(layer_ids), max_ngram)
        layout = cls(layer_ids, max_ngram, n_heads, primes_arr, offsets, multipliers)
        if num_embeddings is not None and tuple(int(n) for n in num_embeddings) != layout.num_embeddings:
            raise ValueError(f"engram_num_embeddings={list(num_embeddings)} does not match the bucket "
                             f"primes of engram_layer_ids={list(layer_ids)}, which sum to "
                             f"{list(layout.num_embeddings)} rows per layer")
        return layout


def engram_hash_ids(cids: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                    multipliers: torch.Tensor) -> torch.Tensor:
    """Table rows of the n-grams ending at each token, for one layer: int64 [T, C].

    cids: int64 [T, N], column s the compressed id of the token s places back (the pad's
    compressed id where that is before the request's start); primes, offsets: int64 [C] of the
    layer; multipliers: int64 [N]. The n-gram hash is the xor of ``cids[:, s] * multipliers[s]``
    for s < n; column ``(n-2)*H + h`` is that hash mod ``primes[...]`` plus ``offsets[...]``.
    Products stay below 2**63 (multiplier bound), so signed int64 arithmetic is exact.
    """
    if cids.dtype != torch.int64:
        raise TypeError(f"cids must be int64 (the products need 63 bits), got {cids.dtype}")
    t, n = cids.shape
    heads = primes.shape[0] // (n - 1)
    products = cids * multipliers                                               # [T, N]
    rolling = products[:, 0]
    grams = []
    for s in range(1, n):
        rolling = torch.bitwise_xor(rolling, products[:, s])
        grams.append(rolling)
    grams = torch.stack(grams, dim=1)[:, :, None].expand(t, n - 1, heads).reshape(t, -1)   # [T, C]
    return grams % primes + offsets


class EngramTable(nn.Module):
    """The hash table ``weight`` [R, E] in the compute dtype; the checkpoint's FP8 rows and
    per-32 scales are dequantised at load (``models/quant.py`` ``dequant_engram_table``)."""

    def __init__(self, num_embeddings: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, head_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Engram(nn.Module):
    """One layer's Engram: streams [T, n, D] and hash ids [T, C] -> new streams [T, n, D]."""

    def __init__(self, hidden_size: int, hc_mult: int, n_orders: int, n_heads: int, head_dim: int,
                 num_embeddings: int, eps: float) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.eps = eps
        self.embed = EngramTable(num_embeddings, head_dim)
        # Output rows: n keys (stream-major, D each), then the value (D).
        self.wkv = nn.Linear(n_orders * n_heads * head_dim, (hc_mult + 1) * hidden_size, bias=False)
        self.q_weight = nn.Parameter(torch.empty(hc_mult, hidden_size))
        self.k_weight = nn.Parameter(torch.empty(hc_mult, hidden_size))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """streams: [T, n, D] (read only, may be an expanded view); hash_ids: int64 [T, C]
        -> [T, n, D] in streams.dtype."""
        rows = self.embed(hash_ids).flatten(1)                                  # [T, C*E]
        kv = self.wkv(rows)                                                     # [T, (n+1)*D]
        # The two weights only ever act as their product.
        weight = self.q_weight.float() * self.k_weight.float()                  # [n, D]
        return reference.engram_gate(streams, kv, weight, self.eps)
