"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4 paper section 2.2).

The residual stream is ``n = hc_mult`` parallel streams [T, n, D]. Around each
block one :class:`HyperConnection` computes, from the (RMS-normalised,
flattened) streams, three mixings with a one-layer perceptron:

- ``pre``  [T, n]:    collapses the streams into the block input, ``x = sum_j pre_j s_j``;
- ``post`` [T, n]:    spreads the block output back over the streams;
- ``comb`` [T, n, n]: mixes the input streams into the output streams,
  projected to a doubly-stochastic matrix by Sinkhorn-Knopp iterations,

so that ``s'_k = post_k * block(x) + sum_j comb[j, k] * s_j``. The model's
final :class:`HyperHead` collapses the streams once more (sigmoid weights, no
mixing). All mixing runs in float32, as in the reference.

Shapes: T tokens, n streams, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.deepseek_v4_common import rms_unweighted


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        if sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters={sinkhorn_iters} must be >= 1")
        n = hc_mult
        self.hc_mult = n
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        # Rows: n pre weights, n post weights, n*n comb weights.
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))   # pre, post, comb

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # streams: [T, n, D] -> (block input [T, D], post [T, n], comb [T, n, n]); post/comb float32
        n = self.hc_mult
        flat = rms_unweighted(streams.flatten(1).float(), self.norm_eps)     # [T, n*D]
        mixes = F.linear(flat, self.fn)                                       # [T, (2+n)*n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps              # [T, n]
        post = 2 * torch.sigmoid(post_w * post_s + post_b)                    # [T, n]
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns first, then (rows, columns) until iters normalisations are done.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)   # [T, D]
        return collapsed, post, comb

    @staticmethod
    def expand(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor) -> torch.Tensor:
        """New streams ``post_k * block_out + sum_j comb[j, k] * streams_j``.

        block_out: [T, D]; streams: [T, n, D]; post: [T, n]; comb: [T, n, n] -> [T, n, D].
        """
        out = post.unsqueeze(-1) * block_out.float().unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), streams.float())
        return out.to(streams.dtype)


class HyperHead(nn.Module):
    """Final collapse of the streams: ``sum_j (sigmoid(mix_j) + eps) s_j``."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        # streams: [T, n, D] -> [T, D]
        flat = rms_unweighted(streams.flatten(1).float(), self.norm_eps)     # [T, n*D]
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
