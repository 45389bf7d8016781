"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache.

What belongs here: MLA's projections, its decoupled rotary embedding (with the
YaRN scaling DeepSeek configures, and the softmax-scale correction it implies),
storing the per-token latent in the paged cache and attending over it. What
does not: the decoder block around it (models/deepseek_v3.py).

Each token's keys and values are compressed into one latent vector
``c = RMSNorm(W_dkv x)`` of kv_lora_rank R, plus one rotary key ``k_pe`` of
rope dim Dr shared by all heads. The cache stores only ``[c, k_pe]`` (one
"head" of R + Dr); per-head keys ``[W_uk c, k_pe]`` and values ``W_uv c`` are
re-expanded with kv_b_proj when attending prompt chunks; decode steps attend
in the absorbed form instead (W_uk folded into q, W_uv applied to the
attention-weighted latent: ``kernels/mla_decode.py``), one launch for the batch.

Shape legend:
    T   tokens in the flattened batch;  L  context length of one sequence
    H   hidden size;  Nh  attention heads
    Dn  qk_nope_head_dim;  Dr  qk_rope_head_dim;  Dv  v_head_dim
    R   kv_lora_rank;  Rq  q_lora_rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from deepinfer import batch_invariant
from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import backend, reference
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import inv_frequencies, rope_parameters
from deepinfer.models.base import config_value
from deepinfer.parallel.groups import current_groups
from deepinfer.parallel.tensor import ColumnParallelLinear, RowParallelLinear

