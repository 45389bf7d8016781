"""Physical floors: what a step must move and compute, and the device's measured rates.

A floor is a lower bound on a step's time: ``max(bytes / HBM bandwidth, FLOPs /
matmul rate)``, both rates measured in the same run (:func:`measure_hbm_bandwidth`,
:func:`measure_matmul_tflops`). The accounting is analytic, from the model's
shapes (:class:`DeepseekV4Cost`); tests check it against a built model's tensors.

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

FLOPs: ``2 x`` matmul parameters used per token (lm_head once per sampled row),
plus attention: ``4 x H x D`` per visible key (QK and PV), and the CSA indexer's
``2 x Hi x Di`` per scored entry. Element-wise work (norms, softmax, pooling,
Sinkhorn) is left out, so the floors stay lower bounds.

Shapes: Hd hidden, V vocab, H heads, D head dim, E routed experts, K per token,
I expert width, W window, r compress ratio, Hi/Di indexer heads/dim, n hc streams.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.layers.deepseek_v4_attention import CSA, HCA
from deepinfer.models.deepseek_v4 import DeepseekV4Args

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class Tensor:
    """One parameter (or buffer) of the model, for the accounting."""

    layer: int | None      # decoder layer index; None for embeddings, lm_head, final norm/mixing
    part: str              # "attention" | "norm" | "hc" | "router" | "tid2eid" | "shared_expert"
                           # | "routed_experts" | "embed" | "lm_head"
    name: str
    numel: int
    elem_bytes: int
    matmul: bool           # multiplies every token's activations (counts toward FLOPs)

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem_bytes


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts that ``tokens`` tokens choosing ``top_k`` of ``num_experts`` uniformly touch."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


class DeepseekV4Cost:
    """Bytes and FLOPs of DeepSeek-V4's main layers (MTP layers are not run by the engine)."""

    def __init__(self, args: DeepseekV4Args, weight_bytes: int, cache_bytes: int,
                 tie_word_embeddings: bool = False) -> None:
        self.args = args
        self.w = weight_bytes
        self.c = cache_bytes
        self.tied = tie_word_embeddings
        self.tensors = self._tensors()

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
        n = a.hc_mult
        mix = (2 + n) * n
        for hc in ("attn_hc", "ffn_hc"):
            out += [Tensor(i, "hc", f"{hc}.fn", mix * n * hd, FP32, True),
                    Tensor(i, "hc", f"{hc}.base", mix, FP32, False),
                    Tensor(i, "hc", f"{hc}.scale", 3, FP32, False)]
        out += [Tensor(i, "norm", "input_layernorm", hd, FP32, False),
                Tensor(i, "norm", "post_attention_layernorm", hd, FP32, False),
                Tensor(i, "router", "gate.weight", a.n_routed_experts * hd, FP32, True)]
        if a.mlp_layer_types[i] == "hash_moe":
            out.append(Tensor(i, "tid2eid", "gate.tid2eid", a.vocab_size * a.top_k, INT64, False))
        else:
            out.append(Tensor(i, "router", "gate.e_score_correction_bias", a.n_routed_experts, FP32, False))
        expert = 3 * hd * a.moe_intermediate_size
        out += [Tensor(i, "routed_experts", "experts", a.n_routed_experts * expert, w, False),
                Tensor(i, "shared_expert", "shared_experts", expert, w, True)]
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

    # -- totals -----------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        """Elements of every parameter and persistent buffer (tid2eid included)."""
        return sum(t.numel for t in self.tensors)

    @property
    def param_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def expert_bytes(self) -> int:
        """One routed expert's three matrices."""
        return 3 * self.args.hidden_size * self.args.moe_intermediate_size * self.w

    @property
    def _lm_head_numel(self) -> int:
        return self.args.vocab_size * self.args.hidden_size

    def dense_bytes(self) -> int:
        """Bytes every step reads whole: all but the embedding table, routed experts and tid2eid tables."""
        skip = ("embed", "routed_experts", "tid2eid")
        total = sum(t.nbytes for t in self.tensors if t.part not in skip)
        return total + (self._lm_head_numel * self.w if self.tied else 0)

    def matmul_params_per_token(self) -> int:
        """Parameters one token multiplies through, lm_head excluded: dense matmuls + K routed experts."""
        dense = sum(t.numel for t in self.tensors if t.matmul)
        expert = 3 * self.args.hidden_size * self.args.moe_intermediate_size
        return dense + self.args.num_layers * self.args.top_k * expert

    # -- attention and KV cache, per token ------------------------------------------------
    def attention_flops(self, s: int) -> int:
        """FLOPs of one query with ``s`` tokens of context (itself included), over all layers."""
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
        """KV-cache bytes one decode query with ``s`` tokens of context reads, over all layers."""
        a = self.args
        total = 0
        for kind in a.layer_types[: a.num_layers]:
            entries = min(s, a.sliding_window)
            if kind == CSA:
                n = s // a.compress_rates[kind]
                entries += min(a.index_topk, n)
                total += n * a.index_head_dim * self.c
            elif kind == HCA:
                entries += s // a.compress_rates[kind]
            total += entries * a.head_dim * self.c
        return total

    def kv_write_bytes(self) -> float:
        """KV-cache bytes one token writes over all layers: window entry, compressor (and indexer)
        states (kv and gate), compressed entries amortised over their ``r`` tokens."""
        a = self.args
        d, di = a.head_dim, a.index_head_dim
        total = 0.0
        for kind in a.layer_types[: a.num_layers]:
            total += d
            if kind == CSA:
                r = a.compress_rates[kind]
                total += 2 * 2 * d + 2 * 2 * di + (d + di) / r
            elif kind == HCA:
                total += 2 * d + d / a.compress_rates[kind]
        return total * self.c

    # -- steps ------------------------------------------------------------------------
    def decode_weight_bytes(self, batch: int, distinct_experts: list[float]) -> float:
        """Weight bytes one decode step of ``batch`` sequences reads, given the distinct routed
        experts each layer touches."""
        a = self.args
        if len(distinct_experts) != a.num_layers:
            raise ValueError(f"distinct_experts has {len(distinct_experts)} entries; the model has "
                             f"{a.num_layers} layers")
        hash_layers = sum(t == "hash_moe" for t in a.mlp_layer_types[: a.num_layers])
        rows = batch * (a.hidden_size * self.w + hash_layers * a.top_k * INT64)
        return self.dense_bytes() + rows + sum(distinct_experts) * self.expert_bytes

    def estimated_distinct_experts(self, tokens: int) -> list[float]:
        a = self.args
        return [expected_distinct_experts(a.n_routed_experts, a.top_k, tokens)] * a.num_layers

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
        a = self.args
        # The routed experts' share, bounded on its own by parts_floor_ms.
        expert_flops = 2 * tokens * a.num_layers * a.top_k * 3 * a.hidden_size * a.moe_intermediate_size
        return {"weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv, "flops": flops,
                "distinct_experts": distinct, "expert_bytes": sum(distinct) * self.expert_bytes,
                "expert_flops": expert_flops}


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
