"""Physical floors: what a step must move and compute, and the device's measured rates.

A floor is a lower bound on a step's time: ``max(bytes / HBM bandwidth, FLOPs /
matmul rate)``, both rates measured in the same run (:func:`measure_hbm_bandwidth`,
:func:`measure_matmul_tflops`). The accounting is analytic, from the model's
shapes (:class:`DeepseekV4Cost`, :class:`DeepseekV41Cost`); tests check it against a built model's tensors.

Decode step (B sequences, each with s tokens of context after the step):

- weights touched: every attention, compressor, indexer, norm, hyper-connection,
  router and shared-expert tensor, the final norm and head mixing, ``lm_head``; B
  embedding rows (and B rows of each hash layer's token -> expert table); and the
  routed experts the batch actually selects, per layer (counted from the routing,
  or estimated as ``E * (1 - (1 - K/E)^B)`` for uniform routing);
- KV cache read per sequence and layer: the window's ``min(s, W)`` entries; CSA:
  every indexer key (``s // r``) and the ``min(topk, s // r)`` selected entries;
  HCA: its ``s // r`` entries;
- KV cache written per token: the window entry and the compressor (and indexer)
  state, plus the compressed entries amortised over their ``r`` tokens.

Window rows and compressed entries count ``D`` values of the cache dtype, or with
``kv_cache_dtype="fp8"`` one DeepSeek FP8 record each (kv_spec.py ``ds_mla_format``: 584 B at
D = 512); the indexer keys and compressor states stay in the cache dtype.

FLOPs: ``2 x`` matmul parameters used per token (lm_head once per sampled row),
plus attention: ``4 x H x D`` per visible key (QK and PV), and the CSA indexer's
``2 x Hi x Di`` per scored entry. Element-wise work (norms, softmax, pooling,
Sinkhorn) is left out, so the floors stay lower bounds.

DeepSeek-V4.1 (:class:`DeepseekV41Cost`) counts the same way, by layer role
(models/deepseek_v41.py ``layer_roles``), with the KV cache in the release's packed
records (what any engine serving the release's formats must move; ours stores them so on
CUDA with ``kv_cache_dtype="auto"``, kv_spec.py ``record_bytes``):

- per layer, the window's ``min(s, W)`` rows of ``D + D/32`` B (MXFP8: 528 B);
- a compressed layer (ratio r) attends to ``min(topk, s // r)`` selected entries of
  ``D/2 + D/16`` B (NVFP4: 288 B) of its KV source's stream;
- an index source (KV source that indexes, reindex layer) scores every visible key of its
  key owner, ``s // r`` keys of ``Di/2 + Di/32`` B (MXFP4: 68 B); reuse layers take a
  selection and read no keys. A reindex layer could skip the keys outside its candidate
  blocks (at most ``candidate_topk_blocks x candidate_block_size``), but our indexer,
  like mlx-lm's, scores them all and masks, so they are counted; this only matters
  beyond that many entries (16,384 tokens at ratio 1 for the release);
- written per token: each layer's window row; a ratio-2 source's compressor state (kv and
  gate rows, compute dtype) and half an entry and key; a ratio-1 source's entry and key.

Each layer reads its own copy of what it uses (a reuse layer reads the entries its
selection names again), as the kernels run one layer at a time. FLOPs as for V4: ``4 x H
x D`` per attended key (window rows and selected entries), ``2 x Hi x Di`` per scored key.
Weights: as for V4, without the head mixing, plus each engram layer's ``wkv`` (read whole)
and the table rows each token's n-gram hashes select. They count at the compute dtype's
size (the engine dequantises the release's FP8/FP4 weights on load).

Shapes: Hd hidden, V vocab, H heads, D head dim, E routed experts, K per token,
I expert width, W window, r compress ratio, Hi/Di indexer heads/dim, n hc streams.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.kv_spec import ds_mla_format, record_bytes
from deepinfer.layers.deepseek_v4_attention import CSA, HCA
from deepinfer.models.deepseek_v4 import DeepseekV4Args
from deepinfer.models.deepseek_v41 import DeepseekV41Args

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class Tensor:
    """One parameter (or buffer) of the model, for the accounting."""

    layer: int | None      # decoder layer index; None for embeddings, lm_head, final norm/mixing
    part: str              # "attention" | "norm" | "hc" | "router" | "tid2eid" | "shared_expert"
                           # | "routed_experts" | "embed" | "lm_head" | "engram" | "engram_table"
    name: str
    numel: int
    elem_bytes: float      # FP8 and FP4 weights count their scales' share
    matmul: bool           # multiplies every token's activations (counts toward FLOPs)

    @property
    def nbytes(self) -> float:
        return self.numel * self.elem_bytes


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts that ``tokens`` tokens choosing ``top_k`` of ``num_experts`` uniformly touch."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


class DeepseekCost:
    """What DeepSeek-V4 and V4.1 account alike: the totals over the parameter table, a
    decode step's and a prefill's bytes and FLOPs. Subclasses give the table
    (:meth:`_tensors`), the attention and KV-cache terms, and the table rows each token
    reads (:meth:`token_row_bytes`)."""

    # Set by the subclasses before ``_tensors()`` runs.
    num_layers: int
    hidden_size: int
    vocab_size: int
    n_experts: int
    top_k: int
    expert_width: int

    def __init__(self, weight_bytes: int, cache_bytes: int, tie_word_embeddings: bool) -> None:
        self.w = weight_bytes
        self.c = cache_bytes
        self.tied = tie_word_embeddings
        self.expert_elem_bytes: float = weight_bytes
        self.tensors = self._tensors()

    def with_weight_formats(self, fp8_names: tuple[str, ...], fp8_elem_bytes: float | None,
                            expert_elem_bytes: float | None) -> None:
        """Count the weights as stored quantised (models/quantize.py): the tensors named in
        ``fp8_names`` and the shared experts at ``fp8_elem_bytes`` a weight, the routed experts at
        ``expert_elem_bytes`` (None: unchanged)."""
        def elem(t: Tensor) -> float:
            if fp8_elem_bytes is not None and (t.name in fp8_names or t.part == "shared_expert"):
                return fp8_elem_bytes
            if expert_elem_bytes is not None and t.part == "routed_experts":
                return expert_elem_bytes
            return t.elem_bytes
        self.tensors = [dataclasses.replace(t, elem_bytes=elem(t)) for t in self.tensors]
        if expert_elem_bytes is not None:
            self.expert_elem_bytes = expert_elem_bytes

    # -- what the subclasses give -------------------------------------------------------
    def _tensors(self) -> list[Tensor]:
        raise NotImplementedError

    def layer_kinds(self) -> list[str]:
        """One word per main layer, for the report."""
        raise NotImplementedError

    def attention_flops(self, s: int) -> int:
        """FLOPs of one query with ``s`` tokens of context (itself included), over all layers."""
        raise NotImplementedError

    def kv_read_bytes(self, s: int) -> int:
        """KV-cache bytes one decode query with ``s`` tokens of context reads, over all layers."""
        raise NotImplementedError

    def kv_write_bytes(self) -> float:
        """KV-cache bytes one token writes, over all layers."""
        raise NotImplementedError

    def token_row_bytes(self) -> int:
        """Bytes of the lookup tables (embedding, hash-routing, engram) one token reads."""
        raise NotImplementedError

    # -- totals -----------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """Elements of every parameter and persistent buffer (tid2eid included)."""
        return sum(t.numel for t in self.tensors)

    @property
    def param_bytes(self) -> int:
        return int(sum(t.nbytes for t in self.tensors))

    @property
    def expert_bytes(self) -> int:
        """One routed expert's three matrices."""
        return 3 * self.hidden_size * self.expert_width * self.expert_elem_bytes

    @property
    def _lm_head_numel(self) -> int:
        return self.vocab_size * self.hidden_size

    def dense_bytes(self) -> int:
        """Bytes every step reads whole: all but the lookup tables (embedding, tid2eid, engram)
        and the routed experts."""
        skip = ("embed", "routed_experts", "tid2eid", "engram_table")
        total = sum(t.nbytes for t in self.tensors if t.part not in skip)
        return total + (self._lm_head_numel * self.w if self.tied else 0)

    def matmul_params_per_token(self) -> int:
        """Parameters one token multiplies through, lm_head excluded: dense matmuls + K routed experts."""
        dense = sum(t.numel for t in self.tensors if t.matmul)
        return dense + self.num_layers * self.top_k * 3 * self.hidden_size * self.expert_width

    # -- steps ------------------------------------------------------------------------
    def decode_weight_bytes(self, batch: int, distinct_experts: list[float]) -> float:
        """Weight bytes one decode step of ``batch`` sequences reads, given the distinct routed
        experts each layer touches."""
        if len(distinct_experts) != self.num_layers:
            raise ValueError(f"distinct_experts has {len(distinct_experts)} entries; the model has "
                             f"{self.num_layers} layers")
        return self.dense_bytes() + batch * self.token_row_bytes() + sum(distinct_experts) * self.expert_bytes

    def estimated_distinct_experts(self, tokens: int) -> list[float]:
        return [expected_distinct_experts(self.n_experts, self.top_k, tokens)] * self.num_layers

    def decode_step(self, batch: int, context: int, distinct_experts: list[float] | None = None) -> dict:
        """Bytes and FLOPs of one decode step; every sequence has ``context`` tokens after it."""
        distinct = distinct_experts or self.estimated_distinct_experts(batch)
        weights = self.decode_weight_bytes(batch, distinct)
        kv = batch * (self.kv_read_bytes(context) + self.kv_write_bytes())
        flops = batch * (2 * (self.matmul_params_per_token() + self._lm_head_numel)
                         + self.attention_flops(context))
        return {"weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv, "flops": flops,
                "distinct_experts": list(distinct)}

    def prefill(self, batch: int, prompt_len: int) -> dict:
        """Bytes and FLOPs of prefilling ``batch`` prompts of ``prompt_len`` tokens (logits for the
        last token of each only)."""
        tokens = batch * prompt_len
        attention = sum(self.attention_flops(s) for s in range(1, prompt_len + 1))
        flops = batch * (2 * self.matmul_params_per_token() * prompt_len + 2 * self._lm_head_numel
                         + attention)
        distinct = self.estimated_distinct_experts(tokens)
        weights = self.decode_weight_bytes(tokens, distinct)
        kv = tokens * self.kv_write_bytes()
        # The routed experts' share, bounded on its own by parts_floor_ms.
        expert_flops = 2 * tokens * self.num_layers * self.top_k * 3 * self.hidden_size * self.expert_width
        return {"weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv, "flops": flops,
                "distinct_experts": distinct, "expert_bytes": sum(distinct) * self.expert_bytes,
                "expert_flops": expert_flops}


