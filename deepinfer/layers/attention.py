"""Attention front-end shared by the paged-KV models (Llama, Qwen3, Mistral, ...).

Takes projected, rotated q/k/v for the flattened batch, stores the new K/V into
this layer's paged cache and attends over each sequence's context. The cache
tensor and group id are bound by the runner after the KV cache is allocated;
until then (or when the context has no groups) the layer attends only within
the batch, which is how models are compared against reference implementations.
Under context parallelism (``ctx.cp``) the layer gathers the step's K/V from
every rank before storing it (parallel/context.py). In a ``decode_only`` context
the cached path is CUDA-graph safe with the Triton backend: it reads only device
tensors of the context and ``max_seq_len``.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import backend, reference
from deepinfer.kv_spec import KVCacheSpec


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} must be a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_spec = KVCacheSpec(
            kind="sliding" if sliding_window else "full",
            num_kv_heads=num_kv_heads, head_size=head_dim, dtype=dtype,
            sliding_window=sliding_window)
        # Bound by the runner (runner/model_runner.py) once memory is laid out.
        self.kv_cache: torch.Tensor | None = None
        self.group_id: int | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # q: [T, Hq*D]  k, v: [T, Hkv*D]  ->  [T, Hq*D]
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not ctx.groups or self.kv_cache is None:
            out = torch.empty_like(q)
            for b in range(ctx.num_seqs):
                s, e = ctx.query_start_loc[b], ctx.query_start_loc[b + 1]
                pos = ctx.positions[s:e]
                out[s:e] = reference.causal_attention(q[s:e], k[s:e], v[s:e], pos, pos,
                                                      self.scale, self.sliding_window)
            return out.view(t, -1)
        meta = ctx.groups[self.group_id]
        if ctx.cp is None:
            backend.store_kv(self.kv_cache, meta.slot_mapping, k, v)
        else:
            # A context-parallel share: store the whole step's K/V (every rank's, in token
            # order), then attend for this rank's queries only.
            # One all-gather for both.
            k_all, v_all = ctx.cp.gather(torch.cat((k, v), dim=-1)).split(self.head_dim, dim=-1)
            backend.store_kv(self.kv_cache, meta.slot_mapping, k_all, v_all)
        if ctx.decode_only:
            # Token b is sequence b's only query: the CUDA-graph-safe path, which reads the
            # lengths on the device and sizes its work from B and ctx.max_seq_len.
            out = backend.paged_decode_attention(q, self.kv_cache, meta.block_table, ctx.seq_lens_t,
                                                 ctx.max_seq_len, self.scale, self.sliding_window)
        else:
            out = backend.paged_attention(q, self.kv_cache, meta.block_table, ctx.query_start_loc,
                                          ctx.seq_lens, self.scale, self.sliding_window)
        return out.view(t, -1)
