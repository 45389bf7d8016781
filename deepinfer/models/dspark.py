"""The DSpark drafter shipped inside DeepSeek-V4.1 checkpoints (``mtp.*``): a few
backbone-shaped stages that draft a block of tokens in one parallel pass, then a Markov
head that adds a bias left to right, and a confidence head.

What belongs here: the drafter's weights, its forward math and its sampling of the draft
block, over explicit tensors. What does not: where the context rows live (the engine
stores them, e.g. in its paged KV cache, and hands them back as a dense window),
scheduling, verification and rejection sampling. The target's features come from
``DeepseekV41Model.forward(..., capture=...)`` (models/deepseek_v41.py).

Shape legend:
    B   requests in the batch
    G   the draft block (``dspark_block_size``; the anchor slot plus G-1 noise slots)
    S   drafter stages (``mtp.0 .. mtp.{S-1}``)
    T   committed positions whose context rows are made
    W   context rows a request's query block sees (<= the window; 128 in the release)
    M   target layers read (``dspark_target_layer_ids``)
    Hd  hidden size, n hyper-connection streams
    H   heads, D head dim (K = V latent), R rope dims
    V   vocabulary, r Markov rank

Indexing convention (checked against DeepSeek's reference, tests/models/test_dspark.py):
``s`` is the last position whose target hidden state is known; the anchor ``a`` is the
token the target picked for position ``s + 1`` (not yet in any cache). The block
``[a, n, .., n]`` sits at positions ``s + 1 .. s + G`` and slot ``i`` proposes the token of
position ``s + 2 + i``: the G drafts follow the anchor. Each stage's context is its rows of
positions ``max(0, s - W + 1) .. s``. ``z_i`` (:attr:`DraftProposal.logits`) includes the
Markov bias; the confidence is returned as the raw logit ``l_i`` (``sigmoid`` gives the
probability that draft ``i`` survives, given drafts ``0 .. i-1`` did); ``l_i`` reads
``[h_i; embed(prev_i)]`` with ``prev_0 = a``, so it never sees draft ``i`` itself.

Forward (dspark_module.md §2):

1. context: ``main_x_p = main_norm(main_proj(concat_L mean_j X_L[p, j]))`` where ``X_L`` are
   the n streams *entering* target layer L; each stage's row ``c_p = rope_p(kv_norm(wkv main_x_p))``
   (rounded to MXFP8 with the release's KV formats). main_x enters only through these rows;
2. query block: embed ``[a, n, ..]`` (the target's embedding) into n streams, then S lagged-mHC
   stages (as the backbone's layers), each attention window-only: every block query sees all G
   block rows (bidirectional) and the request's valid context rows, K = V, per-head sinks,
   inverse rope on the output, grouped ``wo_a`` then ``wo_b``; MoE with the drafter's own
   expert count and top-k;
3. head: ``h_i = collapse(streams, last FFN pre)``, ``U_i = lm_head(norm(h_i))`` (the target's
   head), then left to right ``z_i = U_i + markov_head . markov_embed[prev_i]`` in float32,
   ``d_i`` = argmax or a sample of ``softmax(z_i / T)``, ``prev_{i+1} = d_i``.

DeepSeek-V4 (non-.1) drafters (``variant="v4"``: V4-Flash-0731, V4-Flash-DSpark; the same
module, these switches): per-head q RMS (after ``wq_b``, weightless, before rope), the
backbone's non-lagged mHC, a learned ``hc_head`` in the last stage collapsing the streams
(instead of V4.1's last FFN pre), Markov tensors named ``markov_w1``/``markov_w2``, the
backbone's routed experts, no ``bias_vl``, ``dspark_target_layer_ids`` in capture-after
semantics (layer L's *output*, i.e. the streams entering L + 1; the last layer's output is
the final streams before the head), stages counted from the ``mtp.N`` tensors (the HF config's
``num_nextn_predict_layers`` says 1 for 3 stages). No reference outputs exist for it: each of
these differences is tested against an independent re-implementation, and the engine's
drafts against this module's, but not against DeepSeek's code.

Release KV rounding (``round_kv``): V4.1 rounds context and block rows to MXFP8 (32
channels a scale); V4 rounds only the non-rope channels, to E4M3 with a power-of-two scale
per 64 (the grid of the V4 backbone's FP8 KV records), the rope channels left as computed.
The release also rounds ``main_proj``'s input to FP8 per 32: like the backbone's GEMM-input
rounding, that is not done here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.kernels import backend, reference
from deepinfer.layers.deepseek_v4_attention import GroupedLinear
from deepinfer.layers.deepseek_v4_common import InterleavedRope, RMSNorm
from deepinfer.layers.deepseek_v4_moe import DeepseekV4MoE
from deepinfer.layers.hyper_connection import HyperConnection, HyperHead
from deepinfer.layers.moe import FusedMoE
from deepinfer.models.base import load_module_weights
from deepinfer.models.deepseek_v4 import BLOCK_RENAMES, remap_block_tensor
from deepinfer.models.dummy import fill_dummy_
from deepinfer.models.quant import pair_scales

VARIANTS = ("v4.1", "v4")


@dataclass(frozen=True)
class DSparkConfig:
    variant: str                    # "v4.1" or "v4"
    num_stages: int
    block_size: int                 # G
    noise_token_id: int
    target_layer_ids: tuple[int, ...]   # layers whose *entering* streams are read (V4's ids + 1)
    markov_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    window: int
    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    gate_temp: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"DSpark variant {self.variant!r} is not one of {', '.join(VARIANTS)}")
        if self.num_stages < 1:
            raise ValueError(f"a DSpark drafter needs at least one stage, got {self.num_stages}")
        if self.block_size < 1:
            raise ValueError(f"dspark_block_size={self.block_size} must be >= 1")
        if not 0 <= self.noise_token_id < self.vocab_size:
            raise ValueError(f"dspark_noise_token_id={self.noise_token_id} is not a token of the "
                             f"{self.vocab_size}-token vocabulary")
        if not self.target_layer_ids:
            raise ValueError("dspark_target_layer_ids is empty: the drafter reads at least one target layer")

    @classmethod
    def from_target(cls, cfg: dict, num_layers: int, variant: str = "v4.1",
                    num_stages: int | None = None) -> "DSparkConfig":
        """From the target's flattened text config (HF ``text_config`` names, defaults filled in).
        ``num_layers``: the target's layer count (V4's capture-after ids may name the last);
        ``num_stages``: the stages the checkpoint ships, when counted from its tensors (else
        ``n_mtp_layers`` / ``num_nextn_predict_layers``)."""
        if "dspark_block_size" not in cfg:
            raise ValueError("the checkpoint's config has no dspark_block_size: it ships no DSpark drafter")
        ids = tuple(int(i) for i in cfg["dspark_target_layer_ids"])
        if variant == "v4":
            # V4 names the layer whose output is read: the streams entering the next one.
            ids = tuple(i + 1 for i in ids)
        bad = [i for i in ids if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"dspark_target_layer_ids {list(cfg['dspark_target_layer_ids'])} read layer(s) "
                             f"{bad} outside the target's {num_layers}")
        stages = num_stages or int(cfg.get("n_mtp_layers") or cfg.get("num_nextn_predict_layers") or 0)
        return cls(
            variant=variant, num_stages=stages, block_size=int(cfg["dspark_block_size"]),
            noise_token_id=int(cfg["dspark_noise_token_id"]), target_layer_ids=ids,
            markov_rank=int(cfg["dspark_markov_rank"]),
            n_routed_experts=int(cfg.get("dspark_n_routed_experts") or cfg["n_routed_experts"]),
            num_experts_per_tok=int(cfg.get("dspark_num_experts_per_tok") or cfg.get("dspark_n_activated_experts")
                                    or cfg["num_experts_per_tok"]),
            window=int(cfg["sliding_window"]), vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]), num_heads=int(cfg["num_attention_heads"]),
            head_dim=int(cfg["head_dim"]), rope_dim=int(cfg["qk_rope_head_dim"]),
            q_lora_rank=int(cfg["q_lora_rank"]), o_groups=int(cfg["o_groups"]),
            o_lora_rank=int(cfg["o_lora_rank"]), moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            scoring_func=str(cfg["scoring_func"]), routed_scaling_factor=float(cfg["routed_scaling_factor"]),
            swiglu_limit=float(cfg["swiglu_limit"]), gate_temp=float(cfg.get("gate_temp", 1.0)),
            hc_mult=int(cfg["hc_mult"]), hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]),
            hc_eps=float(cfg["hc_eps"]), rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=float(cfg["rope_theta"]))

    @property
    def feature_size(self) -> int:
        """Width of the target features main_proj reads: M * Hd."""
        return len(self.target_layer_ids) * self.hidden_size


@dataclass(frozen=True)
class DraftSampling:
    """How :meth:`DSparkDrafter.propose` picks each draft token, per request.

    Greedy rows take ``argmax z_i`` (their draft distribution is one-hot). Sampled rows take
    ``argmax(q / e)`` with ``q = softmax(filters(z_i / temperature))`` and ``e ~ Exp(1)``
    (the exponential race the engine's sampler uses; a sample of q). ``noise`` [B, G, V]
    gives the ``e`` draws (e.g. from per-request seeded generators); without it they are
    drawn from ``generator``. The filters (``min_p``, ``top_k``, ``top_p``: [B] each, all or
    none) are the engine's (``backend.sampling_filters_``); q is the distribution after them,
    as rejection sampling needs.
    """

    greedy: torch.Tensor                       # [B] bool
    temperature: torch.Tensor                  # [B] float32, > 0 on sampled rows
    min_p: torch.Tensor | None = None          # [B] float32
    top_k: torch.Tensor | None = None          # [B] int64 (V: off)
    top_p: torch.Tensor | None = None          # [B] float32
    noise: torch.Tensor | None = None          # [B, G, V] float32 Exp(1) draws
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        filters = (self.min_p, self.top_k, self.top_p)
        if any(f is None for f in filters) and any(f is not None for f in filters):
            raise ValueError("DraftSampling takes min_p, top_k and top_p together or not at all")


@dataclass(frozen=True)
class DraftProposal:
    tokens: torch.Tensor              # [B, G] int64 drafts for positions s+2 .. s+G+1
    confidence_logits: torch.Tensor   # [B, G] float32 l_i; sigmoid(l_i) = P(draft i survives | 0..i-1 did)
    logits: torch.Tensor              # [B, G, V] float32 z_i = U_i + Markov bias (before temperature)
    probs: torch.Tensor               # [B, G, V] float32 the distribution each draft was drawn from

    @property
    def confidence(self) -> torch.Tensor:
        """[B, G] float32 sigmoid of the confidence logits."""
        return torch.sigmoid(self.confidence_logits)


def window_positions(last_positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a request's context rows must hold: ``s - W + 1 .. s`` for each
    ``s`` in last_positions [B] -> (positions [B, W] int64, valid [B, W] bool; False before 0).
    Row order does not matter to :meth:`DSparkDrafter.propose` (attention is order-free)."""
    pos = last_positions.long()[:, None] - torch.arange(window - 1, -1, -1, device=last_positions.device)
    return pos.clamp(min=0), pos >= 0


class DSparkAttention(nn.Module):
    """A stage's window-only attention; parameter names as the backbone's (BLOCK_RENAMES)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.o_groups = cfg.num_heads, cfg.head_dim, cfg.o_groups
        self.scale = cfg.head_dim ** -0.5
        self.q_head_norm = cfg.variant == "v4"
        self.eps = cfg.rms_norm_eps
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.num_heads * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(cfg.num_heads * cfg.head_dim // cfg.o_groups,
                                      cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads, dtype=torch.float32))

    def kv_rows(self, x: torch.Tensor, positions: torch.Tensor, rope: InterleavedRope) -> torch.Tensor:
        # x: [T, Hd] (main_x, or the normed block input), positions: [T] -> K = V rows [T, D]
        return backend.kv_norm_rope(self.kv_proj(x), self.kv_norm.weight, positions, rope.inv_freq,
                                    rope.scaling, self.kv_norm.eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                context_valid: torch.Tensor, rope: InterleavedRope,
                round_rows: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        # x: [B*G, Hd] normed block input; positions: [B*G]; context: [B, W, D] this stage's rows;
        # context_valid: [B, W] bool -> [B*G, Hd]
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        b, w = context_valid.shape
        g = t // b
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).view(t, h, d)
        if self.q_head_norm:
            q = backend.q_norm_rope(q, positions, rope.inv_freq, rope.scaling, self.eps)      # [B*G, H, D]
        else:
            q = backend.interleaved_rope(q, positions, rope.inv_freq, rope.scaling)          # [B*G, H, D]
        block = round_rows(self.kv_rows(x, positions, rope))                                  # [B*G, D]
        # Each request's keys as one "page" of W + G rows (ring, then block): every block query
        # sees its request's valid ring rows and all G block rows, none of another request's.
        keys = torch.cat([context.to(block.dtype), block.view(b, g, d)], dim=1)             # [B, W+G, D]
        cols = torch.arange(w + g, device=x.device)
        visible = torch.cat([context_valid, context_valid.new_ones(b, g)], dim=1)           # [B, W+G]
        slots = torch.where(visible, torch.arange(b, device=x.device)[:, None] * (w + g) + cols, -1)
        slots = slots.repeat_interleave(g, dim=0)                                            # [B*G, W+G]
        out = backend.sparse_attention(q, [(keys[:, :, None, None, :], slots)], self.sinks, self.scale)
        out = backend.interleaved_rope(out, positions, rope.inv_freq, rope.scaling, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.view(t, self.o_groups, -1)).flatten(1))


class DSparkStage(nn.Module):
    """One stage: mHC around window attention and the MoE (the backbone's layer, no engram)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.lagged = cfg.variant == "v4.1"
        self.self_attn = DSparkAttention(cfg)
        self.mlp = DeepseekV4MoE(d, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                                 cfg.scoring_func, cfg.routed_scaling_factor, cfg.swiglu_limit, None,
                                 gate_temp=cfg.gate_temp)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.attn_hc = HyperConnection(cfg.hc_mult, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.ffn_hc = HyperConnection(cfg.hc_mult, d, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)

    def _connect(self, hc: HyperConnection, streams: torch.Tensor, pre_in: torch.Tensor | None,
                 norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(normed block input, this connection's pre (V4.1: lagged to the next sublayer;
        V4: None), post, comb)."""
        if self.lagged:
            return hc.lagged(streams, pre_in, norm.params())
        x, post, comb = hc(streams, norm.params())
        return x, None, post, comb

    def forward(self, streams: torch.Tensor, pre_mix: torch.Tensor | None, input_ids: torch.Tensor,
                positions: torch.Tensor, context: torch.Tensor, context_valid: torch.Tensor,
                rope: InterleavedRope, round_rows: Callable[[torch.Tensor], torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # streams: [B*G, n, Hd]; pre_mix: [B*G, n] float32 (V4.1) -> (streams, the FFN's pre)
        x, attn_pre, post, comb = self._connect(self.attn_hc, streams, pre_mix, self.input_layernorm)
        x = self.self_attn(x, positions, context, context_valid, rope, round_rows)
        streams = backend.hc_post(x, streams, post, comb)
        x, ffn_pre, post, comb = self._connect(self.ffn_hc, streams, attn_pre, self.post_attention_layernorm)
        return backend.hc_post(self.mlp(x, input_ids), streams, post, comb), ffn_pre


class MarkovHead(nn.Module):
    """The rank-r Markov bias ``head . embed[prev]`` and the embedding the confidence reads.
    Float32 whatever the compute dtype (BF16 in the checkpoint, so exact): the bias is added
    to float32 logits."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.empty(vocab_size, rank, dtype=torch.float32))    # [V, r]
        self.head = nn.Parameter(torch.empty(vocab_size, rank, dtype=torch.float32))     # [V, r]


# Checkpoint names of the drafter's own (non-stage) tensors, by variant -> ours.
_HEAD_RENAMES = {
    "v4.1": {"markov_head.embed.weight": "markov.embed", "markov_head.head.weight": "markov.head"},
    "v4": {"markov_head.markov_w1.weight": "markov.embed", "markov_head.markov_w2.weight": "markov.head",
           "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"},
}
_SHARED_RENAMES = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight",
                   "norm.weight": "norm.weight", "confidence_head.proj.weight": "confidence.weight"}
_MTP_NAME = re.compile(r"^mtp\.(?P<idx>\d+)\.(?P<rest>.+)$")
# V4.1's vision-only routing bias (``gate.bias_vl``): the engine serves the target text-only.
# V4 ships none (there it is an unknown tensor).
_SKIPPED_SUFFIXES = (".gate.bias_vl",)


class DSparkDrafter(nn.Module):
    """The drafter. It owns its stages and heads; the embedding and LM head are the
    target's, passed in and not registered (they are not part of :meth:`state_dict`)."""

    def __init__(self, cfg: DSparkConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 round_kv: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        # The release rounds context and block rows (V4.1: MXFP8; V4: the non-rope channels per 64).
        self.round_kv = round_kv
        self.main_proj = nn.Linear(cfg.feature_size, d, bias=False)
        self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.stages = nn.ModuleList(DSparkStage(cfg) for _ in range(cfg.num_stages))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hc_mult, d, cfg.hc_eps, cfg.rms_norm_eps) if cfg.variant == "v4" else None
        self.markov = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        self.confidence = nn.Linear(d + cfg.markov_rank, 1, bias=False, dtype=torch.float32)
        self.rope = InterleavedRope(cfg.head_dim, {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                                   "partial_rotary_factor": cfg.rope_dim / cfg.head_dim},
                                    0)
        self._shared = (embed_tokens, lm_head)

    @classmethod
    def from_target(cls, target: nn.Module) -> "DSparkDrafter":
        """The drafter of a loaded DeepseekV41ForCausalLM (variant "v4.1") or
        DeepseekV4ForCausalLM with a DSpark config (variant "v4"): built on the target's device
        and dtype, sharing its embedding and head, rounding its rows as the release when the
        target keeps the release's KV formats (V4.1: ``kv_cache_dtype`` "auto"; V4: "fp8"),
        loaded from the ``mtp.*`` tensors the target kept (``drafter_tensors``; any still
        quantised are dequantised with their scales by ``pair_scales``, as the loader does for
        the backbone), or drawn from the target's seed when its weights are random."""
        from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, has_dspark, text_config
        from deepinfer.models.loader import fp8_block_size

        if isinstance(target, DeepseekV4ForCausalLM):
            if not has_dspark(target.hf_config):
                raise ValueError("the checkpoint's config has no dspark_block_size: it ships no DSpark drafter")
            cfg = DSparkConfig.from_target(_v4_dspark_config(target, text_config(target.hf_config)),
                                           len(target.model.layers), variant="v4",
                                           num_stages=_count_stages(target.drafter_tensors))
            round_kv = target.kv_cache_dtype == "fp8"
        else:
            cfg = DSparkConfig.from_target(target.args.cfg, len(target.model.layers))
            round_kv = getattr(target, "kv_cache_dtype", "auto") == "auto"
        weight = target.lm_head.weight
        previous = torch.get_default_dtype()
        torch.set_default_dtype(weight.dtype)
        try:
            with torch.device(weight.device):
                drafter = cls(cfg, target.model.embed_tokens, target.lm_head, round_kv=round_kv)
        finally:
            torch.set_default_dtype(previous)
        if target.drafter_tensors:
            drafter.load_weights(pair_scales(target.drafter_tensors.items(),
                                             fp8_block=fp8_block_size(target.hf_config)))
        elif target.dummy_seed is not None:
            drafter.fill_dummy_(target.dummy_seed)
        else:
            raise ValueError("the target has no DSpark (mtp.*) tensors and no random weights to draw them from")
        return drafter.eval()

    def fill_dummy_(self, seed: int) -> None:
        """Random weights for a target with random weights (``load_format="dummy"``: benchmarks at
        release widths): each of the drafter's own tensors drawn as models/dummy.py draws a
        target's (the embedding and head are the target's, not in this module's state dict)."""
        for name, tensor in self.state_dict(keep_vars=True).items():
            fill_dummy_(tensor.data, f"mtp.{name}", seed, self.cfg.n_routed_experts)

    # -- weights -----------------------------------------------------------------------
    def remap_weight_name(self, name: str) -> str | None:
        m = _MTP_NAME.match(name)
        if m is None:
            raise ValueError(f"checkpoint tensor {name!r} is not a drafter (mtp.*) tensor")
        i, rest = int(m["idx"]), m["rest"]
        if i >= self.cfg.num_stages:
            raise ValueError(f"checkpoint tensor {name!r} belongs to stage {i}, but the drafter has "
                             f"{self.cfg.num_stages} stages (num_nextn_predict_layers; V4: its mtp.N tensors)")
        if rest.endswith(_SKIPPED_SUFFIXES) and self.cfg.variant == "v4.1":
            return None
        own = _HEAD_RENAMES[self.cfg.variant].get(rest) or _SHARED_RENAMES.get(rest)
        if own is not None:
            # main_proj / main_norm live in the first stage, the heads in the last.
            want = 0 if rest.startswith("main_") else self.cfg.num_stages - 1
            if i != want:
                raise ValueError(f"checkpoint tensor {name!r}: the drafter's {rest} belongs to stage {want} "
                                 f"(mtp.{want}.{rest}) of its {self.cfg.num_stages}")
            return own
        return remap_block_tensor(self, name, f"stages.{i}", rest, BLOCK_RENAMES)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load dequantised ``mtp.*`` tensors (strict: unknown, mis-shaped or missing tensors raise)."""
        load_module_weights(self, weights, self.remap_weight_name)
        for module in self.modules():
            if isinstance(module, FusedMoE) and module.packing_helps():
                module.pack_weights()

    # -- context rows ------------------------------------------------------------------
    def _round(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.round_kv:
            return rows
        if self.cfg.variant == "v4.1":
            rounded = reference.round_mxfp8(rows)
        else:
            rounded = round_v4_kv(rows, self.cfg.rope_dim)
        # Training (rows that need a gradient): straight through, the rounding's gradient
        # taken as the identity. Otherwise the rounded rows themselves.
        return rows + (rounded - rows).detach() if rows.requires_grad else rounded

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The context rows of committed positions, for every stage.

        features: [T, M*Hd] the target's features of those positions (the n-stream means of
        the streams entering each target layer, concatenated in ``target_layer_ids`` order);
        positions: [T] -> [S, T, D] (roped at their positions; rounded as the release with round_kv).
        """
        main_x = self.main_norm(self.main_proj(features.to(self.main_proj.weight.dtype)))   # [T, Hd]
        return torch.stack([self._round(stage.self_attn.kv_rows(main_x, positions, self.rope))
                            for stage in self.stages])                                     # [S, T, D]

    # -- the draft block ---------------------------------------------------------------
    def block_states(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, context: torch.Tensor,
                     context_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The parallel backbone over each request's block ``[a, n, .., n]``: (pre-norm head
        hidden states h_i [B, G, Hd], base logits U_i [B, G, V] float32, without the Markov
        bias). Arguments as :meth:`propose`. Differentiable (the training forward of
        scripts/train_dspark_drafter.py); :meth:`propose` adds the Markov chain."""
        cfg = self.cfg
        b, g = anchor_ids.shape[0], cfg.block_size
        if context.dim() != 4 or context.shape[:2] != (cfg.num_stages, b) or context.shape[2] > cfg.window:
            raise ValueError(f"context must be [stages={cfg.num_stages}, B={b}, W<={cfg.window}, D], "
                             f"got {tuple(context.shape)}")
        if context_valid.shape != context.shape[1:3]:
            raise ValueError(f"context_valid must be [B, W] = {tuple(context.shape[1:3])}, "
                             f"got {tuple(context_valid.shape)}")
        device = anchor_ids.device
        ids = torch.full((b, g), cfg.noise_token_id, dtype=torch.long, device=device)
        ids[:, 0] = anchor_ids
        ids = ids.flatten()                                                              # [B*G]
        positions = (anchor_positions.long()[:, None] + torch.arange(g, device=device)).flatten()   # [B*G]
        embed, lm_head = self._shared
        streams = embed(ids)[:, None, :].expand(-1, cfg.hc_mult, -1)                    # [B*G, n, Hd]
        pre_mix = None
        if cfg.variant == "v4.1":
            # Lagged mHC: the first stage's input is stream 0 (as the backbone's first layer).
            pre_mix = torch.zeros(streams.shape[:2], dtype=torch.float32, device=device)
            pre_mix[:, 0] = 1.0
        for stage, rows in zip(self.stages, context):
            streams, pre_mix = stage(streams, pre_mix, ids, positions, rows, context_valid, self.rope, self._round)
        if self.hc_head is None:
            hidden = backend.hc_collapse(streams, pre_mix)                               # [B*G, Hd] pre-norm
        else:
            hidden = self.hc_head(streams)
        base = lm_head(self.norm(hidden)).float().view(b, g, -1)                         # [B, G, V] U_i
        return hidden.view(b, g, -1), base

    def markov_logits(self, base: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head of slots whose feeding tokens are known: base [B, K, V] float32 U_i,
        hidden [B, K, Hd] h_i, prev [B, K] the token feeding each slot (the anchor for slot
        0, then draft i-1) -> (z_i = U_i + Markov bias [B, K, V] float32, confidence logits
        l_i [B, K] float32). :meth:`propose` calls it one slot at a time with its own drafts;
        training calls it on the whole block with the true tokens (teacher forcing)."""
        e = self.markov.embed[prev.long()]                                               # [B, K, r]
        z = base + e @ self.markov.head.t()                                              # [B, K, V]
        conf = torch.cat([hidden.float(), e], dim=-1) @ self.confidence.weight[0]       # [B, K]
        return z, conf

    def propose(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, context: torch.Tensor,
                context_valid: torch.Tensor, sampling: DraftSampling | None = None) -> DraftProposal:
        """Draft G tokens after each anchor.

        anchor_ids: [B] the token the target picked for position s+1; anchor_positions: [B]
        (= s+1); context: [S, B, W, D] each stage's rows of the request's positions
        ``max(0, s-W+1) .. s`` in any order (:func:`window_positions`), W <= window;
        context_valid: [B, W] bool, False for rows to ignore (positions < 0, not yet written);
        sampling: None for greedy. Never synchronises with the host.
        """
        hidden, base = self.block_states(anchor_ids, anchor_positions, context, context_valid)
        return self._markov_chain(base, hidden, anchor_ids, sampling)

    def _markov_chain(self, base: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                      sampling: DraftSampling | None) -> DraftProposal:
        # base: [B, G, V] float32 U_i; hidden: [B, G, Hd] pre-norm h_i; anchor_ids: [B]
        g = base.shape[1]
        noise = None
        if sampling is not None and sampling.noise is None:
            noise = torch.empty_like(base).exponential_(generator=sampling.generator)   # [B, G, V]
        elif sampling is not None:
            noise = sampling.noise
        prev = anchor_ids.long()
        tokens, conf, logits, probs = [], [], [], []
        for i in range(g):
            z, c = self.markov_logits(base[:, i:i + 1], hidden[:, i:i + 1], prev[:, None])
            z, c = z[:, 0], c[:, 0]                                                      # [B, V], [B]
            token, q = pick_draft(z, sampling, None if noise is None else noise[:, i])
            tokens.append(token)
            conf.append(c)
            logits.append(z)
            probs.append(q)
            prev = token
        return DraftProposal(tokens=torch.stack(tokens, 1), confidence_logits=torch.stack(conf, 1),
                             logits=torch.stack(logits, 1), probs=torch.stack(probs, 1))


def round_v4_kv(rows: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """DeepSeek-V4's DSpark KV rounding: rows [..., D] with their first D - R channels rounded to
    E4M3 with a power-of-two scale per 64 (as the V4 backbone's FP8 KV records hold them) and
    the trailing ``rope_dim`` channels kept as they are -> rows' shape and dtype."""
    rounded = reference.round_ds_mla(rows, rope_dim)
    return torch.cat([rounded[..., :-rope_dim], rows[..., -rope_dim:]], dim=-1)


def _count_stages(tensors: dict[str, torch.Tensor]) -> int | None:
    """1 + the highest ``mtp.N`` among checkpoint tensors, None when there are none."""
    stages = [int(m["idx"]) for m in map(_MTP_NAME.match, tensors) if m is not None]
    return max(stages) + 1 if stages else None


def _v4_dspark_config(target: nn.Module, cfg: dict) -> dict:
    """A DeepSeek-V4 target's config as DSparkConfig.from_target reads it: the drafter's rope
    is the window layers' ("main": no YaRN), its width from head_dim * partial_rotary_factor."""
    main = target.args.rope_parameters["main"]
    return {**cfg, "qk_rope_head_dim": int(target.args.head_dim * main.get("partial_rotary_factor", 1.0)),
            "rope_theta": float(main["rope_theta"])}


def pick_draft(z: torch.Tensor, sampling: DraftSampling | None, noise: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft slot: z [B, V] float32 logits -> (token [B] int64, its draft distribution [B, V]),
    as :class:`DraftSampling` says; ``noise`` [B, V] Exp(1) draws for the sampled rows (unused
    when ``sampling`` is None). Shared with the chained MTP drafter (spec/mtp.py)."""
    greedy_tok = z.argmax(-1)                                                            # [B]
    one_hot = torch.zeros_like(z).scatter_(1, greedy_tok[:, None], 1.0)
    if sampling is None:
        return greedy_tok, one_hot
    # Shift the row max to 0 first: no positive temperature, however small, overflows (as the sampler).
    # Greedy rows divide by 1: their temperature may be anything, 0 included.
    temperature = torch.where(sampling.greedy, 1.0, sampling.temperature.float())        # [B]
    x = (z - z.amax(-1, keepdim=True)) / temperature[:, None]
    if sampling.top_k is not None:
        backend.sampling_filters_(x, sampling.min_p, sampling.top_k, sampling.top_p)
    q = x.softmax(-1)                                                                    # [B, V]
    sampled = (q / noise.clamp_min(torch.finfo(q.dtype).tiny)).argmax(-1)               # [B]
    greedy = sampling.greedy[:, None]
    return torch.where(sampling.greedy, greedy_tok, sampled), torch.where(greedy, one_hot, q)
