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
mixing). All mixing runs in float32, as in the reference. The math lives in
``kernels/reference.py`` (``hc_pre``, ``hc_post``, ``hc_head``) and, fused, in
``kernels/hyper_connection.py``; ``kernels/backend.py`` picks one per call.

The block input is read only by the block's input RMSNorm, so the connection takes
that norm's (weight, eps) and returns the normalised input: the kernel then never
writes the raw input to memory (one pass over [T, D] and a launch fewer). The norm
keeps its own module and parameter (checkpoint names unchanged); the caller passes
them in.

Shapes: T tokens, n streams, D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import backend


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
        # (group, pow2_scale) of the FP8 linears that read the normalised block input, set after
        # load (``note_fp8_inputs``): the collapse launch then quantises it for them.
        self.fp8_out: tuple[int, bool] | None = None

    def forward(self, streams: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, n, D] -> (block input [T, D], post [T, n], comb [T, n, n]); post/comb
        float32. ``norm`` (weight [D] float32, eps): the block input comes back normalised
        (``rms_norm(x, weight, eps, round_first=False)``, DeepSeek-V4's RMSNorm)."""
        return backend.hc_pre(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.hc_eps,
                              self.norm_eps, norm, fp8=self.fp8_out if norm is not None else None)

    def lagged(self, streams: torch.Tensor, pre_in: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek-V4.1's lagged connection: the block input collapses the streams with the
        previous sublayer's ``pre_in`` [T, n] float32 (normalised by ``norm`` as in
        :meth:`forward`), and this connection's own pre comes back for the next sublayer ->
        (block input [T, D], pre [T, n], post [T, n], comb [T, n, n])."""
        return backend.hc_pre_lagged(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.hc_eps,
                                     self.norm_eps, pre_in, norm, fp8=self.fp8_out if norm is not None else None)

    @staticmethod
    def expand(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor) -> torch.Tensor:
        """New streams ``post_k * block_out + sum_j comb[j, k] * streams_j``.

        block_out: [T, D]; streams: [T, n, D]; post: [T, n]; comb: [T, n, n] -> [T, n, D].
        """
        return backend.hc_post(block_out, streams, post, comb)


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
        return backend.hc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.hc_eps, self.norm_eps)