# HF and DeepSeek build q_a_layernorm and kv_a_layernorm with the default eps,
# not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """The config.json fields MLA reads, and the derived softmax scale."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool
    rope: dict

    @classmethod
    def from_hf(cls, cfg: dict) -> "MLAConfig":
        q_lora_rank = cfg.get("q_lora_rank", 1536)   # HF's default; an explicit null means q_proj
        out = cls(
            hidden_size=int(config_value(cfg, "hidden_size")),
            num_heads=int(config_value(cfg, "num_attention_heads")),
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(config_value(cfg, "kv_lora_rank")),
            qk_nope_head_dim=int(config_value(cfg, "qk_nope_head_dim")),
            qk_rope_head_dim=int(config_value(cfg, "qk_rope_head_dim")),
            v_head_dim=int(config_value(cfg, "v_head_dim")),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            rope=mla_rope_parameters(cfg),
        )
        if out.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={out.qk_rope_head_dim} must be even")
        return out

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """Softmax scale: ``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2``
        under scaled rope (YaRN's attention temperature moved out of cos/sin, as in HF)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope["rope_type"] != "default":
            mscale_all_dim = self.rope.get("mscale_all_dim", 0)
            if mscale_all_dim:
                mscale = yarn_mscale(self.rope["factor"], mscale_all_dim)
                scale = scale * mscale * mscale
        return scale


def mla_rope_parameters(cfg: dict) -> dict:
    """``rotary.rope_parameters`` plus YaRN's pretraining length (config.json's
    top-level ``original_max_position_embeddings`` first, then the rope dict's,
    then ``max_position_embeddings``, in HF's order)."""
    params = rope_parameters(cfg)
    if params["rope_type"] == "yarn":
        top_level = cfg.get("original_max_position_embeddings")
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings",
                          int(config_value(cfg, "max_position_embeddings")))
        # YaRN derives a missing ``factor`` from it.
        params["max_position_embeddings"] = int(config_value(cfg, "max_position_embeddings"))
    return params


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_frequencies(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float32, cos/sin scaling) for ``rope_type="yarn"``,
    as HF's ``_compute_yarn_parameters`` computes them: interpolate (divide by
    ``factor``) the low frequencies, keep the high ones, ramp linearly between
    the dims that rotate ``beta_slow`` and ``beta_fast`` times over the
    pretraining length."""
    base = float(params["rope_theta"])
    original_len = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = params["max_position_embeddings"] / original_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]

    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)   # [dim/2]
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp                                   # 1: keep the original frequency
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, float(attention_factor)


class MLARotaryEmbedding(nn.Module):
    """cos/sin of the Dr rotary dims for the batch's positions (default, linear,
    llama3 or YaRN frequencies)."""

    def __init__(self, dim: int, params: dict) -> None:
        super().__init__()
        if params["rope_type"] == "yarn":
            inv_freq, self.attention_scaling = yarn_inv_frequencies(params, dim)
        else:
            inv_freq, self.attention_scaling = inv_frequencies(params, dim)
        # Derived from the config, so not part of the checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, Dr/2] float32
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

def apply_mla_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   interleave: bool) -> torch.Tensor:
    """Rotate x [T, heads, Dr] by cos/sin [T, Dr/2]: DeepSeek's interleaved pairs
    (x0, x1), (x2, x3), ... when ``interleave``, else the rotate-half layout."""
    if interleave:
        # Like HF, the result is laid out de-interleaved (all first elements of
        # the pairs, then all second ones); q and k share the layout, so their
        # dot products are those of the interleaved rotation.
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return reference.apply_rope(x, cos, sin)


class MLAttention(nn.Module):
    """MLA: low-rank (or direct) q, compressed kv latent, decoupled rope, o_proj.

    Declares one cache entry of R + Dr per token (``kv_spec``); the runner binds
    ``kv_cache`` ([num_blocks, block_size, 1, 1, R + Dr]) and ``group_id``. Under tensor
    parallelism ``cfg.num_heads`` is this rank's Nh/tp heads.
    """

    def __init__(self, cfg: MLAConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_heads
        # Tensor parallelism shards the heads: q/kv_b column-parallel (their rows are per-head
        # blocks), o_proj row-parallel. The latent (kv_a) is every head's, so each rank
        # computes and caches all of it.
        tp = current_groups().tp.size
        self.cfg = cfg = replace(cfg, num_heads=nh // tp)                # this rank's heads
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                              bias=False)
        self.o_proj = RowParallelLinear(nh * cfg.v_head_dim, h, bias=cfg.attention_bias)
        self.scale = cfg.scale
        self.kv_spec = KVCacheSpec(kind="full", num_kv_heads=1,
                                   head_size=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                   dtype=dtype, num_tensors=1)
        # Bound by the runner (runner/model_runner.py) once memory is laid out.
        self.kv_cache: torch.Tensor | None = None
        self.group_id: int | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, Dr/2] -> [T, H]
        c = self.cfg
        t = x.shape[0]
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, c.num_heads, c.qk_head_dim).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)            # [T, Nh, Dn], [T, Nh, Dr]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)                # [T, R], [T, Dr]
        latent = self.kv_a_layernorm(latent)
        q_pe = apply_mla_rope(q_pe, cos, sin, c.rope_interleave)         # [T, Nh, Dr]
        k_pe = apply_mla_rope(k_pe[:, None, :], cos, sin, c.rope_interleave)[:, 0]  # [T, Dr]
        q = torch.cat((q_nope, q_pe), dim=-1)                            # [T, Nh, Dn+Dr]
        entries = torch.cat((latent, k_pe), dim=-1)                      # [T, R+Dr]

        out = q.new_empty(t, c.num_heads, c.v_head_dim)                  # [T, Nh, Dv]
        if not ctx.groups or self.kv_cache is None:
            for b in range(ctx.num_seqs):
                s, e = ctx.query_start_loc[b], ctx.query_start_loc[b + 1]
                pos = ctx.positions[s:e]
                out[s:e] = self._attend(q[s:e], entries[s:e], pos, pos)
        elif ctx.decode_only or (batch_invariant.enabled() and ctx.cp is None and backend.use_triton(x)):
            meta = ctx.groups[self.group_id]
            backend.store_kv(self.kv_cache, meta.slot_mapping, entries[:, None, :])
            if ctx.decode_only:
                tables, lengths = meta.block_table, ctx.seq_lens_t                  # a row per sequence
            else:
                # Batch-invariant mode with the Triton kernels: every token, of a chunk or a
                # decode step, attends in the absorbed form as a row of its own (its sequence's
                # block-table row, length position + 1) through the kernel's unsplit config, so
                # its reduction is the same however the step is made up (graph-safe).
                tables = meta.block_table.index_select(0, ctx.token_seq)            # [T, M]
                lengths = (ctx.positions + 1).to(torch.int32)                       # [T]
            out = self._decode_absorbed(q_nope, q_pe, tables, lengths, ctx.max_seq_len)
        else:
            meta = ctx.groups[self.group_id]
            # A context-parallel share stores the whole step's latents (every rank's, in token
            # order; parallel/context.py) and attends for this rank's queries only.
            step_entries = entries if ctx.cp is None else ctx.cp.gather(entries)
            backend.store_kv(self.kv_cache, meta.slot_mapping, step_entries[:, None, :])
            for b in range(ctx.num_seqs):
                s, e = ctx.query_start_loc[b], ctx.query_start_loc[b + 1]
                if e == s:
                    continue
                length = ctx.seq_lens[b]
                ctx_entries = reference.gather_kv(self.kv_cache, meta.block_table[b], 0, length)
                q_pos = torch.arange(length - (e - s), length, device=x.device)
                k_pos = torch.arange(length, device=x.device)
                out[s:e] = self._attend(q[s:e], ctx_entries[:, 0, 0].to(x.dtype), q_pos, k_pos)
        return self.o_proj(out.reshape(t, -1))                           # [T, H]

    def _decode_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """One query row per sequence (row b: its block-table row ``block_table[b]`` and length
        ``seq_lens[b]``, a device tensor), attending over the cached latents without expanding
        them: with kv_b_proj = [W_uk; W_uv] per head, ``q_nope . (W_uk c) = (W_uk^T q_nope) . c``
        and the values' ``W_uv`` applies once to the attention-weighted latent
        (``kernels.backend.mla_decode``). Reads only device tensors, so a decode step never
        waits for the host.

        q_nope: [B, Nh, Dn]; q_pe: [B, Nh, Dr] (roped) -> [B, Nh, Dv].
        """
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]  # [Nh, Dn, R], [Nh, Dv, R]
        q_latent = torch.einsum("tnd,ndr->tnr", q_nope, w_uk)             # [B, Nh, R]
        q_abs = torch.cat((q_latent, q_pe), dim=-1)                       # [B, Nh, R+Dr]
        latent_out = backend.mla_decode(q_abs, self.kv_cache, block_table, seq_lens,
                                        self.scale, c.kv_lora_rank, max_seq_len)      # [B, Nh, R]
        return torch.einsum("tnr,nvr->tnv", latent_out, w_uv)             # [B, Nh, Dv]

    def _attend(self, q: torch.Tensor, entries: torch.Tensor, q_pos: torch.Tensor,
                k_pos: torch.Tensor) -> torch.Tensor:
        """Causal attention of q [n, Nh, Dn+Dr] over latent entries [L, R+Dr] -> [n, Nh, Dv]."""
        c = self.cfg
        length = entries.shape[0]
        latent, k_pe = entries.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)  # [L, R], [L, Dr]
        k_nope, v = self.kv_b_proj(latent).view(length, c.num_heads, -1).split(
            [c.qk_nope_head_dim, c.v_head_dim], dim=-1)                  # [L, Nh, Dn], [L, Nh, Dv]
        k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, c.num_heads, -1)), dim=-1)  # [L, Nh, Dn+Dr]
        return reference.causal_attention(q, k, v, q_pos, k_pos, self.scale)
