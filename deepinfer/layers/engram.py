"""DeepSeek-V4.1 Engram: an n-gram hash-table lookup gated into the mHC residual streams.

At each Engram layer (release: layers 1 and 14) the streams are updated before anything else
in the layer:

1. the 2- .. N-grams ending at a token, over *compressed* token ids (:func:`build_token_map`),
   are hashed into ``H`` prime-sized buckets each (:func:`engram_hash_ids`), giving C row ids;
2. those C rows of the table are read and concatenated, and ``wkv`` projects them to one key
   per stream plus one value shared by all streams;
3. each stream gets ``gate * value`` added, the gate a sigmoid of the signed square root of a
   normalised stream-key dot product (:func:`deepinfer.kernels.reference.engram_gate`).

Tables (:class:`EngramTable`): small ones are dequantised onto the device; large ones (the
release's ~98 GB each) stay in host memory in their FP8 form, and a step gathers only the rows
it reads (:func:`table_in_host_memory`, :class:`EngramRows`).

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

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, normalizers
from torch import nn

from deepinfer import env
from deepinfer.host_memory import HostPin
from deepinfer.kernels import backend
from deepinfer.layers import side_stream

logger = logging.getLogger(__name__)

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


# Table placement (:func:`table_in_host_memory`): a table whose checkpoint form (FP8 codes
# and scales) takes at least this many bytes stays in host memory, the rows a step reads
# gathered and dequantised on the device; smaller ones are dequantised onto the device whole.
# The release's two tables (98.3 GB of codes + 3.1 GB of scales each) are far above it; the
# tiny test and default models' (tens of KB) far below. DEEPINFER_ENGRAM_TABLES forces either.
HOST_TABLE_MIN_BYTES = 1 << 30
# Values of a table row that share one scale (the release's E8M0 scale per 32).
SCALE_GROUP = 32


def table_bytes(num_embeddings: int, head_dim: int) -> int:
    """Bytes of a table in its checkpoint form: one E4M3 byte a value, one E8M0 byte a group."""
    return num_embeddings * head_dim * (SCALE_GROUP + 1) // SCALE_GROUP


def table_in_host_memory(num_embeddings: int, head_dim: int) -> bool:
    """Where a table of ``num_embeddings`` rows of ``head_dim`` lives: in host memory (True) or
    dequantised on the model's device. DEEPINFER_ENGRAM_TABLES=host/device decides; ``auto``
    (the default) puts tables of at least :data:`HOST_TABLE_MIN_BYTES` on the host."""
    placement = env.engram_table_placement()
    if placement == "auto":
        return table_bytes(num_embeddings, head_dim) >= HOST_TABLE_MIN_BYTES
    return placement == "host"


class EngramTable(nn.Module):
    """One engram layer's hash table, in one of two places (:func:`table_in_host_memory`):

    - on the device: ``weight`` [R, E] in the compute dtype, the checkpoint's FP8 rows and
      per-32 scales dequantised at load (``models/quant.py`` ``dequant_engram_table``);
    - in host memory: the checkpoint's FP8 form as stored, ``codes`` [R, E] E4M3 and
      ``scales`` [R, E/32] E8M0, set by :meth:`set_fp8` (the loader maps them read-only from
      the checkpoint file, ``CausalLM.keeps_quantized``), pinned in place on CUDA
      (``host_memory.HostPin``). A lookup gathers its rows onto the ids' device and
      dequantises them there (``backend.engram_gather``: a Triton kernel reading the pinned
      table through its device-mapped address, so only those rows cross PCIe and the ids never
      leave the device). Not a parameter or buffer: ``Module.to`` and the state dict leave it be.

    Rows come out equal in both places: the E4M3 value times its power-of-two scale is exact in
    float32 and rounds once to the compute dtype.
    """

    def __init__(self, num_embeddings: int, head_dim: int, in_host_memory: bool = False) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.head_dim = head_dim
        self.in_host_memory = in_host_memory
        self.host: HostPin | None = None
        if not in_host_memory:
            self.weight = nn.Parameter(torch.empty(num_embeddings, head_dim))

    @property
    def codes(self) -> torch.Tensor | None:
        """A host-memory table's E4M3 codes [R, E] (None until loaded or on the device)."""
        return None if self.host is None else self.host.tensors[0]

    @property
    def scales(self) -> torch.Tensor | None:
        """A host-memory table's E8M0 scales [R, E/32] (None until loaded or on the device)."""
        return None if self.host is None else self.host.tensors[1]

    def set_fp8(self, codes: torch.Tensor, scales: torch.Tensor, device: torch.device,
                name: str = "engram.embed") -> None:
        """Keep a host-memory table: codes [R, E] ``float8_e4m3fn``, scales [R, E/32]
        ``float8_e8m0fnu`` (or raw uint8 exponent bytes), both on the CPU, as the checkpoint
        stores them; pinned for ``device``'s kernels when it is CUDA. ``name`` names the table
        in errors and the log line."""
        if not self.in_host_memory:
            raise RuntimeError(f"{name}: the table is on the device; set_fp8 keeps host-memory tables only")
        shape = (self.num_embeddings, self.head_dim)
        if codes.dtype != torch.float8_e4m3fn or tuple(codes.shape) != shape:
            raise ValueError(f"{name}: a host-memory engram table takes the checkpoint's FP8 form, float8_e4m3fn "
                             f"{shape}; got {codes.dtype} {tuple(codes.shape)} (DEEPINFER_ENGRAM_TABLES=device "
                             "dequantises any table onto the device instead)")
        groups = (self.num_embeddings, self.head_dim // SCALE_GROUP)
        if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8) or tuple(scales.shape) != groups:
            raise ValueError(f"{name}: its scales must be E8M0 (float8_e8m0fnu or uint8 exponent bytes) of shape "
                             f"{groups}, one per {SCALE_GROUP} values of a row; got {scales.dtype} "
                             f"{tuple(scales.shape)}")
        if codes.device.type != "cpu" or scales.device.type != "cpu":
            raise ValueError(f"{name}: a host-memory table must be given on the CPU, got {codes.device}")
        self.host = HostPin([codes, scales], device)
        logger.info("%s: %.3g GB FP8 table in host memory for %s (%s)", name, table_bytes(*shape) / 1e9,
                    device, ", ".join(sorted(set(self.host.how))))

    def fill_dummy_(self, generator: torch.Generator, device: torch.device) -> None:
        """Random weights (``models/dummy.py``) for a host-memory table, values ``N(0, 1/E)`` as
        dummy embeddings get: E4M3 codes of ``N(0, 8^2)`` times one scale ``2^round(log2(E^-0.5 / 8))``.
        A device table is a parameter, filled with the others."""
        if not self.in_host_memory:
            return
        codes = torch.empty(self.num_embeddings, self.head_dim, dtype=torch.float8_e4m3fn)
        flat = codes.view(-1)
        chunk = 1 << 26
        for i in range(0, flat.numel(), chunk):
            n = min(chunk, flat.numel() - i)
            flat[i:i + n] = (torch.randn(n, generator=generator) * 8.0).to(torch.float8_e4m3fn)
        exponent = round(math.log2(self.head_dim ** -0.5 / 8.0))
        scales = torch.full((self.num_embeddings, self.head_dim // SCALE_GROUP), 127 + exponent, dtype=torch.uint8)
        self.set_fp8(codes, scales.view(torch.float8_e8m0fnu), device)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [T, C] (on the model's device) -> rows [T, C*E] in ``dtype`` (the device table's
        own dtype when on the device)."""
        if not self.in_host_memory:
            return F.embedding(ids, self.weight).flatten(1)
        if self.host is None:
            raise RuntimeError("a host-memory engram table was never loaded (set_fp8): the checkpoint lacks it")
        return backend.engram_gather(self.codes, self.scales, ids, dtype).flatten(1)


class Engram(nn.Module):
    """One layer's Engram: streams [T, n, D] and the layer's table rows [T, C*E] (:meth:`lookup`
    of its hash ids) -> new streams [T, n, D]."""

    def __init__(self, hidden_size: int, hc_mult: int, n_orders: int, n_heads: int, head_dim: int,
                 num_embeddings: int, eps: float, table_in_host: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.eps = eps
        self.embed = EngramTable(num_embeddings, head_dim, table_in_host)
        # Output rows: n keys (stream-major, D each), then the value (D).
        self.wkv = nn.Linear(n_orders * n_heads * head_dim, (hc_mult + 1) * hidden_size, bias=False)
        self.q_weight = nn.Parameter(torch.empty(hc_mult, hidden_size))
        self.k_weight = nn.Parameter(torch.empty(hc_mult, hidden_size))

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """hash_ids: int64 [T, C] -> the table rows [T, C*E] in the projection's dtype."""
        return self.embed(hash_ids, self.wkv.weight.dtype)

    def forward(self, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """streams: [T, n, D] (read only, may be an expanded view); rows: [T, C*E] from
        :meth:`lookup` -> [T, n, D] in streams.dtype."""
        kv = self.wkv(rows)                                                     # [T, (n+1)*D]
        # The two weights only ever act as their product.
        weight = self.q_weight.float() * self.k_weight.float()                  # [n, D]
        return backend.engram_gate(streams, kv, weight, self.eps)


class EngramRows:
    """Every engram layer's table rows for one forward, looked up as soon as the hash ids
    exist: they depend on the tokens only.

    When a table is in host memory the lookups run on the ``"engram"`` side-stream lane
    (``side_stream``, for any token count: they wait on PCIe, not on the GPU's compute), forked
    at the top of the forward, so they overlap the layers before each engram layer; each
    engram layer joins only its own lookup (an event after it). With every table on the device
    they run inline (an on-device embedding takes microseconds). The hash ids, made on the
    main stream and read by the lane, are held until :meth:`finish` joins the lane; a row
    tensor, made on the lane, is handed to the main stream only after its join. ``finish``
    must run before the forward ends: a CUDA-graph capture must rejoin every stream it forked.
    """

    def __init__(self, engrams: dict[int, Engram], hash_ids: torch.Tensor) -> None:
        """engrams: the engram modules by layer index, in hash-index order; hash_ids:
        [T, n_engram_layers, C]."""
        overlap = any(e.embed.in_host_memory for e in engrams.values())
        self._side = side_stream.fork(hash_ids, max_tokens=None, lane="engram") if overlap else None
        # Read by the lane until finish(): held so the allocator cannot hand its block to the
        # main stream while a gather still reads it.
        self._hash_ids: torch.Tensor | None = hash_ids
        self._rows: dict[int, torch.Tensor] = {}
        self._ready: dict[int, torch.cuda.Event | None] = {}
        with side_stream.on(self._side):
            for k, (layer_idx, engram) in enumerate(engrams.items()):
                self._rows[layer_idx] = engram.lookup(hash_ids[:, k])
                self._ready[layer_idx] = side_stream.mark(self._side)

    def pop(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s rows [T, C*E], ready for the current stream."""
        side_stream.join(self._ready.pop(layer_idx))
        return self._rows.pop(layer_idx)

    def take(self, rows: torch.Tensor) -> None:
        """Keep only the token rows ``rows`` [T'] of the lookups not used yet (bounded replay)."""
        self.finish()
        self._rows = {i: r.index_select(0, rows) for i, r in self._rows.items()}
        self._ready = dict.fromkeys(self._rows)

    def finish(self) -> None:
        """Join the lane (no-op when inline or already joined)."""
        side_stream.join(self._side)
        self._side = None
        self._hash_ids = None