def _hc_tensors(layer: int | None, n: int, hd: int) -> list[Tensor]:
    """A layer's two hyper-connections (attention, FFN): mixers read every token (float32)."""
    mix = (2 + n) * n
    out = []
    for hc in ("attn_hc", "ffn_hc"):
        out += [Tensor(layer, "hc", f"{hc}.fn", mix * n * hd, FP32, True),
                Tensor(layer, "hc", f"{hc}.base", mix, FP32, False),
                Tensor(layer, "hc", f"{hc}.scale", 3, FP32, False)]
    return out


def _moe_tensors(layer: int, hd: int, experts: int, width: int, w: int) -> list[Tensor]:
    """A layer's norms, router (float32), routed and shared experts (the router's hash table
    or score-correction bias is the caller's)."""
    expert = 3 * hd * width
    return [Tensor(layer, "norm", "input_layernorm", hd, FP32, False),
            Tensor(layer, "norm", "post_attention_layernorm", hd, FP32, False),
            Tensor(layer, "router", "gate.weight", experts * hd, FP32, True),
            Tensor(layer, "routed_experts", "experts", experts * expert, w, False),
            Tensor(layer, "shared_expert", "shared_experts", expert, w, True)]


class DeepseekV4Cost(DeepseekCost):
    """Bytes and FLOPs of DeepSeek-V4's main layers (MTP layers are not run by the engine)."""

    def __init__(self, args: DeepseekV4Args, weight_bytes: int, cache_bytes: int,
                 tie_word_embeddings: bool = False, kv_cache_dtype: str = "auto") -> None:
        self.args = args
        # Bytes of one window row / compressed entry per layer: an FP8 record, or D values.
        self.kv_row_bytes = [record_bytes(ds_mla_format(args.rope_dim(i)), args.head_dim)
                             if kv_cache_dtype == "fp8" else args.head_dim * cache_bytes
                             for i in range(args.num_layers)]
        self.num_layers, self.hidden_size, self.vocab_size = args.num_layers, args.hidden_size, args.vocab_size
        self.n_experts, self.top_k, self.expert_width = args.n_routed_experts, args.top_k, args.moe_intermediate_size
        super().__init__(weight_bytes, cache_bytes, tie_word_embeddings)

    # -- the parameter table ----------------------------------------------------------
    def _layer_tensors(self, i: int) -> list[Tensor]:
        a, w = self.args, self.w
        hd, d, nh = a.hidden_size, a.head_dim, a.num_heads
        kind = a.layer_types[i]
        out = [
            Tensor(i, "attention", "q_a_proj", hd * a.q_lora_rank, w, True),
            Tensor(i, "norm", "q_a_norm", a.q_lora_rank, FP32, False),
            Tensor(i, "attention", "q_b_proj", a.q_lora_rank * nh * d, w, True),
            Tensor(i, "attention", "kv_proj", hd * d, w, True),
            Tensor(i, "norm", "kv_norm", d, FP32, False),
            Tensor(i, "attention", "o_a_proj", nh * d * a.o_lora_rank, w, True),
            Tensor(i, "attention", "o_b_proj", a.o_groups * a.o_lora_rank * hd, w, True),
            Tensor(i, "attention", "sinks", nh, FP32, False),
        ]
        if kind in (CSA, HCA):
            r = a.compress_rates[kind]
            width = 2 * d if kind == CSA else d
            out += [
                Tensor(i, "attention", "compressor.kv_proj", hd * width, w, True),
                Tensor(i, "attention", "compressor.gate_proj", hd * width, w, True),
                Tensor(i, "attention", "compressor.position_bias", r * width, FP32, False),
                Tensor(i, "norm", "compressor.kv_norm", d, FP32, False),
            ]
            if kind == CSA:
                di, hi = a.index_head_dim, a.index_n_heads
                out += [
                    Tensor(i, "attention", "indexer.kv_proj", hd * 2 * di, w, True),
                    Tensor(i, "attention", "indexer.gate_proj", hd * 2 * di, w, True),
                    Tensor(i, "attention", "indexer.position_bias", r * 2 * di, FP32, False),
                    Tensor(i, "norm", "indexer.kv_norm", di, FP32, False),
                    Tensor(i, "attention", "indexer.q_b_proj", a.q_lora_rank * hi * di, w, True),
                    Tensor(i, "attention", "indexer.weights_proj", hd * hi, w, True),
                ]
        out += _hc_tensors(i, a.hc_mult, hd)
        out += _moe_tensors(i, hd, a.n_routed_experts, a.moe_intermediate_size, w)
        if a.mlp_layer_types[i] == "hash_moe":
            out.append(Tensor(i, "tid2eid", "gate.tid2eid", a.vocab_size * a.top_k, INT64, False))
        else:
            out.append(Tensor(i, "router", "gate.e_score_correction_bias", a.n_routed_experts, FP32, False))
        return out

    def _tensors(self) -> list[Tensor]:
        a = self.args
        hd, n = a.hidden_size, a.hc_mult
        out = [Tensor(None, "embed", "embed_tokens", a.vocab_size * hd, self.w, False)]
        for i in range(a.num_layers):
            out += self._layer_tensors(i)
        out += [Tensor(None, "norm", "norm", hd, FP32, False),
                Tensor(None, "hc", "hc_head.hc_fn", n * n * hd, FP32, True),
                Tensor(None, "hc", "hc_head.hc_base", n, FP32, False),
                Tensor(None, "hc", "hc_head.hc_scale", 1, FP32, False)]
        if not self.tied:
            out.append(Tensor(None, "lm_head", "lm_head", a.vocab_size * hd, self.w, False))
        return out

    def layer_kinds(self) -> list[str]:
        return list(self.args.layer_types[: self.num_layers])

    def token_row_bytes(self) -> int:
        """An embedding row, and one row of each hash layer's token -> expert table (K int64 ids)."""
        a = self.args
        hash_layers = sum(t == "hash_moe" for t in a.mlp_layer_types[: a.num_layers])
        return a.hidden_size * self.w + hash_layers * a.top_k * INT64

    # -- attention and KV cache, per token ------------------------------------------------
    def attention_flops(self, s: int) -> int:
        a = self.args
        per_key = 4 * a.num_heads * a.head_dim
        total = 0
        for kind in a.layer_types[: a.num_layers]:
            keys = min(s, a.sliding_window)
            if kind in (CSA, HCA):
                entries = s // a.compress_rates[kind]
                if kind == CSA:
                    keys += min(a.index_topk, entries)
                    total += 2 * a.index_n_heads * a.index_head_dim * entries
                else:
                    keys += entries
            total += per_key * keys
        return total

    def kv_read_bytes(self, s: int) -> int:
        a = self.args
        total = 0
        for i, kind in enumerate(a.layer_types[: a.num_layers]):
            entries = min(s, a.sliding_window)
            if kind == CSA:
                n = s // a.compress_rates[kind]
                entries += min(a.index_topk, n)
                total += n * a.index_head_dim * self.c
            elif kind == HCA:
                entries += s // a.compress_rates[kind]
            total += entries * self.kv_row_bytes[i]
        return total

    def kv_write_bytes(self) -> float:
        """KV-cache bytes one token writes over all layers: window entry, compressor (and indexer)
        states (kv and gate), compressed entries amortised over their ``r`` tokens."""
        a = self.args
        d, di = a.head_dim, a.index_head_dim
        total = 0.0
        for i, kind in enumerate(a.layer_types[: a.num_layers]):
            row = self.kv_row_bytes[i]
            total += row
            if kind == CSA:
                r = a.compress_rates[kind]
                total += (2 * 2 * d + 2 * 2 * di + di / r) * self.c + row / r
            elif kind == HCA:
                total += 2 * d * self.c + row / a.compress_rates[kind]
        return total


