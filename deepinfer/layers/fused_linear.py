"""Several bias-free projections of the same input as one GEMM.

At batch 1 a decode step is bound by kernel launches, not bytes: a layer that runs
seven small GEMVs on one input pays seven launches. :class:`FusedProjection` keeps
the projections as the separate ``nn.Linear`` modules the checkpoint names (module
tree, parameter names and ``state_dict`` unchanged) and, once :meth:`fuse` has run,
computes them as ``F.linear(x, W)`` with ``W = cat(W_1, ..., W_n)`` [sum_out, in],
returning the pieces as column views of the one output.

Contract:

- Before :meth:`fuse` (a model built and filled through ``load_state_dict`` or
  ``load_weights`` without the loader's ``after_load`` hook) every call computes the
  projections one by one: correct, only slower. Fusion is never implicit.
- :meth:`fuse` copies the weights into one new buffer and points each piece's
  parameter at its rows of it (``param.data`` = a view; the Parameter objects stay),
  so the weights are stored once. In-place writes to a piece (``copy_``,
  ``load_state_dict``, ``load_weights``, random fills) write into the fused buffer
  and are seen by the next call.
- A piece whose storage was replaced after :meth:`fuse` (``module.weight = ...``,
  ``param.data = ...``, ``model.to(other dtype or device)``) would make the fused
  buffer stale: every call checks the pieces' addresses (host-side, no device sync)
  and raises, asking for :meth:`fuse` again.

Numerics: each output column is the same dot product over ``in`` as in its own
projection; the GEMM library may still block the reduction differently for a wider
output, so bf16 results can differ from the unfused ones by rounding.

Shapes: T tokens, K input width, N_i output width of piece i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class FusedProjection:
    """The projections ``linears`` (bias-free ``nn.Linear`` over the same input width),
    computed unfused until :meth:`fuse`, then as one GEMM. Not an ``nn.Module``: the
    linears stay registered where they are, under their own names."""

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        if not linears:
            raise ValueError("FusedProjection needs at least one projection")
        widths = {lin.in_features for lin in linears}
        if len(widths) != 1:
            raise ValueError(f"FusedProjection: the projections read inputs of different widths {widths}")
        if any(lin.bias is not None for lin in linears):
            raise NotImplementedError("FusedProjection: projections with a bias are not supported")
        self.linears = tuple(linears)
        self.sizes = [lin.out_features for lin in linears]
        self.weight: torch.Tensor | None = None          # [sum N_i, K] once fused
        self._addresses: tuple[int, ...] = ()

    @property
    def fused(self) -> bool:
        return self.weight is not None

    @torch.no_grad()
    def fuse(self) -> None:
        """Copy the pieces into one buffer [sum N_i, K] and make each piece's parameter a
        view of its rows. Running it again re-fuses from the pieces' current values."""
        pieces = [lin.weight for lin in self.linears]
        kinds = {(w.dtype, w.device) for w in pieces}
        if len(kinds) != 1:
            raise ValueError(f"FusedProjection: the projections' weights differ in dtype/device: {kinds}")
        weight = torch.cat([w.detach() for w in pieces], dim=0)                  # [sum N_i, K]
        for param, rows in zip(pieces, weight.split(self.sizes, dim=0)):
            param.data = rows
        self.weight = weight
        self._addresses = tuple(w.data_ptr() for w in pieces)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x: [T, K] -> n pieces [T, N_i] (column views of one [T, sum N_i] output once fused)
        if self.weight is None:
            return tuple(lin(x) for lin in self.linears)
        current = tuple(lin.weight.data_ptr() for lin in self.linears)
        if current != self._addresses:
            stale = [i for i, (a, b) in enumerate(zip(current, self._addresses)) if a != b]
            raise RuntimeError(f"FusedProjection: the weight of projection(s) {stale} (out widths "
                               f"{[self.sizes[i] for i in stale]}) was replaced after fuse(), so the "
                               "fused buffer is stale; call fuse_projections() again")
        return F.linear(x, self.weight).split(self.sizes, dim=-1)