class DeepseekV41Cost(DeepseekCost):
    """Bytes and FLOPs of DeepSeek-V4.1's main layers by role (the module docstring says what
    is counted). ``cache_bytes`` is the compute dtype's size, for what the release keeps
    unpacked (the ratio-2 compressor state, engram's token history); the window rows,
    entries and index keys count at the release's packed sizes whatever the dtype."""

    def __init__(self, args: DeepseekV41Args, weight_bytes: int, cache_bytes: int) -> None:
        # V4.1's output head is always its own matrix (no tying), as in mlx-lm and the release.
        self.args = args
        self.roles = args.roles
        self.num_layers, self.hidden_size, self.vocab_size = (args.num_hidden_layers, args.hidden_size,
                                                              args.vocab_size)
        self.n_experts, self.top_k, self.expert_width = (args.n_routed_experts, args.num_experts_per_tok,
                                                         args.moe_intermediate_size)
        # The release's packed records (deepseek_v41.md §4-6): MXFP8 window rows (528 B at
        # D = 512), NVFP4 entries (288 B), MXFP4 index keys (68 B at Di = 128).
        self.window_record = record_bytes("mxfp8", args.head_dim)
        self.entry_record = record_bytes("nvfp4", args.head_dim)
        self.key_record = record_bytes("mxfp4", args.index_head_dim)
        super().__init__(weight_bytes, cache_bytes, tie_word_embeddings=False)

    # -- the parameter table ----------------------------------------------------------
    def _layer_tensors(self, i: int) -> list[Tensor]:
        a, w, role = self.args, self.w, self.roles[i]
        hd, d, nh, ql = a.hidden_size, a.head_dim, a.num_attention_heads, a.q_lora_rank
        out = [
            Tensor(i, "attention", "q_a_proj", hd * ql, w, True),
            Tensor(i, "norm", "q_a_norm", ql, FP32, False),
            Tensor(i, "attention", "q_b_proj", ql * nh * d, w, True),
            Tensor(i, "attention", "kv_proj", hd * d, w, True),
            Tensor(i, "norm", "kv_norm", d, FP32, False),
            Tensor(i, "attention", "o_a_proj", nh * d * a.o_lora_rank, w, True),
            Tensor(i, "attention", "o_b_proj", a.o_groups * a.o_lora_rank * hd, w, True),
            Tensor(i, "attention", "sinks", nh, FP32, False),
        ]
        if role.kv_source:
            out += [Tensor(i, "attention", "compressor.kv_proj", hd * d, w, True),
                    Tensor(i, "norm", "compressor.kv_norm", d, FP32, False)]
            if role.ratio > 1:      # a ratio-1 source takes every token: no gate
                out.append(Tensor(i, "attention", "compressor.gate_proj", hd * d, w, True))
        if role.index_source:
            hi, di = a.index_n_heads, a.index_head_dim
            out += [Tensor(i, "attention", "indexer.q_b_proj", ql * hi * di, w, True),
                    Tensor(i, "attention", "indexer.weights_proj", hd * hi, w, True)]
            if role.key_owner:
                out += [Tensor(i, "attention", "indexer.k_proj", d * di, w, True),
                        Tensor(i, "norm", "indexer.k_norm", di, FP32, False)]
        out += _hc_tensors(i, a.hc_mult, hd)
        out += _moe_tensors(i, hd, a.n_routed_experts, a.moe_intermediate_size, w)
        out.append(Tensor(i, "router", "gate.e_score_correction_bias", a.n_routed_experts, FP32, False))
        if i in a.engram_layer_ids:
            k = a.engram_layer_ids.index(i)
            rows = a.engram_layout.num_embeddings[k]
            cols = a.engram_layout.n_cols * a.engram_head_dim
            out += [Tensor(i, "engram_table", "engram.embed", rows * a.engram_head_dim, w, False),
                    Tensor(i, "engram", "engram.wkv", cols * (a.hc_mult + 1) * hd, w, True),
                    # q and k only act as their product, element-wise: no matmul.
                    Tensor(i, "engram", "engram.q_weight", a.hc_mult * hd, w, False),
                    Tensor(i, "engram", "engram.k_weight", a.hc_mult * hd, w, False)]
        return out

    def _tensors(self) -> list[Tensor]:
        a = self.args
        out = [Tensor(None, "embed", "embed_tokens", a.vocab_size * a.hidden_size, self.w, False)]
        for i in range(self.num_layers):
            out += self._layer_tensors(i)
        # No hc_head: the streams collapse with the last FFN's pre.
        return out + [Tensor(None, "norm", "norm", a.hidden_size, FP32, False),
                      Tensor(None, "lm_head", "lm_head", a.vocab_size * a.hidden_size, self.w, False)]

    def layer_kinds(self) -> list[str]:
        return [r.kind for r in self.roles]

    def token_row_bytes(self) -> int:
        """An embedding row, and each engram layer's hash-selected table rows."""
        a = self.args
        rows = a.engram_layout.n_cols * len(a.engram_layer_ids) if a.engram_layer_ids else 0
        return a.hidden_size * self.w + rows * a.engram_head_dim * self.w

    # -- attention and KV cache, per token ------------------------------------------------
    def attention_flops(self, s: int) -> int:
        """Per layer ``4 H D`` per attended key (window rows and selected entries), and an index
        source's ``2 Hi Di`` per scored key."""
        a = self.args
        per_key = 4 * a.num_attention_heads * a.head_dim
        total = 0
        for role in self.roles:
            keys = min(s, a.sliding_window)
            if role.ratio:
                visible = s // role.ratio
                keys += min(a.index_topk, visible)
                if role.index_source:
                    total += 2 * a.index_n_heads * a.index_head_dim * visible
            total += per_key * keys
        return total

    def kv_read_bytes(self, s: int) -> int:
        """Per layer: its window rows, its selected entries, and (index sources) every visible
        key of its key owner, in the release's records; engram's token history."""
        a = self.args
        total = 0
        for role in self.roles:
            total += min(s, a.sliding_window) * self.window_record
            if role.ratio:
                visible = s // role.ratio
                total += min(a.index_topk, visible) * self.entry_record
                if role.index_source:
                    total += visible * self.key_record
        if a.engram_layer_ids:      # the n-gram's compressed ids, 3 values a token
            total += min(s, a.engram_max_ngram_size) * 3 * self.c
        return total

    def kv_write_bytes(self) -> float:
        """Per token: every layer's window row; a KV source's entry (and a key owner's key)
        amortised over its ``r`` tokens, and at ratio 2 the compressor state (kv and gate);
        engram's token history."""
        a = self.args
        total = 0.0
        for role in self.roles:
            total += self.window_record
            if role.kv_source:
                total += (self.entry_record + (self.key_record if role.key_owner else 0)) / role.ratio
                if role.ratio > 1:
                    total += 2 * a.head_dim * self.c
        if a.engram_layer_ids:
            total += 3 * self.c
        return total


def floor_ms(work: dict, hbm_gb_s: float, matmul_tflop_s: float) -> dict:
    """Both time bounds of ``work`` (``bytes``, ``flops``) and the floor, their maximum, in ms."""
    bytes_ms = work["bytes"] / (hbm_gb_s * 1e9) * 1e3
    flops_ms = work["flops"] / (matmul_tflop_s * 1e12) * 1e3
    return {"bytes_ms": bytes_ms, "flops_ms": flops_ms, "floor_ms": max(bytes_ms, flops_ms),
            "bound": "memory" if bytes_ms >= flops_ms else "compute"}


def parts_floor_ms(work: dict, hbm_gb_s: float, matmul_tflop_s: float) -> dict:
    """A tighter floor for ``work`` that carries ``expert_bytes`` / ``expert_flops``: the routed
    experts and the rest each at their own bound, summed. A prefill's experts read every
    expert's weights for a few dozen rows each (memory bound) while its dense GEMMs and
    attention are compute bound; :func:`floor_ms` bounds the whole by its larger total, which
    lets each part borrow the other's unused resource."""
    bw, rate = hbm_gb_s * 1e9, matmul_tflop_s * 1e12
    eb, ef = work["expert_bytes"], work["expert_flops"]
    experts = {"bytes_ms": eb / bw * 1e3, "flops_ms": ef / rate * 1e3}
    rest = {"bytes_ms": (work["bytes"] - eb) / bw * 1e3, "flops_ms": (work["flops"] - ef) / rate * 1e3}
    for part in (experts, rest):
        part["floor_ms"] = max(part["bytes_ms"], part["flops_ms"])
        part["bound"] = "memory" if part["bytes_ms"] >= part["flops_ms"] else "compute"
    return {"experts": experts, "rest": rest, "floor_ms": experts["floor_ms"] + rest["floor_ms"]}


# -- measured rates ------------------------------------------------------------------------
def _time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median wall time of ``fn`` in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_hbm_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy of ``nbytes``, in GB/s counting the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def measure_matmul_tflops(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.bfloat16,
                          iters: int = 10) -> float:
    """Dense ``n x n x n`` matmul rate in TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = _time_ms(lambda: torch.mm(a, b), device, iters)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12
